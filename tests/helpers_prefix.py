"""The prefix cache's state as a cache of one entry per key keeps it: the reference its entries of
many keys (replay/core/kv/prefix_cache.py) are compared against."""

from __future__ import annotations

from servelab.replay.core.kv.prefix_cache import PrefixCache


def per_key_view(cache: PrefixCache):
    """The cache's state as one entry per key keeps it (the reference: the general path's entries each
    have one key, the aligned path's many): the free queue, GONE segments left out, plain segments
    merged, each run cut per key (the highest key first, as a per-key release queues them); and per
    key with a cached block, its holdings, ``top`` and queued runs (offsets within the key)."""
    from servelab.replay.core.kv.prefix_cache import GONE, OWN, RUN

    def slices(e):
        if len(e.keys) == 1:
            return [(e.keys[0], 0, e.size)]
        return [(key, j * cache.per, cache.per) for j, key in enumerate(e.keys)]

    queue = []
    for seg in cache.queue:
        if seg[0] == GONE:
            continue
        if seg[0] == RUN:
            start, stop = seg[3], seg[3] + seg[1]
            for key, a, size in reversed(slices(seg[2])):
                lo, hi = max(start, a), min(stop, a + size)
                if hi > lo:
                    queue.append((RUN, hi - lo, key, lo - a))
        elif seg[0] == OWN:
            queue.append((OWN, seg[1], seg[2]))
        elif queue and queue[-1][0] == "plain":
            queue[-1] = ("plain", queue[-1][1] + seg[1])
        else:
            queue.append(("plain", seg[1]))
    keys = {}
    for e in cache.records():
        for key, a, size in slices(e):
            def clamp(c):
                return min(max(c - a, 0), size)
            held: dict = {}
            for count, holders in e.holdings().items():
                if clamp(count):
                    held[clamp(count)] = held.get(clamp(count), 0) + holders
            runs = tuple((max(r[3], a) - a, min(r[3] + r[1], a + size) - max(r[3], a))
                         for r in e.runs if r[3] < a + size and r[3] + r[1] > a)
            if held or runs:
                keys[key] = (tuple(sorted(held.items())), clamp(e.top), runs)
    return cache.queued, tuple(queue), keys
