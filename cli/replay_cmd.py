"""`servelab replay`, `servelab demo` and `servelab policies`, plus the replay options other commands share.

Every engine/policy/runner option has the same name on the command line and in a TOML config
file (``--max-num-seqs 64`` == ``max_num_seqs = 64``). Precedence: defaults < ``--config`` file <
options given on the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any, Callable

import click

from servelab.cli.key_values import parse_key_values
from servelab.common.errors import ServelabError
from servelab.replay.config import COMMAND_LINE, EngineConfig, ReplayConfig

_ENGINE_HELP = {
    "block_size": "Tokens per KV block.",
    "num_gpu_blocks": "KV blocks per replica (default: derived from the runner's model and GPU).",
    "gpu_memory_utilization": "Share of GPU memory for weights + KV when deriving num_gpu_blocks.",
    "max_num_seqs": "Most requests in one iteration.",
    "max_num_batched_tokens": "Most tokens computed in one iteration (chunked-prefill budget).",
    "max_model_len": "Longest prompt + max output; longer requests are rejected (default: the model's context).",
    "kv_allocation": "on-demand (vLLM) or reserve (prompt + max_output reserved at admission).",
    "enable_prefix_caching": "Reuse cached prefix blocks (vLLM v1; docs/engine.md).",
    "prefix_cache_scope": "global (default) or tenant: a tenant's requests hit only its own cached blocks.",
    "kv_tiers": "Offload tier below GPU memory, repeatable, top first: dram:capacity_gb=64 | ssd:capacity_gb=1000 | "
                "remote:capacity_gb=10000 (shared), with optional read_gbps, write_gbps, latency_ms, shared=0|1.",
    "kv_tier_write": "back (default): blocks reach the first tier when evicted from GPU memory; through: when computed.",
    "kv_load_overlap_layers": "0 (default): a lower-tier KV load runs before the prefill; N: layer by layer over the "
                              "model's N layers, under the admitting iteration's compute.",
    "purge_tenants": "Tenant whose cached blocks are dropped from every tier when its requests end; repeatable.",
    "preemption": "recompute or swap, when KV runs out.",
    "swap_space_gb": "Host swap pool per replica, GB.",
    "swap_bandwidth_gbps": "Host<->GPU copy bandwidth, GB/s.",
    "kv_bytes_per_token": "KV bytes per token, for runners that don't know their model (swap timing).",
    "head_of_line": "strict: stop at the first waiting request that does not fit; skip: let later ones pass.",
    "async_scheduling": "vLLM's async scheduling (its default since 0.14): the next step is picked while one runs, "
                        "so a request arriving during a step is first scheduled in the step after the next.",
    "replicas": "Identical engine replicas behind the router.",
    "router": "round-robin, least-outstanding, least-kv, power-of-two, weighted, prefix-affinity (cache-aware), "
              "lora-affinity (adapter-aware) or session (sticky); `servelab routers` lists them.",
    "until_s": "Horizon in seconds; requests in flight then are 'unfinished'.",
    "seed": "Seed for every random choice (predictors, retries).",
    "quota": "Quota, repeatable: tenant=NAME:rpm=60,tpm=40000,concurrency=8 or tier=NAME:tpm=... (NAME may be *).",
    "retries": "Client retries of a throttled request.",
    "retry_backoff_s": "First retry backoff, seconds (doubles per retry).",
    "retry_max_backoff_s": "Longest retry backoff, seconds.",
    "retry_jitter": "Share of each backoff drawn away at random (seeded), 0..1.",
    "retry_after": "Clients retry exactly when their quota will have refilled (Retry-After).",
    "queue_cap": "Most requests waiting across replicas; beyond it the lowest tier is dropped.",
    "tier_order": "Tiers highest first, for queue-cap shedding.",
    "pause": "Pause a tier under load: tier=flex,waiting=32[,resume=8] or tier=flex,kv=0.9[,resume=0.7].",
    "fail": "Replica failure, repeatable: replica=R,at=T[,for=D] (seconds; without for it stays down).",
    "journal": "Interrupted requests keep their generated tokens (--no-journal: they start over).",
    "client_timeout_s": "Client timeout in seconds for requests without a trace timeout_s: the client abandons "
                        "the request then ('aborted', its KV freed).",
    "client_timeout_until": "What must arrive before the client timeout: finish (the last token: a total deadline) "
                            "or first_token (an HTTP read timeout: a client with a first byte keeps reading).",
    "spec_method": "Speculative decoding: draft_model, eagle, eagle3, mtp or ngram (off when not given).",
    "spec_k": "Speculative decoding: draft tokens proposed per decode and step (num_speculative_tokens).",
    "spec_acceptance": "Each draft's acceptance rate where the trace has no spec_acceptance: a rate, "
                       "uniform:LO,HI or beta:ALPHA,BETA (drawn per request, seeded).",
    "spec_draft_model": "spec_method draft_model: the draft's preset or config.json (default llama-3.2-1b).",
    "speculative_config": "vLLM's --speculative-config JSON (method, num_speculative_tokens, model).",
    "max_loras": "LoRA adapter slots per replica = most distinct adapters in one batch (vLLM --max-loras); 0: LoRA off.",
    "max_cpu_loras": "LoRA adapters cached in host memory per replica (vLLM --max-cpu-loras; default: max_loras).",
    "lora_rank": "Rank of every LoRA adapter not named in lora_ranks.",
    "lora_ranks": "An adapter's own rank, repeatable: NAME=RANK.",
    "lora_host_gbps": "Host -> GPU bandwidth loading a LoRA adapter cached in host memory, GB/s.",
    "lora_disk_gbps": "Disk -> host bandwidth loading a LoRA adapter not cached, GB/s.",
    "vision_encoder": "Encoder preset pricing images and video (qwen2.5-vl-vit, siglip-so400m); none: multimodal off.",
    "audio_encoder": "Encoder preset pricing audio (whisper-large-v3-encoder).",
    "encoder_cache_tokens": "Embedding tokens the encoder cache holds per replica (default: max_num_batched_tokens).",
}


_BOOL_WORDS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


def _bool_flags() -> tuple[str, ...]:
    return tuple("--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig) if str(f.type) == "bool")


class ReplayCommand(click.Command):
    """A command with the replay options: the old value form of a boolean (``--journal off``,
    ``--enable-prefix-caching=false``) still works, as ``--no-journal``, with a note that it is deprecated."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        flags, out, i = _bool_flags(), [], 0
        while i < len(args):
            arg = args[i]
            name, eq, value = arg.partition("=")
            if name in flags and (eq or (i + 1 < len(args) and args[i + 1].lower() in _BOOL_WORDS)):
                if not eq:
                    value, i = args[i + 1], i + 1
                if value.lower() not in _BOOL_WORDS:
                    raise click.BadParameter(f"expects no value (or true/false), got '{value}'", ctx, param_hint=name)
                new = name if _BOOL_WORDS[value.lower()] else "--no-" + name[2:]
                click.echo(f"note: '{arg}{'' if eq else ' ' + value}' is deprecated; write {new}", err=True)
                arg = new
            out.append(arg)
            i += 1
        return super().parse_args(ctx, out)


def replay_options(func: Callable) -> Callable:
    """Add every replay option to a click command; read them back with ``config_from_options``."""
    options = [
        click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML config file."),
        click.option("--policy", help="Scheduling policy (see `servelab policies`). Default: sarathi."),
        click.option("--policy-param", "policy_param", multiple=True, metavar="KEY=VALUE",
                     help="A policy parameter; repeatable."),
        click.option("--router-param", "router_param", multiple=True, metavar="KEY=VALUE",
                     help="A router parameter (e.g. weighted's queue=2); repeatable."),
        click.option("--runner", help="Runner spec, e.g. roofline, linear:base=0.01,prefill_token=1e-5, "
                                      "fitted:model.json. Default: roofline."),
        click.option("--model", help="Model preset for the runner (see `servelab presets`)."),
        click.option("--gpu", help="GPU preset for the runner."),
        click.option("--tp", type=int, help="Tensor-parallel degree per replica."),
        # Parallelism beyond TP, named as vLLM's flags (docs/runners.md "Parallelism").
        click.option("--dp", "--data-parallel-size", "dp", type=int,
                     help="Data-parallel ranks per replica: engines of tp x pp GPUs each (MoE: experts shared)."),
        click.option("--pp", "--pipeline-parallel-size", "pp", type=int, help="Pipeline-parallel stages per replica."),
        click.option("--enable-expert-parallel/--no-enable-expert-parallel", "enable_expert_parallel", default=None,
                     help="MoE: split the experts over the dp x tp GPUs (all-to-all dispatch and combine)."),
        click.option("--quantization", "quantization",
                     help="Weight format over the checkpoint's: fp8, int8, awq, gptq, nvfp4, mxfp4, none."),
        click.option("--kv-cache-dtype", "kv_cache_dtype", help="KV cache dtype: auto (the model's) or fp8."),
    ]
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + ("until" if f.name == "until_s" else f.name.replace("_", "-"))
        repeatable = str(f.type).startswith("tuple")
        if str(f.type) == "bool":  # vLLM's --x/--no-x; None when neither is given (the config file decides)
            on_off = "on" if f.default else "off"
            options.append(click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None,
                                        help=f"{_ENGINE_HELP.get(f.name, '')}  [default: {on_off}]"))
            continue
        # parsed as text (the config's own checks give the errors), shown with its kind and default
        kind = str(f.type).split(" | ")[0]
        metavar = {"int": "INTEGER", "float": "FLOAT"}.get(kind, "SPEC" if repeatable else "TEXT")
        shown = f.default if f.default not in (None, (), dataclasses.MISSING) else False
        default = f"  [default: {shown}]" if shown is not False else ""
        options.append(click.option(flag, f.name, default=None, multiple=repeatable, metavar=metavar,
                                    help=_ENGINE_HELP.get(f.name, "") + default))
    for option in reversed(options):
        func = option(func)
    return func


def config_from_options(config_file: str | None = None, policy_param: tuple[str, ...] = (),
                        router_param: tuple[str, ...] = (), **options: Any) -> ReplayConfig:
    """Defaults, a TOML file and explicit options as one validated ReplayConfig. The file is parsed and typed
    once (``ReplayConfig.from_toml``); options given on top of it are typed alone and replace its fields
    (``ReplayConfig.with_options``): the file's values are never typed again."""
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    runner_keys = ["dp", "pp", "enable_expert_parallel", "quantization", "kv_cache_dtype"]
    given = {key: options[key] for key in [*engine_names, "policy", "runner", "model", "gpu", "tp", *runner_keys]
             if options.get(key) is not None and options.get(key) != ()}  # a repeatable option not given is ()
    if policy_param:
        given["policy_params"] = parse_key_values(policy_param, "--policy-param")
    if router_param:
        given["router_params"] = parse_key_values(router_param, "--router-param")
    if not config_file:
        return ReplayConfig.from_dict(given, source=COMMAND_LINE)
    config = ReplayConfig.from_toml(config_file)
    return config.with_options(given, source=COMMAND_LINE) if given else config


def _load_trace(path: str):
    from servelab.traces.io import read_trace

    return read_trace(path)


def _trace_meta(path: str) -> dict:
    from servelab.traces.io import trace_sha256

    return {"path": str(path), "name": Path(path).stem, "sha256": trace_sha256(path)}


RUN_MARKERS = ("run.json", "requests.parquet")


def check_replay_output(out_dir: str | None, force: bool, may_replace: bool = False) -> None:
    """Refuse before any work to write over something that is not a run, or over a run without --force."""
    if out_dir:
        from servelab.common.outdir import check_output_dir

        check_output_dir(out_dir, force, "run directory", RUN_MARKERS, may_replace=may_replace)


def parse_slo(slo: "tuple[str, ...] | Any" = (), config_file: str | None = None):
    """The SLO for the report as an SloTable (None without any): the ``--slo`` flags over an ``[slo]``
    table in the ``--config`` file (as `servelab sweep` reads them); a bad one fails here, before the replay."""
    return parse_slo_and_source(slo, config_file)[0]


def parse_slo_and_source(slo: "tuple[str, ...] | Any" = (), config_file: str | None = None):
    """``(SloTable or None, source)``: ``parse_slo``'s table and where it came from, as the report's header
    says it (``"given"``: the flags; else it names the config file whose ``[slo]`` table it is)."""
    if slo is not None and not isinstance(slo, (tuple, list, str)):
        return slo, "given"  # already a table
    if isinstance(slo, str):
        slo = (slo,)
    if not slo and not config_file:
        return None, None
    try:
        from servelab.cli.slo_options import slo_and_source
    except ImportError:  # a build without scoring: its plain report has no SLO columns
        if slo:
            raise ServelabError("--slo needs servelab's scoring package, which this installation lacks") from None
        return None, None
    return slo_and_source(tuple(slo or ()), None, config_file)


def check_replay_config(config: ReplayConfig, trace_path: str | None = None):
    """Build what the replay needs from names (the runner and its KV size; the policy, the router and
    their parameters were checked when the config was made), so that a bad name, spec or parameter
    fails before anything is read or printed.
    Returns ``(runner, cluster)`` for the replay to use: a cluster's pools are built here, once, for
    the trace at ``trace_path`` (its prefix hash block size read from the file's schema), and the
    replay takes them (``replay(..., cluster=)``); one pool's runner is built here and its replicas by
    the replay."""
    from servelab.api import build_cluster, build_runner, kv_bytes_per_token, resolve_num_gpu_blocks

    if config.cluster is not None:  # every pool's parts (each pool brings its own runner)
        return None, build_cluster(config, None, _file_block_tokens(trace_path))
    runner = build_runner(config)
    resolve_num_gpu_blocks(config, runner)
    kv_bytes_per_token(config.engine, runner)
    return runner, None


def _file_block_tokens(trace_path: str | None) -> int | None:
    """Tokens per prefix hash of the trace file at ``trace_path`` (None without hashes, or a file that cannot
    be opened: reading it says why, later), from its schema alone."""
    if trace_path is None:
        return None
    from servelab.api import trace_block_tokens
    from servelab.replay.stream import TraceFile

    try:
        source = TraceFile(trace_path)
    except ServelabError:
        return None
    try:
        return trace_block_tokens(source.schema)
    finally:
        source.close()


def run_replay(trace_path: str, config: ReplayConfig, out_dir: str | None, show_report: bool,
               slo: Any = (), token_log: bool = False, force: bool = False,
               may_replace: bool = False, slo_source: str = "given", client_model: str | None = None,
               stream: bool = False) -> None:  # fmt: skip
    """Replay and write/report; every option is checked (SLO, output directory, policy, runner, trace)
    before the replay starts. ``slo``: ``--slo`` specs or an SloTable."""
    from servelab.api import replay, write_run

    slo_table = parse_slo(slo)
    check_replay_output(out_dir, force, may_replace)
    runner, cluster = check_replay_config(config, trace_path)
    if client_model is not None:
        from servelab.fidelity.client_model import resolve

        client = resolve(client_model)
    if stream:
        why = "no run directory (-o) to write to" if not out_dir else \
            "--client-model reads the whole token log" if client_model is not None else None
        if why is None:
            if _run_streamed(trace_path, config, out_dir, runner, show_report, slo_table, token_log, slo_source):
                return
        else:
            click.echo(f"not streaming: {why}; replaying in memory", err=True)
    trace = _load_trace(trace_path)
    click.echo(f"replaying {trace.num_rows:,} requests from {trace_path} with {_serving(config)}", err=True)
    with _progress_bar(trace) as progress:
        result = replay(trace, config, runner=runner, trace_meta=_trace_meta(trace_path), token_log=token_log,
                        progress=progress, token_dir=_spill_dir(out_dir) if token_log else None, cluster=cluster)
    if client_model is not None:  # the client-side times as their own columns (fidelity/client_model.py)
        import dataclasses

        from servelab.fidelity.client_model import with_client_columns

        tokens = result.tokens.read() if hasattr(result.tokens, "read") else result.tokens
        result = dataclasses.replace(result, requests=with_client_columns(result.requests, client, tokens),
                                     meta=dict(result.meta, client_model=client.to_dict()))
    meta = result.meta
    reuse = _ideal_reuse(trace, result.requests)
    if reuse is not None and isinstance(meta.get("trace"), dict):  # the report explains a hit share above it
        meta["trace"]["prefix_reuse_share"] = reuse
    if slo_table is not None:  # the run keeps the SLO it was judged by: a later report/query/compare uses it
        meta["slo"] = slo_table.to_dict()
    pools = (meta.get("cluster") or {}).get("pools") or []
    blocks = (", ".join(_pool_blocks(p) for p in pools) if pools
              else f"{meta['engine']['num_gpu_blocks']:,} per {_kv_unit(config)}")
    click.echo(f"simulated {meta['simulated_span_s']:.1f} s in {meta['wall_time_s']:.2f} s wall (KV blocks: {blocks})",
               err=True)
    if out_dir:
        write_run(result, out_dir)
        click.echo(f"wrote {out_dir}/requests.parquet, steps.parquet, {'tokens.parquet, ' if token_log else ''}"
                   "run.json", err=True)
    if show_report:
        click.echo(_report(result, out_dir, slo_table, slo_source))


def _pool_blocks(pool: dict) -> str:
    """A pool's KV blocks per replica for the summary line: per instance type for a pool of them."""
    if pool["num_gpu_blocks"] is not None:
        return f"{pool['num_gpu_blocks']:,} per {pool['name']} replica"
    return ", ".join(f"{t['num_gpu_blocks']:,} per {pool['name']} {t['gpu']} replica"
                     for t in pool.get("instances") or [] if t["num_gpu_blocks"] is not None)


class _InMemory(Exception):
    """``servelab replay --stream`` of a replay that is not streamed: replay in memory instead."""


def _run_streamed(trace_path: str, config: ReplayConfig, out_dir: str, runner, show_report: bool, slo_table,
                  token_log: bool, slo_source: str) -> bool:
    """``servelab replay --stream``: straight into the run directory (servelab.api.replay_to). False,
    with the reason said once, when the replay is not streamed (the caller replays in memory). A
    streamed run.json has no ``trace.prefix_reuse_share`` (it needs the whole trace at once)."""
    import json

    from servelab.api import replay_to

    def in_memory(reason: str) -> None:
        click.echo(f"not streaming: {reason}; replaying in memory", err=True)
        raise _InMemory

    from servelab.api import not_streamed

    reason = not_streamed(config)
    if reason is not None:
        click.echo(f"not streaming: {reason}; replaying in memory", err=True)
        return False
    span_s = None
    if sys.stderr.isatty():  # the progress bar's span, without loading the trace
        from servelab.replay.stream import trace_span

        span_s = trace_span(trace_path)
    click.echo(f"replaying {trace_path} streamed, with {_serving(config)}", err=True)
    try:
        with _progress_bar(None, span_s=span_s) as progress:
            replay_to(trace_path, config, out_dir, runner=runner, trace_meta=_trace_meta(trace_path), token_log=token_log,
                      progress=progress, token_dir=_spill_dir(out_dir) if token_log else None,
                      meta={"slo": slo_table.to_dict()} if slo_table is not None else None, on_fallback=in_memory)
    except _InMemory:
        return False
    meta = json.loads((Path(out_dir) / "run.json").read_text())
    click.echo(f"simulated {meta['simulated_span_s']:.1f} s of {meta['trace']['rows']:,} requests in "
               f"{meta['wall_time_s']:.2f} s wall "
               f"(KV blocks: {meta['engine']['num_gpu_blocks']:,} per {_kv_unit(config)})",
               err=True)
    click.echo(f"wrote {out_dir}/requests.parquet, steps.parquet, {'tokens.parquet, ' if token_log else ''}"
               "run.json", err=True)
    if show_report:
        click.echo(_report(None, out_dir, slo_table, slo_source))
    return True


def _kv_unit(config) -> str:
    """What one KV pool serves: a replica, or each of its DP ranks (their own engines and caches)."""
    return "DP rank" if getattr(config, "dp", 1) > 1 else "replica"


def _ideal_reuse(trace, requests) -> float | None:
    """The trace's ideal prefix reuse (what an unlimited cache would serve to first admissions), or None
    without prefix hashes. Only a run with preemptions and cache hits can exceed it (re-admitted
    requests hit their own blocks), so only such a run pays for it (seconds for 10^7 hashes).
    The counts are read with numpy: importing pyarrow.compute for two sums cost ~30 ms, a tenth
    of a small replay's whole process (issue #31)."""
    if "prefix_hashes" not in trace.column_names or "cached_tokens" not in requests.column_names:
        return None
    if not _any_positive(requests["num_preemptions"]) or not _any_positive(requests["cached_tokens"]):
        return None
    from servelab.traces.info import prefix_reuse_share  # polars: only for a run that needs the figure

    return prefix_reuse_share(trace)


def _any_positive(column) -> bool:
    """Whether a count column has a value above 0 (a null, read as NaN, is not)."""
    return bool((column.to_numpy(zero_copy_only=False) > 0).any())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _serving(config: ReplayConfig) -> str:
    """What serves the trace, for the progress line: policy, runner and replicas, counted per pool
    for a cluster (``pool prefill: 1 replica ...; pool decode: 1 replica ...; 2 replicas in all``)."""
    if config.cluster is None:
        return f"policy {config.policy}, runner {config.runner}, {_plural(config.engine.replicas, 'replica')}"
    pools = "; ".join(
        f"pool {p.name} ({p.role}): {_plural(p.replicas, 'replica')}"
        + (f" (autoscaled {p.autoscale.min}..{p.autoscale.max})" if p.autoscale is not None else "")
        for p in config.cluster.pools)
    total = sum(p.replicas for p in config.cluster.pools)
    start = " at the start" if any(p.autoscale is not None for p in config.cluster.pools) else ""
    return f"{pools}; {_plural(total, 'replica')} in all{start}"


def _spill_dir(out_dir: str | None) -> str | None:
    """Where --token-log spills while replaying: beside the run directory (same disk), else the temp folder."""
    if not out_dir:
        return None
    parent = Path(out_dir).absolute().parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    return str(parent)


PROGRESS_DELAY_S = 2.0  # wall seconds before the bar appears: a replay quicker than that shows none


@contextlib.contextmanager
def _progress_bar(trace, console=None, delay_s: float = PROGRESS_DELAY_S, span_s: float | None = None):
    """The replay's progress on stderr when it is a terminal (else nothing: no line to be cut in a
    log), once the replay has run ``delay_s`` wall seconds, whatever the trace's size; ``console``
    (tests) is taken for a terminal. ``span_s``: the trace's last arrival (else read from ``trace``)."""
    if console is None and not sys.stderr.isatty():
        yield None
        return
    import pyarrow.compute as pc
    from rich.console import Console

    if span_s is None:
        span_s = (pc.max(trace["arrival_s"]).as_py() or 0.0) if trace.num_rows else 0.0
    bar = ReplayProgress(span_s, console or Console(stderr=True), delay_s=delay_s)
    try:
        yield bar
    finally:
        bar.stop()


class ReplayProgress:
    """``progress(now_s, ended, total)`` as a rich bar: simulated time against the trace's last
    arrival, then, while the queue drains, the requests done of those still in flight; with the
    elapsed time and an ETA. Everything but the bar is one text that wraps between words when the
    terminal is narrow: no number is ever cut. The bar appears at the first call ``delay_s`` wall
    seconds or more after it was made (0: at once), so a quick replay prints nothing."""

    def __init__(self, span_s: float, console, delay_s: float = 0.0):
        import time

        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
        from rich.table import Column
        from rich.text import Text

        def clock(seconds: float | None) -> str:
            return "-:--:--" if seconds is None else str(datetime.timedelta(seconds=int(seconds)))

        class Detail(ProgressColumn):
            def __init__(self):
                super().__init__(table_column=Column(no_wrap=False, overflow="fold", min_width=12))

            def render(self, task):
                return Text(f"{task.fields['detail']}, {clock(task.elapsed or 0.0)} elapsed, "
                            f"ETA {clock(task.time_remaining)}")

        self.span_s = span_s
        self.drain_from: int | None = None  # requests ended when the last arrival was in
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), Detail(),
                                 console=console, transient=True)
        self.task = self.progress.add_task("replay", total=max(span_s, 1e-9), detail="starting")
        self._clock = time.monotonic
        self._show_at = self._clock() + delay_s
        self.started = False

    def stop(self) -> None:
        if self.started:
            self.progress.stop()
            self.started = False

    def __call__(self, now_s: float, ended: int, total: int) -> None:
        bar = self.progress
        if not self.started and self._clock() >= self._show_at:
            bar.start()
            self.started = True
        if self.drain_from is None and now_s >= self.span_s:  # every trace arrival is in: the queue drains
            self.drain_from = ended
            bar.reset(self.task, total=max(total - ended, 1), completed=0, description="draining")
        if self.drain_from is None:
            bar.update(self.task, completed=now_s,
                       detail=f"{now_s:,.0f} of {self.span_s:,.0f} s simulated, {ended:,} of {total:,} done")
        else:
            bar.update(self.task, completed=ended - self.drain_from,
                       detail=f"{total - ended:,} in flight, {ended:,} of {total:,} done")


def _report(result, out_dir: str | None, slo, slo_source: str = "given") -> str:
    """The report `servelab report` prints; without -o, of the run written to a temporary folder
    (so that --slo attainment is reported too). A build without scoring prints percentiles only
    (``result`` None: of the run in ``out_dir``, as a streamed replay leaves it)."""
    try:
        from servelab.scoring.report import report_text
    except ImportError:
        report_text = None
    if report_text is not None and out_dir:
        return report_text(out_dir, slo, slo_source=slo_source)
    if report_text is not None:
        import dataclasses
        import tempfile

        from servelab.replay.results import write_run

        name = str((result.meta.get("trace") or {}).get("name") or "run")
        with tempfile.TemporaryDirectory(prefix="servelab-report.") as tmp:
            run_dir = write_run(dataclasses.replace(result, tokens=None), Path(tmp) / name)
            return report_text(run_dir, slo, slo_source=slo_source).replace(f"({run_dir})", "(not saved: add -o RUN_DIR to keep it)", 1)
    import pyarrow.compute as pc

    if result is None:  # a streamed run: read back from its directory
        import json

        import pyarrow.parquet as pq

        req = pq.read_table(Path(out_dir) / "requests.parquet", columns=["ttft_s", "tpot_s", "e2e_s"])
        counts = json.loads((Path(out_dir) / "run.json").read_text())["counts"]
    else:
        req = result.requests
        counts = result.meta["counts"]
    lines = [f"requests: {req.num_rows:,}  " + "  ".join(f"{k}: {v:,}" for k, v in counts.items())]
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        q = pc.quantile(req[col], q=[0.5, 0.9, 0.99], interpolation="linear").to_pylist()
        lines.append(f"{col:7s} p50 {q[0]:.4f}  p90 {q[1]:.4f}  p99 {q[2]:.4f}")
    return "\n".join(lines)


def _slo_option(func: Callable) -> Callable:
    return click.option("--slo", multiple=True, metavar="SPEC",
                        help="SLO for the report, kept in run.json, e.g. ttft=500ms,tpot=50ms or tier=priority:ttft=0.2s "
                             "or task=30s (a deadline per task; a bare number is seconds).")(func)


_force_option = click.option("--force/--no-force", default=False, help="Replace the run directory -o names if it already holds a run.")


@click.command(cls=ReplayCommand)
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Run directory to write.")
@_force_option
@click.option("--report/--no-report", default=True, help="Print the report after the replay.")
@click.option("--token-log/--no-token-log", default=False, help="Also write tokens.parquet: every output token's time.")
@click.option("--client-model", default=None,
              help="Add client-side times (client_ttft_s, client_e2e_s, ...) with this client/API-server model: "
                   "a server kind (vllm: a GPU server's, vllm-cpu) or a JSON from fit --client (docs/fidelity.md).")
@click.option("--stream/--no-stream", default=False,
              help="Read the trace in batches and write -o's files as requests end: memory holds the requests in "
                   "flight, not the trace (docs/performance.md). What is not streamed replays in memory, saying why.")
@_slo_option
@replay_options
def replay(trace: str, out_dir: str | None, force: bool, report: bool, token_log: bool, slo: tuple[str, ...],
           client_model: str | None = None, stream: bool = False, **options: Any) -> None:
    """Replay TRACE (.arrow or .parquet) through the engine; write a run directory with -o (--force to replace one)."""
    config = config_from_options(**options)
    slo_table, slo_source = parse_slo_and_source(slo, options.get("config_file"))
    run_replay(trace, config, out_dir, report, slo_table, token_log, force=force, slo_source=slo_source or "given",
               client_model=client_model, stream=stream)


def _is_demo_run(out_dir: str, trace_path: Path) -> bool:
    """Whether ``out_dir`` holds a run of the bundled trace (the demo replaces its own earlier output)."""
    import json

    from servelab.traces.io import trace_sha256

    try:
        meta = json.loads((Path(out_dir) / "run.json").read_text())
        return (meta.get("trace") or {}).get("sha256") == trace_sha256(trace_path)
    except (OSError, ValueError, AttributeError, ServelabError):
        return False


@click.command(cls=ReplayCommand)
@click.option("-o", "--out", "out_dir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--force/--no-force", default=False, help="Replace -o even if it holds a run of another trace.")
@_slo_option
@replay_options
def demo(out_dir: str, force: bool, slo: tuple[str, ...], **options: Any) -> None:
    """Replay the bundled Azure LLM conversation trace (2023, 19,366 requests) and print the report.

    Running it again replaces its own earlier run in -o; a run of another trace there needs --force.
    """
    from servelab.traces.bundled import default_trace_path

    config = config_from_options(**options)
    given, source = parse_slo_and_source(slo, options.get("config_file"))
    slo = given or parse_slo(("ttft=2,tpot=0.1",))
    trace_path = default_trace_path()
    run_replay(str(trace_path), config, out_dir, True, slo, force=force, may_replace=_is_demo_run(out_dir, trace_path),
               slo_source=source if given else "the demo's default SLO; --slo replaces it")


@click.command()
def policies() -> None:
    """List the registered scheduling policies and their parameters."""
    from servelab.policies.base import POLICIES, policy_class, policy_names

    _list_registered(policy_names(), policy_class, 14, POLICIES.aliases_of)


@click.command()
def routers() -> None:
    """List the registered routers and their parameters (``--router``, a pool's ``router``)."""
    from servelab.routers.base import router_class, router_names

    _list_registered(router_names(), router_class, 18)


def _list_registered(names: list[str], class_of, width: int, aliases_of=None) -> None:
    """Each name, the first line of its module's docstring, and its parameters with their defaults."""
    from servelab.common.coerce import option_text

    for name in names:
        cls = class_of(name)
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        params = ", ".join(f"{f.name}={option_text(f.default)}" for f in dataclasses.fields(cls.Params)) \
            or "no parameters"
        aliases = aliases_of(name) if aliases_of else []
        also = f"\n{'':{width}s} also named: {', '.join(aliases)}" if aliases else ""
        click.echo(f"{name:{width}s} {doc}\n{'':{width}s} parameters: {params}{also}")


__all__ = ["ReplayCommand", "replay", "demo", "policies", "routers", "replay_options", "config_from_options", "run_replay", "check_replay_output",
           "parse_slo", "parse_slo_and_source"]
