"""Prefix caching costs what it does: on a trace without hashes, whose requests are never preempted
by recompute, nothing is ever cached, and the cache only counts blocks (issue #31 item 2)."""

from __future__ import annotations

import pytest

from helpers_engine import synthetic
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.prefix_cache import PrefixCache


def _spy(monkeypatch, names):
    calls = {name: 0 for name in names}
    for name in names:
        original = getattr(PrefixCache, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(PrefixCache, name, counted)
    return calls


def test_a_trace_without_hashes_never_touches_the_index(monkeypatch):
    caches = []
    original_init = PrefixCache.__init__
    monkeypatch.setattr(PrefixCache, "__init__",
                        lambda self, *a, **k: (original_init(self, *a, **k), caches.append(self))[0])
    calls = _spy(monkeypatch, ["hashed_blocks", "groups", "_settle", "_push_run", "claim"])
    trace = synthetic(n=400)
    assert "prefix_hashes" not in trace.column_names
    result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=2, enable_prefix_caching=True)))
    assert result.requests.num_rows == 400
    assert caches and calls == dict.fromkeys(calls, 0)
    for cache in caches:  # the free queue is the one segment it started as: only its count moved
        assert cache.countable and len(cache.queue) == 1 and not cache.entries and not cache.segments


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_own_segments_are_still_reused_after_a_recompute(monkeypatch, preemption):
    """With KV pressure a preempted request's own blocks are queued (the queue is rebuilt from the
    count first) and hit when it returns: caching on reuses tokens that caching off computes again."""
    calls = _spy(monkeypatch, ["_settle"])
    trace = synthetic(n=600)
    engine = dict(num_gpu_blocks=700, preemption=preemption, swap_space_gb=0.01)
    on = replay(trace, ReplayConfig(engine=EngineConfig(**engine, enable_prefix_caching=True)))
    cached = sum(on.requests.column("cached_tokens").to_pylist())
    assert calls["_settle"] > 0 and cached > 0
