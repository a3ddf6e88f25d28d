"""Scoring commands: `query`, `report`, `compare`, `sweep`, `plot` and `runs collect`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from servelab.cli.replay_cmd import ReplayCommand, config_from_options, replay_options  # the replay flags sweep shares
from servelab.cli.slo_options import slo_from_options
from servelab.common.errors import ServelabError


def slo_options(func):
    """``--slo`` (repeatable) and ``--slo-file``; shared by every command that scores runs."""
    func = click.option(
        "--slo-file",
        type=click.Path(dir_okay=False),
        help="TOML file with an SLO table (global keys, [tier.NAME], [tenant.NAME]); --slo flags override it.",
    )(func)
    func = click.option(
        "--slo",
        "slo_specs",
        multiple=True,
        metavar="SPEC",
        help="SLO: 'ttft=500ms,tpot=50ms', 'tier=priority:ttft=0.2s', 'tenant=acme:e2e=10', 'task=30s' (a deadline per "
             "task; a bare number is seconds; one implausible as seconds is refused). Default: the SLO the runs "
             "recorded. Repeatable.",
    )(func)
    return func


def runs_slo(run_dirs, slo_specs: tuple[str, ...] = (), slo_file: str | None = None):
    """The SLO to score ``run_dirs`` with (see ``resolve_runs_slo``), its source said on stderr."""
    slo, source = resolve_runs_slo(run_dirs, slo_specs, slo_file)
    if slo is not None and source not in (None, "given"):
        click.echo(f"scoring with {source} ({slo.describe()}); --slo or --slo-file replaces it", err=True)
    return slo


def resolve_runs_slo(run_dirs, slo_specs: tuple[str, ...] = (), slo_file: str | None = None):
    """``(SloTable or None, source)``: the SLO to score ``run_dirs`` with and where it came from.

    The options' SLO if any was given (source ``"given"``); else the sweep's own, stored in sweep.json
    ("the sweep's SLO"); else the one the runs recorded in run.json when they were replayed or searched
    ("the SLO recorded in run.json"); else None. Runs that recorded different SLOs are all scored with the
    first one's, and the source says so: one SLO scores every run of a connection.
    """
    slo = slo_from_options(slo_specs, slo_file)
    if slo is not None or slo_specs or slo_file:
        return slo, "given"
    if any(str(d).endswith(".duckdb") for d in run_dirs):
        return None, None
    from servelab.scoring.sweep import sweep_slo

    try:
        slo = sweep_slo(run_dirs)
    except ServelabError:  # a missing run directory is reported by connect() with its own message
        return None, None
    if slo is not None:
        return slo, "the sweep's SLO"
    from servelab.scoring.slo import recorded_slo

    return recorded_slo(run_dirs)




_format = click.option(
    "--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table", show_default=True
)
_out = click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Write to this file (atomically).")


@click.command()
@click.argument("args", nargs=-1, required=True)
@slo_options
@_format
@_out
@click.option("--limit", type=int, default=200, show_default=True, help="Rows shown by --format table (0 = all).")
@click.option("--read-only/--no-read-only", default=False,
              help="The SQL may read the runs only: no other file, no COPY ... TO, no network, no extension installs; "
                   "and it is capped by the four limits below.")
@click.option("--memory-limit", default="2GB", show_default=True, help="--read-only: DuckDB memory_limit.")
@click.option("--max-temp-size", default="4GB", show_default=True,
              help="--read-only: DuckDB max_temp_directory_size (disk a query may spill to).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="--read-only: DuckDB threads.")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="--read-only: stop the query after this many seconds.")
def query(args, slo_specs, slo_file, fmt, out, limit, read_only, memory_limit, max_temp_size, threads, timeout_s):
    """Run SQL over one or more runs: servelab query RUN_DIR [RUN_DIR ...] "SQL".

    RUN_DIR may be a glob (quote it), a sweep/search directory, or a file made by `servelab runs
    collect`. Views: requests, steps, runs, request_metrics (+ _guidellm, _distserve), slo_attainment,
    latency_summary, goodput, tenant_summary, fairness, resource_summary, replica_balance,
    attainment_vs_rate, guidellm_summary (GuideLLM's statistics), tasks, task_summary (per task/session:
    completion time, critical path, deadline), slo_table, run_span; with per-token times (replay --token-log, bench
    --token-log, imported vLLM bench runs) tokens and itl_summary; with live metrics server_metrics.

    The SQL is DuckDB's, with your user's rights: it can read and write any file you can (COPY ...
    TO, read_csv), fetch URLs and install extensions. Give --read-only to run SQL you did not write.
    """
    from servelab.scoring.db import QueryLimits, connect, query_arrow
    from servelab.scoring.output import write_result

    if len(args) < 2:
        raise ServelabError('query needs at least one RUN_DIR and the SQL, e.g. servelab query runs/a "SELECT * FROM goodput"')
    *dirs, sql = args
    if not read_only:  # the limits are --read-only's: given alone they would silently do nothing
        ctx = click.get_current_context()
        for name, flag in (("memory_limit", "--memory-limit"), ("max_temp_size", "--max-temp-size"),
                           ("threads", "--threads"), ("timeout_s", "--timeout-s")):  # fmt: skip
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"{flag} limits a --read-only query: add --read-only")
    limits = QueryLimits(memory_limit, max_temp_size, threads, timeout_s) if read_only else None
    con = connect(dirs, runs_slo(dirs, slo_specs, slo_file), read_only=read_only, limits=limits)
    try:
        table = query_arrow(con, sql, timeout_s=limits.timeout_s if limits else None)
    finally:
        con.close()
    write_result(table, fmt, out, limit=limit or None)


@click.command()
@click.argument("run_dirs", nargs=-1, required=True)
@slo_options
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@_out
@click.option("--width", type=click.IntRange(min=20), default=None,
              help="Text width (default: COLUMNS or the terminal's, else 120); tables never cut a cell, they grow wider.")
def report(run_dirs, slo_specs, slo_file, fmt, out, width):
    """Readable summary of each run: attainment, latency percentiles, goodput, throughput, counts."""
    from servelab.common.atomic import atomic_path
    from servelab.scoring.db import connect
    from servelab.scoring.report import render_text, report_data

    slo, source = resolve_runs_slo(run_dirs, slo_specs, slo_file)  # the header says which SLO and whence
    con = connect(run_dirs, slo, read_only=True)
    try:
        if fmt == "json":
            ids = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
            text = json.dumps([report_data(con, i, slo_source=source) for i in ids], indent=1, default=str) + "\n"
        else:
            text = render_text(con, width=width, slo_source=source)
    finally:
        con.close()
    if out:
        with atomic_path(out) as tmp:
            Path(tmp).write_text(text)
    else:
        click.echo(text, nl=False)


COMPARE_DIGITS = 4  # significant digits of the text table: a metric's change shows, no six-digit noise


@click.command()
@click.argument("run_dirs", nargs=-1, required=True)
@slo_options
@_format
@_out
def compare(run_dirs, slo_specs, slo_file, fmt, out):
    """The report's metrics side by side; deltas of each run against the first."""
    import textwrap

    from servelab.common.tables import available_width
    from servelab.scoring.compare import clock_note, compare_table, differing_note
    from servelab.scoring.db import connect
    from servelab.scoring.output import write_result
    from servelab.scoring.sources import find_runs

    runs = find_runs(run_dirs)
    if len(runs) < 2:
        raise ServelabError("compare needs at least two runs")
    con = connect(run_dirs, runs_slo(run_dirs, slo_specs, slo_file), read_only=True)
    try:
        ids = [r.run_id for r in runs]
        table = compare_table(con, ids)
        note = differing_note(con, ids)  # a delta means little without what else changed between the runs
        clocks = clock_note(con, ids)  # nor when the runs' seconds are not the same seconds
        if clocks:
            note += "\n" + clocks
    finally:
        con.close()
    to_stderr = bool(out) or fmt != "table"  # (stdout stays the data's alone for machine formats)
    width = available_width(sys.stderr if to_stderr else None)
    if width:
        note = "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False,
                                        break_long_words=False) for line in note.split("\n"))
    click.echo(note, err=to_stderr)
    write_result(table, fmt, out, significant=COMPARE_DIGITS)


@click.command()
@click.argument("run_dirs", nargs=-1, required=True)
@slo_options
@click.option("-o", "--output", "out", type=click.Path(file_okay=False), required=True, help="Directory for the PNGs.")
@click.option("--cluster/--no-cluster", "cluster_only", default=False,
              help="Only the replicas-and-cost chart of each run (runs of a [cluster] config).")
def plot(run_dirs, slo_specs, slo_file, out, cluster_only):
    """PNG charts: TTFT/TPOT CDFs per tier, timelines, per-tenant attainment, attainment vs rate, replicas and cost."""
    from servelab.scoring.db import connect
    from servelab.scoring.plots import plot_clusters, write_plots

    con = connect(run_dirs, runs_slo(run_dirs, slo_specs, slo_file), read_only=True)
    try:
        # --cluster: every run must have pools (checked before anything is drawn)
        written = plot_clusters(con, out, only=True) if cluster_only else write_plots(con, out)
    finally:
        con.close()
    for path in written:
        click.echo(str(path))


@click.group()
def runs():
    """Work with many run directories at once."""


@runs.command("collect")
@click.argument("run_dirs", nargs=-1, required=True)
@slo_options
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), required=True, help="DuckDB file to write.")
def collect_cmd(run_dirs, slo_specs, slo_file, out):
    """Materialise runs (paths or globs) into one DuckDB file with the same tables and views."""
    from servelab.scoring.collect import collect

    n = collect(list(run_dirs), out, runs_slo(run_dirs, slo_specs, slo_file))
    click.echo(f"collected {n} run(s) into {out}")


def _deprecated(value, old: str, new: str):
    """An old option name still works, with a note that names the new one."""
    if value is not None:
        click.echo(f"note: {old} is deprecated; write {new}", err=True)
    return value


def _scaled(value, factor: float | None):
    return value if factor is None or value is None else value * factor


def _floats(text: str | None, name: str) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ServelabError(f"{name} expects comma-separated numbers, got '{text}'") from None


@click.command(cls=ReplayCommand)
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--rates", help="Comma-separated offered arrival rates to replay, req/s (e.g. 1,2,4,8).")
@click.option("--rate-scales", "scales", help="Comma-separated multipliers of the trace's own rate (arrival_s divided by each).")
@click.option("--scales", "old_scales", hidden=True,
              callback=lambda ctx, param, value: _deprecated(value, "--scales", "--rate-scales"))
@click.option("--goodput-target", "target", type=float, help="Search the highest rate whose joint SLO attainment >= this (e.g. 0.9).")
@click.option("--tolerance", type=float, default=0.02, show_default=True, help="Stop the search when hi/lo - 1 <= this.")
@click.option("--min-rate", type=float, help="Lowest rate the search may try, req/s.")
@click.option("--max-rate", type=float, help="Highest rate the search may try, req/s.")
@click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Replays run in parallel processes.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Sweep directory to write.")
@click.option("--force/--no-force", default=False, help="Replace the sweep directory -o names if it already holds a sweep.")
@slo_options
@replay_options
def sweep(trace, rates, scales, old_scales, target, tolerance, min_rate, max_rate, jobs, out_dir, force, slo_specs, slo_file, **options):
    """Replay TRACE at several arrival rates (one run dir each) and find the goodput rate."""
    import pyarrow as pa

    from servelab.common.outdir import check_output_dir
    from servelab.scoring.output import render_table
    from servelab.scoring.sweep import run_sweep

    config = config_from_options(**options)
    slo = slo_from_options(slo_specs, slo_file, options.get("config_file"))
    check_output_dir(out_dir, force, "sweep directory", ("sweep.json",))  # before any replay

    def progress(p):
        click.echo(f"  rate {p.rate_rps:.6g} req/s (x{p.scale:.4g}): attainment {p.attainment:.3f}", err=True)

    result = run_sweep(
        trace, config, out_dir, slo=slo, rates=_floats(rates, "--rates"),
        scales=_floats(scales or old_scales, "--rate-scales" if scales else "--scales"),
        target=target, tolerance=tolerance, jobs=jobs, min_rate=min_rate, max_rate=max_rate, progress=progress,
    )  # fmt: skip
    cols = ("rate_rps", "scale", "attainment", "attainment_ttft", "attainment_tpot", "goodput_rps",
            "request_throughput_rps", "ttft_p99_s", "tpot_p99_s", "unfinished", "refused", "run_dir")  # fmt: skip
    # latencies in ms, shares in %, as in report and compare (sweep.json keeps seconds and fractions)
    shown = {"attainment": ("attainment_pct", 100.0), "attainment_ttft": ("attainment_ttft_pct", 100.0),
             "attainment_tpot": ("attainment_tpot_pct", 100.0), "ttft_p99_s": ("ttft_p99_ms", 1e3),
             "tpot_p99_s": ("tpot_p99_ms", 1e3)}
    table = pa.table({shown.get(c, (c,))[0]: [_scaled(getattr(p, c), shown.get(c, (c, None))[1]) for p in result.points]
                      for c in cols})
    click.echo(f"trace rate {result.native_rate_rps:.6g} req/s; {len(result.points)} replays in {out_dir}")
    click.echo(render_table(table), nl=False)
    for note in result.notes:
        click.echo(note)
    if result.target is not None and result.goodput_rate_rps is not None:
        lo, hi = result.bracket_rps
        upper = f", first miss at {hi:.6g}" if hi is not None else ""
        click.echo(
            f"goodput rate (attainment >= {result.target:g}): {lo:.6g} req/s{upper} (tolerance {result.tolerance:g}); "
            f"{result.goodput_rate_per_gpu:.6g} req/s per GPU"
        )
