"""The readable run summary: attainment, latency percentiles, goodput, throughput, counts, resources.

`report_data` gathers it from the views as plain dicts; `report_text` renders it (also used by
`servelab replay` and `demo` after a replay).
"""

from __future__ import annotations

import io
import os
from typing import Any

import duckdb
from rich import box
from rich.console import Console
from rich.table import Table
from servelab.common.tables import available_width, escape_controls, fit_table, print_table
from servelab.scoring.compare import server_time_scale
from servelab.scoring.db import connect
# (their home was here: scoring/lengths.py holds them now, light to import for `servelab search`'s summary)
from servelab.scoring.lengths import LENGTH_RANKED, output_length_knowledge, output_length_note  # noqa: F401
from servelab.scoring.slo import SloTable, as_slo_table, recorded_slo
from servelab.scoring.views import LIVE_STATUSES

REPORT_METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s")
MAX_TENANT_ROWS = 20


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[dict[str, Any]]:
    rel = con.execute(sql, params or [])
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r)) for r in rel.fetchall()]


# Overload: the signs that a run was offered more than it could serve (docs/metrics.md "Overload").
# request_metrics holds the requests the run was offered (arriving by its end), so a horizon's
# quarters are of the replayed arrivals. Waits are medians of `wait_s` (queue time, or time until the
# run ended for a request never scheduled); a request's service time is its e2e minus its queue time.
# The queue at a time t: the requests arrived by t and still waiting for their first schedule (one never
# scheduled waits to the end and beyond).
_OVERLOAD = """
WITH m AS (SELECT *, CASE WHEN first_scheduled_s IS NULL AND status = 'unfinished' THEN 'infinity'::DOUBLE
                          ELSE arrival_s + coalesce(wait_s, 0.0) END AS left_queue_s
           FROM request_metrics WHERE run_id = ?),
     span AS (SELECT min(arrival_s) AS a0, max(arrival_s) AS a1, min(arrival_s) + 0.75 * (max(arrival_s) - min(arrival_s)) AS a3
              FROM m)
SELECT quantile_cont(wait_s, 0.5) AS wait_p50_s,
       quantile_cont(e2e_s - queue_s, 0.5) FILTER (WHERE finished) AS service_p50_s,
       quantile_cont(wait_s, 0.5) FILTER (WHERE arrival_s <= a0 + 0.25 * (a1 - a0)) AS wait_first_quarter_s,
       quantile_cont(wait_s, 0.5) FILTER (WHERE arrival_s >= a1 - 0.25 * (a1 - a0)) AS wait_last_quarter_s,
       max(wait_s) AS max_wait_s,
       count(*) FILTER (WHERE arrival_s <= a3) AS arrived_three_quarters,
       count(*) FILTER (WHERE arrival_s <= a3 AND left_queue_s > a3) AS queued_three_quarters,
       count(*) AS arrived_last,
       count(*) FILTER (WHERE left_queue_s > a1) AS queued_last,
       count(*) FILTER (WHERE status IN ('aborted', 'timeout')) AS gave_up
FROM m, span
"""
RATE_RATIO = 1.2  # offered / served at or above this, while requests wait at least their service time
GROWTH_RATIO = 3.0  # the last quarter's median wait >= this x the first quarter's ...
GROWTH_SERVICES = 2.0  # ... and >= this many median service times
DWARF_RATIO = 10.0  # the median wait >= this many median service times
BACKLOG_SHARE = 0.2  # still waiting at 3/4 of the arrival window and at the last arrival: this share of arrivals ...
BACKLOG_MIN = 10  # ... and at least this many requests at the last arrival
GAVE_UP_SHARE = 0.1  # aborted at the client timeout (or timed out, live): this share of the requests


def _backlog(row: dict) -> str | None:
    """The waiting queue kept growing while requests arrived: at 3/4 of the arrival window and at the last
    arrival, ``BACKLOG_SHARE`` of the arrivals so far still waited for their first schedule, and more at
    the end than at 3/4. Service times that balloon under full batches hide this from the wait signs;
    a short trace whose tail is one long request has no queue at all, so it is not called overloaded."""
    q3, n3, q1, n1 = (row[k] for k in ("queued_three_quarters", "arrived_three_quarters", "queued_last", "arrived_last"))
    if not n3 or q1 < BACKLOG_MIN or q1 <= q3 or q3 < BACKLOG_SHARE * n3 or q1 < BACKLOG_SHARE * n1:
        return None
    return (f"the queue kept growing while requests arrived: {q3:,} of the first {n3:,} arrivals still waited at "
            f"three quarters of the arrival window, {q1:,} of {n1:,} at the last arrival")


def _gave_up(row: dict) -> str | None:
    """Requests abandoned at the client timeout: a server that answers in time loses none."""
    n, gave_up = row["arrived_last"], row["gave_up"]
    if not n or gave_up < GAVE_UP_SHARE * n:
        return None
    return f"{gave_up:,} of {n:,} requests ({gave_up / n:.0%}) gave up at the client timeout"


def overload(con: duckdb.DuckDBPyConnection, run_id: str, goodput_row: dict | None) -> dict[str, Any]:
    """Whether the run was overloaded, and why: ``{"overloaded": bool, "reasons": [...], figures}``.

    Five signs, any one enough: the offered rate exceeds the served rate by ``RATE_RATIO`` while
    the median wait is at least the median service time (without waiting, a lower served rate is only
    a short trace's tail); the queue grows (late arrivals wait ``GROWTH_RATIO`` times longer than early
    ones, and at least ``GROWTH_SERVICES`` service times); the median wait is ``DWARF_RATIO`` service
    times or more; a backlog builds up while requests arrive (``_backlog``); many requests give up at the
    client timeout (``_gave_up``). A run without queue times (a live run) is judged by the rates and
    timeouts alone, the rates at 1.5x.
    """
    row = _rows(con, _OVERLOAD, [run_id])[0]
    g = goodput_row or {}
    offered, served = g.get("offered_rate_rps"), g.get("request_throughput_rps")
    wait, service = row["wait_p50_s"], row["service_p50_s"]
    early, late = row["wait_first_quarter_s"], row["wait_last_quarter_s"]
    reasons = []
    timed = wait is not None and service is not None
    if offered and served is not None and offered >= RATE_RATIO * served and (
            wait >= service if timed else offered >= 1.5 * served):
        reasons.append(f"offered {offered:,.1f} req/s but served {served:,.1f} req/s")
    if timed and early is not None and late is not None and late >= GROWTH_RATIO * early \
            and late >= GROWTH_SERVICES * service and late > 0:
        reasons.append(f"the queue grew: the median wait was {_ms_text(early)} for the first quarter of arrivals "
                       f"and {_ms_text(late)} for the last")
    if timed and service > 0 and wait >= DWARF_RATIO * service:
        reasons.append(f"the median wait {_ms_text(wait)} is {wait / service:,.0f}x the median service time "
                       f"{_ms_text(service)}")
    reasons += [r for r in (_backlog(row), _gave_up(row)) if r]
    return {"overloaded": bool(reasons), "reasons": reasons, "offered_rate_rps": offered, "served_rate_rps": served,
            **row}


_PER_REPLICA = """
WITH req AS (SELECT replica, count(*) AS requests FROM requests WHERE run_id = $1 AND replica IS NOT NULL GROUP BY replica),
     busy AS (SELECT replica, sum(duration_s) AS busy_s FROM steps WHERE run_id = $1 GROUP BY replica)
SELECT replica, coalesce(req.requests, 0) AS requests, coalesce(busy.busy_s, 0.0) AS busy_s
FROM req FULL OUTER JOIN busy USING (replica) ORDER BY replica
"""


def cluster_pools(run: dict) -> list[dict]:
    """The pools of a cluster run (run.json's ``cluster.pools``), or [] for a run of one engine config."""
    import json

    raw = run.get("cluster_pools")
    try:
        pools = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return []
    return [p for p in pools or [] if isinstance(p, dict)]


def pool_balance(con: duckdb.DuckDBPyConnection, run_id: str, pools: list[dict]) -> list[dict]:
    """Replica balance within each pool (a prefill replica is never compared with a decode one):
    replicas, requests min..max (pools whose replicas record requests), busy max/mean, Jain's index of busy time."""
    per = {r["replica"]: r for r in _rows(con, _PER_REPLICA, [run_id])}
    out = []
    for p in pools:
        rows = [per.get(i, {"requests": 0, "busy_s": 0.0}) for i in p.get("replicas") or []]
        if not rows:
            continue
        busy = [float(r["busy_s"]) for r in rows]
        requests = [int(r["requests"]) for r in rows]
        mean = sum(busy) / len(busy)
        squares = sum(b * b for b in busy)
        out.append({
            "pool": p.get("name"), "role": p.get("role"), "replicas": len(rows),
            "min_requests": min(requests) if any(requests) else None,
            "max_requests": max(requests) if any(requests) else None,
            "busy_max_over_mean": max(busy) / mean if mean else None,
            "jain_busy": sum(busy) ** 2 / (len(busy) * squares) if squares else None,
        })  # fmt: skip
    return out


def report_data(con: duckdb.DuckDBPyConnection, run_id: str, slo_source: str | None = None) -> dict[str, Any]:
    """Everything the report shows for one run, as plain Python values (JSON-serialisable).

    ``slo_source`` says where the connection's SLO came from ("given", "the SLO recorded in
    run.json", ...), for the header."""
    run = _rows(con, "SELECT * FROM runs WHERE run_id = ?", [run_id])
    if not run:
        from servelab.common.errors import ServelabError

        raise ServelabError(f"no run '{run_id}'")
    attainment = _rows(con, "SELECT * FROM slo_attainment WHERE run_id = ?", [run_id])
    latency = _rows(
        con,
        "SELECT * FROM latency_summary WHERE run_id = ? AND scope <> 'tenant' AND metric IN ({})".format(
            ", ".join(f"'{m}'" for m in REPORT_METRICS)
        ),
        [run_id],
    )
    goodput = _rows(con, "SELECT * FROM goodput WHERE run_id = ?", [run_id])
    span = _rows(con, "SELECT * FROM run_span WHERE run_id = ?", [run_id])
    resources = _rows(con, "SELECT * FROM resource_summary WHERE run_id = ? AND scope = 'overall'", [run_id])
    balance = _rows(con, "SELECT * FROM replica_balance WHERE run_id = ?", [run_id])
    fairness = _rows(con, "SELECT * FROM fairness WHERE run_id = ?", [run_id])
    cost = _rows(con, "SELECT * FROM cost WHERE run_id = ? AND scope <> 'gpu'", [run_id])
    slo = _rows(con, "SELECT * FROM slo_table ORDER BY scope, name")
    views = {row[0] for row in con.execute("SELECT view_name FROM duckdb_views()").fetchall()}
    cache = _rows(con, "SELECT * FROM prefix_cache WHERE run_id = ? AND scope = 'overall'", [run_id]) \
        if "prefix_cache" in views else []
    tiers = _rows(con, "SELECT * FROM kv_tiers WHERE run_id = ? AND scope = 'overall'", [run_id]) \
        if "kv_tiers" in views else []
    breakdown = _rows(con, "SELECT * FROM ttft_breakdown WHERE run_id = ? AND scope = 'overall'", [run_id]) \
        if "ttft_breakdown" in views else []
    tasks = _rows(con, "SELECT * FROM task_summary WHERE run_id = ? AND scope = 'overall'", [run_id]) \
        if "task_summary" in views else []
    spec = _rows(con, "SELECT * FROM spec_decode WHERE run_id = ? AND scope = 'overall'", [run_id]) \
        if "spec_decode" in views else []
    return {
        "run": run[0],
        "slo": slo,
        "slo_source": (slo_source or "given") if slo else None,
        "attainment": attainment,
        "latency": latency,
        "goodput": goodput,
        "span": span[0] if span else None,
        "resources": resources[0] if resources else None,
        "replica_balance": balance[0] if balance else None,
        "fairness": fairness[0] if fairness else None,
        "prefix_cache": cache[0] if cache and cache[0]["cached_tokens"] else None,
        "kv_tiers": tiers,
        "ttft_breakdown": breakdown[0] if breakdown else None,
        "tasks": tasks[0] if tasks else None,
        "spec_decode": spec[0] if spec else None,
        "cost": cost,
        "pool_balance": pool_balance(con, run_id, cluster_pools(run[0])),
        "overload": overload(con, run_id, next((g for g in goodput if g["scope"] == "overall"), None)),
    }


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ms(value: float | None) -> str:
    """Seconds shown as milliseconds, the report's one latency unit."""
    return "-" if value is None else f"{value * 1e3:.1f}"


def _ms_text(value: float | None) -> str:
    """Milliseconds for a line of prose: thousands separated, the unit written."""
    return "-" if value is None else f"{value * 1e3:,.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _label(row: dict) -> str:
    return "overall" if row["scope"] == "overall" else f"{row['scope']}={row['name']}"


def _slo_line(slo_rows: list[dict], source: str | None = None) -> str:
    parts = []
    for r in slo_rows:
        fields = ", ".join(f"{k}={r[k]:g}" for k in ("ttft_s", "tpot_s", "e2e_s", "max_stall_s", "task_s")
                           if r.get(k) is not None)
        parts.append(f"{r['scope']}{'=' + r['name'] if r['name'] else ''}: {fields}")
    if not parts:
        return "none given or recorded, so no attainment: 'finished' below is the share of requests that finished"
    said = {"given": "given with --slo/--slo-file"}.get(source or "given", source)
    return "; ".join(parts) + f" ({said})"


_ATTAINMENT_COLUMNS = ("requests", "finished", "unfin.", "refused", "joint", "ttft", "tpot", "e2e", "stall",
                       "goodput req/s", "done req/s")  # fmt: skip


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                 show_edge=False)


def _group_column(t: Table, rows: list[dict], fold: bool = True) -> None:
    """Group labels stay on one line up to the longest built-in one; longer tenant names fold rather than push
    every number off the screen (print_table never cuts them)."""
    if not fold:
        t.add_column("group", justify="left", no_wrap=True)
        return
    longest = max((len(_label(r)) for r in rows if r["scope"] != "tenant"), default=7)
    t.add_column("group", justify="left", overflow="fold", min_width=longest)


def _print(t: Table, console: Console) -> None:
    print_table(t, console, width=console.width)
    console.print()


def render(data: dict[str, Any], console: Console) -> None:
    run = data["run"]
    console.print(f"[bold]run {run['run_id']}[/bold]  ({run.get('run_path', '')})")
    line = []
    pools = cluster_pools(run)
    keys = [("trace_name", "trace")]
    if not pools:  # a cluster names these per pool, below
        keys += [("config_model", "model"), ("config_gpu", "GPU"), ("config_tp", "TP"), ("policy_name", "policy"),
                 ("runner_name", "runner")]
    for key, label in keys:
        if run.get(key) is not None:
            line.append(f"{label} {run[key]}")
    if pools:
        line.append(f"replicas {sum(len(p.get('replicas') or []) for p in pools)}, GPUs {run['num_gpus']}")
    elif run.get("engine_replicas") is not None:
        line.append(f"replicas {run['engine_replicas']}, GPUs {run['num_gpus']}")
    if run.get("simulated_span_s") is not None:
        line.append(f"simulated {run['simulated_span_s']:.1f} s")
    if line:
        console.print("  ".join(line))
    scale = server_time_scale(run)
    if scale is not None:  # a live run against `servelab serve --time-scale K`: two clocks in one run
        console.print(f"times are the client's wall-clock seconds; the server simulated {scale:g} s per wall second "
                      f"(servelab serve --time-scale {scale:g}): multiply by {scale:g} for simulated seconds, the unit "
                      "of its metrics (server_metrics)")
    for p in pools:
        n = len(p.get("replicas") or [])
        start = p.get("initial_replicas")
        count = f"{n} replica{'' if n == 1 else 's'}" + (f" (from {start})" if start not in (None, n) else "")
        parts = [f"{label} {p[key]}" for key, label in (("model", "model"), ("gpu", "GPU"), ("tp", "TP"),
                                                         ("policy", "policy"), ("runner", "runner")) if p.get(key)]
        console.print(f"pool {p.get('name')} ({p.get('role')}): {count}, " + "  ".join(parts))
    params = {k.removeprefix("policy_"): v for k, v in run.items() if k.startswith("policy_") and k != "policy_name"}
    note = output_length_note(run.get("policy_name"), params)
    if note:
        console.print(f"policy {run.get('policy_name')}: {note}")
    # plain text: the source may name "the [slo] table in FILE", which rich would read as markup
    console.print(f"SLO: {_slo_line(data['slo'], data.get('slo_source'))}", markup=False)
    over = data.get("overload") or {}
    if over.get("overloaded"):  # latencies then measure the backlog, not the server
        console.print("OVERLOADED: " + "; ".join(over["reasons"]) + ". The latencies below are mostly queueing; "
                      "lower the rate or add replicas.")
    overall = next(r for r in data["attainment"] if r["scope"] == "overall")
    refused = overall["rejected"] + overall["throttled"] + overall["dropped"]
    live = sum(overall.get(s) or 0 for s in LIVE_STATUSES)  # a live run's failed, timed-out, cancelled requests
    skipped = overall.get("skipped") or 0  # dependent requests never sent (replay/core/depends.py)
    console.print(
        f"requests {overall['requests']}: {overall['finished']} finished, {overall['unfinished']} unfinished, "
        f"{overall['rejected']} rejected, {overall['throttled']} throttled, {overall['dropped']} dropped"
        + ("".join(f", {overall[s]} {s}" for s in LIVE_STATUSES) if live else "")
        + (f", {skipped} skipped" if skipped else "")
        + (" (all not finished count as SLO misses)" if refused + overall["unfinished"] + live + skipped else "")
    )
    late = (data.get("span") or {}).get("after_horizon") or 0
    if late:  # a horizon stopped the run first: those requests were never offered
        console.print(f"{late} more requests of the trace arrive after the run's end "
                      f"({data['span']['end_s']:,.2f} s) and are not counted: never offered, so neither "
                      "unfinished nor SLO misses")
    if run.get("stopped_by") or run.get("not_sent"):  # a live run stopped early: say so, and what was never sent
        why = f"stopped by {run.get('stopped_by') or 'its end'}" + (f" ({run['signal']})" if run.get("signal") else "")
        console.print(why + (f": {run['not_sent']} requests of the trace never sent (not counted above)"
                             if run.get("not_sent") else ""))
    console.print(
        f"preemptions {overall['preemptions']} ({overall['preempted_requests']} requests)"
    )
    cache = data.get("prefix_cache")
    if cache:  # only when the prefix cache served anything
        console.print(f"prefix cache: {cache['cached_tokens']:,} of {cache['prompt_tokens']:,} prompt tokens "
                      f"served from cache ({_pct(cache['hit_rate'])}), {_pct(cache['requests_with_hit'])} of requests hit")
        ideal = run.get("trace_prefix_reuse_share")
        if isinstance(ideal, (int, float)) and cache["hit_rate"] is not None and cache["hit_rate"] > ideal + 5e-4:
            console.print(
                f"  that is above the trace's ideal reuse of {_pct(ideal)} (what an unlimited cache serves to first "
                f"admissions): requests re-admitted after a preemption ({overall['preempted_requests']} here) hit "
                "their own blocks again, as in vLLM")
        elif ideal is None and cache["cached_tokens_preempted"] == cache["cached_tokens"]:
            # no reuse figure (a trace without prefix hashes shares no prefix): every hit is a re-admission's
            console.print(
                f"  all of them on requests re-admitted after a preemption ({overall['preempted_requests']} here), which "
                "hit their own blocks again, as in vLLM")
    if data.get("kv_tiers"):  # with offload tiers: what each served, and where TTFT went
        console.print("  by tier: " + ", ".join(f"{r['tier']} {r['cached_tokens']:,} ({_pct(r['hit_rate'])})"
                                               for r in data["kv_tiers"]))
        b = data.get("ttft_breakdown")
        if b:
            console.print(f"  mean TTFT {_ms(b['mean_ttft_s'])} ms = queue {_ms(b['mean_queue_s'])} + KV load "
                          f"{_ms(b['mean_load_s'])} + compute {_ms(b['mean_compute_s'])} ms")
    spec = data.get("spec_decode")
    if spec:  # speculative decoding (vLLM's spec-decode metrics)
        console.print(f"speculative decoding: {spec['num_accepted_tokens']:,} of {spec['num_draft_tokens']:,} draft tokens "
                      f"accepted ({_pct(spec['acceptance_rate'])}), mean acceptance length "
                      f"{spec['mean_acceptance_length']:.2f} tokens per step over {spec['num_drafts']:,} drafts")
    console.print()

    goodput = {(_label(r)): r for r in data["goodput"]}
    rows = data["attainment"]
    tenant_rows = [r for r in rows if r["scope"] == "tenant"]
    shown = [r for r in rows if r["scope"] != "tenant"]
    hidden = 0
    if len(tenant_rows) > MAX_TENANT_ROWS:  # the worst tenants matter most
        hidden = len(tenant_rows) - MAX_TENANT_ROWS
        tenant_rows = sorted(tenant_rows, key=lambda r: (r["attainment"], str(r["name"])))[:MAX_TENANT_ROWS]
    # every request in one count column: statuses beyond finished/unfinished/refused (aborted, a live run's
    # failed..., skipped) get one more, named after the status when only one occurs
    others = [s for s in (*LIVE_STATUSES, "skipped") if overall.get(s)]
    cells = []
    for r in shown + tenant_rows:
        g = goodput.get(_label(r), {})
        refused_r = r["rejected"] + r["throttled"] + r["dropped"]
        counts = [str(r["requests"]), str(r["finished"]), str(r["unfinished"]), str(refused_r)]
        if others:
            counts.append(str(r["requests"] - r["finished"] - r["unfinished"] - refused_r))
        cells.append((
            *counts, _pct(r["attainment"]),
            _pct(r["attainment_ttft"]), _pct(r["attainment_tpot"]), _pct(r["attainment_e2e"]),
            _pct(r["attainment_stall"]), _f(g.get("goodput_rps")), _f(g.get("request_throughput_rps")),
        ))  # fmt: skip
    labels = [_label(r) for r in shown + tenant_rows]

    names = list(_ATTAINMENT_COLUMNS)
    if others:
        names.insert(4, others[0] if len(others) == 1 else "other")
    rates = 5 if others else 4  # the count columns come first
    if data["slo"]:
        title, every = "SLO attainment (joint and per SLO) and goodput", list(range(len(names)))
    else:  # no SLO: the share finished, never shown as an attainment, and no goodput
        names[rates] = "finished %"
        title, every = "Requests finished (no SLO given: no attainment, no goodput)", [*range(rates + 1), len(names) - 1]
    if len(others) > 1:
        console.print("the count column 'other' holds the requests " + ", ".join(others))

    def table(title: str, columns: list[int], fold: bool = True) -> Table:
        t = _table(title)
        _group_column(t, rows, fold)
        for i in columns:
            t.add_column(names[i], justify="right", no_wrap=True)
        for label, row in zip(labels, cells):
            t.add_row(label, *(row[i] for i in columns))
        return t

    if fit_table(table(title, every, fold=False), console.width, console) <= console.width:
        _print(table(title, every), console)
    else:  # too narrow for one table: counts, then attainment and rates (no name or number is cut)
        _print(table("Requests", every[:rates]), console)
        _print(table(title, every[rates:]), console)
    if hidden:
        console.print(f"({hidden} more tenants with higher attainment: servelab query ... \"SELECT * FROM slo_attainment\")")

    t = _table("Latency of finished requests (ms)")
    _group_column(t, data["latency"])
    for col in ("metric", "n", "mean", "p50", "p90", "p99", "p99.9", "max"):
        t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    order = {m: i for i, m in enumerate(REPORT_METRICS)}
    for r in sorted(data["latency"], key=lambda r: (r["scope"] != "overall", str(r["name"]), order[r["metric"]])):
        t.add_row(_label(r), r["metric"].removesuffix("_s"), str(r["n"]), _ms(r["mean"]), _ms(r["p50"]), _ms(r["p90"]),
                  _ms(r["p99"]), _ms(r["p999"]), _ms(r["max"]))  # fmt: skip
    _print(t, console)

    g = goodput["overall"]
    console.print(
        f"duration ({_duration_label(run, data.get('span'))}) {_f(g['duration_s'], 2)} s; throughput {_f(g['request_throughput_rps'])} req/s, "
        f"{_f(g['output_throughput_tps'], 1)} output tok/s, {_f(g['total_token_throughput_tps'], 1)} total tok/s; "
        + (f"goodput {_f(g['goodput_rps'])} req/s ({_f(g['goodput_rps_per_gpu'])} per GPU); " if data["slo"] else "")
        + f"offered rate {_f(g['offered_rate_rps'])} req/s"
    )
    _task_lines(data.get("tasks"), console)
    res = data["resources"]
    if res:
        console.print(
            f"resources: mean batch {_f(res['mean_batch_requests'], 2)} (max {res['max_batch_requests']}), "
            f"KV use mean {_pct(res['mean_kv_util'])} max {_pct(res['max_kv_util'])}, "
            f"queue mean {_f(res['mean_waiting'], 1)} max {res['max_waiting']}, busy {_f(res['busy_s'], 2)} s, "
            f"{res['iterations']} iterations"
        )
    _cost_lines(data.get("cost") or [], console, bool(data["slo"]))
    bal = data["replica_balance"]
    pool_bal = [b for b in data.get("pool_balance") or [] if b["replicas"] > 1]
    if data.get("pool_balance"):  # a cluster: balance within each pool, never across them
        if pool_bal:
            console.print("replica balance per pool: " + "; ".join(
                f"{b['pool']} {b['replicas']} replicas"
                + (f", requests {b['min_requests']}..{b['max_requests']}" if b["min_requests"] is not None else "")
                + f", busy max/mean {_f(b['busy_max_over_mean'])}, Jain (busy) {_f(b['jain_busy'])}" for b in pool_bal))
    elif bal and bal["replicas"] > 1:
        console.print(
            f"replica balance: {bal['replicas']} replicas, requests {bal['min_requests']}..{bal['max_requests']}, "
            f"busy max/mean {_f(bal['busy_max_over_mean'])}, Jain (busy) {_f(bal['jain_busy'])}"
        )
    fair = data["fairness"]
    if fair and fair["tenants"] > 1:
        console.print(
            f"fairness over {fair['tenants']} tenants: Jain service {_f(fair['jain_service'])}, "
            f"Jain attainment {_f(fair['jain_attainment'])}, worst tenant {fair['worst_tenant']} "
            f"({_pct(fair['worst_tenant_attainment'])}), longest wait {_ms_text(fair['max_wait_s'])} "
            f"({fair['longest_wait_tenant']})"
        )
    elif fair:
        console.print(f"longest wait of any request {_ms_text(fair['max_wait_s'])}")


# An imported benchmark's own duration, by its format (run.json source.format), named after its tool.
_SOURCE_TOOLS = {"vllm-bench": "vLLM", "sglang-bench": "SGLang"}


def _duration_label(run: dict, span: dict | None) -> str:
    """What the run's duration measures: an imported benchmark's own figure, or first arrival to the last finish
    (to the run's end when nothing finished, e.g. a short horizon)."""
    if run.get("source_duration_s") is not None:
        fmt = run.get("source_format")
        tool = _SOURCE_TOOLS.get(fmt, f"the {fmt} source" if fmt else "the source")
        return f"the benchmark's own, as {tool} computes throughput"
    if span is not None and span.get("duration_to_finish") is False:
        return "first arrival to the run's end: nothing finished"
    return "first arrival to last finish"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f} s"


def _task_lines(t: dict | None, console: Console) -> None:
    """Tasks (the ``task_summary`` view), for a run whose requests carry a session/task id."""
    if not t or not t["tasks"]:
        return
    console.print(
        f"tasks {t['tasks']}: {t['complete']} complete, {t['with_skipped']} with skipped requests "
        f"({t['skipped']} never sent), {t['with_failed']} with failed requests; job completion time p50 "
        f"{_seconds(t['jct_p50_s'])}, p90 {_seconds(t['jct_p90_s'])}, p99 {_seconds(t['jct_p99_s'])}, "
        f"max {_seconds(t['jct_max_s'])}"
    )
    if t["complete"] and not t["links"] and t["requests"] > t["tasks"]:  # (a run written without depends_on)
        console.print("  critical paths unknown: the run's requests.parquet records no dependencies (depends_on, "
                      f"think_s); reused {t['reused_tokens'] or 0:,} of {t['prompt_tokens'] or 0:,} prompt tokens "
                      f"({_pct(t['reuse_rate'])})")
    elif t["complete"]:
        console.print(
            f"  along the critical paths: LLM {_pct(t['cp_llm_share'])}, tool/think waits {_pct(t['cp_wait_share'])}, "
            f"queueing {_pct(t['cp_queue_share'])}, later first calls {_pct(t['cp_start_share'])}; reused "
            f"{t['reused_tokens'] or 0:,} of {t['prompt_tokens'] or 0:,} prompt tokens ({_pct(t['reuse_rate'])})"
        )
    if t["with_deadline"]:
        console.print(
            f"  task deadline met by {t['met_deadline']} of {t['with_deadline']} tasks "
            f"({_pct(t['deadline_attainment'])}; unfinished, failed and skipped tasks count as misses), "
            f"{_f(t['task_goodput_per_s'], 4)} tasks/s"
        )


def _cost_lines(rows: list[dict], console: Console, has_slo: bool = True) -> None:
    """Pools and cost (the ``cost`` view), for a run with several pools or a price."""
    pools = [r for r in rows if r["scope"] == "pool"]
    overall = next((r for r in rows if r["scope"] == "overall"), None)
    if overall is None or (len(pools) < 2 and overall["dollars"] is None):
        return
    parts = [f"{r['name']} ({r['role']}) {r['gpus']} GPU, {_f(r['gpu_s'] / 3600, 3)} GPU-h"
             + (f", ${_f(r['dollars'], 2)}" if r["dollars"] is not None else "") for r in pools]
    console.print("pools: " + "; ".join(parts))
    if overall["dollars"] is not None:
        console.print(
            f"cost: ${_f(overall['dollars'], 2)} for {_f(overall['gpu_s'] / 3600, 3)} GPU-h; "
            f"${_f(overall['dollars_per_million_output_tokens'], 3)} per million output tokens, "
            f"${_f(overall['dollars_per_request'], 5)} per finished request"
            + (f"; goodput {_f(overall['goodput_requests_per_dollar'], 1)} requests per $, "
               f"{_f(overall['goodput_rps_per_gpu'])} req/s per GPU" if has_slo else "")
        )


DEFAULT_WIDTH = 120


def render_text(con: duckdb.DuckDBPyConnection, run_ids: list[str] | None = None, width: int | None = None,
                slo_source: str | None = None) -> str:
    """The report as text, lines wrapped at ``width`` (None: ``COLUMNS`` or the terminal's, else 120).

    Tables never cut a name or a number: they wrap their headers to fit, and are printed wider when
    that is not enough.
    """
    if width is None:
        width = available_width() or DEFAULT_WIDTH
    if run_ids is None:
        run_ids = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None, highlight=False)
    for i, run_id in enumerate(run_ids):
        if i:
            console.print()
        render(report_data(con, run_id, slo_source), console)
    # prose lines name tenants too (worst tenant, longest wait): no control character reaches the terminal raw
    return escape_controls("\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n")


def report_text(
    run_dir: str | os.PathLike, slo: SloTable | list[str] | tuple[str, ...] | None = None, width: int | None = None,
    slo_source: str = "given",
) -> str:
    """The report of one run directory (or several, one after another) as plain text.

    ``slo`` is an SloTable or ``--slo`` strings such as ``("ttft=2,tpot=0.1",)`` (``slo_source`` says
    whence, for the header); without one, the SLO the runs recorded in run.json (if any), as
    `servelab report` does.
    """
    table, source = as_slo_table(slo), slo_source
    if table is None:
        table, source = recorded_slo(run_dir)
    con = connect(run_dir, table)
    try:
        return render_text(con, width=width, slo_source=source)
    finally:
        con.close()
