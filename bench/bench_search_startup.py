"""Instructions a search worker spends once (start-up, and its first trial's extra over a later one), by checkout.

A pool worker (search/pool.py) unpickles the spec (importing what its classes need), imports the
pool and the Evaluator, prepares or maps the trace, and then evaluates trials; what its first trial
costs beyond a later one (imports a trial makes on first use) is start-up too. Both children run
in a fresh interpreter under ``valgrind --tool=callgrind``, collecting inside ``functools.reduce``
only (bench/ab.py): run A counts the start-up and the first trial, run B only a second trial (after
the first, outside the count). A - B is the per-worker one-time cost, a count that does not depend
on the machine's load, comparable between checkouts that evaluate the same trial (same spec, same
replay).

    .venv/bin/python bench/bench_search_startup.py [ROOT ...] [--requests 2000]

Each ROOT is a directory holding a ``servelab`` package (a symlink to a checkout, as for
bench_ab.py), put first on ``PYTHONPATH``; none: the interpreter's own. The trace is prepared once
by this checkout (bench_search.py's spec on the bundled trace); a checkout whose Evaluator takes no
``prepared`` trace prepares it itself, as its workers did.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from ab import callgrind

HERE = Path(__file__).resolve().parent

CHILD = r"""
import functools, pickle, sys
blob, study_dir, prepared, params, count_first = pickle.load(open(sys.argv[1], "rb"))
state = {}

def start(_a, _b):
    spec = pickle.loads(blob)  # as a spawned worker gets its arguments
    import servelab.search.pool as pool
    from servelab.search.objective import Evaluator
    try:
        evaluator = Evaluator(spec, study_dir, threads=1, prepared=prepared)
    except TypeError:  # before session 17: each worker prepared the trace itself
        evaluator = Evaluator(spec, study_dir, threads=1)
    if hasattr(pool, "preload"):
        pool.preload(spec)
    else:  # (sessions 17 and before: the Evaluator imported them)
        getattr(evaluator, "warm_up", lambda: None)()
    state.update(evaluator=evaluator, pool=pool)

def trial(number):
    outcome = state["pool"].evaluate(state["evaluator"], number, params)
    assert outcome.state == "complete", outcome.user_attrs

if count_first:
    functools.reduce(lambda a, b: (start(a, b), trial(0)), [0, 0])
else:
    start(0, 0)
    trial(0)
    functools.reduce(lambda a, b: trial(1), [0, 0])
state["evaluator"].close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_search import SPEC

    from servelab.search.objective import prepare_trace
    from servelab.search.spec import load_spec
    from servelab.traces.bundled import default_trace_path

    params = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16, "policy": "sarathi"}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "bench.toml"
        spec_path.write_text(SPEC.format(trials=1, trace=default_trace_path(), requests=args.requests, seed=0,
                                         rate_scale=2.0))  # fmt: skip
        spec = load_spec(spec_path)
        study_dir = Path(tmp) / "study"
        study_dir.mkdir()
        _, path, meta = prepare_trace(spec, study_dir)
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        print("| checkout | start-up + first trial | a later trial | once per worker (A - B) |")
        print("|---|---:|---:|---:|")
        for root in args.roots or [None]:
            env = dict(os.environ, PYTHONHASHSEED="0")
            if root:
                env["PYTHONPATH"] = root
            counts = []
            for count_first in (True, False):
                blob = Path(tmp) / "args.pickle"
                blob.write_bytes(pickle.dumps((pickle.dumps(spec), study_dir, (path, meta), params, count_first)))
                n, _ = callgrind(lambda prefix: subprocess.run([*prefix, sys.executable, str(child), str(blob)], env=env,
                                                               check=True, capture_output=True))  # fmt: skip
                counts.append(n)
            a, b = counts
            print(f"| {root or 'this interpreter'} | {a / 1e6:,.0f} M | {b / 1e6:,.0f} M | {(a - b) / 1e6:,.0f} M |")


if __name__ == "__main__":
    main()
