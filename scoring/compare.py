"""Side-by-side metrics of several runs, with each run's change against the first (the baseline)."""

from __future__ import annotations

import duckdb
import pyarrow as pa

_Q = "[0.5, 0.9, 0.99, 0.999]"
_Q_NAMES = ("p50", "p90", "p99", "p999")

# One pass over request_metrics per run (the views' grouping sets would be recomputed per metric).
_PER_RUN = f"""
SELECT m.run_id,
    count(*) AS requests,
    count(*) FILTER (WHERE finished) AS finished,
    count(*) FILTER (WHERE status = 'unfinished') AS unfinished,
    count(*) FILTER (WHERE status IN ('rejected', 'throttled', 'dropped')) AS refused,
    count(*) FILTER (WHERE met_all) / count(*) AS attainment,
    count(*) FILTER (WHERE met_ttft) / nullif(count(met_ttft), 0) AS attainment_ttft,
    count(*) FILTER (WHERE met_tpot) / nullif(count(met_tpot), 0) AS attainment_tpot,
    count(*) FILTER (WHERE met_e2e) / nullif(count(met_e2e), 0) AS attainment_e2e,
    count(*) FILTER (WHERE met_stall) / nullif(count(met_stall), 0) AS attainment_stall,
    avg(ttft_s) FILTER (WHERE finished) AS ttft_mean,
    quantile_cont(ttft_s, {_Q}) FILTER (WHERE finished) AS ttft_q,
    avg(tpot_s) FILTER (WHERE finished) AS tpot_mean,
    quantile_cont(tpot_s, {_Q}) FILTER (WHERE finished) AS tpot_q,
    avg(e2e_s) FILTER (WHERE finished) AS e2e_mean,
    quantile_cont(e2e_s, {_Q}) FILTER (WHERE finished) AS e2e_q,
    quantile_cont(queue_s, 0.99) FILTER (WHERE finished) AS queue_p99,
    any_value(sp.duration_s) AS duration_s,
    count(*) FILTER (WHERE finished) / any_value(sp.duration_s) AS request_throughput_rps,
    coalesce(sum(output_tokens) FILTER (WHERE finished), 0) / any_value(sp.duration_s) AS output_throughput_tps,
    coalesce(sum(prompt_tokens + output_tokens) FILTER (WHERE finished), 0) / any_value(sp.duration_s)
        AS total_token_throughput_tps,
    count(*) FILTER (WHERE met_all) / any_value(sp.duration_s) AS goodput_rps,
    count(*) FILTER (WHERE met_all) / any_value(sp.duration_s) / any_value(sp.num_gpus) AS goodput_rps_per_gpu,
    sum(num_preemptions) AS preemptions
FROM request_metrics m JOIN run_span sp ON sp.run_id = m.run_id
GROUP BY m.run_id
"""
_TIERS = """
SELECT run_id, tier, count(*) FILTER (WHERE met_all) / count(*) AS attainment
FROM request_metrics GROUP BY run_id, tier ORDER BY tier NULLS FIRST, run_id
"""
_RESOURCES = """
SELECT run_id, sum(batch_requests * duration_s) / nullif(sum(duration_s), 0) AS mean_batch_requests,
       sum(kv_blocks_used / nullif(kv_blocks_total, 0) * duration_s) / nullif(sum(duration_s), 0) AS mean_kv_util
FROM steps GROUP BY run_id
"""
_FAIRNESS = "SELECT run_id, jain_service, worst_tenant_attainment, max_wait_s FROM fairness"
_COST = """
SELECT run_id, gpus, gpu_s / 3600 AS gpu_hours, dollars, dollars_per_million_output_tokens, dollars_per_request,
       goodput_requests_per_dollar
FROM cost WHERE scope = 'overall'
"""
_TASKS = """
SELECT run_id, tasks, complete AS tasks_complete, skipped AS requests_skipped, jct_mean_s AS task_jct_mean_s,
       jct_p50_s AS task_jct_p50_s, jct_p90_s AS task_jct_p90_s, jct_p99_s AS task_jct_p99_s,
       cp_llm_share AS task_cp_llm_share, cp_wait_share AS task_cp_wait_share,
       cp_queue_share AS task_cp_queue_share, reuse_rate AS task_reuse_rate,
       with_deadline, deadline_attainment AS task_deadline_attainment, task_goodput_per_s
FROM task_summary WHERE scope = 'overall'
"""
# Task metrics in their own units: completion times in seconds (tasks last seconds to minutes), shares in %.
_TASK_SHOWN = {"task_cp_llm_share": "task_cp_llm_pct", "task_cp_wait_share": "task_cp_wait_pct",
               "task_cp_queue_share": "task_cp_queue_pct", "task_reuse_rate": "task_reuse_pct",
               "task_deadline_attainment": "task_deadline_attainment_pct"}


def _records(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict]:
    rel = con.execute(sql)
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


# How each metric of _PER_RUN, _RESOURCES and _FAIRNESS is shown: the report's units (latency in
# ms, shares in %), the unit in the name. Metrics not listed keep their name and value.
_SHOWN = {
    "attainment": ("attainment_pct", 100.0),
    "attainment_ttft": ("attainment_ttft_pct", 100.0),
    "attainment_tpot": ("attainment_tpot_pct", 100.0),
    "attainment_e2e": ("attainment_e2e_pct", 100.0),
    "attainment_stall": ("attainment_stall_pct", 100.0),
    "ttft_mean": ("ttft_mean_ms", 1e3),
    "tpot_mean": ("tpot_mean_ms", 1e3),
    "e2e_mean": ("e2e_mean_ms", 1e3),
    "queue_p99": ("queue_p99_ms", 1e3),
    "max_wait_s": ("max_wait_ms", 1e3),  # a latency like the others: ms
    "mean_kv_util": ("mean_kv_util_pct", 100.0),
    "worst_tenant_attainment": ("worst_tenant_attainment_pct", 100.0),
    **{f"{m}_{q}": (f"{m}_{q}_ms", 1e3) for m in ("ttft", "tpot", "e2e") for q in _Q_NAMES},
}


def _shown(metric: str, value) -> tuple[str, float | None]:
    name, factor = _SHOWN.get(metric, (metric, 1.0))
    return name, None if value is None else float(value) * factor


def run_metrics(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Long table (run_id, metric, value): the report's overall numbers plus attainment per tier (when several).

    Units as in the report and in each metric's name: ``_ms`` latency, ``_pct`` shares (0-100),
    ``_s`` seconds, ``_rps``/``_tps`` requests/tokens per second; counts and indices bare.
    """
    out: list[tuple[str, str, float | None]] = []
    extra = {r["run_id"]: r for r in _records(con, _RESOURCES)}
    fair = {r["run_id"]: r for r in _records(con, _FAIRNESS)}
    per_run = sorted(_records(con, _PER_RUN), key=lambda r: r["run_id"])
    by_metric: dict[str, list[tuple[str, float | None]]] = {}
    for r in per_run:
        values: dict[str, float | None] = {}
        for k, v in r.items():
            if k == "run_id":
                continue
            if k.endswith("_q"):
                for name, q in zip(_Q_NAMES, v or [None] * len(_Q_NAMES)):
                    values[f"{k[:-2]}_{name}"] = q
            else:
                values[k] = v
        values.update({k: extra.get(r["run_id"], {}).get(k) for k in ("mean_batch_requests", "mean_kv_util")})
        values.update({k: fair.get(r["run_id"], {}).get(k) for k in ("jain_service", "worst_tenant_attainment", "max_wait_s")})
        for k, v in values.items():
            name, value = _shown(k, v)
            by_metric.setdefault(name, []).append((r["run_id"], value))
    for metric, vals in by_metric.items():
        out += [(rid, metric, v) for rid, v in vals]
    cost = _records(con, _COST)
    if any(r["dollars"] is not None for r in cost):  # (priced runs only: docs/cluster.md "Cost")
        for k in ("gpus", "gpu_hours", "dollars", "dollars_per_million_output_tokens", "dollars_per_request",
                  "goodput_requests_per_dollar"):
            out += [(r["run_id"], k, None if r[k] is None else float(r[k])) for r in sorted(cost, key=lambda r: r["run_id"])]
    tasks = sorted((r for r in _records(con, _TASKS) if r["tasks"]), key=lambda r: r["run_id"])
    if tasks:  # (runs whose requests carry a task/session id: docs/metrics.md "Tasks")
        deadline = any(r["with_deadline"] for r in tasks)
        for k in ("tasks", "tasks_complete", "requests_skipped", "task_jct_mean_s", "task_jct_p50_s", "task_jct_p90_s",
                  "task_jct_p99_s", "task_cp_llm_share", "task_cp_wait_share", "task_cp_queue_share", "task_reuse_rate",
                  *(("task_deadline_attainment", "task_goodput_per_s") if deadline else ())):
            factor = 100.0 if k in _TASK_SHOWN else 1.0
            out += [(r["run_id"], _TASK_SHOWN.get(k, k), None if r[k] is None else float(r[k]) * factor) for r in tasks]
    tiers = _records(con, _TIERS)
    if len({r["tier"] for r in tiers}) < 2:  # one tier: its row would repeat attainment_pct
        tiers = []
    for r in tiers:
        tier = "(none)" if r["tier"] is None else r["tier"]
        out.append((r["run_id"], f"attainment_pct tier={tier}", _shown("attainment", r["attainment"])[1]))
    return pa.table(
        {"run_id": [o[0] for o in out], "metric": [o[1] for o in out], "value": [o[2] for o in out]},
        schema=pa.schema([("run_id", pa.string()), ("metric", pa.string()), ("value", pa.float64())]),
    )


def compare_table(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> pa.Table:
    """One row per metric; a column per run; ``delta RUN`` (in the metric's unit) and ``delta_pct RUN``
    (relative to the first run, in %) of each later run against the first."""
    long = run_metrics(con).to_pylist()
    metrics: list[str] = []
    values: dict[tuple[str, str], float | None] = {}
    for row in long:
        if row["metric"] not in metrics:
            metrics.append(row["metric"])
        values[(row["metric"], row["run_id"])] = row["value"]
    cols: dict[str, list] = {"metric": metrics}
    base = run_ids[0]
    for rid in run_ids:
        cols[rid] = [values.get((m, rid)) for m in metrics]
    for rid in run_ids[1:]:
        deltas, pcts = [], []
        for m in metrics:
            a, b = values.get((m, base)), values.get((m, rid))
            d = None if a is None or b is None else b - a
            deltas.append(d)
            pcts.append(None if d is None or a == 0 else 100.0 * d / abs(a))
        cols[f"delta {rid}"] = deltas
        cols[f"delta_pct {rid}"] = pcts
    schema = pa.schema([("metric", pa.string())] + [(k, pa.float64()) for k in cols if k != "metric"])
    return pa.table(cols, schema=schema)


# What a run was set up with, as the runs view names it (the report's header), for "what differs"
_SETUP = (("measured", "kind"), ("trace_name", "trace"), ("trace_sha256", "trace content"),
          ("config_model", "model"), ("config_gpu", "gpu"), ("config_tp", "tp"), ("num_gpus", "GPUs"),
          ("config_runner", "runner"), ("config_policy", "policy"), ("config_router", "router"),
          ("config_replicas", "replicas"))
MAX_SHOWN = 8  # settings named in full; the rest are counted


def differing_settings(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> list[tuple[str, list]]:
    """The settings (the report header's, then every other ``config_*`` column) on which ``run_ids``
    differ: ``(name, [value per run])`` in the runs' order. A setting a run does not record is None."""
    columns = [r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE runs)").fetchall()]
    named = dict(_SETUP)
    wanted = [c for c, _ in _SETUP if c in columns]
    wanted += sorted(c for c in columns if c.startswith("config_") and c not in named)
    if not wanted:
        return []
    select = ", ".join(f'"{c}"' for c in wanted)
    rows = {r[0]: r[1:] for r in con.execute(f'SELECT run_id, {select} FROM runs').fetchall()}
    out = []
    for i, column in enumerate(wanted):
        values = [rows[rid][i] if rid in rows else None for rid in run_ids]
        if column == "measured":  # (a replay's run.json does not say)
            values = ["measured" if v else "simulated" for v in values]
        if len({repr(v) for v in values}) > 1:
            out.append((named.get(column, column.removeprefix("config_")), values))
    return out


def server_time_scale(run: dict) -> float | None:
    """The time scale of the simulated server a live run measured (run.json ``endpoint.server_time_scale``,
    `servelab serve --time-scale`) when it is not 1: its times are wall seconds, its metrics simulated."""
    scale = run.get("endpoint_server_time_scale")
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 and scale != 1 else None


def clock_note(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> str | None:
    """Which clock each run's times are in, when one is a live run against a server whose simulated time
    runs at another speed than the wall clock (its deltas against a replay are then mostly the scale)."""
    columns = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE runs)").fetchall()}
    if "endpoint_server_time_scale" not in columns:
        return None
    wanted = [c for c in ("endpoint_server_time_scale", "measured") if c in columns]
    rows = {r[0]: dict(zip(wanted, r[1:])) for r in con.execute(
        f"SELECT run_id, {', '.join(wanted)} FROM runs").fetchall()}  # fmt: skip
    if not any(server_time_scale(rows.get(rid, {})) for rid in run_ids):
        return None
    parts = []
    for rid in run_ids:
        row = rows.get(rid, {})
        scale = server_time_scale(row)
        if scale is not None:
            parts.append(f"{rid} in the client's wall-clock seconds at server time scale {scale:g} "
                         f"(x{scale:g} for simulated seconds)")
        else:
            parts.append(f"{rid} in {'measured' if row.get('measured') else 'simulated'} seconds")
    return "times: " + "; ".join(parts)


def differing_note(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> str:
    """One line naming what the runs differ in (``runs differ in: gpu (a l40s, b h100-80gb); ...``), or
    that they share every recorded setting: a change in the table is then the runs' own."""
    diffs = differing_settings(con, run_ids)
    if not diffs:
        return "runs differ in: no recorded setting (model, GPU, runner, policy, trace and engine settings alike)"
    parts = []
    for name, values in diffs[:MAX_SHOWN]:
        if name == "trace content":
            parts.append("trace content (another file or rows)")
            continue
        shown = ", ".join(f"{rid} {'-' if v is None else v}" for rid, v in zip(run_ids, values))
        parts.append(f"{name} ({shown})")
    more = len(diffs) - MAX_SHOWN
    tail = f"; and {more} more (servelab query RUN... 'SELECT * FROM runs')" if more > 0 else ""
    return "runs differ in: " + "; ".join(parts) + tail
