"""Speculative decoding's effect on one example: Llama-3.1-8B on one H100 (roofline), sarathi, the first
N requests of the bundled Azure conversation trace, without speculation and with each proposer.

Usage: .venv/bin/python bench/bench_spec.py [--requests 2000] [--rate-scale 1.0]

Prints, per case: KV capacity (tokens), decode steps, mean step time of pure-decode steps and of all
steps, mean / p50 / p99 TPOT, mean TTFT, the measured mean acceptance length beside the closed form
(1 - a^(k+1)) / (1 - a), and the replay's wall time (speculation runs every step alone: no decode
stretches or cohort).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from servelab.api import EngineConfig, ReplayConfig, build_runner, replay
from servelab.replay.core.speculative import expected_tokens_per_step
from servelab.traces.bundled import default_trace_path
from servelab.traces.io import read_trace

RUNNER = "roofline:model=llama-3.1-8b,gpu=h100-80gb"
CASES = (  # label, EngineConfig fields
    ("off", {}),
    ("ngram k=3 a=0.5", dict(spec_method="ngram", spec_k=3, spec_acceptance="0.5")),
    ("eagle k=3 a=0.7", dict(spec_method="eagle", spec_k=3, spec_acceptance="0.7")),
    ("eagle k=4 a=0.8", dict(spec_method="eagle", spec_k=4, spec_acceptance="0.8")),
    ("mtp k=1 a=0.9", dict(spec_method="mtp", spec_k=1, spec_acceptance="0.9")),
    ("draft llama-3.2-1b k=4 a=0.8", dict(spec_method="draft_model", spec_k=4, spec_acceptance="0.8")),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival times divided by this (more load)")
    args = parser.parse_args()
    trace = read_trace(default_trace_path()).slice(0, args.requests)
    if args.rate_scale != 1.0:
        import pyarrow as pa
        import pyarrow.compute as pc

        i = trace.column_names.index("arrival_s")
        trace = trace.set_column(i, "arrival_s", pc.divide(trace.column("arrival_s"), pa.scalar(args.rate_scale)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; {RUNNER}, sarathi, first {args.requests} requests of the bundled Azure "
          f"conversation trace, arrivals / {args.rate_scale}")
    print()
    print("| case | KV tokens | decode steps | decode step ms | all steps ms | TPOT mean ms | TPOT p50 ms "
          "| TPOT p99 ms | TTFT mean ms | accepted length (closed form) | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for label, fields in CASES:
        config = ReplayConfig(engine=EngineConfig(**fields), policy="sarathi", runner=RUNNER)
        runner = build_runner(config)
        start = time.perf_counter()
        result = replay(trace, config, runner=runner)
        wall = time.perf_counter() - start
        steps = result.steps.to_pydict()
        iters = np.array(steps["num_iterations"], dtype=float)
        dur = np.array(steps["duration_s"])
        decode = np.array(steps["prefill_requests"]) == 0
        req = result.requests.to_pydict()
        tpot = np.array([t for t, n in zip(req["tpot_s"], req["output_tokens"]) if t is not None and n > 1])
        ttft = np.array([t for t in req["ttft_s"] if t is not None])
        spec = result.meta.get("spec_decode")
        if spec:
            rate = float(fields["spec_acceptance"])
            accepted = f"{spec['mean_acceptance_length']:.3f} ({expected_tokens_per_step(rate, fields['spec_k']):.3f})"
        else:
            accepted = "1"
        print(f"| {label} | {runner.kv_capacity_tokens(0.9):,} | {int(iters[decode].sum()):,} "
              f"| {1e3 * dur[decode].sum() / iters[decode].sum():.2f} | {1e3 * dur.sum() / iters.sum():.2f} "
              f"| {1e3 * tpot.mean():.2f} | {1e3 * np.percentile(tpot, 50):.2f} | {1e3 * np.percentile(tpot, 99):.2f} "
              f"| {1e3 * ttft.mean():.1f} | {accepted} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
