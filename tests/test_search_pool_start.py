"""How a local study's pool workers start (search/pool.py): forked from the `search` process on Linux, so a
worker costs milliseconds, not a fresh interpreter's imports, and after the trace is prepared, so it inherits
what that set up (spawned ones start before it, their imports overlapping it); each keeping only its own pipe
and writing through its own standard streams."""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
from pathlib import Path

import pytest

from helpers_search import grid_spec
from servelab.search import batch
from servelab.search.objective import prepare_trace, worker_id
from servelab.search.pool import Pool
from servelab.search.signals import Interrupt
from servelab.search.spec import load_spec

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; workers fork on Linux")
PARAMS = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "policy": "sarathi"}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pool(tmp_path: Path, prepared: bool = True) -> tuple[Pool, object]:
    spec = load_spec(grid_spec(tmp_path, n_trials=4))
    study_dir = tmp_path / "study"
    study_dir.mkdir(exist_ok=True)
    trace = prepare_trace(spec, study_dir)[1:] if prepared else None
    return Pool(spec, study_dir, 2, worker_id(), Interrupt(), trace), spec


@linux
def test_a_pool_worker_starts_on_what_the_search_process_has_imported(tmp_path):
    """A spawned worker spent ~0.6-0.85 s of CPU importing numpy, pyarrow and the engine again before its first
    trial, on the batches' critical path (bench/RESULTS.md, Session 18); a forked one starts on what the parent
    imported (`preload`, once for all the workers, before it forks them)."""
    pool, _ = _pool(tmp_path)
    try:
        pool.submit(0, PARAMS)
        pool.submit(1, PARAMS)  # one trial each (an idle worker takes the next one)
        outcomes = pool.collect([0, 1])
        assert [o.state for o in outcomes.values()] == ["complete", "complete"]
        assert len({o.user_attrs["worker"] for o in outcomes.values()}) == 2
        trial_cpu = {int(o.user_attrs["worker"].split(":")[1]): o.user_attrs["metrics"]["eval_cpu_s"]
                     for o in outcomes.values()}  # fmt: skip
        start_up = {pid: _cpu_s(pid) - trial_cpu[pid] for pid in (p.pid for p in pool._procs)}
    finally:
        pool.close()
    assert all(s < 0.25 for s in start_up.values()), start_up


@linux
def test_forked_workers_start_after_the_trace_is_prepared_and_spawned_ones_before(tmp_path, monkeypatch):
    """A forked worker inherits what preparing the trace set up (the first Arrow kernel call, zstd): forked before
    it, each worker's first trial cost ~30 ms more CPU than the others (bench/RESULTS.md, Session 25). A spawned
    worker imports what a trial runs while the trace is prepared. Either way the trace is handed to them."""
    from dataclasses import replace

    from servelab.search import objective
    from servelab.search import pool as pool_module
    from servelab.search.study import run_study

    seen = []
    real = objective.prepare_trace

    def prepare(*args, **kwargs):
        seen.append(len([p for p in multiprocessing.active_children() if p.name.startswith("servelab-search-")]))
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "prepare_trace", prepare)
    monkeypatch.setattr(batch, "prepare_trace", prepare, raising=False)  # (the name search/batch.py calls)
    spec = load_spec(grid_spec(tmp_path, n_trials=4))
    for method, alive in (("fork", 0), ("spawn", 2)):
        monkeypatch.setattr(pool_module, "START_METHOD", method)
        seen.clear()
        run_study(replace(spec, workers=2), tmp_path / method)
        assert seen == [alive], method
        trials = sorted((tmp_path / method / "trials").iterdir())
        assert len(trials) == 4 and all((t / "requests.parquet").is_file() for t in trials)


@linux
def test_a_worker_stopped_before_the_trace_exits_cleanly(tmp_path):
    """Ctrl-C (or an error) while the trace is prepared: the workers, waiting for it, stop at the parent's word."""
    pool, _ = _pool(tmp_path, prepared=False)
    procs = list(pool._procs)
    pool.close(wait_s=20.0)
    assert [p.exitcode for p in procs] == [0, 0]


@linux
def test_a_worker_holds_no_other_end_of_the_parents_pipes(tmp_path):
    """A forked worker inherits every descriptor the parent had: it closes the parent's ends of the pipes (its
    own, an earlier worker's), or a worker's pipe would not read EOF when the parent dies."""
    pool, _ = _pool(tmp_path)
    try:
        parent_ends = {os.fstat(c.fileno()).st_ino for c in pool._conns}
        pool.submit(0, PARAMS)
        pool.submit(1, PARAMS)
        pool.collect([0, 1])  # both started, past their start-up
        for proc in pool._procs:
            held = set()
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    held.add(int(target[len("socket:["):-1]))
            assert not held & parent_ends, (proc.pid, held & parent_ends)
    finally:
        pool.close()


class _GuardedStream(io.TextIOBase):
    """A standard stream that writes under a lock another thread takes too, as rich's progress bar does."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            return len(text)

    def flush(self) -> None:  # (nothing buffered)
        pass


@linux
def test_a_worker_forked_while_a_thread_holds_the_stderr_lock_can_write(tmp_path, monkeypatch):
    """`servelab search` forks its workers under a refreshing progress bar: a worker's copy of a lock that thread
    held at the fork stays held, so a worker writes through fresh streams (else its first warning hangs it)."""
    import time

    from servelab.search import objective

    lock, held, release = threading.Lock(), threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait()

    monkeypatch.setattr(sys, "stderr", _GuardedStream(lock))
    real = objective.Evaluator._replay_timed

    def replay(self, *args, **kwargs):
        print("a warning from the replay", file=sys.stderr)  # (a forked worker runs this patched method)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(objective.Evaluator, "_replay_timed", replay)
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        pool, _ = _pool(tmp_path)  # forked while the lock is held
    finally:
        release.set()
        holder.join()
    procs = list(pool._procs)
    try:
        pool.submit(0, PARAMS)
        deadline = time.monotonic() + 60
        while 0 not in pool._done and time.monotonic() < deadline:
            pool._poll(0.5)
        assert 0 in pool._done, "the worker hung writing to stderr"
        assert pool._done[0].state == "complete"
    finally:
        pool.close(wait_s=20.0, grace_s=5.0)
    assert [p.exitcode for p in procs] == [0, 0]  # stopped between trials, not by SIGTERM after the wait


def test_spawned_workers_where_fork_is_not_used_evaluate_the_same(tmp_path):
    """macOS spawns its workers (fork is unsafe there): the same protocol (the trace handed over once prepared)."""
    spec = load_spec(grid_spec(tmp_path, n_trials=4))
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    pool = Pool(spec, study_dir, 2, worker_id(), Interrupt(), start_method="spawn")
    procs = list(pool._procs)
    try:
        pool.trace(prepare_trace(spec, study_dir)[1:])
        pool.submit(0, PARAMS)
        pool.submit(1, dict(PARAMS, policy="vllm-v0"))
        outcomes = pool.collect([0, 1])
    finally:
        pool.close()
    assert [o.state for o in outcomes.values()] == ["complete", "complete"]
    assert [p.exitcode for p in procs] == [0, 0]
