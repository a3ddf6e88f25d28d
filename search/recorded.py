"""A trial without Optuna: the `Pruned` signal an evaluation raises, and `RecordedTrial`, the stand-in a pool worker evaluates on.

A pool worker (search/pool.py) gets a trial's number and the parameters its parent's sampler drew;
it needs no sampler, storage or study, so it does not import Optuna (~80 ms of CPU per worker
start, issue #31). The parent records what the stand-in recorded on the real trial.
"""

from __future__ import annotations

from typing import Any, Callable


class Pruned(Exception):
    """The trial stops without a value: pruned at a checkpoint, or infeasible settings. The Optuna loop
    (search/study.py ``run_worker``) turns it into ``optuna.TrialPruned``; the batch runner tells the trial pruned."""


class RecordedTrial:
    """A worker's stand-in for the parent's trial: ``suggest_*`` return the parameters the parent drew; user
    attributes, constraints and reports are recorded; ``should_prune`` asks ``prune(number, reports)``.

    The part of Optuna's trial API the Evaluator (search/objective.py) and `suggest` (search/space.py) use.
    """

    def __init__(self, params: dict[str, Any], number: int, prune: Callable[[int, dict[int, float]], bool] | None):
        self._params = dict(params)
        self._suggested: dict[str, Any] = {}  # in the order asked: `params`, as Optuna's FixedTrial gives it
        self.number = number
        self.user_attrs: dict[str, Any] = {}
        self.intermediate: dict[int, float] = {}
        self.recorded_constraints: dict[str, float] = {}
        self._prune = prune

    @property
    def params(self) -> dict[str, Any]:
        """The parameters suggested so far (after `suggest`: all the parent drew)."""
        return self._suggested

    def _drawn(self, name: str) -> Any:
        try:
            value = self._params[name]
        except KeyError:
            raise ValueError(f"trial {self.number}: parameter {name!r} was not drawn by the sampler") from None
        self._suggested[name] = value
        return value

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return int(self._drawn(name))

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:  # fmt: skip
        return self._drawn(name)

    def suggest_categorical(self, name: str, choices) -> Any:
        return self._drawn(name)

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value

    def report(self, value: float, step: int) -> None:
        self.intermediate[int(step)] = float(value)

    def should_prune(self) -> bool:
        return bool(self._prune(self.number, dict(self.intermediate))) if self._prune is not None else False

    def set_constraint(self, name: str, value: float) -> None:  # (the Evaluator's form on Optuna >= 5.1)
        self.recorded_constraints[name] = float(value)


__all__ = ["Pruned", "RecordedTrial"]
