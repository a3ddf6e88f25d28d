"""KV retention across tool waits: what happens to a session's KV when one of its calls ends and
the next one is still to come (``EngineConfig.kv_retention``; off by default: ``lru``).

An agent's next call sends the whole context again: the previous prompt, the tokens generated, the
tool's output. Whether its prefill recomputes that context or reuses it depends on what the engine
kept during the tool wait:

- ``lru`` (default, today's behaviour): the call's blocks are released; its hashed prompt blocks
  stay cached until least-recently-used eviction reaches them. Its generated tokens' blocks are
  not keyed by any hash, so the next call recomputes them.
- ``keep``: the call's context (prompt and generated tokens) stays in GPU memory, pinned: it cannot
  be evicted, and counts as used, until the session's next call is admitted on this replica (it
  takes the blocks over: it prefills only its new tokens, and the previous call's last output
  token, which that call never computed), arrives on another replica, ends unserved,
  ``kv_retention_ttl_s`` seconds pass, or memory is needed. A released pin's blocks are queued
  as a release queues them (cached, evicted least recently used first). Memory is needed when,
  before a decision, the replica's free blocks do not cover the iteration's largest growth: a new
  block for every decoding request, the blocks of the running requests' next prefill chunks and
  those of the waiting requests' known tokens, in queue order while ``max_num_seqs`` has seats
  (prefill within ``max_num_batched_tokens``): a pin holds only memory nothing waiting could use: pins are then released oldest first (those whose
  next call waits here last) until they do; and when a policy admits nothing while nothing runs
  and requests wait, every pin of the replica goes and the policy is asked again (so retention
  never stalls a replica that would run without it).
- ``offload``: the call's context is written to the first offload tier (``kv_tiers``, needed) and
  its GPU blocks become plain free blocks, the first reused: the wait costs no GPU memory, and the
  next call loads its context from the tier (its read time is charged to the admitting iteration,
  as any lower-tier hit's).

In ``keep`` and ``offload`` the context the next call reuses includes the generated tokens: the
ending call's full blocks past its hashed prompt are cached under the next call's hashes (its
``prefix_hashes`` cover the previous prompt and answer, as a session's do), as vLLM caches decode
blocks. This needs the trace's ``prefix_hashes``; it stops at the first trace block whose hash
differs between the two calls (with ``prefix_block_tokens`` larger than ``block_size`` the ending
call's partial last trace block usually does: then nothing past its hashed prompt is continued).

The next call of a session is the closed-loop follower (``session_id`` + ``think_s``): requests
without one are released as in ``lru``. Retention needs prefix caching and a cost-model runner.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from servelab.common.errors import ServelabError

MODES = ("lru", "keep", "offload")


def check_retention(mode: str, ttl_s: float | None) -> None:
    """Validate the two engine options (``EngineConfig.__post_init__``)."""
    if mode not in MODES:
        raise ServelabError(f"kv_retention must be one of {', '.join(MODES)}; got '{mode}'")
    if ttl_s is not None:
        if not 0 < ttl_s < math.inf:
            raise ServelabError(f"kv_retention_ttl_s must be a finite number of seconds > 0, got {ttl_s}")
        if mode != "keep":
            raise ServelabError(f"kv_retention_ttl_s applies to kv_retention = keep (pinned KV); got kv_retention = {mode}")


class Pin:
    """A finished call's context held for its session's next call: a holder like a running request
    (``kv_blocks``, ``cached_keys``: what ``KVManager.check`` counts)."""

    __slots__ = ("replica", "chain", "kv_blocks", "cached_keys", "follower")

    def __init__(self, replica, chain, follower):
        self.replica = replica
        self.chain = chain
        self.cached_keys = chain
        self.kv_blocks = chain.blocks
        self.follower = follower


class Retention:
    """The engine's retention: pins (``keep``) by the next call's index, per replica oldest first."""

    def __init__(self, engine, mode: str, ttl_s: float | None):
        self.engine = engine
        self.mode = mode
        self.ttl_s = ttl_s
        self.pins: dict[int, Pin] = {}  # next call's index -> its pin
        self.by_replica: dict[int, OrderedDict] = {}  # replica id -> {next call's index: pin}, oldest first
        self.counts = {"retained": 0, "continued_blocks": 0, "admitted": 0, "moved": 0, "ended": 0,
                       "ttl": 0, "pressure": 0, "failed": 0}
        engine.on_failed.append(self._failed)

    # -- a call ends ----------------------------------------------------------------------------
    def finish(self, replica, req, now: float) -> bool:
        """``req`` finished on ``replica``: keep or offload its context for its session's next call
        (True), or leave its release to the engine (False: no next call, or nothing to keep)."""
        follower = self.engine.followers.get(req.index)
        kv = replica.kv
        cache = kv.cache
        if follower is None or cache is None or not cache.trace_block:
            return False
        self._continue(cache, req, follower)
        if self.mode == "offload":
            kv.offload(req)
            self.counts["retained"] += 1
            return True
        chain = req.cached_keys
        if chain is None or not chain.blocks:
            return False
        pin = Pin(replica, kv.pin(req), follower.index)
        self.pins[follower.index] = pin
        self.by_replica.setdefault(replica.id, OrderedDict())[follower.index] = pin
        self.counts["retained"] += 1
        if self.ttl_s is not None:
            self.engine.push(now + self.ttl_s, self.engine.TIMER, lambda t, pin=pin: self._expire(pin))
        return True

    def _continue(self, cache, req, follower) -> None:
        """Cache ``req``'s full blocks past its hashed prompt under ``follower``'s hashes, where the
        two calls' hashes agree on every trace block ``req`` holds so far."""
        theirs = follower.prefix_hashes
        if not theirs:
            return
        ours = req.prefix_hashes or []
        chain = req.cached_keys
        held = chain.blocks if chain is not None else 0
        touched = -(-held * cache.block_size // cache.trace_block)  # trace blocks its chain reaches into
        if touched > len(theirs) or ours[:touched] != theirs[:touched]:
            return
        cache.register(req, theirs)
        after = req.cached_keys.blocks if req.cached_keys is not None else 0
        self.counts["continued_blocks"] += after - held

    # -- the next call ------------------------------------------------------------------------------
    def routed(self, replica, req) -> None:
        """``req`` joined ``replica``: a pin of its context elsewhere is of no use any more."""
        pin = self.pins.get(req.index)
        if pin is not None and pin.replica is not replica:
            self._release(pin, "moved")

    def admitted(self, req) -> None:
        """``req`` was admitted (onto its pinned context, held now by itself): the pin lets go."""
        pin = self.pins.get(req.index)
        if pin is not None:
            self._release(pin, "admitted")

    def ended(self, req) -> None:
        """``req`` reached a terminal state: a pin still waiting for it is released."""
        pin = self.pins.get(req.index)
        if pin is not None:
            self._release(pin, "ended")

    def _expire(self, pin: Pin) -> None:
        if self.pins.get(pin.follower) is pin:
            self._release(pin, "ttl")

    def _failed(self, replica, now: float) -> None:
        """``replica`` went down: its pins go before its KV is lost."""
        for pin in list(self.by_replica.get(replica.id, {}).values()):
            self._release(pin, "failed")

    # -- memory pressure ----------------------------------------------------------------------------
    def before_schedule(self, replica) -> None:
        """Release pins, oldest first, until the replica's free blocks cover the next iteration's
        growth: a block per decoding request, the blocks of the running requests' next prefill
        chunks, and those of the waiting requests' known tokens (queue order, while seats are
        left), the chunks within one token budget: a pin holds only memory that nothing waiting
        could use now. Pins whose next call waits here go last."""
        pins = self.by_replica.get(replica.id)
        if not pins:
            return
        kv = replica.kv
        budget = replica.config.max_num_batched_tokens
        running = replica.running
        if kv.free >= len(running) + -(-budget // kv.block_size) + 1:  # (the most it can need)
            return
        need, left = 0, budget
        for req in running:  # (a decode-cohort member's counters are old, but it decodes: one token)
            n = req.num_tokens - req.num_computed_tokens
            if n <= 1:
                need += 1  # (at most)
            elif left > 0:
                n = min(n, left)
                left -= n
                need += kv.blocks_needed(req, n)
        seats = replica.config.max_num_seqs - len(running)
        for req in replica.waiting:  # (queue order; the policy's may differ: the first ones within the budget)
            if left <= 0 or seats <= 0:
                break
            n = min(req.num_tokens, left)
            left -= n
            seats -= 1
            need += -(-n // kv.block_size)
        if kv.free >= need:
            return
        waiting = {req.index for req in replica.waiting}
        for pass_waiting in (False, True):
            for index, pin in list(pins.items()):
                if kv.free >= need:
                    return
                if (index in waiting) == pass_waiting:
                    self._release(pin, "pressure")

    def unstall(self, replica) -> bool:
        """The policy admitted nothing on ``replica`` while nothing runs and requests wait: release
        every pin it holds (True if there was one; the engine then asks the policy again), so that
        retention never stalls a replica that would run without it."""
        pins = self.by_replica.get(replica.id)
        if not pins:
            return False
        for pin in list(pins.values()):
            self._release(pin, "pressure")
        return True

    def _release(self, pin: Pin, why: str) -> None:
        del self.pins[pin.follower]
        del self.by_replica[pin.replica.id][pin.follower]
        pin.replica.kv.unpin(pin.chain)
        self.counts[why] += 1

    # -- for the results and the tests ----------------------------------------------------------------
    def holders(self, replica) -> list[Pin]:
        """The pins ``replica`` holds (``KVManager.check`` counts them with its running requests)."""
        return list(self.by_replica.get(replica.id, {}).values())

    def meta(self) -> dict:
        return {"mode": self.mode, "ttl_s": self.ttl_s, "pins_left": len(self.pins), **self.counts}


__all__ = ["MODES", "Pin", "Retention", "check_retention"]
