"""The platform scenarios of docs/platform.md, scored with the SQL views: who pays for whom.

    .venv/bin/python bench/bench_platform.py [--out DIR]

Replays each scenario (seeded traces built with numpy, a linear runner sized so the bursts
overload one replica), writes the run directories under DIR (a temporary one by default) and
prints markdown tables: per-tenant / per-tier attainment and TTFT, Jain's index, the latency each
tier imposes on the others (each tier removed in turn), quotas, and failures with and without the
journal.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from servelab.api import EngineConfig, ReplayConfig, replay, write_run
from servelab.runners.base import make_runner
from servelab.scoring import SloTable, connect

RUNNER = "linear:base=0.02,decode_seq=0.001,prefill_token=0.0001"  # ~15.5 requests/s of 200 + 10..30 tokens


def trace_table(arrivals, prompts, outputs, **extra) -> pa.Table:
    order = np.argsort(np.asarray(arrivals), kind="stable")
    n = len(order)
    cols = {
        "request_id": pa.array(range(n), pa.int64()),
        "arrival_s": pa.array(np.asarray(arrivals, dtype=float)[order]),
        "prompt_tokens": pa.array(np.asarray(prompts)[order], pa.int32()),
        "output_tokens": pa.array(np.asarray(outputs)[order], pa.int32()),
    }
    for name, values in extra.items():
        cols[name] = pa.array(np.asarray(values)[order].tolist())
    return pa.table(cols)


def poisson(rate_rps, start_s, end_s, rng):
    return np.sort(rng.uniform(start_s, end_s, rng.poisson(rate_rps * (end_s - start_s))))


def noisy_neighbour(burst: bool, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    a = poisson(2.0, 0.0, 120.0, rng)
    b = poisson(50.0, 30.0, 90.0, rng) if burst else np.array([])
    n = len(a) + len(b)
    return trace_table(np.concatenate([a, b]), [200] * n, [20] * n, tenant=["a"] * len(a) + ["b"] * len(b))


def overload(seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    arrivals = poisson(30.0, 0.0, 60.0, rng)
    n = len(arrivals)
    tiers = rng.choice(["priority", "standard", "flex"], size=n, p=[0.25, 0.6, 0.15])
    return trace_table(arrivals, [200] * n, rng.integers(10, 31, n), tier=tiers)


def run_to(out: Path, name: str, trace: pa.Table, policy="sarathi", params=None, **engine) -> Path:
    engine.setdefault("num_gpu_blocks", 100_000)
    engine.setdefault("max_num_seqs", 16)
    cfg = ReplayConfig(engine=EngineConfig(**engine), policy=policy, policy_params=params or {}, runner=RUNNER)
    result = replay(trace, cfg, runner=make_runner(RUNNER), trace_meta={"name": name})
    return write_run(result, out / name)


def table(con, sql: str) -> str:
    rel = con.sql(sql)
    rows = rel.fetchall()
    head = "| " + " | ".join(rel.columns) + " |\n|" + "---|" * len(rel.columns) + "\n"
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    return head + "".join("| " + " | ".join(fmt(v) for v in row) + " |\n" for row in rows)


def noisy_neighbour_report(out: Path) -> str:
    runs = [run_to(out, f"nn-{p}-{'burst' if b else 'alone'}", noisy_neighbour(b), p)
            for p in ("sarathi", "vtc", "drr") for b in (False, True)]
    con = connect(runs, slo=SloTable.parse_cli(["ttft=1"]))
    text = "Tenant a during b's burst (arrivals 30-90 s), TTFT SLO 1 s:\n\n" + table(con, """
        SELECT run_id, tenant, count(*) AS requests,
               round(avg(CASE WHEN met_all THEN 1 ELSE 0 END), 3) AS attainment,
               round(quantile_cont(ttft_s, 0.5), 3) AS ttft_p50_s, round(quantile_cont(ttft_s, 0.99), 3) AS ttft_p99_s
        FROM request_metrics WHERE arrival_s >= 30 AND arrival_s < 90
        GROUP BY run_id, tenant ORDER BY run_id, tenant""")
    text += "\nWhole runs (fairness view):\n\n" + table(con, """
        SELECT run_id, round(jain_attainment, 3) AS jain_attainment, worst_tenant,
               round(worst_tenant_attainment, 3) AS worst_tenant_attainment, round(max_wait_s, 2) AS max_wait_s
        FROM fairness ORDER BY run_id""")
    return text


def tiers_report(out: Path) -> str:
    trace = overload()
    runs = [run_to(out, "tiers-fcfs", trace)]
    for preempt in (False, True):
        runs.append(run_to(out, f"tiers-preempt-{'on' if preempt else 'off'}", trace, "tiers",
                           {"max_wait_s": 20, "preempt": preempt}))
    con = connect(runs, slo=SloTable.parse_cli(["tier=priority:ttft=0.4", "tier=standard:ttft=2",
                                                "tier=flex:ttft=30"]))
    text = "Arrivals at 2x capacity (25% priority, 60% standard, 15% flex); SLO TTFT 0.4 / 2 / 30 s:\n\n"
    text += table(con, """
        SELECT run_id, tier, count(*) AS requests, round(avg(CASE WHEN met_all THEN 1 ELSE 0 END), 3) AS attainment,
               round(quantile_cont(ttft_s, 0.99), 2) AS ttft_p99_s, round(max(wait_s), 2) AS max_wait_s,
               sum(num_preemptions) AS preemptions
        FROM request_metrics GROUP BY run_id, tier
        ORDER BY run_id, CASE tier WHEN 'priority' THEN 0 WHEN 'standard' THEN 1 ELSE 2 END""")
    # who pays for whom: remove each tier in turn and see the others' TTFT move
    cost_runs = [runs[2]]
    tiers_col = trace.column("tier").to_pylist()
    for tier in ("priority", "standard", "flex"):
        keep = pa.array([t != tier for t in tiers_col])
        cost_runs.append(run_to(out, f"tiers-without-{tier}", trace.filter(keep), "tiers",
                                {"max_wait_s": 20, "preempt": True}))
    con = connect(cost_runs)
    text += "\nLatency each tier imposes on the others (preempt on): p99 TTFT with it minus without it:\n\n"
    text += table(con, """
        WITH p AS (SELECT run_id, tier, quantile_cont(ttft_s, 0.99) AS p99 FROM request_metrics GROUP BY run_id, tier)
        SELECT replace(w.run_id, 'tiers-without-', '') AS removed_tier, w.tier AS affected_tier,
               round(f.p99, 3) AS p99_with_s, round(w.p99, 3) AS p99_without_s, round(f.p99 - w.p99, 3) AS cost_s
        FROM p w JOIN p f ON f.run_id = 'tiers-preempt-on' AND f.tier = w.tier
        WHERE w.run_id LIKE 'tiers-without-%' ORDER BY removed_tier, affected_tier""")
    return text


def quota_report(out: Path) -> str:
    n = 120
    arrivals = [float(t) for t in range(n) for _ in (0, 1)]
    trace = trace_table(arrivals, [100] * (2 * n), [50] * (2 * n), tenant=["a", "b"] * n)
    runs = [run_to(out, "quota-none", trace),
            run_to(out, "quota-a-4500tpm", trace, quota=("tenant=a:tpm=4500",)),
            run_to(out, "quota-a-4500tpm-retry", trace, quota=("tenant=a:tpm=4500",), retries=3,
                   retry_backoff_s=2.0)]
    con = connect(runs, slo=SloTable.parse_cli(["ttft=5"]))
    return "Tenants a and b each send one 150-token request per second for 120 s; a's quota is 4,500 tokens/min:\n\n" \
        + table(con, """
        SELECT run_id, tenant, count(*) AS requests, count(*) FILTER (WHERE status = 'finished') AS finished,
               count(*) FILTER (WHERE status = 'throttled') AS throttled, sum(num_retries) AS retries,
               round(avg(CASE WHEN met_all THEN 1 ELSE 0 END), 3) AS attainment,
               round(quantile_cont(ttft_s, 0.99), 2) AS ttft_p99_s
        FROM request_metrics GROUP BY run_id, tenant ORDER BY run_id, tenant""")


def fault_report(out: Path) -> str:
    rng = np.random.default_rng(3)
    arrivals = poisson(8.0, 0.0, 60.0, rng)
    n = len(arrivals)
    trace = trace_table(arrivals, [200] * n, rng.integers(50, 400, n))
    runs = [run_to(out, "fault-none", trace, replicas=2, max_num_seqs=32)]
    for journal in (True, False):
        runs.append(run_to(out, f"fault-journal-{'on' if journal else 'off'}", trace, replicas=2, max_num_seqs=32,
                           fail=("replica=0,at=30,for=10",), journal=journal))
    con = connect(runs)
    text = "8 req/s for 60 s on 2 replicas; replica 0 down from 30 s to 40 s:\n\n" + table(con, """
        SELECT run_id, count(*) FILTER (WHERE num_resumes > 0 OR tokens_lost > 0) AS interrupted,
               sum(tokens_lost) AS tokens_generated_twice, sum(recomputed_tokens) AS kv_tokens_recomputed,
               round(quantile_cont(e2e_s, 0.5), 2) AS e2e_p50_s, round(quantile_cont(e2e_s, 0.99), 2) AS e2e_p99_s,
               round(max(e2e_s), 2) AS e2e_max_s
        FROM requests GROUP BY run_id ORDER BY run_id""")
    text += "\nThe interrupted requests only:\n\n" + table(con, """
        SELECT run_id, count(*) AS requests, round(avg(e2e_s), 2) AS e2e_mean_s, round(max(e2e_s), 2) AS e2e_max_s,
               round(avg(max_itl_s), 2) AS max_itl_mean_s
        FROM requests WHERE num_resumes > 0 OR tokens_lost > 0 GROUP BY run_id ORDER BY run_id""")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for the run directories (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for title, report in (("Noisy neighbour", noisy_neighbour_report), ("Tiers under overload", tiers_report),
                              ("Quotas", quota_report), ("Failures and the journal", fault_report)):
            print(f"### {title}\n\n{report(out)}")


if __name__ == "__main__":
    main()
