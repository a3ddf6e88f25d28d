"""Prefix caching costs what it does: on a trace without hashes, whose requests are never preempted
by recompute, nothing is ever cached, and the cache only counts blocks (issue #31 item 2)."""

from __future__ import annotations

import pytest

from helpers_engine import synthetic
from helpers_prefix import per_key_view
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.kv.prefix_cache import PrefixCache


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


def _reference_let_go(self, chain):
    """``_let_go`` as the general path writes it: per entry, ``unhold`` then ``_push_run``."""
    freed = 0
    for e, count in reversed(list(chain.counts())):
        e.unhold(count)
        if count > e.top:
            self._push_run(e, e.top, count - e.top)
            freed += count - e.top
    return freed


def _cache_history(monkeypatch, trace, settings, general: bool):
    """Replay ``trace`` recording the cache's state after every take: its free queue (kind, blocks and
    start of each segment), its entries' holdings and queued runs; ``general``: the aligned paths off.
    Also returns where each general (unaligned) walk of keys, ``_groups``, started."""
    history, walked = [], []
    original_init, original_take = PrefixCache.__init__, PrefixCache.take
    original_walk = PrefixCache._groups

    def init(self, *a, **k):
        original_init(self, *a, **k)
        if general:
            self.per = 0

    def take(self, n):
        original_take(self, n)
        history.append(per_key_view(self))

    def walk(self, hashes, salt, start, stop):
        walked.append(start)
        return original_walk(self, hashes, salt, start, stop)

    monkeypatch.setattr(PrefixCache, "__init__", init)
    monkeypatch.setattr(PrefixCache, "take", take)
    monkeypatch.setattr(PrefixCache, "_groups", walk)
    if general:
        monkeypatch.setattr(PrefixCache, "_let_go", _reference_let_go)
    policy = settings.pop("policy", "sarathi")
    params = settings.pop("policy_params", {})
    result = replay(trace, ReplayConfig(engine=EngineConfig(**settings), policy=policy, policy_params=params))
    monkeypatch.undo()
    return result, history, walked


@pytest.mark.parametrize("tb, settings", [
    (512, {"num_gpu_blocks": 900}),  # Mooncake's hash blocks (32 engine blocks each), KV pressure: evictions
    (48, {"num_gpu_blocks": 500, "max_num_batched_tokens": 100, "prefix_cache_scope": "tenant"}),  # chunks end mid entry
    (48, {"num_gpu_blocks": 400, "policy": "srpt", "policy_params": {"preempt": True}, "max_num_seqs": 6}),
])
def test_the_aligned_paths_change_the_cache_exactly_as_the_general_ones(monkeypatch, tb, settings):
    """The aligned keys (``groups``) and ``release``'s inline let-go (both per hash block of every prompt:
    most of a Mooncake replay's caching cost) leave the free queue, the entries and their holdings as
    the general path does after every take, and the replay's results equal. (Holdings shared by
    several requests are also checked after every event by tests/test_engine_invariants.py.)"""
    from sampled_suites import size
    from servelab.traces.synth import synth_trace

    # (at 150 requests the srpt case over-committed KV before 38e7878: tests/test_preempt_after_admit_kv.py)
    n = size(300, 100)
    trace = synth_trace(n=n, rate=6.0, tenants="a=1,b=1", shared_prefix_tokens=1024, turns=3.0, think_s=2.0,
                        prompt="lognormal:1500:0.7", output="lognormal:40:0.7", prefix_block_tokens=tb, seed=11)
    fast, fast_history, none = _cache_history(monkeypatch, trace, dict(settings), general=False)
    slow, slow_history, walked = _cache_history(monkeypatch, trace, dict(settings), general=True)
    assert walked and not none  # each side took the path it should
    assert sum(fast.requests.column("cached_tokens").to_pylist()) > 0  # hits
    assert any(len(q) < len(p) for (_, p, _), (_, q, _) in zip(fast_history, fast_history[1:]))  # evictions
    assert fast_history == slow_history
    assert fast.requests.equals(slow.requests)


def test_an_entry_held_by_one_request_needs_no_dict_and_counts_as_a_multiset():
    """``Entry.held`` is None while at most one request has held the entry since it was last unheld
    (most of a Mooncake replay's entries); through any sequence of holds and lets-go, its holdings,
    ``top`` and ``others_max`` are those of a plain multiset of holdings."""
    import random

    from servelab.replay.core.kv.prefix_cache import Entry

    rng = random.Random(5)
    for born in (0, 3):
        e = Entry(("h", 0), 0, 8, born)
        holders = [born] if born else []
        saw_dict = False
        for _ in range(400):
            if holders and rng.random() < 0.45:
                count = holders.pop(rng.randrange(len(holders)))
                e.unhold(count)
            else:
                count = rng.randint(1, 8)
                holders.append(count)
                e.hold(count)
            expected = {c: holders.count(c) for c in set(holders)}
            assert e.holdings() == expected
            assert e.top == max(holders, default=0)
            assert len(holders) <= 1 if e.held is None else e.held  # (a dict only while someone holds it)
            saw_dict |= e.held is not None
            for count in set(holders):
                others = list(holders)
                others.remove(count)
                assert e.others_max(count) == max(others, default=0)
        assert saw_dict


def test_runs_claimed_from_the_queues_middle_are_left_gone_and_compacted_away():
    """Hits on runs in the middle of the free queue (a cache far larger than its use: no eviction
    ever reaches them) leave those runs GONE in place; the deque is compacted when most of it is
    GONE, so GONE segments never outnumber the others by much, and the KV checks pass throughout."""
    from servelab.replay.core.kv.manager import KVManager
    from servelab.replay.core.kv.prefix_cache import GONE
    from servelab.replay.core.request import Request, Status

    cache = PrefixCache(100_000, 16, 16)
    kv = KVManager(100_000, 16, prefix_cache=cache)
    marked = 0
    for i in range(300):  # the same prompt again and again: each reuses the last one's four blocks
        req = Request(f"r{i}", 0.0, 4 * 16, 1, prefix_hashes=[7, 8, 9, 10], index=i)
        req.status = Status.RUNNING
        hit = kv.lookup(req)
        assert (hit is not None and hit.blocks == 4) == (i > 0)
        if hit is not None:
            kv.claim(req, hit)  # (its run, queued by the last release, leaves the queue's middle)
            marked += 1
            req.num_computed_tokens = hit.tokens
        kv.grow(req, 4)
        req.num_computed_tokens = 64
        kv.register(req)
        kv.check([req])
        req.status = Status.FINISHED
        kv.release(req)
        kv.check([])
        assert sum(seg[0] == GONE for seg in cache.queue) == cache.gone
        assert cache.gone <= 64 or 2 * cache.gone <= len(cache.queue)
    assert marked == 299 and cache.gone < marked / 2  # compacted (no eviction ever took the head)
    assert kv.used == 0 and cache.queued == 100_000
