"""The policy seam: a small protocol, a base class with the defaults, and the registry by name.

A policy sees one replica's state at an iteration boundary and returns an immutable `Batch`; it
never calls the runner and never mutates the replica (the engine applies the decision). A new
policy is one file: a class with ``Params`` (a frozen dataclass) registered with ``@POLICIES.register``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from servelab.common.registry import Registry
from servelab.replay.batch import Batch, BatchBuilder
from servelab.replay.config import EngineConfig, make_params
from servelab.replay.replica import Replica
from servelab.replay.request import Request


class Policy(Protocol):
    name: ClassVar[str]

    def schedule(self, replica: Replica) -> Batch:
        """Choose the next iteration's batch (and any preemptions)."""

    def on_arrival(self, req: Request, replica: Replica) -> None:
        """A request joined ``replica``'s waiting queue."""

    def on_leave(self, req: Request, replica: Replica) -> None:
        """A request left ``replica`` without the policy's decision (dropped, paused, failure)."""

    def on_requeue(self, req: Request, replica: Replica) -> None:
        """A running request was preempted back into ``replica``'s waiting queue (state already updated)."""

    def reject_reason(self, req: Request) -> str | None:
        """Why this request can never be served under this policy, or None."""

    def victim_key(self, req: Request) -> Any:
        """Preemption order: the running request with the largest key is preempted first."""


@dataclass(frozen=True, slots=True)
class NoParams:
    pass


class PolicyBase:
    """Defaults: FCFS victims (most recently admitted first), no rejection, no arrival bookkeeping."""

    name: ClassVar[str] = "?"
    Params: ClassVar[type] = NoParams
    uses_token_budget: ClassVar[bool] = True  # False: max_num_batched_tokens does not apply (orca, static)
    # True: the policy reads running requests only through ``schedule_running(replica.running,
    # decodes_first=True)`` and ignores ``on_step``'s items, so the engine may keep the replica's
    # decoding requests as one aggregate whose members' counters are materialised lazily (replay/cohort.py).
    decode_cohort: ClassVar[bool] = False

    def __init__(self, params: Any, engine: EngineConfig, replica_id: int = 0):
        self.params = params
        self.engine = engine
        self.replica_id = replica_id

    def on_arrival(self, req: Request, replica: Replica) -> None:
        pass

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        pass

    def on_leave(self, req: Request, replica: Replica) -> None:
        """``req`` left ``replica`` without this policy's decision (dropped, paused, replica failure)."""

    def on_requeue(self, req: Request, replica: Replica) -> None:
        """``req`` was preempted back into ``replica``'s waiting queue (its counters already updated)."""

    def reject_reason(self, req: Request) -> str | None:
        return None

    def victim_key(self, req: Request) -> Any:
        return req.admitted_seq

    def builder(self, replica: Replica, token_budget: int | None = None, seq_budget: int | None = None) -> BatchBuilder:
        return BatchBuilder(replica, self.victim_key, token_budget, seq_budget)


POLICIES: Registry[type[PolicyBase]] = Registry("policy")


def _load_builtin() -> None:
    # Importing registers them; each is one small file.
    from servelab.policies import builtin  # noqa: F401


def policy_class(name: str) -> type[PolicyBase]:
    _load_builtin()
    return POLICIES.get(name)


def make_policy(name: str, raw_params: dict[str, Any], engine: EngineConfig, replica_id: int = 0) -> PolicyBase:
    cls = policy_class(name)
    params = make_params(cls.Params, raw_params, f"policy '{name}'")
    return cls(params, engine, replica_id)


def policy_names() -> list[str]:
    _load_builtin()
    return POLICIES.names()
