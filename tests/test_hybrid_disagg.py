"""Disaggregated prefill/decode with a hybrid-attention model (#29 item 2): the transfer moves each layer
group's bytes (a full layer every token, a sliding layer the blocks of its window, a state layer its
state), the decode replica reserves what the groups hold for the next token, by hand."""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError


def _config(model: str, gpu: str, block_size: int, **extra) -> ReplayConfig:
    return ReplayConfig.from_dict({
        "model": model, "gpu": gpu, "tp": 2, "block_size": block_size, "num_gpu_blocks": 4000,
        "cluster": {"pools": [{"name": "p", "role": "prefill", "replicas": 1},
                              {"name": "d", "role": "decode", "replicas": 1}],
                    "links": [{"from": "p", "to": "d", "bandwidth_gbps": 10.0}]}, **extra})


def test_gemma3_moves_every_full_token_and_only_the_sliding_window():
    # 3,000 prompt tokens handed off. Whole model, a layer's KV is 2 x 16 KV heads x 128 x 2 = 8,192
    # bytes per token. 10 full layers move 3,000 tokens each; 52 sliding layers (window 1,024) only the
    # blocks they hold: from block floor((3000 - 1023) / 16) = 123, token 1,968: 1,032 tokens each.
    result = replay(make_trace([0.0], [3000], [4]), _config("gemma-3-27b", "h100-80gb", 16))
    assert result.requests.column("status").to_pylist() == ["finished"]
    moved = result.meta["cluster"]["transfers"]["bytes_moved"]
    assert moved == 8192 * (10 * 3000 + 52 * 1032) == 685_375_488
    # against every layer full: 62 x 3,000 tokens
    assert moved < 8192 * 62 * 3000 / 2


def test_qwen3_next_moves_its_attention_tokens_and_one_state_per_layer():
    # 12 full layers of 2 x 2 KV heads x 256 x 2 = 2,048 bytes per token; 36 states of 1,097,728 bytes
    result = replay(make_trace([0.0], [3000], [4]), _config("qwen3-next-80b-a3b", "h200", 544, num_gpu_blocks=600))
    assert result.requests.column("status").to_pylist() == ["finished"]
    assert result.meta["cluster"]["transfers"]["bytes_moved"] == 12 * 3000 * 2048 + 36 * 1_097_728


def test_the_pools_must_serve_one_hybrid_model():
    cfg = _config("gemma-3-27b", "h100-80gb", 16).to_dict()
    cfg["cluster"]["pools"][1]["model"] = "llama-3.1-8b"
    with pytest.raises(ServelabError, match="different models"):
        replay(make_trace([0.0], [300], [4]), ReplayConfig.from_dict(cfg))


@pytest.mark.parametrize("model, gpu, bs, blocks", [("gpt-oss-120b", "h100-80gb", 16, 600),
                                                    ("qwen3-next-80b-a3b", "h200", 544, 60)])
def test_bookkeeping_adds_up_after_every_event_across_the_handoff(monkeypatch, model, gpu, bs, blocks):
    """KVManager.check on both pools after every event (landing placeholders included), with prefix
    caching per group on the prefill pool and KV pressure on the decode pool."""
    import servelab.assembly
    from helpers_engine import synthetic
    from test_engine_invariants import CheckedEngine

    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=80, rate=20.0, seed=5, prompt="lognormal:500:0.6", output="lognormal:60:0.8",
                      shared_prefix_tokens=600, prefix_groups=3, prefix_block_tokens=16)
    before = CheckedEngine.events
    result = replay(trace, _config(model, gpu, bs, num_gpu_blocks=blocks))
    assert CheckedEngine.events - before > 200
    assert set(result.requests.column("status").to_pylist()) <= {"finished", "rejected"}
    assert result.meta["cluster"]["transfers"]["bytes_moved"] > 0
