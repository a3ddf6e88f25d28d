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
from servelab.replay.config import EngineConfig, ReplayConfig

_ENGINE_HELP = {
    "block_size": "Tokens per KV block.",
    "num_gpu_blocks": "KV blocks per replica (default: derived from the runner's model and GPU).",
    "gpu_memory_utilization": "Share of GPU memory for weights + KV when deriving num_gpu_blocks.",
    "max_num_seqs": "Most requests in one iteration.",
    "max_num_batched_tokens": "Most tokens computed in one iteration (chunked-prefill budget).",
    "kv_allocation": "on-demand (vLLM) or reserve (prompt + max_output reserved at admission).",
    "enable_prefix_caching": "true (default) or false: reuse cached prefix blocks (vLLM v1; docs/engine.md).",
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
    "replicas": "Identical engine replicas behind the router.",
    "router": "round-robin, least-outstanding, least-kv, power-of-two, weighted, prefix-affinity (cache-aware) "
              "or session (sticky); `servelab routers` lists them.",
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
    "journal": "on: interrupted requests keep their generated tokens; off: they start over.",
    "client_timeout_s": "Client timeout in seconds for requests without a trace timeout_s: the client abandons "
                        "the request then ('aborted', its KV freed).",
}


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
    ]
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + ("until" if f.name == "until_s" else f.name.replace("_", "-"))
        repeatable = str(f.type).startswith("tuple")
        options.append(click.option(flag, f.name, default=None, multiple=repeatable,
                                    help=_ENGINE_HELP.get(f.name, "")))
    for option in reversed(options):
        func = option(func)
    return func


def config_from_options(config_file: str | None = None, policy_param: tuple[str, ...] = (),
                        router_param: tuple[str, ...] = (), **options: Any) -> ReplayConfig:
    """Merge defaults, a TOML file and explicit options into one validated ReplayConfig."""
    base = ReplayConfig.from_toml(config_file).to_dict() if config_file else {}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    for key in [*engine_names, "policy", "runner", "model", "gpu", "tp"]:
        value = options.get(key)
        if value is not None and value != ():  # a repeatable option not given is ()
            base[key] = value
    if policy_param:
        if "policy" in options and options["policy"] is not None and options["policy"] != base.get("policy"):
            base.pop("policy_params", None)
        base["policy_params"] = {**base.get("policy_params", {}), **parse_key_values(policy_param, "--policy-param")}
    if router_param:
        base["router_params"] = {**base.get("router_params", {}), **parse_key_values(router_param, "--router-param")}
    return ReplayConfig.from_dict(base, source="options")


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
    if slo is not None and not isinstance(slo, (tuple, list, str)):
        return slo  # already a table
    if isinstance(slo, str):
        slo = (slo,)
    if not slo and not config_file:
        return None
    try:
        from servelab.cli.score_cmd import slo_from_options
    except ImportError:  # a build without scoring: its plain report has no SLO columns
        if slo:
            raise ServelabError("--slo needs servelab's scoring package, which this installation lacks") from None
        return None
    return slo_from_options(tuple(slo or ()), None, config_file)


def check_replay_config(config: ReplayConfig):
    """Build what the replay needs from names (router, a policy with its parameters, the runner and
    its KV size), so that a bad name, spec or parameter fails before anything is read or printed.
    Returns the runner, for the replay to use."""
    from servelab.api import build_cluster, build_runner, kv_bytes_per_token, resolve_num_gpu_blocks
    from servelab.policies.base import make_policy
    from servelab.routers.base import make_router

    make_router(config.engine.router, config.router_params, config.engine.seed)
    make_policy(config.policy, config.policy_params, config.engine, 0)
    if config.cluster is not None:  # every pool's parts (each pool brings its own runner)
        build_cluster(config)
        return None
    runner = build_runner(config)
    resolve_num_gpu_blocks(config, runner)
    kv_bytes_per_token(config.engine, runner)
    return runner


def run_replay(trace_path: str, config: ReplayConfig, out_dir: str | None, show_report: bool,
               slo: Any = (), token_log: bool = False, force: bool = False,
               may_replace: bool = False, client_model: str | None = None) -> None:  # fmt: skip
    """Replay and write/report; every option is checked (SLO, output directory, policy, runner, trace)
    before the replay starts. ``slo``: ``--slo`` specs or an SloTable."""
    from servelab.api import replay, write_run

    slo_table = parse_slo(slo)
    check_replay_output(out_dir, force, may_replace)
    runner = check_replay_config(config)
    if client_model is not None:
        from servelab.fidelity.client_model import resolve

        client = resolve(client_model)
    trace = _load_trace(trace_path)
    click.echo(f"replaying {trace.num_rows:,} requests from {trace_path} with policy {config.policy}, "
               f"runner {config.runner}, {config.engine.replicas} replica(s)", err=True)
    with _progress_bar(trace) as progress:
        result = replay(trace, config, runner=runner, trace_meta=_trace_meta(trace_path), token_log=token_log,
                        progress=progress, token_dir=_spill_dir(out_dir) if token_log else None)
    if client_model is not None:  # the client-side times as their own columns (fidelity/client_model.py)
        import dataclasses

        from servelab.fidelity.client_model import with_client_columns

        tokens = result.tokens.read() if hasattr(result.tokens, "read") else result.tokens
        result = dataclasses.replace(result, requests=with_client_columns(result.requests, client, tokens),
                                     meta=dict(result.meta, client_model=client.to_dict()))
    meta = result.meta
    click.echo(f"simulated {meta['simulated_span_s']:.1f} s in {meta['wall_time_s']:.2f} s wall "
               f"({meta['engine']['num_gpu_blocks']:,} KV blocks per replica)", err=True)
    if out_dir:
        write_run(result, out_dir)
        click.echo(f"wrote {out_dir}/requests.parquet, steps.parquet, {'tokens.parquet, ' if token_log else ''}"
                   "run.json", err=True)
    if show_report:
        click.echo(_report(result, out_dir, slo_table))


def _spill_dir(out_dir: str | None) -> str | None:
    """Where --token-log spills while replaying: beside the run directory (same disk), else the temp folder."""
    if not out_dir:
        return None
    parent = Path(out_dir).absolute().parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    return str(parent)


@contextlib.contextmanager
def _progress_bar(trace, console=None):
    """The replay's progress on stderr when it is a terminal (else nothing: no line to be cut in a
    log), for traces of 50,000 requests or more; ``console`` (tests) is taken for a terminal."""
    if trace.num_rows < 50_000 or (console is None and not sys.stderr.isatty()):
        yield None
        return
    import pyarrow.compute as pc
    from rich.console import Console

    span_s = pc.max(trace["arrival_s"]).as_py() or 0.0
    bar = ReplayProgress(span_s, console or Console(stderr=True))
    with bar.progress:
        yield bar


class ReplayProgress:
    """``progress(now_s, ended, total)`` as a rich bar: simulated time against the trace's last
    arrival, then, while the queue drains, the requests done of those still in flight; with the
    elapsed time and an ETA. Everything but the bar is one text that wraps between words when the
    terminal is narrow: no number is ever cut."""

    def __init__(self, span_s: float, console):
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

    def __call__(self, now_s: float, ended: int, total: int) -> None:
        bar = self.progress
        if self.drain_from is None and now_s >= self.span_s:  # every trace arrival is in: the queue drains
            self.drain_from = ended
            bar.reset(self.task, total=max(total - ended, 1), completed=0, description="draining")
        if self.drain_from is None:
            bar.update(self.task, completed=now_s,
                       detail=f"{now_s:,.0f} of {self.span_s:,.0f} s simulated, {ended:,} of {total:,} done")
        else:
            bar.update(self.task, completed=ended - self.drain_from,
                       detail=f"{total - ended:,} in flight, {ended:,} of {total:,} done")


def _report(result, out_dir: str | None, slo) -> str:
    """The report `servelab report` prints; without -o, of the run written to a temporary folder
    (so that --slo attainment is reported too). A build without scoring prints percentiles only."""
    try:
        from servelab.scoring.report import report_text
    except ImportError:
        report_text = None
    if report_text is not None and out_dir:
        return report_text(out_dir, slo)
    if report_text is not None:
        import dataclasses
        import tempfile

        from servelab.replay.results import write_run

        name = str((result.meta.get("trace") or {}).get("name") or "run")
        with tempfile.TemporaryDirectory(prefix="servelab-report.") as tmp:
            run_dir = write_run(dataclasses.replace(result, tokens=None), Path(tmp) / name)
            return report_text(run_dir, slo).replace(f"({run_dir})", "(not saved: add -o RUN_DIR to keep it)", 1)
    import pyarrow.compute as pc

    req = result.requests
    counts = result.meta["counts"]
    lines = [f"requests: {req.num_rows:,}  " + "  ".join(f"{k}: {v:,}" for k, v in counts.items())]
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        q = pc.quantile(req[col], q=[0.5, 0.9, 0.99], interpolation="linear").to_pylist()
        lines.append(f"{col:7s} p50 {q[0]:.4f}  p90 {q[1]:.4f}  p99 {q[2]:.4f}")
    return "\n".join(lines)


def _slo_option(func: Callable) -> Callable:
    return click.option("--slo", multiple=True, metavar="SPEC",
                        help="SLO for the report, e.g. ttft=0.5,tpot=0.05 or tier=priority:ttft=0.2.")(func)


_force_option = click.option("--force", is_flag=True, help="Replace the run directory -o names if it already holds a run.")


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Run directory to write.")
@_force_option
@click.option("--report/--no-report", default=True, help="Print the report after the replay.")
@click.option("--token-log", is_flag=True, help="Also write tokens.parquet: every output token's time.")
@click.option("--client-model", default=None,
              help="Add client-side times (client_ttft_s, client_e2e_s, ...) with this client/API-server model: "
                   "a server kind (vllm) or a JSON from fit --client (docs/fidelity.md).")
@_slo_option
@replay_options
def replay(trace: str, out_dir: str | None, force: bool, report: bool, token_log: bool, slo: tuple[str, ...],
           client_model: str | None = None, **options: Any) -> None:
    """Replay TRACE (.arrow or .parquet) through the engine; write a run directory with -o (--force to replace one)."""
    config = config_from_options(**options)
    slo_table = parse_slo(slo, options.get("config_file"))
    run_replay(trace, config, out_dir, report, slo_table, token_log, force=force, client_model=client_model)


def _is_demo_run(out_dir: str, trace_path: Path) -> bool:
    """Whether ``out_dir`` holds a run of the bundled trace (the demo replaces its own earlier output)."""
    import json

    from servelab.traces.io import trace_sha256

    try:
        meta = json.loads((Path(out_dir) / "run.json").read_text())
        return (meta.get("trace") or {}).get("sha256") == trace_sha256(trace_path)
    except (OSError, ValueError, AttributeError, ServelabError):
        return False


@click.command()
@click.option("-o", "--out", "out_dir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace -o even if it holds a run of another trace.")
@_slo_option
@replay_options
def demo(out_dir: str, force: bool, slo: tuple[str, ...], **options: Any) -> None:
    """Replay the bundled Azure LLM conversation trace (2023, 19,366 requests) and print the report.

    Running it again replaces its own earlier run in -o; a run of another trace there needs --force.
    """
    from servelab.traces.bundled import default_trace_path

    config = config_from_options(**options)
    slo = parse_slo(slo, options.get("config_file")) or parse_slo(("ttft=2,tpot=0.1",))
    trace_path = default_trace_path()
    run_replay(str(trace_path), config, out_dir, True, slo, force=force, may_replace=_is_demo_run(out_dir, trace_path))


@click.command()
def policies() -> None:
    """List the registered scheduling policies and their parameters."""
    from servelab.policies.base import policy_class, policy_names

    _list_registered(policy_names(), policy_class, 14)


@click.command()
def routers() -> None:
    """List the registered routers and their parameters (``--router``, a pool's ``router``)."""
    from servelab.routers.base import router_class, router_names

    _list_registered(router_names(), router_class, 18)


def _list_registered(names: list[str], class_of, width: int) -> None:
    """Each name, the first line of its module's docstring, and its parameters with their defaults."""
    for name in names:
        cls = class_of(name)
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Params)) or "no parameters"
        click.echo(f"{name:{width}s} {doc}\n{'':{width}s} parameters: {params}")


__all__ = ["replay", "demo", "policies", "routers", "replay_options", "config_from_options", "run_replay", "check_replay_output",
           "parse_slo"]
