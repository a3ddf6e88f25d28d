"""Memory of `--token-log`: peak RSS of a replay that logs millions of output tokens, with and
without the token log, each in a fresh process.

Usage: .venv/bin/python bench/bench_token_log.py [--n 50000] [--case plain|token-log|codecs]
Prints the tokens logged, wall seconds (replay + writing the run directory) and peak RSS
(``resource.getrusage``, the whole process: trace, engine, result tables and the token log).
``codecs``: CPU seconds (median of 3) and size of writing that replay's token table with each
Parquet compression (tokens.parquet is zstd): what the codec costs of the token log's writing.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def case(n: int, token_log: bool) -> None:
    from servelab.api import EngineConfig, ReplayConfig, replay, write_run
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    config = ReplayConfig(engine=EngineConfig(replicas=8))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = replay(trace, config, token_log=token_log)
        write_run(result, Path(tmp) / "run")
        wall = time.perf_counter() - t0
        tokens = sum(result.requests.column("generated_tokens").to_pylist())
        size = (Path(tmp) / "run" / "tokens.parquet").stat().st_size if token_log else 0
    label = "token-log" if token_log else "plain"
    print(f"{label}: {n:,} requests, {tokens:,} output tokens; wall {wall:.1f} s; "
          f"tokens.parquet {size / 1e6:.0f} MB; peak RSS {peak_rss_mb():.0f} MB", flush=True)


def codecs(n: int) -> None:
    import statistics

    import pyarrow.parquet as pq
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    table = replay(trace, ReplayConfig(engine=EngineConfig(replicas=8)), token_log=True).tokens.read()
    print(f"{n:,} requests, {table.num_rows:,} token rows: pq.write_table(use_dictionary=False), CPU seconds")
    for codec in ("zstd", "lz4", "snappy", "none"):
        cpu = []
        for _ in range(3):
            with tempfile.TemporaryFile() as out:
                start = time.process_time()
                pq.write_table(table, out, compression=codec, use_dictionary=False)
                cpu.append(time.process_time() - start)
                size = out.tell()
        print(f"  {codec:6s} {statistics.median(cpu):.3f} s ({' '.join(f'{c:.3f}' for c in cpu)}), "
              f"{size / 1e6:.1f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--case", choices=["plain", "token-log", "codecs"])
    args = parser.parse_args()
    if args.case == "codecs":
        codecs(args.n)
    elif args.case:
        case(args.n, args.case == "token-log")
    else:
        for name in ("plain", "token-log"):
            subprocess.run([sys.executable, __file__, "--n", str(args.n), "--case", name], check=True)


if __name__ == "__main__":
    main()
