"""Run a study: open its storage, fail trials whose worker died, and let worker processes evaluate until n_trials are done.

``n_trials`` counts finished trials (complete or pruned, infeasible included) over the whole study,
however many runs, workers and machines took part; failed trials (errors, Ctrl-C, killed workers)
do not count, so a resumed study makes them up. Each worker checks the count before it starts a
trial; when several workers race for the last trial the late one is recorded as a failed
``surplus`` trial with no parameters (Optuna cannot take a trial back).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Callable

from servelab.common.atomic import atomic_path
from servelab.common.errors import ServelabError
from servelab.common.processes import alive
from servelab.search.spec import SearchSpec, comparable_identity
from servelab.search.storage import (
    HASH_ATTR, SLO_ATTR, SPEC_ATTR, TRACE_SHA_ATTR, journal_storage, make_storage, redact, sync_storage,
)
from servelab.search.storage import rdb_storage, sqlalchemy_url  # noqa: F401  (re-exported: their home was here)
from servelab.search.signals import _PR_SET_PDEATHSIG, PARENT_DIED, PARENT_POLL_S, Flag, Interrupt, _ParentWatch  # noqa: F401  (re-exported)
from servelab.search.trials import counts
from servelab.traces.io import trace_sha256

MAX_ERRORS_IN_A_ROW = 5
# A live worker records itself on a trial as the objective's first step, milliseconds after Optuna
# creates it; a RUNNING trial still unclaimed this long after its start lost its worker in between.
UNCLAIMED_GRACE_S = 10.0


class _DropInterrupted:
    """A logging filter: Optuna logs a trial failed by Ctrl-C (or its worker being stopped) as a warning with a
    30-70 line traceback; servelab records it as an ``interrupted`` trial and prints one line instead."""

    _TRIAL = re.compile(r"^Trial (\d+) failed with ")

    def __init__(self) -> None:
        self.dropped: str | None = None  # the trial whose failure was dropped: its "failed with value" line goes too

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        m = self._TRIAL.match(message)
        if isinstance(exc, KeyboardInterrupt) or "KeyboardInterrupt" in message:
            self.dropped = m.group(1) if m else None
            return False
        if m and m.group(1) == self.dropped and message.startswith(f"Trial {self.dropped} failed with value"):
            return False
        return True


_DROP_INTERRUPTED = _DropInterrupted()


def _quiet_optuna() -> None:
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logger = logging.getLogger("optuna")
    if _DROP_INTERRUPTED not in logger.filters:
        logger.addFilter(_DROP_INTERRUPTED)
    for handler in logger.handlers:  # Optuna logs through its own handler on the "optuna" logger
        if _DROP_INTERRUPTED not in handler.filters:
            handler.addFilter(_DROP_INTERRUPTED)


def make_sampler(spec: SearchSpec, seed: int):
    import optuna

    opts = dict(spec.sampler_options)
    try:
        if spec.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=seed, **opts)
        if spec.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed, **opts)
        if spec.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, **opts)
        if spec.sampler == "grid":
            grid = {p.name: list(p.grid_values()) for p in spec.space}
            # the spec's seed, not the worker's: the seed orders the grid, and a trial's number picks its
            # point in that order, so workers (and resumed runs) with other seeds evaluated duplicates
            # (failed points of an earlier run are run again: search/grid.py)
            from servelab.search.grid import ResumableGridSampler

            return ResumableGridSampler(grid, seed=spec.seed, **opts)
        if spec.sampler == "cmaes":
            import importlib.util

            if importlib.util.find_spec("cmaes") is None:
                raise ServelabError(f"{spec.path}: sampler 'cmaes' needs the cmaes package (pip install cmaes)")
            return optuna.samplers.CmaEsSampler(seed=seed, **opts)
    except TypeError as err:
        raise ServelabError(f"{spec.path}, sampler: bad option ({err})") from None
    raise ServelabError(f"{spec.path}: unknown sampler {spec.sampler!r}")


def make_pruner(spec: SearchSpec):
    import optuna

    opts = dict(spec.pruner_options)
    try:
        if spec.pruner == "median":
            return optuna.pruners.MedianPruner(**opts)
        if spec.pruner == "hyperband":
            opts.setdefault("min_resource", round(spec.checkpoints[0] * 100))
            opts.setdefault("max_resource", 100)
            return optuna.pruners.HyperbandPruner(**opts)
    except (TypeError, ValueError) as err:
        raise ServelabError(f"{spec.path}, pruner: bad option ({err})") from None
    return optuna.pruners.NopPruner()


def grid_size(spec: SearchSpec) -> int:
    n = 1
    for p in spec.space:
        n *= len(p.grid_values())
    return n


def _storage_text(spec: SearchSpec, storage_url: str | None) -> str:
    url = storage_url or spec.storage
    return redact(url) if url else "journal:study.journal"


def check_study_dir(spec: SearchSpec, study_dir: Path, storage_url: str | None = None) -> None:
    """One folder, one study: refuse (before anything is written) a folder that holds another study.

    Another study is one with another name or storage in STUDY_DIR/study.json, or another study in
    STUDY_DIR/study.journal. The same study with a changed spec is refused by `open_study`.
    """
    study_dir = Path(study_dir)
    if study_dir.exists() and not study_dir.is_dir():
        raise ServelabError(f"{study_dir}: exists and is not a directory")
    info_path = study_dir / "study.json"
    storage = _storage_text(spec, storage_url)
    hint = "one folder holds one study: use another -o STUDY_DIR"
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text())
            name, other_storage = info["study_name"], info["storage"]
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ServelabError(f"{info_path}: unreadable ({err}); not writing into {study_dir}") from None
        if name != spec.study_name or other_storage != storage:
            raise ServelabError(f"{study_dir} holds study '{name}' ({other_storage}, from {info.get('spec_path', '?')}), "
                                f"not '{spec.study_name}' ({storage}); {hint}")  # fmt: skip
    journal = study_dir / "study.journal"
    if journal.is_file():
        import optuna

        _quiet_optuna()
        names = optuna.get_all_study_names(journal_storage(journal))
        others = [n for n in names if n != spec.study_name or storage != "journal:study.journal"]
        if others:
            raise ServelabError(f"{study_dir} holds study '{others[0]}' in its study.journal, not "
                                f"'{spec.study_name}' in {storage}; {hint}")  # fmt: skip


def resumed_seed(seed: int, trials_before: int) -> int:
    """The sampler seed of a worker joining a study that already has ``trials_before`` trials.

    A fresh study samples with ``seed`` itself (a seeded one-worker run is reproducible); a resumed
    one must not restart that random stream, or its first trials repeat the earlier run's settings.
    """
    if trials_before == 0:
        return seed
    import hashlib

    digest = hashlib.sha256(f"servelab-resume:{seed}:{trials_before}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def open_study(spec: SearchSpec, study_dir: Path, seed: int | None = None, storage_url: str | None = None):
    """Create or load the study; refuse one made from a different spec."""
    import optuna

    _quiet_optuna()
    storage = make_storage(spec, study_dir, storage_url)
    sampler = make_sampler(spec, spec.seed if seed is None else seed)
    study = optuna.create_study(storage=storage, study_name=spec.study_name, directions=list(spec.directions),
                                sampler=sampler, pruner=make_pruner(spec), load_if_exists=True)  # fmt: skip
    attrs = study.user_attrs
    digest = spec.identity_hash()
    where = redact(spec.storage) if spec.storage else study_dir
    trace_sha = trace_sha256(spec.trace.path)
    if HASH_ATTR not in attrs:
        study.set_user_attr(SPEC_ATTR, json.loads(json.dumps(spec.identity(), default=str)))
        study.set_user_attr(HASH_ATTR, digest)
        study.set_user_attr("objectives", list(spec.objectives))
    elif attrs[HASH_ATTR] != digest:
        # the stored hash may be of an older identity form (one with the trace's path): compare the identities
        old = comparable_identity(attrs.get(SPEC_ATTR, {}))
        changed = sorted(k for k, v in comparable_identity(spec.identity()).items() if old.get(k) != v)
        if changed or not old:
            raise ServelabError(
                f"study '{spec.study_name}' in {where} was made from a different spec (changed: "
                f"{', '.join(changed) or 'unknown'}); use another -o STUDY_DIR or study_name, or restore the spec"
            )
    if SLO_ATTR not in attrs:  # (a study begun before it was recorded gets it now: its spec was just matched)
        study.set_user_attr(SLO_ATTR, spec.slo.to_dict())
    before = attrs.get(TRACE_SHA_ATTR)
    if before is None:  # a new study (or one begun before servelab recorded the digest)
        study.set_user_attr(TRACE_SHA_ATTR, trace_sha)
    elif before != trace_sha:
        raise ServelabError(
            f"study '{spec.study_name}' in {where} was made from another trace: {spec.trace.path} has changed "
            f"since (sha256 {before[:12]}... then, {trace_sha[:12]}... now); restore the trace, or use another "
            f"-o STUDY_DIR or study_name for the new one"
        )
    return study


def _alive(pid: int, token: str) -> bool:
    return alive(pid, None if token == "?" else token)


def fail_stale_trials(study, study_dir: Path) -> list[int]:
    """Mark RUNNING trials whose worker process is gone as FAIL (reason 'stale'); returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    host = socket.gethostname()
    stale = []
    storage = study._storage
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    young = [t.datetime_start for t in running if not t.user_attrs.get("worker") and t.datetime_start is not None]
    if young:  # a worker killed between Optuna's ask and its claim: wait out the claim window once
        wait_s = UNCLAIMED_GRACE_S - (datetime.now() - max(young)).total_seconds()
        if wait_s > 0:
            time.sleep(min(wait_s, UNCLAIMED_GRACE_S))
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    now = datetime.now()
    for t in running:
        worker = t.user_attrs.get("worker")
        gone = False
        if worker:
            w_host, pid, token = worker.rsplit(":", 2)
            gone = w_host == host and not _alive(int(pid), token)
        elif t.datetime_start is not None and (now - t.datetime_start).total_seconds() >= UNCLAIMED_GRACE_S:
            gone = True
        if not gone:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "outcome", "stale")
            storage.set_trial_user_attr(t._trial_id, "reason", f"stale: worker {worker or '?'} died mid-trial")
            storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            stale.append(t.number)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # its worker (or another restart) finished it meanwhile
    with warnings.catch_warnings():  # "experimental" since Optuna 2.9
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)  # heartbeat-based, for workers on other machines (RDB)
    trials_root = Path(study_dir) / "trials"
    for number in stale:  # what killed workers left: atomic_dir's temporaries, or a run written before the tell
        for tmp in trials_root.glob(f".{number:04d}.*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trials_root / f"{number:04d}", ignore_errors=True)
    return stale


def run_worker(spec: SearchSpec, study_dir: Path, seed: int, threads: int | None = None,
               on_trial: Callable | None = None, storage_url: str | None = None,
               interrupt: Interrupt | None = None) -> None:  # fmt: skip
    """Evaluate trials in this process until the study has ``spec.n_trials`` finished ones (or timeout).

    Ctrl-C (and whatever ``interrupt`` catches) raises KeyboardInterrupt here once the trial in
    flight is failed as ``interrupted`` or, between trials, once the last one is recorded.
    """
    import optuna
    from optuna.trial import TrialState

    from servelab.search.objective import Evaluator, QuotaReached
    from servelab.search.recorded import Pruned

    own_interrupt = interrupt is None
    interrupt = (interrupt or Interrupt()).install()
    evaluator = study = None
    try:
        study = open_study(spec, study_dir, seed=seed, storage_url=storage_url)
        before = len(study.get_trials(deepcopy=False))
        if before:  # continue the random stream, not restart it (a restarted one repeats earlier settings)
            study.sampler = make_sampler(spec, resumed_seed(seed, before))
        limit = spec.n_trials
        if spec.sampler == "grid":
            limit = min(limit, grid_size(spec))
        if counts(study)["finished"] >= limit:
            return
        evaluator = Evaluator(spec, study_dir, threads=threads)
        evaluator.interrupted = interrupt.event
        interrupt.evaluator = evaluator
        if interrupt.is_set():
            raise KeyboardInterrupt
        errors: list[str] = []

        def quota(trial) -> None:
            done = running_before = 0
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)):
                if t.state != TrialState.RUNNING:
                    done += 1
                elif t.number < trial.number:
                    running_before += 1
            if done + running_before >= limit:
                trial.set_user_attr("outcome", "surplus")
                trial.set_user_attr("reason", f"surplus: n_trials = {limit} was reached by other workers")
                raise QuotaReached()

        def after(study_, frozen) -> None:
            outcome = frozen.user_attrs.get("outcome")
            if frozen.state == TrialState.FAIL and outcome == "error":
                errors.append(frozen.user_attrs.get("reason", "?"))
                if len(errors) >= MAX_ERRORS_IN_A_ROW:
                    study_.stop()
            elif frozen.state != TrialState.FAIL:
                errors.clear()
            if on_trial is not None:
                on_trial(study_, frozen)
            c = counts(study_)
            if c["finished"] >= limit or c["finished"] + c["running"] >= limit or outcome == "surplus":
                study_.stop()

        evaluator.quota_check = quota

        def objective(trial):
            try:
                return evaluator(trial)
            except Pruned as err:  # (the Evaluator's own signal: pool workers run it without Optuna)
                raise optuna.TrialPruned(str(err)) from None

        try:
            study.optimize(objective, n_trials=None, timeout=spec.timeout_s, catch=(Exception,),
                           callbacks=[after, lambda study_, _frozen: interrupt.is_set() and study_.stop()],
                           gc_after_trial=False)  # fmt: skip
            if interrupt.is_set():
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            _fail_own_running(study, evaluator.worker)  # a trial the interrupt left running, if any
            raise
        if len(errors) >= MAX_ERRORS_IN_A_ROW:
            raise ServelabError(f"{MAX_ERRORS_IN_A_ROW} trials in a row failed; the last: {errors[-1]}")
    finally:
        interrupt.evaluator = None
        if own_interrupt:
            interrupt.restore()
        if evaluator is not None:
            evaluator.close()
        if study is not None:
            sync_storage(study)


def _fail_own_running(study, worker: str) -> None:
    import optuna
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("worker") == worker:
            try:
                study._storage.set_trial_user_attr(t._trial_id, "outcome", "interrupted")
                study._storage.set_trial_user_attr(t._trial_id, "reason", "interrupted (Ctrl-C)")
                study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass


def _worker_entry(spec: SearchSpec, study_dir: str, seed: int, storage_url: str | None, parent_pid: int | None = None) -> None:
    # Ctrl-C reaches the workers too (one process group); SIGTERM comes from the parent stopping
    # stragglers. Both stop the worker like Ctrl-C; so does the parent's death (_ParentWatch).
    interrupt = Interrupt().install((signal.SIGINT, signal.SIGTERM))
    watch = _ParentWatch(parent_pid, interrupt) if parent_pid is not None else None
    try:
        try:
            run_worker(spec, Path(study_dir), seed, threads=1, storage_url=storage_url, interrupt=interrupt)
        except KeyboardInterrupt:
            pass  # its trial in flight is already marked failed (interrupted)
        if watch is not None and watch.gone():
            # the `search` process is gone (killed): it will not write trials.parquet, so each worker
            # does, with the handlers still installed (a second signal only sets the flag again)
            from servelab.search.trials import write_trials, write_trials_retrying

            # (both workers write it at once: write_trials_retrying keeps trying for a while)
            write_trials_retrying(lambda: write_trials(open_study(spec, Path(study_dir), storage_url=storage_url),
                                                       Path(study_dir)))  # fmt: skip
    finally:
        if watch is not None:
            watch.close()
        interrupt.restore()


def worker_seed(spec: SearchSpec, index: int) -> int:
    """Local worker ``index`` samples with seed + index (worker 0 = the spec's seed: a one-worker run is reproducible)."""
    return spec.seed + index


def write_study_json(spec: SearchSpec, study_dir: Path, storage_url: str | None) -> None:
    url = storage_url or spec.storage
    info = {"study_name": spec.study_name, "storage": redact(url) if url else "journal:study.journal",
            "spec_path": str(spec.path), "objectives": list(spec.objectives), "directions": list(spec.directions),
            "target": spec.target, "spec": spec.identity()}  # fmt: skip
    with atomic_path(Path(study_dir) / "study.json") as tmp:
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")


def open_study_dir(spec: SearchSpec, study_dir: Path, storage_url: str | None = None):
    """Check STUDY_DIR holds no other study, create it and open the study; refuses a changed spec.

    A storage that cannot be opened (an unreachable database URL) leaves nothing behind: a folder
    this call created is removed again.
    """
    study_dir = Path(study_dir)
    check_study_dir(spec, study_dir, storage_url)  # one folder, one study
    made = [p for p in (study_dir, *study_dir.parents) if not p.exists()]
    study_dir.mkdir(parents=True, exist_ok=True)
    try:
        return open_study(spec, study_dir, storage_url=storage_url)
    except BaseException:
        for folder in made:  # deepest first; only while empty (nothing else wrote there meanwhile)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def run_study(spec: SearchSpec, study_dir: Path, progress=None, storage_url: str | None = None,
              poll_s: float = 0.5) -> None:  # fmt: skip
    """`servelab search SPEC -o STUDY_DIR`: run the study's trials on ``spec.workers`` local processes.

    A study in a local journal runs in batches (search/batch.py: the same trials whatever the
    number of workers; one worker runs in this process). A database study keeps Optuna's
    independent workers (`run_worker`: this process when 1), since workers on other machines
    join it. ``progress(study)`` is called after each batch or trial, or every ``poll_s``.
    Ctrl-C stops every worker after marking its running trial failed; finished trials are kept.
    """
    from servelab.traces.io import read_trace

    read_trace(spec.trace.path)  # a missing or invalid trace fails before anything is written
    study_dir = Path(study_dir)
    study = open_study_dir(spec, study_dir, storage_url)
    write_study_json(spec, study_dir, storage_url)
    fail_stale_trials(study, study_dir)
    if progress is not None:
        progress(study)
    if not (storage_url or spec.storage):  # a local journal: batches, the same trials for any number of workers
        _run_local(spec, study_dir, study, progress)
        return
    workers = spec.workers or 1  # a database study: independent workers, as other machines run them
    if workers == 1:
        run_worker(spec, study_dir, worker_seed(spec, 0), storage_url=storage_url,
                   on_trial=(lambda s, t: progress(s)) if progress else None)  # fmt: skip
        return
    from servelab.search.objective import prepare_trace

    prepare_trace(spec, study_dir)  # once, before the workers race to write it
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker_entry, args=(spec, str(study_dir), worker_seed(spec, i), storage_url, os.getpid()),
                         name=f"servelab-search-{i}") for i in range(workers)]  # fmt: skip
    # Workers start with Ctrl-C ignored (inherited through exec) until they install their own
    # handler, so one landing while they start up prints no traceback from multiprocessing.
    ignore = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
    try:
        for p in procs:
            p.start()
    finally:
        if ignore:
            signal.signal(signal.SIGINT, previous)
    try:
        while any(p.is_alive() for p in procs):
            if progress is not None:
                progress(study)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop_workers(procs)
        raise
    finally:
        for p in procs:
            p.join()
    if progress is not None:
        progress(study)
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise ServelabError(f"{len(bad)} worker process(es) exited with an error (exit codes {bad})")


def _run_local(spec: SearchSpec, study_dir: Path, study, progress=None) -> None:
    """A study in STUDY_DIR/study.journal: trials in batches on ``resolve_workers(spec)`` processes (search/batch.py)."""
    from servelab.search.batch import resolve_workers, run_batches

    before = len(study.get_trials(deepcopy=False))
    if before:  # continue the random stream, not restart it (a restarted one repeats earlier settings)
        study.sampler = make_sampler(spec, resumed_seed(spec.seed, before))
    limit = min(spec.n_trials, grid_size(spec)) if spec.sampler == "grid" else spec.n_trials
    if counts(study)["finished"] >= limit:
        return
    try:
        run_batches(study, spec, study_dir, resolve_workers(spec), limit, progress)
    finally:
        sync_storage(study)


def _stop_workers(procs, wait_s: float = 3.0, grace_s: float = 60.0) -> None:
    """Workers in the terminal's process group got Ctrl-C too; stop the rest (SIGTERM: like Ctrl-C), then kill stragglers."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


__all__ = ["open_study", "open_study_dir", "run_study", "run_worker", "fail_stale_trials", "counts", "make_storage", "redact",
           "write_study_json", "grid_size", "check_study_dir", "resumed_seed", "Interrupt"]  # fmt: skip
