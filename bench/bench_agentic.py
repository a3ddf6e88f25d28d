"""Task completion time of agentic workloads: FCFS vs least attained service vs KV retention (#28 item 5).

    .venv/bin/python bench/bench_agentic.py [--sessions 300] [--loads 0.7,0.95] [--out DIR]
    .venv/bin/python bench/bench_agentic.py --trace agentic.parquet      # a trace of your own, as is

An agent's task is a session of calls: each call's prompt is the task's context so far (earlier
prompts and answers) plus new tokens (a tool's output), sent ``think_s`` (the tool's time) after the
previous call ends. The default synthetic mix is built from closed-loop sessions (``trace synth``
with turns, think times and carried context): each task is a chain of calls. ``--shape
react|fanout|chat|mix`` builds trace schema v2 tasks (``depends_on``: ReAct loops, fan-outs joined
by an aggregator, chats) with the same lengths and waits (issue 28's acceptance figure: ``--shape
mix``); ``--trace`` replays any trace instead. Tasks are grouped by ``session_id``.

Load is offered calls per second over the replica's capacity. The capacity is measured on the
same mix with every task starting at t=0 (closed loop, FCFS): calls finished per second up to the
first iteration that finds nothing waiting. A load L then starts tasks at ``L x capacity / mean
calls per task`` per second (Poisson).
The replica: Llama-3.1-8B on an H100 (roofline runner), 4,096 KV blocks of 16 tokens.

Per-task job completion time (JCT) is the last call's finish minus the first call's arrival;
percentiles by DuckDB over the runs' requests.parquet. A task with a call that did not finish is
counted apart (none should).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import duckdb

from servelab.api import EngineConfig, ReplayConfig, replay, write_run
from servelab.traces.io import read_trace
from servelab.traces.synth import synth_trace

MODEL, GPU = "llama-3.1-8b", "h100-80gb"
BLOCKS = 4096  # 64 k tokens of KV (a GPU shared with other models, or a 70B's share): contexts compete
# name -> (policy, policy params, engine settings)
DRAM = ("dram:capacity_gb=64",)
CONFIGS = {
    "fcfs": ("sarathi", {}, {}),
    "las": ("las", {}, {}),
    "las+bound": ("las", {"max_wait_s": 30.0}, {}),
    "fcfs+keep": ("sarathi", {}, {"kv_retention": "keep"}),
    "fcfs+keep-ttl": ("sarathi", {}, {"kv_retention": "keep", "kv_retention_ttl_s": 5.0}),
    "fcfs+dram": ("sarathi", {}, {"kv_tiers": DRAM}),  # lru with the offload tier: evictions written back
    "fcfs+offload": ("sarathi", {}, {"kv_retention": "offload", "kv_tiers": DRAM}),
    "las+offload": ("las", {}, {"kv_retention": "offload", "kv_tiers": DRAM}),
}


def mix(sessions: int, rate: float, seed: int, shape: str | None = None):
    """The synthetic agentic mix: tasks of geometric length (mean 5 calls, so many 1-2 call tasks
    and a tail of long ones), a 1,024-token system prompt shared per tenant, 300 new tokens per
    call (lognormal: tool outputs), 120-token answers, tool waits of 2 s on average (exponential).
    With ``shape`` (react, fanout, chat, mix): trace schema v2 tasks (``depends_on``) of that shape
    from ``trace synth --shape`` (traces/agentic_synth.py), with the same lengths and waits."""
    if shape is not None:
        from servelab.traces.agentic_synth import generate_agentic, make_agent_config

        return generate_agentic(make_agent_config(
            shape=shape, tasks=sessions, arrival={"rate_per_s": rate}, prompt="lognormal:1024:0.3",
            output="lognormal:120:0.6", new_tokens="lognormal:300:0.8", tool_s="exp:2.0", user_think_s="exp:2.0",
            prefix_block_tokens=16, seed=seed))
    return synth_trace(n=None, duration_s=sessions / rate, rate=rate, turns=5.0, think_s=2.0,
                       prompt="lognormal:300:0.8", output="lognormal:120:0.6", shared_prefix_tokens=1024,
                       tenants="agent-a=1,agent-b=1", prefix_block_tokens=16, seed=seed)


def replay_one(trace, name: str, out: Path, engine: EngineConfig) -> tuple[Path, float]:
    policy, params, settings = CONFIGS[name]
    config = ReplayConfig(engine=replace(engine, **settings), policy=policy, policy_params=params,
                          runner="roofline", model=MODEL, gpu=GPU)
    start = time.perf_counter()
    result = replay(trace, config)
    wall = time.perf_counter() - start
    return write_run(result, out), wall


def capacity(trace, engine: EngineConfig, out: Path) -> float:
    """Calls per second one replica finishes while saturated: the mix's tasks all start at t=0
    (closed loop: tool waits and contexts as in the real runs), FCFS, counted up to the first
    iteration that finds nothing waiting (until then every iteration runs as full as KV allows)."""
    saturated = trace.set_column(trace.schema.get_field_index("arrival_s"), "arrival_s", [[0.0] * trace.num_rows])
    run_dir, _ = replay_one(saturated, "fcfs", out / "capacity", engine)
    return duckdb.sql(f"""
        WITH t AS (SELECT min(start_s) AS t FROM '{run_dir}/steps.parquet' WHERE waiting = 0 AND start_s > 0)
        SELECT count(*) / any_value(t.t) FROM '{run_dir}/requests.parquet', t
        WHERE status = 'finished' AND finish_s <= t.t""").fetchone()[0]


TASKS = """
WITH calls AS (SELECT * FROM '{path}'),
tasks AS (
  SELECT coalesce(session_id, -1 - request_id) AS task, count(*) AS calls,
         bool_and(status = 'finished') AS done, max(finish_s) - min(arrival_s) AS jct_s,
         sum(cached_tokens) AS cached, sum(prompt_tokens) AS prompt
  FROM calls GROUP BY 1)
SELECT count(*) FILTER (done) AS tasks, count(*) FILTER (NOT done) AS incomplete,
       avg(jct_s) FILTER (done) AS mean_s,
       quantile_cont(jct_s, 0.5) FILTER (done) AS p50_s,
       quantile_cont(jct_s, 0.9) FILTER (done) AS p90_s,
       quantile_cont(jct_s, 0.99) FILTER (done) AS p99_s,
       100.0 * sum(cached) / sum(prompt) AS cached_pct
FROM tasks
"""


def task_row(run_dir: Path) -> tuple:
    return duckdb.sql(TASKS.format(path=run_dir / "requests.parquet")).fetchone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=300, help="tasks per load (synthetic mix)")
    ap.add_argument("--loads", default="0.7,0.95", help="offered load, share of the measured capacity")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--trace", help="replay this trace file as is instead of the synthetic mix (one row per config)")
    ap.add_argument("--shape", choices=("react", "fanout", "chat", "mix"),
                    help="trace schema v2 tasks (depends_on) of this shape instead of closed-loop sessions")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="KV blocks of 16 tokens on the replica")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="run directories here (default: a temporary folder)")
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-agentic-"))
    engine = EngineConfig(num_gpu_blocks=args.blocks, seed=args.seed)
    if args.trace:
        cases = [("trace", read_trace(args.trace))]
    else:
        probe = mix(args.sessions, 1.0, args.seed, args.shape)
        calls_per_task = probe.num_rows / args.sessions
        cap = capacity(probe, engine, out)
        print(f"capacity: {cap:.2f} calls/s on one replica ({MODEL}, {GPU}, {args.blocks} KV blocks), saturated; "
              f"{calls_per_task:.2f} calls per task", flush=True)
        cases = []
        for load in (float(x) for x in args.loads.split(",")):
            rate = load * cap / calls_per_task
            cases.append((f"{load:.0%}", mix(args.sessions, rate, args.seed, args.shape)))
    print("| load | config | tasks | JCT mean (s) | p50 | p90 | p99 | prompt tokens cached | replay wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, trace in cases:
        for name in names:
            run_dir, wall = replay_one(trace, name, out / f"{label.rstrip('%')}-{name}", engine)
            tasks, incomplete, mean, p50, p90, p99, cached = task_row(run_dir)
            done = f"{tasks}" + (f" (+{incomplete} incomplete)" if incomplete else "")
            print(f"| {label} | {name} | {done} | {mean:.2f} | {p50:.2f} | {p90:.2f} | {p99:.2f} | "
                  f"{cached:.1f}% | {wall:.1f} |", flush=True)
    print(f"\nruns: {out}")


if __name__ == "__main__":
    main()
