"""Helpers for engine tests: run a replay with a linear runner in one call; an engine that checks its
bookkeeping after every event (every fourth in a developer's run of the long suites)."""

from __future__ import annotations

from collections.abc import Callable

from sampled_suites import full_suites
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.engine import Engine
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


class PagedLinear:
    """A cost model that asks for block tables, so the KV manager hands out real block ids (as for
    the torch runner) while the replay stays cheap: the ids' bookkeeping is checked at every event."""

    needs_block_tables = True

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def make_allocator(self, replica_id, num_blocks):
        from servelab.runners.paged_kv import BlockAllocator

        return BlockAllocator(num_blocks)

    def step_time(self, plan):
        assert all(item.request.block_table is not None for item in plan.items)
        return self.inner.step_time(plan)

    def decode_affine(self, num_seqs):
        return None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


# The invariant suites check the books after every event under SERVELAB_FULL_SUITES=1 (CI), and
# after every fourth (a fixed phase) in a developer's run: the checks are most of those suites' time,
# and a broken count stays broken for the events after it (sampled_suites.py).
QUICK_EVERY = 4


def checking_engine(check: Callable[[Engine], None], every: int | None = None) -> type[Engine]:
    """An ``Engine`` subclass that calls ``check(engine)`` after every arrival, scheduling decision and
    completed step (its ``_check`` runs it, for hooks elsewhere to call too) or, with ``every`` = k,
    after every k-th of them (default: 1 under SERVELAB_FULL_SUITES=1, else ``QUICK_EVERY``); the class
    attribute ``events`` counts the events and ``checks`` the checks, so a test can assert the checks
    really ran. Replays through ``servelab.api`` use it once it is patched in:
    ``monkeypatch.setattr(servelab.assembly, "Engine", cls)``."""
    stride = every if every is not None else (1 if full_suites() else QUICK_EVERY)

    class CheckingEngine(Engine):
        events = 0
        checks = 0

        def _arrive(self, req, now):
            super()._arrive(req, now)
            self._check()

        def _start(self, replica, now):
            super()._start(replica, now)
            self._check()

        def _complete(self, replica, now):
            super()._complete(replica, now)
            self._check()

        def _check(self):
            CheckingEngine.events += 1
            if CheckingEngine.events % stride == 0:
                CheckingEngine.checks += 1
                check(self)

    return CheckingEngine


def check_after_each_abort(monkeypatch) -> None:
    """Client timeouts (replay/platform/abort.py) also check the books: each abort's intents are applied,
    then the engine's ``_check`` runs (a ``checking_engine``'s), as after any other event."""
    from servelab.replay.platform.abort import Aborts

    fire = Aborts.fire

    def checked_fire(self, req, now, reason=None):
        self.engine.enact(fire(self, req, now, reason), now)
        self.engine._check()
        return []

    monkeypatch.setattr(Aborts, "fire", checked_fire)


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


def with_tiers(trace):
    """``trace`` with a ``tier`` column cycling priority, standard, flex (request i: the (i mod 3)-th),
    for replays under the tiers policy."""
    import pyarrow as pa

    tiers = ("priority", "standard", "flex")
    return trace.append_column("tier", pa.array([tiers[i % 3] for i in range(trace.num_rows)]))


def column(result, name):
    return result.requests.column(name).to_pylist()


def rows(result, *columns) -> list[tuple]:
    """The requests table of ``result`` as tuples of ``columns``, in request order."""
    return [tuple(r[c] for c in columns) for r in result.requests.to_pylist()]


def string_splits(run, where, names=("split", "partition", "rsplit")):
    """``(calls, result)``: the ``str`` splitting calls (``names``) made from files ``where`` (a set of
    folders and files) while ``run()`` runs, each as ``"file.py:line name"``, and what ``run()``
    returned. Counts a config's text parsed again where it should have been typed once."""
    import sys
    from pathlib import Path

    where = {Path(p).resolve() for p in where}
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in names:
            path = Path(frame.f_code.co_filename).resolve()
            if path in where or path.parent in where:
                calls.append(f"{path.name}:{frame.f_lineno} {arg.__name__}")

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return calls, result


def count_builds(monkeypatch, classes: dict, log: dict) -> dict:
    """Count each build of the dataclasses ``classes`` (class -> the ``log`` key it counts under) through
    their ``__post_init__`` (the check every construction, ``replace`` included, runs); returns ``log``."""
    for cls, key in classes.items():
        check = cls.__post_init__

        def counted(self, check=check, key=key):
            log[key] += 1
            check(self)

        monkeypatch.setattr(cls, "__post_init__", counted)
    return log
