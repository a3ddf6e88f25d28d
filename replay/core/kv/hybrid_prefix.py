"""Prefix caching per KV layer group of a hybrid model (vLLM v1's hybrid KV cache manager), counted in pool blocks.

A hybrid model (replay/core/kv/kv_groups.py) keeps full-attention, sliding-window and state (linear
attention, Mamba) groups in one block pool. What a cached prefix needs differs by group, and a hit
is the longest prefix of ``h`` blocks (``h * block_size`` tokens) that *every* group can serve
(vLLM ``HybridKVCacheCoordinator.find_longest_cache_hit``, whose fixed point is that length):

- a **full** group needs every block ``0 .. h-1`` cached (``FullAttentionManager``);
- a **sliding-window** group needs only the blocks holding the window before the hit point, blocks
  ``floor(max(0, h*bs - window + 1) / bs) .. h-1`` (``SlidingWindowManager``: the earlier ones
  are null blocks; the next token attends to ``window`` tokens, its own included);
- a **state** group needs the state after exactly ``h * bs`` tokens (``MambaManager``, cache mode
  ``align``: a state is saved only at block boundaries, so hits are block-aligned; the lookup takes
  the right-most cached state). A state is cached at the last block boundary each step reached
  (vLLM's ``align`` mode cuts a prefill chunk at a block boundary so that the state there exists;
  the extra step that cut costs is not priced here). The hit's state is copied into the request's
  own state block, so the request holds no cached state, only reads it.

The hit is at most ``(tokens - 1) // bs`` blocks (vLLM's ``max_length = num_tokens - 1``: the last
token is always computed). The unit of caching is one block position of one group *kind*: ``F``
(one block in each full group), ``S`` (in each sliding group) or ``M`` (a state in each state
group), worth that many pool blocks. Keys are the trace's ``prefix_hashes`` (replay/core/kv/prefix_cache.py):
engine block ``j`` is keyed by the trace block holding its last token, and ``j``.

Bookkeeping: every pool block no running request holds is free; free blocks are plain (``plain``) or
cached units in an LRU queue (head evicted first). Allocation takes plain blocks first, then evicts
units from the head (a unit larger than what is still needed leaves its rest plain). A unit held by
running requests has ``refs`` > 0 and is out of the queue; the requests' ``Chain`` lists what each
holds, so a unit shared by several is counted once (``KVManager.check``). A request registers its
newly full hashed blocks after each step (up to the first already cached by another: its copy stays
private, as in replay/core/kv/prefix_cache.py); its sliding-window units leave it when they leave the window,
and all its units go to the queue's tail (reverse block order) when it is released.

Cost: per engine block, not per trace block as replay/core/kv/prefix_cache.py (a hybrid model only).
Not modelled with a hybrid model (refused in assembly.py): offload tiers, KV retention, per-tenant
purge, real block ids (a runner that executes batches), a preempted request's own (unhashed) blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from servelab.replay.core.kv.prefix_cache import Hit

if TYPE_CHECKING:
    from servelab.replay.core.kv.kv_groups import KVLayout
    from servelab.replay.core.request import Request


class Unit:
    """One cached block position of one group kind: ``blocks`` pool blocks, held by ``refs`` requests."""

    __slots__ = ("key", "blocks", "refs")

    def __init__(self, key, blocks: int):
        self.key = key
        self.blocks = blocks
        self.refs = 0


class Chain:
    """The units a running request holds: its full units (blocks ``0 .. len-1``) and its sliding units
    by block index (those still in its window)."""

    __slots__ = ("full", "sliding", "done", "state")

    def __init__(self):
        self.full: list[Unit] = []
        self.sliding: dict[int, Unit] = {}
        self.done = 0  # blocks registered (or claimed) so far
        self.state = 0  # the last block boundary whose state it cached

    @property
    def blocks(self) -> int:
        return len(self.full)

    def counts(self):
        """(unit, pool blocks of it held), as ``KVManager.check`` reads a chain."""
        for u in self.full:
            yield u, u.blocks
        for u in self.sliding.values():
            yield u, u.blocks


class HybridPrefixCache:
    __slots__ = ("block_size", "trace_block", "per_tenant", "layout", "units", "queue", "plain", "queued",
                 "tiers", "purge", "names", "keep_outputs", "_per")

    def __init__(self, total_blocks: int, layout: "KVLayout", trace_block: int | None, per_tenant: bool = False):
        self.block_size = layout.block_size
        self.trace_block = trace_block
        self.per_tenant = per_tenant
        self.layout = layout
        full, sliding, state = layout.groups
        self._per = {"F": full, "S": sliding, "M": state}  # pool blocks per unit of each kind
        self.units: dict = {}  # key -> Unit (held or queued)
        self.queue: OrderedDict = OrderedDict()  # key -> Unit, cached and unheld, head evicted first
        self.plain = total_blocks  # free blocks holding nothing reusable
        self.queued = 0  # pool blocks in the queue
        self.tiers = None  # (the interface replay/core/kv/manager.py reads; none of these is modelled here)
        self.purge = frozenset()
        self.names = None
        self.keep_outputs = False

    # -- keys -------------------------------------------------------------------------------------
    def hashed_blocks(self, req: "Request") -> int:
        hashes = req.prefix_hashes
        if not hashes or self.trace_block is None:
            return 0
        tokens = req.prompt_tokens + req.output_tokens if self.keep_outputs else req.prompt_tokens
        return min(tokens, len(hashes) * self.trace_block) // self.block_size

    def _keys(self, req: "Request", stop: int) -> list:
        """The keys of ``req``'s engine blocks ``0 .. stop-1`` (salted as replay/core/kv/prefix_cache.py does)."""
        bs, tb, hashes = self.block_size, self.trace_block, req.prefix_hashes
        salt = req.tenant if self.per_tenant else None
        if req.lora_adapter is not None:
            salt = ("lora", req.lora_adapter, salt)
        keys = []
        for j in range(stop):
            i = ((j + 1) * bs - 1) // tb
            keys.append((salt, hashes[i], i, j))
        return keys

    def _first_in_window(self, tokens: int) -> int:
        """The first block a sliding group holds with ``tokens`` computed (a hit of that many tokens
        needs it and those after it)."""
        skipped = tokens - self.layout.kinds.window + 1
        return skipped // self.block_size if skipped > 0 else 0

    # -- the free pool ----------------------------------------------------------------------------
    def spare(self) -> int:
        """Blocks ``take`` gives up before evicting a unit (the plain ones): no hit changes before."""
        return self.plain

    def take(self, n: int) -> None:
        """``n`` free blocks are allocated: plain ones first, then units evicted from the queue's head."""
        if n <= self.plain:
            self.plain -= n
            return
        n -= self.plain
        self.plain = 0
        queue, units = self.queue, self.units
        while n > 0:
            key, u = queue.popitem(last=False)
            del units[key]
            self.queued -= u.blocks
            if u.blocks > n:
                self.plain += u.blocks - n
            n -= u.blocks

    def _unhold(self, u: Unit) -> int:
        """A holder lets go of ``u``; returns the pool blocks that became free (queued at the tail)."""
        u.refs -= 1
        if u.refs:
            return 0
        self.queue[u.key] = u
        self.queued += u.blocks
        return u.blocks

    # -- admission --------------------------------------------------------------------------------
    def lookup(self, req: "Request") -> Hit | None:
        """The longest prefix of whole blocks that every group can serve, or None."""
        most = min(self.hashed_blocks(req), (req.num_tokens - 1) // self.block_size)
        if most <= 0:
            return None
        keys = self._keys(req, most)
        units = self.units
        per = self._per
        full, sliding, state = per["F"], per["S"], per["M"]
        h = most
        if full:  # the longest run of cached full blocks from the first
            for j, key in enumerate(keys):
                if ("F",) + key not in units:
                    h = j
                    break
        while h > 0:
            if state and ("M",) + keys[h - 1] not in units:
                h -= 1
                continue
            if sliding:
                lo = self._first_in_window(h * self.block_size)
                gap = next((j for j in range(h - 1, lo - 1, -1) if ("S",) + keys[j] not in units), None)
                if gap is not None:
                    h = gap  # (no hit ending past a missing window block can be served)
                    continue
            break
        if h <= 0:
            return None
        held = []
        if full:
            held += [units[("F",) + keys[j]] for j in range(h)]
        if sliding:
            held += [units[("S",) + keys[j]] for j in range(self._first_in_window(h * self.block_size), h)]
        blocks = sum(u.blocks for u in held)
        claimed = sum(u.blocks for u in held if not u.refs)
        hit = Hit(held, blocks, 0, h * self.block_size, claimed)
        return hit

    def claim(self, req: "Request", hit: Hit) -> int:
        """``req`` holds ``hit``'s units; returns the pool blocks that left the free queue."""
        chain = req.cached_keys = Chain()
        claimed = 0
        h = chain.done = chain.state = hit.tokens // self.block_size
        lo = self._first_in_window(hit.tokens)
        for u in hit.keys:
            if not u.refs:
                del self.queue[u.key]
                self.queued -= u.blocks
                claimed += u.blocks
            u.refs += 1
            if u.key[0] == "F":
                chain.full.append(u)
            else:
                chain.sliding[lo] = u
                lo += 1
        return claimed

    # -- while running ------------------------------------------------------------------------------
    def register(self, req: "Request") -> None:
        """``req`` computed more: its newly full hashed blocks, and the state at the last block
        boundary it reached, become cached."""
        bs = self.block_size
        hashed = self.hashed_blocks(req)
        full_now = min(req.num_computed_tokens // bs, hashed)
        if full_now <= 0:
            return
        chain = req.cached_keys
        if chain is None:
            chain = req.cached_keys = Chain()
        per = self._per
        units = self.units
        start = chain.done
        boundary = req.num_computed_tokens // bs
        state = per["M"] and chain.state < boundary <= hashed
        if full_now <= start and not state:
            return
        keys = self._keys(req, full_now)
        if state:  # a copy of its state at that boundary: cached, not held (vLLM frees it two steps on)
            chain.state = boundary
            key = ("M",) + keys[boundary - 1]
            if key not in units and self.plain + self.queued >= per["M"]:
                self.take(per["M"])
                u = units[key] = Unit(key, per["M"])
                self.queue[key] = u
                self.queued += u.blocks
        held_from = start
        if per["S"]:  # the first block its sliding groups hold (one that landed from a prefill replica, or
            # came back from a swap, never held those before its window): from what it holds now
            blocks_now = -(-req.num_computed_tokens // bs)
            rest = req.kv_blocks - per["F"] * blocks_now - per["M"]
            held_from = max(start, blocks_now - rest // per["S"])
        for kind, blocks in (("F", per["F"]), ("S", per["S"])):
            if not blocks:
                continue
            if kind == "F" and len(chain.full) != start:
                continue  # (an earlier block of its was a private copy)
            for j in range(start if kind == "F" else held_from, full_now):
                key = (kind,) + keys[j]
                if key in units:  # cached by another request: this copy stays private (a full group's
                    if kind == "F":  # later ones too: its chain is a prefix)
                        break
                    continue
                u = units[key] = Unit(key, blocks)
                u.refs = 1
                if kind == "F":
                    chain.full.append(u)
                else:
                    chain.sliding[j] = u
        chain.done = full_now

    def slide(self, req: "Request", dropped: int) -> int:
        """``req``'s sliding groups let go of ``dropped`` pool blocks, those below its window; returns
        how many no running request holds any more (its units there that others hold stay held)."""
        chain = req.cached_keys
        shared = units = 0
        if chain is not None and chain.sliding:
            first = self._first_in_window(req.num_computed_tokens)
            for j in [j for j in chain.sliding if j < first]:
                u = chain.sliding.pop(j)
                units += u.blocks
                if not self._unhold(u):
                    shared += u.blocks
        self.plain += dropped - units
        return dropped - shared

    # -- release -----------------------------------------------------------------------------------
    def release(self, req: "Request", blocks: int, may_return: bool, keep_chain: bool = False) -> int:
        """``req`` gives back its ``blocks``; returns how many no running request holds any more.
        Its units go to the queue's tail, last block first; the rest are plain."""
        chain = req.cached_keys
        in_units = freed = 0
        if chain is not None:
            order = sorted([(j, u) for j, u in enumerate(chain.full)] + list(chain.sliding.items()),
                           key=lambda ju: -ju[0])
            for _, u in order:
                in_units += u.blocks
                freed += self._unhold(u)
            req.cached_keys = None
        self.plain += blocks - in_units
        return freed + blocks - in_units

    # -- questions from the KV manager and the batch builder ----------------------------------------
    def shared_blocks(self, req: "Request") -> int:
        chain = req.cached_keys
        if chain is None:
            return 0
        return sum(u.blocks for u, _ in chain.counts() if u.refs > 1)

    def sole_blocks(self, req: "Request", into: dict) -> None:
        chain = req.cached_keys
        if chain is None:
            return
        for u, _ in chain.counts():
            if u.refs == 1:
                into[u] = True

    @staticmethod
    def covered(hits, sole: dict) -> int:
        """Pool blocks of the units in ``sole`` that at least one of ``hits`` reuses, each unit once
        (``PrefixCache.covered``)."""
        return sum(u.blocks for u in {u for hit in hits for u in hit.keys if u in sole})

    def check(self, total_blocks: int, used: int, running, chains: list | None = None) -> None:
        """Free blocks are plain or queued units; a unit's refs are its holders; queued units are unheld
        (``chains``: accepted for the KV manager's one call; the units are counted from ``running`` here)."""
        assert self.plain >= 0 and self.plain + self.queued == total_blocks - used, (self.plain, self.queued, used)
        assert self.queued == sum(u.blocks for u in self.queue.values())
        refs: dict = {}
        for req in running:
            chain = req.cached_keys
            if chain is None:
                continue
            for u, _ in chain.counts():
                refs[u] = refs.get(u, 0) + 1
        for key, u in self.units.items():
            assert u.key == key
            assert u.refs == refs.pop(u, 0), (key, u.refs)
            assert (key in self.queue) == (u.refs == 0), key
        assert not refs, refs
        assert all(self.units.get(k) is u for k, u in self.queue.items())

    def clear(self, total_blocks: int) -> None:
        self.units.clear()
        self.queue.clear()
        self.queued = 0
        self.plain = total_blocks


__all__ = ["HybridPrefixCache"]
