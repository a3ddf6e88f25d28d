"""Benchmark the cost-model runners: step_time calls per second (the replay calls it every iteration),
a replay of a real trace slice with each, and the roofline calibration error table.

    .venv/bin/python bench/bench_runners.py [--trace ../shared/traces/vidur/splitwise_conv.csv] [--requests 2000]

Prints Markdown (paste into bench/RESULTS_runners.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.fitted import fit_profile
from servelab.runners.profiling import profile
from servelab.runners.roofline import load_calibration_file

SHARED = Path(__file__).resolve().parents[2] / "shared"


def random_plans(n: int, seed: int = 0) -> list[StepPlan]:
    """Mixed batches like a chunked-prefill replay produces: one chunk or none, plus decodes."""
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(n):
        chunk, ctx = int(rng.integers(0, 2048)) * int(rng.random() < 0.3), int(rng.integers(0, 4096))
        d = int(rng.integers(0 if chunk else 1, 256))
        plans.append(StepPlan(StepShape(chunk, int(chunk > 0), (chunk + ctx) * (chunk > 0),
                                        chunk * ctx + chunk * (chunk + 1) // 2, d, d * int(rng.integers(64, 4096)))))
    return plans


def calls_per_s(fn, plans: list[StepPlan], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for p in plans:
            fn(p)
        best = min(best, time.perf_counter() - start)
    return len(plans) / best


def replay_rows(runners: dict, trace_path: Path, requests: int) -> list[str]:
    from servelab.api import ReplayConfig, replay
    from servelab.traces.importers import import_trace

    from servelab.replay.config import EngineConfig

    trace = import_trace("vidur", [trace_path]).table.slice(0, requests)
    # Every runner gets the roofline's KV size (linear knows no model), so only step times differ.
    blocks = runners["roofline"].kv_capacity_tokens() // 16
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=blocks))
    rows = []
    for label, runner in runners.items():
        start = time.perf_counter()
        result = replay(trace, config, runner=runner)
        wall = time.perf_counter() - start
        iters = int(np.sum(result.steps.column("num_iterations").to_numpy()))
        rows.append(f"| {label} | {trace.num_rows} | {iters} | {result.steps.num_rows} | {wall:.2f} | {iters / wall:,.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", type=Path, default=SHARED / "traces/vidur/splitwise_conv.csv")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()

    roofline = make_runner("roofline")
    linear = make_runner("linear:base=0.005,prefill_token=0.00003,decode_context_token=0.00000004")
    with tempfile.TemporaryDirectory() as tmp:
        profile(roofline, Path(tmp) / "p.parquet", spec="roofline",
                context={"model": "llama-3.1-8b", "gpu": "h100-80gb", "tp": 1})
        fit_profile(Path(tmp) / "p.parquet", Path(tmp) / "m.json", buckets=(16, 64, 256, 1024))
        fitted = make_runner(f"fitted:{Path(tmp) / 'm.json'}")
    plans = random_plans(20_000)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {platform.system()}")
    print()
    print("## step_time throughput (20,000 random mixed batches, best of 5)")
    print()
    print("| runner | calls/s | us/call |")
    print("|---|---:|---:|")
    for label, runner in (("linear", linear), ("roofline (llama-3.1-8b, h100-80gb)", roofline),
                          ("fitted (4 buckets, from roofline profile)", fitted)):
        rate = calls_per_s(runner.step_time, plans)
        print(f"| {label} | {rate:,.0f} | {1e6 / rate:.2f} |")
    rate = calls_per_s(lambda p: roofline.decode_affine(p.shape.decode_seqs), plans)
    print(f"| roofline decode_affine | {rate:,.0f} | {1e6 / rate:.2f} |")

    if args.trace.is_file():
        print()
        print(f"## replay of the first {args.requests} requests of {args.trace.name} (sarathi, defaults)")
        print()
        print("| runner | requests | iterations | step rows | wall s | iterations/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for row in replay_rows({"roofline": roofline, "fitted": fitted, "linear": linear}, args.trace, args.requests):
            print(row)

    print()
    print("## roofline calibration error (packaged constants vs vidur measurements)")
    print()
    print("| GPU | group | samples | median APE % | p90 APE % |")
    print("|---|---|---:|---:|---:|")
    for e in load_calibration_file()["errors"]:
        print(f"| {e['gpu']} | {e['group']} | {e['n']} | {e['median_ape_pct']:.1f} | {e['p90_ape_pct']:.1f} |")


if __name__ == "__main__":
    main()
