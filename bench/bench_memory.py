"""Where a large replay's memory goes: resident memory at each phase of ``replay()`` + ``write_run()``.

Usage: .venv/bin/python bench/bench_memory.py [--n 1000000] [--no-write]
The 1 M case's workload (``bench_replay.py --case 1m``: gamma CV 2 at 40 req/s, lognormal prompt
800 / output 200, seed 7, 8 replicas) with ``--n`` requests. At the entry and exit of each phase
(building the Request objects, the engine, its loop, the requests table, the step table, each
Parquet file) it prints the elapsed seconds, the current RSS (/proc/self/statm, Linux) and the peak
so far (``resource.getrusage``), by wrapping those functions in this process; then the files' sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import tempfile
import time
from pathlib import Path


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Marks:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, label: str) -> None:
        print(f"{time.perf_counter() - self.t0:7.1f} s  {label:34s} RSS {rss_mb():6.0f} MB  peak {peak_mb():6.0f} MB",
              flush=True)

    def wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def marked(*args, **kwargs):
            self(f"> {name}")
            try:
                return inner(*args, **kwargs)
            finally:
                self(f"< {name}")

        setattr(owner, name, marked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--no-write", action="store_true", help="replay() only")
    args = parser.parse_args()
    mark = Marks()
    mark("start")
    from servelab import assembly as api  # (the module that runs the replay: its functions are wrapped)
    from servelab.replay import results
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.logs import StepLog
    from servelab.traces.synth import synth_trace

    mark("imported")
    trace = synth_trace(n=args.n, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    mark(f"trace generated ({trace.nbytes / 2**20:.0f} MB)")
    for owner, name in ((api, "requests_from_table"), (Engine, "__init__"), (Engine, "run"),
                        (api, "requests_table_from"), (api, "with_platform_columns"), (StepLog, "table"),
                        (results, "write_parquet")):
        mark.wrap(owner, name)
    start = time.perf_counter()
    result = api.replay(trace, api.ReplayConfig(engine=api.EngineConfig(replicas=8)))
    mark(f"replay() returned ({time.perf_counter() - start:.1f} s)")
    if not args.no_write:
        with tempfile.TemporaryDirectory() as tmp:
            api.write_run(result, Path(tmp) / "run")
            mark("run directory written")
            for f in sorted((Path(tmp) / "run").glob("*.parquet")):
                print(f"  {f.name} sha256 {hashlib.sha256(f.read_bytes()).hexdigest()}")
    print(f"peak RSS {peak_mb():.0f} MB")


if __name__ == "__main__":
    main()
