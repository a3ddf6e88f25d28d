"""KVManager.grow_all (one take from the prefix cache's free queue for several requests) leaves the
KV state exactly as one grow per request does."""

from __future__ import annotations

import pytest

from servelab.replay.core.kv.manager import KVManager
from servelab.replay.core.kv.prefix_cache import PrefixCache
from servelab.replay.core.request import Request, Status


def held_and_freed(with_cache: bool) -> tuple[KVManager, list[Request]]:
    """64 blocks of 16 tokens; four requests held 8 blocks each and two of them gave theirs back (one
    keeping its computed blocks as its own segment), so the free queue has several segments."""
    cache = PrefixCache(64, 16, None) if with_cache else None
    kv = KVManager(64, 16, prefix_cache=cache)
    reqs = [Request(i, 0.0, 100, 50, index=i) for i in range(6)]
    for req in reqs:
        req.status = Status.RUNNING
    for req in reqs[:4]:
        kv.grow(req, 8)
        req.num_computed_tokens = 100
    kv.release(reqs[1], may_return=True)
    kv.release(reqs[2])
    return kv, reqs


def state(kv: KVManager, reqs: list[Request]):
    cache = kv.cache
    queue = None if cache is None else ([list(entry) for entry in cache.queue],
                                        dict(cache.segments), cache.queued)
    return kv.used, [req.kv_blocks for req in reqs], queue


@pytest.mark.parametrize("with_cache", [True, False])
def test_grow_all_is_one_grow_per_request(with_cache):
    # 35 more blocks: past the fresh segment (32), through a dead one and into the own segment
    growth = [(0, 12), (3, 16), (4, 20), (5, 3), (3, 10)]  # (the last holds fewer than it has: no change)
    one, reqs_one = held_and_freed(with_cache)
    for i, target in growth:
        one.grow(reqs_one[i], target)
    together, reqs_together = held_and_freed(with_cache)
    together.grow_all([(reqs_together[i], target) for i, target in growth])
    assert state(together, reqs_together) == state(one, reqs_one)
    assert together.used == 16 + 35
    if with_cache:
        assert len(together.cache.queue) < len(held_and_freed(True)[0].cache.queue)  # segments were taken whole


def test_grow_all_checks_over_commitment():
    kv, reqs = held_and_freed(False)
    with pytest.raises(AssertionError, match="over-committed"):
        kv.grow_all([(reqs[4], 40), (reqs[5], 10)])
