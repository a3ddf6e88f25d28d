"""One DuckDB connection with the scoring views over one run's Arrow tables at a time, swapped per run (no Parquet round trip).

A search scores hundreds of runs and a goodput sweep a dozen; opening a connection and creating the
views costs more than the queries, and reading a run back from its files costs as much again
(~170 ms a point for a 2,000-request run against ~55 ms in memory; bench/RESULTS.md, issue #31). So
the connection is made once and each run's tables are registered in place of the last one's. The
figures are those `servelab query` gives on the written run directory (tests check it).
"""

from __future__ import annotations

import pyarrow as pa

from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA
from servelab.scoring.db import new_connection, set_slo
from servelab.scoring.slo import SloTable
from servelab.scoring.sources import OPTIONAL_REQUEST_COLUMNS, POOLS_SCHEMA, num_gpus, pool_rows
from servelab.scoring.views import create_views

RUN_ID = "trial"


class RunConnection:
    """``register(requests, steps, meta)`` makes one run the content of the views of ``con``."""

    def __init__(self, slo: SloTable | None, threads: int | None = None, gpu_prices: dict[str, float] | None = None):
        # $ per GPU-hour by GPU, for a flat run's pool (a cluster's pools carry their own prices)
        self.gpu_prices = dict(gpu_prices or {})
        self.con = new_connection(threads=threads)
        self.register(REQUESTS_SCHEMA.empty_table(), STEPS_SCHEMA.empty_table(), {})
        set_slo(self.con, slo)
        create_views(self.con)

    def close(self) -> None:
        self.con.close()

    def register(self, requests: pa.Table, steps: pa.Table, meta: dict) -> None:
        n = requests.num_rows
        requests = requests.add_column(0, "run_id", pa.array([RUN_ID] * n, pa.string()))
        for f in OPTIONAL_REQUEST_COLUMNS:
            if f.name not in requests.column_names:
                requests = requests.append_column(f, pa.nulls(n, f.type))
        steps = steps.add_column(0, "run_id", pa.array([RUN_ID] * steps.num_rows, pa.string()))
        self.con.register("requests", requests)
        self.con.register("steps", steps)
        self.con.register("runs", _runs(RUN_ID, meta))
        pools = [dict(p, run_id=RUN_ID) for p in pool_rows(meta)]
        for p in pools:
            if p["price_per_gpu_hour"] is None and p["gpu"] in self.gpu_prices:
                p["price_per_gpu_hour"] = self.gpu_prices[p["gpu"]]
        self.con.register("pools", pa.Table.from_pylist(pools, schema=POOLS_SCHEMA))


def _runs(run_id: str, meta: dict) -> pa.Table:
    """The `runs` columns the scoring views read. scoring.sources.runs_table flattens all of run.json
    (~100 columns, ~1 ms a run); the views need only these, and were created against them."""
    span = meta.get("simulated_span_s")
    span = float(span) if isinstance(span, (int, float)) and not isinstance(span, bool) else None
    return pa.table({"run_id": pa.array([run_id], pa.string()), "run_path": pa.array([run_id], pa.string()),
                     "num_gpus": pa.array([num_gpus(meta)], pa.int64()),
                     "simulated_span_s": pa.array([span], pa.float64()),
                     # a replay has no source duration and is never stopped by a signal
                     "source_duration_s": pa.array([None], pa.float64()), "stopped_by": pa.array([None], pa.string())})


__all__ = ["RunConnection"]
