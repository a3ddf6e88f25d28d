"""The roofline runner: presets, hand-checked formulas, exact decode_affine, KV sizing, factory errors."""

from __future__ import annotations

import json
import math

import pytest

from servelab.common.errors import ServelabError
from servelab.runners.base import StepPlan, StepShape, make_runner, picker, runner_spec
from servelab.runners.presets import GPUS, MODELS, get_gpu, get_model
from servelab.runners.roofline import (
    ACTIVATION_TOKENS,
    LOGIT_SEQS,
    NON_TORCH_BYTES,
    RooflineRunner,
    layer_ops,
    load_calibration,
    load_calibration_file,
    op_time_s,
)


def plan(**counts) -> StepPlan:
    return StepPlan(StepShape(**counts))


def prefill(chunk: int, context: int = 0) -> StepPlan:
    return plan(
        prefill_tokens=chunk,
        prefill_seqs=1,
        prefill_context_tokens=context + chunk,
        prefill_attention_pairs=chunk * context + chunk * (chunk + 1) // 2,
    )


@pytest.mark.parametrize(
    "name, billions",
    # Published parameter counts (model cards); Qwen's QKV biases (~0.01%) are left out.
    [("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("qwen2.5-7b", 7.62), ("qwen2.5-32b", 32.76),
     ("qwen2.5-72b", 72.71), ("mistral-7b", 7.25), ("llama-3.2-3b", 3.21), ("qwen2.5-3b", 3.09),
     ("qwen2.5-14b", 14.77), ("qwen3-4b", 4.02), ("qwen3-8b", 8.19), ("qwen3-14b", 14.8),
     ("qwen3-235b-a22b", 235.1), ("mixtral-8x7b", 46.7)],
)
def test_model_presets_match_published_parameter_counts(name, billions):
    assert get_model(name).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_kv_bytes_per_token_is_k_and_v_of_every_layer():
    m = get_model("llama-3.1-8b")
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert make_runner("roofline:model=llama-3.1-70b,tp=4").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_required_presets_exist_and_unknown_names_list_known():
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "mistral-7b", "tiny"} <= set(MODELS)
    assert {"a100-80gb", "h100-80gb", "h200", "l40s", "a40"} <= set(GPUS)
    with pytest.raises(ServelabError, match="unknown GPU preset 'v100'.*h100-80gb"):  # (b200 is a preset now)
        get_gpu("v100")
    with pytest.raises(ServelabError, match="unknown model preset 'gpt-5'.*llama-3.1-8b"):
        get_model("gpt-5")


def test_op_time_is_latency_plus_max_of_compute_and_memory():
    gpu = get_gpu("h100-80gb")
    cal = load_calibration("h100").ops["qkv_proj"]
    work = layer_ops(get_model("llama-3.1-8b"), 1)["qkv_proj"]
    # QKV of Llama-3.1-8B: 4096 x (4096 + 2 x 1024) weights.
    assert work.fixed_bytes == 4096 * 6144 * 2
    for tokens in (1, 64, 4096):
        compute = 2 * 4096 * 6144 * tokens / (989e12 * cal.eff_compute)
        memory = (4096 * 6144 * 2 + tokens * (4096 + 6144) * 2) / (3.35e12 * cal.eff_memory)
        assert op_time_s(work, cal, gpu, tokens) == pytest.approx(cal.latency_s + max(compute, memory), rel=1e-12)
    # One token reads every weight for 2 FLOPs per weight: memory-bound. 4096 tokens: compute-bound.
    assert 2 * 4096 * 6144 / (989e12 * cal.eff_compute) < 4096 * 6144 * 2 / (3.35e12 * cal.eff_memory)
    assert 2 * 4096 * 6144 * 4096 / (989e12 * cal.eff_compute) > (4096 * 6144 * 2 + 4096 * 10240 * 2) / (3.35e12 * cal.eff_memory)


@pytest.mark.parametrize("spec", ["roofline", "roofline:model=llama-3.1-70b,gpu=a100-80gb,tp=4",
                                  "roofline:model=qwen2.5-7b,gpu=l40s", "roofline:model=mistral-7b,gpu=h200,tp=2",
                                  "roofline:model=tiny,gpu=a40,cpu_overhead=0"])
def test_decode_affine_reproduces_pure_decode_steps(spec):
    runner = make_runner(spec)
    for n in (1, 3, 32, 256):
        a, b = runner.decode_affine(n)
        assert b > 0
        for context in (n, 17 * n + 5, 1000 * n, 123_457):
            step = runner.step_time(plan(decode_seqs=n, decode_context_tokens=context))
            assert step == a + b * context  # exactly: the engine mixes both for one stretch


def test_decode_affine_slope_is_kv_bytes_over_calibrated_bandwidth():
    runner = make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb")
    eff = runner.calibration.decode_attention_eff_memory
    assert runner.decode_affine(8)[1] == pytest.approx(131072 / (3.35e12 * eff), rel=1e-12)


def test_step_time_grows_with_every_count():
    r = make_runner("roofline")
    base = r.step_time(plan(decode_seqs=16, decode_context_tokens=16_000))
    assert r.step_time(plan(decode_seqs=17, decode_context_tokens=16_000)) > base
    assert r.step_time(plan(decode_seqs=16, decode_context_tokens=32_000)) > base
    assert r.step_time(prefill(2048, 4096)) > r.step_time(prefill(2048, 0)) > r.step_time(prefill(512, 0))
    assert r.step_time(plan()) == 0.0


def test_cpu_overhead_is_additive_and_switchable():
    on, off = make_runner("roofline"), make_runner("roofline:cpu_overhead=0")
    p = plan(decode_seqs=32, decode_context_tokens=32_000)
    cal = on.calibration
    assert on.step_time(p) - off.step_time(p) == pytest.approx(cal.cpu_base_s + 32 * cal.cpu_per_seq_s, rel=1e-9)


def test_tensor_parallel_prices_two_ring_all_reduces_per_layer():
    r1 = make_runner("roofline:model=llama-3.1-70b,tp=1,cpu_overhead=0")
    r4 = make_runner("roofline:model=llama-3.1-70b,tp=4,cpu_overhead=0")
    c = r4.calibration
    tokens = 512
    expected = c.all_reduce_latency_s + 2 * 3 / 4 * tokens * 8192 * 2 / (450e9 * c.all_reduce_eff)
    assert r4.all_reduce_s(tokens) == pytest.approx(expected, rel=1e-12)
    assert r1.all_reduce_s(tokens) == 0.0
    # Splitting weights four ways speeds a memory-bound decode up, but by less than 4x (all-reduces, latencies).
    p = plan(decode_seqs=8, decode_context_tokens=8000)
    assert r1.step_time(p) / 4 < r4.step_time(p) < r1.step_time(p)


def test_kv_capacity_matches_hand_computation():
    # the 2023 profile keeps the fixed reserve (8192 activation tokens, 256 logits, 1 GiB non-torch);
    # vllm-v1-cudagraph's, sized by the engine's limits, is checked in test_runner_fidelity_calibration.py
    r = make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb,host=vidur-2023")
    m = r.model
    reserve = ACTIVATION_TOKENS * (2 * 14336 + 14336 + 2 * 4096) * 2 + LOGIT_SEQS * 128256 * 4 + NON_TORCH_BYTES
    free = 81559 * 2**20 * 0.9 - m.num_params * 2 - reserve
    assert r.kv_capacity_tokens(0.9) == int(free // 131072)
    assert 400_000 < r.kv_capacity_tokens(0.9) < 480_000  # ~55 GiB of KV left beside 15 GiB of weights
    assert r.kv_capacity_tokens(0.5) < r.kv_capacity_tokens(0.9)
    # TP 2 halves the weights per GPU and doubles the memory: more than twice the KV.
    assert make_runner("roofline:tp=2,host=vidur-2023").kv_capacity_tokens() > 2 * r.kv_capacity_tokens()


def test_more_ranks_than_kv_heads_copy_the_heads_as_vllm_does():
    """Qwen3-235B's 4 KV heads at TP 8: each head on two ranks, so every rank holds one head's KV (not
    half of one) and all of the K and V projections of its head; a tp that neither divides nor is a
    multiple of the KV heads is refused, as vLLM refuses it."""
    m = get_model("qwen3-235b-a22b")
    assert (m.num_kv_heads, m.kv_shards(8), m.kv_shards(4), m.kv_shards(2)) == (4, 4, 4, 2)
    r8 = make_runner("roofline:model=qwen3-235b-a22b,gpu=h200,tp=8")
    r4 = make_runner("roofline:model=qwen3-235b-a22b,gpu=h200,tp=4")
    # bytes per token on one rank: one KV head at TP 8 as at TP 4, not halved
    assert r8._kv_bytes_per_token_layer_shard == r4._kv_bytes_per_token_layer_shard == 2 * 128 * 2
    ops8, ops4 = layer_ops(m, 8), layer_ops(m, 4)
    h = m.hidden_size
    assert ops8["qkv_proj"].fixed_bytes == h * (m.q_size / 8 + 2 * 128) * 2  # q split 8 ways, K and V whole heads
    assert ops8["qkv_proj"].fixed_bytes > ops4["qkv_proj"].fixed_bytes / 2
    # a rank holds what it would with 8 KV heads at TP 8 (one head's KV and projections): the same tokens
    from dataclasses import replace

    eight = replace(r8, model=replace(m, name="qwen3-235b-a22b with 8 KV heads", num_kv_heads=8))
    assert eight.model.kv_shards(8) == 8
    assert r8.kv_capacity_tokens(0.9) == pytest.approx(eight.kv_capacity_tokens(0.9), abs=1)
    ds = get_model("deepseek-v3")  # MLA: the latent is whole on every rank, the heads' rope work still split
    assert ds.kv_shards(8) == 1
    assert layer_ops(ds, 8)["rope"].bytes_per_token == 2 * (ds.q_size / 8 + ds.kv_size / 8) * ds.dtype_bytes
    with pytest.raises(ServelabError, match="divide or be a multiple of its KV heads"):
        make_runner("roofline:model=qwen2.5-14b,tp=5")  # 40 query heads, 8 KV heads
    with pytest.raises(ServelabError, match="tp=3 must divide"):
        make_runner("roofline:model=qwen3-32b,tp=3")


def test_copied_kv_projections_count_once_per_rank():
    from servelab.runners.roofline import weight_bytes_per_gpu

    m = get_model("qwen3-235b-a22b")
    kv_proj = m.num_layers * 2 * m.hidden_size * m.kv_size * 2
    assert weight_bytes_per_gpu(m, 8) == pytest.approx(m.weight_bytes / 8 + kv_proj * (1 / 4 - 1 / 8))
    assert weight_bytes_per_gpu(m, 4) == m.weight_bytes / 4  # one head per rank: nothing copied


def test_kv_capacity_errors_when_the_model_does_not_fit():
    r = make_runner("roofline:model=llama-3.1-70b,gpu=a40,tp=1")
    with pytest.raises(ServelabError, match="does not fit on 1 x a40"):
        r.kv_capacity_tokens()
    with pytest.raises(ServelabError, match="gpu_memory_utilization"):
        make_runner("roofline").kv_capacity_tokens(1.5)
    assert r.describe()["kv_capacity_tokens_at_0.9"] is None


def test_describe_is_json_and_names_everything_needed_to_rebuild():
    d = make_runner("roofline:model=qwen2.5-32b,gpu=h200,tp=2").describe()
    json.dumps(d)
    assert (d["model"]["name"], d["gpu"]["name"], d["tp"], d["calibration_key"]) == ("qwen2.5-32b", "h200", 2, "h100")
    assert d["calibration"]["ops"]["mlp_up"]["eff_compute"] > 0


def test_factory_takes_cli_context_and_spec_values_win():
    r = make_runner("roofline", model="mistral-7b", gpu="a100-80gb", tp=2)
    assert (r.model.name, r.gpu.name, r.tp) == ("mistral-7b", "a100-80gb", 2)
    r = make_runner("roofline:gpu=l40s", model="mistral-7b", gpu="a100-80gb", tp=None)
    assert (r.model.name, r.gpu.name, r.tp) == ("mistral-7b", "l40s", 1)
    default = make_runner("roofline")
    assert (default.model.name, default.gpu.name, default.tp, default.name) == ("llama-3.1-8b", "h100-80gb", 1, "roofline")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("roofline:flops=1", "unknown parameter 'flops'"),
        ("roofline:tp=3", "tp=3 must divide"),
        ("roofline:model=qwen2.5-7b,tp=8", "tp=8 must divide"),
        ("roofline:tp=two", "tp: expected a finite int, got 'two'"),
        ("roofline:cpu_overhead=-1", "cpu_overhead must be >= 0"),
        ("roofline:gpu=tpu", "unknown GPU preset 'tpu'"),
    ],
)
def test_factory_rejects_bad_parameters(spec, message):
    with pytest.raises(ServelabError, match=message):
        make_runner(spec)


def test_a_spec_refuses_unknown_keys_then_picks_spec_context_default():
    """A spec's unknown key is refused when it is typed (naming the spec and the known keys); then
    runners.base.picker (roofline's and torch's builds): the spec's value, else the context's unless
    None, else the default."""
    with pytest.raises(ServelabError, match=r"^runner 'roofline:tp=2,c=1': unknown parameter 'c' \(parameters: model, gpu, tp,"):
        runner_spec("roofline:tp=2,c=1")
    pick = picker(runner_spec("roofline:tp=2").params, {"tp": 4, "gpu": "a100-80gb", "model": None})
    assert pick("tp", 1) == 2  # the spec wins over the context (typed: an int)
    assert pick("gpu", "h100-80gb") == "a100-80gb"  # then the context
    assert pick("model", "llama-3.1-8b") == "llama-3.1-8b"  # a None in the context: the default


def test_every_gpu_preset_has_a_packaged_calibration_with_provenance():
    data = load_calibration_file()
    assert "microsoft/vidur" in data["source"]["repository"] and "MIT" in data["source"]["licence"]
    assert data["source"]["files"] and all(len(f["sha256"]) == 64 for f in data["source"]["files"])
    for gpu in GPUS.values():
        cal = load_calibration(gpu.calibration)
        for op in cal.ops.values():
            assert 0 < op.eff_compute <= 1 and 0 < op.eff_memory <= 1 and op.latency_s >= 0
    assert "attention" in data["gpus"]["h100"]["derived"]  # H100 attention is transferred, and says so


def test_step_time_is_fast_enough_for_per_iteration_calls():
    import time

    r = make_runner("roofline")
    p = plan(prefill_tokens=512, prefill_seqs=1, prefill_context_tokens=1024, prefill_attention_pairs=400_000,
             decode_seqs=60, decode_context_tokens=60_000)
    start = time.perf_counter()
    for _ in range(2000):
        r.step_time(p)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 100e-6  # measured ~4 us; generous for a loaded 2-core CI box
    assert math.isfinite(r.step_time(p))


def test_runner_is_frozen():
    r = make_runner("roofline")
    assert isinstance(r, RooflineRunner)
    with pytest.raises(AttributeError):
        r.tp = 2


def test_describe_rebuilds_the_same_runner_through_json():
    r = make_runner("roofline:model=qwen2.5-72b,gpu=a100-80gb,tp=4,cpu_overhead=0.5")
    again = RooflineRunner.from_describe(json.loads(json.dumps(r.describe())))
    p = plan(prefill_tokens=300, prefill_seqs=2, prefill_context_tokens=900, prefill_attention_pairs=120_000,
             decode_seqs=40, decode_context_tokens=50_000)
    assert again.step_time(p) == r.step_time(p)
    assert again.decode_affine(7) == r.decode_affine(7)
    assert again.kv_capacity_tokens() == r.kv_capacity_tokens()
