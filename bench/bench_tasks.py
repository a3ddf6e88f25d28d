"""Time the per-task views (scoring/tasks.py) on a synthetic agentic run written with numpy (seeded).

    .venv/bin/python bench/bench_tasks.py        # --tasks 100000 --calls 10 --repeat 2

Each task is a chain of ``--calls`` requests (call k depends on call k-1, a 1 s tool wait), every
request finished; the critical path of each task is the whole chain, so the recursive CTE walks
``--calls`` levels over all tasks at once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA

SCHEMA = pa.schema(list(REQUESTS_SCHEMA) + [pa.field("depends_on", pa.list_(pa.int64())),
                                            pa.field("think_s", pa.float64()), pa.field("task_deadline_s", pa.float64())])


def synth_run(run_dir: Path, tasks: int, calls: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    n = tasks * calls
    task = np.repeat(np.arange(tasks), calls)
    call = np.tile(np.arange(calls), tasks)
    ids = np.arange(n)
    arrival = task * 1.0 + call * 3.0
    sched = arrival + rng.exponential(0.1, n)
    finish = sched + rng.exponential(1.0, n)
    offsets = np.concatenate([[0], np.cumsum(call > 0)]).astype(np.int32)
    depends = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids[call > 0] - 1))
    cols = {f.name: pa.nulls(n, f.type) for f in SCHEMA}
    cols.update(request_id=pa.array(ids), session_id=pa.array(task), status=pa.array(np.full(n, "finished")),
                tenant=pa.array(np.full(n, "t")), tier=pa.array(np.full(n, "standard")), arrival_s=pa.array(arrival),
                first_scheduled_s=pa.array(sched), first_token_s=pa.array(sched + 0.01), finish_s=pa.array(finish),
                prompt_tokens=pa.array(np.full(n, 1000, np.int32)), output_tokens=pa.array(np.full(n, 100, np.int32)),
                generated_tokens=pa.array(np.full(n, 100, np.int32)), num_preemptions=pa.array(np.zeros(n, np.int32)),
                cached_tokens=pa.array(np.where(call > 0, 900, 0).astype(np.int32)), depends_on=depends,
                think_s=pa.array(np.where(call > 0, 1.0, np.nan)))
    run_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=SCHEMA), run_dir / "requests.parquet")
    pq.write_table(STEPS_SCHEMA.empty_table(), run_dir / "steps.parquet")
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name}))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from servelab.scoring.db import connect
    from servelab.scoring.report import render_text
    from servelab.scoring.slo import SloTable

    with tempfile.TemporaryDirectory() as tmp:
        n = synth_run(Path(tmp) / "agents", args.tasks, args.calls)
        con = connect(Path(tmp) / "agents", SloTable.parse_cli(["task=40s"]))

        def best(fn) -> float:
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        print(f"{n:,} requests in {args.tasks:,} tasks of {args.calls} calls")
        for label, sql in (("SELECT * FROM tasks (to Arrow)", "SELECT * FROM tasks"),
                           ("SELECT * FROM task_summary", "SELECT * FROM task_summary"),
                           ("SELECT * FROM slo_attainment (for scale)", "SELECT * FROM slo_attainment")):
            print(f"| `{label}` | {best(lambda: con.execute(sql).to_arrow_table()):.2f} |")
        print(f"| full report text | {best(lambda: render_text(con, width=120)):.2f} |")


if __name__ == "__main__":
    main()
