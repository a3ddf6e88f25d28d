"""A/B of two checkouts' engines on cluster replays (pools, PD handoff, autoscaling, instance types,
failures), interleaved in fresh processes: what the intents (replay/core/intents.py) cost where they are used.

Usage: .venv/bin/python bench/bench_ab_cluster.py A_ROOT B_ROOT [--pairs 6] [--requests N] [--case NAME ...]
where each ROOT is a directory holding a ``servelab`` package (a folder with a symlink
``servelab -> /path/to/checkout``, as for bench_ab.py), put first on ``PYTHONPATH`` for its runs.

Cases, on the bundled Azure conversation trace (its first N requests with ``--requests``):
``disagg`` (2 prefill + 4 decode, bench_replay.py's azure-disagg), ``disagg-autoscale``
(examples/clusters/disagg-autoscale.toml) with a prefill and a decode replica failing, ``autoscale``
(a mixed pool of 2..6 replicas, one failing for 60 s) and ``spot`` (examples/clusters/spot-fallback.toml:
instance types, H100s reclaimed at 600 s). Each pair runs A then B, the next B then A (ABBA). Per run:
``Engine.run``'s CPU time (user + system); printed: each run, the medians and the median of the pairs'
B/A ratios per case. The script checks that both versions give the same finish times (the same work).
``--instructions``: instead, Engine.run's instructions under valgrind's callgrind, one run per side (a count
that does not depend on the machine's load; as bench_instructions.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ab import callgrind, compare, interleaved

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"

CHILD = r"""
import functools, hashlib, resource, sys, tomllib
from servelab.api import ReplayConfig, replay
from servelab.replay.core.engine import Engine
from servelab.traces.bundled import default_trace_path
from servelab.traces.io import read_trace

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

spent = [0.0]
run = Engine.run
def timed(self, *a, **k):
    t = cpu()
    try:
        return run(self, *a, **k)
    finally:
        spent[0] += cpu() - t
Engine.run = timed
if sys.argv[4] == "count":  # under callgrind, which collects inside functools.reduce only: Engine.run's instructions
    def collected(engine, *a, **k):
        return functools.reduce(lambda _, __: timed(engine, *a, **k), (0, 0))
    Engine.run = collected

case, n, examples = sys.argv[1], int(sys.argv[2]), sys.argv[3]
LINEAR = "linear:base=0.004,prefill_token=0.00003,decode_seq=0.0001"
if case == "disagg":
    raw = {"runner": LINEAR, "kv_bytes_per_token": 131072, "num_gpu_blocks": 28000, "cluster": {
        "pools": [{"name": "prefill", "role": "prefill", "replicas": 2},
                  {"name": "decode", "role": "decode", "replicas": 4, "router": "least-outstanding"}],
        "links": [{"from": "prefill", "to": "decode", "bandwidth_gbps": 50.0, "latency_s": 0.0005}]}}
elif case == "disagg-autoscale":
    raw = tomllib.load(open(f"{examples}/disagg-autoscale.toml", "rb"))
    raw.update(runner=LINEAR, kv_bytes_per_token=131072, num_gpu_blocks=28000, fail=["replica=0,at=300,for=120", "replica=5,at=900"])
elif case == "autoscale":
    raw = {"runner": LINEAR, "num_gpu_blocks": 28000, "fail": ["replica=1,at=600,for=60"], "cluster": {"pools": [{"name": "web", "replicas": 2,
           "autoscale": {"min": 2, "max": 6, "signal": "running", "target": 8, "interval_s": 10, "cooldown_s": 60,
                         "startup_s": 30}}]}}
else:  # spot
    raw = tomllib.load(open(f"{examples}/spot-fallback.toml", "rb"))
config = ReplayConfig.from_dict(raw)
trace = read_trace(default_trace_path())
if n:
    trace = trace.slice(0, n)
replay(trace.slice(0, 50), config)  # warm-up: imports and first calls
spent[0] = 0.0
result = replay(trace, config)
finish = hashlib.sha256(str(result.requests.column("finish_s").to_pylist()).encode()).hexdigest()[:16]
print(spent[0], finish)
"""

CASES = ("disagg", "disagg-autoscale", "autoscale", "spot")


def one(root: str, case: str, requests: int, prefix: tuple[str, ...] = ()) -> tuple[float, str]:
    """One run: Engine.run's CPU s and the finish times' hash (``prefix``: callgrind's command)."""
    env = dict(os.environ, PYTHONPATH=root, PYTHONHASHSEED="0")
    proc = subprocess.run([*prefix, sys.executable, "-c", CHILD, case, str(requests), str(EXAMPLES),
                           "count" if prefix else "time"], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{case} under {root} failed:\n{proc.stderr[-3000:]}")
    out = proc.stdout.split()
    return float(out[0]), out[1]


def instructions(root: str, case: str, requests: int) -> tuple[int, str]:
    """Engine.run's instructions under callgrind (hash seed and address layout fixed) and the finish hash."""
    count, (_, finish) = callgrind(lambda prefix: one(root, case, requests, prefix))
    return count, finish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--requests", type=int, default=0, help="the trace's first N requests (0: all)")
    parser.add_argument("--case", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--instructions", action="store_true",
                        help="count Engine.run's instructions under valgrind's callgrind instead (one run per side)")
    args = parser.parse_args()
    if args.instructions:
        for case in args.case:
            counts = {side: instructions(root, case, args.requests) for side, root in (("A", args.a), ("B", args.b))}
            if counts["A"][1] != counts["B"][1]:
                raise SystemExit(f"{case}: the versions' finish times differ: not the same work")
            print(f"{case}: Engine.run A {counts['A'][0] / 1e6:,.1f} M instructions, B {counts['B'][0] / 1e6:,.1f} M; "
                  f"B/A {counts['B'][0] / counts['A'][0]:.4f}; same finish times (sha256 {counts['A'][1]})", flush=True)
        return
    for case in args.case:
        runs = interleaved(args.pairs, lambda side, case=case: one(args.a if side == "A" else args.b, case, args.requests),
                           lambda k, side, r, case=case: print(f"{case} pair {k + 1} {side}: Engine.run {r[0]:.3f} s CPU",
                                                               flush=True))
        finishes = {r[1] for side in runs.values() for r in side}
        if len(finishes) != 1:
            raise SystemExit(f"{case}: the versions' finish times differ ({sorted(finishes)}): not the same work")
        summary = compare([r[0] for r in runs["A"]], [r[0] for r in runs["B"]])
        print(f"{case}: Engine.run {summary}; same finish times (sha256 {finishes.pop()})", flush=True)


if __name__ == "__main__":
    main()
