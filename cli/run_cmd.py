"""`servelab run import`: a real benchmark's per-request output as a run directory (marked measured)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

FORMATS = ("vllm-bench", "guidellm", "otel", "timestamps-jsonl", "blis")


@click.group()
def run():
    """Work with run directories that come from outside a replay."""


@run.command("import")
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True,
              help="Source format (docs/fidelity.md describes each).")
@click.argument("sources", metavar="SRC...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Run directory to write.")
@click.option("--trace-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the derived trace here (.arrow or .parquet); the run directory always has trace.arrow.")
@click.option("--benchmark", type=int, default=None, help="guidellm: import only the N-th benchmark (0-based).")
@click.option("--vllm-log", type=click.Path(dir_okay=False, path_type=Path),
              help="The vLLM server log: engine settings (non-default args) and its KV block count.")
@click.option("--setting", "settings", multiple=True, metavar="KEY=VALUE",
              help="An engine setting the source does not record (model, gpu, tp, max_num_seqs, "
                   "max_num_batched_tokens, block_size, num_gpu_blocks, gpu_memory_utilization, "
                   "enable_prefix_caching); repeatable, wins over the source and the log.")
@click.option("--force", is_flag=True, help="Replace an existing run directory.")
def import_run(fmt, sources, output, trace_out, benchmark, vllm_log, settings, force):
    """Turn a real benchmark's per-request timings (SRC) into a run directory that report, query,
    compare, plot and validate --real read."""
    from servelab.cli.replay_cmd import check_replay_output
    from servelab.common.errors import ServelabError
    from servelab.fidelity.base import build_run, import_measured, write_measured_run

    check_replay_output(str(output), force)
    options = {}
    if benchmark is not None:
        if fmt != "guidellm":
            raise ServelabError("--benchmark applies to --format guidellm only")
        options["benchmark"] = benchmark
    extra = _parse_settings(settings)
    if fmt == "guidellm" and benchmark is None and len(sources) == 1:
        from servelab.fidelity.guidellm import count_benchmarks

        count = count_benchmarks(Path(sources[0]))
        if count > 1:  # a sweep: each benchmark (strategy) is a run of its own
            _import_sweep(count, fmt, sources, output, vllm_log, extra)
            return
    measured = import_measured(fmt, list(sources), **options)
    merged, source = dict(measured.settings), dict(measured.source)
    if vllm_log is not None:
        from servelab.fidelity.vllm_log import settings_from_log

        log_settings, log_source = settings_from_log(vllm_log)
        merged.update(log_settings)
        source.update(log_source)
    merged.update(extra)
    measured = dataclasses.replace(measured, settings=merged, source=source)
    result, trace = build_run(measured, fmt, list(sources))
    write_measured_run(result, trace, output, trace_out)
    counts = result.meta["counts"]
    click.echo(f"wrote {output}: {result.requests.num_rows} requests ({counts['finished']} finished, "
               f"{result.requests.num_rows - counts['finished']} failed, timed out or cancelled), {measured.clock}-side times, trace of {trace.num_rows} requests")
    for note in measured.notes:
        click.echo(f"note: {note}")
    if trace_out is not None:
        click.echo(f"wrote {trace_out}")


def _import_sweep(count, fmt, sources, output, vllm_log, extra) -> None:
    """A GuideLLM report of several benchmarks: OUTPUT/benchmark_<i> for each and OUTPUT/sweep.json."""
    import json

    from servelab.common.atomic import atomic_dir
    from servelab.fidelity.base import build_run, import_measured, write_measured_run

    levels = []
    with atomic_dir(output) as tmp:
        for i in range(count):
            measured = import_measured(fmt, list(sources), benchmark=i)
            merged = dict(measured.settings)
            if vllm_log is not None:
                from servelab.fidelity.vllm_log import settings_from_log

                merged.update(settings_from_log(vllm_log)[0])
            merged.update(extra)
            result, trace = build_run(dataclasses.replace(measured, settings=merged), fmt, list(sources))
            name = f"benchmark_{i}"
            write_measured_run(result, trace, tmp / name)
            levels.append({"name": name, "benchmark": i, "load": result.meta.get("load", {}),
                           "requests": result.requests.num_rows})
        (tmp / "sweep.json").write_text(json.dumps({"source": str(sources[0]), "format": fmt,
                                                    "runs": levels}, indent=2, sort_keys=True) + "\n")
    click.echo(f"wrote {output}: {count} benchmarks of a sweep, each a run directory (benchmark_0 .. "
               f"benchmark_{count - 1}) and sweep.json")


def _parse_settings(items: tuple[str, ...]) -> dict:
    from servelab.cli.key_values import parse_key_values
    from servelab.fidelity.base import SETTING_TYPES

    return parse_key_values(items, "--setting", known=SETTING_TYPES, underscores=True)
