"""Score one replay result in memory with the scoring views (the SQL `servelab report` runs), on one reused DuckDB connection.

A search scores hundreds of runs; opening a connection and creating the views costs more than the
queries, so each worker process keeps one connection (scoring/memory.py) and swaps the run's Arrow
tables in. The numbers are those `servelab query` gives on the written run directory (a test checks it).

With ``quick`` (a search over a small trace) a run is scored by scoring/quick.py instead: numpy over
the Arrow columns, bit-equal to the DuckDB query, without its ~10 ms of planning; the connection is
then opened only for what numpy does not compute (the cost view, a run holding a NaN).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from servelab.common.kernels import call
from servelab.scoring import quick as quick_scoring
from servelab.scoring.slo import SloTable
from servelab.scoring.gpus import num_gpus as run_gpus

if TYPE_CHECKING:
    from servelab.scoring.memory import RunConnection

# One pass over `request_metrics` (the view holding every per-request definition: effective SLOs,
# met_* flags, TPOT): the same aggregates as slo_attainment, latency_summary (finished requests) and
# goodput, for the whole run and per tier, without binding three grouped views per trial.
_LAT = ", ".join(
    f"avg({m}_s) FILTER (WHERE finished) AS {m}_mean, "
    f"quantile_cont({m}_s, [0.5, 0.9, 0.99]) FILTER (WHERE finished) AS {m}_q"
    for m in ("ttft", "tpot", "e2e", "queue", "max_itl")
)
_SUMMARY_SQL = """
SELECT {select},
       count(*) AS requests,
       count(*) FILTER (WHERE finished) AS completed,
       count(*) FILTER (WHERE met_all) AS met_all,
       count(*) FILTER (WHERE met_all) / count(*) AS attainment,
       count(*) FILTER (WHERE met_ttft) / nullif(count(met_ttft), 0) AS attainment_ttft,
       count(*) FILTER (WHERE met_tpot) / nullif(count(met_tpot), 0) AS attainment_tpot,
       {lat}
FROM request_metrics
{group}
"""
# The run's span rides along on every row: a second query for it cost ~2-4 ms a trial, mostly
# DuckDB binding the views again (issue #31); the values are the same expressions either way.
_WITH_SPAN = """
SELECT q.*, sp.duration_s AS span_duration_s, sp.num_gpus AS span_num_gpus
FROM ({summary}) q LEFT JOIN (SELECT duration_s, num_gpus FROM run_span) sp ON true
ORDER BY q.by_tier, q.tier
"""
_SUMMARY = _WITH_SPAN.format(summary=_SUMMARY_SQL.format(
    select="grouping(tier) = 0 AS by_tier, tier", lat=_LAT, group="GROUP BY GROUPING SETS ((), (tier))"))
# One tier (the common case): its row would repeat the overall one, so the second pass is skipped.
_OVERALL = _WITH_SPAN.format(summary=_SUMMARY_SQL.format(select="false AS by_tier, NULL AS tier", lat=_LAT, group=""))
_ATTAINMENT = "SELECT attainment FROM slo_attainment WHERE scope = 'overall'"
_COST = ("SELECT c.dollars, c.dollars_per_million_output_tokens, c.mean_gpus, c.gpu_s, c.goodput_rps_per_mean_gpu, "
         "sp.duration_s FROM cost c JOIN run_span sp USING (run_id) WHERE c.scope = 'overall'")


class RunScorer:
    """``score(result)`` -> flat dict of attainment, per-tier attainment, latency percentiles, goodput, GPUs."""

    def __init__(self, slo: SloTable | None, threads: int | None = None, gpu_prices: dict[str, float] | None = None,
                 quick: bool = False):  # fmt: skip
        self.slo = slo
        self.quick = quick
        self._args = (slo, threads, gpu_prices)
        self._run: RunConnection | None = None

    @property
    def run(self) -> RunConnection:
        """The DuckDB connection with the scoring views, opened on first use (a quick scorer may never need it)."""
        if self._run is None:
            # (imported here: DuckDB costs ~90 ms of CPU to import, which a search scoring by numpy never needs)
            from servelab.scoring.memory import RunConnection

            slo, threads, gpu_prices = self._args
            self._run = RunConnection(slo, threads=threads, gpu_prices=gpu_prices)
        return self._run

    @property
    def con(self):
        return self.run.con

    def close(self) -> None:
        if self._run is not None:
            self._run.close()

    def _register(self, requests: pa.Table, steps: pa.Table, meta: dict) -> None:
        self.run.register(requests, steps, meta)

    def attainment(self, result, arrived_by_s: float | None = None) -> float:
        """Overall attainment, over the requests that arrived by ``arrived_by_s`` when given (and, as in every
        view, by the run's end: a checkpoint's horizon is both)."""
        requests = result.requests
        if arrived_by_s is not None:
            requests = requests.filter(call("less_equal", requests.column("arrival_s"), arrived_by_s))
            if requests.num_rows == 0:
                return 1.0
        if self.quick:
            try:
                return quick_scoring.attainment(requests, self.slo, end_s=result.meta.get("simulated_span_s"))
            except quick_scoring.NotQuick:
                pass
        self._register(requests, result.steps, result.meta)
        return float(self.con.execute(_ATTAINMENT).fetchall()[0][0])

    def score(self, result, cost: bool = False) -> dict[str, Any]:
        """``cost`` adds the cost view's overall row: dollars, dollars_per_million_output_tokens, mean_gpus,
        gpu_s, goodput_rps_per_mean_gpu (at the trace's rate, per GPU held on average) and cost_duration_s."""
        tiers = call("unique", result.requests.column("tier")).to_pylist()
        out: dict[str, Any] = {}
        for row in self._summary_rows(result, by_tier=len(tiers) > 1, cost=cost):
            if row["by_tier"]:
                out[f"attainment.tier.{row['tier']}"] = row["attainment"]
                continue
            out.update(attainment=row["attainment"], attainment_ttft=row["attainment_ttft"],
                       attainment_tpot=row["attainment_tpot"], requests=row["requests"])  # fmt: skip
            if len(tiers) == 1 and tiers[0] is not None:
                out[f"attainment.tier.{tiers[0]}"] = row["attainment"]
            for metric in ("ttft", "tpot", "e2e", "queue", "max_itl"):
                q = row[f"{metric}_q"] or [None, None, None]
                out.update({f"{metric}_mean": row[f"{metric}_mean"], f"{metric}_p50": q[0], f"{metric}_p90": q[1],
                            f"{metric}_p99": q[2]})  # fmt: skip
            if row["span_duration_s"]:
                duration_s, num_gpus = row["span_duration_s"], row["span_num_gpus"]
                out.update(goodput_rps=row["met_all"] / duration_s, throughput=row["completed"] / duration_s,
                           num_gpus=num_gpus)  # fmt: skip
        if cost:  # (the summary above came from DuckDB, with this run registered)
            found = self.con.execute(_COST).fetchall()
            if found:
                out.update(zip(("dollars", "dollars_per_million_output_tokens", "mean_gpus", "gpu_s",
                                "goodput_rps_per_mean_gpu", "cost_duration_s"), found[0]))
        return out

    def _summary_rows(self, result, by_tier: bool, cost: bool) -> list[dict[str, Any]]:
        if self.quick and not cost:
            try:
                return quick_scoring.summary_rows(result.requests, result.steps, run_gpus(result.meta), self.slo, by_tier,
                                                  end_s=result.meta.get("simulated_span_s"))
            except quick_scoring.NotQuick:
                pass
        self._register(result.requests, result.steps, result.meta)
        rows = self.con.execute(_SUMMARY if by_tier else _OVERALL).fetchall()
        cols = [d[0] for d in self.con.description]
        return [dict(zip(cols, values)) for values in rows]


__all__ = ["RunScorer"]
