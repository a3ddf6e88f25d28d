"""Score one replay result in memory with the scoring views (the SQL `servelab report` runs), on one reused DuckDB connection.

A search scores hundreds of runs; opening a connection and creating the views costs more than the
queries, so each worker process keeps one connection and swaps the run's Arrow tables in. The
numbers are those `servelab query` gives on the written run directory (a test checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from servelab.replay.schema import REQUESTS_SCHEMA, STEPS_SCHEMA
from servelab.scoring.db import set_slo
from servelab.scoring.slo import SloTable
from servelab.scoring.sources import OPTIONAL_REQUEST_COLUMNS, RunDir, runs_table
from servelab.scoring.views import create_views

_SUMMARY = """
SELECT
  (SELECT list(struct_pack(scope, name, requests, attainment, attainment_ttft, attainment_tpot)
               ORDER BY scope, name)
     FROM slo_attainment WHERE scope IN ('overall', 'tier')),
  (SELECT list(struct_pack(metric, mean, p50, p90, p99))
     FROM latency_summary WHERE scope = 'overall'),
  (SELECT struct_pack(goodput_rps, request_throughput_rps, num_gpus)
     FROM goodput WHERE scope = 'overall')
"""
_ATTAINMENT = "SELECT attainment FROM slo_attainment WHERE scope = 'overall'"


class RunScorer:
    """``score(result)`` -> flat dict of attainment, per-tier attainment, latency percentiles, goodput, GPUs."""

    def __init__(self, slo: SloTable | None, threads: int | None = None):
        self.con = duckdb.connect(config={"threads": threads} if threads else {})
        self._register(REQUESTS_SCHEMA.empty_table(), STEPS_SCHEMA.empty_table(), {})
        set_slo(self.con, slo)
        create_views(self.con)

    def close(self) -> None:
        self.con.close()

    def _register(self, requests: pa.Table, steps: pa.Table, meta: dict) -> None:
        run_id = "trial"
        n = requests.num_rows
        requests = requests.add_column(0, "run_id", pa.array([run_id] * n, pa.string()))
        for f in OPTIONAL_REQUEST_COLUMNS:
            if f.name not in requests.column_names:
                requests = requests.append_column(f, pa.nulls(n, f.type))
        steps = steps.add_column(0, "run_id", pa.array([run_id] * steps.num_rows, pa.string()))
        self.con.register("requests", requests)
        self.con.register("steps", steps)
        self.con.register("runs", runs_table([RunDir(run_id, Path(run_id), meta)]))

    def attainment(self, result, arrived_by_s: float | None = None) -> float:
        """Overall attainment, over the requests that arrived by ``arrived_by_s`` when given."""
        requests = result.requests
        if arrived_by_s is not None:
            requests = requests.filter(pc.less_equal(requests.column("arrival_s"), arrived_by_s))
            if requests.num_rows == 0:
                return 1.0
        self._register(requests, result.steps, result.meta)
        return float(self.con.execute(_ATTAINMENT).fetchall()[0][0])

    def score(self, result) -> dict[str, Any]:
        self._register(result.requests, result.steps, result.meta)
        scopes, latencies, goodput = self.con.execute(_SUMMARY).fetchall()[0]
        out: dict[str, Any] = {}
        for row in scopes or []:
            if row["scope"] == "overall":
                out.update(attainment=row["attainment"], attainment_ttft=row["attainment_ttft"],
                           attainment_tpot=row["attainment_tpot"], requests=row["requests"])  # fmt: skip
            else:
                out[f"attainment.tier.{row['name']}"] = row["attainment"]
        for row in latencies or []:
            metric = row["metric"].removesuffix("_s")
            for stat in ("mean", "p50", "p90", "p99"):
                out[f"{metric}_{stat}"] = row[stat]
        if goodput:
            out.update(goodput_rps=goodput["goodput_rps"], throughput=goodput["request_throughput_rps"],
                       num_gpus=goodput["num_gpus"])  # fmt: skip
        return out


__all__ = ["RunScorer"]
