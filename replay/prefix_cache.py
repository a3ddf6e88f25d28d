"""Prefix caching (vLLM v1 semantics), counted in blocks: which free blocks still hold reusable KV.

Every block not referenced by a running request is in one **free queue**, least recently freed
first. Allocating takes blocks from its head — evicting whatever cached KV they held — and freeing
appends to its tail, a request's blocks in reverse order so that its tail blocks are evicted first
(vLLM's ``FreeKVCacheBlockQueue``). A block holds reusable KV when it is *full* and has a key:

- **hashed blocks** — full blocks of a prompt covered by the trace's ``prefix_hashes``. Engine
  block ``j`` (tokens ``[j*bs, (j+1)*bs)``) is keyed by the trace hash of the trace block holding
  its last token, and ``j``: two requests share it only if their prompts agree through that trace
  block. When the trace's block (``prefix_block_tokens``, Mooncake: 512) is a multiple of the
  engine's, this is exact; otherwise a block straddling two trace blocks needs both to match.
  Hashed blocks are cached as soon as they are computed, reference-counted while running
  requests share them, and evictable once no running request holds them.
- **a request's own blocks** — its other full blocks (tokens not covered by hashes, and generated
  tokens), keyed by the request itself: only that request can hit them, when it is admitted again
  after a preemption by recompute. They are queued as one *segment* per released request (the
  queue keeps runs of blocks, so a replay whose trace has no hashes pays O(1) per release).

A request that is admitted with no computed tokens reuses the longest cached prefix: its hashed
blocks in order while each is cached, then (if all of them hit) its own segment. At least its last
token is always computed, since the iteration that computes it emits the next token (vLLM v1
recomputes the whole last block to keep computed tokens block-aligned; we recompute one token,
as SGLang does). The runner is charged for the tokens computed; attention still reads the context.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.replay.request import Request

FRESH, DEAD, OWN = 0, 1, 2  # kinds of a queued segment: never used, holds nothing reusable, a request's own


class Hit:
    """What an admission reuses: ``keys`` (hashed blocks, in order), ``own`` blocks of its segment."""

    __slots__ = ("keys", "own", "tokens", "claimed")

    def __init__(self, keys: list, own: int, tokens: int, claimed: int):
        self.keys = keys
        self.own = own
        self.tokens = tokens  # prompt (+ generated) tokens it need not compute
        self.claimed = claimed  # of its blocks, how many leave the free queue (were not held by anyone)


class PrefixCache:
    __slots__ = ("block_size", "trace_block", "per_tenant", "queue", "refs", "segments", "seq", "queued")

    def __init__(self, total_blocks: int, block_size: int, trace_block: int | None, per_tenant: bool = False):
        self.block_size = block_size
        self.trace_block = trace_block  # tokens per prefix_hashes entry (None: the trace has no hashes)
        self.per_tenant = per_tenant  # a tenant's requests hit only its own blocks (vLLM's cache salt)
        # The free queue, head first: a hashed key -> None (one block), or a segment id -> [kind, blocks, owner]
        self.queue: OrderedDict = OrderedDict()
        self.refs: dict = {}  # cached hashed key -> running requests holding it (0: queued, evictable)
        self.segments: dict[int, int] = {}  # request index -> id of its own segment in the queue
        self.seq = 0
        self.queued = 0  # blocks in the queue
        self._push_segment(FRESH, total_blocks, None)

    # -- keys -----------------------------------------------------------------------------------
    def hashed_blocks(self, req: "Request") -> int:
        """How many of ``req``'s leading full blocks the trace's hashes identify."""
        hashes = req.prefix_hashes
        if not hashes or self.trace_block is None:
            return 0
        covered = min(req.prompt_tokens, len(hashes) * self.trace_block)
        return covered // self.block_size

    def keys(self, req: "Request", start: int, stop: int) -> list:
        """The keys of ``req``'s hashed blocks j in [start, stop): the trace hash of the trace block
        holding the block's last token, and j (with the tenant first when the cache is per tenant).
        One pass for a run of blocks: long prompts have thousands."""
        hashes, bs, tb = req.prefix_hashes, self.block_size, self.trace_block
        if self.per_tenant:
            tenant = req.tenant
            return [(tenant, hashes[((j + 1) * bs - 1) // tb], j) for j in range(start, stop)]
        return [(hashes[((j + 1) * bs - 1) // tb], j) for j in range(start, stop)]

    # -- the free queue -------------------------------------------------------------------------
    def _push_segment(self, kind: int, blocks: int, owner: int | None) -> None:
        if blocks <= 0:
            return
        self.queued += blocks
        if kind != OWN and self.queue:  # merge with a tail segment of no value
            tail_id = next(reversed(self.queue))
            tail = self.queue[tail_id]
            if tail is not None and tail[0] != OWN:
                tail[1] += blocks
                return
        self.seq += 1
        self.queue[self.seq] = [kind, blocks, owner]
        if kind == OWN:
            self.segments[owner] = self.seq

    def take(self, n: int) -> None:
        """Take ``n`` blocks from the head of the free queue, evicting what they cached."""
        self.queued -= n
        queue, refs = self.queue, self.refs
        pop = queue.popitem
        while n > 0:
            head_id, entry = pop(last=False)
            if entry is None:  # a hashed block: evicted
                del refs[head_id]
                n -= 1
                continue
            if entry[1] > n:  # a run of blocks: its tail blocks go first, so its prefix stays cached
                entry[1] -= n
                queue[head_id] = entry
                queue.move_to_end(head_id, last=False)  # (back at the head, where it was)
                return
            n -= entry[1]
            if entry[0] == OWN:
                del self.segments[entry[2]]

    # -- admission ------------------------------------------------------------------------------
    def lookup(self, req: "Request") -> Hit | None:
        """The longest cached prefix ``req`` (admitted with nothing computed) can reuse, or None."""
        bs = self.block_size
        limit = req.num_tokens - 1  # the last token is always computed
        hashed = min(self.hashed_blocks(req), -(-limit // bs))
        refs = self.refs
        keys = []
        claimed = 0
        start, chunk = 0, 8
        while start < hashed:  # keys a chunk at a time (growing): a hit often ends long before the prompt
            stop = min(hashed, start + chunk)
            for key in self.keys(req, start, stop):
                count = refs.get(key)
                if count is None:
                    break
                keys.append(key)
                claimed += count == 0
            else:
                start, chunk = stop, chunk * 4
                continue
            break
        own = 0
        seg = self.segments.get(req.index)
        if seg is not None and len(keys) == self.hashed_blocks(req):
            own = min(self.queue[seg][1], -(-limit // bs) - len(keys))
            claimed += own
        blocks = len(keys) + own
        if not blocks:
            return None
        return Hit(keys, own, min(blocks * bs, limit), claimed)

    def claim(self, req: "Request", hit: Hit) -> int:
        """Give ``req`` the blocks of ``hit`` (its first ``len(keys) + own`` blocks); returns how many
        of them left the free queue (a block another request of the same batch claimed first does
        not: ``hit.claimed``, counted when the batch was built, is then an overestimate)."""
        refs, queue = self.refs, self.queue
        claimed = hit.own
        for key in hit.keys:
            if refs[key] == 0:
                del queue[key]
                claimed += 1
            refs[key] += 1
        self.queued -= claimed - hit.own
        req.cached_keys = list(hit.keys)
        seg = self.segments.pop(req.index, None)
        if seg is not None:  # what it does not reuse now is stale: plain free blocks, in place
            entry = queue[seg]
            self.queued -= hit.own
            if hit.own >= entry[1]:
                del queue[seg]
            else:
                entry[0], entry[1], entry[2] = DEAD, entry[1] - hit.own, None
        return claimed

    # -- while running ----------------------------------------------------------------------------
    def register(self, req: "Request") -> None:
        """``req`` computed more of its prompt: its newly full hashed blocks become cached (shared)."""
        keys = req.cached_keys
        if keys is None:
            if not req.prefix_hashes:
                return
            keys = req.cached_keys = []
        have = len(keys)
        full = min(req.num_computed_tokens // self.block_size, self.hashed_blocks(req))
        if full <= have:
            return
        refs = self.refs
        for key in self.keys(req, have, full):
            if key in refs:  # computed twice at once (both requests were admitted before either had it):
                return  # this copy stays private (vLLM too caches one of the two)
            refs[key] = 1
            keys.append(key)

    # -- release --------------------------------------------------------------------------------
    def release(self, req: "Request", blocks: int, may_return: bool) -> int:
        """``req`` gives back its ``blocks`` blocks; returns how many no running request holds any
        more. Full blocks keep their KV, cached; a request that ``may_return`` (preempted by
        recompute) keeps its own blocks as a segment only it can hit."""
        keys = req.cached_keys or ()
        shared = len(keys)
        full = max(min(req.num_computed_tokens // self.block_size, blocks), shared)
        hashed = self.hashed_blocks(req)
        refs, queue = self.refs, self.queue
        # freed in reverse block order: the partial last block, own blocks, private hashed blocks, shared ones
        self._push_segment(DEAD, blocks - full, None)
        own = full - max(hashed, shared)
        if own > 0:
            self._push_segment(OWN if may_return else DEAD, own, req.index)
        for key in reversed(self.keys(req, shared, min(full, hashed))):  # hashed blocks it computed privately
            if key in refs:
                self._push_segment(DEAD, 1, None)
            else:
                refs[key] = 0
                queue[key] = None
                self.queued += 1
        freed = blocks - shared
        for key in reversed(keys):
            count = refs[key] - 1
            refs[key] = count
            if not count:
                queue[key] = None
                self.queued += 1
                freed += 1
        req.cached_keys = None
        return freed

    def check(self, total_blocks: int, used: int, running) -> None:
        """The free queue holds exactly the blocks no running request holds; references add up."""
        assert self.queued == total_blocks - used, (self.queued, total_blocks, used)
        assert self.queued == sum(1 if e is None else e[1] for e in self.queue.values())
        held: dict = {}
        for req in running:
            for key in req.cached_keys or ():
                held[key] = held.get(key, 0) + 1
        for key, count in self.refs.items():
            assert count == held.get(key, 0), (key, count, held.get(key, 0))
            assert (count == 0) == (key in self.queue)
        for owner, seg in self.segments.items():
            assert self.queue[seg][0] == OWN and self.queue[seg][2] == owner

    def clear(self, total_blocks: int) -> None:
        """Everything lost (the replica failed)."""
        self.queue.clear()
        self.refs.clear()
        self.segments.clear()
        self.queued = 0
        self._push_segment(FRESH, total_blocks, None)
