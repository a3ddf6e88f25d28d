"""Prefix caching per layer group (replay/core/kv/hybrid_prefix.py) on a shared-prefix trace: Gemma-3-27B on
2 x H100 (52 of 62 layers slide over 1,024 tokens), its hit rate and TTFT with the cache on and off,
and the same for Qwen3-Next-80B-A3B (state layers: hits only where a state was saved).

    .venv/bin/python bench/bench_hybrid_prefix.py
"""

from __future__ import annotations

import time

import duckdb

from servelab.api import replay
from servelab.replay.config import ReplayConfig
from servelab.traces.synth import synth_trace

N = 600


def main() -> None:
    # 600 requests at 6/s: a 4,096-token system prompt shared by one of 4 groups, then 200-2,000 new tokens
    trace = synth_trace(n=N, rate=6.0, arrival="poisson", prompt="lognormal:800:0.6", output="lognormal:150:0.8",
                        shared_prefix_tokens=4096, prefix_groups=4, prefix_block_tokens=16, seed=11)
    print(f"| model, 2 GPUs | prefix caching | hit rate (cached / prompt tokens) | median TTFT (ms) | p99 TTFT (ms) "
          "| median TPOT (ms) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for model, gpu, bs in (("gemma-3-27b", "h100-80gb", 16), ("qwen3-next-80b-a3b", "h200", 544)):
        for caching in (False, True):
            config = ReplayConfig.from_dict({"model": model, "gpu": gpu, "tp": 2, "block_size": bs,
                                             "enable_prefix_caching": caching})
            t0 = time.perf_counter()
            res = replay(trace, config)
            wall = time.perf_counter() - t0
            reqs = res.requests  # noqa: F841 (read by DuckDB below)
            hit, ttft, p99, tpot = duckdb.sql(
                "select sum(cached_tokens) / sum(prompt_tokens), median(ttft_s), quantile_cont(ttft_s, 0.99), "
                "median(tpot_s) from reqs").fetchone()
            print(f"| {model}, {gpu} | {'on' if caching else 'off'} | {hit:.1%} | {ttft * 1e3:.1f} | "
                  f"{p99 * 1e3:.1f} | {tpot * 1e3:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
