"""Runner commands: `presets` (models and GPUs), `profile` (time shapes), `fit` (learn a cost model), `validate`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from servelab.cli.key_values import parse_key_values
from servelab.common.errors import ServelabError

_model = click.option("--model", default=None, help="Model preset for runners that take one (see `servelab presets`).")
_gpu = click.option("--gpu", default=None, help="GPU preset for runners that take one.")
_tp = click.option("--tp", type=int, default=None, help="Tensor-parallel degree.")


def _console():
    from rich.console import Console

    return Console()


def _weights(model) -> str:
    """The linear layers' weight format beside the model dtype: gpt-oss is 'mxfp4 (bfloat16)', not 'bfloat16'."""
    return f"{model.quantization} ({model.dtype})" if model.quantization else model.dtype


@click.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def presets(fmt):
    """List the model and GPU presets the roofline runner (and others) accept."""
    from dataclasses import asdict

    from servelab.runners.presets import GPUS, MODEL_SOURCES, MODELS

    def source(name: str) -> dict:  # where a 2026 preset's config.json is, and whether it is calibrated
        s = MODEL_SOURCES.get(name)
        return {"config_url": s.config_url, "calibrated": s.calibrated} if s is not None else {}

    if fmt == "json":
        click.echo(json.dumps({"models": [{**asdict(m), **source(m.name)} for m in MODELS.values()],
                               "gpus": [asdict(g) for g in GPUS.values()]}, indent=2))
        return
    from rich.table import Table

    models = Table(title="Model presets (shapes from each model's config.json)")
    for col in ("name", "params", "layers", "hidden", "heads q/kv", "head dim", "ffn", "vocab", "weights", "KV KiB/tok"):
        models.add_column(col, justify="left" if col in ("name", "weights") else "right", no_wrap=col != "heads q/kv")
    for m in MODELS.values():
        models.add_row(m.name, f"{m.num_params / 1e9:.2f}B", str(m.num_layers), str(m.hidden_size),
                       f"{m.num_heads}/{m.num_kv_heads}", str(m.head_dim), str(m.ffn_size), str(m.vocab_size),
                       _weights(m), f"{m.kv_bytes_per_token / 1024:g}")
    gpus = Table(title="GPU presets (dense bf16, datasheet figures)")
    for col in ("name", "TFLOP/s", "HBM TB/s", "GiB", "link GB/s", "calibrated on", "device"):
        gpus.add_column(col, justify="left" if col in ("name", "device", "calibrated on") else "right",
                        no_wrap=col == "name")
    for g in GPUS.values():
        gpus.add_row(g.name, f"{g.peak_flops / 1e12:g}", f"{g.hbm_bytes_per_s / 1e12:g}",
                     f"{g.memory_bytes / 2**30:.1f}", f"{g.interconnect_bytes_per_s / 1e9:g} ({g.interconnect})",
                     f"{g.calibration} ({'own profile' if g.calibrated else 'borrowed/derived'})", g.description)
    from servelab.common.tables import print_table

    print_table(models)  # never cut: the names are what --model and --gpu take
    print_table(gpus)


@click.command()
@click.option("--runner", "spec", required=True, help="Runner spec to time, e.g. roofline, torch:..., fitted:m.json.")
@_model
@_gpu
@_tp
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Profile Parquet to write.")
@click.option("--grid", type=click.Choice(["default", "small"]), default="default", show_default=True)
@click.option("--repeats", type=int, default=None,
              help="Timed runs per shape (default: 1 for cost models, 5 for runners that execute batches).")
@click.option("--warmup", type=int, default=None,
              help="Untimed runs per shape first (default: 0 for cost models, 1 for runners that execute).")
@click.option("--max-batched-tokens", type=int, default=None, help="Skip shapes with more tokens (default 8192).")
def profile(spec, model, gpu, tp, output, grid, repeats, warmup, max_batched_tokens):
    """Sweep batch shapes through a runner and write their step times (input to `servelab fit`)."""
    from dataclasses import replace

    from rich.progress import Progress
    from servelab.runners.base import make_runner
    from servelab.runners.profiling import GRIDS
    from servelab.runners.profiling import profile as run_profile

    context = {"model": model, "gpu": gpu, "tp": tp}
    runner = make_runner(spec, **context)
    measured = runner.decode_affine(1) is None  # a runner that executes promises no formula
    repeats = repeats if repeats is not None else (5 if measured else 1)
    warmup = warmup if warmup is not None else (1 if measured else 0)
    chosen = GRIDS[grid]
    if max_batched_tokens is not None:
        if max_batched_tokens < 1:
            raise ServelabError(f"--max-batched-tokens must be >= 1, got {max_batched_tokens}")
        chosen = replace(chosen, max_batched_tokens=max_batched_tokens)
    described = runner.describe()
    context = {  # record what the runner resolved to, not just what was typed
        "model": (described.get("model") or {}).get("name") if isinstance(described.get("model"), dict) else model,
        "gpu": (described.get("gpu") or {}).get("name") if isinstance(described.get("gpu"), dict) else gpu,
        "tp": described.get("tp", tp),
    }
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling", total=None)
        table = run_profile(runner, output, spec=spec, grid=chosen, repeats=repeats, warmup=warmup, context=context,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    click.echo(f"wrote {output}: {table.num_rows} timed steps")


def _buckets(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ServelabError(f"--buckets needs comma-separated token counts or 'none', got '{text}'") from None
    if any(v < 1 for v in values):
        raise ServelabError(f"--buckets: token counts must be >= 1, got '{text}'")
    return values


@click.command()
@click.argument("profile_path", metavar="[PROFILE]", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Model JSON to write (PROFILE fits).")
@click.option("--buckets", default=None,
              help="Batch-token bucket edges for piecewise coefficients ('none' = one linear model; default "
                   "16,64,256,1024, and none with --live / --endpoint, whose sweeps have few shapes).")
@click.option("--test-fraction", type=float, default=0.2, show_default=True, help="Held-out share of rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the train/test split.")
@click.option("--real", "real_runs", multiple=True, type=click.Path(file_okay=False),
              help="Fit the roofline's host profile (or, with --gpu-from, a GPU's efficiency scales) to measured "
                   "run directories by replaying them; repeatable. Grids: see python -m servelab.fidelity.fit_host -h.")
@click.option("--gpu-from", default=None, help="--real: fit a GPU as this profiled GPU's efficiencies x scales.")
@click.option("--steps", "steps_path", type=click.Path(dir_okay=False),
              help="Fit a `fitted` model to a real engine's per-step log (Parquet/CSV; columns: docs/fidelity.md).")
@click.option("--block-size", type=int, default=16, show_default=True,
              help="--steps with a vLLM step trace: tokens per KV block (decode context = blocks in use x this).")
@click.option("--live", "live_sweeps", multiple=True, type=click.Path(file_okay=False),
              help="Fit a `fitted` model to a live calibration sweep directory (written by --endpoint); repeatable.")
@click.option("--endpoint", help="Run a calibration sweep against this OpenAI-compatible server (docs/live.md), "
                                 "write it to --sweep-out and fit a `fitted` model to it.")
@click.option("--sweep-out", type=click.Path(file_okay=False), help="--endpoint: the sweep directory to write.")
@click.option("--sweep-seed", type=int, default=None,
              help="--endpoint: seed of the prompts' text (default: a new one, recorded in sweep.json, so that no "
                   "prompt is in the server's prefix cache).")
@click.option("--sweep-passes", type=click.IntRange(min=1), default=None,
              help="--endpoint: how many times the sweep runs its list of levels (default 3).")
@click.option("--client", "client_sources", multiple=True, type=click.Path(exists=True),
              help="Fit a client/API-server model (fidelity/client_model.py) to live run directories with vLLM's "
                   "/metrics (metrics.parquet), observation JSON files with client and engine times, or vLLM "
                   "OpenTelemetry span files (the API server's own time); repeatable.")
@click.option("--server-kind", default="vllm", show_default=True, help="--client: the server kind it describes.")
@click.option("--client-load", type=click.Choice(["streams", "admitting"]), default="streams", show_default=True,
              help="--client: what the load term counts at a send: every other open stream, or the others not yet "
                   "at their first token (a GPU server's: docs/fidelity.md).")
@_model
@_gpu
@_tp
def fit(profile_path, output, buckets, test_fraction, seed, real_runs, gpu_from, steps_path, block_size, live_sweeps,
        endpoint, sweep_out, sweep_seed, sweep_passes, client_sources, server_kind, client_load, model, gpu, tp):
    """Fit a `fitted` cost model (non-negative least squares) to a profile (use it as --runner fitted:OUT);
    with --steps LOG, to a real engine's per-step log (held-out steps reported); with --endpoint URL or
    --live SWEEP_DIR, to a calibration sweep of a live server; or, with --real RUN_DIR, fit the roofline's
    host profile to real runs (held-out half reported); with --client SRC, a client/API-server model."""
    if client_sources:
        _fit_client(client_sources, server_kind, output, client_load)
        return
    if endpoint or live_sweeps:
        _fit_live(endpoint, sweep_out, sweep_seed, sweep_passes, live_sweeps, output, buckets, test_fraction, seed,
                  model, bool(profile_path or real_runs or steps_path or gpu or tp))
        return
    if sweep_out or sweep_seed is not None or sweep_passes is not None:
        raise ServelabError("--sweep-out, --sweep-seed and --sweep-passes go with fit --endpoint URL")
    buckets = "16,64,256,1024" if buckets is None else buckets
    if steps_path:
        if profile_path or real_runs or not output:
            raise ServelabError("fit --steps takes a step log and -o OUT (no PROFILE or --real)")
        from servelab.fidelity.step_log import fit_steps

        meta = {k: v for k, v in (("model", model), ("gpu", gpu), ("tp", tp)) if v is not None}
        fitted = fit_steps(steps_path, output, buckets=_buckets(buckets), test_fraction=test_fraction, seed=seed,
                           block_size=block_size, meta=meta)
        _print_fit(fitted.metadata["fit"])
        click.echo(f"wrote {output} (use --runner fitted:{output})")
        return
    if model or gpu or tp:
        raise ServelabError("--model, --gpu and --tp apply to fit --steps (a profile records its own)")
    if real_runs:
        if profile_path or output:
            raise ServelabError("fit --real takes measured run directories only (no PROFILE or -o): it prints the fit")
        from servelab.fidelity.fit_host import main as fit_host

        fit_host([*real_runs, *(["--gpu-from", gpu_from] if gpu_from else [])])
        return
    if not profile_path or not output:
        raise click.UsageError("fit needs PROFILE and -o (or --real RUN_DIR)")
    from servelab.runners.fitted import fit_profile

    fitted = fit_profile(profile_path, output, buckets=_buckets(buckets), test_fraction=test_fraction, seed=seed)
    _print_fit(fitted.metadata["fit"])
    click.echo(f"wrote {output} (use --runner fitted:{output})")


def _fit_client(sources, server_kind, output, load="streams"):
    """fit --client SRC... -o OUT: the client model's terms (docs/fidelity.md), printed and written."""
    from servelab.fidelity.client_model import fit_from_sources, save

    if not output:
        raise ServelabError("fit --client SRC... needs -o OUT (the client model JSON)")
    model = fit_from_sources([Path(src) for src in sources], server_kind, load)
    save(model, output)
    per = "open stream" if model.load == "streams" else "other request before its first token"
    click.echo(f"client model ({server_kind}): {model.request_s * 1e3:.3f} ms + {model.prompt_token_s * 1e6:.3f} us "
               f"per prompt token + {model.stream_s * 1e3:.3f} ms per {per} outside the engine, "
               f"{model.token_s * 1e6:.3f} us per streamed token; API server {model.api_request_s * 1e3:.3f} ms + "
               f"{model.api_prompt_token_s * 1e6:.3f} us per prompt token of its own; {model.provenance}")
    click.echo(f"wrote {output} (use validate --real RUN --client-model {output})")


def _fit_live(endpoint, sweep_out, sweep_seed, sweep_passes, live_sweeps, output, buckets, test_fraction, seed, model,
              other):
    """fit --endpoint URL --sweep-out DIR -o OUT (sweep, then fit) or fit --live DIR... -o OUT (fit)."""
    from servelab.live.calibrate import fit_live

    if other or (endpoint and live_sweeps) or not output:
        raise ServelabError("fit --endpoint URL --sweep-out DIR -o OUT, or fit --live SWEEP_DIR -o OUT "
                            "(no PROFILE, --steps, --real, --gpu or --tp)")
    if endpoint:
        if not sweep_out:
            raise ServelabError("fit --endpoint needs --sweep-out DIR (the sweep's runs are kept there)")
        _run_calibration_sweep(endpoint, sweep_out, sweep_seed, sweep_passes, model)
        live_sweeps = (sweep_out,)
    elif sweep_out or sweep_seed is not None or sweep_passes is not None or model:
        raise ServelabError("--sweep-out, --sweep-seed, --sweep-passes and --model go with fit --endpoint URL")
    fitted = fit_live(list(live_sweeps), output, buckets=_buckets(buckets or "none"), test_fraction=test_fraction,
                      seed=seed)
    _print_fit(fitted.metadata["fit"])
    click.echo(f"wrote {output} (use --runner fitted:{output})")


def _run_calibration_sweep(endpoint: str, sweep_out: str, sweep_seed: int | None, passes: int | None,
                           model: str | None) -> None:
    import time

    from servelab.cli.bench_cmd import _discover_model
    from servelab.common.outdir import check_output_dir
    from servelab.live.calibrate import SweepPlan, run_sweep
    from servelab.live.client import Target

    if not endpoint.startswith(("http://", "https://")):
        raise click.BadParameter("must start with http:// or https://", param_hint="--endpoint")
    check_output_dir(sweep_out, False, "calibration sweep directory", ("sweep.json",))
    seed = sweep_seed if sweep_seed is not None else time.time_ns() % 1_000_000_007
    target = Target(endpoint, model or _discover_model(endpoint, None, 30.0), ignore_eos=True, min_tokens=True)
    try:
        plan = SweepPlan() if passes is None else SweepPlan(passes=passes)
        run_sweep(target, plan, sweep_out, seed, echo=lambda line: click.echo(line, err=True))
    except RuntimeError as err:  # the server cannot be reached
        raise ServelabError(str(err)) from None
    click.echo(f"wrote the calibration sweep {sweep_out} (seed {seed})", err=True)


def _print_fit(fit_info: dict) -> None:
    for split in ("train", "test"):
        if split in fit_info:
            s = fit_info[split]
            r2 = "n/a" if s["r2"] is None else f"{s['r2']:.5f}"
            click.echo(f"{split:5} rows={fit_info[f'{split}_rows']:6}  MAPE {s['mape_pct']:.2f}%  "
                       f"p90 APE {s['p90_ape_pct']:.2f}%  R^2 {r2}")


@click.command()
@click.argument("trace_path", metavar="[TRACE]", required=False, type=click.Path(dir_okay=False))
@click.option("--real", "real_run", type=click.Path(file_okay=False, path_type=Path),
              help="A measured run directory (`servelab run import`): replay its trace with its settings and "
                   "compare simulated with measured latencies.")
@click.option("--reference", help="Runner taken as truth (e.g. torch:..., or a fine cost model).")
@click.option("--candidate", help="Runner to judge against it (e.g. roofline, fitted:m.json); "
                                  "with --real, the runner that simulates the run (default: roofline).")
@_model
@_gpu
@_tp
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Replay config TOML (engine, policy).")
@click.option("--policy", default=None, help="Scheduling policy (default: the config's).")
@click.option("--num-gpu-blocks", type=int, default=None, help="KV blocks per replica (default: from the reference).")
@click.option("--set", "set_options", multiple=True, metavar="KEY=VALUE",
              help="--real: an engine setting over the run's (max_num_seqs, max_num_batched_tokens, block_size, "
                   "gpu_memory_utilization, enable_prefix_caching, ...); repeatable.")
@click.option("--limit", type=int, default=None, help="Replay only the first N requests.")
@click.option("--duration-s", type=float, default=None, help="Replay only requests arriving in the first S seconds.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="--real: write the measured and simulated TTFT/TPOT/E2E CDFs (PNG, SVG or PDF).")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Also write the report as JSON (atomically).")
@click.option("--client-model", default="auto", show_default=True,
              help="--real, a client-side run: the client/API-server model added to simulated times "
                   "(auto: the calibrated one of the server kind; vllm: a GPU server's; vllm-cpu: a CPU "
                   "server's; a JSON from fit --client; none).")
def validate(trace_path, real_run, reference, candidate, model, gpu, tp, config_path, policy, num_gpu_blocks,
             set_options, limit, duration_s, plot_path, fmt, output, client_model):
    """Replay a trace slice with two runners and report step-time and TTFT/TPOT errors; or, with --real
    RUN_DIR, replay a measured run and report simulated against measured."""
    if real_run is not None:
        if trace_path or reference or limit or duration_s:
            raise ServelabError("validate --real takes a run directory only: no TRACE, --reference, --limit or --duration-s")
        _validate_real(real_run, candidate, model, gpu, tp, config_path, policy, num_gpu_blocks, set_options,
                       plot_path, fmt, output, None if client_model == "none" else client_model)
        return
    if not trace_path or not reference or not candidate:
        raise click.UsageError("validate needs TRACE, --reference and --candidate (or --real RUN_DIR)")
    if set_options or plot_path or fmt != "table":
        raise ServelabError("--set, --plot and --format apply to validate --real")
    from dataclasses import replace

    from rich.table import Table
    from servelab.assembly import build_runner
    from servelab.replay.config import ReplayConfig
    from servelab.runners.validation import slice_trace, write_report
    from servelab.runners.validation import validate as run_validate
    from servelab.traces.io import read_trace

    config = ReplayConfig.from_toml(config_path) if config_path else ReplayConfig()
    overrides = {k: v for k, v in (("policy", policy), ("model", model), ("gpu", gpu), ("tp", tp)) if v is not None}
    config = replace(config, **overrides)
    if num_gpu_blocks is not None:
        config = replace(config, engine=replace(config.engine, num_gpu_blocks=num_gpu_blocks))
    trace = slice_trace(read_trace(trace_path), limit=limit, duration_s=duration_s)
    # built as `servelab replay` builds its runner (the engine's batch sizes, block size, parallelism and
    # quantization as well as model, GPU and TP), so both derive the same KV blocks from the same settings
    ref_runner, cand_runner = (build_runner(replace(config, runner=spec)) for spec in (reference, candidate))
    report = run_validate(trace, config, ref_runner, cand_runner, reference_spec=reference, candidate_spec=candidate)
    if output:
        write_report(report, output)
    step = report["step_time"]
    console = _console()
    console.print(f"{report['requests']} requests, policy {report['policy']}, {report['num_gpu_blocks']} KV blocks; "
                  f"finished {report['finished']['reference']} (reference) / {report['finished']['candidate']} (candidate)")
    console.print(f"step time over all {step['iterations']:,} iterations of the reference replay, each priced by both: MAPE {step['mape_pct']:.2f}%, "
                  f"median {step['median_ape_pct']:.2f}%, p90 {step['p90_ape_pct']:.2f}%, "
                  f"mean signed {step['mean_signed_pct']:+.2f}%")
    table = Table(title=f"{candidate} vs {reference}")
    for col in ("metric", "reference", "candidate", "error"):
        table.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)

    def fmt(v):
        return "n/a" if v is None else f"{v * 1000:.2f} ms"

    for m in report["latency"]:
        err = "n/a" if m["error_pct"] is None else f"{m['error_pct']:+.2f}%"
        table.add_row(m["metric"], fmt(m["reference"]), fmt(m["candidate"]), err)
    from servelab.common.tables import print_table

    print_table(table)
    if output:
        console.print(f"wrote {output}")


def _validate_real(run_dir, runner, model, gpu, tp, config_path, policy, num_gpu_blocks, set_options, plot_path,
                   fmt, output, client_model="auto"):
    from servelab.fidelity.validate import clock_labels, plot_cdfs, validate_real
    from servelab.replay.config import Options, read_table
    from servelab.runners.validation import write_report

    # typed once here, then put over each run's own settings: the file's keys (only those it sets), then
    # --set and the options
    given = parse_key_values(set_options, "--set", underscores=True)
    given.update({k: v for k, v in (("runner", runner), ("model", model), ("gpu", gpu), ("tp", tp),
                                    ("policy", policy), ("num_gpu_blocks", num_gpu_blocks)) if v is not None})
    overrides = (*([Options.parse(read_table(config_path), str(config_path))] if config_path else []),
                 Options.parse(given, "options"))
    from servelab.fidelity.validate import sweep_runs

    runs = sweep_runs(run_dir)
    if runs is not None:  # a GuideLLM sweep imported as one run per benchmark: each validated in turn
        if plot_path is not None:
            raise ServelabError(f"{run_dir} is a sweep of {len(runs)} runs; --plot takes one: {runs[0]}")
        _validate_sweep(run_dir, runs, overrides, client_model, fmt, output)
        return
    report, measured, simulated = validate_real(run_dir, overrides, client_model)
    if plot_path is not None:
        # the simulated times the table compares (a client-side run's: through the client model)
        plot_cdfs(measured, simulated, plot_path, title=f"{run_dir.name}: measured vs {report['config']['runner']}",
                  labels=clock_labels(report))
        report["plot"] = str(plot_path)
    if output:
        write_report(report, output)
    if fmt == "json":
        click.echo(json.dumps(report, indent=2))
        return
    render_real(report)


def _validate_sweep(run_dir, runs, overrides, client_model, fmt, output) -> None:
    from servelab.fidelity.validate import sweep_summary, validate_real
    from servelab.runners.validation import write_report

    reports = [validate_real(run, overrides, client_model)[0] for run in runs]
    whole = {"sweep": str(run_dir), "summary": sweep_summary(reports), "runs": reports}
    if output:
        write_report(whole, output)
    if fmt == "json":
        click.echo(json.dumps(whole, indent=2))
        return
    for report in reports:
        render_real(report)
        click.echo("")
    from rich.table import Table
    from servelab.common.tables import print_table

    table = Table(title=f"sweep of {len(runs)} runs ({run_dir.name}): error of the mean")
    for col in ("run", "requests", "ttft", "tpot", "e2e", "not finished (measured / simulated)"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for row in whole["summary"]:
        table.add_row(row["run"], str(row["requests"]), _pct(row["ttft_mean_error_pct"]),
                      _pct(row["tpot_mean_error_pct"]), _pct(row["e2e_mean_error_pct"]),
                      f"{_share(row['not_finished_measured'])} / {_share(row['not_finished_simulated'])}")
    print_table(table)


def _pct(v) -> str:
    """An error in percent, signed (n/a when not measured)."""
    return "n/a" if v is None else f"{v:+.1f}%"


def _share(v) -> str:
    """A share as a percentage (n/a when not measured)."""
    return "n/a" if v is None else f"{v:.1%}"


def _by_status(left: dict) -> str:
    """Simulated requests that did not finish, counted by status: '300 rejected, 2 unfinished'."""
    return ", ".join(f"{n:,} {status}" for status, n in left["by_status"].items())


def _why_not_finished(left: dict) -> str:
    """Why the replay finished nothing: the counts by status, whether any prompt fits the KV cache, and the
    shortest refused prompt's reason."""
    kv, shortest = left["kv_capacity_tokens"], left["shortest_prompt_tokens"]
    fits = (f"no prompt fits the {kv:,} tokens of KV cache (the shortest has {shortest:,})" if shortest > kv
            else f"the KV cache holds {kv:,} tokens (the shortest prompt has {shortest:,})")
    example = left.get("example")
    told = (f"; request {example['request_id']} ({example['prompt_tokens']:,} prompt tokens) {example['status']}: "
            f"{example['reason']}" if example else "")
    return f"{_by_status(left)}; {fits}{told}"


def render_real(report: dict) -> None:
    from rich.table import Table
    from servelab.common.tables import print_table

    console = _console()
    cfg = report["config"]
    tp, dp, pp = (int(cfg.get(k, 1) or 1) for k in ("tp", "dp", "pp"))
    layout = f"{tp} x {cfg['gpu']}"
    if dp > 1 or pp > 1:  # every GPU of the server: tp x pp x dp
        parts = [f"tp {tp}", *([f"dp {dp}"] if dp > 1 else []), *([f"pp {pp}"] if pp > 1 else [])]
        layout = (f"{tp * pp * dp} x {cfg['gpu']} ({' x '.join(parts)}"
                  f"{', expert parallel' if cfg.get('enable_expert_parallel') else ''})")
    console.print(f"{report['run']}: {report['requests']} requests ({report['clock']}-side times), "
                  f"{cfg['model']} on {layout}, runner {cfg['runner']}, policy {cfg['policy']}")
    per_rank = " per DP rank" if dp > 1 else ""
    console.print(f"KV cache {report['num_gpu_blocks']:,} blocks = {report['kv_capacity_tokens']:,} tokens{per_rank} "
                  f"({report['kv_blocks_from']}); finished {report['finished']['measured']} measured / "
                  f"{report['finished']['simulated']} simulated; simulated preemptions {report['preemptions_simulated']}")
    if report.get("memory_warning"):
        console.print(f"[bold red]warning:[/] {report['memory_warning']}")
    if report.get("arrivals") == "regenerated":
        console.print("[bold red]warning:[/] the benchmark recorded no send times: the arrivals were drawn from its "
                      "pacing process (run.json notes), so means compare and single requests do not")
    if report["finished"]["simulated"] == 0 and report.get("not_finished_simulated"):
        console.print(f"[bold red]warning:[/] no simulated request finished, so no simulated latency or "
                      f"throughput (n/a below): {_why_not_finished(report['not_finished_simulated'])}")
    if report.get("settings"):
        console.print("settings: " + ", ".join(f"{s['setting']}={s['value']} ({s['from']})" for s in report["settings"]))
    if report.get("prefix"):
        p = report["prefix"]
        below = (f" (+ {_share(p['simulated_lower_tiers'])} from offload tiers)" if "simulated_lower_tiers" in p
                 else "")
        external = (f" (+ {_share(p['measured_external'])} from its KV connector)" if "measured_external" in p
                    else "")
        console.print(f"prefix-cache hits (share of prompt tokens): measured {_share(p['measured'])}{external} "
                      f"({p.get('measured_from') or 'not reported'}), simulated {_share(p['simulated'])}{below}, "
                      f"ideal {_share(p['ideal'])}; sharing from {p['origin']}")
        if p.get("warning"):
            console.print(f"[bold red]warning:[/] {p['warning']}")
        if p.get("pressure"):  # the measured rate counts preempted requests' lookups: not comparable as a share
            console.print(f"note: the measured rate counts preempted requests re-finding their own blocks, "
                          f"each scheduling attempt ({p['pressure']}): not a share of prompt tokens")
    table = Table(title="measured vs simulated")
    for col in ("metric", "stat", "measured", "simulated", "error"):
        table.add_column(col, justify="left" if col in ("metric", "stat") else "right", no_wrap=True)

    def ms(v):
        return "n/a" if v is None else f"{v * 1000:,.2f} ms"

    engine = {(r["metric"], r["stat"]): r for r in report.get("latency_engine") or ()}
    if engine:
        table.add_column("engine-side", justify="right", no_wrap=True)
        table.add_column("error", justify="right", no_wrap=True)
    for row in report["latency"]:
        cells = [row["metric"], row["stat"], ms(row["measured_s"]), ms(row["simulated_s"]), _pct(row["error_pct"])]
        if engine:
            e = engine.get((row["metric"], row["stat"]))
            cells += [ms(e["simulated_s"]), _pct(e["error_pct"])] if e else ["", ""]
        table.add_row(*cells)
    for row in report["throughput"]:
        fmt_v = (lambda v: "n/a" if v is None else f"{v:,.3f}")
        table.add_row(row["metric"], "", fmt_v(row["measured"]), fmt_v(row["simulated"]), _pct(row["error_pct"]))
    print_table(table)
    for metric, why in (report.get("not_measured") or {}).items():
        console.print(f"{metric}: measured n/a: {why}")
    model = report.get("client_model")
    if model:
        console.print(f"client model ({model['server']}): {model['request_s'] * 1e3:.2f} ms + "
                      f"{model['prompt_token_s'] * 1e6:.2f} us per prompt token + "
                      f"{model.get('stream_s', 0.0) * 1e3:.2f} ms per "
                      f"{'other request before its first token' if model.get('load') == 'admitting' else 'open stream'}"
                      f" outside the engine, "
                      f"{model['token_s'] * 1e6:.2f} us per streamed token in the API server's queue; "
                      f"simulated = client-side, engine-side beside it. {model['provenance']}")
    api = report.get("api_server")
    if api:
        side = "client-side" if model else "server-side (vLLM's spans: from the API server's receipt)"
        mean = "" if api["mean_s"] is None else f" (mean {api['mean_s'] * 1e3:.2f} ms)"
        console.print(f"API server ({api['server']}): {api['request_s'] * 1e3:.2f} ms + {api['prompt_token_s'] * 1e6:.2f} us "
                      f"per prompt token{mean} of its own work in the {side} times, none in the engine's: added to "
                      f"the simulated first and last token" + ("" if model else "; engine-side beside it"))
    errors = report.get("errors")
    if errors and errors["measured"] is not None and errors["simulated"] is not None:
        left = report.get("not_finished_simulated")
        by_status = f"; simulated: {_by_status(left)}" if left and report["finished"]["simulated"] else ""
        console.print(f"not finished: {errors['measured'] * 100:.1f}% measured, {errors['simulated'] * 100:.1f}% "
                      f"simulated ({errors['difference_pct_points']:+.1f} points{by_status})")
    per = report["per_request"]
    parts = [f"{m.removesuffix('_s')} MAPE {per[m]['mape_pct']:.1f}% (median {per[m]['median_ape_pct']:.1f}%)"
             for m in ("ttft_s", "tpot_s", "e2e_s") if per[m]["mape_pct"] is not None]
    if parts:  # (none when no request finished on both sides)
        console.print(f"per request ({per['matched']} matched): " + ", ".join(parts))
    if report.get("plot"):
        console.print(f"wrote {report['plot']}")
