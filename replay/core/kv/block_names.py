"""Real block ids for the prefix cache, when the runner executes batches against a paged KV pool.

The prefix cache (replay/core/kv/prefix_cache.py) counts blocks; a runner with ``needs_block_tables`` must
also know *which* blocks hold a request's KV. ``BlockNames`` names them, following the cache's
own bookkeeping step by step, so that the ids mean exactly what the counts mean:

- an entry's cached blocks (held by running requests, or queued in runs) keep their ids in
  ``Entry.ids`` (offset -> id, None where the entry caches nothing);
- a request's own segment (preempted by recompute) keeps its blocks' ids, in block order;
- every other id is in the allocator: plain free blocks (the queue's FRESH and DEAD segments) and
  the blocks of running requests outside their shared chains (``req.block_table``).

A request admitted onto a cached prefix gets a ``block_table`` that starts with the entries' ids
(the same ids as every other holder: shared, counted by the entries' holdings), then its own
segment's ids; blocks it registers (newly computed hashed blocks) give their ids to the entry.
Evicting a run or segment (the free queue's head is taken) returns exactly its ids to the
allocator, which then hands ids out again, lowest first. Only the torch runner's small replays
pay for this: without an allocator the cache has no ``names`` and runs as before.
"""

from __future__ import annotations

from servelab.replay.core.kv.prefix_cache import FRESH, OWN, RUN, Entry, PrefixCache


class BlockNames:
    __slots__ = ("allocator", "own")

    def __init__(self, allocator):
        self.allocator = allocator
        self.own: dict[int, list[int]] = {}  # own segment's queue id -> its blocks' ids, in block order

    @staticmethod
    def _ids(e: Entry) -> list:
        if e.ids is None:
            e.ids = [None] * e.size
        return e.ids

    def free(self, ids) -> None:
        if ids:
            self.allocator.free(ids)

    def free_cached(self, e: Entry, start: int, stop: int) -> None:
        """The entry's blocks ``[start, stop)`` hold nothing any more: their ids go back."""
        ids = self._ids(e)
        self.free(ids[start:stop])
        ids[start:stop] = [None] * (stop - start)

    def evicted(self, seg_id: int, seg: list, keep: int, count: int) -> None:
        """The free queue's segment ``seg`` keeps its first ``keep`` of ``count`` blocks; the rest are
        taken (evicted): their ids go back to the allocator."""
        kind = seg[0]
        if kind == RUN:
            self.free_cached(seg[2], seg[3] + keep, seg[3] + count)
        elif kind == OWN:
            ids = self.own.pop(seg_id)
            self.free(ids[keep:])
            if keep:
                self.own[seg_id] = ids[:keep]

    def table(self, parts, own: int, seg: int | None) -> list[int]:
        """The block table of a request admitted onto a hit: the ids of ``parts`` ((entry, blocks of it
        from its first), in order), then its own segment's first ``own`` (the segment ``seg``'s other
        ids go back: its rest is stale)."""
        table = []
        for e, got in parts:
            table.extend(e.ids[:got])
        if seg is not None:
            ids = self.own.pop(seg)
            table.extend(ids[:own])
            self.free(ids[own:])
        return table

    def released_own(self, seg_id: int | None, ids: list[int]) -> None:
        """A released request's own blocks: a segment it may hit (``seg_id``), else plain free."""
        if seg_id is None:
            self.free(ids)
        else:
            self.own[seg_id] = list(ids)

    def release_private(self, e: Entry, table: list[int], start: int, stop: int) -> None:
        """A released request's private copies of ``e``'s blocks ``[start, stop)`` (``table``: its
        block table): where the entry caches the block already, the copy is freed, else it is cached."""
        ids = self._ids(e)
        lo = e.lo
        for j in range(start, stop):
            if ids[j] is None:
                ids[j] = table[lo + j]
            else:
                self.allocator.free((table[lo + j],))

    def register(self, cache: PrefixCache, req) -> None:
        """``cache.register``, then the blocks it made shared give the entries their ids."""
        chain = req.cached_keys
        have = chain.blocks if chain is not None else 0
        cache.register(req)
        chain = req.cached_keys
        if chain is None or chain.blocks <= have:
            return
        table = req.block_table
        for e, count in chain.counts():
            lo = max(have, e.lo)
            hi = e.lo + count
            if hi > lo:
                ids = self._ids(e)
                for p in range(lo, hi):
                    assert ids[p - e.lo] is None, (e.key, p)
                    ids[p - e.lo] = table[p]

    def clear(self, cache: PrefixCache) -> None:
        """The replica failed (its running requests were released first): every cached id goes back."""
        for e in cache.records():
            if e.ids is not None:
                self.free([i for i in e.ids if i is not None])
                e.ids = None
        for ids in self.own.values():
            self.free(ids)
        self.own.clear()

    # -- invariants ---------------------------------------------------------------------------
    def check(self, cache: PrefixCache, holders, chains: list | None = None) -> None:
        """Every id is in exactly one place; holders' tables start with their entries' ids; an
        entry names exactly its cached blocks; the allocator's free ids are the queue's plain blocks
        (``chains``: as for ``PrefixCache.check``).
        (Called after ``cache.check``, which asserts an entry's runs are disjoint and above its
        holdings: the cached offsets are then ``[0, top)`` and each run's, and slices check them.)"""
        seen: list[int] = []
        for e in cache.records():
            ids = e.ids
            if ids is None:
                assert not e.top and not e.runs, (e.key, e.top, e.runs)  # names nothing: caches nothing
                continue
            cached = e.top
            parts = [ids[:cached]]
            for run in e.runs:
                parts.append(ids[run[3]:run[3] + run[1]])
                cached += run[1]
            named = len(ids) - ids.count(None)
            # the cached offsets are named (the slices are whole and hold no None), and nothing else is
            assert sum(map(len, parts)) == cached == named, (e.key, ids, e.top, e.runs)
            for part in parts:
                assert None not in part, (e.key, ids, e.top, e.runs)
                seen.extend(part)
        own = {seg[4]: seg for seg in cache.queue if seg[0] == OWN}
        for seg_id, ids in self.own.items():
            seg = own[seg_id]
            assert seg[1] == len(ids), (seg_id, seg, ids)
            seen.extend(ids)
        holders = list(holders)
        if chains is None:
            chains = [None if req.cached_keys is None else list(req.cached_keys.counts()) for req in holders]
        for req, pairs in zip(holders, chains, strict=True):
            table = req.block_table or []
            assert len(table) == req.kv_blocks, (req.request_id, len(table), req.kv_blocks)
            shared = 0
            if req.cached_keys is not None:
                for e, count in pairs:
                    assert table[e.lo:e.lo + count] == e.ids[:count], (req.request_id, e.key)
                shared = req.cached_keys.blocks
            seen.extend(table[shared:])
        plain = sum(seg[1] for seg in cache.queue if seg[0] <= FRESH + 1)  # FRESH, DEAD
        alloc = self.allocator
        assert alloc.num_free == plain, (alloc.num_free, plain)
        assert len(seen) == len(set(seen)) == alloc.num_used, (len(seen), len(set(seen)), alloc.num_used)


__all__ = ["BlockNames"]
