"""Helpers for engine tests: run a replay with a linear runner in one call."""

from __future__ import annotations

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.runners.base import make_runner


class NoStretch:
    """Wraps a runner so the engine must run every iteration one by one (reference behaviour)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def step_time(self, plan):
        return self.inner.step_time(plan)

    def decode_affine(self, num_seqs):
        return None

    def describe(self):
        return self.inner.describe()

    def __getattr__(self, name: str):  # the rest of the Runner protocol: the wrapped runner's
        return getattr(self.inner, name)


def run(trace, policy="sarathi", runner="linear:base=1", policy_params=None, stretch=True, **engine):
    engine.setdefault("num_gpu_blocks", 100_000)
    cfg = ReplayConfig(engine=EngineConfig(**engine), policy=policy, policy_params=policy_params or {}, runner=runner)
    r = make_runner(runner)
    if not stretch:
        r = NoStretch(r)
    return replay(trace, cfg, runner=r)


def synthetic(**overrides):
    """A bursty synthetic trace (gamma CV 2, lognormal lengths) for engine-equivalence tests."""
    from servelab.traces.synth import synth_trace

    spec = dict(n=1500, rate=30.0, arrival="gamma", cv=2.0, prompt="lognormal:700:1.0",
                output="lognormal:150:1.0", seed=3)
    spec.update(overrides)
    return synth_trace(**spec)


def column(result, name):
    return result.requests.column(name).to_pylist()


def rows(result, *columns) -> list[tuple]:
    """The requests table of ``result`` as tuples of ``columns``, in request order."""
    return [tuple(r[c] for c in columns) for r in result.requests.to_pylist()]
