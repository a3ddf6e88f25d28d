"""What multi-LoRA serving does to step time, KV capacity and a replay (roofline, Llama-3.1-8B on one
H100-80GB): the adapters' shrink/expand kernels per step by rank and adapters per batch, the slots'
memory, and a replay of a Zipf-popular adapter mix under max_loras caps (docs/engine.md "Multi-LoRA").

    .venv/bin/python bench/bench_lora.py

Prints Markdown (paste into bench/RESULTS_runners.md).
"""

from __future__ import annotations

import numpy as np

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.traces.synth import synth_trace
from servelab.traces.transforms import lora_adapters

MODEL, GPU = "llama-3.1-8b", "h100-80gb"
PLANS = {"decode 64 x 2k": (StepPlan(StepShape(decode_seqs=64, decode_context_tokens=128_000)), 64),
         "prefill 2048": (StepPlan(StepShape(prefill_tokens=2048, prefill_seqs=1,
                                              prefill_attention_pairs=2048 * 2049 // 2)), 2048)}


def step_table(runner) -> None:
    print("| adapters in batch x rank | " + " | ".join(f"{p} (ms)" for p in PLANS) + " |")
    print("|---|" + "---|" * len(PLANS))
    for adapters, rank in ((0, 0), (1, 8), (1, 16), (1, 64), (8, 16), (8, 64)):
        cells = []
        for plan, tokens in PLANS.values():
            base = runner.step_time(plan)
            extra = runner.lora_step_s(tokens * rank, [rank] * adapters) if adapters else 0.0
            cells.append(f"{(base + extra) * 1e3:.2f}" + (f" (+{extra / base:.0%})" if adapters else ""))
        print(f"| {'none' if not adapters else f'{adapters} x r{rank}'} | " + " | ".join(cells) + " |")


def replay_table(runner) -> None:
    base = synth_trace(n=3000, rate=12.0, prompt="lognormal:700:1.0", output="lognormal:150:1.0", seed=7)
    trace = lora_adapters(base, 32, zipf_s=1.0, seed=7)
    print("| setting | KV blocks | adapter loads (disk/host) | load s | mean TTFT (s) | p99 TTFT (s) | mean TPOT (ms) | span (s) |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [("no LoRA (same lengths)", base, {}), ("max_loras 8, rank 16", trace, {"max_loras": 8}),
             ("max_loras 8, max_cpu_loras 32", trace, {"max_loras": 8, "max_cpu_loras": 32}),
             ("max_loras 8, rank 64", trace, {"max_loras": 8, "lora_rank": 64}),
             ("max_loras 2, rank 16", trace, {"max_loras": 2}),
             ("max_loras 32, rank 16", trace, {"max_loras": 32})]
    for label, t, engine in cases:
        r = replay(t, ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU), runner=runner)
        ttft = np.array(r.requests.column("ttft_s").to_pylist(), dtype=float)
        tpot = np.array([v for v in r.requests.column("tpot_s").to_pylist() if v is not None], dtype=float)
        lora = r.meta.get("lora", {"loads_from_disk": 0, "loads_from_host": 0, "load_s": 0.0})
        print(f"| {label} | {r.meta['engine']['num_gpu_blocks']:,} | {lora['loads_from_disk']}/{lora['loads_from_host']} | "
              f"{lora['load_s']:.2f} | {ttft.mean():.3f} | {np.percentile(ttft, 99):.3f} | {tpot.mean() * 1e3:.1f} | "
              f"{r.meta['simulated_span_s']:.1f} |")


def main() -> None:
    runner = make_runner("roofline", model=MODEL, gpu=GPU)
    print(f"Adapter size: {runner.lora_params_per_rank:,} parameters per unit of rank; rank 16 bf16 = "
          f"{16 * runner.lora_params_per_rank * 2 / 1e6:.1f} MB\n")
    step_table(runner)
    print()
    replay_table(runner)


if __name__ == "__main__":
    main()
