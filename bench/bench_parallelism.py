"""What parallelism beyond one NVLink TP group does to the roofline's step time and to a replay:
TP2 over PCIe against the same link priced as NVLink (what the runner did before), DP2 with
expert-parallel MoE against one GPU, and pipeline against tensor parallelism.

    .venv/bin/python bench/bench_parallelism.py [--requests 400] [--rate 8]

The model shapes are written from the public config.json fields (Qwen/Qwen3-32B, Qwen/Qwen3-30B-A3B).
Prints Markdown (paste into bench/RESULTS_runners.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from servelab.runners.base import StepPlan, StepShape, make_runner

QWEN3_32B = {"_name_or_path": "Qwen/Qwen3-32B", "hidden_size": 5120, "intermediate_size": 25600,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64,
             "vocab_size": 151936, "torch_dtype": "bfloat16"}
QWEN3_30B_A3B = {"_name_or_path": "Qwen/Qwen3-30B-A3B", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
                 "torch_dtype": "bfloat16"}
PLANS = {
    "decode 1 x 1k ctx": StepPlan(StepShape(decode_seqs=1, decode_context_tokens=1000)),
    "decode 32 x 1k ctx": StepPlan(StepShape(decode_seqs=32, decode_context_tokens=32_000)),
    "decode 128 x 1k ctx": StepPlan(StepShape(decode_seqs=128, decode_context_tokens=128_000)),
    "prefill 2048": StepPlan(StepShape(prefill_tokens=2048, prefill_seqs=1, prefill_attention_pairs=2048 * 2049 // 2)),
}


def write(folder: Path, name: str, cfg: dict) -> str:
    path = folder / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return str(path)


def table(title: str, runners: dict) -> None:
    names = list(runners)
    print(f"\n**{title}** (step time, ms)\n")
    print("| batch | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for label, plan in PLANS.items():
        times = [runners[n].step_time(plan) for n in names]
        print(f"| {label} | " + " | ".join(f"{t * 1e3:.3f}" for t in times) + " | "
              + " | ".join(f"{t / times[0]:.3f}x" for t in times[1:]) + " |")


def replay_rows(model: str, rate: float, n: int) -> None:
    import numpy as np
    import pyarrow as pa
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig

    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    trace = pa.table({"request_id": pa.array(range(n), pa.int64()), "arrival_s": pa.array(arrivals),
                      "prompt_tokens": pa.array(rng.integers(200, 3000, n), pa.int32()),
                      "output_tokens": pa.array(rng.integers(50, 400, n), pa.int32())})
    print(f"\n**Replay**: {n} Poisson requests at {rate} req/s (prompts 200-3,000, outputs 50-400 tokens, seed 0), "
          "Qwen3-30B-A3B on H100-80GB\n")
    print("| layout | GPUs | engines | KV blocks per engine | mean TTFT (ms) | mean TPOT (ms) | mean E2E (s) |")
    print("|---|---|---|---|---|---|---|")
    for label, cfg in (("one GPU", ReplayConfig(model=model)),
                       ("--dp 2 --enable-expert-parallel", ReplayConfig(model=model, dp=2, enable_expert_parallel=True)),
                       ("--tp 2 (experts TP)", ReplayConfig(model=model, tp=2))):
        res = replay(trace, cfg)
        r = res.requests
        ttft = np.array([v for v in r.column("ttft_s").to_pylist() if v is not None])
        tpot = np.array([v for v in r.column("tpot_s").to_pylist() if v is not None])
        e2e = np.array([v for v in r.column("e2e_s").to_pylist() if v is not None])
        print(f"| {label} | {cfg.engine.replicas * cfg.gpus_per_replica} | {cfg.engines_per_replica} | "
              f"{res.meta['engine']['num_gpu_blocks']:,} | {ttft.mean() * 1e3:,.1f} | {tpot.mean() * 1e3:.2f} | "
              f"{e2e.mean():.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=8.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dense, moe = write(folder, "qwen3-32b", QWEN3_32B), write(folder, "qwen3-30b-a3b", QWEN3_30B_A3B)
        for gpu in ("rtx-pro-6000", "l40s"):
            pcie = make_runner(f"roofline:model={dense},gpu={gpu},tp=2")
            as_nvlink = dataclasses.replace(pcie, gpu=dataclasses.replace(pcie.gpu, link="nvlink"))
            table(f"Qwen3-32B TP2 on {gpu}: PCIe link terms against the same bandwidth priced as NVLink (before)",
                  {"NVLink-priced (before)": as_nvlink, "PCIe (now)": pcie})
        host = make_runner("roofline:model=llama-3.1-8b,gpu=rtx-4090,tp=2")
        table("Llama-3.1-8B TP2 on RTX 4090 (no peer-to-peer: through host memory)",
              {"NVLink-priced (before)": dataclasses.replace(host, gpu=dataclasses.replace(host.gpu, link="nvlink")),
               "PCIe via host (now)": host})
        table("Qwen3-30B-A3B on H100-80GB: one GPU against DP2 + EP (per DP rank, each with its own batch)",
              {"one GPU": make_runner(f"roofline:model={moe}"),
               "dp2 + ep2": make_runner(f"roofline:model={moe}", dp=2, enable_expert_parallel=True),
               "dp2 (experts TP over 2)": make_runner(f"roofline:model={moe}", dp=2)})
        table("Llama-3.1-70B on H100-80GB: TP4 against TP2 x PP2 (a batch's latency through the stages)",
              {"tp4": make_runner("roofline:model=llama-3.1-70b,tp=4"),
               "tp2 pp2": make_runner("roofline:model=llama-3.1-70b,tp=2,pp=2")})
        replay_rows(moe, args.rate, args.requests)


if __name__ == "__main__":
    main()
