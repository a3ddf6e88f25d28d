"""What quantisation does to weights per GPU, KV capacity and step time (roofline defaults), and
DeepSeek-V3 from a config.json mirroring its public architecture fields (tests/test_runner_quantization.py).

    .venv/bin/python bench/bench_quantization.py

Prints Markdown (paste into bench/RESULTS_runners.md).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from servelab.runners.base import StepPlan, StepShape, make_runner

PLANS = {"decode 1 x 1k": StepPlan(StepShape(decode_seqs=1, decode_context_tokens=1000)),
         "decode 64 x 2k": StepPlan(StepShape(decode_seqs=64, decode_context_tokens=128_000)),
         "prefill 2048": StepPlan(StepShape(prefill_tokens=2048, prefill_seqs=1,
                                            prefill_attention_pairs=2048 * 2049 // 2))}
ROWS = [("llama-3.1-8b", "h100-80gb", 1, ""), ("llama-3.1-8b", "h100-80gb", 1, "fp8"),
        ("llama-3.1-8b", "a100-80gb", 1, ""), ("llama-3.1-8b", "a100-80gb", 1, "fp8"),
        ("llama-3.1-8b", "h100-80gb", 1, "awq"), ("llama-3.1-70b", "b200", 2, ""),
        ("llama-3.1-70b", "b200", 2, "nvfp4"), ("deepseek-v3", "h200", 8, "")]


def row(label: str, runner, tp: int) -> str:
    return (f"| {label} | {runner.gpu.name} x {tp} | {runner.model.quantization or 'bf16'} | "
            f"{runner.model.weight_bytes / tp / 2**30:.1f} | {runner.kv_capacity_tokens(0.9):,} | "
            + " | ".join(f"{runner.step_time(p) * 1e3:.2f}" for p in PLANS.values()) + " |")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_runner_quantization import DEEPSEEK_V3

    print("| model | GPU x TP | weights | weights per GPU (GiB) | KV tokens at 0.9 | "
          + " | ".join(PLANS) + " (ms) |")
    print("|---|---|---|---|---|" + "---|" * len(PLANS))
    with tempfile.TemporaryDirectory() as tmp:
        deepseek = Path(tmp) / "config.json"
        deepseek.write_text(json.dumps(DEEPSEEK_V3))
        for model, gpu, tp, quant in ROWS:
            path = str(deepseek) if model == "deepseek-v3" else model
            runner = make_runner(f"roofline:model={path},gpu={gpu},tp={tp}" + (f",quantization={quant}" if quant else ""))
            print(row("DeepSeek-V3 (its config.json: fp8, MLA)" if model == "deepseek-v3" else model, runner, tp))
    print(row("llama-3.1-8b, --kv-cache-dtype fp8", make_runner("roofline:model=llama-3.1-8b,kv_cache_dtype=fp8"), 1))


if __name__ == "__main__":
    main()
