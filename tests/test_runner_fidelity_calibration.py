"""Physics floors for every preset and host profile, the vLLM-style KV derivation against a real log,
and the named host profiles."""

from __future__ import annotations

import json

import pytest
from servelab.common.errors import ServelabError
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.presets import GPUS, MODELS
from servelab.runners.roofline import (
    RooflineRunner,
    load_calibration,
    load_real_calibration_file,
)

HOSTS = ("vidur-2023", *load_real_calibration_file()["host_profiles"])


def _fitting_runners(gpu: str, host: str, keep):
    """(preset, tp, roofline runner) for every preset ``keep`` accepts at each TP that divides its
    heads, where the model fits the GPU's memory (the runner's own ``_fits``: KV room at 0.9 utilisation)."""
    for m in MODELS.values():
        if not keep(m):
            continue
        for tp in (1, 2, 4, 8):
            if m.num_kv_heads % tp or m.num_heads % tp:
                continue
            r = make_runner(f"roofline:model={m.name},gpu={gpu},tp={tp},host={host}")
            if r._fits():
                yield m, tp, r


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_physics_floors_hold_for_every_preset(gpu, host):
    """decode >= (weights + KV read) / HBM bandwidth; prefill >= linear-layer FLOPs / peak, by hand."""
    g = GPUS[gpu]
    checked = 0
    # (not tiny nor the MoE, latent and hybrid presets: those have the next test's floors)
    for m, tp, r in _fitting_runners(gpu, host, lambda m: not (m.name == "tiny" or m.is_moe or m.is_mla or m.is_hybrid)):
        checked += 1
        n, context = 32, 32 * 2000
        kv_read = context * 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes / tp
        decode = r.step_time(StepPlan(StepShape(decode_seqs=n, decode_context_tokens=context)))
        assert decode >= (m.weight_bytes / tp + kv_read) / g.hbm_bytes_per_s * 0.999
        t = 4096
        per_token = 2 * m.num_layers * (m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size
                                        + 3 * m.hidden_size * m.ffn_size)
        prefill = r.step_time(StepPlan(StepShape(prefill_tokens=t, prefill_seqs=1,
                                                 prefill_attention_pairs=t * (t + 1) // 2)))
        assert prefill >= per_token * t / tp / g.peak_flops
    assert checked > 0


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_physics_floors_hold_for_every_moe_latent_and_hybrid_preset(gpu, host):
    """The same floors for the presets a dense formula does not cover (DeepSeek-V3, Qwen3-Next,
    Gemma 3, gpt-oss, Nemotron-H): a decode reads at least the weights it uses (every layer's dense weights, the
    LM head and the experts its tokens route to) and the KV of each layer group (a sliding layer at
    most its window per sequence, a state layer its state, read and written); a prefill computes at
    least the active linear layers' FLOPs at the format's tensor-core rate."""
    from servelab.runners.quant import compute_speedup, weight_format

    g = GPUS[gpu]
    checked = 0
    for m, tp, r in _fitting_runners(gpu, host, lambda m: m.is_moe or m.is_mla or m.is_hybrid):
        checked += 1
        n, context = 32, 32 * 2000
        touched = m.experts_touched(n) / m.num_experts if m.is_moe else 1.0
        embedding = 0 if m.tied_embeddings else m.vocab_size * m.hidden_size * m.dtype_bytes
        weights = (m.weight_bytes - m.expert_weight_bytes * (1 - touched) - embedding) / tp
        token_layer = m.kv_bytes_per_token_layer / (1 if m.is_mla else tp)
        full = m.attention_layers - m.sliding_layers
        kv = token_layer * (full * context + m.sliding_layers * min(context, n * m.sliding_window))
        kv += m.state_layers * 2 * m.state_bytes / tp * n
        decode = r.step_time(StepPlan(StepShape(decode_seqs=n, decode_context_tokens=context)))
        assert decode >= (weights + kv) / g.hbm_bytes_per_s * 0.999, (m.name, tp)
        h, t = m.hidden_size, 4096
        attention = sum(m.mla_projection_params()) if m.is_mla else h * (m.q_size + 2 * m.kv_size) + m.q_size * h
        mlp = 3 * h * (m.experts_per_token * m.ffn_size + m.shared_ffn_size) if m.is_moe else 3 * h * m.ffn_size
        moe_layers = m.num_layers - m.dense_layers
        per_token = 2 * (m.num_layers * attention + moe_layers * mlp + m.dense_layers * 3 * h * m.dense_ffn_size)
        if m.mlp_only_layers:  # Nemotron-H: mixer layers (attention-shaped) and 2-matrix MLP layers apart
            per_token = 2 * ((m.num_layers - m.mlp_only_layers) * attention
                             + m.mlp_only_layers * (3 if m.gated_mlp else 2) * h * m.ffn_size)
        speedup = compute_speedup(weight_format(m.quantization), g.fp8, g.fp4) if m.quantization else 1.0
        prefill = r.step_time(StepPlan(StepShape(prefill_tokens=t, prefill_seqs=1, prefill_context_tokens=t,
                                                 prefill_attention_pairs=t * (t + 1) // 2)))
        assert prefill >= per_token * t / tp / (g.peak_flops * speedup), (m.name, tp)
    assert checked > 0


def test_derived_gpu_calibration_scales_and_caps_the_base_efficiencies():
    base, derived = load_calibration("a40"), load_calibration("rtx4090")
    scales = load_real_calibration_file()["derived_gpus"]["rtx4090"]
    for name, op in base.ops.items():
        assert derived.ops[name].eff_memory == pytest.approx(min(1.0, op.eff_memory * scales["memory_scale"]))
        assert derived.ops[name].latency_s == op.latency_s
        assert 0 < derived.ops[name].eff_compute <= 1 and 0 < derived.ops[name].eff_memory <= 1


def test_every_gpu_preset_says_whether_it_is_calibrated():
    assert {g for g, p in GPUS.items() if p.calibrated} == {"a100-80gb", "h100-80gb", "a40"}
    assert {"rtx-4090", "rtx-pro-6000", "l40s", "a100-40gb", "h100-pcie", "h100-80gb", "h200", "b200",
            "mi300x"} <= set(GPUS)


def test_kv_capacity_as_vllm_derives_it_matches_the_h100_log():
    # vLLM 0.11.0, Llama-2-7B, H100-SXM, gpu_memory_utilization 0.9, max_num_batched_tokens 4096,
    # max_num_seqs 256: its log says num_gpu_blocks 7438 (shared/calibration/real_vllm/.../vllm.log)
    r = make_runner("roofline:model=llama-2-7b,gpu=h100-80gb,host=vllm-v1-cudagraph",
                    max_num_batched_tokens=4096, max_num_seqs=256)
    assert abs(r.kv_capacity_tokens(0.9) // 16 - 7438) <= 8  # within 0.1%
    # the activation reserve follows max_num_batched_tokens: a smaller budget leaves more KV
    small = make_runner("roofline:model=llama-2-7b,gpu=h100-80gb,host=vllm-v1-cudagraph",
                        max_num_batched_tokens=1024, max_num_seqs=256)
    m = MODELS["llama-2-7b"]
    act_per_token = (3 * m.ffn_size + 2 * m.hidden_size) * m.dtype_bytes
    assert small.kv_capacity_tokens(0.9) - r.kv_capacity_tokens(0.9) == pytest.approx(
        3072 * act_per_token / m.kv_bytes_per_token, abs=1)


def test_host_profile_cuts_small_batch_overheads_only_and_round_trips():
    old = make_runner("roofline:model=llama-3.1-8b,host=vidur-2023")
    new = make_runner("roofline:model=llama-3.1-8b")  # the default profile
    decode = StepPlan(StepShape(decode_seqs=8, decode_context_tokens=8000))
    assert new.step_time(decode) < old.step_time(decode)
    profile = new.host_profile
    # above the CUDA-graph size the launch latencies are back; only CPU and GEMM efficiency differ
    assert profile.graph_max_tokens == 512 and 0 < profile.launch_scale < 1
    again = RooflineRunner.from_describe(json.loads(json.dumps(new.describe())))
    big = StepPlan(StepShape(prefill_tokens=2048, prefill_seqs=1, prefill_attention_pairs=2048 * 2049 // 2))
    for p in (decode, big):
        assert again.step_time(p) == new.step_time(p)
    with pytest.raises(ServelabError, match="unknown host profile 'v2'"):
        make_runner("roofline:host=v2")


MIXTRAL = {"_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16"}
QWEN3_MOE = {"_name_or_path": "Qwen/Qwen3-30B-A3B", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936}


def _config(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_models_from_hf_config_dense_gqa_mqa_and_moe(tmp_path):
    from servelab.runners.presets import model_from_hf_config

    m = model_from_hf_config(_config(tmp_path, MIXTRAL))
    # by hand, per layer: attention 4096 x (4096 + 2 x 1024) + 4096 x 4096, 8 experts x 3 x 4096 x 14336,
    # router 4096 x 8, two norms; + untied embeddings 2 x 32000 x 4096 + final norm
    per_layer = 4096 * 6144 + 4096 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert m.num_params == 32 * per_layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    assert (m.num_experts, m.experts_per_token, m.ffn_size) == (8, 2, 14336)
    q = model_from_hf_config(_config(tmp_path, QWEN3_MOE))
    assert (q.num_experts, q.experts_per_token, q.ffn_size, q.head_dim) == (128, 8, 768, 128)
    assert q.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    mqa = model_from_hf_config(_config(tmp_path, {**MIXTRAL, "num_key_value_heads": 1, "num_local_experts": None}))
    assert not mqa.is_moe and mqa.kv_bytes_per_token == 2 * 32 * 1 * 128 * 2
    mha = {k: v for k, v in MIXTRAL.items() if k not in ("num_key_value_heads", "num_local_experts")}
    assert model_from_hf_config(_config(tmp_path, mha)).num_kv_heads == 32
    with pytest.raises(ServelabError, match="column 'vocab_size': field missing"):
        model_from_hf_config(_config(tmp_path, {k: v for k, v in MIXTRAL.items() if k != "vocab_size"}))


def test_moe_step_reads_the_experts_its_tokens_route_to(tmp_path):
    path = _config(tmp_path, MIXTRAL)
    r = make_runner(f"roofline:model={path},tp=2")
    m, g = r.model, r.gpu
    assert m.experts_touched(1) == pytest.approx(2.0)  # 8 (1 - (6/8)^1)
    assert m.experts_touched(512) == pytest.approx(8.0)
    expert_bytes = 3 * 4096 * 14336 * 2 / 2  # per shard
    attention_bytes = (4096 * 6144 + 4096 * 4096) * 2 / 2
    one = r.step_time(StepPlan(StepShape(decode_seqs=1)))
    assert one >= 32 * (attention_bytes + 2 * expert_bytes) / g.hbm_bytes_per_s
    many = r.step_time(StepPlan(StepShape(decode_seqs=256)))
    assert many >= 32 * (attention_bytes + 8 * expert_bytes) / g.hbm_bytes_per_s
    # and a decode of one token reads far less than every expert
    assert one < 32 * (attention_bytes + 8 * expert_bytes) / g.hbm_bytes_per_s


def test_expert_parallel_prices_all_to_all_dispatch_and_combine_by_hand(tmp_path):
    path = _config(tmp_path, MIXTRAL)
    tp = make_runner(f"roofline:model={path},tp=4")
    ep = make_runner(f"roofline:model={path},tp=4,ep=4")
    c = ep.calibration  # the h100 NCCL fit prices the all-to-all: latency + bytes / (450 GB/s x eff)
    # vLLM's default all2all backend all-gathers the hidden states over the 4 GPUs (and reduce-scatters the
    # results): 256 tokens, 64 on each GPU, each GPU's moved to the 3 others: 3 x 64 x 4096 x 2 B = 1,572,864 B
    # whatever the 2 experts of each token (NVLink adds no step latency)
    assert ep.all_to_all_s(256) == pytest.approx(c.all_reduce_latency_s + 1_572_864 / (450e9 * c.all_reduce_eff),
                                                 rel=1e-12)
    assert tp.all_to_all_s(256) == 0.0
    # Per rank, EP reads touched/4 whole experts and TP 1/4 of each touched expert, and both compute
    # T k / 4 token-expert pairs at full width: the same expected work. What changes is the
    # communication: per layer one all-reduce + dispatch + combine instead of two all-reduces.
    for tokens in (1, 256):
        plan = StepPlan(StepShape(prefill_tokens=tokens, prefill_seqs=1))
        expected = 32 * (2 * ep.all_to_all_s(tokens) - tp.all_reduce_s(tokens))
        assert ep.step_time(plan) - tp.step_time(plan) == pytest.approx(expected, rel=1e-9)
    # 1 token: 3 x 0.25 x 8192 B = 6,144 B per rank
    assert ep.all_to_all_s(1) == pytest.approx(c.all_reduce_latency_s + 6144 / (450e9 * c.all_reduce_eff), rel=1e-12)


def test_expert_parallel_is_checked(tmp_path):
    path = _config(tmp_path, MIXTRAL)
    with pytest.raises(ServelabError, match="ep=2 needs a mixture-of-experts model, ep equal to tp"):
        make_runner("roofline:model=llama-3.1-8b,tp=2,ep=2")
    with pytest.raises(ServelabError, match="ep equal to tp"):
        make_runner(f"roofline:model={path},tp=4,ep=2")
    from servelab.runners.roofline import RooflineRunner

    r = make_runner(f"roofline:model={path},tp=4,ep=4")
    assert RooflineRunner.from_describe(r.describe()).ep == 4
