"""Hybrid attention from config.json (#29 items 2 and 6): KV kept per layer group as vLLM's hybrid KV
cache manager keeps it, capacity and blocks by hand, and the new presets."""

from __future__ import annotations

import json
import math
import random

import pytest
from servelab.common.errors import InputError, ServelabError
from servelab.replay.core.kv.kv_groups import KVLayout, LayerKinds
from servelab.runners.base import StepItem, StepPlan, StepShape, make_runner
from servelab.runners.presets import MODEL_SOURCES, MODELS, model_from_hf_config
from servelab.runners.roofline import kv_memory_bytes

GEMMA3_27B = {  # google/gemma-3-27b-it config.json (text_config), the fields read
    "model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208,
        "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16"}}
QWEN3_NEXT = {  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json, the fields read
    "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "num_experts": 512, "num_experts_per_tok": 10, "shared_expert_intermediate_size": 512, "vocab_size": 151936,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}


def _config(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# -- the acceptance goldens ------------------------------------------------------------------------
def test_deepseek_v3_mla_kv_is_70272_bytes_per_token():
    m = MODELS["deepseek-v3"]
    assert m.is_mla and not m.is_hybrid
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272


@pytest.mark.parametrize("block_size", [16, 32, 7])
def test_a_128_token_window_never_holds_more_than_ceil_w_over_bs_plus_one(block_size):
    layout = KVLayout(LayerKinds(full=0, sliding=4, state=0, window=128, token_bytes=1024), block_size)
    bound = math.ceil(128 / block_size) + 1
    # a long decode: one token per step, during the step and after it
    during = [layout.sliding_blocks(c, 1) for c in range(1, 20_000)]
    assert max(during) == bound  # reached, never passed
    assert max(layout.sliding_blocks(c, 0) for c in range(20_000)) <= bound
    # a long prefill in chunks of 512: between steps (the window's blocks) within the bound; while a
    # chunk computes, its own tokens' blocks too (vLLM allocates them before freeing at the next step)
    for chunk in (512, 100):
        for c in range(0, 20_000, chunk):
            assert layout.sliding_blocks(c + chunk, 0) <= bound
            assert layout.sliding_blocks(c, chunk) <= math.ceil((128 - 1 + chunk) / block_size) + 1
    # pool blocks: 4 layers of one kind make one group
    assert layout.groups == (0, 1, 0) and layout.between(10_000) <= bound


def test_the_window_bound_holds_over_a_replay_of_gpt_oss(monkeypatch):
    """gpt-oss-120b (window 128, alternate layers): after every step, every request's sliding group
    holds at most ceil(128 / 16) + 1 blocks, its full group ceil(tokens / 16), and the pool adds up."""
    from conftest import make_trace
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig
    from servelab.replay.core.kv.manager import KVManager

    seen = {"steps": 0, "most": 0}
    original = KVManager.slide

    def checked(self, items):
        original(self, items)
        full, sliding, state = self.layout.groups
        assert (full, sliding, state) == (1, 1, 0)
        for req, _ in items:
            c = req.num_computed_tokens
            window_blocks = req.kv_blocks - full * -(-c // 16)
            assert 0 <= window_blocks <= math.ceil(128 / 16) + 1, (c, req.kv_blocks)
            seen["most"] = max(seen["most"], window_blocks)
        seen["steps"] += 1

    monkeypatch.setattr(KVManager, "slide", checked)
    rnd = random.Random(3)
    n = 40
    trace = make_trace([i * 0.02 for i in range(n)], [rnd.randint(50, 3000) for _ in range(n)],
                       [rnd.randint(100, 800) for _ in range(n)])
    cfg = ReplayConfig.from_dict({"model": "gpt-oss-120b", "gpu": "h100-80gb", "tp": 2, "enable_prefix_caching": False,
                                  "max_num_batched_tokens": 512, "num_gpu_blocks": 1500})
    res = replay(trace, cfg)
    assert res.requests.column("status").to_pylist() == ["finished"] * n
    assert seen["steps"] > 100 and seen["most"] == math.ceil(128 / 16) + 1


def test_gemma3_27b_capacity_by_hand(tmp_path):
    m = model_from_hf_config(_config(tmp_path, GEMMA3_27B))
    assert (m.num_layers, m.sliding_layers, m.sliding_window, m.state_layers) == (62, 52, 1024, 0)
    r = make_runner(f"roofline:model={_config(tmp_path, GEMMA3_27B)},gpu=h100-80gb,tp=2", block_size=16)
    # 10 full and 52 sliding layers: group size 10 (52 >= 1.25 x 10), 1 full group + ceil(52 / 10) = 6
    # sliding groups; a page is 16 tokens x K and V x 8 KV heads per GPU x 128 x 2 bytes = 65,536 bytes
    layout = r.kv_layout
    assert (layout.group_size, layout.groups, layout.page_bytes) == (10, (1, 6, 0), 65_536)
    free = kv_memory_bytes(r.model, r.gpu, 2, 0.9, r.activation_tokens, r.logit_seqs, r.non_torch_bytes)
    blocks = int(free // (65_536 * 10))
    assert r.kv_capacity_tokens(0.9) == blocks * 16
    # a 4,000-token request, between steps: 250 full blocks + 6 groups x (ceil(4000/16) - floor(2977/16))
    assert layout.between(4000) == 250 + 6 * (250 - 186) == 634
    # the same memory as one group of 62 full-attention layers: 7 x 10 / 62 times fewer tokens fit
    dense = make_runner("roofline:model=llama-3.1-8b")  # (only to show the classes differ)
    assert type(dense).__name__ == "RooflineRunner" and type(r).__name__ == "HybridRoofline"


def test_qwen3_next_capacity_and_one_state_slot_per_sequence_by_hand(tmp_path):
    m = model_from_hf_config(_config(tmp_path, QWEN3_NEXT))
    assert (m.state_layers, m.sliding_layers) == (36, 0)
    # Gated DeltaNet: conv (2*16*128 + 32*128) x 3 values + recurrent 32 x 128 x 128 values, in bf16
    assert m.state_bytes == ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2 == 1_097_728
    assert m.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2  # only the 12 attention layers keep KV
    with pytest.raises(ServelabError, match="block_size = 544"):  # a page must hold a state: 16 x ceil(548864 / 16384)
        make_runner(f"roofline:model={_config(tmp_path, QWEN3_NEXT)},gpu=h200,tp=2", block_size=16)
    r = make_runner(f"roofline:model={_config(tmp_path, QWEN3_NEXT)},gpu=h200,tp=2", block_size=544)
    layout = r.kv_layout
    # 12 full + 36 state layers: group size 12, 1 full group and 3 state groups; a page is 544 tokens x
    # K and V x 1 KV head per GPU x 256 x 2 bytes = 557,056 bytes (>= a state per GPU: 548,864)
    assert (layout.group_size, layout.groups, layout.page_bytes) == (12, (1, 0, 3), 557_056)
    free = kv_memory_bytes(r.model, r.gpu, 2, 0.9, r.activation_tokens, r.logit_seqs, r.non_torch_bytes)
    assert r.kv_capacity_tokens(0.9) == int(free // (557_056 * 12)) * 544
    # state slots: one per state group per sequence, whatever its length
    for tokens in (1, 543, 544, 545, 100_000):
        assert layout.between(tokens) == -(-tokens // 544) + 3
    assert layout.between(0) == 0


def test_state_slots_over_a_replay_of_qwen3_next(monkeypatch):
    """Every running sequence holds its 3 state blocks and ceil(tokens / 544) full-attention blocks."""
    from conftest import make_trace
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig
    from servelab.replay.core.kv.manager import KVManager

    seen = []
    original = KVManager.slide

    def slide(self, items):
        original(self, items)
        for req, _ in items:
            if req.num_computed_tokens:
                assert req.kv_blocks == -(-req.num_computed_tokens // 544) + 3
                seen.append(req)

    monkeypatch.setattr(KVManager, "slide", slide)
    trace = make_trace([i * 0.05 for i in range(20)], [300 + 97 * i for i in range(20)], [50 + 13 * i for i in range(20)])
    cfg = ReplayConfig.from_dict({"model": "qwen3-next-80b-a3b", "gpu": "h200", "tp": 2, "block_size": 544,
                                  "enable_prefix_caching": False})
    res = replay(trace, cfg)
    assert len(seen) > 100
    assert res.requests.column("status").to_pylist() == ["finished"] * 20


# -- config.json readers ----------------------------------------------------------------------------
@pytest.mark.parametrize("extra, sliding, state", [
    ({"layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": 128}, 3, 0),  # gpt-oss
    ({"sliding_window": 4096, "max_position_embeddings": 32768}, 6, 0),  # Mistral-7B v0.1: every layer
    ({"sliding_window": 32768, "use_sliding_window": False}, 0, 0),  # Qwen2: off
    ({"sliding_window": 4096, "max_position_embeddings": 4096}, 0, 0),  # a window as long as the context
    ({"sliding_window": 4096, "model_type": "gemma2"}, 3, 0),
    ({"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 16, "mamba_expand": 2, "mamba_d_conv": 4}, 0, 3),
])
def test_layer_kinds_from_config(tmp_path, extra, sliding, state):
    cfg = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, **extra}
    m = model_from_hf_config(_config(tmp_path, cfg))
    assert (m.sliding_layers, m.state_layers) == (sliding, state)
    if state:  # Jamba's Mamba: d_inner = 2 x 256, conv 3 x 512 values, SSM 512 x 16 values, bf16
        assert m.state_bytes == (512 * 3 + 512 * 16) * 2


def test_a_bad_layer_type_names_the_file_and_field(tmp_path):
    cfg = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
           "vocab_size": 1000, "layer_types": ["full_attention", "chunked_attention"]}
    with pytest.raises(InputError, match="layer_types") as err:
        model_from_hf_config(_config(tmp_path, cfg))
    assert "config.json" in str(err.value) and "chunked_attention" in str(err.value)


# -- pricing ----------------------------------------------------------------------------------------
def test_gemma3_decode_past_the_window_reads_less_than_all_full_attention():
    from dataclasses import replace

    from servelab.runners.roofline import RooflineRunner

    hybrid = make_runner("roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2")
    full = RooflineRunner(replace(hybrid.model, sliding_layers=0, sliding_window=0), hybrid.gpu, 2,
                          hybrid.calibration, host_profile=hybrid.host_profile,
                          custom_all_reduce=hybrid.custom_all_reduce)
    short = StepPlan(StepShape(decode_seqs=8, decode_context_tokens=8 * 500))
    assert hybrid.step_time(short) == pytest.approx(full.step_time(short), rel=1e-12)  # inside the window: alike
    long = StepPlan(StepShape(decode_seqs=8, decode_context_tokens=8 * 32_000))
    kv_read_saved = 52 * 8 * (32_000 - 1024) * full._rates.kv_bytes_per_token / (
        full.gpu.hbm_bytes_per_s * full.calibration.decode_attention_eff_memory)
    assert full.step_time(long) - hybrid.step_time(long) == pytest.approx(kv_read_saved, rel=1e-9)


def test_items_price_each_context_and_shapes_price_the_mean():
    from servelab.replay.core.request import Request

    r = make_runner("roofline:model=gpt-oss-120b,gpu=h100-80gb,tp=2")
    reqs = [Request(i, 0.0, p, 10) for i, p in enumerate((50, 1000))]
    for req in reqs:
        req.num_computed_tokens, req.num_generated_tokens = req.prompt_tokens, 1  # decoding its 2nd token
    items = tuple(StepItem(req, req.num_computed_tokens, 1) for req in reqs)
    shape = StepShape(decode_seqs=2, decode_context_tokens=51 + 1001)
    assert r._windowed(StepPlan(shape, items)) == (0, 0, 51 + 128)
    assert r._windowed(StepPlan(shape)) == (0, 0, min(1052, 2 * 128))
    assert r.decode_affine(4) is None  # not affine: the engine prices every iteration


def test_prefix_caching_is_on_by_default_with_a_hybrid_model():
    """No refusal any more: the per-group cache (replay/core/kv/hybrid_prefix.py, tests/test_hybrid_prefix.py) runs."""
    from conftest import make_trace
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig

    result = replay(make_trace([0.0], [100], [5]), ReplayConfig.from_dict({"model": "gemma-3-27b", "tp": 2}))
    assert result.requests.column("status").to_pylist() == ["finished"]


# -- presets ---------------------------------------------------------------------------------------
def test_new_presets_cite_their_config_and_say_they_are_not_calibrated():
    assert {"deepseek-v3", "qwen3-next-80b-a3b", "gemma-3-27b", "gpt-oss-120b", "qwen3-vl-8b", "nemotron-h-8b",
            "qwen3-32b", "qwen3-30b-a3b"} <= set(MODEL_SOURCES)  # the often-served ones: tests/test_model_presets.py
    for name, source in MODEL_SOURCES.items():
        assert source.config_url.endswith(f"{MODELS[name].hf_id}/blob/main/config.json")
        assert source.calibrated is False


def test_presets_equal_their_configs_read(tmp_path):
    m = model_from_hf_config(_config(tmp_path, QWEN3_NEXT))
    p = MODELS["qwen3-next-80b-a3b"]
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size",
                "num_experts", "experts_per_token", "shared_ffn_size", "state_layers", "state_bytes"):
        assert getattr(m, key) == getattr(p, key), key
    # the Qwen3 presets of the real RTX PRO 6000 runs (bench/real_runs), against their config.json fields
    qwen3 = {"qwen3-32b": {"_name_or_path": "Qwen/Qwen3-32B", "hidden_size": 5120, "intermediate_size": 25600,
                           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                           "num_hidden_layers": 64, "vocab_size": 151936, "max_position_embeddings": 40960},
             "qwen3-30b-a3b": {"_name_or_path": "Qwen/Qwen3-30B-A3B-Instruct-2507", "hidden_size": 2048,
                               "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
                               "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
                               "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 262144}}
    for name, cfg in qwen3.items():
        q, pq = model_from_hf_config(_config(tmp_path, cfg)), MODELS[name]
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size",
                    "num_experts", "experts_per_token", "shared_ffn_size", "max_position_embeddings"):
            assert getattr(q, key) == getattr(pq, key), (name, key)
    g, pg = model_from_hf_config(_config(tmp_path, GEMMA3_27B)), MODELS["gemma-3-27b"]
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size",
                "sliding_window", "sliding_layers"):
        assert getattr(g, key) == getattr(pg, key), key


# -- the engine's bookkeeping with a hybrid layout -------------------------------------------------
HYBRID_CASES = {
    "sarathi, KV pressure": ("sarathi", {}, {"num_gpu_blocks": 400}),
    "srpt preempting, swap": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "preemption": "swap",
                                                          "swap_space_gb": 0.05}),
    "orca, reserve": ("orca", {}, {"num_gpu_blocks": 2000, "kv_allocation": "reserve"}),
    "vllm-v0, small chunks": ("vllm-v0", {}, {"num_gpu_blocks": 400, "max_num_batched_tokens": 256}),
}


@pytest.mark.parametrize("model", ["gpt-oss-120b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("case", sorted(HYBRID_CASES))
@pytest.mark.sampled(keep=4)
def test_bookkeeping_adds_up_after_every_event_with_layer_groups(monkeypatch, case, model):
    """KVManager.check after every event (used == the blocks the running requests hold over their
    groups) while sliding groups free blocks and state groups hold their slots, under preemption."""
    import servelab.assembly
    from helpers_engine import run, synthetic
    from test_engine_invariants import CheckedEngine

    policy, params, engine = HYBRID_CASES[case]
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=120, rate=40.0, seed=5)
    gpu, bs = ("h100-80gb", 16) if model == "gpt-oss-120b" else ("h200", 544)
    blocks = engine["num_gpu_blocks"] if bs == 16 else engine["num_gpu_blocks"] // 8
    before = CheckedEngine.events
    result = run(trace, policy=policy, runner=f"roofline:model={model},gpu={gpu},tp=2", policy_params=params,
                 **{**engine, "num_gpu_blocks": blocks, "block_size": bs, "enable_prefix_caching": False})
    assert CheckedEngine.events - before > 300
    assert set(result.requests.column("status").to_pylist()) <= {"finished", "rejected"}


def test_a_hybrid_runner_is_rebuilt_from_its_description():
    from servelab.runners.roofline import RooflineRunner

    r = make_runner("roofline:model=qwen3-next-80b-a3b,gpu=h200,tp=2")
    back = RooflineRunner.from_describe(json.loads(json.dumps(r.describe())))
    assert type(back) is type(r) and back.block_size == r.block_size == 544
    assert back.kv_layout == r.kv_layout and back.kv_capacity_tokens(0.9) == r.kv_capacity_tokens(0.9)
    plan = StepPlan(StepShape(prefill_tokens=300, prefill_seqs=1, prefill_context_tokens=300,
                              prefill_attention_pairs=300 * 301 // 2, decode_seqs=4, decode_context_tokens=9000))
    assert back.step_time(plan) == r.step_time(plan)


NEMOTRON_H_8B = {  # nvidia/Nemotron-H-8B-Base-8K config.json, the fields read
    "model_type": "nemotron_h", "hidden_size": 4096, "num_hidden_layers": 52, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504, "vocab_size": 131072,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "mlp_hidden_act": "relu2",
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def test_nemotron_h_from_its_pattern_by_hand(tmp_path):
    """24 Mamba-2 ('M'), 4 attention ('*') and 24 MLP-only ('-') layers: KV in 4 layers, a state in 24,
    neither in the MLP layers, whose MLP (squared ReLU: 2 matrices) is priced."""
    m = model_from_hf_config(_config(tmp_path, NEMOTRON_H_8B))
    p = MODELS["nemotron-h-8b"]
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size",
                "gated_mlp", "state_layers", "state_bytes", "mlp_only_layers", "max_position_embeddings"):
        assert getattr(m, key) == getattr(p, key), key
    assert (p.state_layers, p.attention_layers, p.mlp_only_layers, p.gated_mlp) == (24, 4, 24, False)
    # Mamba-2 state: conv (128 x 64 + 2 x 8 x 128) x (4 - 1) + SSM 128 x 64 x 128, bf16
    assert p.state_bytes == (8192 + 2048) * 3 * 2 + 128 * 64 * 128 * 2 == 2_158_592
    assert p.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16_384  # the 4 attention layers only
    # parameters: 28 mixers priced as attention (q, k, v, o), 24 MLPs of 2 matrices, a norm per layer
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    assert p.num_params == 28 * attention + 24 * 2 * 4096 * 21504 + 52 * 4096 + 2 * 131072 * 4096 + 4096
    # the linear FLOPs a step prices per token: the same mixers and MLPs, not 52 of each
    from servelab.runners.roofline import LINEAR_OPS, layer_ops

    ops = layer_ops(p, 1)
    assert sum(ops[n].flops_per_token * ops[n].calls for n in LINEAR_OPS) * 52 == pytest.approx(
        2 * (28 * attention + 24 * 2 * 4096 * 21504), rel=1e-12)


def test_nemotron_h_capacity_and_state_slots_by_hand():
    r = make_runner("roofline:model=nemotron-h-8b,gpu=h100-80gb,tp=1")
    layout = r.kv_layout
    # a page holds a state: 16 x ceil(2,158,592 / (16 x 4,096)) = 528 tokens; 4 full + 24 state
    # layers make groups of 4: 1 full group and 6 state groups, pages of 528 x 4,096 bytes
    assert layout.block_size == 16 * math.ceil(2_158_592 / (16 * 4096)) == 528
    assert layout.groups == (1, 0, 6) and layout.page_bytes == 528 * 4096 == 2_162_688
    # a 4,000-token request: ceil(4000 / 528) = 8 full blocks and one state block in each state group
    assert layout.between(4000) == 8 + 6
    free = kv_memory_bytes(r.model, r.gpu, 1, 0.9, r.activation_tokens, r.logit_seqs, r.non_torch_bytes)
    assert r.kv_capacity_tokens(0.9) == int(free // (2_162_688 * 4)) * 528


@pytest.mark.parametrize("pattern, match", [("M-M*", "layers for 52"), ("ME" * 26, "layer 'E'")])
def test_a_bad_nemotron_h_pattern_names_the_file_and_field(tmp_path, pattern, match):
    with pytest.raises(InputError, match=f"hybrid_override_pattern.*{match}|{match}.*hybrid_override_pattern"):
        model_from_hf_config(_config(tmp_path, {**NEMOTRON_H_8B, "hybrid_override_pattern": pattern}))


def test_blocks_to_finish_covers_a_whole_prompt_in_one_step_and_the_window_after():
    from servelab.replay.core.kv.manager import KVManager
    from servelab.replay.core.request import Request

    layout = KVLayout(LayerKinds(full=18, sliding=18, state=0, window=128, token_bytes=1024), 16, 8192)
    kv = KVManager(100_000, 16, layout=layout)
    # a 10,000-token prompt computed in one step (a policy that does not chunk): 625 blocks in each group
    assert kv.blocks_to_finish(Request(0, 0.0, 10_000, 100)) == 625 + 625
    # a short prompt with a long output: the full group grows, the window stays ceil((127 + 8192) / 16) + 1
    assert kv.blocks_to_finish(Request(1, 0.0, 100, 20_000)) == 1257 + 521
    assert kv.can_ever_fit(Request(2, 0.0, 100, 20_000))


def test_a_swap_moves_a_pool_blocks_bytes():
    """Swapping with layer groups: a pool block is a page in each of group_size layers on every GPU."""
    from servelab.assembly import build_replicas
    from servelab.replay.config import ReplayConfig

    r = make_runner("roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2", block_size=16)
    assert r.kv_block_bytes == 65_536 * 10 * 2
    cfg = ReplayConfig.from_dict({"model": "gemma-3-27b", "tp": 2, "enable_prefix_caching": False,
                                  "preemption": "swap", "swap_space_gb": 1.0})
    kv = build_replicas(cfg, r, 1000)[0].kv
    assert kv.bytes_per_block == 1_310_720 and kv.host_total == int(1e9 // 1_310_720)
