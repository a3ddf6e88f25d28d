"""Multimodal requests (replay/core/encoder.py, runners/encoders.py): the encoder's time in the request's TTFT,
the encoder cache by image hash, the encoders' cost by hand, and the trace columns' validation."""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import make_trace
from helpers_engine import column
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.common.errors import InputError, ServelabError
from servelab.replay.core.protocols import StepPlan, StepShape
from servelab.runners.base import make_runner
from servelab.runners.encoders import ENCODERS, EncoderPricer, encode_flops_bytes
from servelab.traces.io import prepare

MODEL, GPU = "qwen2.5-7b", "h100-80gb"


def runner():
    return make_runner("roofline", model=MODEL, gpu=GPU)


def config(**engine) -> ReplayConfig:
    engine.setdefault("num_gpu_blocks", 20_000)
    return ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU)


def mm_trace(arrivals, prompts, outputs, hashes=None, **columns) -> pa.Table:
    table = make_trace(arrivals, prompts, outputs, **columns)
    if hashes is not None:
        table = table.append_column("image_hashes", pa.array(hashes, pa.list_(pa.int64())))
    return prepare(table, "test", "test")


def prefill_s(r, tokens: int) -> float:
    return r.step_time(StepPlan(StepShape(prefill_tokens=tokens, prefill_seqs=1, prefill_context_tokens=tokens,
                                          prefill_attention_pairs=tokens * (tokens + 1) // 2)))


def test_an_images_encoder_time_appears_exactly_in_its_ttft_on_an_idle_engine():
    r = runner()
    trace = mm_trace([0, 100], [1500, 1500], [4, 4], images=[1, 0], image_tokens=[1024, 0])
    result = replay(trace, config(vision_encoder="qwen2.5-vl-vit"), runner=r)
    encode = EncoderPricer(r, "qwen2.5-vl-vit", None)("image", 1024)
    assert encode > 0.001  # a 4,096-patch image through a 0.67 B-parameter ViT: milliseconds
    ttft = column(result, "ttft_s")
    assert ttft[1] == pytest.approx(prefill_s(r, 1500), rel=1e-12)  # text only: the prefill alone
    assert ttft[0] == pytest.approx(prefill_s(r, 1500) + encode, rel=1e-12)
    assert result.meta["encoder"] == {"items_encoded": 1, "cache_hits": 0, "encode_s": pytest.approx(encode)}


def test_the_encoder_cache_reuses_an_image_by_hash_until_evicted():
    r = runner()
    pricer = EncoderPricer(r, "qwen2.5-vl-vit", None)
    # A(h7) encodes; B(h7) hits; C(h8) encodes and, with room for one image, evicts h7; D(h7) encodes again
    trace = mm_trace([0, 100, 200, 300], [1500] * 4, [2] * 4, hashes=[[7], [7], [8], [7]],
                     images=[1] * 4, image_tokens=[1024] * 4)
    result = replay(trace, config(vision_encoder="qwen2.5-vl-vit", encoder_cache_tokens=1500), runner=r)
    base, encode = prefill_s(r, 1500), pricer("image", 1024)
    assert column(result, "ttft_s") == pytest.approx([base + encode, base, base + encode, base + encode], rel=1e-12)
    assert result.meta["encoder"]["cache_hits"] == 1
    roomy = replay(trace, config(vision_encoder="qwen2.5-vl-vit", encoder_cache_tokens=4096), runner=r)
    assert column(roomy, "ttft_s") == pytest.approx([base + encode, base, base + encode, base], rel=1e-12)


def test_several_images_are_encoded_each_and_video_and_audio_through_their_encoders():
    r = runner()
    vision = EncoderPricer(r, "qwen2.5-vl-vit", "whisper-large-v3-encoder")
    trace = mm_trace([0, 100, 200], [2000] * 3, [2] * 3, images=[3, 0, 0], image_tokens=[1000, 0, 0],
                     video_tokens=[0, 1200, 0], audio_tokens=[0, 0, 750])
    result = replay(trace, config(vision_encoder="qwen2.5-vl-vit", audio_encoder="whisper-large-v3-encoder"), runner=r)
    base = prefill_s(r, 2000)
    sizes = [334, 333, 333]  # 1,000 tokens split evenly, the first image taking the remainder
    want = [base + sum(vision("image", t) for t in sizes), base + vision("video", 1200), base + vision("audio", 750)]
    assert column(result, "ttft_s") == pytest.approx(want, rel=1e-12)
    assert result.meta["encoder"]["items_encoded"] == 5


def test_the_vit_costs_are_the_hand_count():
    qwen = ENCODERS["qwen2.5-vl-vit"]
    flops, nbytes, launches = encode_flops_bytes(qwen, 1024)
    patches, h, f = 4096, 1280, 3420
    linear = 32 * 2 * patches * (4 * h * h + 3 * h * f)
    attention = 4 * patches * h * (4 * patches + 28 * 64)  # 4 full-attention layers, 28 windowed (64 patches)
    merger = 2 * 1024 * (5120 * 5120 + 5120 * 3584)
    assert flops == linear + attention + merger
    params = 32 * (4 * h * h + 3 * h * f) + 5120 * 5120 + 5120 * 3584
    assert qwen.num_params == params and 0.6e9 < params < 0.7e9  # Qwen2.5-VL's ViT: ~0.67 B
    assert nbytes == params * 2 + 32 * patches * (8 * h + 2 * f) * 2 and launches == 8 * 32 + 2
    # a tiled encoder: 256 tokens are one tile, 257 two (the second padded)
    siglip = ENCODERS["siglip-so400m"]
    one, two = encode_flops_bytes(siglip, 256)[0], encode_flops_bytes(siglip, 257)[0]
    assert two - 2 * 257 * siglip.merger_params_per_token == pytest.approx(
        2 * (one - 2 * 256 * siglip.merger_params_per_token))


def test_multimodal_columns_are_validated_and_need_their_encoder():
    with pytest.raises(InputError, match="exceed prompt_tokens"):
        mm_trace([0], [100], [1], images=[1], image_tokens=[200])
    with pytest.raises(InputError, match="one hash per image"):
        mm_trace([0], [1000], [1], hashes=[[1, 2]], images=[1], image_tokens=[200])
    with pytest.raises(InputError, match=">= 0"):
        mm_trace([0], [1000], [1], audio_tokens=[-5])
    trace = mm_trace([0, 1], [1000, 1000], [1, 1], images=[0, 1], image_tokens=[0, 300])
    with pytest.raises(ServelabError, match="row 2.*vision_encoder"):
        replay(trace, config(), runner=runner())
    audio = mm_trace([0], [1000], [1], audio_tokens=[300])
    with pytest.raises(ServelabError, match="audio_encoder"):
        replay(audio, config(vision_encoder="qwen2.5-vl-vit"), runner=runner())
    with pytest.raises(ServelabError, match="unknown encoder 'qwen-vit'"):
        replay(trace, config(vision_encoder="qwen-vit"), runner=runner())
    with pytest.raises(ServelabError, match="audio encoder, not an image"):
        replay(trace, config(vision_encoder="whisper-large-v3-encoder"), runner=runner())
    lin = ReplayConfig(engine=EngineConfig(vision_encoder="qwen2.5-vl-vit", num_gpu_blocks=100), runner="linear:base=1")
    with pytest.raises(ServelabError, match="use the roofline runner"):
        replay(trace, lin)


def test_the_cli_replays_a_multimodal_trace(tmp_path):
    import json

    from click.testing import CliRunner

    from servelab.cli.main import cli
    from servelab.traces.io import write_trace

    path = tmp_path / "mm.parquet"
    write_trace(mm_trace([0, 0.5, 1.0], [1500] * 3, [8] * 3, hashes=[[1], [1], [2]], images=[1] * 3,
                         image_tokens=[1024] * 3), path, "test")
    out = tmp_path / "run"
    done = CliRunner().invoke(cli, ["replay", str(path), "-o", str(out), "--model", MODEL, "--gpu", GPU,
                                    "--vision-encoder", "qwen2.5-vl-vit"])
    assert done.exit_code == 0, done.output
    meta = json.loads((out / "run.json").read_text())
    assert meta["encoder"]["items_encoded"] == 2 and meta["encoder"]["cache_hits"] == 1


def encode_cluster(encode_replicas: int = 1, bandwidth_gbps: float = 10.0, latency_s: float = 0.001, **top):
    from servelab.replay.cluster.config import ClusterConfig

    cluster = ClusterConfig.from_dict({
        "pools": [{"name": "llm", "role": "mixed"},
                  {"name": "enc", "role": "encode", "replicas": encode_replicas, "vision_encoder": "qwen2.5-vl-vit"}],
        "links": [{"from": "enc", "to": "llm", "bandwidth_gbps": bandwidth_gbps, "latency_s": latency_s}]})
    engine = dict(num_gpu_blocks=20_000, **top)
    return ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU, cluster=cluster)


def test_an_encode_pool_encodes_first_then_the_embeddings_cross_the_link_then_the_prefill():
    r = runner()
    trace = mm_trace([0, 100], [1500, 1500], [4, 4], images=[1, 0], image_tokens=[1024, 0])
    result = replay(trace, encode_cluster(), runner=r)
    encode = EncoderPricer(r, "qwen2.5-vl-vit", None)("image", 1024)
    transfer = 0.001 + 1024 * 3584 * 2 / 10e9  # Qwen2.5-7B's hidden size, bf16 embeddings
    ttft = column(result, "ttft_s")
    assert ttft[0] == pytest.approx(encode + transfer + prefill_s(r, 1500), rel=1e-12)  # no second encode
    assert ttft[1] == pytest.approx(prefill_s(r, 1500), rel=1e-12)  # text only: straight to the LLM pool
    assert column(result, "encode_replica") == [1, None] and column(result, "replica") == [0, 0]
    assert column(result, "encode_s") == [pytest.approx(encode), None]
    assert column(result, "embedding_transfer_s") == [pytest.approx(transfer), None]
    assert result.meta["cluster"]["encode"]["requests"] == 1


def test_an_encode_replica_takes_one_request_at_a_time_and_the_pool_spreads_them():
    r = runner()
    trace = mm_trace([0, 0], [1500, 1500], [4, 4], hashes=[[1], [2]], images=[1, 1], image_tokens=[1024, 1024])
    encode = EncoderPricer(r, "qwen2.5-vl-vit", None)("image", 1024)
    one = replay(trace, encode_cluster(1), runner=r)
    assert column(one, "encode_wait_s") == [0.0, pytest.approx(encode)]  # the second waits for the first
    two = replay(trace, encode_cluster(2), runner=r)
    assert column(two, "encode_wait_s") == [0.0, 0.0] and column(two, "encode_replica") == [1, 2]


def test_encode_pool_configs_are_checked():
    from servelab.replay.cluster.config import ClusterConfig

    pools = [{"name": "llm", "role": "mixed"}, {"name": "enc", "role": "encode"}]
    with pytest.raises(ServelabError, match="no link from encode pool 'enc'"):
        ClusterConfig.from_dict({"pools": pools})
    with pytest.raises(ServelabError, match="at most one encode pool"):
        ClusterConfig.from_dict({"pools": pools + [{"name": "enc2", "role": "encode"}]})
    with pytest.raises(ServelabError, match="nothing flows into an encode pool"):
        ClusterConfig.from_dict({"pools": pools, "links": [{"from": "enc", "to": "llm"}, {"from": "llm", "to": "enc"}]})
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000), model=MODEL, gpu=GPU,
                       cluster=ClusterConfig.from_dict({"pools": pools, "links": [{"from": "enc", "to": "llm"}]}))
    with pytest.raises(ServelabError, match="vision_encoder"):
        replay(mm_trace([0], [1500], [4], images=[1], image_tokens=[1024]), cfg, runner=runner())
    with pytest.raises(ServelabError, match="an encode pool needs an encoder"):
        replay(mm_trace([0], [1500], [4]), cfg, runner=runner())


def test_servegen_can_keep_each_modalitys_tokens_with_the_same_draws():
    from pathlib import Path

    from servelab.traces.importers import import_trace

    folder = Path(__file__).parent / "fixtures" / "traces" / "servegen" / "mm-image"
    plain = import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=2).table
    mm = import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=2, modalities=True).table
    assert mm.select(plain.column_names).equals(plain)  # the same requests, lengths and prompts
    assert {"image_tokens"} <= set(mm.column_names) - set(plain.column_names)
    prompt = mm.column("prompt_tokens").to_pylist()
    parts = [sum(v) for v in zip(*(mm.column(c).to_pylist() for c in ("image_tokens", "audio_tokens",
                                                                        "video_tokens") if c in mm.column_names))]
    assert all(p <= q for p, q in zip(parts, prompt)) and any(p > 0 for p in parts)
    result = replay(prepare(mm.slice(0, 40), "test", "test"), config(vision_encoder="qwen2.5-vl-vit",
                                                                      audio_encoder="whisper-large-v3-encoder"),
                    runner=runner())
    assert result.meta["encoder"]["items_encoded"] > 0
