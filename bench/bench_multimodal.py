"""What multimodal requests' encoder stage does to step time and a replay (roofline, Qwen2.5-7B on one
H100-80GB with Qwen2.5-VL's ViT): one item's encoder time by preset and size, and a replay where half
the requests carry an image drawn from a Zipf-popular pool, under encoder caches of several sizes
(docs/engine.md "Multimodal requests"), and the same trace at 24 req/s with the encoder in the LLM
replicas' steps or on an encode pool (docs/cluster.md "Encode pools").

    .venv/bin/python bench/bench_multimodal.py

Prints Markdown (paste into bench/RESULTS_runners.md).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.encoders import ENCODERS, EncoderPricer, encode_flops_bytes
from servelab.traces.io import prepare
from servelab.traces.synth import synth_trace

MODEL, GPU = "qwen2.5-7b", "h100-80gb"


def encoder_table(runner) -> None:
    print("| encoder | item tokens | TFLOP | encode (ms) | the LLM's 2,048-token prefill (ms) |")
    print("|---|---|---|---|---|")
    prefill = runner.step_time(StepPlan(StepShape(prefill_tokens=2048, prefill_seqs=1, prefill_context_tokens=2048,
                                                  prefill_attention_pairs=2048 * 2049 // 2)))
    for name, sizes in (("qwen2.5-vl-vit", (256, 1024, 4096)), ("siglip-so400m", (256, 1024)),
                        ("whisper-large-v3-encoder", (750,))):
        preset = ENCODERS[name]
        price = EncoderPricer(runner, name if preset.modality == "image" else None,
                              name if preset.modality == "audio" else None)
        for tokens in sizes:
            flops = encode_flops_bytes(preset, tokens)[0]
            kind = "image" if preset.modality == "image" else "audio"
            print(f"| {name} | {tokens:,} | {flops / 1e12:.2f} | {price(kind, tokens) * 1e3:.2f} | {prefill * 1e3:.2f} |")


def mm_trace(seed: int = 11, rate: float = 6.0) -> tuple[pa.Table, pa.Table]:
    base = synth_trace(n=2000, rate=rate, prompt="lognormal:600:0.8", output="lognormal:150:0.8", seed=seed)
    rng = np.random.default_rng(seed)
    n = base.num_rows
    has = rng.random(n) < 0.5
    weights = 1.0 / np.arange(1, 201) ** 1.0
    pool = rng.choice(200, size=n, p=weights / weights.sum())  # 200 distinct images, Zipf(1) popular
    image_tokens = np.where(has, 1024, 0)
    prompt = base.column("prompt_tokens").to_numpy() + image_tokens
    table = base.set_column(base.column_names.index("prompt_tokens"), "prompt_tokens", pa.array(prompt, pa.int32()))
    text = prepare(table, "bench", "bench")
    table = table.append_column("images", pa.array(has.astype(np.int32)))
    table = table.append_column("image_tokens", pa.array(image_tokens.astype(np.int32)))
    table = table.append_column("image_hashes", pa.array([[int(p)] if h else [] for p, h in zip(pool, has)],
                                                         pa.list_(pa.int64())))
    return text, prepare(table, "bench", "bench")


def replay_table(runner) -> None:
    text, mm = mm_trace()
    print("| setting | items encoded | cache hits | encoder s | mean TTFT (ms) | p99 TTFT (ms) | mean TPOT (ms) |")
    print("|---|---|---|---|---|---|---|")
    cases = [("images priced as text (no encoder)", text, {}),
             ("qwen2.5-vl-vit, cache 2,048 tokens (default)", mm, {"vision_encoder": "qwen2.5-vl-vit"}),
             ("qwen2.5-vl-vit, no cache", mm, {"vision_encoder": "qwen2.5-vl-vit", "encoder_cache_tokens": 0}),
             ("qwen2.5-vl-vit, cache 65,536 tokens", mm, {"vision_encoder": "qwen2.5-vl-vit",
                                                          "encoder_cache_tokens": 65536})]
    for label, trace, engine in cases:
        r = replay(trace, ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU), runner=runner)
        ttft = np.array(r.requests.column("ttft_s").to_pylist(), dtype=float)
        tpot = np.array([v for v in r.requests.column("tpot_s").to_pylist() if v is not None], dtype=float)
        enc = r.meta.get("encoder", {"items_encoded": 0, "cache_hits": 0, "encode_s": 0.0})
        print(f"| {label} | {enc['items_encoded']} | {enc['cache_hits']} | {enc['encode_s']:.2f} | "
              f"{ttft.mean() * 1e3:.1f} | {np.percentile(ttft, 99) * 1e3:.1f} | {tpot.mean() * 1e3:.2f} |")


def cluster_table(runner) -> None:
    from servelab.replay.cluster.config import ClusterConfig

    _, mm = mm_trace(rate=24.0)
    print("| topology (GPUs) | mean TTFT (ms) | p99 TTFT (ms) | mean TPOT (ms) | p99 TPOT (ms) | mean encode wait (ms) |")
    print("|---|---|---|---|---|---|")
    enc = {"vision_encoder": "qwen2.5-vl-vit", "encoder_cache_tokens": 0}
    cases = [("2 mixed, encoder in the admitting step (2)", {"replicas": 2, "router": "least-outstanding", **enc}, None),
             ("3 mixed, encoder in the admitting step (3)", {"replicas": 3, "router": "least-outstanding", **enc}, None),
             ("2 mixed + 1 encode, 25 GB/s link (3)", {"router": "least-outstanding"}, ClusterConfig.from_dict({
                 "pools": [{"name": "llm", "role": "mixed", "replicas": 2},
                           {"name": "enc", "role": "encode", **enc}],
                 "links": [{"from": "enc", "to": "llm", "bandwidth_gbps": 25.0, "latency_s": 0.0005}]}))]
    for label, engine, cluster in cases:
        r = replay(mm, ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU, cluster=cluster),
                   runner=runner)
        ttft = np.array(r.requests.column("ttft_s").to_pylist(), dtype=float)
        tpot = np.array([v for v in r.requests.column("tpot_s").to_pylist() if v is not None], dtype=float)
        wait = r.meta.get("cluster", {}).get("encode", {}).get("mean_wait_s")
        print(f"| {label} | {ttft.mean() * 1e3:.1f} | {np.percentile(ttft, 99) * 1e3:.1f} | {tpot.mean() * 1e3:.2f} | "
              f"{np.percentile(tpot, 99) * 1e3:.2f} | {'-' if wait is None else f'{wait * 1e3:.2f}'} |")


def main() -> None:
    runner = make_runner("roofline", model=MODEL, gpu=GPU)
    encoder_table(runner)
    print()
    replay_table(runner)
    print()
    cluster_table(runner)


if __name__ == "__main__":
    main()
