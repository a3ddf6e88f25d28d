"""Collectives between the GPUs of a replica, priced by link (NVLink/NVSwitch or PCIe) and, for the
tensor-parallel all-reduce, by the implementation vLLM picks for the message size.

vLLM (since 0.2.7, `vllm/distributed/device_communicators/custom_all_reduce.py` and
`csrc/custom_all_reduce.cuh`) reduces a message of ``B`` bytes over ``p`` GPUs with its own
peer-to-peer kernels when the GPUs can read each other's memory, and with NCCL otherwise:

- custom all-reduce only for p in {2, 4, 6, 8}, GPUs fully connected by NVLink (or p = 2 with
  peer access), and ``B < max_size`` (8 MiB by default);
- inside it, the one-shot kernel (every rank reads the whole message from every peer and sums)
  for p = 2 at any size, for p <= 4 below 512 KiB and for p <= 8 below 256 KiB; the two-shot
  kernel (reduce-scatter then all-gather through peer memory) above;
- everything else goes to NCCL (a ring on one node).

Each is priced as ``latency + traffic x B / (link bandwidth x efficiency)``, with the traffic
each rank moves over its links: one-shot (p - 1) B, two-shot and ring 2 (p - 1) / p B. The
ring's latency and efficiency are the GPU calibration's NCCL fit (vidur profiles); the custom
kernels' come from ``real_calibration.json`` ``custom_all_reduce`` (docs/runners.md has the
sources and the figures they were read from).

The NCCL fit was measured on NVLink nodes. Over PCIe (``LINKS``) every step of a collective costs
more (NCCL's own cost model, ``src/graph/tuning.cc`` ``hwLat``, Ring/Simple: 5.7 us a step on PCI
against 3.4 us on NVLink) and the link delivers less of its nominal bandwidth (peer-to-peer writes
reach ~54-56 of 63 GB/s on PCIe 5.0 x16); GPUs without peer-to-peer access (GeForce) go through
host memory, so every byte crosses PCIe twice. The same link terms price expert-parallel
all-to-alls and pipeline-parallel sends.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB
CUSTOM_WORLD_SIZES = (2, 4, 6, 8)
ONE_SHOT_MAX_BYTES = {4: 512 * KIB, 8: 256 * KIB}  # p <= 4: below 512 KiB; p <= 8: below 256 KiB


@dataclass(frozen=True, slots=True)
class Link:
    """How a GPU-to-GPU link differs from the NVLink nodes the NCCL fit was measured on."""

    step_latency_s: float  # added per step of a collective (a ring all-reduce has 2 (p - 1) steps)
    bandwidth_share: float  # share of the nominal per-direction bandwidth a transfer gets, on top of the fit's


# NVLink/NVSwitch: the fit as measured. PCIe: NCCL's hwLat difference (5.7 - 3.4 us per Ring/Simple
# step) and the measured share of PCIe 5.0 x16 that peer-to-peer writes reach (54/63, voipmonitor/rtx6kpro
# hardware/pcie-bandwidth.md, five systems 53-56 GB/s); pcie-host: no peer-to-peer access (GeForce cards),
# NCCL's shared-memory transport copies through host memory, so each byte crosses PCIe twice.
LINKS = {
    "nvlink": Link(0.0, 1.0),
    "pcie": Link(2.3e-6, 54 / 63),
    "pcie-host": Link(2.3e-6, 54 / 63 / 2),
}


def get_link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link '{name}' (known: {', '.join(LINKS)})") from None


@dataclass(frozen=True, slots=True)
class CustomAllReduce:
    """Latencies and link efficiencies of vLLM's custom all-reduce kernels, and its size cap."""

    one_shot_latency_s: float
    one_shot_eff: float
    two_shot_latency_s: float
    two_shot_eff: float
    max_bytes: int = 8 * MIB


def algorithm(nbytes: int, ranks: int, p2p_ranks: int, custom: CustomAllReduce | None) -> str:
    """``one-shot``, ``two-shot`` or ``nccl-ring``: what vLLM runs for a message of ``nbytes``
    over ``ranks`` GPUs, when up to ``p2p_ranks`` of them can run the custom kernels together."""
    if (custom is None or ranks not in CUSTOM_WORLD_SIZES or ranks > p2p_ranks or nbytes >= custom.max_bytes
            or nbytes % 16):
        return "nccl-ring"
    if ranks == 2:
        return "one-shot"
    limit = ONE_SHOT_MAX_BYTES[4] if ranks <= 4 else ONE_SHOT_MAX_BYTES[8]
    return "one-shot" if nbytes < limit else "two-shot"


def all_reduce_time_s(nbytes: int, ranks: int, link_bytes_per_s: float, nccl_latency_s: float, nccl_eff: float,
                      p2p_ranks: int = 0, custom: CustomAllReduce | None = None, link: str = "nvlink") -> float:
    """Seconds for one all-reduce of ``nbytes`` over ``ranks`` GPUs (0 for one GPU or no bytes)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link != "nvlink":  # the custom kernels are modelled on NVLink only (p2p_ranks is 0 on PCIe parts)
        return nccl_time_s(2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1), link_bytes_per_s, nccl_latency_s,
                           nccl_eff, link)
    algo = algorithm(nbytes, ranks, p2p_ranks, custom)
    if algo == "one-shot":
        return custom.one_shot_latency_s + (ranks - 1) * nbytes / (link_bytes_per_s * custom.one_shot_eff)
    ring = 2 * (ranks - 1) / ranks * nbytes
    if algo == "two-shot":
        return custom.two_shot_latency_s + ring / (link_bytes_per_s * custom.two_shot_eff)
    return nccl_latency_s + ring / (link_bytes_per_s * nccl_eff)


def nccl_time_s(bytes_per_gpu: float, steps: int, link_bytes_per_s: float, nccl_latency_s: float, nccl_eff: float,
                link: str = "nvlink") -> float:
    """An NCCL collective in which each GPU sends ``bytes_per_gpu`` over its link in ``steps`` steps:
    the fit's latency plus the link's extra per-step latency, and the bytes at the fit's efficiency
    times the link's share of its nominal bandwidth. Never faster than the bytes at the nominal
    bandwidth: both efficiencies are at most 1."""
    if bytes_per_gpu <= 0 or steps <= 0:
        return 0.0
    lk = get_link(link)
    return (nccl_latency_s + steps * lk.step_latency_s
            + bytes_per_gpu / (link_bytes_per_s * nccl_eff * lk.bandwidth_share))


def send_time_s(nbytes: float, link_bytes_per_s: float, nccl_latency_s: float, nccl_eff: float,
                link: str = "nvlink") -> float:
    """A point-to-point send of ``nbytes`` (pipeline-parallel activations from one stage to the next)."""
    return nccl_time_s(nbytes, 1, link_bytes_per_s, nccl_latency_s, nccl_eff, link)
