"""Evaluate a batch's trials: in this process, or in worker processes that each hold an Evaluator and send back what a trial recorded.

On Linux the workers are forked from the `search` process: a worker starts on what it has imported
(numpy, pyarrow, Optuna's dependencies, the spec's classes), where a spawned one spent ~0.6 s of CPU
importing them again before its first trial, on the batches' critical path (with 2 workers on 2 cores
that start-up cost about half of the gain on a 20-trial study; bench/RESULTS.md, Session 18). Elsewhere (macOS,
where fork is unsafe) they are spawned. The `search` process prepares the trace and imports what a trial
runs (`preload`) before it forks them, once for all (a worker forked before the trace was prepared paid
~30 ms of CPU more in its first trial: the first Arrow kernel call, zstd; Session 25); a spawned worker
imports it while the parent prepares the trace. Either maps the file the parent sends.
A forked worker keeps only its own pipe and writes through fresh standard streams (`_forked`).

A worker never touches the study's storage while its parent lives: it gets a trial's number and the
parameters the parent's sampler drew, runs the trial through the same Evaluator as a one-process
search (config, replay, run directory, scores) on a stand-in trial (`RecordedTrial`, search/recorded.py:
a spawned worker never imports Optuna; a forked one has it in memory, unused), and sends back an
`Outcome`: the state, values, user attributes, constraint and intermediate values that the parent
then records on the real trial. A pruner's question ("prune at this checkpoint?") goes to
the parent, which asks the real trial.

A worker's parent dying (kill -9) is noticed by `signals._ParentWatch` (the kernel's parent-death
signal, and a poll): the worker fails its trial in flight as interrupted, and worker 0 marks the
dead parent's running trials interrupted and writes trials.parquet, which the parent cannot.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

from servelab.common.errors import ServelabError
from servelab.search.recorded import Pruned, RecordedTrial
from servelab.search.signals import Interrupt, _ParentWatch
from servelab.search.spec import SearchSpec

# How pool workers start: "fork" (Linux) or "spawn". When `servelab search` forks, its only Python thread
# besides the main one is the progress bar's (`_forked` gives the worker fresh standard streams, whose locks
# that thread may hold); its native threads are OpenBLAS's (numpy), pyarrow's thread pools and jemalloc's
# background thread, which those libraries rebuild in a forked child (their at-fork handlers; Arrow's pools
# check the pid). DuckDB is not loaded yet: the workers open their own. (Python 3.12+ warns of any fork of a
# process with threads, a DeprecationWarning shown only under -W or pytest: these are the threads it means.)
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


class WorkerDied(ServelabError):
    """A worker process ended without being asked to (killed, crashed): ``number`` is the trial it had, if any."""

    def __init__(self, message: str, number: int | None):
        super().__init__(message)
        self.number = number


@dataclass
class Outcome:
    """What one trial's evaluation recorded, for the parent to apply to the real trial and tell."""

    number: int
    state: str  # "complete", "pruned", "fail" (an error) or "interrupted"
    values: list[float] | None = None
    user_attrs: dict[str, Any] = field(default_factory=dict)
    constraints: dict[str, float] = field(default_factory=dict)
    intermediate: dict[int, float] = field(default_factory=dict)


def evaluate(evaluator, number: int, params: dict[str, Any], prune=None) -> Outcome:
    """Run trial ``number`` with ``params`` through ``evaluator`` (search/objective.py) on a `RecordedTrial`."""
    trial = RecordedTrial(params, number, prune)
    try:
        value = evaluator(trial)
        state, values = "complete", list(value) if isinstance(value, tuple) else [value]
    except Pruned:
        state, values = "pruned", None
    except KeyboardInterrupt:
        state, values = "interrupted", None
    except Exception as err:  # the Evaluator recorded outcome "error" and its reason
        state, values = "fail", None
        trial.user_attrs.setdefault("reason", f"error: {type(err).__name__}: {err}")
    return Outcome(number, state, values, dict(trial.user_attrs), trial.recorded_constraints, trial.intermediate)


class InProcess:
    """One worker: the trials run in this process, each as soon as it is submitted."""

    workers = 1

    def __init__(self, spec: SearchSpec, study_dir: Path, interrupt: Interrupt,
                 prepared: tuple[Path, dict] | None = None):  # fmt: skip
        from servelab.search.objective import Evaluator

        self.evaluator = Evaluator(spec, study_dir, prepared=prepared)
        self.evaluator.interrupted = interrupt.event
        interrupt.evaluator = self.evaluator  # Ctrl-C raises only while its replay and scoring run
        self._done: list[Outcome] = []
        self.prune = None  # set by the batch loop: (number, reports) -> bool

    def submit(self, number: int, params: dict[str, Any]) -> None:
        self._done.append(evaluate(self.evaluator, number, params, self.prune))

    def collect(self, numbers: list[int]) -> dict[int, Outcome]:
        return self.finished()

    def finished(self) -> dict[int, Outcome]:
        """The outcomes received and not yet collected."""
        done, self._done = {o.number: o for o in self._done}, []
        return done

    def close(self) -> None:
        self.evaluator.close()


class Pool:
    """``n`` worker processes; a trial goes to an idle one, or waits for one.

    The workers start at once (forked, they have what a trial runs imported already, the trace prepared by
    the caller; spawned, they import it while this process prepares the trace); each builds its Evaluator
    when `trace` hands it the prepared file.
    """

    def __init__(self, spec: SearchSpec, study_dir: Path, n: int, owner: str, interrupt: Interrupt,
                 prepared: tuple[Path, dict] | None = None, start_method: str | None = None):  # fmt: skip
        """``prepared``: the trace the parent prepared (`prepare_trace`'s path and metadata), which each worker maps
        (else call `trace` once it is); ``start_method``: "fork" or "spawn" (default START_METHOD)."""
        method = start_method or START_METHOD
        ctx = multiprocessing.get_context(method)
        if method == "fork":
            # imported once, here, for all of them: when the workers imported it themselves while this process
            # imported the same modules to prepare the trace, the three took ~0.5 s on 2 cores, not ~0.2 s
            preload(spec)
        self.workers = n
        self.interrupt = interrupt
        self.in_trial = False  # True while waiting on the workers: Ctrl-C may raise there (signals.Interrupt)
        self.prune = None
        self._conns, self._procs = [], []
        # Workers start with Ctrl-C ignored (inherited) until they install their own handler
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for i in range(n):
                parent_end, child_end = ctx.Pipe()
                # a forked worker closes the parent's ends it inherited (its own, the earlier workers'): while it
                # held one, that worker's pipe would never read EOF when the parent dies
                inherited = (*self._conns, parent_end) if method == "fork" else ()
                proc = ctx.Process(target=_worker_main, name=f"servelab-search-{i}",
                                   args=(child_end, spec, str(study_dir), os.getpid(), owner, i, inherited))  # fmt: skip
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        self._busy: dict[int, int] = {}  # worker index -> trial number
        self._queue: list[tuple[int, dict[str, Any]]] = []
        self._done: dict[int, Outcome] = {}
        interrupt.evaluator = self
        if prepared is not None:
            self.trace(prepared)

    def trace(self, prepared: tuple[Path, dict]) -> None:
        """Hand the workers the trace the parent prepared (`prepare_trace`'s path and metadata): they map it."""
        for conn in self._conns:
            try:
                conn.send(("trace", prepared))
            except OSError:
                pass  # a worker that failed to start (its error is waiting in the pipe) or died: the next poll says so

    def submit(self, number: int, params: dict[str, Any]) -> None:
        self._queue.append((number, params))
        self._dispatch()
        self._poll(0)  # answer a pruner's question, take a finished trial, without waiting

    def collect(self, numbers: list[int]) -> dict[int, Outcome]:
        """Wait until each of ``numbers`` has its outcome; raises ServelabError when a worker died."""
        while any(n not in self._done for n in numbers):
            self.in_trial = True
            try:
                if self.interrupt.is_set():
                    raise KeyboardInterrupt
                self._poll(None)
            finally:
                self.in_trial = False
        return {n: self._done.pop(n) for n in numbers}

    def finished(self) -> dict[int, Outcome]:
        """The outcomes received and not yet collected (after a stop: what came back before it)."""
        done, self._done = self._done, {}
        return done

    def _dispatch(self) -> None:
        for i in range(len(self._procs)):
            if not self._queue:
                return
            if i not in self._busy:
                number, params = self._queue.pop(0)
                self._conns[i].send(("trial", number, params))
                self._busy[i] = number

    def _poll(self, timeout: float | None) -> None:
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        ready = wait([*self._conns, *sentinels], timeout)
        for obj in ready:
            if obj in sentinels:
                continue  # a dead worker: its pipe reads EOF below (a message it sent first is read first)
            i = self._conns.index(obj)
            try:
                message = obj.recv()
            except (EOFError, OSError):
                self._died(i)
            if message[0] == "done":
                outcome = message[1]
                self._done[outcome.number] = outcome
                self._busy.pop(i, None)
            elif message[0] == "prune":
                obj.send(("prune", self.prune(message[1], message[2]) if self.prune else False))
            elif message[0] == "error":
                raise ServelabError(f"search worker {i} (pid {self._procs[i].pid}) failed: {message[1]}")
        self._dispatch()

    def _died(self, i: int) -> None:
        proc = self._procs[i]
        proc.join(1.0)
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        number = self._busy.get(i)
        during = f" while evaluating trial {number}" if number is not None else ""
        raise WorkerDied(f"search worker {i} (pid {proc.pid}) {how}{during}; the study stops "
                         "(its finished trials are kept: run the same command to continue)", number)  # fmt: skip

    def running(self) -> list[int]:
        return [*self._busy.values(), *(n for n, _ in self._queue)]

    def close(self, wait_s: float = 3.0, grace_s: float = 30.0) -> None:
        """Stop the workers: a clean stop between trials; SIGTERM (a trial in flight fails as interrupted), then kill."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self.interrupt.evaluator = None


def preload(spec: SearchSpec) -> None:
    """Import what a worker's trials run: the Evaluator's scorer, the replay, the run writer and the plug-ins
    the base and the space name."""
    import servelab.assembly  # noqa: F401
    import servelab.search.scorer  # noqa: F401
    import servelab.search.space  # noqa: F401
    from servelab.replay import write_run  # noqa: F401
    from servelab.replay.core.plugins import POLICIES, ROUTERS
    from servelab.runners.base import RUNNERS, runner_spec

    base = spec.base
    named = {"policy": {base.policy}, "router": {base.engine.router}, "runner": {base.runner}}
    for p in spec.space:
        if p.key in named and not p.is_policy_param:
            named[p.key].update(p.choices or ())
    for registry, key in ((POLICIES, "policy"), (ROUTERS, "router"), (RUNNERS, "runner")):
        for name in named[key]:
            try:
                registry.get(runner_spec(name).name if key == "runner" else name)
            except ServelabError:
                pass  # a name that does not resolve is the trial's to report (infeasible), not the worker's start


def _forked(inherited) -> None:
    """In a forked worker: close the parent's pipe ends it inherited, and write through fresh standard streams.

    A thread of the parent (a progress bar refreshing) may have held a stream's lock at the fork; the
    worker's copy of that lock stays held, so its first write, or the flush at its exit, would wait forever.
    """
    for conn in inherited:
        conn.close()
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            setattr(sys, name, open(fd, "w", buffering=1, errors="backslashreplace", closefd=False))
        except OSError:  # (no such descriptor: a daemon's)
            setattr(sys, name, None)


def _worker_main(conn, spec: SearchSpec, study_dir: str, parent_pid: int, owner: str, index: int,
                 inherited=()) -> None:  # fmt: skip
    """A pool worker: import what trials run, map the trace once the parent sends it, then evaluate the trials
    it sends until it says stop or goes away."""
    if inherited:
        _forked(inherited)

    # Ctrl-C reaches the workers too (one process group), and SIGTERM comes from the parent stopping
    # them: both fail the trial in flight as interrupted. So does the parent's death (_ParentWatch).
    interrupt = Interrupt().install((signal.SIGINT, signal.SIGTERM))
    watch = _ParentWatch(parent_pid, interrupt)
    evaluator = None
    try:
        evaluator = _start(conn, spec, Path(study_dir))
        if evaluator is None:
            return
        evaluator.interrupted = interrupt.event
        interrupt.evaluator = evaluator

        def prune(number: int, reports: dict[int, float]) -> bool:
            conn.send(("prune", number, reports))
            return conn.recv()[1]

        while not interrupt.is_set():
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if message[0] != "trial":
                break
            outcome = evaluate(evaluator, message[1], message[2], prune)
            try:
                conn.send(("done", outcome))
            except OSError:
                break
    except (KeyboardInterrupt, EOFError, OSError):
        pass  # a signal or the parent's death between trials (or in a pruner's question)
    finally:
        interrupt.evaluator = None
        if evaluator is not None:
            evaluator.close()
        if watch.gone() and index == 0:
            _record_orphaned(spec, Path(study_dir), owner)
        watch.close()
        interrupt.restore()


def _start(conn, spec: SearchSpec, study_dir: Path):
    """A worker's start: import what trials run (before its first trial: each is timed alike), then wait for the
    parent's prepared trace and build the Evaluator on it; None when stopped first, or failed (said to the parent)."""
    from servelab.search.objective import Evaluator

    try:
        preload(spec)
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return None
    message = conn.recv()  # (EOFError: the parent is gone)
    if message[0] != "trace":
        return None  # stopped before the trace was ready
    try:
        return Evaluator(spec, study_dir, threads=1, prepared=message[1])
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return None


def _record_orphaned(spec: SearchSpec, study_dir: Path, owner: str) -> None:
    """The `search` process died (kill -9): fail its running trials as interrupted and write trials.parquet for it."""
    from servelab.search.storage import make_storage
    from servelab.search.trials import write_trials, write_trials_retrying

    import optuna

    def write() -> None:
        study = optuna.load_study(study_name=spec.study_name, storage=make_storage(spec, study_dir))
        fail_running(study, owner, "interrupted", "interrupted (the search process died)")
        write_trials(study, study_dir)

    write_trials_retrying(write)


def fail_running(study, worker: str, outcome: str, reason: str) -> list[int]:
    """Mark the RUNNING trials that ``worker`` (a worker id) owns as failed with ``outcome``; returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("worker") == worker:
            try:
                study._storage.set_trial_user_attr(t._trial_id, "outcome", outcome)
                study._storage.set_trial_user_attr(t._trial_id, "reason", reason)
                study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
                failed.append(t.number)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
    return failed


__all__ = ["START_METHOD", "WorkerDied", "Outcome", "evaluate", "InProcess", "Pool", "fail_running", "preload"]
