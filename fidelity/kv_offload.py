"""vLLM's CPU KV offloading as a run records it, and the tier ``validate --real`` replays it with.

vLLM (0.11 on) offloads KV blocks to host memory through a KV connector, set by either

- ``--kv-offloading-size GiB`` (with ``--kv-offloading-backend native``, the default, or ``lmcache``;
  vLLM's documentation: the buffer's total over the tensor-parallel ranks), or
- ``--kv-transfer-config`` naming ``OffloadingConnector`` (or ``SimpleCPUOffloadConnector``), its
  ``kv_connector_extra_config`` holding ``cpu_bytes_to_use`` (bytes) or, in the connector's first form
  (vLLM 0.11), ``num_cpu_blocks`` (blocks of the extra config's ``block_size`` tokens, else the GPU's).
  A ``MultiConnector`` is searched through its ``connectors``.

Every full block is stored to host memory as it is computed; a prompt whose prefix GPU memory no
longer holds loads it back from there, least recently used first out. The replay models this as a
``dram`` tier written through (``kv_tier_write = "through"``; docs/engine.md "Offload tiers") of the
recorded size. LMCache keeps its sizes in its own configuration, which vLLM's arguments do not show;
its workers log them (``Creating LMCacheEngine with config: {... 'max_local_cpu_size': 20.0, ...}``, per
worker), read by fidelity/vllm_log.py; without that line such a run is noted, and replayed without a
tier unless ``--set kv_tiers=...`` gives one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
LMCACHE = ("LMCacheConnectorV1", "LMCacheConnector", "LMCacheMPConnector")


@dataclass(frozen=True)
class Offload:
    """A recorded CPU offload: its capacity in GB (1e9 bytes, the whole replica) or in blocks of
    ``block_tokens`` tokens (the ``num_cpu_blocks`` form; None: the GPU's block size; bytes per token are
    then the model's), or neither (``how`` says why)."""

    gb: float | None
    blocks: int | None
    how: str
    block_tokens: int | None = None


def recorded_offload(args: dict[str, Any]) -> Offload | None:
    """The CPU offload that vLLM's arguments (non-default args, ``engine_kwargs``) set, or None."""
    size = args.get("kv_offloading_size")
    if size not in (None, 0, 0.0, "None"):
        backend = str(args.get("kv_offloading_backend") or "native")
        try:
            size = float(size)
        except (TypeError, ValueError):
            return Offload(None, None, f"kv_offloading_size {size!r} (not a number of GiB)")
        if backend == "lmcache":
            return Offload(None, None, f"kv_offloading_size {size} GiB through LMCache (its CPU size is LMCache's "
                                       "own setting)")
        return Offload(size * GIB / 1e9, None, f"kv_offloading_size {size} GiB ({backend})")
    config = _as_dict(args.get("kv_transfer_config"))
    return None if config is None else _from_connector(config)


def _from_connector(config: dict) -> Offload | None:
    name = str(config.get("kv_connector") or "")
    extra = _as_dict(config.get("kv_connector_extra_config")) or {}
    if name == "MultiConnector":
        for sub in extra.get("connectors") or ():
            if (sub := _as_dict(sub)) is not None and (found := _from_connector(sub)) is not None:
                return found
        return None
    if name in LMCACHE:
        return Offload(None, None, f"{name} (its CPU size is LMCache's own setting, not in vLLM's arguments)")
    if name not in CONNECTORS:
        return None
    try:
        if extra.get("cpu_bytes_to_use") is not None:
            nbytes = float(extra["cpu_bytes_to_use"])
            return Offload(nbytes / 1e9, None, f"{name} cpu_bytes_to_use {nbytes:.0f}")
        if extra.get("num_cpu_blocks") is not None:
            blocks, block = int(extra["num_cpu_blocks"]), extra.get("block_size")
            return Offload(None, blocks, f"{name} num_cpu_blocks {blocks}", None if block is None else int(block))
    except (TypeError, ValueError):
        return Offload(None, None, f"{name} with a size that is not a number ({extra})"[:200])
    return Offload(None, None, f"{name} without cpu_bytes_to_use or num_cpu_blocks")


def _as_dict(value: Any) -> dict | None:
    """A config given as a dict, or as the JSON text of one (``--kv-transfer-config '{...}'``)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def settings(offload: Offload, block_size: int | None) -> dict[str, Any]:
    """run.json config keys for ``offload``: ``kv_offload_gb`` or ``kv_offload_tokens`` (none when its
    capacity is not recorded). ``block_size``: the GPU's, for ``num_cpu_blocks`` without its own."""
    if offload.gb is not None:
        return {"kv_offload_gb": round(offload.gb, 6)}
    if offload.blocks is not None:
        return {"kv_offload_tokens": offload.blocks * int(offload.block_tokens or block_size or 16)}
    return {}


def from_args(args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """What vLLM's arguments (``args``) record of CPU KV offloading: its words for run.json's source and the
    run.json config keys of its size (none when no size is recorded), or None without offloading."""
    offload = recorded_offload(args)
    return None if offload is None else (offload.how, settings(offload, args.get("block_size")))


def tier_spec(gb: float, name: str = "dram") -> str:
    """The ``kv_tiers`` entry of a tier of ``gb`` GB: host memory (``dram``) or a local disk (``ssd``), at
    that tier's bandwidth and latency."""
    return f"{name}:capacity_gb={f'{gb:.6f}'.rstrip('0').rstrip('.')}"
