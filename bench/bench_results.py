"""Writing a replay's results: their share of the replay's time, and the process's peak memory.

Usage: .venv/bin/python bench/bench_results.py [--case azure|synth] [--n 200000] [--token-log] [--repeat 3]
``azure``: the bundled trace on 6 replicas; ``synth``: the 1 M case's workload (``bench_replay.py --case
1m``: gamma CV 2 at 40 req/s, lognormal prompt 800 / output 200, seed 7, 8 replicas) with ``--n``
requests. Each repeat is one ``replay()`` + ``write_run()`` into a temporary folder, timed in CPU
seconds (``time.process_time``: steadier than wall time on a shared machine; Parquet's writer threads
count too) and split into:

- engine: ``Engine.run``, less the step rows packed into Arrow batches while it runs;
- results: packing the step rows (during and after the loop), the requests table, the token log's
  work while the loop runs (``--token-log``: "spill", converting the records and the decode
  cohorts' advances logged to numpy and spilling them; the calls that log each one stay in engine)
  and its final merge
  ("tokens"), and ``write_run`` (Parquet files and run.json).

The share printed is results / (engine + results + the rest of ``replay()``), median of the repeats;
then the files' sha256 (the last repeat), to compare outputs before and after a change.
The parts are timed by wrapping these functions (``assembly.requests_table_from``, ``StepLog._pack``,
``TokenLog._flush`` and ``_flush_timeline`` outside ``finish``, ``TokenLog.finish``, ``Engine.run``) in this process only.
Peak RSS: ``resource.getrusage`` (the whole process: trace, requests, engine, tables); for a figure
without the instrumentation use ``/usr/bin/time -v``.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import statistics
import tempfile
import time
from pathlib import Path


class Parts:
    """CPU seconds spent in wrapped functions, by part."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, part: str, busy: list | None = None) -> None:
        """Time ``owner.name`` as ``part``; with ``busy`` (a list shared by several wrapped functions),
        only while it is empty: a call inside another one is that one's work."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if busy:
                return inner(*args, **kwargs)
            start = time.process_time()
            if busy is not None:
                busy.append(name)
            try:
                return inner(*args, **kwargs)
            finally:
                if busy is not None:
                    busy.pop()
                self.seconds[part] = self.seconds.get(part, 0.0) + time.process_time() - start

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["azure", "synth"], default="azure")
    parser.add_argument("--n", type=int, default=200_000, help="synth: requests")
    parser.add_argument("--token-log", action="store_true", help="also log every output token (tokens.parquet)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from servelab import assembly as api  # (the module that runs the replay: its functions are wrapped)
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.logs import StepLog, TokenLog

    if args.case == "azure":
        from servelab.traces.bundled import default_trace_path
        from servelab.traces.io import read_trace

        trace = read_trace(default_trace_path())
        config = api.ReplayConfig(engine=api.EngineConfig(replicas=6))
        label = f"azure-conv x6 ({trace.num_rows:,} requests)"
    else:
        from servelab.traces.synth import synth_trace

        trace = synth_trace(n=args.n, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                            output="lognormal:200:1.0", seed=7)
        config = api.ReplayConfig(engine=api.EngineConfig(replicas=8))
        label = f"synthetic x8 ({trace.num_rows:,} requests)"

    parts = Parts()
    peak_after_loop = []
    loop = Engine.run

    def run_and_note_peak(engine, *args, **kwargs):
        try:
            return loop(engine, *args, **kwargs)
        finally:
            peak_after_loop.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    Engine.run = run_and_note_peak
    parts.wrap(Engine, "run", "engine")
    parts.wrap(StepLog, "_pack", "steps")
    parts.wrap(api, "requests_table_from", "requests")
    # the token log's spills in the loop and its merge at the end (whose last spill is the merge's)
    token_log_busy: list = []
    parts.wrap(TokenLog, "_flush", "spill", token_log_busy)
    parts.wrap(TokenLog, "_flush_timeline", "spill", token_log_busy)  # the decode cohorts' advances
    parts.wrap(TokenLog, "finish", "tokens", token_log_busy)
    rows = []
    for _ in range(args.repeat):
        parts.seconds.clear()
        with tempfile.TemporaryDirectory() as tmp:
            start = time.process_time()
            result = api.replay(trace, config, token_log=args.token_log, token_dir=tmp)
            replayed = time.process_time()
            api.write_run(result, Path(tmp) / "run")
            end = time.process_time()
            digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16]
                       for f in sorted((Path(tmp) / "run").glob("*.parquet"))}
        s = dict(parts.seconds, write=end - replayed, total=end - start)
        s["engine"] -= s.get("steps", 0.0) + s.get("spill", 0.0)  # rows packed, tokens spilled in the loop
        s["results"] = sum(s.get(k, 0.0) for k in ("steps", "requests", "spill", "tokens", "write"))
        rows.append(s)
    print(f"{label}{', token log' if args.token_log else ''}: CPU seconds, median of {args.repeat}")
    for key in ("total", "engine", "results", "steps", "requests", "spill", "tokens", "write"):
        if key in rows[0]:
            values = [r[key] for r in rows]
            print(f"  {key:9s} {statistics.median(values):8.3f}  ({' '.join(f'{v:.3f}' for v in values)})")
    share = statistics.median(r["results"] / r["total"] for r in rows)
    print(f"  results share of the replay: {share:.1%}; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB "
          f"(when the first engine loop ended: {peak_after_loop[0]:.0f} MB)")
    print("  sha256: " + " ".join(f"{name}={digest}" for name, digest in digests.items()))


if __name__ == "__main__":
    main()
