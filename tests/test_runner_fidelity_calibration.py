"""Physics floors for every preset and host profile, the vLLM-style KV derivation against a real log,
and the named host profiles."""

from __future__ import annotations

import json

import pytest

from servelab.common.errors import ServelabError
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.presets import GPUS, MODELS
from servelab.runners.roofline import RooflineRunner, load_calibration_file

HOSTS = ("vidur-2023", *load_calibration_file()["host_profiles"])


def _fits(runner) -> bool:
    try:
        runner.kv_capacity_tokens(0.9)
    except ServelabError:
        return False
    return True


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_physics_floors_hold_for_every_preset(gpu, host):
    """decode >= (weights + KV read) / HBM bandwidth; prefill >= linear-layer FLOPs / peak, by hand."""
    g = GPUS[gpu]
    checked = 0
    for m in MODELS.values():
        if m.name == "tiny":
            continue
        for tp in (1, 2, 4, 8):
            if m.num_kv_heads % tp or m.num_heads % tp:
                continue
            r = make_runner(f"roofline:model={m.name},gpu={gpu},tp={tp},host={host}")
            if not _fits(r):
                continue
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
    old = make_runner("roofline:model=llama-3.1-8b")
    new = make_runner("roofline:model=llama-3.1-8b,host=vllm-v1-cudagraph")
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
