"""servelab's Python API: assemble a replay from a config (runner, policies, router by name) and run it.

    from servelab.api import EngineConfig, ReplayConfig, replay, write_run
    result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=2), policy="sarathi"))
    write_run(result, "runs/sarathi")

This is where names become parts: ``make_runner`` and ``make_policy`` look them up in their
registries, and the engine (``servelab.replay``) receives built objects only.
"""

from __future__ import annotations

import gc
import inspect
import os
import time
from dataclasses import asdict

import pyarrow as pa

from servelab import __version__
from servelab.common.errors import ServelabError
from servelab.policies.base import make_policy
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.replay.engine import Engine
from servelab.replay.kv import KVManager
from servelab.replay.prefix_cache import PrefixCache
from servelab.replay.protocols import Runner
from servelab.replay.replica import Replica
from servelab.replay.request import Status
from servelab.replay.results import (
    RunResult, _jsonable, platform_meta, requests_from_table, requests_table_from, tier_meta, with_platform_columns,
    with_tier_columns, write_run,
)
from servelab.replay.router import ROUTERS
from servelab.replay.tiers import build_stacks, parse_tiers
from servelab.runners.base import make_runner


def build_runner(config: ReplayConfig) -> Runner:
    return make_runner(config.runner, model=config.model, gpu=config.gpu, tp=config.tp,
                       block_size=config.engine.block_size, max_num_batched_tokens=config.engine.max_num_batched_tokens,
                       max_num_seqs=config.engine.max_num_seqs)


def resolve_num_gpu_blocks(config: ReplayConfig, runner: Runner) -> int:
    engine = config.engine
    if engine.num_gpu_blocks is not None:
        return engine.num_gpu_blocks
    capacity = runner.kv_capacity_tokens
    if capacity is None:
        raise ServelabError(
            f"runner '{runner.name}' does not know a model or GPU, so the KV size cannot be derived: "
            "set num_gpu_blocks (--num-gpu-blocks)"
        )
    tokens = capacity(engine.gpu_memory_utilization)
    blocks = tokens // engine.block_size
    if blocks < 1:
        raise ServelabError(f"no room for KV cache: the model does not fit the GPU memory ({runner.describe()})")
    return blocks


def kv_bytes_per_token(config: EngineConfig, runner: Runner) -> int:
    """The runner's KV bytes per token, else the config's; swapping needs one of them."""
    value = runner.kv_bytes_per_token
    if value is None:
        value = config.kv_bytes_per_token
    if value is None:
        if config.preemption == "swap":
            raise ServelabError(
                f"preemption 'swap' needs the KV size per token: runner '{runner.name}' does not know its "
                "model, so set kv_bytes_per_token (e.g. --kv-bytes-per-token 131072 for Llama-3.1-8B)"
            )
        return 0
    return int(value)


def build_replicas(config: ReplayConfig, runner: Runner, num_blocks: int,
                   trace_block_tokens: int | None = None) -> list[Replica]:
    """One KV manager and one policy instance per replica (``trace_block_tokens``: tokens per entry of
    the trace's ``prefix_hashes``, None when it has none)."""
    engine_cfg = config.engine
    caching = engine_cfg.enable_prefix_caching and engine_cfg.kv_allocation == "on-demand"
    swap = engine_cfg.preemption == "swap"
    bytes_per_token = kv_bytes_per_token(engine_cfg, runner)
    host_blocks = 0
    if swap and bytes_per_token:
        host_blocks = int(engine_cfg.swap_space_gb * 1e9 // (bytes_per_token * engine_cfg.block_size))
    tier_specs = parse_tiers(engine_cfg.kv_tiers)
    if tier_specs and (not caching or runner.needs_block_tables):
        raise ServelabError("kv_tiers hold prefix-cache blocks: they need enable_prefix_caching, on-demand "
                            "allocation and a cost-model runner")
    stacks = build_stacks(tier_specs, engine_cfg.replicas, bytes_per_token * engine_cfg.block_size,
                          engine_cfg.kv_tier_write == "through")
    replicas = []
    for rid in range(engine_cfg.replicas):
        allocator = runner.make_allocator(rid, num_blocks) if runner.needs_block_tables else None
        cache = PrefixCache(num_blocks, engine_cfg.block_size, trace_block_tokens,
                            per_tenant=engine_cfg.prefix_cache_scope == "tenant", tiers=stacks[rid],
                            purge=frozenset(engine_cfg.purge_tenants)) if caching else None
        kv = KVManager(num_blocks, engine_cfg.block_size, reserve=engine_cfg.kv_allocation == "reserve",
                       allocator=allocator, prefix_cache=cache, swap=swap, host_blocks=host_blocks,
                       bytes_per_block=bytes_per_token * engine_cfg.block_size,
                       swap_bytes_per_s=engine_cfg.swap_bandwidth_gbps * 1e9,
                       overlap_layers=engine_cfg.kv_load_overlap_layers)
        policy = make_policy(config.policy, config.policy_params, engine_cfg, rid)
        replicas.append(Replica(rid, engine_cfg, kv, policy))
    return replicas


def trace_block_tokens(trace: pa.Table) -> int | None:
    """Tokens per ``prefix_hashes`` entry (the trace's ``prefix_block_tokens``), None without hashes."""
    if "prefix_hashes" not in trace.column_names:
        return None
    value = (trace.schema.metadata or {}).get(b"prefix_block_tokens")
    return int(value) if value else None


def replay(trace: pa.Table, config: ReplayConfig, runner: Runner | None = None, trace_meta: dict | None = None,
           token_log: bool = False, progress=None, token_dir: str | None = None) -> RunResult:
    """Replay ``trace`` (a validated trace table) under ``config``; ``runner`` overrides config.runner.

    ``token_log`` also returns every output token's time (``RunResult.tokens``, tokens.parquet),
    streamed to anonymous temporary files in ``token_dir`` (default: the system's temporary folder)
    while replaying, so that memory stays bounded however many tokens there are;
    ``progress(now_s, ended, total)`` is called now and then during the replay (the simulated time
    reached, the requests ended so far, all requests; ``Engine.run``); a callback that takes two
    arguments gets ``(arrived, total)`` at every 8192nd trace arrival instead, as before.
    """
    wall_start = time.perf_counter()
    if token_log and token_dir is not None and not os.path.isdir(token_dir):
        raise ServelabError(f"token_dir '{token_dir}' is not a directory (where --token-log spills while replaying)")
    if runner is None:
        runner = build_runner(config)
    engine_cfg = config.engine
    num_blocks = resolve_num_gpu_blocks(config, runner)
    replicas = build_replicas(config, runner, num_blocks, trace_block_tokens(trace))
    if hasattr(runner, "hash_block_tokens"):  # an executing runner derives hashed prompt tokens from the hashes
        runner.hash_block_tokens = trace_block_tokens(trace)
    router = ROUTERS.get(engine_cfg.router)()
    requests, followers = requests_from_table(trace)
    engine = Engine(requests, replicas, router, runner, engine_cfg, followers, token_log=token_log)
    if engine.tokens is not None:
        engine.tokens.spill_dir = token_dir
    # The loop allocates many short-lived tuples but builds no reference cycles: the cyclic
    # collector would only rescan the live requests again and again (~10% of a large replay).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        end_s = engine.run(_engine_progress(progress, engine))
    finally:
        if gc_was_enabled:
            gc.enable()
    requests_table = with_platform_columns(requests_table_from(requests), engine.ledger)
    if engine_cfg.kv_tiers:
        requests_table = with_tier_columns(requests_table, requests, [t.name for t in parse_tiers(engine_cfg.kv_tiers)])
    steps_table = engine.steps.table()
    counts = {s.name.lower(): 0 for s in (Status.FINISHED, Status.UNFINISHED, Status.REJECTED)}
    for req in requests:
        name = req.status.name.lower()
        counts[name] = counts.get(name, 0) + 1
    meta = {
        "servelab_version": __version__,
        "trace": dict(trace_meta or {}, rows=trace.num_rows),
        "policy": {"name": config.policy, "params": _jsonable(asdict(replicas[0].policy.params))},
        "engine": dict(_jsonable(asdict(engine_cfg)), num_gpu_blocks=num_blocks,
                       swap_host_blocks=replicas[0].kv.host_total),
        "runner": {"name": runner.name, "spec": config.runner, "params": _jsonable(runner.describe())},
        "seed": engine_cfg.seed,
        "simulated_span_s": end_s,
        "wall_time_s": time.perf_counter() - wall_start,
        "counts": counts,
        "swap_fallbacks": engine.num_swap_fallbacks,
        "platform": platform_meta(engine),
        **({"kv_tiers": tier_meta(replicas)} if engine_cfg.kv_tiers else {}),
        "config": config.to_dict(),
    }
    tokens = engine.tokens.finish() if engine.tokens is not None else None
    return RunResult(requests_table, steps_table, meta, tokens)


def _engine_progress(progress, engine: Engine):
    """``progress`` as the engine calls it, ``(now_s, ended, total)``; one of two arguments gets the
    ``(arrived, total)`` of every 8192nd trace arrival it always got."""
    if progress is None:
        return None
    try:
        inspect.signature(progress).bind(0.0, 0, 0)
        return progress
    except TypeError:
        pass
    except ValueError:  # no signature to read (a builtin): the current contract
        return progress
    total = len(engine.arrivals)
    due = 0  # the next multiple of 8192 to report once that many arrivals are in

    def arrivals(now_s: float, ended: int, _total: int) -> None:
        nonlocal due
        while due < engine.next_arrival:
            progress(due, total)
            due += 8192

    return arrivals


__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "build_runner", "replay", "requests_from_table",
           "resolve_num_gpu_blocks", "write_run"]
