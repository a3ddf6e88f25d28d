"""A local study in batches: ask the sampler for BATCH_TRIALS trials, evaluate them on the workers at once, tell the results in trial order.

The sampler of trial k sees the trials told before its batch, and no others: the same history
whatever the number of workers, so a seeded study gives the same trials on a 1-core and a 16-core
machine (tests/test_search_parallel.py). A trial goes to a worker as soon as its parameters are
drawn, so sampling the next trial overlaps the replays in flight. BATCH_TRIALS is a constant, not
the number of workers: it is part of what a seed means (docs/search.md, "Parallel trials").
Used for studies in a local journal; a database storage keeps independent workers
(search/study.py `run_worker`), since other machines join it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import shutil
import time
from pathlib import Path

from servelab.common.errors import ServelabError
from servelab.search.objective import prepare_trace, trial_dir, worker_id
from servelab.search.pool import InProcess, Outcome, Pool, WorkerDied, fail_running
from servelab.search.signals import Interrupt
from servelab.search.spec import SearchSpec
from servelab.search.storage import batched_writes
from servelab.search.trials import counts

BATCH_TRIALS = 4
MAX_ERRORS_IN_A_ROW = 5


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores() -> int:
    """Usable cores less the machine's 1-minute load average (rounded), at least 1."""
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, usable_cores() - math.floor(busy + 0.5))


def auto_workers(spec: SearchSpec) -> int:
    """``workers = "auto"`` (the default): one per free core, at most BATCH_TRIALS (a batch's trials) and n_trials."""
    return max(1, min(free_cores(), BATCH_TRIALS, spec.n_trials))


def resolve_workers(spec: SearchSpec) -> int:
    """The worker processes a local study runs: ``spec.workers``, or auto; never more than a batch's trials."""
    return auto_workers(spec) if spec.workers is None else min(spec.workers, BATCH_TRIALS)


def run_batches(study, spec: SearchSpec, study_dir: Path, workers: int, limit: int, progress=None,
                interrupt: Interrupt | None = None, prepared: tuple[Path, dict] | None = None) -> None:  # fmt: skip
    """Evaluate trials in batches until the study has ``limit`` finished ones (or ``spec.timeout_s`` passes).

    Ctrl-C (``interrupt``) stops after the trials in hand are recorded: finished ones are told,
    the rest failed as ``interrupted``; then KeyboardInterrupt is raised. A worker that dies
    raises ServelabError once the batch's finished trials are told. ``prepared``: the trace as
    `prepare_trace` left it (path, metadata), for the evaluators to read instead of preparing it again
    (else the Evaluator prepares it, or with several workers this process: before forking them, or once
    spawned ones are started).
    """
    with _frozen_before_trials():
        _run_batches(study, spec, study_dir, workers, limit, progress, interrupt, prepared)


@contextlib.contextmanager
def _frozen_before_trials():
    """The objects that exist when the trials begin (modules, classes, the study, the sampler) left out of the
    cyclic collector's full collections until they end (`gc.freeze`), then handed back (`gc.unfreeze`).

    They live for the whole study, yet a full collection walks every one of them: the first one after the
    imports of a `search` process (~45,000 objects: Optuna, numpy, pyarrow) came during the trials, 15-30 ms
    of CPU, >1 ms a trial of a 20-trial study (bench/RESULTS.md, Session 26). Collections still run, over
    what the trials make. A caller that froze objects itself keeps them frozen (nothing is unfrozen here)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_batches(study, spec: SearchSpec, study_dir: Path, workers: int, limit: int, progress,
                 interrupt: Interrupt | None, prepared: tuple[Path, dict] | None) -> None:  # fmt: skip
    own_interrupt = interrupt is None
    interrupt = (interrupt or Interrupt()).install()
    owner = worker_id()
    runner = None
    started = time.monotonic()
    errors: list[str] = []
    try:
        if interrupt.is_set():
            raise KeyboardInterrupt
        if workers == 1:
            runner = InProcess(spec, study_dir, interrupt, prepared)
        else:
            from servelab.search import pool

            if prepared is None and pool.START_METHOD == "fork":
                # prepared before the fork: the workers inherit what preparing it set up (the first Arrow kernel
                # call, zstd, their imports) instead of each paying for it in its first trial (~30 ms of CPU a
                # worker); the first trial waits for the trace either way (bench/RESULTS.md, Session 25)
                prepared = prepare_trace(spec, study_dir)[1:]
            # (spawned workers start first: they import what a trial runs while this process prepares the trace)
            runner = Pool(spec, study_dir, workers, owner, interrupt, prepared)
            if prepared is None:
                _, path, meta = prepare_trace(spec, study_dir)
                runner.trace((path, meta))
        # Optuna's own loop flag: samplers may call study.stop() when told a result (the grid sampler, its grid
        # covered), which Optuna refuses outside an optimize loop; here it ends the study after the batch
        study._thread_local.in_optimize_loop = True
        study._stop_flag = False
        while not study._stop_flag:
            need = limit - counts(study)["finished"]
            if need <= 0 or len(errors) >= MAX_ERRORS_IN_A_ROW or _grid_covered(study):
                break
            if spec.timeout_s is not None and time.monotonic() - started >= spec.timeout_s:
                break
            # (fewer when errors are piling up: the study stops at the fifth in a row, as a sequential one)
            size = min(BATCH_TRIALS, need, MAX_ERRORS_IN_A_ROW - len(errors))
            _one_batch(study, spec, study_dir, runner, owner, size, interrupt, errors)
            if progress is not None:
                progress(study)
            if interrupt.is_set():
                raise KeyboardInterrupt
        if len(errors) >= MAX_ERRORS_IN_A_ROW:
            raise ServelabError(f"{MAX_ERRORS_IN_A_ROW} trials in a row failed; the last: {errors[-1]}")
    finally:
        study._thread_local.in_optimize_loop = False
        if runner is not None:
            runner.close()
        if own_interrupt:
            interrupt.restore()


def _one_batch(study, spec, study_dir, runner, owner: str, size: int, interrupt: Interrupt, errors: list[str]) -> None:
    from servelab.search.space import suggest

    trials: dict[int, object] = {}  # number -> the real trial, in ask order
    reported: dict[int, set[int]] = {}

    def prune(number: int, reports: dict[int, float]) -> bool:
        trial = trials[number]
        for step, value in sorted(reports.items()):
            if step not in reported[number]:
                trial.report(value, step)
                reported[number].add(step)
        return trial.should_prune()

    runner.prune = prune
    outcomes: dict[int, Outcome] = {}
    stop: BaseException | None = None
    try:
        for _ in range(size):
            if interrupt.is_set() or _grid_covered(study):
                break
            with batched_writes(study):  # its creation, owner and parameters: one append
                trial = study.ask()
                trials[trial.number] = trial
                reported[trial.number] = set()
                trial.set_user_attr("worker", owner)  # the owner until told: a stale-trial check asks if it lives
                if not interrupt.is_set():  # (Ctrl-C during Optuna's ask: this trial never starts)
                    suggest(trial, spec.space, spec.base)
            if interrupt.is_set():
                break
            runner.submit(trial.number, dict(trial.params))
        outcomes.update(runner.collect([n for n in trials if n not in outcomes]))
    except (KeyboardInterrupt, ServelabError) as err:
        stop = err
        if not isinstance(err, KeyboardInterrupt):
            interrupt.event.set()  # a worker died: the study stops
        outcomes.update(runner.finished())  # what came back before the stop
    with batched_writes(study):  # the batch's results: one append
        _tell_all(study, study_dir, trials, outcomes, reported, stop, errors)
    if stop is not None:
        raise stop
    if interrupt.is_set():
        raise KeyboardInterrupt


def _grid_covered(study) -> bool:
    """A grid whose every point is done, running or failed in this run: another trial would repeat a point."""
    is_exhausted = getattr(study.sampler, "is_exhausted", None)
    return is_exhausted is not None and is_exhausted(study)


def _tell_all(study, study_dir: Path, trials: dict, outcomes: dict[int, Outcome], reported: dict[int, set[int]],
              stop: BaseException | None, errors: list[str]) -> None:  # fmt: skip
    """Record each trial's outcome and tell it, in trial order; trials without one failed (interrupted, or the dead worker's)."""
    from optuna.trial import TrialState

    lost = stop.number if isinstance(stop, WorkerDied) else None  # the dead worker's trial
    for number, trial in trials.items():  # in trial order
        outcome = outcomes.get(number)
        if outcome is None or outcome.state == "interrupted":
            shutil.rmtree(trial_dir(study_dir, number), ignore_errors=True)
            if number == lost:
                trial.set_user_attr("outcome", "error")
                trial.set_user_attr("reason", f"error: {stop}")
            else:
                trial.set_user_attr("outcome", "interrupted")
                trial.set_user_attr("reason", "interrupted (Ctrl-C)" if isinstance(stop, KeyboardInterrupt) or stop is None
                                    else "interrupted (the study stopped: a worker died)")  # fmt: skip
            study.tell(trial, state=TrialState.FAIL)
            continue
        _tell(study, trial, outcome, reported[number], errors)


def _tell(study, trial, outcome: Outcome, reported: set[int], errors: list[str]) -> None:
    from optuna.trial import TrialState

    for key, value in outcome.user_attrs.items():
        trial.set_user_attr(key, value)
    for name, value in outcome.constraints.items():
        trial.set_constraint(name, value)
    for step, value in sorted(outcome.intermediate.items()):
        if step not in reported:
            trial.report(value, step)
    if outcome.state == "complete":
        study.tell(trial, outcome.values[0] if len(outcome.values) == 1 else outcome.values)
        errors.clear()
    elif outcome.state == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
        errors.clear()
    else:
        reason = outcome.user_attrs.get("reason", "?")
        logging.getLogger("optuna").warning(f"Trial {trial.number} failed: {reason}")
        study.tell(trial, state=TrialState.FAIL)
        if outcome.user_attrs.get("outcome") == "error":
            errors.append(reason)


__all__ = ["BATCH_TRIALS", "auto_workers", "free_cores", "resolve_workers", "run_batches", "usable_cores", "fail_running"]
