"""Assemble a replay from a config and run it: runner, policies and router looked up by name, the pools
of a cluster, the platform, the handoff and the autoscalers built on the engine; the results tables.

This is where names become parts: ``make_runner`` and ``make_policy`` look them up in their
registries (the config typed their specs and parameters once, when it was made), and the engine (``servelab.replay``) receives built objects only. The public entry point
is ``servelab.api``, which re-exports what a user needs; the packages that replay as part of their
own work (scoring's sweep, fidelity, search) import this module, below the API.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from servelab import __version__
from servelab.common.atomic import atomic_dir
from servelab.common.errors import ServelabError
from servelab.policies.base import make_policy
from servelab.replay.platform.abort import Aborts, client_timeouts
from servelab.replay.core.depends import Dependencies, parents_of
from servelab.replay.config import EngineConfig, ReplayConfig, instance_config, one_pool, pool_config
from servelab.replay.core.engine import ENTRY, Engine
from servelab.replay.core.encoder import MM_COLUMNS, EncoderStage, encoder_meta
from servelab.replay.core.kv.manager import KVManager
from servelab.replay.core.lora import check_trace_adapters, lora_meta, make_slots, reserved_tokens
from servelab.replay.platform.hooks import Platform
from servelab.replay.core.kv.hybrid_prefix import HybridPrefixCache
from servelab.replay.core.kv.prefix_cache import PrefixCache
from servelab.replay.core.protocols import Runner
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Status
from servelab.replay.core.kv.retention import Retention
from servelab.replay.results import (
    RunResult, _jsonable, platform_meta, requests_from_table, requests_table_from, schema_columns, tier_columns,
    tier_meta, with_platform_columns, write_run,
)
from servelab.replay.cluster.config import ClusterConfig, PoolConfig
from servelab.replay.core.specs import check_failures
from servelab.replay.core.protocols import StepPlan
from servelab.replay.core.schema import DISAGG_SCHEMA, INSTANCE_SCHEMA, PD_INSTANCE_SCHEMA, SPEC_SCHEMA, STEPS_SCHEMA
from servelab.replay.stream import BATCH_ROWS, CHUNK, RowGroupWriter, TraceFile, TraceStream, requests_schema
from servelab.replay.core.kv.tiers import build_stacks
from servelab.routers.base import make_router
from servelab.runners.base import make_runner

if TYPE_CHECKING:  # the cluster's parts a replay may not use, loaded where they are built
    from servelab.replay.cluster.autoscale import Autoscaler
    from servelab.replay.cluster.disagg import Disaggregation
    from servelab.replay.cluster.encode_pool import EncodePool
    from servelab.replay.cluster.instances import InstanceType


def build_runner(config: ReplayConfig) -> Runner:
    parallel = ({"dp": config.dp, "pp": config.pp, "enable_expert_parallel": config.enable_expert_parallel}
                if config.engines_per_replica > 1 or config.enable_expert_parallel else {})
    if config.quantization:  # vLLM's --quantization / --kv-cache-dtype (runners/quant.py)
        parallel["quantization"] = config.quantization
    if config.kv_cache_dtype != "auto":
        parallel["kv_cache_dtype"] = config.kv_cache_dtype
    if config.engine.async_scheduling:  # the host's per-step work overlaps the GPU's (runners/roofline.py)
        parallel["async_scheduling"] = True
    runner = make_runner(config.runner, model=config.model, gpu=config.gpu, tp=config.tp,
                         block_size=config.engine.block_size, max_num_batched_tokens=config.engine.max_num_batched_tokens,
                         max_num_seqs=config.engine.max_num_seqs, **parallel)
    return _speculative(runner, config.engine)


def _speculative(runner: Runner, engine: EngineConfig) -> Runner:
    """``runner`` with the proposer's cost and memory when speculative decoding is on (runners/speculative.py)."""
    if engine.spec_method is None:
        return runner
    from servelab.runners.speculative import speculative_runner

    return speculative_runner(runner, engine)


def most_gpu_blocks(config: ReplayConfig, runner: Runner) -> int | None:
    """The blocks the runner's memory model fits beside the weights with all of GPU memory (None: it
    knows no model or GPU, or sizes its own pool)."""
    capacity = runner.kv_capacity_tokens
    if capacity is None or runner.needs_block_tables:
        return None
    return capacity(1.0) // config.engine.block_size


def resolve_num_gpu_blocks(config: ReplayConfig, runner: Runner, measured: bool = False) -> int:
    """The KV blocks per replica: ``num_gpu_blocks`` when given (refused when the runner's memory model
    cannot fit it: such a server would not start; ``measured``: a real server ran with them, so they are
    kept, and the caller says the memory model disagrees), else derived from the model and GPU."""
    engine = config.engine
    capacity = runner.kv_capacity_tokens
    if engine.num_gpu_blocks is not None:
        most = None if measured else most_gpu_blocks(config, runner)
        # weights and KV beyond the GPUs' memory would not start on a real server: refuse, not price it
        if most is not None and engine.num_gpu_blocks > most:
            raise ServelabError(
                f"num_gpu_blocks = {engine.num_gpu_blocks:,} does not fit: {config.model} on {config.tp} x {config.gpu} "
                f"(runner '{runner.name}') holds at most {most:,} blocks of {engine.block_size} tokens beside "
                f"the weights, with all of GPU memory")
        return engine.num_gpu_blocks
    if capacity is None:
        raise ServelabError(
            f"runner '{runner.name}' does not know a model or GPU, so the KV size cannot be derived: "
            "set num_gpu_blocks (--num-gpu-blocks)"
        )
    tokens = capacity(engine.gpu_memory_utilization)
    if engine.max_loras:  # the adapter slots' GPU memory comes out of the KV cache (replay/core/lora.py)
        tokens -= reserved_tokens(engine, runner, kv_bytes_per_token(engine, runner))
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
                   trace_block_tokens: int | None = None, first_id: int = 0) -> list[Replica]:
    """One KV manager and one policy instance per replica (``trace_block_tokens``: tokens per entry of
    the trace's ``prefix_hashes``, None when it has none). A replica of dp data-parallel ranks and pp
    pipeline stages is dp x pp engines behind the router, each stage's with 1/pp of the rank's blocks."""
    engine_cfg = config.engine
    engines = engine_cfg.replicas * config.engines_per_replica
    if config.pp > 1:
        num_blocks //= config.pp
        if num_blocks < 1:
            raise ServelabError(f"pp={config.pp}: fewer KV blocks than pipeline stages (each stage's engine needs one)")
    if engine_cfg.max_model_len is None:  # the model's own context, as vLLM defaults max_model_len
        context = getattr(getattr(runner, "model", None), "max_position_embeddings", None)
        if context is not None:
            engine_cfg = replace(engine_cfg, max_model_len=context)
    caching = engine_cfg.enable_prefix_caching and engine_cfg.kv_allocation == "on-demand"
    layout = getattr(runner, "kv_layout", None)  # a hybrid model's KV layer groups (replay/core/kv/kv_groups.py)
    if layout is not None and caching:  # prefix caching per layer group (replay/core/kv/hybrid_prefix.py)
        refuse_hybrid_caching(engine_cfg, runner)
    swap = engine_cfg.preemption == "swap"
    bytes_per_token = kv_bytes_per_token(engine_cfg, runner)
    block_bytes = bytes_per_token * engine_cfg.block_size
    if layout is not None:  # a pool block: one page in each layer of a group, on every GPU of the engine
        block_bytes = runner.kv_block_bytes
    host_blocks = 0
    if swap and bytes_per_token:
        host_blocks = int(engine_cfg.swap_space_gb * 1e9 // block_bytes)
    tier_specs = engine_cfg.tier_specs
    if tier_specs and (not caching or runner.needs_block_tables):
        raise ServelabError("kv_tiers hold prefix-cache blocks: they need enable_prefix_caching, on-demand "
                            "allocation and a cost-model runner")
    stacks = build_stacks(tier_specs, engines, bytes_per_token * engine_cfg.block_size,
                          engine_cfg.kv_tier_write == "through")
    replicas = []
    for rid in range(first_id, first_id + engines):
        allocator = runner.make_allocator(rid, num_blocks) if runner.needs_block_tables else None
        cache = PrefixCache(num_blocks, engine_cfg.block_size, trace_block_tokens,
                            per_tenant=engine_cfg.prefix_cache_scope == "tenant", tiers=stacks[rid - first_id],
                            purge=frozenset(engine_cfg.purge_tenants)) if caching and layout is None else None
        if caching and layout is not None:
            cache = HybridPrefixCache(num_blocks, layout, trace_block_tokens,
                                      per_tenant=engine_cfg.prefix_cache_scope == "tenant")
        kv = KVManager(num_blocks, engine_cfg.block_size, reserve=engine_cfg.kv_allocation == "reserve",
                       allocator=allocator, prefix_cache=cache, swap=swap, host_blocks=host_blocks,
                       bytes_per_block=block_bytes,
                       swap_bytes_per_s=engine_cfg.swap_bandwidth_gbps * 1e9,
                       overlap_layers=engine_cfg.kv_load_overlap_layers, layout=layout)
        policy = make_policy(config.policy, config.policy_params, engine_cfg, rid)
        replica = Replica(rid, engine_cfg, kv, policy)
        replica.lora = make_slots(engine_cfg, runner)
        replica.encoder = encoder_stage(engine_cfg, runner)
        replicas.append(replica)
    if config.dp > 1 and getattr(runner, "dp_lockstep", False):  # an MoE model's DP ranks step together
        from servelab.replay.core.lockstep import DpGroup

        for first in range(0, engines, config.dp):
            DpGroup(replicas[first:first + config.dp], runner)
    return replicas


def refuse_hybrid_caching(engine_cfg: EngineConfig, runner: Runner) -> None:
    """What prefix caching per layer group (replay/core/kv/hybrid_prefix.py) does not model yet, refused by name."""
    name = runner.model.name
    if engine_cfg.kv_tiers:
        raise ServelabError(f"kv_tiers with a hybrid-attention model ({name}): offload tiers of per-group "
                            "prefix-cache blocks are not modelled; drop kv_tiers or --no-enable-prefix-caching")
    if engine_cfg.kv_retention != "lru":
        raise ServelabError(f"kv_retention = {engine_cfg.kv_retention} with a hybrid-attention model ({name}) is not "
                            "modelled (per-group prefix caching keeps no session chains); use kv_retention = lru")
    if engine_cfg.purge_tenants:
        raise ServelabError(f"purge_tenants with a hybrid-attention model ({name}) is not modelled by per-group "
                            "prefix caching; drop purge_tenants or --no-enable-prefix-caching")
    if runner.needs_block_tables:
        raise ServelabError(f"prefix caching with a hybrid-attention model ({name}) on a runner that executes "
                            "batches (real block ids per group) is not modelled: --no-enable-prefix-caching")


def encoder_stage(engine: EngineConfig, runner: Runner) -> EncoderStage | None:
    """A replica's multimodal encoder (replay/core/encoder.py), priced on its runner's GPU; None when no
    encoder is named."""
    if engine.vision_encoder is None and engine.audio_encoder is None:
        return None
    cache = engine.encoder_cache_tokens if engine.encoder_cache_tokens is not None else engine.max_num_batched_tokens
    from servelab.runners.encoders import EncoderPricer

    return EncoderStage(EncoderPricer(runner, engine.vision_encoder, engine.audio_encoder), cache)


def check_encoders(requests, engine: EngineConfig) -> None:
    """Every modality the trace holds needs its encoder: images and video the vision one, audio the audio one."""
    for req in requests:
        mm = req.mm
        if mm is None:
            continue
        if (mm.images or mm.image_tokens or mm.video_tokens) and engine.vision_encoder is None:
            raise ServelabError(f"trace row {req.index + 1}: request {req.request_id} has images or video "
                                "(columns images/image_tokens/video_tokens) but no encoder prices them: "
                                "set vision_encoder (--vision-encoder qwen2.5-vl-vit)")
        if mm.audio_tokens and engine.audio_encoder is None:
            raise ServelabError(f"trace row {req.index + 1}: request {req.request_id} has audio (column audio_tokens) "
                                "but no encoder prices it: set audio_encoder (--audio-encoder whisper-large-v3-encoder)")


def trace_block_tokens(trace: pa.Table | pa.Schema) -> int | None:
    """Tokens per ``prefix_hashes`` entry (the trace's ``prefix_block_tokens``), None without hashes; from a
    trace table or its schema alone (a trace file's, before its rows are read)."""
    schema = trace if isinstance(trace, pa.Schema) else trace.schema
    if "prefix_hashes" not in schema.names:
        return None
    value = (schema.metadata or {}).get(b"prefix_block_tokens")
    return int(value) if value else None


def replay(trace: pa.Table, config: ReplayConfig, runner: Runner | None = None, trace_meta: dict | None = None,
           token_log: bool = False, progress=None, token_dir: str | None = None,
           cluster: BuiltCluster | None = None) -> RunResult:
    """Replay ``trace`` (a validated trace table) under ``config``; ``runner`` overrides config.runner.

    ``token_log`` also returns every output token's time (``RunResult.tokens``, tokens.parquet),
    streamed to anonymous temporary files in ``token_dir`` (default: the system's temporary folder)
    while replaying, so that memory stays bounded however many tokens there are;
    ``progress(now_s, ended, total)`` is called now and then during the replay (the simulated time
    reached, the requests ended so far, all requests; ``Engine.run``); a callback that takes two
    arguments gets ``(arrived, total)`` at every 8192nd trace arrival instead, as before.
    ``cluster``: the pools already built for this config and trace (``build_cluster(config, runner,
    trace_block_tokens(trace))``, as the CLI does to check a config before reading the trace), used
    instead of building them again; a built cluster serves one replay.
    """
    wall_start = time.perf_counter()
    if token_log and token_dir is not None and not os.path.isdir(token_dir):
        raise ServelabError(f"token_dir '{token_dir}' is not a directory (where --token-log spills while replaying)")
    # Building the requests, the loop (many short-lived tuples) and the result tables allocate a lot
    # but build no reference cycles: the cyclic collector would only rescan the live requests again
    # and again (~10% of a large replay, and a third of building its results).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(trace, config, runner, trace_meta, token_log, progress, token_dir, wall_start, cluster)
    finally:
        if gc_was_enabled:
            gc.enable()


def _replay(trace: pa.Table, config: ReplayConfig, runner: Runner | None, trace_meta: dict | None, token_log: bool,
            progress, token_dir: str | None, wall_start: float, cluster: BuiltCluster | None = None) -> RunResult:
    if cluster is None:
        cluster = build_cluster(config, runner, trace_block_tokens(trace))
    else:
        cluster.take(config, trace_block_tokens(trace))
    entry = cluster.pools[0]
    runner, engine_cfg, num_blocks = entry.runner, entry.config.engine, entry.num_blocks
    if engine_cfg.fail != config.engine.fail:  # a cluster's failures (replica ids across its pools)
        engine_cfg = replace(engine_cfg, fail=config.engine.fail)
    requests, followers = requests_from_table(trace)
    if "lora_adapter" in trace.column_names:
        check_trace_adapters([r.lora_adapter for r in requests], engine_cfg)
    if any(name in trace.column_names for name in MM_COLUMNS):
        encode_spec = cluster.spec.encode
        check_encoders(requests, engine_cfg if encode_spec is None else
                       next(p for p in cluster.pools if p.spec is encode_spec).config.engine)
    reclaims = any(p.spec.instances for p in cluster.pools)  # replicas may be taken away (replay/cluster/fleet.py)
    platform = None
    if reclaims or Platform.wanted(engine_cfg, cluster.replicas):
        platform = lambda engine: Platform(engine, engine_cfg, reclaims)  # noqa: E731 (built on the engine)
    engine = Engine(requests, cluster.replicas, entry.router, runner, engine_cfg, followers, token_log=token_log,
                    platform=platform)
    if engine.spec is not None and "spec_acceptance" in trace.column_names:  # per-request acceptance rates
        engine.spec.set_trace_rates(trace.column("spec_acceptance").to_pylist())
    disagg = cluster.disaggregate(engine)
    encode = cluster.encode_pool(engine)
    scalers = cluster.autoscale(engine, disagg)
    timeouts = client_timeouts(trace, engine_cfg.client_timeout_s)
    if timeouts:
        engine.aborts = Aborts(engine, timeouts, disagg, encode)
        engine.aborts.arm_all(requests)
    parents = parents_of(trace)
    if parents:  # requests that wait for others (trace schema v2)
        engine.depends = Dependencies(requests, parents)
        for replica in cluster.replicas:
            if replica.kv.cache is not None:
                replica.kv.cache.keep_outputs = True
    if engine_cfg.kv_retention != "lru":
        engine.retention = build_retention(engine, engine_cfg, runner)
    if engine.tokens is not None:
        engine.tokens.spill_dir = token_dir
    end_s = engine.run(_engine_progress(progress, engine))
    if disagg is not None:
        disagg.strand()
    # Everything that reads the Request objects first: the requests table then frees them as it grows.
    counts = {s.name.lower(): 0 for s in (Status.FINISHED, Status.UNFINISHED, Status.REJECTED)}
    for req in requests:
        name = req.status.name.lower()
        counts[name] = counts.get(name, 0) + 1
    extra = []  # (field, column) appended after the platform columns, in order
    if engine_cfg.kv_tiers:
        extra += tier_columns(requests, [t.name for t in engine_cfg.tier_specs])
    # what the `tasks` view walks (scoring/tasks.py): each request's parents, delay and deadline; a trace
    # of closed-loop sessions (turns linked by think_s, ``followers``) too, so its turns are linked there
    if parents or followers:
        extra += _dependency_columns(trace)
    handoffs = disagg.columns(len(requests)) if disagg is not None else None
    if encode is not None:
        from servelab.replay.cluster.encode_pool import ENCODE_SCHEMA

        extra += schema_columns(ENCODE_SCHEMA, encode.columns(len(requests)))
    if handoffs is not None:
        extra += schema_columns(DISAGG_SCHEMA, handoffs)
    fleets = [scalers[p.spec.name] for p in cluster.pools if p.types]  # (a pool of instance types has a Fleet)
    if fleets:  # which instance type served each request (its last replica's: with disaggregation the decoding one)
        kinds = {r.id: p.config.gpu for p in cluster.pools for r in p.replicas}  # (a pool of one GPU type)
        kinds.update({rid: f.instance_of(rid) for f in fleets for rid in f.kind})
        instance = [None] * len(requests)
        for req in requests:
            if req.replica is not None:
                instance[req.index] = kinds.get(req.replica)
        columns, schema = {"instance": instance}, INSTANCE_SCHEMA
        if handoffs is not None:  # and the one that prefilled it (for its last handoff)
            columns["prefill_instance"] = [None if rid is None else kinds[rid] for rid in handoffs["prefill_replica"]]
            schema = PD_INSTANCE_SCHEMA
        extra += schema_columns(schema, columns)
    if engine.spec is not None:  # speculative decoding's counters per request (vLLM's spec-decode metrics)
        extra += schema_columns(SPEC_SCHEMA, engine.spec.columns(len(requests)))
    cluster_meta = cluster.meta(disagg, scalers, requests, end_s) if config.cluster is not None else None
    if encode is not None:
        cluster_meta["encode"] = encode.meta()
    _release_requests(engine)
    requests_table = with_platform_columns(requests_table_from(requests, release=True), engine.ledger)
    for f, column in extra:
        requests_table = requests_table.append_column(f, column)
    steps_table = engine.steps.table()
    meta = _run_meta(config, engine, runner, engine_cfg, num_blocks, dict(trace_meta or {}, rows=trace.num_rows),
                     end_s, wall_start, counts)
    if cluster_meta is not None:
        meta["cluster"] = cluster_meta
    tokens = engine.tokens.finish() if engine.tokens is not None else None
    return RunResult(requests_table, steps_table, meta, tokens)


def _run_meta(config: ReplayConfig, engine: Engine, runner: Runner, engine_cfg: EngineConfig, num_blocks: int,
              trace: dict, end_s: float, wall_start: float, counts: dict) -> dict:
    """run.json of a replay, in memory or streamed (``trace``: what it says of the trace, with its rows)."""
    return {
        "servelab_version": __version__,
        "trace": trace,
        "policy": {"name": config.policy, "params": _jsonable(asdict(engine.replicas[0].policy.params))},
        "engine": dict(_jsonable(asdict(engine_cfg)), num_gpu_blocks=num_blocks,
                       swap_host_blocks=engine.replicas[0].kv.host_total),
        "runner": {"name": runner.name, "spec": str(config.runner), "params": _jsonable(runner.describe())},
        "seed": engine_cfg.seed,
        "simulated_span_s": end_s,
        "wall_time_s": time.perf_counter() - wall_start,
        "counts": counts,
        "swap_fallbacks": engine.num_swap_fallbacks,
        "platform": platform_meta(engine),
        **({"client_timeouts": engine.aborts.meta()} if engine.aborts is not None else {}),
        **({"dependencies": engine.depends.meta()} if engine.depends is not None else {}),
        **({"kv_tiers": tier_meta(engine.replicas)} if engine_cfg.kv_tiers else {}),
        **({"spec_decode": engine.spec.meta()} if engine.spec is not None else {}),
        **({"lora": lora_meta(engine.replicas)} if engine_cfg.max_loras else {}),
        **({"encoder": encoder_meta(engine.replicas)}
           if engine_cfg.vision_encoder is not None or engine_cfg.audio_encoder is not None else {}),
        **({"kv_retention": engine.retention.meta()} if engine.retention is not None else {}),
        "config": config.to_dict(),
    }



def not_streamed(config: ReplayConfig) -> str | None:
    """Why a replay under ``config`` is not streamed (``replay_to`` replays it in memory), or None: what
    reads or changes every request at its end (a cluster, the platform, ...) is not streamed yet."""
    engine = config.engine
    if config.cluster is not None:
        return "a cluster (pools) is not streamed"
    if engine.spec_method is not None:
        return "speculative decoding is not streamed"
    if engine.kv_retention != "lru":
        return f"kv_retention = {engine.kv_retention} is not streamed"
    if engine.max_loras:
        return "LoRA adapters (max_loras) are not streamed"
    if engine.vision_encoder is not None or engine.audio_encoder is not None:
        return "multimodal encoders are not streamed"
    if engine.client_timeout_s is not None:
        return "client timeouts (client_timeout_s) are not streamed"
    if engine.has_front_door or engine.pause is not None or engine.fail \
            or make_policy(config.policy, config.policy_params, engine, 0).sheds:
        return "the platform's features (quotas, retries, queue caps, pausing, failures, shedding) are not streamed"
    return None


def replay_to(trace, config: ReplayConfig, run_dir: str | os.PathLike, runner: Runner | None = None,
              trace_meta: dict | None = None, token_log: bool = False, progress=None, token_dir: str | None = None,
              meta: dict | None = None, on_fallback=None, group_rows: int = CHUNK, batch_rows: int = BATCH_ROWS) -> Path:
    """Replay ``trace`` (a trace file's path, or a validated table) under ``config`` straight into the
    run directory ``run_dir`` (all or nothing, as ``write_run``), streamed: the trace read a batch of
    ``batch_rows`` at a time and the results written as requests end, ``group_rows`` rows a row group,
    so that memory holds the requests in flight, not the trace. The files hold what ``replay`` and
    ``write_run`` write (the same bytes up to 65,536 rows, or with ``group_rows`` = 1 << 20).

    What is not streamed (``not_streamed``, replay/stream.py's ``TraceFile.scan``) is replayed in memory
    instead, after ``on_fallback(reason)``. ``meta``: entries added to run.json; ``progress(now_s, ended,
    total)`` as for ``replay`` (three arguments only; ``total``: the trace's rows). Returns the run directory."""
    wall_start = time.perf_counter()
    run_dir = Path(run_dir)
    if group_rows < 1 or group_rows % CHUNK:
        raise ServelabError(f"group_rows = {group_rows}: a positive multiple of {CHUNK:,} rows")
    if token_log and token_dir is not None and not os.path.isdir(token_dir):
        raise ServelabError(f"token_dir '{token_dir}' is not a directory (where --token-log spills while replaying)")
    reason = not_streamed(config)
    source = None
    if reason is None:
        source = TraceFile(trace)
        reason = source.scan()
    if reason is not None:
        if source is not None:
            source.close()
        if on_fallback is not None:
            on_fallback(reason)
        if not isinstance(trace, pa.Table):
            from servelab.traces.io import read_trace

            trace = read_trace(trace)
        result = replay(trace, config, runner, trace_meta, token_log, progress, token_dir)
        result.meta.update(meta or {})
        return write_run(result, run_dir)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # (as ``replay``: the loop builds no reference cycles)
    try:
        return _replay_to(source, config, run_dir, runner, trace_meta, token_log, progress, token_dir, meta or {},
                          group_rows, batch_rows, wall_start)
    finally:
        source.close()
        if gc_was_enabled:
            gc.enable()


def _replay_to(source: TraceFile, config: ReplayConfig, run_dir: Path, runner: Runner | None, trace_meta: dict | None,
               token_log: bool, progress, token_dir: str | None, meta: dict, group_rows: int, batch_rows: int,
               wall_start: float) -> Path:
    block_tokens = None
    if "prefix_hashes" in source.names:
        value = (source.schema.metadata or {}).get(b"prefix_block_tokens")
        block_tokens = int(value) if value else None
    entry = build_cluster(config, runner, block_tokens).pools[0]
    runner, engine_cfg = entry.runner, entry.config.engine
    engine = Engine([], entry.replicas, entry.router, runner, engine_cfg, token_log=token_log)
    if engine.tokens is not None:
        engine.tokens.spill_dir = token_dir
    if progress is not None:  # (the engine's total is that of the requests it was built with: none)
        report = progress
        progress = lambda now_s, ended, _total: report(now_s, ended, source.rows)  # noqa: E731
    tiers = [t.name for t in engine_cfg.tier_specs] if engine_cfg.kv_tiers else None
    with atomic_dir(run_dir) as tmp:
        requests = RowGroupWriter(tmp / "requests.parquet", requests_schema(tiers), group_rows)
        steps = RowGroupWriter(tmp / "steps.parquet", STEPS_SCHEMA, group_rows)
        engine.steps.sink = steps.write
        stream = TraceStream(source, requests, batch_rows, tiers)
        stream.start(engine)
        end_s = engine.run(progress)
        stream.finish(horizon=engine_cfg.until_s is not None)
        engine.steps.flush()
        steps.close()
        requests.close()
        if engine.tokens is not None:
            engine.tokens.finish().write(tmp / "tokens.parquet")
        out = _run_meta(config, engine, runner, engine_cfg, entry.num_blocks, dict(trace_meta or {}, rows=source.rows),
                        end_s, wall_start, stream.counts)
        out.update(meta, run_id=run_dir.name)
        (tmp / "run.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return run_dir

def build_retention(engine: Engine, engine_cfg: EngineConfig, runner: Runner) -> Retention:
    """KV retention across sessions' tool waits (replay/core/kv/retention.py), checked against the setup."""
    mode = engine_cfg.kv_retention
    if runner.needs_block_tables or any(r.kv.cache is None for r in engine.replicas):
        raise ServelabError(f"kv_retention = {mode} keeps prefix-cache blocks: it needs enable_prefix_caching, "
                            "on-demand allocation and a cost-model runner")
    if mode == "offload" and not engine_cfg.kv_tiers:
        raise ServelabError("kv_retention = offload writes a session's context to the first offload tier: "
                            "set kv_tiers (e.g. --kv-tiers dram:capacity_gb=64)")
    return Retention(engine, mode, engine_cfg.kv_retention_ttl_s)


def _release_requests(engine: Engine) -> None:
    """After the run, the engine's other lists of the Request objects (its arrivals, the closed-loop
    turns) let go of them, so that building the requests table can free each as it is converted."""
    engine.arrivals.clear()
    engine.followers.clear()  # (the dict requests_from_table made, shared)


class BuiltPool:
    """One pool, built: its flat config, runner, KV size, replicas and router (a pool of instance
    types: those of its first usable type, and ``types`` for each)."""

    def __init__(self, spec: PoolConfig, config: ReplayConfig, runner: Runner, num_blocks: int,
                 replicas: list[Replica], router, types: list[BuiltType] | None = None):
        self.spec, self.config, self.runner, self.num_blocks = spec, config, runner, num_blocks
        self.replicas, self.router = replicas, router
        self.types = types or []

    def meta(self) -> dict:
        out = {"name": self.spec.name, "role": self.spec.role, "replicas": [r.id for r in self.replicas],
               "initial_replicas": self.spec.replicas,
               "gpu": self.config.gpu, "tp": self.config.tp, "model": self.config.model,
               "runner": str(self.config.runner), "policy": self.config.policy, "router": self.config.engine.router,
               "num_gpu_blocks": self.num_blocks, "price_per_gpu_hour": self.spec.price_per_gpu_hour}
        if self.types:
            out.update(gpu=None, price_per_gpu_hour=None, num_gpu_blocks=None,
                       instances=[t.meta() for t in self.types])
        return out


class BuiltType:
    """One instance type of a pool: its replicas, KV size and runner, or why it is not used."""

    def __init__(self, spec: InstanceType, config: ReplayConfig | None = None, runner: Runner | None = None,
                 num_blocks: int | None = None, replicas: list[Replica] | None = None,
                 skipped: str | None = None, reference_step_s: float | None = None):
        self.spec, self.config, self.runner, self.num_blocks = spec, config, runner, num_blocks
        self.replicas, self.skipped, self.reference_step_s = replicas or [], skipped, reference_step_s

    def meta(self) -> dict:
        out = dict(self.spec.to_dict(), replicas=[r.id for r in self.replicas], num_gpu_blocks=self.num_blocks,
                   runner=None if self.config is None else str(self.config.runner))
        if self.reference_step_s is not None:
            out["reference_step_s"] = self.reference_step_s
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


class BuiltCluster:
    def __init__(self, spec: ClusterConfig, pools: list[BuiltPool], config: ReplayConfig,
                 block_tokens: int | None = None):
        self.spec, self.pools, self.config = spec, pools, config
        self.block_tokens = block_tokens  # the trace's tokens per prefix hash it was built for
        self.replicas = [r for p in pools for r in p.replicas]
        self.taken = False

    def take(self, config: ReplayConfig, block_tokens: int | None) -> None:
        """A replay takes these pools (built before it: ``replay(..., cluster=)``): they must be built for its
        config and trace, and serve one replay (their replicas keep its state)."""
        if self.taken:
            raise ServelabError("a built cluster serves one replay: build another (build_cluster)")
        if config is not self.config or block_tokens != self.block_tokens:
            raise ServelabError(f"the cluster given to replay was built for another config or trace (tokens per "
                                f"prefix hash {self.block_tokens}, the trace's {block_tokens}): build it for this one")
        self.taken = True

    def disaggregate(self, engine: Engine) -> Disaggregation | None:
        """The prefill -> decode handoff, for a cluster with a decode pool (else None)."""
        if not self.spec.disaggregated:
            return None
        prefill, decode = self.pools[0], next(p for p in self.pools if p.spec.role == "decode")
        if any(p.config.engine.max_loras for p in self.pools):
            raise ServelabError("cluster: LoRA adapters (max_loras) are not modelled with disaggregated prefill and "
                                "decode (a handed-off request would join its decode replica's batch past the adapter cap)")
        from servelab.replay.cluster.disagg import Disaggregation

        link = self.spec.link()
        bytes_per_token = kv_bytes_per_token(prefill.config.engine, prefill.runner)
        layouts = [getattr(p.runner, "kv_layout", None) for p in (prefill, decode)]
        context_bytes = None
        if layouts[0] is not None or layouts[1] is not None:  # a hybrid model: its KV moves per layer group
            if layouts[0] is None or layouts[1] is None or layouts[0].kinds.window != layouts[1].kinds.window \
                    or prefill.runner.model.name != decode.runner.model.name:
                raise ServelabError(f"cluster: the prefill and decode pools serve different models ({prefill.runner.name}, "
                                    f"{decode.runner.name}): a hybrid model's KV moves between like layer groups")
            layout, model = layouts[0], prefill.runner.model
            token, state = model.kv_bytes_per_token_layer, model.state_bytes

            def context_bytes(computed: int) -> int:
                return layout.transfer_bytes(computed, token, state)
        if not bytes_per_token:
            raise ServelabError(f"cluster: moving KV from pool '{prefill.spec.name}' needs its size per token: runner "
                                f"'{prefill.runner.name}' does not know its model, so set kv_bytes_per_token")
        return Disaggregation(engine, prefill.replicas, decode.replicas, decode.router, bytes_per_token,
                              link.bandwidth_gbps, link.latency_s, link.stream_layers, context_bytes)

    def encode_pool(self, engine: Engine) -> EncodePool | None:
        """The encode pool's stage before the arrivals' pool (replay/cluster/encode_pool.py), or None without one."""
        spec = self.spec.encode
        if spec is None:
            return None
        pool = next(p for p in self.pools if p.spec is spec)
        if pool.replicas[0].encoder is None:
            raise ServelabError(f"cluster pool '{spec.name}': an encode pool needs an encoder "
                                "(vision_encoder or audio_encoder, in the pool or at the top level)")
        model = getattr(self.pools[0].runner, "model", None)
        if model is None or not hasattr(model, "hidden_size"):
            raise ServelabError(f"cluster: the embeddings an encode pool sends are sized by the language model's hidden "
                                f"size: runner '{self.pools[0].runner.name}' of pool '{self.pools[0].spec.name}' knows no model")
        if not self.spec.disaggregated:  # (a prefill pool was published by the handoff)
            engine.publish(ENTRY, list(self.pools[0].replicas))
        from servelab.replay.cluster.encode_pool import EncodePool

        link = self.spec.encode_link()
        return EncodePool(engine, pool.replicas, model.hidden_size * model.dtype_bytes, link.bandwidth_gbps, link.latency_s)

    def autoscale(self, engine: Engine, disagg: Disaggregation | None = None) -> dict[str, Autoscaler]:
        """An autoscaler per pool that has one, a `Fleet` per pool of instance types (pool name -> it);
        a prefill or decode pool's works through the handoff (``disagg``), a `Fleet`'s too."""
        if not any(pool.types or pool.spec.autoscale is not None for pool in self.pools):
            return {}  # (without loading the autoscaling modules)
        from servelab.replay.cluster.autoscale import Autoscaler
        from servelab.replay.cluster.fleet import Fleet

        scalers = {}
        for pool in self.pools:
            if pool.types:
                used = [t for t in pool.types if t.replicas]
                kinds = [k for k, t in enumerate(used) for _ in t.replicas]
                scalers[pool.spec.name] = Fleet(engine, pool.replicas, tuple(t.spec for t in used), kinds,
                                                pool.spec.autoscale, pool.spec.replicas, disagg=disagg,
                                                rebalance=pool.spec.rebalance)
            elif pool.spec.autoscale is not None:
                scalers[pool.spec.name] = Autoscaler(engine, pool.replicas, pool.spec.autoscale, pool.spec.replicas,
                                                     disagg=disagg)
        for scaler in scalers.values():
            scaler.siblings = [s for s in scalers.values() if s is not scaler]
        return scalers

    def meta(self, disagg: Disaggregation | None, scalers: dict[str, Autoscaler], requests, end_s: float) -> dict:
        out = {"pools": [p.meta() for p in self.pools], "links": [l.to_dict() for l in self.spec.links]}
        if disagg is not None:
            out["transfers"] = disagg.meta()
        if scalers:
            # GPU time over the window the cost view uses: first arrival to last finish (else the end)
            arrivals = [r.arrival_s for r in requests if r.arrival_s is not None]
            finishes = [r.finish_s for r in requests if r.status is Status.FINISHED]
            start = min(arrivals) if arrivals else 0.0
            stop = max(finishes) if finishes else end_s
            for pool, built in zip(out["pools"], self.pools):
                scaler = scalers.get(built.spec.name)
                if scaler is None:
                    continue
                if built.spec.autoscale is not None:
                    pool["autoscale"] = scaler.meta()
                pool["replica_seconds"] = scaler.replica_seconds(start, stop)
                if built.types:  # a Fleet: per instance type (the used ones are the fleet's, in order)
                    used = [entry for entry, t in zip(pool["instances"], built.types) if t.replicas]
                    for k, entry in enumerate(used):
                        entry.update(scaler.type_meta(k, start, stop))
        return out


def build_cluster(config: ReplayConfig, runner: Runner | None = None,
                  block_tokens: int | None = None, measured_blocks: bool = False) -> BuiltCluster:
    """Build every pool of ``config.cluster`` (one pool of ``engine.replicas`` without one); the
    arrivals' pool first, then the others in their order, replica ids counting on across pools.
    ``runner`` (given to ``replay``) serves the pools that keep the top level's runner, model, GPU and TP.
    ``measured_blocks``: ``num_gpu_blocks`` is what a real server allocated (validate --real), kept even
    where the runner's memory model would not fit it."""
    spec = config.cluster or one_pool(config)
    order = [spec.entry] + [p for p in spec.pools if p is not spec.entry]
    pools: list[BuiltPool] = []
    first_id = 0
    runners: dict[tuple, Runner] = {}
    base_key = (config.runner, config.model, config.gpu, config.tp, config.engine.block_size)
    if runner is not None:
        runners[base_key] = _speculative(runner, config.engine)
    for pool in order:
        cfg = config if config.cluster is None else pool_config(config, pool)
        if pool.instances:
            built = _build_types(cfg, pool, runners, block_tokens, first_id)
            first_id += len(built.replicas)
            pools.append(built)
            continue
        key = (cfg.runner, cfg.model, cfg.gpu, cfg.tp, cfg.engine.block_size)
        if key not in runners:
            runners[key] = build_runner(cfg)
        pool_runner = runners[key]
        if hasattr(pool_runner, "hash_block_tokens"):  # an executing runner derives hashed prompt tokens from the hashes
            pool_runner.hash_block_tokens = block_tokens
        num_blocks = resolve_num_gpu_blocks(cfg, pool_runner, measured=measured_blocks)
        replicas = build_replicas(cfg, pool_runner, num_blocks, block_tokens, first_id)
        for r in replicas:
            r.pool = pool.name
            r.runner = pool_runner
        first_id += len(replicas)
        router = make_router(cfg.engine.router, cfg.router_params, cfg.engine.seed)
        pools.append(BuiltPool(pool, cfg, pool_runner, num_blocks, replicas, router))
    if spec.disaggregated:
        _check_disaggregated(pools)
    if config.engine.fail:  # replica ids count across the pools, in the order built
        check_failures(config.engine.failures, sum(len(p.replicas) for p in pools))
    return BuiltCluster(spec, pools, config, block_tokens)


def _build_types(cfg: ReplayConfig, pool: PoolConfig, runners: dict[tuple, Runner], block_tokens: int | None,
                 first_id: int) -> BuiltPool:
    """A pool of instance types: per type in order of preference, its runner and KV size, and as many
    replicas as it may ever hold (at most the pool's count); a type the model does not fit at the
    pool's TP, or slower than the floor's reference step, or never available, is skipped with the
    reason (docs/cluster.md). None usable is an error."""
    cap = pool.replicas if pool.autoscale is None else pool.autoscale.max
    where = f"cluster pool '{pool.name}'"
    types: list[BuiltType] = []
    replicas: list[Replica] = []
    for ty in pool.instances:
        most = ty.most(cap)
        tcfg = instance_config(cfg, ty, max(1, most))
        key = (tcfg.runner, tcfg.model, tcfg.gpu, tcfg.tp, tcfg.engine.block_size)
        if key not in runners:
            runners[key] = build_runner(tcfg)
        runner = runners[key]
        if hasattr(runner, "hash_block_tokens"):
            runner.hash_block_tokens = block_tokens
        try:
            num_blocks = resolve_num_gpu_blocks(tcfg, runner)
        except ServelabError as exc:
            if tcfg.engine.num_gpu_blocks is not None or runner.kv_capacity_tokens is None:
                raise  # not the type's fault: the config's
            types.append(BuiltType(ty, tcfg, runner, skipped=f"the model does not fit at tp {tcfg.tp}: {exc}"))
            continue
        step_s = None
        if pool.floor is not None:
            if runner.needs_block_tables:
                raise ServelabError(f"{where}: floor needs a cost-model runner to price its reference step; "
                                    f"runner '{runner.name}' executes batches")
            step_s = runner.step_time(StepPlan(pool.floor.shape()))
            if step_s > pool.floor.max_step_s:
                types.append(BuiltType(ty, tcfg, runner, num_blocks, skipped=(
                    f"its reference step takes {step_s:.6g} s > floor max_step_s {pool.floor.max_step_s:g}"),
                    reference_step_s=step_s))
                continue
        if most == 0:
            types.append(BuiltType(ty, tcfg, runner, num_blocks, skipped="never available",
                                   reference_step_s=step_s))
            continue
        built = build_replicas(tcfg, runner, num_blocks, block_tokens, first_id + len(replicas))
        for r in built:
            r.pool = pool.name
            r.runner = runner
        replicas += built
        types.append(BuiltType(ty, tcfg, runner, num_blocks, built, reference_step_s=step_s))
    used = [t for t in types if t.replicas]
    if not used:
        raise ServelabError(f"{where}: no instance type is usable: "
                            + "; ".join(f"{t.spec.gpu}: {t.skipped}" for t in types))
    first = used[0]
    router = make_router(cfg.engine.router, cfg.router_params, cfg.engine.seed)
    return BuiltPool(pool, cfg, first.runner, first.num_blocks, replicas, router, types)


def _check_disaggregated(pools: list[BuiltPool]) -> None:
    """What the prefill -> decode handoff does not model (yet): say so before replaying."""
    for pool in pools:
        for runner in [pool.runner, *(t.runner for t in pool.types if t.replicas)]:
            if runner.needs_block_tables:
                raise ServelabError(f"cluster pool '{pool.spec.name}': runner '{runner.name}' executes batches; "
                                    "prefill/decode pools need a cost-model runner")
        if type(pool.replicas[0].policy).charges_per_class:
            raise ServelabError(f"cluster pool '{pool.spec.name}': policy '{pool.config.policy}' charges service per "
                                "class in state that does not follow a request from a prefill to a decode replica; "
                                "prefill/decode pools do not support it yet")
        if pool.spec.role == "decode" and pool.replicas[0].policy.sheds:
            raise ServelabError(f"cluster pool '{pool.spec.name}': policy '{pool.config.policy}' drops waiting "
                                "requests, which on a decode pool hold KV; choose a policy that does not shed")


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


__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "build_runner", "not_streamed", "replay", "replay_to",
           "most_gpu_blocks", "requests_from_table", "resolve_num_gpu_blocks", "write_run"]


def _dependency_columns(trace: pa.Table) -> list[tuple[pa.Field, pa.Array]]:
    """The trace's ``depends_on``, ``think_s`` and ``task_deadline_s``, one value per request in row
    order, for the requests table of a replay whose trace has dependencies (schema v2) or closed-loop
    sessions (a trace without either keeps the requests table it always had)."""
    out = []
    for name, type_ in (("depends_on", pa.list_(pa.int64())), ("think_s", pa.float64()),
                        ("task_deadline_s", pa.float64())):
        column = trace.column(name).combine_chunks().cast(type_) if name in trace.column_names \
            else pa.nulls(trace.num_rows, type_)
        out.append((pa.field(name, type_), column))
    return out
