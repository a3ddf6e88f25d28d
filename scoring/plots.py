"""PNG charts of runs: latency CDFs per tier, task completion CDFs, per-tenant attainment, attainment vs rate,
resource timelines.

Data is reduced in SQL first (CDFs from 501 quantiles, timelines bucketed when long) so a plot of a
million-request run costs about as much as one of a thousand.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import duckdb

from servelab.common.atomic import atomic_path

CDF_POINTS = 501
TIMELINE_MAX_ROWS = 20_000
TIMELINE_BUCKETS = 2_000
MAX_TIMELINES = 20
MAX_TENANT_BARS = 30
_PNG_META = {"Software": None}  # no version string: same data, same bytes


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata=_PNG_META, bbox_inches="tight")
    _plt().close(fig)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]


def plot_cdf(con: duckdb.DuckDBPyConnection, metric: str, path: Path) -> Path | None:
    """CDF of ``metric`` (ttft_s/tpot_s) over finished requests, a line per run and tier."""
    plt = _plt()
    qs = [i / (CDF_POINTS - 1) for i in range(CDF_POINTS)]
    rows = con.execute(
        f"SELECT run_id, coalesce(tier, '(none)') AS tier, quantile_cont({metric}, ?::DOUBLE[]) AS q, count(*) AS n "
        f"FROM request_metrics WHERE finished AND {metric} IS NOT NULL GROUP BY ALL ORDER BY run_id, tier",
        [qs],
    ).fetchall()
    if not rows:
        return None
    runs = sorted({r[0] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("viridis")([i / max(1, len(rows) - 1) for i in range(len(rows))]) if len(rows) > 10 else [None] * len(rows)
    for (run_id, tier, q, n), color in zip(rows, colors):
        label = tier if len(runs) == 1 else f"{run_id} / {tier}"
        ax.plot([v * 1e3 for v in q], qs, label=f"{label} (n={n})", color=color,
                drawstyle="steps-post" if n < 50 else "default")
    found = con.execute(f"SELECT {metric} FROM slo_table WHERE scope = 'global'").fetchall()
    slo = found[0] if found else None
    if slo and slo[0] is not None:
        ax.axvline(slo[0] * 1e3, color="black", linestyle="--", linewidth=1, label=f"global SLO {slo[0] * 1e3:g} ms")
    values = [v for _, _, q, _ in rows for v in q if v is not None and v > 0]
    if values and max(values) / min(values) > 100:
        ax.set_xscale("log")
    ax.set_xlabel(f"{metric.removesuffix('_s').upper()} (ms)")
    ax.set_ylabel("fraction of finished requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{metric.removesuffix('_s').upper()} CDF per tier")
    if len(rows) > 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_task_jct_cdf(con: duckdb.DuckDBPyConnection, path: Path) -> Path | None:
    """CDF of task job completion times (the ``tasks`` view), a line per run. Every task counts: a task that
    did not complete (unfinished, failed or skipped requests) never reaches a time, so a line ends at the
    share of tasks complete."""
    plt = _plt()
    qs = [i / (CDF_POINTS - 1) for i in range(CDF_POINTS)]
    # up to CDF_POINTS tasks: every completion time (an exact step CDF); more: CDF_POINTS quantiles
    rows = con.execute(
        "SELECT run_id, CASE WHEN count(*) FILTER (WHERE complete) <= ? THEN list(jct_s ORDER BY jct_s) FILTER "
        "(WHERE complete) ELSE quantile_cont(jct_s, ?::DOUBLE[]) FILTER (WHERE complete) END AS x, count(*) AS n, "
        "count(*) FILTER (WHERE complete) AS done FROM tasks GROUP BY run_id HAVING done > 0 ORDER BY run_id",
        [CDF_POINTS, qs],
    ).fetchall()
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run_id, x, n, done in rows:
        label = f"{run_id} ({done} of {n} tasks complete)" if len(rows) > 1 else f"{done} of {n} tasks complete"
        if done <= CDF_POINTS:
            ax.plot([x[0], *x], [0.0, *((i + 1) / n for i in range(done))], label=label, drawstyle="steps-post")
        else:
            ax.plot(x, [q * done / n for q in qs], label=label)
    found = con.execute("SELECT task_s FROM slo_table WHERE scope = 'global'").fetchall()
    if found and found[0][0] is not None:
        ax.axvline(found[0][0], color="black", linestyle="--", linewidth=1, label=f"task deadline {found[0][0]:g} s")
    ax.set_xlabel("job completion time (s): first arrival to last finish")
    ax.set_ylabel("fraction of tasks")
    ax.set_ylim(0, 1.01)
    ax.grid(True, alpha=0.3)
    ax.set_title("Task completion time CDF")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_tenant_attainment(con: duckdb.DuckDBPyConnection, path: Path) -> Path | None:
    """Joint SLO attainment per tenant (the busiest tenants), bars grouped by run."""
    plt = _plt()
    rows = con.execute(
        "WITH top AS (SELECT tenant, sum(requests) AS n FROM tenant_summary GROUP BY tenant "
        f"ORDER BY n DESC, tenant NULLS FIRST LIMIT {MAX_TENANT_BARS}) "
        "SELECT s.run_id, coalesce(s.tenant, '(none)'), s.attainment FROM tenant_summary s JOIN top "
        "ON s.tenant IS NOT DISTINCT FROM top.tenant ORDER BY s.tenant NULLS FIRST, s.run_id"
    ).fetchall()
    if not rows:
        return None
    tenants = list(dict.fromkeys(r[1] for r in rows))
    runs = sorted({r[0] for r in rows})
    values = {(r[0], r[1]): r[2] for r in rows}
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(tenants) * max(1, len(runs) / 2) + 2), 4.5))
    for i, run_id in enumerate(runs):
        xs = [t + (i - (len(runs) - 1) / 2) * width for t in range(len(tenants))]
        ax.bar(xs, [values.get((run_id, t)) or 0.0 for t in tenants], width=width, label=run_id)
    ax.set_xticks(range(len(tenants)))
    ax.set_xticklabels(tenants, rotation=45 if len(tenants) > 6 else 0, ha="right" if len(tenants) > 6 else "center")
    ax.set_ylim(0, 1.18)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    slo = con.execute("SELECT count(*) FROM slo_table").fetchone()[0]  # without one, never called attainment
    ax.set_ylabel("joint SLO attainment" if slo else "share finished (no SLO given)")
    ax.set_title("SLO attainment per tenant" if slo else "Share finished per tenant (no SLO given)")
    ax.grid(True, axis="y", alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8, loc="upper center", ncol=min(len(runs), 4))
    return _save(fig, path)


MAX_POINT_LABELS = 24


def plot_attainment_vs_rate(
    con: duckdb.DuckDBPyConnection, path: Path, target: float | None = None, goodput_rate: float | None = None,
    sweeps: list[tuple[str, float | None, float | None]] = (),
) -> Path | None:
    """Attainment against offered arrival rate: a line per folder of runs (a sweep), each point named by its run.

    Drawn only when the runs were offered at least two different rates: runs at one rate would be
    points on top of each other (compare them with `servelab compare` instead). ``sweeps``: (folder name,
    target, goodput rate) of each sweep among the folders, whose lines are drawn beside the other runs too.
    """
    plt = _plt()
    rows = con.execute(
        "SELECT v.run_id, r.run_path, v.offered_rate_rps, v.attainment FROM attainment_vs_rate v "
        "JOIN runs r USING (run_id) WHERE v.offered_rate_rps IS NOT NULL ORDER BY v.offered_rate_rps, v.run_id"
    ).fetchall()
    if len({round(r[2], 9) for r in rows}) < 2:
        return None
    tiers = con.execute(
        "SELECT coalesce(a.name, '(none)'), sp.offered_rate_rps, a.attainment FROM slo_attainment a "
        "JOIN run_span sp USING (run_id) WHERE a.scope = 'tier' AND sp.offered_rate_rps IS NOT NULL "
        "ORDER BY 1, 2"
    ).fetchall()
    groups: dict[str, list[tuple]] = {}
    for run_id, run_path, rate, attainment in rows:
        groups.setdefault(Path(run_path).parent.name if run_path else "", []).append((run_id, rate, attainment))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    several = len(groups) > 1
    for index, (name, pts) in enumerate(groups.items()):
        label = f"{name or 'runs'} (all requests)" if several else "all requests"
        line, = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", color=None if several else "black",
                        label=label)
        if len(rows) <= MAX_POINT_LABELS:  # name each point by its run (the legend names the folder)
            for run_id, rate, attainment in pts:
                text = run_id.removeprefix(f"{name}/") if several else run_id
                ax.annotate(text, (rate, attainment), textcoords="offset points", xytext=(4, 5 + 9 * index),
                            fontsize=7, color=line.get_color())
    tier_names = list(dict.fromkeys(t[0] for t in tiers))
    if len(tier_names) > 1 and not several:
        for name in tier_names:
            pts = [(t[1], t[2]) for t in tiers if t[0] == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linestyle="--", label=f"tier {name}")
    marks = [("", target, goodput_rate)] if target is not None or goodput_rate is not None else list(sweeps)
    for value in dict.fromkeys(t for _, t, _ in marks if t is not None):  # one line per distinct target
        ax.axhline(value, color="red", linestyle=":", label=f"target {value:g}")
    for name, _, rate in marks:
        if rate is not None:
            where = f" of {name}" if name and several else ""
            ax.axvline(rate, color="green", linestyle=":", label=f"goodput rate{where} {rate:.3g} req/s")
    slo = con.execute("SELECT count(*) FROM slo_table").fetchone()[0]
    ax.set_xlabel("offered arrival rate (req/s)")
    ax.set_ylabel("joint SLO attainment" if slo else "share finished (no SLO given)")
    ax.set_ylim(-0.02, 1.12)
    ax.grid(True, alpha=0.3)
    ax.set_title("SLO attainment vs arrival rate")
    ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def plot_timeline(con: duckdb.DuckDBPyConnection, run_id: str, path: Path) -> Path | None:
    """Batch size, KV use and queue length over simulated time, one line per replica."""
    plt = _plt()
    n, t0, t1 = con.execute(
        "SELECT count(*), min(start_s), max(start_s + duration_s) FROM steps WHERE run_id = ?", [run_id]
    ).fetchall()[0]
    if not n:
        return None
    if n <= TIMELINE_MAX_ROWS:
        sql = (
            "SELECT replica, start_s AS t, batch_requests AS batch, kv_blocks_used / nullif(kv_blocks_total, 0) AS kv, "
            "waiting FROM steps WHERE run_id = ? ORDER BY replica, start_s"
        )
        params = [run_id]
        style = "steps-post"
    else:  # duration-weighted means per time bucket (stretches split across buckets)
        width = max((t1 - t0) / TIMELINE_BUCKETS, 1e-9)
        sql = (
            "SELECT replica, t_s, mean_batch_requests, mean_kv_util, mean_waiting "
            "FROM resource_timeline(?) WHERE run_id = ? ORDER BY replica, t_s"
        )
        params = [width, run_id]
        style = "default"
    rows = con.execute(sql, params).fetchall()
    if style == "steps-post":  # hold each replica's last stretch until it ends
        last = {r[0]: r for r in rows}
        rows += [(rep, t1, *r[2:]) for rep, r in last.items()]
        rows.sort(key=lambda r: (r[0], r[1]))
    fig, axes = plt.subplots(3, 1, figsize=(9, 6.5), sharex=True)
    replicas = list(dict.fromkeys(r[0] for r in rows))
    for rep in replicas[:8]:
        pts = [r for r in rows if r[0] == rep]
        label = f"replica {rep}"
        ts = [p[1] for p in pts]
        axes[0].plot(ts, [p[2] for p in pts], drawstyle=style, linewidth=0.8, label=label)
        axes[1].plot(ts, [100 * (p[3] or 0) for p in pts], drawstyle=style, linewidth=0.8, label=label)
        axes[2].plot(ts, [p[4] for p in pts], drawstyle=style, linewidth=0.8, label=label)
    axes[0].set_ylabel("batch (requests)")
    axes[1].set_ylabel("KV blocks used (%)")
    axes[1].set_ylim(0, 105)
    axes[2].set_ylabel("queue (waiting)")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if len(replicas) > 1:
        axes[0].legend(fontsize=7, loc="upper right")
    title = f"run {run_id}: batch size, KV use, queue length"
    if len(replicas) > 8:
        title += f" (first 8 of {len(replicas)} replicas)"
    axes[0].set_title(title)
    return _save(fig, path)


def plot_cluster(meta: dict, start_s: float, stop_s: float, end_s: float, path: Path, title: str = "run",
                 where: str = "run") -> Path:
    """Replicas per pool (held: solid; serving, when it differs: dashed) and cumulative dollars per pool
    and in all over a cluster run; GPU-hours instead unless every pool has a price. ``start_s``..``stop_s``
    is the window the cost view charges (first arrival to last finish), ``end_s`` the run's end."""
    from servelab.scoring.cluster_timeline import cumulative, pool_series

    series = pool_series(meta, where)
    plt = _plt()
    # (a run recorded before unpriced pools were null has 0.0 for them: all zero is unpriced too)
    priced = all(p.price_per_gpu_hour is not None for p in series) and any(p.price_per_gpu_hour > 0 for p in series)
    end_s = max(end_s, stop_s, *(p.times[-1] for p in series))
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    grid = sorted({0.0, start_s, stop_s, end_s, *(t for p in series for t in p.times if 0 <= t <= end_s)})
    total = [0.0] * len(grid)
    for p in series:
        label = f"{p.name} ({p.role}, {p.gpu or '?'} x{p.tp})"
        times = [*p.times, end_s]
        line, = axes[0].plot(times, [*p.held, p.held[-1]], drawstyle="steps-post", label=label)
        if p.active != p.held:
            axes[0].plot(times, [*p.active, p.active[-1]], drawstyle="steps-post", linestyle="--",
                         color=line.get_color(), label=f"{p.name} serving")
        values = cumulative(p, start_s, stop_s, grid, p.price_per_gpu_hour if priced else 1.0)
        total = [a + b for a, b in zip(total, values)]
        if len(series) > 1:
            axes[1].plot(grid, values, color=line.get_color(), label=p.name)
    axes[1].plot(grid, total, color="black", linewidth=1.5, label=f"all pools: {total[-1]:.4g}")
    axes[0].set_ylabel("replicas")
    axes[0].set_ylim(bottom=0)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[1].set_ylabel("cumulative $" if priced else "cumulative GPU-hours (no prices)")
    axes[1].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.axvspan(start_s, stop_s, color="grey", alpha=0.08)  # the window the cost view charges
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_title(f"run {title}: replicas per pool and {'cost' if priced else 'GPU time'} over time")
    return _save(fig, path)


def cluster_window(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[float, float, float]:
    """(first arrival, last finish, end) of a run: the cost view's window and where the run stopped."""
    first, duration, end = con.execute(
        "SELECT first_arrival_s, duration_s, end_s FROM run_span WHERE run_id = ?", [run_id]).fetchone()
    first = first or 0.0
    return first, first + (duration or 0.0), end or 0.0


def plot_clusters(con: duckdb.DuckDBPyConnection, out_dir: str | os.PathLike, only: bool = False) -> list[Path]:
    """``cluster_<run>.png`` for each run with cluster pools; ``only``: every run must have them."""
    from servelab.scoring.cluster_timeline import pool_series

    runs = []
    for run_id, run_path in con.execute("SELECT run_id, run_path FROM runs ORDER BY run_id").fetchall():
        meta_path = Path(run_path) / "run.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if only:
            pool_series(meta, str(run_path))  # every run checked before anything is drawn
        elif not (meta.get("cluster") or {}).get("pools"):
            continue
        runs.append((run_id, run_path, meta))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_cluster(meta, *cluster_window(con, run_id), out_dir / f"cluster_{_safe(run_id)}.png", title=run_id,
                         where=str(run_path))
            for run_id, run_path, meta in runs[:MAX_TIMELINES if not only else None]]


def _sweep_info(con: duckdb.DuckDBPyConnection) -> list[tuple[str, float | None, float | None]]:
    """(folder name, target, goodput rate) from the sweep.json of each folder of runs that holds one: a sweep
    keeps its lines when plotted beside other runs."""
    paths = sorted({Path(r[0]).parent for r in con.execute("SELECT run_path FROM runs").fetchall() if r[0]})
    out = []
    for folder in paths:
        info = folder / "sweep.json"
        if info.exists():
            data = json.loads(info.read_text())
            out.append((folder.name, data.get("target"), data.get("goodput_rate_rps")))
    return out


def write_plots(con: duckdb.DuckDBPyConnection, out_dir: str | os.PathLike) -> list[Path]:
    """Write every chart that the runs have data for into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_cdf(con, "ttft_s", out / "ttft_cdf.png"),
        plot_cdf(con, "tpot_s", out / "tpot_cdf.png"),
        plot_tenant_attainment(con, out / "tenant_attainment.png"),
        plot_task_jct_cdf(con, out / "task_jct_cdf.png"),
        plot_attainment_vs_rate(con, out / "attainment_vs_rate.png", sweeps=_sweep_info(con)),
    ]
    run_ids = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
    for run_id in run_ids[:MAX_TIMELINES]:
        written.append(plot_timeline(con, run_id, out / f"timeline_{_safe(run_id)}.png"))
    written += plot_clusters(con, out)
    return [p for p in written if p is not None]
