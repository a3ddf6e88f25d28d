"""Time the scoring views on a synthetic million-request run (numbers from a seeded numpy Generator).

    .venv/bin/python bench/bench_scoring.py [--requests 1000000] [--steps 200000] [--dir DIR]

Prints one markdown row per query: what was timed and the wall seconds (best of --repeat).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA


def synth_run(run_dir: Path, n: int, n_steps: int, seed: int = 0) -> None:
    """A plausible run: Poisson arrivals, lognormal lengths, 8 tenants, 3 tiers, 2% unfinished, 1% rejected."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / 50.0, n))
    prompt = np.clip(rng.lognormal(np.log(600), 1.0, n), 1, 8000).astype(np.int32)
    output = np.clip(rng.lognormal(np.log(150), 0.8, n), 1, 2000).astype(np.int32)
    queue = rng.exponential(0.05, n)
    ttft = queue + prompt * 2e-5 + rng.exponential(0.01, n)
    tpot = rng.lognormal(np.log(0.02), 0.3, n)
    status = rng.choice(np.array(["finished", "unfinished", "rejected"]), n, p=[0.97, 0.02, 0.01])
    finished = status == "finished"
    started = status != "rejected"
    first_token = np.where(started, arrival + ttft, np.nan)
    finish = np.where(finished, first_token + tpot * (output - 1), np.nan)
    generated = np.where(finished, output, np.where(started, np.minimum(output, 5), 0)).astype(np.int32)
    tenants = np.array([f"tenant-{i}" for i in range(8)])
    tiers = np.array(["priority", "standard", "flex"])

    def opt(values, mask):
        return pa.array(values, mask=~mask)

    e2e = finish - arrival
    cols = {
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "tenant": pa.array(tenants[rng.zipf(1.5, n) % 8]),
        "tier": pa.array(tiers[rng.choice(3, n, p=[0.1, 0.6, 0.3])]),
        "session_id": pa.nulls(n, pa.int64()),
        "replica": pa.array(rng.integers(0, 4, n).astype(np.int32)),
        "status": pa.array(status),
        "reason": opt(np.where(status == "rejected", "too long", ""), status == "rejected"),
        "arrival_s": pa.array(arrival),
        "first_scheduled_s": opt(arrival + queue, started),
        "first_token_s": opt(first_token, started),
        "finish_s": opt(finish, finished),
        "prompt_tokens": pa.array(prompt),
        "output_tokens": pa.array(output),
        "generated_tokens": pa.array(generated),
        "num_preemptions": pa.array(rng.poisson(0.05, n).astype(np.int32)),
        "ttft_s": opt(ttft, started),
        "tpot_s": opt(np.where(output > 1, tpot, 0.0), finished),
        "e2e_s": opt(e2e, finished),
        "max_itl_s": opt(tpot * rng.uniform(1, 5, n), finished & (output > 1)),
        "ttft_slo_s": opt(np.full(n, 0.2), rng.random(n) < 0.05),
        "tpot_slo_s": pa.nulls(n, pa.float64()),
        "cached_tokens": pa.array(np.zeros(n, dtype=np.int32)),
    }
    pq.write_table(pa.table(cols, schema=REQUESTS_SCHEMA), run_dir / "requests.parquet", compression="zstd")
    dur = rng.exponential(0.03, n_steps)
    start = np.cumsum(dur) - dur
    batch = rng.integers(1, 256, n_steps).astype(np.int32)
    prefill_req = np.minimum(batch, rng.integers(0, 4, n_steps)).astype(np.int32)
    steps = {
        "replica": pa.array(rng.integers(0, 4, n_steps).astype(np.int32)),
        "start_s": pa.array(start),
        "duration_s": pa.array(dur),
        "num_iterations": pa.array(rng.integers(1, 20, n_steps).astype(np.int32)),
        "prefill_tokens": pa.array(rng.integers(0, 2048, n_steps)),
        "prefill_requests": pa.array(prefill_req),
        "decode_requests": pa.array(batch - prefill_req),
        "batch_requests": pa.array(batch),
        "kv_blocks_used": pa.array(rng.integers(0, 28000, n_steps).astype(np.int32)),
        "kv_blocks_total": pa.array(np.full(n_steps, 28000, dtype=np.int32)),
        "waiting": pa.array(rng.integers(0, 50, n_steps).astype(np.int32)),
        "preemptions": pa.array(rng.poisson(0.01, n_steps).astype(np.int32)),
        "tier_bytes": pa.nulls(n_steps, pa.int64()),  # (no offload tiers)
    }
    pq.write_table(pa.table(steps, schema=STEPS_SCHEMA), run_dir / "steps.parquet", compression="zstd")
    meta = {"servelab_version": "0.1.0", "run_id": run_dir.name, "policy": {"name": "synthetic", "params": {}},
            "engine": {"replicas": 4}, "runner": {"name": "none", "params": {}}, "seed": seed}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="Where to write the run (default: a temporary directory).")
    args = ap.parse_args()

    from servelab.scoring.compare import run_metrics
    from servelab.scoring.db import connect
    from servelab.scoring.report import render_text
    from servelab.scoring.slo import SloTable

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_scoring."))
    run_dir = base / "bench_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    synth_run(run_dir, args.requests, args.steps)
    gen_s = time.perf_counter() - t0
    slo = SloTable.parse_cli(["ttft=0.3,tpot=0.03", "tier=priority:ttft=0.1", "tenant=tenant-3:tpot=0.05"])

    def best(fn) -> float:
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    con = connect(run_dir, slo)
    cases = {
        "connect (register views)": lambda: connect(run_dir, slo).close(),
        "SELECT * FROM slo_attainment": lambda: con.sql("SELECT * FROM slo_attainment").fetchall(),
        "SELECT * FROM latency_summary": lambda: con.sql("SELECT * FROM latency_summary").fetchall(),
        "SELECT * FROM goodput": lambda: con.sql("SELECT * FROM goodput").fetchall(),
        "SELECT * FROM tenant_summary": lambda: con.sql("SELECT * FROM tenant_summary").fetchall(),
        "SELECT * FROM fairness": lambda: con.sql("SELECT * FROM fairness").fetchall(),
        "SELECT * FROM resource_summary": lambda: con.sql("SELECT * FROM resource_summary").fetchall(),
        "request_metrics to Arrow (all rows)": lambda: con.sql("SELECT * FROM request_metrics").to_arrow_table(),
        "compare metrics (run_metrics)": lambda: run_metrics(con),
        "full report text (report_text)": lambda: render_text(con),
    }
    print(f"machine: {platform.machine()}, {platform.system()}, python {platform.python_version()}")
    print(f"{args.requests:,} requests, {args.steps:,} steps; generating + writing Parquet took {gen_s:.2f} s")
    print("\n| query | seconds (best of %d) |\n|---|---|" % args.repeat)
    for name, fn in cases.items():
        print(f"| {name} | {best(fn):.3f} |")
    print("\n" + render_text(con).split("SLO attainment")[0].strip())


if __name__ == "__main__":
    main()
