"""Benchmark trace import (a 1 M-row Azure-2024-style CSV) and synthetic generation (1 M rows).

Usage: .venv/bin/python bench/bench_traces.py [--rows 1000000]

Each measurement runs in a fresh child process so its peak resident memory (ru_maxrss) belongs to
that step alone; the child's baseline (interpreter + numpy/polars/pyarrow imported) is reported
too, so the import's own footprint is the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def write_azure_2024_csv(path: Path, rows: int, seed: int) -> None:
    """A CSV in the Azure 2024 week-long layout: '+00:00' zone, 6 fractional digits."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    gaps_us = rng.exponential(50_000, rows).astype(np.int64)  # ~20 req/s
    start_us = 1_715_299_200_000_000  # 2024-05-10 00:00:00 UTC
    ts = pl.Series("t", start_us + np.cumsum(gaps_us)).cast(pl.Datetime("us"))
    df = pl.DataFrame(
        {
            "TIMESTAMP": ts.dt.to_string("%Y-%m-%d %H:%M:%S%.6f") + "+00:00",
            "ContextTokens": rng.integers(1, 8000, rows),
            "GeneratedTokens": rng.integers(1, 1000, rows),
        }
    )
    df.write_csv(path)


def child(step: str, arg: str, out: str) -> None:
    """One measured step in a fresh process: 'write' (the CSV), 'import' or 'synth'."""
    import numpy  # noqa: F401  (baseline: the libraries every step needs)
    import polars  # noqa: F401
    import pyarrow  # noqa: F401

    from servelab.traces.importers import import_trace
    from servelab.traces.io import write_trace
    from servelab.traces.synth import synth_trace

    if step == "write":
        write_azure_2024_csv(Path(out), int(arg), 0)
        print(json.dumps({}))
        return
    baseline = _peak_mib()
    t0 = time.perf_counter()
    if step == "import":
        result = import_trace("azure", [Path(arg)])
        rows = result.table.num_rows
        parsed = time.perf_counter()
        write_trace(result.table, out, result.source)
    else:
        table = synth_trace(n=int(arg), rate=20.0, arrival="gamma", cv=2.0, prompt="lognormal:600:1",
                            output="lognormal:150:1", tenants=8, tenant_zipf=1.2, seed=0)
        rows = table.num_rows
        parsed = time.perf_counter()
        write_trace(table, out, "bench")
    done = time.perf_counter()
    print(json.dumps({"rows": rows, "compute_s": parsed - t0, "total_s": done - t0,
                      "peak_rss_mib": _peak_mib(), "baseline_rss_mib": baseline}))


def run_child(step: str, arg: str, out: Path) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", step, arg, str(out)], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=3, metavar=("STEP", "ARG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "azure_2024_style.csv"
        t0 = time.perf_counter()
        # Every heavy step runs in a child: Linux carries ru_maxrss across fork+exec, so a parent
        # that held the CSV in memory would inflate the children's peaks.
        run_child("write", str(args.rows), csv)
        size_mib = csv.stat().st_size / 2**20
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(f"wrote {args.rows:,} rows ({size_mib:.1f} MiB CSV) in {time.perf_counter() - t0:.2f} s")
        imp = run_child("import", str(csv), Path(tmp) / "imported.arrow")
        gen = run_child("synth", str(args.rows), Path(tmp) / "synth.arrow")
    for name, r in (("import azure CSV", imp), ("synth (gamma cv=2, lognormal, 8 tenants)", gen)):
        print(
            f"{name}: {r['rows']:,} rows; parse/generate {r['compute_s']:.2f} s "
            f"({r['rows'] / r['compute_s']:,.0f} rows/s); with .arrow write {r['total_s']:.2f} s "
            f"({r['rows'] / r['total_s']:,.0f} rows/s); peak RSS {r['peak_rss_mib']:.0f} MiB "
            f"(baseline {r['baseline_rss_mib']:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
