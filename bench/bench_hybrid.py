"""What hybrid attention does to KV capacity and step time: Gemma-3-27B with its sliding windows (52 of
62 layers attend to the last 1,024 tokens) against the same model with every layer full, on 2 x H100;
then the KV layouts of the other hybrid presets, and a replay of long prompts under both.

    .venv/bin/python bench/bench_hybrid.py

Prints Markdown (paste into bench/RESULTS_runners.md "Hybrid attention").
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from servelab.runners.base import StepItem, StepPlan, StepShape, make_runner
from servelab.runners.roofline import RooflineRunner


def _decoding(n: int, context: int):
    from servelab.replay.core.request import Request

    reqs = [Request(i, 0.0, context, 100) for i in range(n)]
    for req in reqs:
        req.num_computed_tokens, req.num_generated_tokens = context, 1
    items = tuple(StepItem(req, context, 1) for req in reqs)
    return StepPlan(StepShape(decode_seqs=n, decode_context_tokens=n * (context + 1)), items)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_trace
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig

    hybrid = make_runner("roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2", block_size=16)
    full = RooflineRunner(replace(hybrid.model, sliding_layers=0, sliding_window=0), hybrid.gpu, 2, hybrid.calibration,
                          host_profile=hybrid.host_profile, custom_all_reduce=hybrid.custom_all_reduce)
    print("| Gemma-3-27B, 2 x H100 | pool blocks at 0.9 | layers per block | blocks of a 32k request at its peak | "
          "32k requests held | decode 64 x 1k (ms) | decode 64 x 8k (ms) | decode 16 x 32k (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in (("every layer full", full), ("sliding windows (vLLM hybrid manager)", hybrid)):
        blocks = r.kv_capacity_tokens(0.9) // 16
        per_request = hybrid.kv_layout.peak(32_768) if r is hybrid else -(-32_768 // 16)
        layers = hybrid.kv_layout.group_size if r is hybrid else 62
        times = [r.step_time(_decoding(n, c)) * 1e3 for n, c in ((64, 1000), (64, 8000), (16, 32_000))]
        print(f"| {label} | {blocks:,} | {layers} | {per_request:,} | {blocks // per_request:,} | "
              + " | ".join(f"{t:.2f}" for t in times) + " |")
    print()
    print("| preset | GPU x TP | block size | groups (full / sliding / state) x layers | page (bytes) | "
          "pool blocks at 0.9 | blocks of a 32k request |")
    print("|---|---|---|---|---|---|---|")
    for model, gpu, tp in (("gemma-3-27b", "h100-80gb", 2), ("gpt-oss-120b", "h100-80gb", 2),
                           ("qwen3-next-80b-a3b", "h200", 2)):
        r = make_runner(f"roofline:model={model},gpu={gpu},tp={tp}")
        lay = r.kv_layout
        print(f"| {model} | {gpu} x {tp} | {lay.block_size} | {' / '.join(map(str, lay.groups))} x {lay.group_size} | "
              f"{lay.page_bytes:,} | {r.kv_capacity_tokens(0.9) // lay.block_size:,} | {lay.peak(32_768):,} |")
    print()
    rnd = random.Random(7)
    n = 300
    trace = make_trace([i * 0.25 for i in range(n)], [rnd.randint(8_000, 24_000) for _ in range(n)],
                       [rnd.randint(200, 800) for _ in range(n)])
    config = ReplayConfig.from_dict({"model": "gemma-3-27b", "gpu": "h100-80gb", "tp": 2,
                                     "enable_prefix_caching": False})
    print("| replay: 300 requests, prompts 8k-24k, 4 req/s | median TTFT (s) | p99 TTFT (s) | median TPOT (ms) | "
          "preemptions | wall (s) |")
    print("|---|---|---|---|---|---|")
    import duckdb

    for label, r in (("every layer full", full), ("sliding windows", hybrid)):
        t0 = time.perf_counter()
        res = replay(trace, config, runner=r)
        wall = time.perf_counter() - t0
        reqs = res.requests  # noqa: F841 (read by DuckDB below)
        ttft, p99, tpot, pre = duckdb.sql(
            "select median(ttft_s), quantile_cont(ttft_s, 0.99), median(tpot_s), sum(num_preemptions) "
            "from reqs").fetchone()
        print(f"| {label} | {ttft:.2f} | {p99:.2f} | {tpot * 1e3:.1f} | {pre} | {wall:.1f} |")


if __name__ == "__main__":
    main()
