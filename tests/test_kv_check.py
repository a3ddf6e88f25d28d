"""The KV checks catch what they claim to catch.

``KVManager.check``, ``PrefixCache.check`` and ``BlockNames.check`` (replay/core/kv/) run after every
event of the invariant suites, so they are written for speed: whole-object comparisons and slices
instead of per-block sets. Here, at events of replays with prefix caching and real block ids, each
corruption below is made in the live state: the check must fail, and pass again once it is undone
(each undo restores the state exactly: the replay ends byte-identical to one nobody touched).
"""

from __future__ import annotations

import pytest

import servelab.assembly
from helpers_engine import PagedLinear, checking_engine, synthetic
from sampled_suites import size
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.kv.prefix_cache import GONE, OWN
from servelab.runners.base import make_runner

SPEC = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005"
HASHED = dict(tenants="a=1,b=1,c=1", shared_prefix_tokens=256, turns=3.0, think_s=0.5)


def _set(obj, index, value):
    """``obj[index] = value``; returns the undo."""
    old = obj[index]
    obj[index] = value
    return lambda: obj.__setitem__(index, old)


def _setattr(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _remap(entries: dict, change):
    """``change(entries)``; the undo puts the map back as it was, in its order."""
    saved = list(entries.items())
    change(entries)

    def undo():
        entries.clear()
        entries.update(saved)
    return undo


def _records(kv):
    return kv.cache.records()


def _first(items, test):
    return next((x for x in items if test(x)), None)


# ---- corruptions: (kv, holders) -> undo, or None where the state has nothing to corrupt that way


def queue_segment_blocks(kv, holders):
    seg = _first(kv.cache.queue, lambda s: s[0] != GONE and s[1] > 0)
    return None if seg is None or kv.cache.countable else _set(seg, 1, seg[1] + 1)


def gone_count(kv, holders):
    return None if kv.cache.countable else _setattr(kv.cache, "gone", kv.cache.gone + 1)


def holder_count(kv, holders):
    e = _first(_records(kv), lambda e: e.held)
    if e is not None:
        count = next(iter(e.held))
        return _set(e.held, count, e.held[count] + 1)
    e = _first(_records(kv), lambda e: e.top)
    return None if e is None else _setattr(e, "top", e.top - 1 if e.top > 1 else e.top + 1)


def key_left_out(kv, holders):
    e = _first(_records(kv), lambda e: True)
    return None if e is None else _remap(kv.cache.entries, lambda m: m.pop(e.keys[-1]))


def key_mapped_to_another_entry(kv, holders):
    records = _records(kv)
    if len(records) < 2:
        return None
    a, b = records[0], records[1]
    return _remap(kv.cache.entries, lambda m: m.__setitem__(a.keys[0], b))


def key_listed_by_two_entries(kv, holders):
    records = _records(kv)
    if len(records) < 2:
        return None
    a, b = records[0], records[1]
    a.keys.append(b.keys[0])
    return a.keys.pop


def run_reaching_below_its_floor(kv, holders):
    """A run starting one block lower, into the holdings or the run below it (or before the entry)."""
    for e in _records(kv):
        below = e.top
        for run in e.runs:
            if run[3] == below:
                return _set(run, 3, run[3] - 1)
            below = run[3] + run[1]
    return None


def run_past_the_entry(kv, holders):
    e = _first(_records(kv), lambda e: e.runs)
    if e is None:
        return None
    run = e.runs[-1]
    return _set(run, 3, e.size - run[1] + 1)


def run_not_queued(kv, holders):
    e = _first(_records(kv), lambda e: e.runs)
    return None if e is None else _set(e.runs, 0, list(e.runs[0]))


def queued_run_its_entry_does_not_list(kv, holders):
    e = _first(_records(kv), lambda e: e.runs)
    if e is None:
        return None
    run = e.runs.pop()
    return lambda: e.runs.append(run)


def own_segment_not_queued(kv, holders):
    owner = next(iter(kv.cache.segments), None)
    return None if owner is None else _set(kv.cache.segments, owner, list(kv.cache.segments[owner]))


def aligned_entry_offset(kv, holders):
    e = _first(_records(kv), lambda e: True)
    return None if e is None or not kv.cache.per else _setattr(e, "lo", e.lo + 1)


def used_beyond_the_holders(kv, holders):
    return None if kv.used >= kv.total else _setattr(kv, "used", kv.used + 1)


def cached_block_unnamed(kv, holders):
    e = _first(_records(kv), lambda e: e.ids is not None and e.top)
    return None if e is None else _set(e.ids, 0, None)


def uncached_offset_named(kv, holders):
    e = _first(_records(kv), lambda e: e.ids is not None and None in e.ids)
    return None if e is None else _set(e.ids, e.ids.index(None), 10**9)


def id_in_two_places(kv, holders):
    e = _first(_records(kv), lambda e: e.ids is not None and e.top)
    req = _first(holders, lambda r: r.block_table and len(r.block_table) > (r.cached_keys.blocks if r.cached_keys else 0))
    if e is None or req is None:
        return None
    shared = req.cached_keys.blocks if req.cached_keys else 0
    return _set(req.block_table, shared, e.ids[0])


def table_disagrees_with_its_entry(kv, holders):
    req = _first(holders, lambda r: r.cached_keys is not None and r.cached_keys.blocks and
                 len(r.block_table) > r.cached_keys.blocks)
    if req is None:
        return None
    table = req.block_table
    first, last = table[0], table[-1]
    table[0], table[-1] = last, first

    def undo():
        table[0], table[-1] = first, last
    return undo


def id_lost_from_the_allocator(kv, holders):
    free = kv.cache.names.allocator._free
    if not free:
        return None
    block = free.pop()  # (the heap's last item: the heap stays a heap)
    return lambda: free.append(block)


def own_segment_ids(kv, holders):
    own = kv.cache.names.own
    seg_id = next(iter(own), None)
    if seg_id is None:
        return None
    own[seg_id].append(10**9)
    return own[seg_id].pop


CORRUPTIONS = [queue_segment_blocks, gone_count, holder_count, key_left_out, key_mapped_to_another_entry,
               key_listed_by_two_entries, run_reaching_below_its_floor, run_past_the_entry, run_not_queued,
               queued_run_its_entry_does_not_list, own_segment_not_queued, aligned_entry_offset,
               used_beyond_the_holders, cached_block_unnamed, uncached_offset_named, id_in_two_places,
               table_disagrees_with_its_entry, id_lost_from_the_allocator, own_segment_ids]

CASES = {  # (policy, params, engine, trace shape, the corruptions the state must offer)
    "aligned hashes": ("sarathi", {}, {"num_gpu_blocks": 400}, dict(HASHED, prefix_block_tokens=32),
                       [c for c in CORRUPTIONS if c not in (own_segment_not_queued, own_segment_ids)]),
    "unaligned hashes, KV pressure": ("sarathi", {}, {"num_gpu_blocks": 300},
                                     dict(HASHED, prefix_block_tokens=24),
                                     [c for c in CORRUPTIONS if c is not aligned_entry_offset]),
}
TRIES = 3  # each corruption at this many events (every 5th event looks: the first that offers it, then every 25th)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_corruption_fails_the_kv_check(monkeypatch, case):
    policy, params, engine, shape, expected = CASES[case]
    tried = {c.__name__: 0 for c in CORRUPTIONS}
    events = [0]

    def corrupt_and_check(engine_):
        events[0] += 1
        if events[0] % 5:
            return
        for replica in engine_.replicas:
            kv, holders = replica.kv, list(replica.running)
            for corruption in CORRUPTIONS:
                name = corruption.__name__
                if tried[name] >= TRIES or (tried[name] and events[0] % 25):
                    continue
                undo = corruption(kv, holders)
                if undo is None:
                    continue
                try:
                    with pytest.raises(AssertionError):
                        kv.check(holders)
                finally:
                    undo()
                kv.check(holders)  # (the state as it was passes: the corruption alone failed it)
                tried[name] += 1

    trace = synthetic(n=size(250, 150), rate=40.0, seed=1, **shape)
    config = ReplayConfig(engine=EngineConfig(**engine), policy=policy, policy_params=params, runner=SPEC)
    untouched = replay(trace, config, runner=PagedLinear(make_runner(SPEC)))
    monkeypatch.setattr(servelab.assembly, "Engine", checking_engine(corrupt_and_check, every=1))
    touched = replay(trace, config, runner=PagedLinear(make_runner(SPEC)))
    assert [c.__name__ for c in expected if tried[c.__name__] < TRIES] == []  # each was really made, and failed
    assert touched.requests.equals(untouched.requests) and touched.steps.equals(untouched.steps)
