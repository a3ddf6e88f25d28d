"""Quantisation and MLA: weight formats from config.json or --quantization change weight bytes, KV
capacity and GEMM throughput per GPU; --kv-cache-dtype fp8 halves the KV; MLA's latent KV size.

The DeepSeek-V3 config below mirrors the architecture fields of deepseek-ai/DeepSeek-V3's public
config.json (written here by hand, not copied). Physics floors: no GEMM is faster than its FLOPs at
the format's tensor-core peak or its (quantised) weight bytes at the HBM bandwidth.
"""

import dataclasses
import json

import pytest
from servelab.common.errors import InputError, ServelabError
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.presets import GPUS, get_gpu, model_from_hf_config
from servelab.runners.quant import WEIGHT_FORMATS, compute_speedup, from_hf_quantization_config, weight_format
from servelab.runners.roofline import LINEAR_OPS, layer_ops

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "_name_or_path": "deepseek-ai/DeepSeek-V3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _config(tmp_path, cfg, name="config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_deepseek_v3_shapes_mla_kv_and_parameter_count_by_hand(tmp_path):
    m = model_from_hf_config(_config(tmp_path, DEEPSEEK_V3))
    assert m.is_mla and m.quantization == "fp8" and m.head_dim == 192
    # MLA: one latent of 512 plus the 64-wide rotary key per token and layer, in bf16
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert dataclasses.replace(m, kv_cache_dtype="fp8").kv_bytes_per_token == 61 * 576 == 35_136
    h = 7168
    attention = (h * 1536 + 1536 * 128 * 192) + (h * 576 + 512 * 128 * 256) + 128 * 128 * h
    dense_mlp = 3 * 3 * h * 18432
    moe = 58 * (3 * h * 2048 * 257 + h * 256)  # 256 routed + 1 shared expert, and the router
    norms = 61 * (2 * h + 1536 + 512)
    assert m.num_params == 61 * attention + dense_mlp + moe + norms + 2 * 129280 * h + h == 671_026_404_352
    # FP8 with 128 x 128 block scales: one byte and a float32 per block for every linear weight
    other = 2 * 129280 * h + h + norms + 58 * h * 256
    assert m.weight_bytes == int((m.num_params - other) * (1 + 4 / 16384) + other * 2)


def test_deepseek_v3_fp8_fits_eight_h200(tmp_path):
    path = _config(tmp_path, DEEPSEEK_V3)
    r = make_runner(f"roofline:model={path},gpu=h200,tp=8")  # before: "weights alone need 163.5 GiB per GPU"
    from servelab.runners.roofline import activation_reserve_bytes

    free = get_gpu("h200").memory_bytes * 0.9 - r.model.weight_bytes / 8 - activation_reserve_bytes(
        r.model, 8, r.activation_tokens, r.logit_seqs, r.non_torch_bytes)
    assert r.model.weight_bytes / 8 / 2**30 == pytest.approx(78.4, abs=0.05)
    # the latent is not split by heads: every TP rank caches all of it
    assert r.kv_capacity_tokens(0.9) == int(free // 70_272)
    fp8_kv = make_runner(f"roofline:model={path},gpu=h200,tp=8,kv_cache_dtype=fp8")
    assert fp8_kv.kv_capacity_tokens(0.9) == int(free // 35_136)
    with pytest.raises(ServelabError, match=r"weights alone need 156\.2 GiB per GPU"):
        make_runner(f"roofline:model={path},gpu=h200,tp=8,quantization=none").kv_capacity_tokens(0.9)
    plan = StepPlan(StepShape(decode_seqs=32, decode_context_tokens=32_000))
    a, b = r.decode_affine(32)
    assert r.step_time(plan) == a + b * 32_000
    assert b == pytest.approx(61 * 576 * 2 / (get_gpu("h200").hbm_bytes_per_s * r.calibration.decode_attention_eff_memory))


def test_replay_runs_deepseek_v3_on_eight_h200(tmp_path):
    from conftest import make_trace
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig

    trace = make_trace([0.0, 0.1, 0.2], [500, 800, 300], [20, 10, 30])
    res = replay(trace, ReplayConfig(model=_config(tmp_path, DEEPSEEK_V3), gpu="h200", tp=8))
    assert res.requests.column("status").to_pylist() == ["finished"] * 3


@pytest.mark.parametrize("fmt, fp8_gpu, no_fp8_gpu, speedup", [  # peak ratio x 1.73/2 measured on an H200
    ("fp8", "h100-80gb", "a100-80gb", 1.73), ("fp8", "l40s", "a40", 1.73), ("fp8", "rtx-4090", "a100-80gb", 1.73),
    ("nvfp4", "b200", "h100-80gb", 3.46),
])
def test_gemm_throughput_follows_the_gpus_tensor_cores(fmt, fp8_gpu, no_fp8_gpu, speedup):
    for gpu, expected in ((fp8_gpu, speedup), (no_fp8_gpu, 1.0)):
        bf16 = make_runner(f"roofline:model=llama-3.1-8b,gpu={gpu}")
        q = make_runner(f"roofline:model=llama-3.1-8b,gpu={gpu},quantization={fmt}")
        for i, name in enumerate(layer_ops(bf16.model, 1)):
            # compute term per token: 1/speedup of bf16's on the linear layers, unchanged elsewhere
            ratio = q._ops[i][2] / bf16._ops[i][2] if bf16._ops[i][2] else 1.0
            assert ratio == pytest.approx(1 / expected if name in LINEAR_OPS else 1.0, rel=1e-12)
            # weights: the format's bytes per weight (with its scales) instead of 2
            fixed = q._ops[i][3] / bf16._ops[i][3] if bf16._ops[i][3] else None
            if name in LINEAR_OPS:
                assert fixed == pytest.approx(WEIGHT_FORMATS[fmt].bytes_per_weight / 2, rel=1e-12)


@pytest.mark.parametrize("gpu", GPUS.values(), ids=lambda g: g.name)
@pytest.mark.parametrize("fmt", ["", *WEIGHT_FORMATS])
def test_no_gemm_beats_its_flops_at_the_formats_peak_or_its_weight_bytes(gpu, fmt, tmp_path):
    model = f"roofline:model=llama-3.1-70b,gpu={gpu.name},tp=8" + (f",quantization={fmt}" if fmt else "")
    r = make_runner(model)
    speedup = compute_speedup(weight_format(fmt), gpu.fp8, gpu.fp4) if fmt else 1.0
    assert speedup <= {"": 1, "fp8": 2 if gpu.fp8 else 1, "int8": 2, "fp4": 4 if gpu.fp4 else 1,
                       "bf16": 1}[WEIGHT_FORMATS[fmt].compute if fmt else ""]  # never above the datasheet ratio
    works = layer_ops(r.model, 8)
    for i, (name, work) in enumerate(works.items()):
        if name not in LINEAR_OPS:
            continue
        for tokens in (1, 64, 4096):
            t = r._op(r._ops[i], tokens)
            assert t >= work.flops_per_token * tokens / (gpu.peak_flops * speedup)
            assert t >= work.fixed_bytes / gpu.hbm_bytes_per_s
            bytes_per_weight = WEIGHT_FORMATS[fmt].bytes_per_weight if fmt else 2
            assert work.fixed_bytes == pytest.approx(work.flops_per_token / 2 * bytes_per_weight, rel=1e-12)


def test_formats_from_quantization_config():
    assert from_hf_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) == "fp8"
    assert from_hf_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128}) == "awq"
    assert from_hf_quantization_config({"quant_method": "gptq", "bits": 8}) == "int8-weight-only"
    assert from_hf_quantization_config({"quant_method": "mxfp4"}) == "mxfp4"
    assert from_hf_quantization_config({"quant_method": "modelopt", "quant_algo": "NVFP4"}) == "nvfp4"
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}
    assert from_hf_quantization_config(ct) == "int8"
    ct["config_groups"]["group_0"]["weights"]["type"] = "float"
    assert from_hf_quantization_config(ct) == "fp8"
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not modelled"):
        from_hf_quantization_config({"quant_method": "bitsandbytes"})


def test_bad_quantization_config_names_the_file_and_field(tmp_path):
    path = _config(tmp_path, {**DEEPSEEK_V3, "quantization_config": {"quant_method": "gptq", "bits": 3}})
    with pytest.raises(InputError, match=r"config\.json.*quantization_config.*3 bits is not modelled"):
        model_from_hf_config(path)
    with pytest.raises(ServelabError, match="unknown quantization 'fp6'"):
        make_runner("roofline:quantization=fp6")
    with pytest.raises(ServelabError, match="unknown kv_cache_dtype 'int2'"):
        make_runner("roofline:kv_cache_dtype=int2")


def test_int4_weights_and_fp8_kv_by_hand():
    bf16 = make_runner("roofline:model=llama-3.1-8b")
    awq = make_runner("roofline:model=llama-3.1-8b,quantization=awq")
    m = bf16.model
    embeddings_and_norms = 2 * 128256 * 4096 + 4096 + 32 * 2 * 4096
    linear = m.num_params - embeddings_and_norms
    assert awq.model.weight_bytes == int(linear * (0.5 + 2.5 / 128) + embeddings_and_norms * 2)
    assert awq.kv_capacity_tokens(0.9) > bf16.kv_capacity_tokens(0.9)
    fp8_kv = make_runner("roofline:model=llama-3.1-8b", kv_cache_dtype="fp8")
    assert fp8_kv.kv_bytes_per_token == m.kv_bytes_per_token // 2 == 65_536
    assert fp8_kv.decode_affine(8)[1] == pytest.approx(bf16.decode_affine(8)[1] / 2, rel=1e-12)
    # memory-bound decode of one token: the weights read dominate, ~4x fewer bytes in int4
    plan = StepPlan(StepShape(decode_seqs=1, decode_context_tokens=100))
    assert awq.step_time(plan) < 0.6 * bf16.step_time(plan)


def test_replay_options_and_unquantised_results_unchanged():
    from servelab.replay.config import ReplayConfig

    c = ReplayConfig.from_dict({"quantization": "fp8", "kv_cache_dtype": "fp8"})
    assert (c.quantization, c.kv_cache_dtype) == ("fp8", "fp8")
    assert not {"quantization", "kv_cache_dtype"} & set(ReplayConfig().to_dict())
    from servelab.api import build_runner

    r = build_runner(c)
    assert (r.model.quantization, r.model.kv_cache_dtype) == ("fp8", "fp8")
    plain = build_runner(ReplayConfig())
    assert plain.model == make_runner("roofline").model and plain.model.quantization == ""


def test_a_measured_runs_quantisation_reaches_validate_real():
    from servelab.fidelity.validate import config_for

    meta = {"config": {"model": "llama-3.1-8b", "gpu": "h100-80gb"},
            "source": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}  # vLLM's arguments, as run import keeps them
    c = config_for(meta, {})
    assert (c.quantization, c.kv_cache_dtype) == ("fp8", "fp8")
    assert config_for(meta, {"quantization": "none"}).quantization == "none"  # an option wins
    # a method only the checkpoint's config.json resolves is not guessed
    assert config_for({**meta, "source": {"quantization": "compressed-tensors"}}, {}).quantization == ""
