"""`servelab run import`: a real benchmark's per-request output as a run directory (marked measured)."""

from __future__ import annotations

from pathlib import Path

import click

from servelab.cli.choices import RegistryChoice


def _formats() -> list[str]:
    """The run import formats: one file each in servelab.fidelity (fidelity/base.py IMPORTERS)."""
    from servelab.fidelity.base import IMPORTERS

    return IMPORTERS.names()


@click.group()
def run():
    """Work with run directories that come from outside a replay."""


def prefix_options(fn):
    """Prompt sharing no file records (trace import, run import)."""
    opts = [
        click.option("--shared-prefix-tokens", type=int, default=None,
                     help="Every request starts with a shared prefix of N tokens (per group)."),
        click.option("--prefix-groups", type=int, default=None,
                     help="With --shared-prefix-tokens: G distinct prefixes, request i in group i mod G (default 1)."),
        click.option("--prompt-pool", type=int, default=None,
                     help="The requests cycle through a pool of K prompts (request i sends prompt i mod K)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@run.command("import")
@click.option("--format", "fmt", type=RegistryChoice(_formats), default=None,
              help="Source format (docs/fidelity.md describes each); detected from the files when omitted.")
@click.argument("sources", metavar="SRC...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Run directory to write.")
@click.option("--trace-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the derived trace here (.arrow or .parquet); the run directory always has trace.arrow.")
@click.option("--benchmark", type=int, default=None, help="guidellm: import only the N-th benchmark (0-based); inference-perf: only stage N; "
                   "sglang-bench: only the N-th run (line); genai-perf: only the N-th experiment.")
@click.option("--vllm-log", type=click.Path(dir_okay=False, path_type=Path),
              help="The vLLM server log (default: vllm.log beside the source, or the file vllm_logging.json names): "
                   "engine settings, KV block count, prefix-cache hit rate.")
@click.option("--vllm-metrics", type=click.Path(dir_okay=False, path_type=Path),
              help="A scrape of the server's /metrics after the run (default: metrics.txt or metrics.prom beside "
                   "the source): its prefix-cache hit rate.")
@click.option("--setting", "settings", multiple=True, metavar="KEY=VALUE",
              help="An engine setting the source does not record (model, gpu, tp, max_num_seqs, "
                   "max_num_batched_tokens, block_size, num_gpu_blocks, gpu_memory_utilization, "
                   "enable_prefix_caching, async_scheduling, replicas, kv_offload_gb: vLLM's CPU KV offloading, "
                   "vllm_version: the server's release, whose defaults a run that records none gets); "
                   "repeatable, wins over the source and its "
                   "files.")
@prefix_options
@click.option("--prefix-from-hit-rate/--no-prefix-from-hit-rate", default=False, show_default=True,
              help="When the run records no prompt sharing but the server log reports a prefix-cache hit rate: "
                   "share one prefix whose length reproduces it.")
@click.option("--force/--no-force", default=False, help="Replace an existing run directory.")
def import_run(fmt, sources, output, trace_out, benchmark, vllm_log, vllm_metrics, settings, shared_prefix_tokens,
               prefix_groups, prompt_pool, prefix_from_hit_rate, force):
    """Turn a real benchmark's per-request timings (SRC) into a run directory that report, query,
    compare, plot and validate --real read."""
    from servelab.cli.replay_cmd import check_replay_output
    from servelab.common.errors import ServelabError
    from servelab.fidelity.base import write_measured_run
    from servelab.fidelity.run_import import import_run as run_import

    check_replay_output(str(output), force)
    options = {}
    # formats whose report holds several benchmarks (stages, experiments)
    staged = ("guidellm", "inference-perf", "sglang-bench", "genai-perf")
    if benchmark is not None:
        options["benchmark"] = benchmark
    from servelab.fidelity.base import detect_format, sources_in_folders
    from servelab.traces.prefixes import spec_from_options

    spec = spec_from_options(shared_prefix_tokens, prefix_groups, prompt_pool)
    kwargs = dict(vllm_log=vllm_log, vllm_metrics=vllm_metrics, given=_parse_settings(settings), prefix=spec,
                  prefix_from_hit_rate=prefix_from_hit_rate)
    sources, in_folders = sources_in_folders(list(sources))  # a run's folder given: the run's file in it
    for note in in_folders:
        click.echo(f"source: {note}", err=True)
    detected = fmt is None
    if detected:  # said before the import, so an error below reads against the format it was read as
        fmt = detect_format(list(sources))
        click.echo(f"format: {fmt} (detected; --format to choose)", err=True)
    kwargs["detected"] = detected
    if fmt not in staged and benchmark is not None:
        raise ServelabError("--benchmark applies to --format guidellm, inference-perf, sglang-bench or genai-perf only")
    if fmt in ("guidellm", "sglang-bench", "genai-perf") and benchmark is None and len(sources) == 1:
        count = _count_benchmarks(fmt, Path(sources[0]))
        if count > 1:  # a sweep: each benchmark (strategy, bench_serving run, experiment) is a run of its own
            _import_sweep(count, sources, output, kwargs, fmt)
            return
    done = run_import(list(sources), fmt, options=options, **kwargs)
    result, trace = done.result, done.trace
    write_measured_run(result, trace, output, trace_out)
    counts = result.meta["counts"]
    click.echo(f"wrote {output}: {result.requests.num_rows} requests ({counts['finished']} finished, "
               f"{result.requests.num_rows - counts['finished']} failed, timed out or cancelled), "
               f"{done.measured.clock}-side times, trace of {trace.num_rows} requests")
    prefix = result.meta["prefix"]
    share = prefix["ideal_hit_share"]
    click.echo(f"prefix sharing: {done.prefix.origin}"
               + (f" (an unlimited cache would serve {share:.1%} of prompt tokens)" if share is not None else ""))
    for note in result.meta["notes"]:
        click.echo(f"note: {note}")
    for warning in done.warnings:
        click.echo(f"warning: {warning}", err=True)
    if trace_out is not None:
        click.echo(f"wrote {trace_out}")


def _count_benchmarks(fmt: str, path: Path) -> int:
    if fmt == "guidellm":
        from servelab.fidelity.guidellm import count_benchmarks
    elif fmt == "genai-perf":
        from servelab.fidelity.genai_perf import count_benchmarks
    else:
        from servelab.fidelity.sglang_bench import count_benchmarks
    return count_benchmarks(path)


def _import_sweep(count: int, sources, output, kwargs: dict, fmt: str = "guidellm") -> None:
    """A GuideLLM report of several benchmarks, an SGLang bench_serving file of several runs, or a
    genai-perf export of several experiments: OUTPUT/benchmark_<i> for each and OUTPUT/sweep.json."""
    import json

    from servelab.common.atomic import atomic_dir
    from servelab.fidelity.base import import_measured, write_measured_run
    from servelab.fidelity.run_import import import_run as run_import

    if fmt == "guidellm":  # the whole report parsed first: a bad row anywhere is the error
        import_measured(fmt, list(sources))
    levels = []
    with atomic_dir(output) as tmp:
        for i in range(count):
            done = run_import(list(sources), fmt, options={"benchmark": i}, **kwargs)
            result = done.result
            name = f"benchmark_{i}"
            write_measured_run(result, done.trace, tmp / name)
            levels.append({"name": name, "benchmark": i, "load": result.meta.get("load", {}),
                           "requests": result.requests.num_rows})
            click.echo(f"{name}: {result.requests.num_rows} requests ({result.meta['counts']['finished']} finished), "
                       f"prefix sharing: {done.prefix.origin}")
            for warning in done.warnings:
                click.echo(f"warning: {name}: {warning}", err=True)
        (tmp / "sweep.json").write_text(json.dumps({"source": str(sources[0]), "format": fmt,
                                                    "runs": levels}, indent=2, sort_keys=True) + "\n")
    click.echo(f"wrote {output}: {count} benchmarks of a sweep, each a run directory (benchmark_0 .. "
               f"benchmark_{count - 1}) and sweep.json")


def _parse_settings(items: tuple[str, ...]) -> dict:
    from servelab.cli.key_values import parse_key_values
    from servelab.fidelity.base import SETTING_TYPES

    return parse_key_values(items, "--setting", known=SETTING_TYPES, underscores=True)
