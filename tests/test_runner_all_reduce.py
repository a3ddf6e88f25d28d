"""Tensor-parallel all-reduce follows vLLM's implementation for the message size (runners/all_reduce.py).

Expected times are written out by hand from the documented formulas (docs/runners.md) and the
constants of real_calibration.json ``custom_all_reduce`` (6 us + (p-1) B / (link x 0.87) one-shot,
13.5 us + 2 (p-1)/p B / (link x 0.5) two-shot) and the h100 NCCL fit (roofline_calibration.json).
"""

import pytest
from servelab.common.errors import ServelabError
from servelab.runners.all_reduce import CustomAllReduce, algorithm, all_reduce_time_s
from servelab.runners.base import make_runner

KIB, MIB = 1024, 1024 * 1024
CUSTOM = CustomAllReduce(6e-6, 0.87, 13.5e-6, 0.5, 8 * MIB)
NVLINK4 = 450e9


@pytest.mark.parametrize("nbytes, ranks, expected", [
    (512 * KIB - 16, 4, "one-shot"), (512 * KIB, 4, "two-shot"),  # p <= 4: one-shot below 512 KiB
    (256 * KIB - 16, 8, "one-shot"), (256 * KIB, 8, "two-shot"),  # p <= 8: below 256 KiB
    (256 * KIB, 6, "two-shot"), (256 * KIB - 16, 6, "one-shot"),
    (8 * MIB - 16, 4, "two-shot"), (8 * MIB, 4, "nccl-ring"),      # custom only below max_size
    (8 * MIB - 16, 2, "one-shot"), (8 * MIB, 2, "nccl-ring"),      # p = 2: always one-shot
    (1024, 3, "nccl-ring"), (1024, 5, "nccl-ring"),               # world sizes 2, 4, 6, 8 only
    (1000, 4, "nccl-ring"),                                       # not a multiple of 16 bytes
])
def test_algorithm_switches_at_vllms_thresholds(nbytes, ranks, expected):
    assert algorithm(nbytes, ranks, p2p_ranks=8, custom=CUSTOM) == expected


def test_no_peer_to_peer_means_nccl_only():
    assert algorithm(1024, 4, p2p_ranks=0, custom=CUSTOM) == "nccl-ring"  # PCIe part
    assert algorithm(1024, 4, p2p_ranks=2, custom=CUSTOM) == "nccl-ring"  # NVLink bridge: pairs only
    assert algorithm(1024, 2, p2p_ranks=2, custom=CUSTOM) == "one-shot"
    assert algorithm(1024, 4, p2p_ranks=8, custom=None) == "nccl-ring"   # custom all-reduce switched off


def test_times_on_both_sides_of_each_threshold_by_hand():
    lat, eff = 22e-6, 0.72  # a made-up NCCL fit, so the ring term is checked too
    # 4 ranks, 512 KiB - 16 B: one-shot, 3 x 524272 B at 450 GB/s x 0.87
    assert all_reduce_time_s(524272, 4, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        6e-6 + 3 * 524272 / 391.5e9, rel=1e-12)
    # 512 KiB: two-shot, 1.5 x 524288 B at 450 GB/s x 0.5
    assert all_reduce_time_s(524288, 4, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        13.5e-6 + 786432 / 225e9, rel=1e-12)
    # 8 MiB - 16: two-shot; 8 MiB: NCCL ring 22 us + 1.5 x 8388608 / (450 GB/s x 0.72)
    assert all_reduce_time_s(8388592, 4, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        13.5e-6 + 1.5 * 8388592 / 225e9, rel=1e-12)
    assert all_reduce_time_s(8388608, 4, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        22e-6 + 12582912 / 324e9, rel=1e-12)
    # 8 ranks around 256 KiB: one-shot 7 x B, two-shot 1.75 x B
    assert all_reduce_time_s(262128, 8, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        6e-6 + 7 * 262128 / 391.5e9, rel=1e-12)
    assert all_reduce_time_s(262144, 8, NVLINK4, lat, eff, 8, CUSTOM) == pytest.approx(
        13.5e-6 + 1.75 * 262144 / 225e9, rel=1e-12)
    assert all_reduce_time_s(262144, 1, NVLINK4, lat, eff, 8, CUSTOM) == 0.0


def test_roofline_70b_tp4_prices_decode_all_reduces_by_vllms_kernels():
    # Llama-2-70B: hidden 8192 bf16, so a token is 16 KiB of all-reduce.
    auto = make_runner("roofline:model=llama-2-70b,gpu=h100-80gb,tp=4")
    ring = make_runner("roofline:model=llama-2-70b,gpu=h100-80gb,tp=4,all_reduce=nccl")
    c = ring.calibration  # the h100 NCCL fit: ~22.6 us + 1.5 B / (450 GB/s x ~0.72)
    # 8 tokens = 128 KiB: one-shot, 6 us + 3 x 131072 B / 391.5 GB/s = 7.004 us
    assert auto.all_reduce_s(8) == pytest.approx(6e-6 + 393216 / 391.5e9, rel=1e-12)
    assert auto.all_reduce_s(8) == pytest.approx(7.0044e-6, rel=1e-4)
    assert ring.all_reduce_s(8) == pytest.approx(c.all_reduce_latency_s + 196608 / (450e9 * c.all_reduce_eff), rel=1e-12)
    # 32 tokens = 512 KiB: two-shot; 512 tokens = 8 MiB: NCCL for both
    assert auto.all_reduce_s(32) == pytest.approx(13.5e-6 + 786432 / 225e9, rel=1e-12)
    assert auto.all_reduce_s(512) == ring.all_reduce_s(512)
    # The step difference is exactly 80 layers x 2 all-reduces x the per-all-reduce difference.
    from servelab.runners.base import StepPlan, StepShape

    p = StepPlan(StepShape(decode_seqs=8, decode_context_tokens=8000))
    assert ring.step_time(p) - auto.step_time(p) == pytest.approx(
        160 * (ring.all_reduce_s(8) - auto.all_reduce_s(8)), rel=1e-9)


def test_pcie_and_old_profile_stay_on_nccl():
    pcie = make_runner("roofline:model=llama-2-70b,gpu=h100-pcie,tp=4")
    c = pcie.calibration
    # the NCCL ring over PCIe: 2 (p - 1) = 6 steps of 2.3 us more than NVLink, 54/63 of PCIe 5.0's 64 GB/s
    assert pcie.all_reduce_s(8) == pytest.approx(
        c.all_reduce_latency_s + 6 * 2.3e-6 + 196608 / (64e9 * c.all_reduce_eff * 54 / 63), rel=1e-12)
    old = make_runner("roofline:model=llama-2-70b,tp=4,host=vidur-2023")  # 2023 vLLM: NCCL ring only
    assert old.custom_all_reduce is None
    with pytest.raises(ServelabError, match="all_reduce must be one of auto, nccl"):
        make_runner("roofline:all_reduce=ring")


def test_describe_round_trips_the_all_reduce_choice():
    from servelab.runners.roofline import RooflineRunner

    r = make_runner("roofline:model=llama-2-70b,tp=4")
    back = RooflineRunner.from_describe(r.describe())
    assert back.custom_all_reduce == r.custom_all_reduce
    assert back.all_reduce_s(8) == r.all_reduce_s(8)
