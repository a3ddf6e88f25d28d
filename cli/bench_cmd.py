"""`servelab bench URL TRACE -o RUN_DIR`: replay a trace against a running OpenAI-compatible server (or an
Amazon SageMaker endpoint, URL ``sagemaker://NAME``) and measure it, writing a run directory in the
replay's schema (docs/live.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import sys
from pathlib import Path

import click
from servelab.common.errors import ServelabError
from servelab.common.loops import LOOPS


def _discover_model(url: str, api_key: str | None, timeout_s: float | None) -> str:
    import json
    import urllib.error
    import urllib.request

    from servelab.live.client import Target

    root = Target(url, "").root
    request = urllib.request.Request(f"{root}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            models = json.loads(response.read()).get("data") or []
    except (OSError, ValueError, AttributeError) as err:
        raise ServelabError(f"{root}/v1/models: cannot list the server's models ({err}); give --model") from None
    if not models:
        raise ServelabError(f"{root}/v1/models: the server lists no model; give --model")
    return str(models[0]["id"])


@click.command()
@click.argument("url")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", required=True, help="Run directory to write.")
@click.option("--force/--no-force", default=False, help="Replace an existing run directory.")
@click.option("--model", help="Model name to request (default: the first of the server's /v1/models).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions", show_default=True,
              help="/v1/completions or /v1/chat/completions.")
@click.option("--shape", type=click.Choice(["trace", "poisson", "constant", "closed"]), default="trace",
              show_default=True, help="Load shape: the trace's arrivals, Poisson or constant --rate, or "
              "a closed loop of --users.")
@click.option("--time-scale", type=float, default=None,
              help="trace shape: multiply the trace's arrival times (0.5 = twice as fast); 1 / --rate-scale.  [default: 1]")
@click.option("--rate-scale", type=float, default=None,
              help="trace shape: multiply the trace's own request rate (arrival times / K), as `trace transform "
              "--rate-scale` and `sweep --rate-scales`.")
@click.option("--rate", "--request-rate", "rate", type=float,
              help="poisson / constant shapes: requests per second (vLLM bench's --request-rate).")
@click.option("--users", type=int, help="closed shape: concurrent users.")
@click.option("--think", "think_s", type=float, default=0.0, show_default=True,
              help="closed shape: seconds a user waits between its requests.")
@click.option("--max-in-flight", type=int, help="Open loop: most requests outstanding at once.")
@click.option("--duration", "duration_s", type=float,
              help="Seconds to send for; requests in flight then are cancelled, the rest not sent.")
@click.option("--num-requests", type=int, help="Send only the first N requests of the trace.")
@click.option("--warmup", type=int, default=0, show_default=True,
              help="Warm-up requests sent (and awaited) first, left out of the results.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Per-request timeout, seconds (0: none).")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Ask the server to generate exactly the trace's output length (vLLM's ignore_eos).")
@click.option("--min-tokens/--no-min-tokens", default=True, show_default=True,
              help="Also send min_tokens = the trace's output length (vLLM).")
@click.option("--extensions", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="vLLM's ignore_eos/min_tokens: probe whether the server takes them, always, or never.")
@click.option("--tokenizer", default="auto", show_default=True,
              help="Prompt lengths from the server's /tokenize (auto: when it has one; server: required), a "
              "local tokenizer.json (a path; --api completions), or 'approximate'.")
@click.option("--metrics/--no-metrics", default=True, show_default=True,
              help="Sample the server's Prometheus /metrics into metrics.parquet.")
@click.option("--metrics-interval", type=float, default=1.0, show_default=True, help="Seconds between samples.")
@click.option("--token-log/--no-token-log", default=False, help="Write tokens.parquet: every token's arrival.")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token (default: $OPENAI_API_KEY).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts' text and Poisson gaps.")
@click.option("--sweep-rates", help="Sweep: one run per rate (req/s, comma-separated) into OUT/rate_<r>; with "
              "--shape trace the trace's arrivals are scaled to each mean rate.")
@click.option("--sweep-users", help="Sweep: one closed-loop run per user count (comma-separated) into OUT/users_<n>.")
@click.option("--report/--no-report", "show_report", default=True, show_default=True,
              help="Print the report of the run (of each run of a sweep).")
@click.option("--slo", multiple=True, metavar="SPEC",
              help="SLO for the report (as replay's), e.g. ttft=0.5,tpot=0.05 or tier=priority:ttft=0.2; a "
              "sweep keeps it in sweep.json for later scoring.")
@click.option("--region", help="sagemaker:// URL: the AWS region (default: boto3's, e.g. $AWS_REGION).")
@click.option("--profile", help="sagemaker:// URL: the AWS profile of ~/.aws/config (default: boto3's chain).")
@click.option("--endpoint-url", help="sagemaker:// URL: the SageMaker runtime API's URL (a local or private endpoint).")
@click.option("--inference-component", help="sagemaker:// URL: the inference component to invoke.")
@click.option("--stream-format", type=click.Choice(["auto", "sse", "jsonlines"]), default="auto", show_default=True,
              help="sagemaker:// URL: the container's stream: server-sent events, JSON lines, or by its content "
              "type.")
@click.option("--loop", "loop_name", type=click.Choice(LOOPS), default="auto", show_default=True,
              help="The client's event loop: uvloop (pip install 'servelab[fast]': usually less CPU per request and token), "
              "asyncio's own, or auto (uvloop when installed).")
def bench(url: str, trace: str, out_dir: str, force: bool, model: str | None, api: str, shape: str, time_scale: float | None,
          rate_scale: float | None, rate: float | None, users: int | None, think_s: float, max_in_flight: int | None, duration_s: float | None,
          num_requests: int | None, warmup: int, timeout_s: float, ignore_eos: bool, min_tokens: bool,
          extensions: str, tokenizer: str, metrics: bool, metrics_interval: float, token_log: bool,
          api_key: str | None, seed: int, sweep_rates: str | None, sweep_users: str | None,
          show_report: bool, slo: tuple[str, ...], region: str | None, profile: str | None, endpoint_url: str | None,
          inference_component: str | None, stream_format: str, loop_name: str) -> None:  # fmt: skip
    """Send TRACE's requests to the OpenAI-compatible server at URL (or the Amazon SageMaker endpoint
    sagemaker://NAME) and measure them (docs/live.md)."""
    from servelab.cli.replay_cmd import check_replay_output, parse_slo
    from servelab.common.loops import resolve_loop
    from servelab.live.bench import LiveOptions
    from servelab.live.client import Target
    from servelab.live.load import LoadConfig
    from servelab.live.sagemaker import is_sagemaker_url
    from servelab.traces.io import read_trace, trace_sha256

    sagemaker = is_sagemaker_url(url)
    if sagemaker:
        backend = _sagemaker_backend(url, region, profile, endpoint_url, inference_component, stream_format,
                                     tokenizer, metrics, api_key)  # fmt: skip
        metrics = False
    else:
        backend = None
        _no_sagemaker_options(region=region, profile=profile, endpoint_url=endpoint_url,
                              inference_component=inference_component, stream_format=stream_format)  # fmt: skip
    if not (sagemaker or url.startswith(("http://", "https://"))):
        raise click.BadParameter("must start with http:// or https:// (or sagemaker:// for a SageMaker endpoint)",
                                 param_hint="URL")
    if time_scale is not None and rate_scale is not None:
        raise click.BadParameter("give --rate-scale or --time-scale (its inverse), not both", param_hint="--rate-scale")
    if rate_scale is not None:
        if not (math.isfinite(rate_scale) and rate_scale > 0):
            raise click.BadParameter(f"must be a finite number > 0, got {rate_scale}", param_hint="--rate-scale")
        time_scale = 1.0 / rate_scale
    elif time_scale is None:
        time_scale = 1.0
    for hint, value in (("--timeout", timeout_s), ("--time-scale", time_scale), ("--rate", rate),
                        ("--think", think_s), ("--duration", duration_s), ("--metrics-interval", metrics_interval)):
        if value is not None and not math.isfinite(value):  # nan/inf: run.json would not be valid JSON
            raise click.BadParameter(f"must be a finite number, got {value}", param_hint=hint)
    if metrics_interval <= 0:
        raise click.BadParameter("must be > 0", param_hint="--metrics-interval")
    if tokenizer not in ("auto", "server", "approximate") and not Path(tokenizer).is_file():
        raise click.BadParameter(f"{tokenizer}: no such file (give auto, server, approximate or a tokenizer.json)",
                                 param_hint="--tokenizer")  # fmt: skip
    if timeout_s < 0:
        raise click.BadParameter("must be >= 0", param_hint="--timeout")
    levels = _sweep_levels(sweep_rates, sweep_users, shape)
    loop_kind = resolve_loop(loop_name)  # an explicit uvloop that is not installed stops here
    slo_table = parse_slo(slo)  # before anything is sent: a bad SPEC costs no run
    load = LoadConfig(shape=shape, time_scale=time_scale, rate=rate if not sweep_rates else levels[0][1],
                      users=users if not sweep_users else levels[0][1], think_s=think_s,
                      max_in_flight=max_in_flight, duration_s=duration_s, num_requests=num_requests,
                      warmup=warmup, seed=seed)  # fmt: skip
    if levels:
        from servelab.common.outdir import check_output_dir

        check_output_dir(out_dir, force, "live sweep directory", ("sweep.json",))
    else:
        check_replay_output(out_dir, force)
    table = read_trace(trace)
    if "depends_on" in table.column_names and table.column("depends_on").combine_chunks().value_lengths().fill_null(0) \
            .to_numpy().any():  # a dependent request's arrival_s is a placeholder: sending at it would be wrong
        raise ServelabError(f"{trace}: requests that depend on others (depends_on) cannot be sent by servelab bench "
                            "yet; replay the trace instead")
    trace_meta = {"path": str(trace), "name": Path(trace).stem, "sha256": trace_sha256(trace)}
    if sagemaker:  # the body names a model only when asked: a SageMaker container serves its own
        target = Target(backend.endpoint.url, model or "", api=api, timeout_s=timeout_s or None,
                        ignore_eos=ignore_eos, min_tokens=min_tokens)  # fmt: skip
    else:
        target = Target(url, model or _discover_model(url, api_key, timeout_s or None), api=api, timeout_s=timeout_s or None,
                        ignore_eos=ignore_eos, min_tokens=min_tokens, api_key=api_key)  # fmt: skip
    options = LiveOptions(metrics=metrics, metrics_interval_s=metrics_interval, tokenizer=tokenizer,
                          extensions=extensions)  # fmt: skip
    if not levels:
        code = _one_run(table, trace_meta, target, load, options, out_dir, token_log, show_report, backend,
                        slo_table, loop_kind)  # fmt: skip
        if code:
            sys.exit(code)
        return
    done = []
    for name, value in levels:
        if sweep_rates:
            level = (dataclasses.replace(load, time_scale=_trace_rate(table, load) / value) if shape == "trace"
                     else dataclasses.replace(load, rate=value))  # fmt: skip
        else:
            level = dataclasses.replace(load, users=value)
        click.echo(f"sweep level {name}", err=True)
        code = _one_run(table, trace_meta, target, level, options, str(Path(out_dir) / name), token_log,
                        show_report, backend, slo_table, loop_kind)  # fmt: skip
        done.append({"run": name, "rate_rps" if sweep_rates else "users": value, "interrupted": bool(code)})
        _write_sweep_json(out_dir, done, levels, slo_table)
        if code:
            sys.exit(code)


def _sagemaker_backend(url, region, profile, endpoint_url, inference_component, stream_format, tokenizer, metrics,
                       api_key):  # fmt: skip
    """The SageMaker backend of a ``sagemaker://NAME`` URL; refuses the HTTP server's options."""
    from servelab.live.sagemaker import (
        SageMakerBackend,
        SageMakerEndpoint,
        require_boto3,
    )

    given = click.get_current_context().get_parameter_source
    if metrics and given("metrics") == click.core.ParameterSource.COMMANDLINE:
        raise click.BadParameter("a SageMaker endpoint has no /metrics to sample (its metrics are in CloudWatch)",
                                 param_hint="--metrics")  # fmt: skip
    if api_key and given("api_key") == click.core.ParameterSource.COMMANDLINE:
        raise click.BadParameter("goes with an http(s):// URL (SageMaker requests are signed with AWS "
                                 "credentials)", param_hint="--api-key")  # fmt: skip
    if tokenizer == "server":
        raise click.BadParameter("a SageMaker endpoint has no /tokenize: give a tokenizer.json or 'approximate'",
                                 param_hint="--tokenizer")  # fmt: skip
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        raise click.BadParameter("must start with http:// or https://", param_hint="--endpoint-url")
    endpoint = SageMakerEndpoint.from_url(url, region=region, profile=profile, endpoint_url=endpoint_url,
                                          inference_component=inference_component, stream_format=stream_format)  # fmt: skip
    require_boto3()
    return SageMakerBackend(endpoint)


def _no_sagemaker_options(**options) -> None:
    given = click.get_current_context().get_parameter_source
    for name, value in options.items():
        if value is not None and given(name) == click.core.ParameterSource.COMMANDLINE:
            raise click.BadParameter("goes with a sagemaker:// URL", param_hint=f"--{name.replace('_', '-')}")


def _sweep_levels(rates: str | None, users: str | None, shape: str) -> list[tuple[str, float | int]]:
    if rates and users:
        raise click.UsageError("give one of --sweep-rates and --sweep-users")
    if not (rates or users):
        return []
    if users and shape != "closed":
        raise click.BadParameter("goes with --shape closed", param_hint="--sweep-users")
    if rates and shape == "closed":
        raise click.BadParameter("goes with an open-loop --shape (trace, poisson, constant)", param_hint="--sweep-rates")
    hint = "--sweep-rates" if rates else "--sweep-users"
    out = []
    for part in (rates or users).split(","):
        try:
            value = float(part) if rates else int(part)
        except ValueError:
            raise click.BadParameter(f"{part.strip()!r} is not a {'number' if rates else 'whole number'}",
                                     param_hint=hint) from None  # fmt: skip
        if not value > 0:
            raise click.BadParameter(f"{part.strip()} must be > 0", param_hint=hint)
        out.append((f"rate_{value:g}" if rates else f"users_{value}", value))
    if len({name for name, _ in out}) != len(out):
        raise click.BadParameter("a level is repeated", param_hint=hint)
    return out


def _trace_rate(table, load) -> float:
    """Mean arrival rate (req/s) of the requests the run sends: (n - 1) / span."""
    n = table.num_rows if load.num_requests is None else min(load.num_requests, table.num_rows)
    arrivals = table.column("arrival_s").to_numpy()[:n]
    span = float(arrivals[-1] - arrivals[0]) if n > 1 else 0.0
    if span <= 0:
        raise ServelabError("--sweep-rates with --shape trace needs a trace whose arrivals span some time")
    return (n - 1) / span


def _write_sweep_json(out_dir: str, done: list[dict], levels, slo=None) -> None:
    import json

    from servelab.common.atomic import atomic_path

    data = {"kind": "live-sweep", "levels": [name for name, _ in levels], "runs": done}
    if slo is not None:  # what `report`/`plot` of the sweep then score with (scoring/sweep.py sweep_slo)
        data["slo"] = slo.to_dict()
    with atomic_path(Path(out_dir) / "sweep.json") as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")


def _one_run(table, trace_meta, target, load, options, out_dir: str, token_log: bool, show_report: bool,
             backend=None, slo=None, loop: str = "asyncio") -> int:  # fmt: skip
    """One live run written to ``out_dir``; the exit code when a signal stopped it (130 Ctrl-C, 143
    SIGTERM), else 0. The first SIGINT or SIGTERM stops sending and keeps what finished; a later
    one while the run winds down or is written is acknowledged, not obeyed (it would lose the run)."""
    from servelab.common.loops import run as run_on
    from servelab.live.bench import write_live_run

    n = table.num_rows if load.num_requests is None else min(load.num_requests, table.num_rows)
    where = target.url if backend is None else target.root
    model = target.model or "the endpoint's own"
    click.echo(f"sending {n:,} requests to {where} (model {model}, shape {load.shape})", err=True)
    signals: list[str] = []
    try:
        run = run_on(_measure(table, target, load, options, backend, signals), loop)
    except RuntimeError as err:
        raise ServelabError(str(err)) from None
    if run is None:
        click.echo(f"{signals[0]} before the first request was sent: nothing written", err=True)
        return _exit_code(signals[0])
    for line in run.log:
        click.echo(f"warning: {line}", err=True)
    with _held_signals(signals):
        if signals:
            run.meta["signal"] = signals[0]
        if slo is not None:  # a later `report`/`query`/`compare` of the run scores it as this one did
            run.meta["slo"] = slo.to_dict()
        write_live_run(run, table, trace_meta, out_dir, token_log=token_log)
    counts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in run.meta["counts"].items() if v)
    click.echo(f"measured {run.meta['measured_span_s']:.1f} s: {counts}; wrote {out_dir}", err=True)
    if show_report:
        from servelab.scoring.report import report_text

        click.echo(report_text(out_dir, slo))
    if signals:
        click.echo(f"stopped by {signals[0]}: the requests that finished are kept", err=True)
        return _exit_code(signals[0])
    return 0


def _exit_code(name: str) -> int:
    return 128 + int(getattr(signal, name))


async def _measure(table, target, load, options, backend, signals: list[str]):
    """run_live with SIGINT and SIGTERM both stopping the run as Ctrl-C does (``signals`` gets their
    names); None when one came before the run began sending."""
    from servelab.live.bench import run_live

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def stop(name: str) -> None:
        signals.append(name)
        if len(signals) == 1:
            click.echo(f"\n{name}: stopping; the requests that finished are kept", err=True)
            task.cancel()
        else:
            click.echo(f"{name} again: the run is being written and is kept", err=True)

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop, sig.name)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread; no such signal here
            pass
    try:
        return await run_live(table, target, load, options, backend)
    except asyncio.CancelledError:
        if not signals:
            raise
        task.uncancel()
        return None
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def _held_signals(signals: list[str]):
    """While the run is written: SIGINT and SIGTERM are noted, not obeyed (atomic writes would drop it)."""
    def note(signum, frame) -> None:
        signals.append(signal.Signals(signum).name)
        click.echo(f"{signals[-1]}: the run is being written and is kept", err=True)

    try:
        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: nothing to hold
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
