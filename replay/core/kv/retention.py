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

The calls that continue a call's context are its session's closed-loop next turn (``session_id`` +
``think_s``), or the requests that depend on it (trace schema v2 ``depends_on``: an agent's next
call, a fan-out's branches); a pin waits for all of them and goes when the first is admitted on its
replica (it then holds the blocks, which its siblings share), or once each has been routed
elsewhere or ended. A call nothing continues is released as in ``lru``. With ``depends_on`` the
trace's hashes already cover a call's output (replay/core/depends.py), so there is nothing to continue.
Retention needs prefix caching and a cost-model runner.
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
    """A finished call's context held for the calls that continue it: a holder like a running
    request (``kv_blocks``, ``cached_keys``: what ``KVManager.check`` counts). ``awaits``: the
    indices of those calls not yet admitted, routed elsewhere or ended."""

    __slots__ = ("replica", "chain", "kv_blocks", "cached_keys", "awaits", "id")

    def __init__(self, replica, chain, awaits: list[int], pin_id: int):
        self.replica = replica
        self.chain = chain
        self.cached_keys = chain
        self.kv_blocks = chain.blocks
        self.awaits = awaits
        self.id = pin_id


class Retention:
    """The engine's retention: pins (``keep``) by the indices of the calls they wait for, and per
    replica oldest first."""

    def __init__(self, engine, mode: str, ttl_s: float | None):
        self.engine = engine
        self.mode = mode
        self.ttl_s = ttl_s
        self.pins: dict[int, list[Pin]] = {}  # a next call's index -> the pins waiting for it (a join: several)
        self.by_replica: dict[int, OrderedDict] = {}  # replica id -> {pin id: pin}, oldest first
        self.made = 0
        self.counts = {"retained": 0, "continued_blocks": 0, "admitted": 0, "moved": 0, "ended": 0,
                       "ttl": 0, "pressure": 0, "failed": 0}
        engine.on_failed.append(self._failed)

    def next_calls(self, req) -> list:
        """The calls that continue ``req``'s context: its session's closed-loop next turn, or the
        requests that depend on it (trace schema v2 ``depends_on``: an agent's next call, a fan-out's
        branches)."""
        engine = self.engine
        follower = engine.followers.get(req.index)
        if follower is not None:
            return [follower]
        depends = engine.depends
        kids = depends.children.get(req.index) if depends is not None else None
        return [engine.requests[c] for c in kids] if kids else []

    # -- a call ends ----------------------------------------------------------------------------
    def finish(self, replica, req, now: float) -> bool:
        """``req`` finished on ``replica``: keep or offload its context for the calls that continue
        it (True), or leave its release to the engine (False: none, or nothing to keep)."""
        kv = replica.kv
        cache = kv.cache
        if cache is None or not cache.trace_block:
            return False
        nexts = self.next_calls(req)
        if not nexts:
            return False
        self._continue(cache, req, nexts[0])
        if self.mode == "offload":
            kv.offload(req)
            self.counts["retained"] += 1
            return True
        chain = req.cached_keys
        if chain is None or not chain.blocks:
            return False
        self.made += 1
        pin = Pin(replica, kv.pin(req), [n.index for n in nexts], self.made)
        for n in nexts:
            self.pins.setdefault(n.index, []).append(pin)
        self.by_replica.setdefault(replica.id, OrderedDict())[pin.id] = pin
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
        """``req`` joined ``replica``: its pins elsewhere stop waiting for it (released once they
        wait for no call)."""
        pins = self.pins.get(req.index)
        if pins:
            for pin in [p for p in pins if p.replica is not replica]:
                self._forget(pin, req.index, "moved")

    def admitted(self, req) -> None:
        """``req`` was admitted (onto its pinned contexts, held now by itself): those pins let go."""
        pins = self.pins.get(req.index)
        if pins:
            for pin in list(pins):
                self._release(pin, "admitted")

    def ended(self, req) -> None:
        """``req`` reached a terminal state: pins still waiting for it stop waiting for it."""
        pins = self.pins.get(req.index)
        if pins:
            for pin in list(pins):
                self._forget(pin, req.index, "ended")

    def _forget(self, pin: Pin, index: int, why: str) -> None:
        pin.awaits.remove(index)
        own = self.pins[index]
        own.remove(pin)
        if not own:
            del self.pins[index]
        if not pin.awaits:
            self._release(pin, why)

    def _expire(self, pin: Pin) -> None:
        if pin.id in self.by_replica.get(pin.replica.id, ()):
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
            for pin in list(pins.values()):
                if kv.free >= need:
                    return
                if any(i in waiting for i in pin.awaits) == pass_waiting:
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
        for index in pin.awaits:
            own = self.pins[index]
            own.remove(pin)
            if not own:
                del self.pins[index]
        pin.awaits = []
        del self.by_replica[pin.replica.id][pin.id]
        pin.replica.kv.unpin(pin.chain)
        self.counts[why] += 1

    # -- for the results and the tests ----------------------------------------------------------------
    def holders(self, replica) -> list[Pin]:
        """The pins ``replica`` holds (``KVManager.check`` counts them with its running requests)."""
        return list(self.by_replica.get(replica.id, {}).values())

    def meta(self) -> dict:
        return {"mode": self.mode, "ttl_s": self.ttl_s,
                "pins_left": sum(len(pins) for pins in self.by_replica.values()), **self.counts}


__all__ = ["MODES", "Pin", "Retention", "check_retention"]
