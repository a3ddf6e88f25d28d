"""Benchmark a search: N trials on the first R requests of the bundled Azure conversation trace (roofline runner).

Each run is a fresh process (as `servelab search` is) running the study with W local workers, and
reports its wall time, trials per minute, and CPU seconds: the replays' own (``replay()``, timed
in the process that ran it), the rest of each trial's evaluation (config, scoring, writing the run
directory), the `search` process's own work beyond evaluations (Optuna's sampling and storage,
telling results, setup; imports excluded; the sampler's share, its CPU inside `suggest`, apart), and the
workers' start-up. "Overhead" (issue #31) is everything but the replays and the start-up, as CPU time
against the replays' CPU time: a figure the machine's load does not inflate as it does wall time.
From the same figures it prints the speed-up they imply on idle cores (`modelled_wall_s`: the batches'
makespans, the `search` process's work counted serial, the workers' start-up overlapping its setup), for
a machine whose cores are busy, where wall-clock scaling cannot be measured.

    .venv/bin/python bench/bench_search.py --trials 20 --requests 2000 --workers 1,2 --rounds 3

``--workers 1,2`` runs interleaved rounds (1 then 2 in even rounds, 2 then 1 in odd ones) and
prints each worker count's median trials/min and the per-round speed-up against the first count.
Measure scaling on an idle machine with at least as many free cores as workers.

It also prints the sha256 of the trials table without its timing columns (start/end, durations,
the ``attr.*_s`` timings, the worker's id): the same spec and seed give the same digest for any
number of workers (search/batch.py), and two checkouts that search alike print the same digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPEC = """
objective = "attainment"
n_trials = {trials}
seed = {seed}
runner = "roofline"
model = "llama-3.1-8b"
gpu = "h100-80gb"
target = 0.9
[trace]
path = "{trace}"
head = {requests}
rate_scale = {rate_scale}
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
          "attr.sweep_s", "attr.eval_cpu_s", "attr.replay_cpu_s"}


def trials_digest(table) -> str:
    """sha256 of the trials table's rows in trial order, timing columns left out."""
    keep = sorted(c for c in table.column_names if c not in TIMING)
    rows = sorted(table.select(keep).to_pylist(), key=lambda r: r["number"])
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def one_run(args) -> dict:
    """One study in this process with ``args.workers`` workers; its figures as a dict."""
    from dataclasses import replace

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from servelab.search.spec import load_spec
    from servelab.search.study import open_study, run_study
    from servelab.search.trials import write_trials
    from servelab.traces.bundled import default_trace_path

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec_path = out / "bench.toml"
    spec_path.write_text(SPEC.format(trials=args.trials, trace=default_trace_path(), requests=args.requests,
                                     seed=args.seed, rate_scale=args.rate_scale))  # fmt: skip
    spec = replace(load_spec(spec_path), workers=int(args.workers))
    if args.batch:  # an experiment on the search's quality: the batch size is a constant of servelab's
        import servelab.search.batch as batch

        batch.BATCH_TRIALS = args.batch
    # imported before the clock starts: their one-time cost (~0.3 s CPU) is not a trial's
    import optuna  # noqa: F401

    import servelab.assembly  # noqa: F401
    import servelab.search.batch  # noqa: F401
    import servelab.search.objective  # noqa: F401

    cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    sampler_cpu = _time_the_sampler()
    if args.profile:
        import cProfile

        cProfile.runctx("run_study(spec, out / 'study')", globals(), {"run_study": run_study, "spec": spec, "out": out},
                        filename=args.profile)  # fmt: skip
    else:
        run_study(spec, out / "study")
    wall = time.perf_counter() - t0
    parent_cpu = _cpu(resource.RUSAGE_SELF) - cpu0
    children_cpu = _cpu(resource.RUSAGE_CHILDREN)  # the pool's workers, joined by now
    write_trials(open_study(spec, out / "study"), out / "study")
    t = pq.read_table(out / "study" / "trials.parquet")

    def total(col: str) -> float:
        return float(pc.sum(t.column(col)).as_py() or 0.0) if col in t.column_names else 0.0

    eval_cpu, replay_cpu = total("attr.eval_cpu_s"), total("attr.replay_cpu_s")
    in_process = int(args.workers) == 1
    rows = sorted(t.select(["number", "attr.eval_cpu_s"]).to_pylist(), key=lambda r: r["number"])
    return {"workers": int(args.workers), "trials": t.num_rows, "wall_s": wall, "parent_cpu_s": parent_cpu,
            "children_cpu_s": children_cpu, "eval_cpu_s": eval_cpu, "replay_cpu_s": replay_cpu,
            "replay_s": total("attr.replay_s"),
            "bookkeeping_cpu_s": parent_cpu - (eval_cpu if in_process else 0.0), "sampler_cpu_s": sampler_cpu[0],
            "setup_cpu_s": sampler_cpu[1] - cpu0,
            "worker_startup_cpu_s": 0.0 if in_process else children_cpu - eval_cpu,
            "best": pc.max(t.column("attainment")).as_py(), "digest": trials_digest(t),
            "trial_eval_cpu_s": [r["attr.eval_cpu_s"] or 0.0 for r in rows], "batch": batch_size(args)}  # fmt: skip


def _time_the_sampler() -> list[float]:
    """Count the `search` process's CPU inside `suggest` on Optuna's trials: the sampler's work (TPE fits its
    model at a trial's first suggest), which grows with the trials told (optuna/optuna#5478); and note its CPU
    (all threads) when it first asks one, after its setup (the study, the trace, an evaluator or the workers)."""
    import servelab.search.space as space

    try:
        from servelab.search.recorded import RecordedTrial
    except ImportError:  # a checkout before session 17 (to measure it with this script)
        from servelab.search.pool import RecordedTrial

    spent = [0.0, None]
    suggest = space.suggest

    def timed(trial, *args, **kwargs):
        if isinstance(trial, RecordedTrial):  # a worker's (or the in-process evaluator's) replay of the draw
            return suggest(trial, *args, **kwargs)
        if spent[1] is None:
            spent[1] = _cpu(resource.RUSAGE_SELF)
        c = time.thread_time()
        try:
            return suggest(trial, *args, **kwargs)
        finally:
            spent[0] += time.thread_time() - c

    space.suggest = timed  # search/batch.py imports it at each batch
    return spent


def batch_size(args) -> int:
    from servelab.search.batch import BATCH_TRIALS

    return args.batch or BATCH_TRIALS


def modelled_wall_s(evals: list[float], batch: int, workers: int, parent_per_trial_s: float, startup_s: float,
                    setup_s: float = 0.0, parent_works: bool = False) -> float:  # fmt: skip
    """The wall time of the study on ``workers`` idle cores, from CPU figures: the `search` process's setup (the
    study, the trace), which the workers' start-up (in parallel) overlaps (they start before it prepares the
    trace); then each batch costs the parent's work on its trials (sampling, storage, tells: all counted as
    serial, though the asks after the first overlap the replays in flight) plus the batch's makespan, its trials
    dealt in order to whichever worker is free first (as search/pool.py does). One worker: in process, no
    start-up. ``parent_works``: the layout where the `search` process is one of the workers (it starts at once,
    the others after their start-up; a trial goes to whoever is free first, an upper bound for that layout)."""
    if workers == 1:
        free = [setup_s]
    else:
        free = [max(setup_s, startup_s)] * workers
        if parent_works:
            free[0] = setup_s
    wall = setup_s
    for i in range(0, len(evals), batch):
        trials = evals[i:i + batch]
        wall += parent_per_trial_s * len(trials)
        free = [max(f, wall) for f in free]
        for e in trials:
            k = free.index(min(free))
            free[k] += e
        wall = max(free)
    return wall


def report(r: dict) -> None:
    n = r["trials"]
    other_eval = r["eval_cpu_s"] - r["replay_cpu_s"]
    overhead = r["bookkeeping_cpu_s"] + other_eval
    print(f"{n} trials, {r['workers']} worker(s): wall {r['wall_s']:.2f} s ({60 * n / r['wall_s']:.0f} trials/min); "
          f"best attainment {r['best']:.4f}; trials table digest {r['digest']}")  # fmt: skip
    print("| CPU | total s | per trial ms | against replays |")
    print("|---|---:|---:|---:|")
    for name, value in (("replay() (in the process that ran it)", r["replay_cpu_s"]),
                        ("rest of the evaluation (config, scoring, writing)", other_eval),
                        ("`search` process beyond evaluations (sampling, storage, tell, setup)", r["bookkeeping_cpu_s"]),
                        ("... of which the sampler (Optuna's TPE, in `suggest`)", r["sampler_cpu_s"]),
                        ("... the rest (ask, tell, journal, setup)", r["bookkeeping_cpu_s"] - r["sampler_cpu_s"]),
                        ("**overhead** (the two above)", overhead),
                        ("workers' start-up (imports, trace), once per run", r["worker_startup_cpu_s"])):  # fmt: skip
        print(f"| {name} | {value:.3f} | {1000 * value / n:.1f} | {value / r['replay_cpu_s']:.1%} |")
    print(f"overhead / replay CPU: {overhead / r['replay_cpu_s']:.1%} "
          f"(without the sampler: {(overhead - r['sampler_cpu_s']) / r['replay_cpu_s']:.1%})")
    if r["workers"] > 1:
        print(f"workers' start-up CPU: {r['worker_startup_cpu_s'] / r['workers']:.2f} s per worker")
    print(implied(r))


def implied(r: dict, startup_s: float | None = None) -> str:
    """The speed-up these CPU figures imply on idle cores (`modelled_wall_s`), for 2 and 4 workers over 1;
    ``startup_s``: the start-up CPU of one worker (default: this run's, when it had workers)."""
    evals, n = r["trial_eval_cpu_s"], r["trials"]
    setup = r.get("setup_cpu_s", 0.0)
    parent = (r["bookkeeping_cpu_s"] - setup) / n
    if startup_s is None and r["workers"] > 1:
        startup_s = r["worker_startup_cpu_s"] / r["workers"]
    one = modelled_wall_s(evals, r["batch"], 1, parent, 0.0, setup)
    parts = []
    for w in (2, 4):
        steady = one / modelled_wall_s(evals, r["batch"], w, parent, 0.0, setup)
        if startup_s is None:
            parts.append(f"{w} workers {steady:.2f}x without the workers' start-up")
        else:
            parts.append(f"{w} workers {one / modelled_wall_s(evals, r['batch'], w, parent, startup_s, setup):.2f}x "
                         f"({steady:.2f}x without the start-up)")  # fmt: skip
    if startup_s is not None:
        own = modelled_wall_s(evals, r["batch"], 2, parent, startup_s, setup, parent_works=True)
        parts.append(f"the `search` process as one of 2 workers {one / own:.2f}x")
    serial = parent * n / (parent * n + sum(evals))
    where = "" if startup_s is None else f"start-up {startup_s:.2f} s/worker, "
    return (f"implied on idle cores (batches of {r['batch']}, {where}setup {setup:.2f} s, the search process's work "
            f"{1000 * parent:.1f} ms/trial = {serial:.1%} of the CPU, counted serial): " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-scale", type=float, default=2.0, help="the trace's rate multiplier (default 2)")
    parser.add_argument("--out", default="/tmp/bench_search")
    parser.add_argument("--workers", default="1", help="worker counts, comma-separated: interleaved rounds")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", help="cProfile the study into this file (one run)")
    parser.add_argument("--batch", type=int, help="trials per batch instead of servelab's BATCH_TRIALS (an experiment)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # a child run: write its figures here
    args = parser.parse_args()
    if args.json:
        Path(args.json).write_text(json.dumps(one_run(args)))
        return
    counts = [int(w) for w in args.workers.split(",")]
    print(f"machine: {platform.node()} {platform.machine()}, {platform.processor() or '?'}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; python {platform.python_version()}")  # fmt: skip
    runs: dict[int, list[dict]] = {w: [] for w in counts}
    for k in range(args.rounds):
        for w in counts if k % 2 == 0 else counts[::-1]:
            figures = Path(f"{args.out}_w{w}_r{k + 1}.json")  # (kept: each run's figures, for a later look)
            child = [sys.executable, __file__, "--trials", str(args.trials), "--requests", str(args.requests),
                     "--seed", str(args.seed), "--rate-scale", str(args.rate_scale), "--out", f"{args.out}_w{w}",
                     "--workers", str(w), "--json", str(figures)] + (["--profile", args.profile] if args.profile else [])  # fmt: skip
            child += ["--batch", str(args.batch)] if args.batch else []
            subprocess.run(child, check=True)
            r = json.loads(figures.read_text())
            runs[w].append(r)
            print(f"\n## round {k + 1}, {w} worker(s) (load average {os.getloadavg()[0]:.2f})")
            report(r)
    if len(counts) > 1 or args.rounds > 1:
        print("\n| workers | trials/min, median (runs) | overhead / replay CPU, median | without the sampler | digest |")
        print("|---:|---|---:|---:|---|")
        for w in counts:
            rates = [60 * r["trials"] / r["wall_s"] for r in runs[w]]
            over = [(r["bookkeeping_cpu_s"] + r["eval_cpu_s"] - r["replay_cpu_s"]) / r["replay_cpu_s"] for r in runs[w]]
            own = [(r["bookkeeping_cpu_s"] - r["sampler_cpu_s"] + r["eval_cpu_s"] - r["replay_cpu_s"]) / r["replay_cpu_s"]
                   for r in runs[w]]  # fmt: skip
            digests = sorted({r["digest"] for r in runs[w]})
            print(f"| {w} | {statistics.median(rates):.0f} ({', '.join(f'{x:.0f}' for x in rates)}) | "
                  f"{statistics.median(over):.1%} | {statistics.median(own):.1%} | {', '.join(digests)} |")  # fmt: skip
        base = counts[0]
        for w in counts[1:]:
            ratios = [b["wall_s"] and a["wall_s"] / b["wall_s"] for a, b in zip(runs[base], runs[w])]
            print(f"speed-up of {w} workers over {base}, per round: {', '.join(f'{x:.2f}x' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
        startups = [r["worker_startup_cpu_s"] / r["workers"] for rs in runs.values() for r in rs if r["workers"] > 1]
        if startups and 1 in runs:
            print(f"from the 1-worker runs' trials with the median start-up of a worker "
                  f"({statistics.median(startups):.2f} s CPU):")
            for r in runs[1]:
                print("  " + implied(r, statistics.median(startups)))
        same = len({r["digest"] for rs in runs.values() for r in rs}) == 1
        print(f"trials tables identical across worker counts and rounds: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
