"""One replica's KV cache: the only code that changes who holds which blocks.

Blocks are counted, not named, unless the runner executes batches against a paged cache (then an
allocator hands out real block ids, kept in ``req.block_table``). Holders:

- a running request holds ``req.kv_blocks`` GPU blocks covering its computed tokens (on-demand,
  vLLM) or its whole reservation of prompt + max_output tokens (reserve mode, fixed at admission);
- requests the batch builder keeps in aggregate (replay/core/batch.py) hold, together, the blocks
  they grew into since they joined it (``aggregate_held``); a request's share is credited to it
  (``settle``) when its counters are made its own again;
- a request preempted by swapping holds host blocks in the swap pool (``host``) until it is
  swapped back in, dropped, or its replica fails (with offload tiers whose first is the replica's
  host DRAM, the pool is that tier: replay/core/kv/tiers.py);
- with prefix caching, blocks no running request holds may still hold reusable KV: the prefix
  cache (replay/core/kv/prefix_cache.py) keeps them in a free queue, and a block shared by several running
  requests is counted once in ``used``.

Invariants (``check``; the tests call it after every event of randomised replays):
``used + free == total``, ``0 <= used <= total``, ``used == sum(kv_blocks of holders) + aggregate_held``,
``host_used == sum(host.values()) <= host_total``.
"""

from __future__ import annotations

from typing import Iterable

from servelab.replay.core.kv.block_names import BlockNames
from servelab.replay.core.kv.prefix_cache import Hit, PrefixCache
from servelab.replay.core.request import Request


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVManager:
    __slots__ = ("block_size", "total", "used", "reserve", "allocator", "aggregate_held", "cache", "register",
                 "swap", "host_total", "host_used", "host", "bytes_per_block", "swap_bytes_per_s", "swap_tier",
                 "overlap_layers", "pending_load_s", "tier_stack", "tier_mark", "layout")

    def __init__(self, total_blocks: int, block_size: int, *, reserve: bool = False, allocator=None,
                 prefix_cache: PrefixCache | None = None, swap: bool = False, host_blocks: int = 0,
                 bytes_per_block: int = 0, swap_bytes_per_s: float = 1.0, overlap_layers: int = 0,
                 layout=None):
        self.block_size = block_size
        self.total = total_blocks
        self.used = 0
        self.reserve = reserve  # conservative reservation of prompt + max_output at admission
        self.allocator = allocator  # hands out real block ids when the runner needs them
        self.aggregate_held = 0  # blocks the requests kept in aggregate grew into since joining it
        # Prefix caching (replay/core/kv/prefix_cache.py): which unheld blocks still hold reusable KV. ``used``
        # then counts blocks held by running requests (a block shared by several once), and ``free``
        # includes cached blocks: taking one evicts what it held.
        self.cache = prefix_cache
        # called with each request an iteration computed tokens of (only when the trace has hashes)
        self.register = prefix_cache.register if prefix_cache is not None and prefix_cache.trace_block else None
        if prefix_cache is not None and allocator is not None:  # cached blocks keep real ids (replay/core/kv/block_names.py)
            names = prefix_cache.names = BlockNames(allocator)
            prefix_cache.countable = False  # (named blocks: the queue's segments stay exact)
            if self.register is not None:
                self.register = lambda req: names.register(prefix_cache, req)
        self.swap = swap  # preemption swaps to the host pool while it has room (else recomputes)
        self.host_total = host_blocks
        self.host_used = 0
        self.host: dict[Request, int] = {}  # swapped-out request -> its host blocks
        self.bytes_per_block = bytes_per_block
        self.swap_bytes_per_s = swap_bytes_per_s
        # with offload tiers whose first is the replica's own (host DRAM), swapping uses it, not a pool
        tiers = prefix_cache.tiers if prefix_cache is not None else None
        self.swap_tier = tiers if swap and tiers is not None and not tiers.tiers[0].spec.shared else None
        if self.swap_tier is not None:
            self.host_total = tiers.tiers[0].capacity
        # > 0: loads from lower tiers run layer by layer (over this many layers) under the admitting
        # iteration's compute instead of before it; their seconds wait here until it is priced
        self.overlap_layers = overlap_layers
        self.pending_load_s = 0.0
        self.tier_stack = tiers  # (None without offload tiers)
        self.tier_mark = 0  # the stack's bytes moved when the last step row was logged
        # A hybrid model's layer groups (replay/core/kv/kv_groups.py KVLayout): a request's blocks are then the
        # sum over its groups (sliding-window groups free what left the window: ``slide``); None: one
        # group of full attention, ceil(tokens / block_size) blocks.
        self.layout = layout

    def tier_bytes(self) -> int:
        """Bytes moved between this replica's GPU memory and its tiers (and between tiers) since the
        last call (only with tiers): loads, swaps, write-backs and write-throughs alike."""
        moved = self.tier_stack.moved
        delta = moved - self.tier_mark
        self.tier_mark = moved
        return delta

    @property
    def free(self) -> int:
        """Blocks a request may take now (with prefix caching: free or cached, evictable)."""
        return self.total - self.used

    # -- questions ----------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks ``req`` must add to compute ``num_new_tokens`` more tokens (0 if it holds enough)."""
        if self.layout is not None:
            if self.reserve:
                target = self.blocks_to_finish(req)
            else:
                target = self.layout.held(req.num_computed_tokens, num_new_tokens)
            extra = target - req.kv_blocks
            return extra if extra > 0 else 0
        if self.reserve:
            target = -(-(req.prompt_tokens + req.max_output_tokens) // self.block_size)
        else:
            target = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = target - req.kv_blocks
        return extra if extra > 0 else 0

    def blocks_to_finish(self, req: Request) -> int:
        """Blocks ``req`` holds at its largest (prompt + max output)."""
        if self.layout is not None:  # (a policy that does not chunk computes the whole prompt in one step)
            layout = self.layout
            most = layout.peak(req.prompt_tokens + req.max_output_tokens)
            whole = layout.held(0, req.prompt_tokens)
            return most if most > whole else whole
        return blocks_for(req.prompt_tokens + req.max_output_tokens, self.block_size)

    def can_ever_fit(self, req: Request) -> bool:
        return self.blocks_to_finish(req) <= self.total

    # -- GPU blocks ---------------------------------------------------------------------------
    def grow(self, req: Request, target: int) -> None:
        """Make ``req`` hold ``target`` blocks (callers checked that they fit)."""
        extra = target - req.kv_blocks
        if extra <= 0:
            return
        self.used += extra
        if self.used > self.total:
            self._over_committed()
        if self.cache is not None:
            self.cache.take(extra)
        req.kv_blocks = target
        if self.allocator is not None:
            if req.block_table is None:
                req.block_table = []
            req.block_table.extend(self.allocator.allocate(extra))

    def grow_all(self, growth: Iterable[tuple[Request, int]]) -> None:
        """``grow`` each ``(request, target)`` of ``growth`` (a batch's or a stretch's requests). The prefix
        cache's free queue gives up the blocks of all of them in one take, the same blocks as one take
        each, unless blocks are named (an allocator) or evictions write back to a tier: their
        bookkeeping is per request."""
        cache = self.cache
        if self.allocator is not None or (cache is not None and cache.tiers is not None and not cache.tiers.write_through):
            for req, target in growth:
                self.grow(req, target)
            return
        extra = 0
        for req, target in growth:
            if target > req.kv_blocks:
                extra += target - req.kv_blocks
                req.kv_blocks = target
        if extra:
            self.used += extra
            if self.used > self.total:
                self._over_committed()
            if cache is not None:
                cache.take(extra)

    def slide(self, items: Iterable[tuple[Request, int]]) -> None:
        """A hybrid layout's step ended: each request of ``items`` gives back the blocks of its
        sliding-window groups that no later token attends to (vLLM frees them before the next step's
        allocation; the same blocks, freed here once). Reservations keep their blocks."""
        if self.reserve:
            return
        between = self.layout.between
        cache = self.cache  # (with prefix caching, replay/core/kv/hybrid_prefix.py: its units there stay cached)
        for req, _ in items:
            target = between(req.num_computed_tokens)
            if target < req.kv_blocks:
                if cache is None:
                    self.used -= req.kv_blocks - target
                else:
                    self.used -= cache.slide(req, req.kv_blocks - target)
                req.kv_blocks = target

    def grow_aggregate(self, blocks: int) -> None:
        """The requests kept in aggregate take ``blocks`` more, together (no block tables: nothing is
        kept in aggregate for runners that need them)."""
        self.used += blocks
        self.aggregate_held += blocks
        if self.used > self.total:
            self._over_committed()
        if self.cache is not None:
            self.cache.take(blocks)

    def settle(self, req: Request, target: int) -> None:
        """A request leaves the aggregate: the blocks it grew into there become its own."""
        self.aggregate_held -= target - req.kv_blocks
        req.kv_blocks = target

    def release(self, req: Request, may_return: bool = False) -> None:
        """``req`` gives back every GPU block it holds (``may_return``: preempted, it will be admitted
        again: with prefix caching its own blocks stay cached for it)."""
        if self.allocator is not None and req.block_table is None:
            req.block_table = []
        if self.cache is not None:
            self.used -= self.cache.release(req, req.kv_blocks, may_return)
        else:
            self.used -= req.kv_blocks
        req.kv_blocks = 0
        if self.allocator is not None and req.block_table is not None:
            if self.cache is None:  # (with prefix caching, the cache returned the ids it does not keep)
                self.allocator.free(req.block_table)
            req.block_table = None

    def pin(self, req: Request):
        """``req`` ended but its hashed blocks stay held, by its chain (KV retention ``keep``,
        replay/core/kv/retention.py): the rest is released; returns the chain, for ``unpin``."""
        chain = req.cached_keys
        self.used -= self.cache.release(req, req.kv_blocks, False, keep_chain=True)
        req.kv_blocks = 0
        req.cached_keys = None
        return chain

    def unpin(self, chain) -> None:
        """A chain ``pin`` kept lets go: its blocks no one else holds are queued, cached."""
        self.used -= self.cache.unpin(chain)

    def offload(self, req: Request) -> None:
        """``req`` ended; its hashed blocks go to the first offload tier, not to the GPU's cache
        (KV retention ``offload``, replay/core/kv/retention.py)."""
        self.used -= self.cache.offload(req, req.kv_blocks)
        req.kv_blocks = 0

    def forget(self, req: Request) -> None:
        """``req`` ended while waiting here (it holds no GPU block): a purged tenant's cached blocks
        (an own segment from a preemption, its prompt's entries) are dropped from every tier."""
        cache = self.cache
        if cache is not None and cache.purge and req.tenant in cache.purge:
            cache.forget(req)

    def releasable(self, req: Request) -> int:
        """Blocks that preempting ``req`` would make free (not those other running requests share)."""
        if self.cache is None or req.cached_keys is None:
            return req.kv_blocks
        return req.kv_blocks - self.cache.shared_blocks(req)

    # -- prefix caching -----------------------------------------------------------------------
    def lookup(self, req: Request) -> Hit | None:
        """The cached prefix ``req`` would reuse if admitted now (None: none, or caching is off).
        Only a request with nothing computed looks (new, or preempted by recompute)."""
        if self.cache is None or req.num_computed_tokens or req.swapped:
            return None
        return self.cache.lookup(req)

    def cached_tokens(self, req: Request) -> int:
        """Tokens of ``req`` this replica's prefix cache would serve if it were admitted now (routers)."""
        hit = self.lookup(req)
        return hit.tokens if hit is not None else 0

    def affinity(self, req: Request) -> tuple[int, int]:
        """(tokens of ``req`` this replica's cache would serve now, of those the ones already in GPU
        memory rather than in a lower tier): what a cache-aware router ranks replicas by."""
        hit = self.lookup(req)
        if hit is None:
            return 0, 0
        if not hit.loaded:
            return hit.tokens, hit.tokens
        in_gpu = hit.tokens - hit.loaded * self.block_size if hit.own else min(hit.shared * self.block_size, hit.tokens)
        return hit.tokens, in_gpu

    def claim(self, req: Request, hit: Hit) -> float:
        """Admission reuses ``hit``: ``req`` holds those blocks (shared ones counted once); returns
        the seconds loading its blocks from lower tiers takes (0 without a lower-tier hit)."""
        self.used += self.cache.claim(req, hit)
        req.kv_blocks = hit.blocks
        if not hit.loaded:
            return 0.0
        # tokens per tier read (the last token is always computed: a hit that would end the prompt has
        # one less, taken from its last block: the last tier read, unless own blocks come after)
        tokens = req.tier_tokens
        if tokens is None:
            tokens = req.tier_tokens = [0] * len(self.cache.tiers.tiers)
        for level, blocks in hit.reads.items():
            tokens[level] += blocks * self.block_size
        if not hit.own:
            tokens[hit.touched[-1][0]] -= (hit.shared + hit.loaded) * self.block_size - hit.tokens
        seconds = self.cache.tiers.load(hit.reads, hit.touched)
        req.kv_load_s += seconds
        if self.overlap_layers:
            self.pending_load_s += seconds
            return 0.0
        return seconds

    def overlap_extra(self, compute_s: float) -> float:
        """Seconds the pending loads add to an iteration computing for ``compute_s`` when loading layer
        l + 1 runs while layer l computes (L layers, each a 1/L share of both): the longer of the two,
        plus one layer's share of the shorter (the first layer's load, or the last layer's compute)."""
        load, layers = self.pending_load_s, self.overlap_layers
        self.pending_load_s = 0.0
        return max(load, compute_s) + min(load, compute_s) / layers - compute_s

    def adopt(self, req: Request, holder: Request) -> None:
        """``req`` takes over the blocks ``holder`` reserved for it here (a KV transfer's landing
        space on a decode replica, replay/cluster/disagg.py); ``req`` held none here before."""
        req.kv_blocks, holder.kv_blocks = holder.kv_blocks, 0

    def _over_committed(self) -> None:
        raise AssertionError(f"KV over-committed: {self.used} > {self.total} blocks")

    # -- the host swap pool -------------------------------------------------------------------
    def swap_out(self, req: Request) -> float | None:
        """Move ``req``'s blocks to the host pool; returns the copy's seconds, or None if swapping is
        off (recompute mode, reservation) or the pool too full: then the caller recomputes and releases."""
        blocks = req.kv_blocks
        if not self.can_swap(blocks) or (self.swap_tier is not None and not self.swap_tier.reserve(blocks)):
            return None
        self.host_used += blocks
        self.host[req] = blocks
        req.swapped = True
        self.release(req)
        return self._copy_s(blocks, True)

    def can_swap(self, blocks: int, planned: int = 0) -> bool:
        """Would ``swap_out`` move ``blocks`` more to the host (after ``planned`` blocks this decision
        already sends there), rather than fall back to recompute? Changes nothing."""
        if not self.swap or self.reserve or self.host_used + planned + blocks > self.host_total:
            return False
        return self.swap_tier is None or self.swap_tier.has_room(planned + blocks)

    def swap_in(self, req: Request) -> float:
        """``req`` was admitted again: its host blocks come back (they are counted into GPU blocks
        by the batch that admitted it); returns the copy's seconds."""
        blocks = self.drop_host(req)
        return self._copy_s(blocks, False)

    def drop_host(self, req: Request) -> int:
        """Forget ``req``'s host copy (swapped in, dropped, or lost); returns its blocks."""
        blocks = self.host.pop(req)
        self.host_used -= blocks
        if self.swap_tier is not None:
            self.swap_tier.unreserve(blocks)
        req.swapped = False
        return blocks

    def _copy_s(self, blocks: int, out: bool) -> float:
        if self.swap_tier is not None:
            return self.swap_tier.swap_s(blocks, out)
        return blocks * self.bytes_per_block / self.swap_bytes_per_s

    def fail(self, running: Iterable[Request]) -> None:
        """The replica went down: every GPU block and the host pool are lost."""
        for req in running:
            self.release(req)
        for req in self.host:
            req.swapped = False
        self.host.clear()
        self.host_used = 0
        self.used -= self.aggregate_held  # (blocks the aggregate took for iterations the failure cut)
        self.aggregate_held = 0
        if self.cache is not None:
            self.cache.clear(self.total)

    # -- invariants ---------------------------------------------------------------------------
    def check(self, holders: Iterable[Request]) -> None:
        """Assert the block accounting adds up (``holders``: every request holding GPU blocks)."""
        assert 0 <= self.used <= self.total, (self.used, self.total)
        assert self.used + self.free == self.total
        holders = list(holders)
        held = sum(req.kv_blocks for req in holders)
        chains = None
        if self.cache is not None:  # a block shared by several running requests is held once
            # each holder's (entry, blocks of it held), or None: read once for the three checks
            chains = [None if req.cached_keys is None else list(req.cached_keys.counts()) for req in holders]
            most: dict = {}  # hashed entry -> the most blocks of it any holder holds
            for pairs in chains:
                for entry, count in pairs or ():
                    held -= count
                    if most.get(entry, 0) < count:
                        most[entry] = count
            held += sum(most.values())
        assert self.used == held + self.aggregate_held, (self.used, held, self.aggregate_held)
        assert 0 <= self.host_used <= self.host_total, (self.host_used, self.host_total)
        assert self.host_used == sum(self.host.values()), (self.host_used, sum(self.host.values()))
        assert all(req.swapped and req.kv_blocks == 0 for req in self.host)
        if self.swap_tier is not None:
            assert self.swap_tier.tiers[0].reserved == self.host_used, (self.swap_tier.tiers[0].reserved, self.host_used)
        if self.cache is not None:
            self.cache.check(self.total, self.used, holders, chains)
            if self.cache.names is not None:
                self.cache.names.check(self.cache, holders, chains)


__all__ = ["KVManager", "blocks_for"]
