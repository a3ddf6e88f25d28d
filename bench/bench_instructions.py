"""Instructions a replay's ``Engine.run`` executes, per decision: a count that does not depend on the
machine's load, to compare two versions of the engine (``bench_ab.py`` gives their CPU time).

Usage: .venv/bin/python bench/bench_instructions.py [ROOT ...] [--case vidur70b|azure|N|TRACE] [--policy sarathi]
       [--requests N] [--caching on|off] [--engine KEY=VALUE ...]
Each ROOT is a directory holding a ``servelab`` package (as for bench_ab.py), put first on
``PYTHONPATH`` (none: the one the interpreter imports). The replay is bench_split.py's case (``--requests N``: the trace's first N
requests; ``--engine``: EngineConfig fields set on top of the case's, e.g. ``--engine queue_cap=100000``
to measure what a feature that does nothing costs). It runs under ``valgrind --tool=callgrind`` with collection on only inside
``functools.reduce``, a C function the child calls ``Engine.run`` through and nothing else calls: the
count is Engine.run's alone (start-up, the trace's reading and the results' writing are not in it),
in the main thread (pyarrow's threads are not). Hash seed and address randomisation are fixed, so two
runs of the same code agree to ~0.001%; the same code in two checkout paths, to ~0.1%. Decisions
(calls of the policy's ``schedule``) are counted in a second run without valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ab import callgrind

HERE = Path(__file__).resolve().parent

CHILD = r"""
import functools, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench_split import workload
from servelab.api import replay
from servelab.policies.base import policy_class
from servelab.replay.core.engine import Engine

case, policy, first, count = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "count"
caching, engine = sys.argv[6], json.loads(sys.argv[7])
decisions = [0]
if count:
    cls = policy_class(policy)
    schedule = cls.schedule
    def counted(self, replica):
        decisions[0] += 1
        return schedule(self, replica)
    cls.schedule = counted
run = Engine.run
def collected(engine, *a, **k):  # callgrind collects inside functools.reduce only
    return functools.reduce(lambda _, __: run(engine, *a, **k), (0, 0))
Engine.run = collected
with tempfile.TemporaryDirectory() as tmp:
    trace, config = workload(case, policy, Path(tmp))
    from dataclasses import replace
    if caching != "default":
        engine["enable_prefix_caching"] = caching == "on"
    for key, value in engine.items():  # (tuple fields, such as kv_tiers and fail, take one item)
        if isinstance(getattr(config.engine, key), tuple):
            engine[key] = (value,)
    config = replace(config, engine=replace(config.engine, **engine))
    replay(trace.slice(0, first) if first else trace, config)
if count:
    print(decisions[0])
"""


def engine_fields(items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> EngineConfig fields (a number, true/false/none, or the text as it is)."""
    fields = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine {item!r}: expected KEY=VALUE")
        value = {"true": True, "false": False, "none": None}.get(text.lower(), text)
        if value is text:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        fields[key] = value
    return fields


def child(root: str, args, count: bool, prefix: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="0")
    if root:
        env["PYTHONPATH"] = root
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (compiling on every run would move the heap around)
    cmd = [*prefix, sys.executable, "-c", CHILD, str(HERE), args.case, args.policy, str(args.requests),
           "count" if count else "run", args.caching, json.dumps(engine_fields(args.engine))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)


def instructions(root: str, args) -> int:
    return callgrind(lambda prefix: child(root, args, False, prefix))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="*", default=[""])  # "": the servelab this interpreter imports
    parser.add_argument("--case", default="vidur70b")
    parser.add_argument("--policy", default="sarathi")
    parser.add_argument("--requests", type=int, default=0, help="the trace's first N requests (0: all)")
    parser.add_argument("--caching", choices=["default", "on", "off"], default="default",
                        help="prefix caching on or off (default: the case's configuration)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field set on top of the case's (repeatable)")
    args = parser.parse_args()
    engine_fields(args.engine)  # (bad input fails here, before any run)
    for root in args.roots:
        decisions = int(child(root, args, True, ()).stdout.split()[-1])
        count = instructions(root, args)
        print(f"{root or 'servelab'}: {args.case} {args.policy}{f' first {args.requests}' if args.requests else ''}"
              f"{f' caching {args.caching}' if args.caching != 'default' else ''}"
              f"{''.join(f' {item}' for item in args.engine)}: "
              f"Engine.run {count / 1e6:,.1f} M instructions, {decisions:,} decisions, "
              f"{count / decisions / 1e3:,.1f} k per decision", flush=True)


if __name__ == "__main__":
    main()
