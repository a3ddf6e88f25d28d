"""Benchmark a search: N trials on the first R requests of the bundled Azure conversation trace (roofline runner).

Reports the study's wall time and how much of it is replay: per trial, the replay itself
(``replay()``), scoring (scoring/quick.py, or the DuckDB views), writing the run directory, and everything else
(Optuna sampling and storage, config building), plus the study-level cost outside trials.

    .venv/bin/python bench/bench_search.py --trials 100 --requests 10000 --out /tmp/bench_search

It also prints the sha256 of the trials table without its timing columns (start/end, durations,
the ``attr.*_s`` timings, the worker's id): two checkouts that search alike print the same digest
for the same seed, so an A/B run of a speed change shows the trials are unchanged. ``--workers N``
runs N local worker processes (their trials differ from one worker's: docs/search.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

SPEC = """
objective = "attainment"
n_trials = {trials}
seed = 0
runner = "roofline"
model = "llama-3.1-8b"
gpu = "h100-80gb"
target = 0.9
[trace]
path = "{trace}"
head = {requests}
rate_scale = 2.0
[slo]
ttft_s = 0.5
tpot_s = 0.03
[space]
max_num_seqs = {{ low = 8, high = 512, log = true }}
max_num_batched_tokens = {{ low = 256, high = 16384, log = true }}
block_size = [16, 32]
policy = ["sarathi", "vllm-v0"]
"""

# columns that time the trial (or name its process): everything else is the search's result
TIMING = {"datetime_start", "datetime_complete", "duration_s", "attr.worker", "attr.eval_s", "attr.replay_s",
          "attr.final_replay_s", "attr.score_s", "attr.write_s", "attr.score_write_s", "attr.checkpoint_replay_s",
          "attr.sweep_s"}


def trials_digest(table) -> str:
    """sha256 of the trials table's rows in trial order, timing columns left out."""
    keep = sorted(c for c in table.column_names if c not in TIMING)
    rows = sorted(table.select(keep).to_pylist(), key=lambda r: r["number"])
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--out", default="/tmp/bench_search")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    from servelab.search.spec import load_spec
    from servelab.search.study import run_study
    from servelab.traces.bundled import default_trace_path

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec_path = out / "bench.toml"
    spec_path.write_text(SPEC.format(trials=args.trials, trace=default_trace_path(), requests=args.requests))
    spec = load_spec(spec_path)
    if args.workers != 1:
        from dataclasses import replace

        spec = replace(spec, workers=args.workers)
    t0 = time.perf_counter()
    run_study(spec, out / "study")
    wall = time.perf_counter() - t0

    from servelab.search.study import open_study
    from servelab.search.trials import write_trials

    write_trials(open_study(spec, out / "study"), out / "study")
    t = pq.read_table(out / "study" / "trials.parquet")

    def total(col: str) -> float:
        return float(pc.sum(t.column(col)).as_py() or 0.0) if col in t.column_names else 0.0

    replay_s, score_s, write_s = total("attr.replay_s"), total("attr.score_s"), total("attr.write_s")
    post_s = total("attr.score_write_s")  # scoring and writing overlap: their common wall time
    eval_s, trial_s = total("attr.eval_s"), total("duration_s")
    n = t.num_rows
    other_in_trial = trial_s - replay_s - post_s
    outside = wall - trial_s
    overhead = wall - replay_s / args.workers  # with N workers, replays run N at a time
    print(f"machine: {platform.node()} {platform.machine()}, {platform.processor() or '?'}; python {platform.python_version()}")
    print(f"{n} trials on {args.requests:,} requests, {args.workers} worker(s), wall {wall:.2f} s ({wall / n:.3f} s/trial, "
          f"{60 * n / wall:.0f} trials/min)")
    print(f"best attainment {pc.max(t.column('attainment')).as_py():.4f}; trials table digest {trials_digest(t)}")
    print("| part | total s | per trial s | share of wall |")
    print("|---|---:|---:|---:|")
    for name, value in (("replay()", replay_s), ("scoring (numpy; DuckDB views for what it does not model)", score_s), ("write run dir (Parquet + run.json)", write_s),
                        ("scoring and writing together (overlapped)", post_s),
                        ("Optuna sampling/storage + config (in trial)", other_in_trial),
                        ("outside trials (setup, trace)", outside),
                        ("**overhead beyond replay**", overhead), ("**wall**", wall)):  # fmt: skip
        print(f"| {name} | {value:.2f} | {value / n:.4f} | {value / wall:.1%} |")
    # issue #31's measure: what the search adds beyond replaying, against the replays' own time
    print(f"overhead / replay time: {overhead / (replay_s / args.workers):.1%}")


if __name__ == "__main__":
    main()
