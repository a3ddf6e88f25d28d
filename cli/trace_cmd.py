"""`servelab trace`: import, synthesise, transform, merge, inspect and validate request traces."""

from __future__ import annotations

import json
from pathlib import Path

import click

from servelab.cli.choices import RegistryChoice
from servelab.common.errors import ServelabError

_PATH = click.Path(path_type=Path)
_EXISTING = click.Path(path_type=Path, exists=False)


@click.group()
def trace() -> None:
    """Work with request traces (Arrow IPC / Parquet, schema version 2; version 1 files read too)."""


# ------------------------------------------------------------------ shared option groups


def _status(message: str):
    """A rich spinner on stderr while a long step runs (nothing when stderr is not a terminal)."""
    from rich.console import Console

    return Console(stderr=True).status(message)


def _arrival_options(fn):
    """Options that describe an arrival process (synth and the lengths importer)."""
    opts = [
        click.option("--arrival", default="poisson", show_default=True,
                     type=click.Choice(["poisson", "gamma", "weibull", "constant"]), help="Gap distribution."),
        click.option("--rate", type=float, default=1.0, show_default=True, help="Mean arrival rate (req/s)."),
        click.option("--cv", type=float, default=1.0, show_default=True, help="Gap coefficient of variation (gamma, weibull)."),
        click.option("--profile", default="flat", show_default=True,
                     type=click.Choice(["flat", "piecewise", "diurnal", "onoff"]), help="How the rate varies over time."),
        click.option("--schedule", default=None, help="Piecewise rates 'START_S:RATE,...' (starts at 0)."),
        click.option("--diurnal-amplitude", type=float, default=0.5, show_default=True, help="rate·(1 + A·sin(2πt/period))."),
        click.option("--diurnal-period-s", type=float, default=86400.0, show_default=True),
        click.option("--burst-on-s", type=float, default=10.0, show_default=True, help="On-off: on part of each cycle."),
        click.option("--burst-off-s", type=float, default=50.0, show_default=True, help="On-off: off part of each cycle."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _parse_schedule(text: str | None) -> tuple[tuple[float, float], ...]:
    if not text:
        return ()
    steps = []
    for part in text.split(","):
        start, sep, rate = part.partition(":")
        try:
            steps.append((float(start), float(rate)))
        except ValueError:
            raise ServelabError(f"bad --schedule '{text}' (use START_S:RATE,START_S:RATE,...)") from None
        if not sep:
            raise ServelabError(f"bad --schedule '{text}' (use START_S:RATE,START_S:RATE,...)")
    return tuple(steps)


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _check_arrival_options(ctx: click.Context) -> None:
    """Refuse an arrival option the chosen process or profile does not use: it would be ignored."""
    arrival, profile = ctx.params["arrival"], ctx.params["profile"]
    if _given(ctx, "cv") and arrival not in ("gamma", "weibull"):
        own = 0 if arrival == "constant" else 1
        raise ServelabError(f"--cv does not apply to --arrival {arrival} (its gaps have CV {own}); it needs --arrival "
                            "gamma or weibull")
    if _given(ctx, "rate") and profile == "piecewise":
        raise ServelabError("--rate does not apply to --profile piecewise (--schedule gives the rates)")
    for name, needs in (("schedule", "piecewise"), ("diurnal_amplitude", "diurnal"), ("diurnal_period_s", "diurnal"),
                        ("burst_on_s", "onoff"), ("burst_off_s", "onoff")):
        if _given(ctx, name) and profile != needs:
            raise ServelabError(f"--{name.replace('_', '-')} needs --profile {needs} (the profile is {profile})")


def _arrival_kwargs(kw: dict) -> dict:
    return {
        "arrival": kw.pop("arrival"),
        "rate": kw.pop("rate"),
        "cv": kw.pop("cv"),
        "profile": kw.pop("profile"),
        "schedule": _parse_schedule(kw.pop("schedule")),
        "diurnal_amplitude": kw.pop("diurnal_amplitude"),
        "diurnal_period_s": kw.pop("diurnal_period_s"),
        "burst_on_s": kw.pop("burst_on_s"),
        "burst_off_s": kw.pop("burst_off_s"),
    }


def _arrival_config(kw: dict):
    from servelab.traces.arrivals import ArrivalConfig

    a = _arrival_kwargs(kw)
    return ArrivalConfig(
        process=a["arrival"], rate_per_s=a["rate"], cv=a["cv"], profile=a["profile"], schedule=a["schedule"],
        diurnal_amplitude=a["diurnal_amplitude"], diurnal_period_s=a["diurnal_period_s"],
        burst_on_s=a["burst_on_s"], burst_off_s=a["burst_off_s"],
    )


# ------------------------------------------------------------------ import

# The options an importer may take, each as the importer's keyword parameter it sets (the same name
# unless said here; the arrival options make one ``arrival``). A format takes the options whose
# parameter its importer's signature has; anything else set on the command line is an error. So a new
# importer (one file in servelab.traces) taking these parameters needs no edit here.
_ARRIVAL = ("arrival", "rate", "cv", "profile", "schedule", "diurnal_amplitude", "diurnal_period_s", "burst_on_s",
            "burst_off_s")
_PARAMETER = {"start": "start_s", "duration": "duration_s", **{name: "arrival" for name in _ARRIVAL}}
_IMPORT_OPTIONS = ("drop_zero", "tenant_from_file", "log_type_as", "block_tokens", "seed", "limit", "shuffle", "start",
                   "duration", "clients", "skip_missing", "think_s", "think", "chars_per_token", "task_deadline_s",
                   "modalities", *_ARRIVAL)


def _trace_formats() -> list[str]:
    from servelab.traces.imported import IMPORTERS

    return IMPORTERS.names()


def _format_options(fmt: str) -> set[str]:
    """The command-line options ``--format fmt`` takes: those whose parameter its importer takes."""
    import inspect

    from servelab.traces.imported import IMPORTERS

    taken = inspect.signature(IMPORTERS.get(fmt)).parameters
    return {name for name in _IMPORT_OPTIONS if _PARAMETER.get(name, name) in taken}


@trace.command("import")
@click.option("--format", "fmt", default=None, type=RegistryChoice(_trace_formats),
              help="Source format (detected from the first file when omitted).")
@click.argument("sources", nargs=-1, required=True, type=_EXISTING)
@click.option("-o", "--output", "out", required=True, type=_PATH, help="Trace to write (.arrow or .parquet).")
@click.option("--drop-zero/--no-drop-zero", default=False, help="azure/vidur: drop rows with 0 tokens instead of failing.")
@click.option("--tenant-from-file/--no-tenant-from-file", default=False, help="Tag each source file's requests with tenant = file stem.")
@click.option("--log-type-as", default="tenant", show_default=True, type=click.Choice(["tenant", "tier", "none"]),
              help="burstgpt: where the Log Type goes.")
@click.option("--block-tokens", type=int, default=None,
              help="mooncake, mooncake-chains: tokens per hash_ids block (512); llmservingsim, sharegpt: tokens per "
                   "prefix-hash block (16).")
@click.option("--seed", type=int, default=0, show_default=True, help="lengths/servegen: random seed.")
@click.option("--limit", type=int, default=None, help="lengths: use only the first N pairs (after --shuffle).")
@click.option("--shuffle/--no-shuffle", default=False, help="lengths: shuffle the pairs (seeded) before use.")
@click.option("--start", type=float, default=0.0, show_default=True, help="servegen: window start (s of the day).")
@click.option("--duration", type=float, default=3600.0, show_default=True, help="servegen: window length (s).")
@click.option("--clients", default=None, help="servegen: only these clients, e.g. 'chunk-3,chunk-7'.")
@click.option("--skip-missing/--no-skip-missing", default=False,
              help="servegen: leave out clients whose chunk-N-dataset.json is missing (a warning says how much traffic).")
@click.option("--think-s", type=float, default=None,
              help="sharegpt: user think time between turns (s, default 0); mooncake-chains: wait after the parent "
                   "finishes (default: the recorded gap between the two arrivals).")
@click.option("--think", type=click.Choice(["fixed", "exponential"]), default="fixed", show_default=True,
              help="sharegpt: --think-s for every turn, or exponential with that mean (seeded).")
@click.option("--chars-per-token", type=float, default=4.0, show_default=True,
              help="sharegpt: characters per token (the source has text, not token counts).")
@click.option("--task-deadline-s", type=float, default=None,
              help="llmservingsim, mooncake-chains, sharegpt: every task's deadline (task_deadline_s column).")
@click.option("--modalities/--no-modalities", default=False,
              help="servegen: also write image_tokens, audio_tokens, video_tokens columns (a replay with an encoder).")
@_arrival_options
@click.option("--shared-prefix-tokens", type=int, default=None,
              help="Every request starts with a shared prefix of N tokens (per group): sharing the source does not record.")
@click.option("--prefix-groups", type=int, default=None, help="With --shared-prefix-tokens: G prefixes, request i in group i mod G.")
@click.option("--prompt-pool", type=int, default=None, help="Requests cycle through a pool of K prompts (request i sends i mod K).")
@click.option("--prefix-block-tokens", type=int, default=16, show_default=True,
              help="Block size of the prefix hashes the three options above add.")
@click.pass_context
def import_cmd(ctx: click.Context, fmt: str | None, sources: tuple[Path, ...], out: Path, **kw) -> None:
    """Convert public trace files (SRC...) of one FORMAT into a servelab trace; several files merge."""
    from servelab.traces.importers import detect_format, import_trace
    from servelab.traces.io import write_trace

    from servelab.traces.prefixes import spec_from_options

    spec = spec_from_options(kw.pop("shared_prefix_tokens"), kw.pop("prefix_groups"), kw.pop("prompt_pool"))
    block_tokens = kw.pop("prefix_block_tokens")
    if spec is None and _given(ctx, "prefix_block_tokens"):
        # (a source's own hashes keep their block size: --block-tokens where the format has one)
        raise ServelabError("--prefix-block-tokens sizes the hashes --shared-prefix-tokens or --prompt-pool add; "
                            "give one of them")
    if spec is not None and block_tokens < 1:  # checked before the import: the hashes divide by it
        raise ServelabError(f"--prefix-block-tokens must be >= 1 (got {block_tokens})")
    if fmt is None:
        fmt = detect_format(list(sources))
        click.echo(f"format: {fmt} (detected; --format to choose)", err=True)
    allowed = _format_options(fmt)
    for name in sorted(set(_IMPORT_OPTIONS) - allowed):
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise ServelabError(f"--{name.replace('_', '-')} does not apply to --format {fmt}")
    if "arrival" in allowed:
        _check_arrival_options(ctx)
    options = {"arrival": _arrival_config(kw)} if "arrival" in allowed else {}  # (the arrival options, as one)
    for name in sorted(allowed - set(_ARRIVAL)):  # each other option the format takes, as the importer's parameter
        parameter = _PARAMETER.get(name, name)
        if name == "clients":
            if kw["clients"]:
                options["clients"] = tuple(c.strip() for c in kw["clients"].split(",") if c.strip())
        elif kw[name] is not None:
            options[parameter] = kw[name]
    with _status(f"importing {len(sources)} {fmt} source(s)"):
        result = import_trace(fmt, list(sources), **options)
        table, block = result.table, result.prefix_block_tokens
        if spec is not None:
            from servelab.traces.prefixes import add_sharing

            table, block = add_sharing(table, spec, block_tokens), block_tokens
        write_trace(table, out, result.source + (f"; prefixes: {spec.describe()}" if spec else ""), block)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"{out}: {result.summary()}")


# ------------------------------------------------------------------ synth


@trace.command("synth")
@click.option("-o", "--output", "out", required=True, type=_PATH, help="Trace to write (.arrow or .parquet).")
@click.option("-n", "--requests", "n", type=int, default=None, help="Number of requests (default 1000).")
@click.option("--duration-s", type=float, default=None, help="Generate arrivals for this long instead of -n.")
@_arrival_options
@click.option("--prompt", default="512", show_default=True, help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA [:cap=N]")
@click.option("--output-len", "output_len", default="128", show_default=True, help="Same forms as --prompt.")
@click.option("--lengths-from", type=_PATH, default=None, help="Resample (prompt, output) pairs from a trace or lengths CSV.")
@click.option("--tenants", default=None, help="A count (tenant-0..) or weights 'a=3,b=1'.")
@click.option("--tenant-zipf", type=float, default=0.0, show_default=True, help="With a tenant count: weight 1/rank^s.")
@click.option("--tiers", default=None, help="Fractions 'priority=0.1,standard=0.6,flex=0.3'.")
@click.option("--turns", type=float, default=1.0, show_default=True, help="Mean turns per session (>1 makes sessions).")
@click.option("--think-s", type=float, default=0.0, show_default=True, help="Mean think time between turns (s).")
@click.option("--session-context/--no-session-context", default=True, show_default=True,
              help="Later turns' prompts include the conversation so far.")
@click.option("--shared-prefix-tokens", type=int, default=0, show_default=True,
              help="Shared prefix length: per tenant (a system prompt), or per group with --prefix-groups.")
@click.option("--prefix-groups", type=int, default=0, show_default=True,
              help="G shared prefixes, request i in group i mod G (0: one per tenant).")
@click.option("--prompt-pool", type=int, default=0, show_default=True,
              help="Requests cycle through a pool of K prompts (request i sends prompt i mod K); 0: no pool.")
@click.option("--prefix-block-tokens", type=int, default=None, help="Add prefix_hashes with this block size.")
@click.option("--model", default=None, help="Model name to store in the model column.")
@click.option("--lora-adapters", type=int, default=None,
              help="Assign N LoRA adapters (lora-0..) to the requests, Zipf popularity (per session).")
@click.option("--lora-zipf", type=float, default=1.0, show_default=True, help="With --lora-adapters: weight 1/rank^s.")
@click.option("--lora-base-fraction", type=float, default=0.0, show_default=True,
              help="With --lora-adapters: share of requests on the base model (no adapter).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shape", default=None, type=click.Choice(["react", "fanout", "chat", "mix"]),
              help="Agentic tasks of dependent calls (schema v2): ReAct loops, fan-out then aggregate, multi-turn "
                   "chats, or a mix; the arrival options then give task starts.")
@click.option("--tasks", type=int, default=100, show_default=True, help="--shape: number of tasks.")
@click.option("--mix", default=None, help="--shape mix: weights 'react=2,fanout=1,chat=1' (default equal).")
@click.option("--calls", default="4", show_default=True, help="--shape react: calls per task (a length spec).")
@click.option("--branches", default="4", show_default=True, help="--shape fanout: parallel branches (a length spec).")
@click.option("--chat-turns", default="3", show_default=True, help="--shape chat: turns per chat (a length spec).")
@click.option("--tool-s", default="1", show_default=True,
              help="--shape: tool time before a dependent call: S | exp:MEAN | uniform:LO:HI | lognormal:MEDIAN:SIGMA.")
@click.option("--user-think-s", default="5", show_default=True, help="--shape chat: user think time (same forms).")
@click.option("--new-tokens", default="256", show_default=True,
              help="--shape: tokens a tool result, branch or user message adds to the context (a length spec).")
@click.option("--task-deadline-s", type=float, default=None, help="--shape: deadline of every task (task_deadline_s).")
@click.pass_context
def synth_cmd(ctx: click.Context, out: Path, n: int | None, duration_s: float | None, **kw) -> None:
    """Generate a seeded synthetic trace (with --shape: agentic tasks of dependent calls)."""
    from servelab.traces.io import write_trace
    from servelab.traces.synth import generate, make_config, parse_fractions

    _check_arrival_options(ctx)
    if kw["shape"] is not None:
        _synth_agentic(ctx, out, n, duration_s, kw)
        return
    for name in _AGENT_ONLY:
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise ServelabError(f"--{name.replace('_', '-')} needs --shape")
    if kw["lengths_from"] is not None:
        for name in ("prompt", "output_len"):
            if _given(ctx, name):
                raise ServelabError(f"--{name.replace('_', '-')} does not apply with --lengths-from (the file gives "
                                    "the lengths)")
    if n is None and duration_s is None:
        n = 1000
    tenants = kw.pop("tenants")
    if tenants is not None and tenants.strip().isdigit():
        tenants = int(tenants)
    config = make_config(
        n=n,
        duration_s=duration_s,
        **_arrival_kwargs(kw),
        prompt=kw["prompt"],
        output=kw["output_len"],
        lengths_from=kw["lengths_from"],
        tenants=tenants,
        tenant_zipf=kw["tenant_zipf"],
        tiers=parse_fractions(kw["tiers"], "--tiers") if kw["tiers"] else None,
        turns=kw["turns"],
        think_s=kw["think_s"],
        session_context=kw["session_context"],
        shared_prefix_tokens=kw["shared_prefix_tokens"],
        prefix_groups=kw["prefix_groups"],
        prompt_pool=kw["prompt_pool"],
        prefix_block_tokens=kw["prefix_block_tokens"],
        model=kw["model"],
        seed=kw["seed"],
    )
    with _status("generating"):
        table = generate(config)
        if kw["lora_adapters"] is not None:
            from servelab.traces.transforms import lora_adapters

            table = lora_adapters(table, kw["lora_adapters"], kw["lora_zipf"], kw["lora_base_fraction"], kw["seed"])
            source = f"{config.source} | {kw['lora_adapters']} LoRA adapters zipf {kw['lora_zipf']:g}"
        write_trace(table, out, source if kw["lora_adapters"] is not None else config.source,
                    config.prefix_block_tokens)
    click.echo(f"{out}: {table.num_rows} requests ({config.source})")


_AGENT_ONLY = ("tasks", "mix", "calls", "branches", "chat_turns", "tool_s", "user_think_s", "new_tokens",
               "task_deadline_s")
_NOT_AGENTIC = ("lengths_from", "tiers", "tenant_zipf", "turns", "think_s", "session_context", "shared_prefix_tokens",
                "prefix_groups", "prompt_pool", "model")


def _synth_agentic(ctx: click.Context, out: Path, n: int | None, duration_s: float | None, kw: dict) -> None:
    from servelab.traces.agentic_synth import generate_agentic, make_agent_config
    from servelab.traces.io import write_trace

    if n is not None or duration_s is not None:
        raise ServelabError("--shape counts tasks: use --tasks, not -n / --duration-s")
    for name in _NOT_AGENTIC:
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise ServelabError(f"--{name.replace('_', '-')} does not apply to --shape")
    if kw["mix"] is not None and kw["shape"] != "mix":
        raise ServelabError("--mix needs --shape mix")
    tenants = kw["tenants"]
    if tenants is not None and tenants.strip().isdigit():
        from servelab.traces.synth import zipf_tenants

        tenants = zipf_tenants(int(tenants))
    arrival = _arrival_config(kw)
    options = dict(shape=kw["shape"], tasks=kw["tasks"], arrival=arrival, prompt=kw["prompt"], output=kw["output_len"],
                   new_tokens=kw["new_tokens"], calls=kw["calls"], branches=kw["branches"], chat_turns=kw["chat_turns"],
                   tool_s=kw["tool_s"], user_think_s=kw["user_think_s"], task_deadline_s=kw["task_deadline_s"],
                   prefix_block_tokens=16 if kw["prefix_block_tokens"] is None else kw["prefix_block_tokens"],
                   seed=kw["seed"])
    if kw["mix"] is not None:
        options["mix"] = kw["mix"]
    if tenants is not None:
        options["tenants"] = tenants
    config = make_agent_config(**options)
    with _status("generating"):
        table = generate_agentic(config)
        write_trace(table, out, config.source, config.prefix_block_tokens)
    click.echo(f"{out}: {table.num_rows} requests in {config.tasks} tasks ({config.source})")


# ------------------------------------------------------------------ transform / merge


def _window(text: str) -> tuple[float, float | None]:
    start, sep, end = text.partition(":")
    if not sep:  # '100' could mean from 100 s on or up to 100 s: say which
        raise ServelabError(f"bad --window '{text}' (use START_S:END_S, either side may be empty: "
                            f"'{text}:' from {text} s on, ':{text}' up to {text} s)")
    try:
        return float(start or 0), (float(end) if end else None)
    except ValueError:
        raise ServelabError(f"bad --window '{text}' (use START_S:END_S, either side may be empty)") from None


def _mapping(text: str) -> dict[str, str]:
    pairs = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ServelabError(f"bad mapping '{text}' (use tenant=tier,tenant=tier)")
        pairs[key.strip()] = value.strip()
    return pairs


def _deprecated(value, old: str, new: str):
    """An old option name still works, with a note that names the new one."""
    if value is not None and value != ():
        click.echo(f"note: {old} is deprecated; write {new}", err=True)
    return value


@trace.command("transform")
@click.argument("src", type=_EXISTING)
@click.option("-o", "--output", "out", required=True, type=_PATH)
@click.option("--window", default=None, help="Keep arrivals in START_S:END_S, re-based to 0 (sessions whole).")
@click.option("--head", type=int, default=None, help="Keep the first N requests.")
@click.option("--sample", default=None,
              help="Random subset: a count N (an integer) or a fraction 0<F<=1 (with a decimal point: 1.0 keeps all; "
                   "sessions whole).")
@click.option("--rate-scale", type=float, default=None, help="Multiply the arrival rate by K (arrival times / K).")
@click.option("--scale-rate", type=float, default=None, hidden=True,
              callback=lambda ctx, param, value: _deprecated(value, "--scale-rate", "--rate-scale"))
@click.option("--tier-by-tenant", default=None, help="Set tiers from tenants: 'tenantA=priority,tenantB=flex'.")
@click.option("--tier-default", default=None, help="With --tier-by-tenant: tier of unlisted tenants.")
@click.option("--tier-fractions", default=None, help="Random tiers: 'priority=0.1,standard=0.6,flex=0.3'.")
@click.option("--lora-adapters", type=int, default=None,
              help="Assign N LoRA adapters (lora-0..) to the requests, Zipf popularity (per session).")
@click.option("--lora-zipf", type=float, default=1.0, show_default=True, help="With --lora-adapters: weight 1/rank^s.")
@click.option("--lora-base-fraction", type=float, default=0.0, show_default=True,
              help="With --lora-adapters: share of requests on the base model (no adapter).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --sample, --tier-fractions, --lora-adapters.")
def transform_cmd(src: Path, out: Path, **kw) -> None:
    """Reshape a trace. Steps run in this order: window, head, sample, rate-scale, tiers, LoRA adapters."""
    from servelab.traces import transforms
    from servelab.traces.io import read_trace, trace_metadata, write_trace
    from servelab.traces.synth import parse_fractions

    table = read_trace(src)
    steps = []
    if kw["window"]:
        table = transforms.window(table, *_window(kw["window"]))
        steps.append(f"window {kw['window']}")
    if kw["head"] is not None:
        table = transforms.head(table, kw["head"])
        steps.append(f"head {kw['head']}")
    if kw["sample"]:
        # An integer is a count, a number with a decimal point (or an exponent) a fraction: 1 keeps one
        # request, 1.0 all of them.
        text = kw["sample"].strip()
        try:
            count, fraction = int(text), None
        except ValueError:
            try:
                count, fraction = None, float(text)
            except ValueError:
                raise ServelabError(f"bad --sample '{text}' (a count N, or a fraction 0<F<=1 written with "
                                    "a decimal point)") from None
        table = transforms.sample(table, kw["seed"], n=count, fraction=fraction)
        steps.append(f"sample {kw['sample']} seed {kw['seed']}")
    scale = kw["rate_scale"] if kw["rate_scale"] is not None else kw["scale_rate"]
    if scale is not None:
        table = transforms.scale_rate(table, scale)
        steps.append(f"rate x{scale:g}")
    if kw["tier_by_tenant"] and kw["tier_fractions"]:
        raise ServelabError("use one of --tier-by-tenant and --tier-fractions")
    if kw["tier_default"] and not kw["tier_by_tenant"]:
        raise ServelabError("--tier-default needs --tier-by-tenant")
    if kw["tier_by_tenant"]:
        table = transforms.tier_by_tenant(table, _mapping(kw["tier_by_tenant"]), kw["tier_default"])
        steps.append("tier by tenant")
    if kw["tier_fractions"]:
        table = transforms.tier_by_fraction(table, parse_fractions(kw["tier_fractions"], "--tier-fractions"), kw["seed"])
        steps.append(f"tier fractions seed {kw['seed']}")
    if kw["lora_adapters"] is not None:
        table = transforms.lora_adapters(table, kw["lora_adapters"], kw["lora_zipf"], kw["lora_base_fraction"], kw["seed"])
        steps.append(f"{kw['lora_adapters']} LoRA adapters zipf {kw['lora_zipf']:g} seed {kw['seed']}")
    if not steps:
        raise ServelabError("nothing to do: give at least one of --window, --head, --sample, --rate-scale, --tier-*, "
                            "--lora-adapters")
    meta = trace_metadata(table)
    source = f"{meta.get('source', src.name)} | {'; '.join(steps)}"
    write_trace(table, out, source)
    click.echo(f"{out}: {table.num_rows} requests ({'; '.join(steps)})")


@trace.command("merge")
@click.argument("sources", nargs=-1, required=True, type=_EXISTING)
@click.option("-o", "--output", "out", required=True, type=_PATH)
@click.option("--tag/--no-tag", default=True, show_default=True, help="Tag tenants with each file's stem.")
def merge_cmd(sources: tuple[Path, ...], out: Path, tag: bool) -> None:
    """Overlay several traces on one clock (ids renumbered)."""
    from servelab.traces import transforms
    from servelab.traces.io import read_trace, write_trace

    tables = [read_trace(p) for p in sources]
    names = [p.stem for p in sources] if tag else None
    if names is not None and len(set(names)) != len(names):
        raise ServelabError("two sources share a file stem; rename one or use --no-tag")
    table = transforms.merge(tables, names)
    write_trace(table, out, "merge of " + ", ".join(p.name for p in sources))
    click.echo(f"{out}: {table.num_rows} requests from {len(sources)} traces")


# ------------------------------------------------------------------ info / validate


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.001:
            return f"{value:.3g}"
        digits = 3 if abs(value) < 100 else 1
        value = round(value, digits)  # what is shown: 3,482, not 3,482.0 for 3481.99 (float noise)
        if value.is_integer():  # token percentiles of integer columns: 13, not 13.000
            return f"{int(value):,}"
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _top(counts: dict[str, int], rows: int, k: int = 8) -> str:
    items = [f"{name} {n / rows:.1%}" for name, n in list(counts.items())[:k]]
    more = len(counts) - k
    return ", ".join(items) + (f", … (+{more})" if more > 0 else "")


@trace.command("info")
@click.argument("path", type=_EXISTING)
@click.option("--json/--no-json", "as_json", default=False, help="Print the statistics as JSON.")
def info_cmd(path: Path, as_json: bool) -> None:
    """Statistics of a trace: size, rate, burstiness, lengths, tenants, tiers, prefix reuse."""
    from servelab.traces.info import trace_info
    from servelab.traces.io import read_trace

    info = trace_info(read_trace(path))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from rich.table import Table

    from servelab.common.tables import print_table

    t = Table(title=str(path), show_header=False)
    t.add_column("stat", style="bold")
    t.add_column("value")
    t.add_row("requests", _fmt(info["rows"]))
    t.add_row("span", f"{_fmt(info['span_s'])} s")
    t.add_row("mean rate", f"{_fmt(info['mean_rate_per_s'])} req/s")
    cv = info["interarrival_cv"]  # rounded: constant gaps give a CV of 1e-13 in float arithmetic, shown as 0
    t.add_row("inter-arrival CV", _fmt(None if cv is None else round(cv, 6)))
    t.add_row("peak 1 s rate", f"{info['peak_1s_rate_per_s']} req/s")
    for name in ("prompt_tokens", "output_tokens"):
        s = info[name]
        t.add_row(name.replace("_", " "), "  ".join(f"{k} {_fmt(s[k])}" for k in ("mean", "p50", "p90", "p99", "max")))
    t.add_row("tenants", f"{len(info['tenants'])}: {_top(info['tenants'], info['rows'])}")
    t.add_row("tiers", _top(info["tiers"], info["rows"]))
    if "models" in info:
        t.add_row("models", _top(info["models"], info["rows"]))
    t.add_row("sessions", _fmt(info["sessions"]))
    if "dependent_requests" in info:
        t.add_row("dependent requests", f"{_fmt(info['dependent_requests'])} (sent when their parents finish: "
                                        "the rate above counts them at their task's start)")
    share = info["prefix_reuse_share"]
    t.add_row("ideal prefix reuse", "-" if share is None else f"{share:.1%} of prompt tokens")
    t.add_row("source", _fmt(info["source"]))
    print_table(t)  # names from the data printed literally: no markup, control characters escaped


@trace.command("validate")
@click.argument("paths", nargs=-1, required=True, type=_EXISTING)
def validate_cmd(paths: tuple[Path, ...]) -> None:
    """Check trace files against the schema (exit 1 on the first problem)."""
    from servelab.traces.io import read_trace

    for path in paths:
        table = read_trace(path)
        click.echo(f"{path}: ok ({table.num_rows} requests)")
