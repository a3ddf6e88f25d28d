"""Side-by-side metrics of several runs, with each run's change against the first (the baseline)."""

from __future__ import annotations

import duckdb
import pyarrow as pa

# (metric label, SQL giving run_id + value); lower_is_better drives nothing but is shown in docs.
_OVERALL = "scope = 'overall'"
METRICS: tuple[tuple[str, str], ...] = (
    ("requests", f"SELECT run_id, requests FROM slo_attainment WHERE {_OVERALL}"),
    ("finished", f"SELECT run_id, finished FROM slo_attainment WHERE {_OVERALL}"),
    ("unfinished", f"SELECT run_id, unfinished FROM slo_attainment WHERE {_OVERALL}"),
    ("refused", f"SELECT run_id, rejected + throttled + dropped FROM slo_attainment WHERE {_OVERALL}"),
    ("attainment", f"SELECT run_id, attainment FROM slo_attainment WHERE {_OVERALL}"),
    ("attainment_ttft", f"SELECT run_id, attainment_ttft FROM slo_attainment WHERE {_OVERALL}"),
    ("attainment_tpot", f"SELECT run_id, attainment_tpot FROM slo_attainment WHERE {_OVERALL}"),
    ("attainment_e2e", f"SELECT run_id, attainment_e2e FROM slo_attainment WHERE {_OVERALL}"),
    ("attainment_stall", f"SELECT run_id, attainment_stall FROM slo_attainment WHERE {_OVERALL}"),
    *(
        (f"{m}_{q}", f"SELECT run_id, {q} FROM latency_summary WHERE {_OVERALL} AND metric = '{m}_s'")
        for m in ("ttft", "tpot", "e2e")
        for q in ("mean", "p50", "p90", "p99", "p999")
    ),
    ("queue_p99", f"SELECT run_id, p99 FROM latency_summary WHERE {_OVERALL} AND metric = 'queue_s'"),
    ("duration_s", f"SELECT run_id, duration_s FROM goodput WHERE {_OVERALL}"),
    ("request_throughput_rps", f"SELECT run_id, request_throughput_rps FROM goodput WHERE {_OVERALL}"),
    ("output_throughput_tps", f"SELECT run_id, output_throughput_tps FROM goodput WHERE {_OVERALL}"),
    ("total_token_throughput_tps", f"SELECT run_id, total_token_throughput_tps FROM goodput WHERE {_OVERALL}"),
    ("goodput_rps", f"SELECT run_id, goodput_rps FROM goodput WHERE {_OVERALL}"),
    ("goodput_rps_per_gpu", f"SELECT run_id, goodput_rps_per_gpu FROM goodput WHERE {_OVERALL}"),
    ("preemptions", f"SELECT run_id, preemptions FROM slo_attainment WHERE {_OVERALL}"),
    ("mean_batch_requests", f"SELECT run_id, mean_batch_requests FROM resource_summary WHERE {_OVERALL}"),
    ("mean_kv_util", f"SELECT run_id, mean_kv_util FROM resource_summary WHERE {_OVERALL}"),
    ("jain_service", "SELECT run_id, jain_service FROM fairness"),
    ("worst_tenant_attainment", "SELECT run_id, worst_tenant_attainment FROM fairness"),
    ("max_wait_s", "SELECT run_id, max_wait_s FROM fairness"),
)


def run_metrics(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Long table (run_id, metric, value) over every run, including attainment per tier."""
    parts = [
        f"SELECT run_id, '{label}' AS metric, {i} AS ord, CAST(v AS DOUBLE) AS value FROM ({sql}) AS t(run_id, v)"
        for i, (label, sql) in enumerate(METRICS)
    ]
    n = len(METRICS)
    parts.append(
        f"SELECT run_id, 'attainment[tier=' || coalesce(name, 'NULL') || ']', {n}, attainment FROM slo_attainment WHERE scope = 'tier'"
    )
    sql = " UNION ALL ".join(parts) + " ORDER BY ord, metric, run_id"
    return con.sql(f"SELECT run_id, metric, value FROM ({sql})").to_arrow_table()


def compare_table(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> pa.Table:
    """One row per metric; a column per run; ``delta``/``pct`` columns of each later run against the first."""
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
        cols[f"pct {rid}"] = pcts
    schema = pa.schema([("metric", pa.string())] + [(k, pa.float64()) for k in cols if k != "metric"])
    return pa.table(cols, schema=schema)
