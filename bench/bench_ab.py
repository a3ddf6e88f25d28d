"""A/B of two checkouts' engines on the same replay, interleaved in fresh processes.

Usage: .venv/bin/python bench/bench_ab.py A_ROOT B_ROOT [--pairs 8] [--requests N] [--synth N]
where each ROOT is a directory holding a ``servelab`` package (e.g. a folder with a symlink
``servelab -> /path/to/checkout``), put first on ``PYTHONPATH`` for its runs.

The replay: the bundled Azure conversation trace (or its first N requests; or, with ``--synth N``, N
requests of bench_replay.py's ``1m`` trace on 8 replicas), 6 replicas, sarathi, the
``linear`` runner (the same step prices in every version), 28,000 KV blocks per replica and prefix
caching off where the version has it, so that both versions do the same work (the script checks that
the finish times agree). Each pair runs A then B, the next B then A (ABBA), so that drift in the
machine's load reaches both alike. Per run: ``Engine.run``'s CPU time (user + system, and each apart
with its minor page faults: kernel time, which instruction counts do not see) and the whole
``replay()`` call's; printed: each run, the medians, and the median of the pairs' B/A ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ab import compare, interleaved

CHILD = r"""
import os, resource, sys, hashlib
try:
    from servelab.api import EngineConfig, ReplayConfig, replay
    engine = dict(enable_prefix_caching=False, num_gpu_blocks=28000)
except ImportError:  # a version before the api module
    from servelab.replay import EngineConfig, ReplayConfig, replay
    engine = dict(num_gpu_blocks=28000)
from servelab.replay.core.engine import Engine
from servelab.traces.bundled import default_trace_path
from servelab.traces.io import read_trace

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt

spent = [0.0]
split = [0.0, 0.0, 0]  # Engine.run's user s, system s, minor page faults
run = Engine.run
def timed(self, *a, **k):
    u = usage()
    try:
        return run(self, *a, **k)
    finally:
        v = usage()
        spent[0] += v[0] + v[1] - u[0] - u[1]
        for i in range(3):
            split[i] += v[i] - u[i]
Engine.run = timed
n, synth = int(sys.argv[1]), int(sys.argv[2])
if synth:
    from servelab.traces.synth import synth_trace
    trace = synth_trace(n=synth, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
else:
    trace = read_trace(default_trace_path())
if n:
    trace = trace.slice(0, n)
config = ReplayConfig(engine=EngineConfig(replicas=8 if synth else 6, **engine), policy="sarathi",
                      runner="linear:base=0.004,prefill_token=0.00003,decode_seq=0.0001")
replay(trace.slice(0, 50), config)  # warm-up: imports and first calls
spent[0] = 0.0
split[:] = [0.0, 0.0, 0]
t = cpu()
result = replay(trace, config)
total = cpu() - t
finish = hashlib.sha256(str(result.requests.column("finish_s").to_pylist()).encode()).hexdigest()[:16]
print(spent[0], total, finish, *split)
"""


def one(root: str, requests: int, synth: int) -> tuple[float, float, str, float, float, int]:
    """One run: Engine.run's CPU s, replay()'s CPU s, the finish times' hash, and Engine.run's user s,
    system s and minor page faults (kernel time is what instruction counts do not see)."""
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", CHILD, str(requests), str(synth)], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), float(out[1]), out[2], float(out[3]), float(out[4]), int(out[5])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--requests", type=int, default=0, help="the trace's first N requests (0: all)")
    parser.add_argument("--synth", type=int, default=0, help="N requests of bench_replay.py's 1m trace instead")
    args = parser.parse_args()
    def report(k: int, side: str, figures: tuple) -> None:
        run_s, total_s, _, user_s, sys_s, faults = figures
        print(f"pair {k + 1} {side}: Engine.run {run_s:.3f} s (user {user_s:.3f}, system {sys_s:.3f}, "
              f"{faults} minor faults), replay() {total_s:.3f} s CPU", flush=True)

    runs = interleaved(args.pairs, lambda side: one(args.a if side == "A" else args.b, args.requests, args.synth),
                       report)
    finishes = {r[2] for side in runs.values() for r in side}
    if len(finishes) != 1:
        raise SystemExit(f"the versions' finish times differ ({sorted(finishes)}): not the same work")
    for i, what in ((0, "Engine.run"), (1, "replay()"), (3, "Engine.run user"), (4, "Engine.run system"),
                    (5, "Engine.run minor faults")):
        summary = compare([r[i] for r in runs["A"]], [r[i] for r in runs["B"]], "" if i == 5 else " s")
        if summary is not None:
            print(f"{what}: {summary}")
    print(f"same finish times in every run (sha256 {finishes.pop()})")


if __name__ == "__main__":
    main()
