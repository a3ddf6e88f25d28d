"""One replica's KV cache: the only code that changes who holds which blocks.

Blocks are counted, not named, unless the runner executes batches against a paged cache (then an
allocator hands out real block ids, kept in ``req.block_table``). Holders:

- a running request holds ``req.kv_blocks`` GPU blocks covering its computed tokens (on-demand,
  vLLM) or its whole reservation of prompt + max_output tokens (reserve mode, fixed at admission);
- the decode cohort (replay/cohort.py) holds, in aggregate, the blocks its members grew into since
  they joined (``cohort_held``); a member's share is credited to it (``settle``) when it materialises;
- a request preempted by swapping holds host blocks in the swap pool (``host``) until it is
  swapped back in, dropped, or its replica fails;
- with prefix caching, blocks no running request holds may still hold reusable KV: the prefix
  cache (replay/prefix_cache.py) keeps them in a free queue, and a block shared by several running
  requests is counted once in ``used``.

Invariants (``check``; the tests call it after every event of randomised replays):
``used + free == total``, ``0 <= used <= total``, ``used == sum(kv_blocks of holders) + cohort_held``,
``host_used == sum(host.values()) <= host_total``.
"""

from __future__ import annotations

from typing import Iterable

from servelab.replay.prefix_cache import Hit, PrefixCache
from servelab.replay.request import Request


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVManager:
    __slots__ = ("block_size", "total", "used", "reserve", "allocator", "cohort_held", "cache", "register",
                 "swap", "host_total", "host_used", "host", "bytes_per_block", "swap_bytes_per_s")

    def __init__(self, total_blocks: int, block_size: int, *, reserve: bool = False, allocator=None,
                 prefix_cache: PrefixCache | None = None, swap: bool = False, host_blocks: int = 0,
                 bytes_per_block: int = 0, swap_bytes_per_s: float = 1.0):
        self.block_size = block_size
        self.total = total_blocks
        self.used = 0
        self.reserve = reserve  # conservative reservation of prompt + max_output at admission
        self.allocator = allocator  # hands out real block ids when the runner needs them
        self.cohort_held = 0  # blocks the decode cohort's members grew into since joining
        # Prefix caching (replay/prefix_cache.py): which unheld blocks still hold reusable KV. ``used``
        # then counts blocks held by running requests (a block shared by several once), and ``free``
        # includes cached blocks: taking one evicts what it held.
        self.cache = prefix_cache
        # called with each request an iteration computed tokens of (only when the trace has hashes)
        self.register = prefix_cache.register if prefix_cache is not None and prefix_cache.trace_block else None
        self.swap = swap  # preemption swaps to the host pool while it has room (else recomputes)
        self.host_total = host_blocks
        self.host_used = 0
        self.host: dict[Request, int] = {}  # swapped-out request -> its host blocks
        self.bytes_per_block = bytes_per_block
        self.swap_bytes_per_s = swap_bytes_per_s

    @property
    def free(self) -> int:
        """Blocks a request may take now (with prefix caching: free or cached, evictable)."""
        return self.total - self.used

    # -- questions ----------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks ``req`` must add to compute ``num_new_tokens`` more tokens (0 if it holds enough)."""
        if self.reserve:
            target = -(-(req.prompt_tokens + req.max_output_tokens) // self.block_size)
        else:
            target = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = target - req.kv_blocks
        return extra if extra > 0 else 0

    def blocks_to_finish(self, req: Request) -> int:
        """Blocks ``req`` holds at its largest (prompt + max output)."""
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

    def grow_cohort(self, blocks: int) -> None:
        """The decode cohort's members take ``blocks`` more, in aggregate (no block tables: the
        cohort is off for runners that need them)."""
        self.used += blocks
        self.cohort_held += blocks
        if self.used > self.total:
            self._over_committed()
        if self.cache is not None:
            self.cache.take(blocks)

    def settle(self, req: Request, target: int) -> None:
        """A cohort member materialises: the blocks it grew into in the cohort become its own."""
        self.cohort_held -= target - req.kv_blocks
        req.kv_blocks = target

    def release(self, req: Request, may_return: bool = False) -> None:
        """``req`` gives back every GPU block it holds (``may_return``: preempted, it will be admitted
        again: with prefix caching its own blocks stay cached for it)."""
        if self.cache is not None:
            self.used -= self.cache.release(req, req.kv_blocks, may_return)
        else:
            self.used -= req.kv_blocks
        req.kv_blocks = 0
        if self.allocator is not None and req.block_table:
            self.allocator.free(req.block_table)
            req.block_table = None

    def releasable(self, req: Request) -> int:
        """Blocks that preempting ``req`` would make free (not those other running requests share)."""
        if self.cache is None or not req.cached_keys:
            return req.kv_blocks
        refs = self.cache.refs
        return req.kv_blocks - sum(1 for key in req.cached_keys if refs[key] > 1)

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

    def claim(self, req: Request, hit: Hit) -> None:
        """Admission reuses ``hit``: ``req`` holds those blocks (shared ones counted once)."""
        self.used += self.cache.claim(req, hit)
        req.kv_blocks = len(hit.keys) + hit.own

    def adopt(self, req: Request, holder: Request) -> None:
        """``req`` takes over the blocks ``holder`` reserved for it here (a KV transfer's landing
        space on a decode replica, replay/disagg.py); ``req`` held none here before."""
        req.kv_blocks, holder.kv_blocks = holder.kv_blocks, 0

    def _over_committed(self) -> None:
        raise AssertionError(f"KV over-committed: {self.used} > {self.total} blocks")

    # -- the host swap pool -------------------------------------------------------------------
    def swap_out(self, req: Request) -> float | None:
        """Move ``req``'s blocks to the host pool; returns the copy's seconds, or None if swapping is
        off (recompute mode, reservation) or the pool too full: then the caller recomputes and releases."""
        blocks = req.kv_blocks
        if not self.swap or self.reserve or self.host_used + blocks > self.host_total:
            return None
        self.host_used += blocks
        self.host[req] = blocks
        req.swapped = True
        self.release(req)
        return self._copy_s(blocks)

    def swap_in(self, req: Request) -> float:
        """``req`` was admitted again: its host blocks come back (they are counted into GPU blocks
        by the batch that admitted it); returns the copy's seconds."""
        blocks = self.drop_host(req)
        return self._copy_s(blocks)

    def drop_host(self, req: Request) -> int:
        """Forget ``req``'s host copy (swapped in, dropped, or lost); returns its blocks."""
        blocks = self.host.pop(req)
        self.host_used -= blocks
        req.swapped = False
        return blocks

    def _copy_s(self, blocks: int) -> float:
        return blocks * self.bytes_per_block / self.swap_bytes_per_s

    def fail(self, running: Iterable[Request]) -> None:
        """The replica went down: every GPU block and the host pool are lost."""
        for req in running:
            self.release(req)
        for req in self.host:
            req.swapped = False
        self.host.clear()
        self.host_used = 0
        self.cohort_held = 0
        if self.cache is not None:
            self.cache.clear(self.total)

    # -- invariants ---------------------------------------------------------------------------
    def check(self, holders: Iterable[Request]) -> None:
        """Assert the block accounting adds up (``holders``: every request holding GPU blocks)."""
        assert 0 <= self.used <= self.total, (self.used, self.total)
        assert self.used + self.free == self.total
        holders = list(holders)
        held = sum(req.kv_blocks for req in holders)
        if self.cache is not None:  # a block shared by several running requests is held once
            shared = {key for req in holders for key in req.cached_keys or ()}
            held += len(shared) - sum(len(req.cached_keys or ()) for req in holders)
        assert self.used == held + self.cohort_held, (self.used, held, self.cohort_held)
        assert 0 <= self.host_used <= self.host_total, (self.host_used, self.host_total)
        assert self.host_used == sum(self.host.values()), (self.host_used, sum(self.host.values()))
        assert all(req.swapped and req.kv_blocks == 0 for req in self.host)
        if self.cache is not None:
            self.cache.check(self.total, self.used, holders)


__all__ = ["KVManager", "blocks_for"]
