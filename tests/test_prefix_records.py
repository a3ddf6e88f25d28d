"""An entry of many hash blocks (replay/core/kv/prefix_cache.py) behaves as one entry per hash block.

The aligned cache keeps a request's run of new hash blocks as one entry (one object, one release
run, one eviction) and cuts it only where another request's keys meet it after its first key. The
reference is the same cache with its aligned paths off (``per = 0``): then every entry has one key,
the per-key bookkeeping of earlier sessions. Both are driven through the same operations and must
agree after every one: hits, blocks claimed and freed, and the state per key (``per_key_view``:
free queue in eviction order, holdings, queued runs), with the KV checks passing on both.
"""

from __future__ import annotations

import random

import pytest

from helpers_prefix import per_key_view
from servelab.replay.core.kv.manager import KVManager, blocks_for
from servelab.replay.core.kv.prefix_cache import PrefixCache
from servelab.replay.core.request import Request, Status
from servelab.runners.paged_kv import BlockAllocator

BS, TB = 16, 64  # 4 engine blocks per hash block


class Pair:
    """The same replica twice: an aligned cache and its one-key-per-entry reference."""

    def __init__(self, total: int, named: bool):
        self.kvs = []
        for general in (False, True):
            cache = PrefixCache(total, BS, TB)
            if general:
                cache.per = 0
            allocator = BlockAllocator(total) if named else None
            self.kvs.append(KVManager(total, BS, prefix_cache=cache, allocator=allocator))
        self.reqs: dict[int, list[Request]] = {}

    def new(self, index: int, prompt: int, hashes: list[int]) -> None:
        self.reqs[index] = [Request(index, 0.0, prompt, 1, prefix_hashes=list(hashes), index=index)
                            for _ in self.kvs]

    def agree(self) -> None:
        views = [per_key_view(kv.cache) for kv in self.kvs]
        assert views[0] == views[1]
        assert self.kvs[0].used == self.kvs[1].used
        for side, kv in enumerate(self.kvs):
            kv.check([pair[side] for pair in self.reqs.values() if pair[side].kv_blocks])

    def admit(self, index: int) -> int:
        """Admit request ``index`` onto what the cache has; returns the tokens it reuses."""
        hits = []
        for kv, req in zip(self.kvs, self.reqs[index]):
            hit = kv.lookup(req)
            hits.append(None if hit is None else (hit.tokens, hit.blocks, hit.shared, hit.own, hit.claimed))
            if hit is not None:
                kv.claim(req, hit)
                req.num_computed_tokens = hit.tokens
            req.status = Status.RUNNING
        assert hits[0] == hits[1]
        self.agree()
        return hits[0][0] if hits[0] else 0

    def compute(self, index: int, tokens: int) -> bool:
        """Request ``index`` computes ``tokens`` more (False: its blocks do not fit)."""
        first = self.reqs[index][0]
        target = blocks_for(first.num_computed_tokens + tokens, BS)
        if target - first.kv_blocks > self.kvs[0].free:
            return False
        for kv, req in zip(self.kvs, self.reqs[index]):
            kv.grow(req, target)
            req.num_computed_tokens += tokens
            if kv.register is not None:
                kv.register(req)
        self.agree()
        return True

    def release(self, index: int, preempted: bool) -> None:
        for kv, req in zip(self.kvs, self.reqs[index]):
            req.status = Status.WAITING if preempted else Status.FINISHED
            kv.release(req, may_return=preempted)
            req.num_computed_tokens = 0
        self.agree()


def test_a_private_chain_shared_in_its_middle_is_cut_there_and_evicted_top_first():
    """A's four hash blocks are one entry; B's hashes meet them only from the third (hashes that are
    not chained), so B's lookup reuses nothing and its registering cuts A's entry there: B holds
    the upper part A also holds. Then both end, and the queue evicts the blocks as per-key entries
    would: B's own first blocks, then A's entry from its top, partly."""
    pair = Pair(40, named=False)
    pair.new(0, 4 * TB + 1, [1, 2, 3, 4])
    pair.admit(0)
    assert pair.compute(0, 4 * TB)
    entry = pair.kvs[0].cache.entries[(1, 0)]
    assert len(entry.keys) == 4 and len(pair.kvs[1].cache.entries[(1, 0)].keys) == 1
    pair.new(1, 4 * TB + 1, [9, 8, 3, 4])  # (3, 2) and (4, 3): A's keys after its first
    assert pair.admit(1) == 0
    assert pair.compute(1, 4 * TB)
    cut = pair.kvs[0].cache.entries[(3, 2)]
    assert cut is not entry and cut.lo == 2 * TB // BS and entry.size == 2 * TB // BS and entry.next is cut
    assert cut.held is None and cut.top == cut.size  # (B stopped there: A holds it, B's copy stays private)
    pair.release(0, preempted=False)
    pair.release(1, preempted=False)
    pair.new(2, 9 * TB, [5, 6, 7, 8, 9, 10, 11, 12, 13])  # takes most blocks: evictions
    pair.admit(2)
    assert pair.compute(2, 30 * BS)
    assert pair.kvs[0].cache.entries  # (something is still cached)
    pair.release(2, preempted=False)


def test_a_hit_that_starts_inside_an_entry_cuts_it_when_claimed():
    """A's entry (keys (1, 0) .. (4, 3)) is met from its second key by B, whose first hash differs
    ((7, 0), then (2, 1), (3, 2)): B's registering cuts A's entry at (2, 1) and holds the part above.
    C, with B's hashes, then hits B's first key and the cut part: three hash blocks, real block ids
    following the cache on both sides."""
    pair = Pair(64, named=True)
    pair.new(0, 4 * TB + 1, [1, 2, 3, 4])
    pair.admit(0)
    assert pair.compute(0, 4 * TB + 1)
    pair.release(0, preempted=False)
    pair.new(1, 3 * TB + 1, [7, 2, 3])  # misses its first key: computes it, then meets A's entry at (2, 1)
    assert pair.admit(1) == 0
    assert pair.compute(1, 3 * TB + 1)
    assert pair.kvs[0].cache.splits >= 1
    pair.release(1, preempted=False)
    pair.new(2, 3 * TB + 1, [7, 2, 3])  # now hits B's first key and A's cut part
    assert pair.admit(2) == 3 * TB
    pair.release(2, preempted=False)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("named", [False, True])
def test_random_operations_leave_both_caches_alike(seed, named):
    """Random prompts whose hashes collide without sharing a prefix (cuts), chunked prefills, KV
    pressure (evictions, partial ones), preemptions (own segments) and returns."""
    rng = random.Random(seed)
    pair = Pair(rng.choice([60, 90, 140]), named)
    waiting, running, done, index = [], [], 0, 0
    while done < 40:
        if len(running) < 3 and (waiting or rng.random() < 0.6):
            if waiting and rng.random() < 0.5:
                i = waiting.pop(0)
            else:
                i, index = index, index + 1
                keys = rng.randint(1, 7)
                hashes = [rng.choice([1, 2]) if rng.random() < 0.7 else rng.randint(3, 9) for _ in range(keys)]
                pair.new(i, keys * TB - rng.choice([0, 0, 5, 40]) + rng.randint(0, 1), hashes)
            pair.admit(i)
            running.append(i)
        if not running:
            continue
        i = rng.choice(running)
        req = pair.reqs[i][0]
        left = req.prompt_tokens - req.num_computed_tokens
        if left and pair.compute(i, min(left, rng.choice([BS, 40, TB, 3 * TB]))):
            continue
        running.remove(i)
        if left and rng.random() < 0.8:  # preempted by recompute (or it did not fit)
            pair.release(i, preempted=True)
            waiting.append(i)
        else:
            pair.release(i, preempted=False)
            done += 1
    for i in running:
        pair.release(i, preempted=False)
    assert pair.kvs[0].used == 0
