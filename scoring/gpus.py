"""A run's GPUs from its run.json: the count a score divides by, and the pools the cost view prices.

Apart from scoring/sources.py (run directories and their DuckDB tables) so that a search scoring each trial
in memory (search/scorer.py) reads a run's GPU count without importing that module (~1.5 ms of CPU from its
.pyc, ~5.5 ms where Python compiles it at each start: PYTHONDONTWRITEBYTECODE; issue #31 item 3).
"""

from __future__ import annotations


def num_gpus(meta: dict) -> int:
    """GPUs a run used: replicas x tensor-parallel degree (runner param ``tp`` / ``tensor_parallel``; default 1)
    x data-parallel ranks x pipeline stages (one replica, a vLLM server, holds tp x pp x dp GPUs); for a
    cluster, summed over its pools (which set tp only)."""
    pools = pool_rows(meta)
    if (meta.get("cluster") or {}).get("pools"):
        return max(1, sum(p["gpus"] for p in pools))
    engine = meta.get("engine") or {}
    params = (meta.get("runner") or {}).get("params") or {}
    tp = (meta.get("config") or {}).get("tp", 1)
    for key in ("tp", "tensor_parallel", "tensor_parallel_size"):
        if key in params:
            tp = params[key]
            break
    try:
        replicas = int(engine.get("replicas", 1) or 1)
    except (TypeError, ValueError):
        replicas = 1
    try:
        tp = int(tp)
    except (TypeError, ValueError):
        tp = 1
    return max(1, replicas) * max(1, tp) * _dp_pp(meta.get("config") or {})


def _dp_pp(config: dict) -> int:
    """GPUs per tensor-parallel group of a replica beyond TP: data-parallel ranks x pipeline stages."""
    try:
        dp = config.get("dp", config.get("data_parallel_size", 1))
        pp = config.get("pp", config.get("pipeline_parallel_size", 1))
        return max(1, int(dp or 1)) * max(1, int(pp or 1))
    except (TypeError, ValueError):
        return 1


def pool_rows(meta: dict) -> list[dict]:
    """A run's pools (run.json ``cluster.pools``; a flat run is one mixed pool without a price)."""
    pools = (meta.get("cluster") or {}).get("pools")
    if pools:
        # a pool of several instance types: one row per type it used (its replicas, price, GPU time)
        parts = [(p, i) for p in pools for i in (p.get("instances") or [p]) if i is p or i.get("replicas")]
        return [{"pool": p.get("name"), "role": p.get("role"), "gpu": i.get("gpu"), "tp": int(p.get("tp") or 1),
                 "replicas": len(i.get("replicas") or ()), "gpus": len(i.get("replicas") or ()) * int(p.get("tp") or 1),
                 "price_per_gpu_hour": i.get("price_per_gpu_hour"),
                 "gpu_s": None if i.get("replica_seconds") is None else i["replica_seconds"] * int(p.get("tp") or 1)}
                for p, i in parts]
    config = meta.get("config") or {}
    engine = meta.get("engine") or {}
    try:
        replicas = max(1, int(engine.get("replicas", 1) or 1))
        tp = max(1, int(config.get("tp", 1) or 1))
    except (TypeError, ValueError):
        replicas, tp = 1, 1
    return [{"pool": "default", "role": "mixed", "gpu": config.get("gpu"), "tp": tp, "replicas": replicas,
             "gpus": replicas * tp * _dp_pp(config), "price_per_gpu_hour": None, "gpu_s": None}]


__all__ = ["num_gpus", "pool_rows"]
