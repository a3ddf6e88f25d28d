"""Where a replay's CPU time goes: the policy's decisions, the runner's pricing, and the engine core
(everything else in ``Engine.run``: events, applying progress, KV accounting, the cohort, routing),
per decision. This is the measurement behind issue #17's question whether a compiled core is the only
way to its targets: a compiled engine core would leave the policy (Python, pluggable) and, unless it
is compiled too, the runner as they are.

Usage: .venv/bin/python bench/bench_split.py [--case vidur70b|azure|N] [--policy sarathi] [--repeat 3]
- ``vidur70b``: bench_replay.py's case (the Azure conversation trace clipped to 4,096 tokens,
  Llama-2-70B TP2 on A100-80GB, 6 replicas, round-robin);
- ``azure``: the bundled replay (Llama-3.1-8B on H100, 6 replicas);
- a number N: bench_replay.py's ``1m`` trace cut to N requests (gamma arrivals cv 2 at 40 req/s,
  lognormal lengths, 8 replicas);
- a trace file's path (``.arrow``/``.parquet``, e.g. ``servelab trace import`` of Mooncake's): it on one
  replica (Llama-3.1-8B on H100).

Policy and runner time are taken with ``time.process_time`` around each call of ``policy.schedule``
(which includes the batch builder it uses) and of the runner's ``step_time``/``decode_affine``; the
timer's own cost (two clock reads per call, ~0.1 us each) is in those shares. Each figure is the
median of ``--repeat`` replays in one process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

CLOCK = time.process_time


class Split:
    """Wraps a policy class's ``schedule`` and the runners' pricing calls with CPU timers."""

    def __init__(self) -> None:
        self.policy_s = self.runner_s = 0.0
        self.decisions = self.pricings = 0
        self.wrapped: set[type] = set()

    def wrap_policy(self, cls: type) -> None:
        schedule = cls.schedule

        def timed(policy, replica):
            t = CLOCK()
            batch = schedule(policy, replica)
            self.policy_s += CLOCK() - t
            self.decisions += 1
            return batch

        cls.schedule = timed

    def wrap_runner(self, cls: type) -> None:
        if cls in self.wrapped:
            return
        self.wrapped.add(cls)
        for name in ("step_time", "decode_affine"):
            method = cls.__dict__.get(name)
            if method is None:
                continue

            def timed(runner, *args, _method=method):
                t = CLOCK()
                out = _method(runner, *args)
                self.runner_s += CLOCK() - t
                self.pricings += 1
                return out

            setattr(cls, name, timed)


def workload(case: str, policy: str, tmp: Path):
    from servelab.api import EngineConfig, ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    if case == "vidur70b":
        from bench_replay import clipped_azure

        trace = read_trace(clipped_azure(tmp / "azure.arrow"))
        return trace, ReplayConfig(engine=EngineConfig(replicas=6, router="round-robin"), model="llama-2-70b",
                                   gpu="a100-80gb", tp=2, policy=policy)
    if case == "azure":
        return read_trace(default_trace_path()), ReplayConfig(engine=EngineConfig(replicas=6), policy=policy)
    if not case.isdigit():  # a trace file (e.g. an imported Mooncake trace), on one replica
        return read_trace(Path(case)), ReplayConfig(engine=EngineConfig(replicas=1), policy=policy)
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=int(case), rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    return trace, ReplayConfig(engine=EngineConfig(replicas=8), policy=policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="vidur70b")
    parser.add_argument("--policy", default="sarathi")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from servelab.api import replay
    from servelab.policies.base import policy_class
    from servelab.replay.core.engine import Engine

    split = Split()
    split.wrap_policy(policy_class(args.policy))
    engine_run = Engine.run
    run_s = [0.0]

    def timed_run(engine, *a, **k):
        for replica in engine.replicas:
            split.wrap_runner(type(replica.runner))
        t = CLOCK()
        try:
            return engine_run(engine, *a, **k)
        finally:
            run_s[0] += CLOCK() - t

    Engine.run = timed_run
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trace, config = workload(args.case, args.policy, Path(tmp))
        for _ in range(args.repeat):
            split.policy_s = split.runner_s = run_s[0] = 0.0
            split.decisions = split.pricings = 0
            t = CLOCK()
            result = replay(trace, config)
            total = CLOCK() - t
            core = run_s[0] - split.policy_s - split.runner_s
            rows.append((total, run_s[0], split.policy_s, split.runner_s, core, split.decisions, split.pricings))
    total, run, policy, runner, core, decisions, pricings = (statistics.median(c) for c in zip(*rows))
    us = 1e6 / decisions
    print(f"{args.case} {args.policy}: {result.requests.num_rows:,} requests, {decisions:,.0f} decisions, "
          f"{pricings:,.0f} runner calls (median of {args.repeat})")
    print(f"  replay() {total:.3f} s CPU; Engine.run {run:.3f} s = policy {policy:.3f} s ({policy / run:.0%}, "
          f"{policy * us:.1f} us/decision) + runner {runner:.3f} s ({runner / run:.0%}) + engine core {core:.3f} s "
          f"({core / run:.0%}, {core * us:.1f} us/decision); outside Engine.run {total - run:.3f} s")


if __name__ == "__main__":
    main()
