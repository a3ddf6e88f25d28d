"""One replica's KV cache: the only code that changes who holds which blocks.

Blocks are counted, not named, unless the runner executes batches against a paged cache (then an
allocator hands out real block ids, kept in ``req.block_table``). Holders:

- a running request holds ``req.kv_blocks`` GPU blocks covering its computed tokens (on-demand,
  vLLM) or its whole reservation of prompt + max_output tokens (reserve mode, fixed at admission);
- the decode cohort (replay/cohort.py) holds, in aggregate, the blocks its members grew into since
  they joined (``cohort_held``); a member's share is credited to it (``settle``) when it materialises;
- a request preempted by swapping holds host blocks in the swap pool (``host``) until it is
  swapped back in, dropped, or its replica fails.

Invariants (``check``; the tests call it after every event of randomised replays):
``used + free == total``, ``0 <= used <= total``, ``used == sum(kv_blocks of holders) + cohort_held``,
``host_used == sum(host.values()) <= host_total``.
"""

from __future__ import annotations

from typing import Iterable

from servelab.replay.request import Request


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVManager:
    __slots__ = ("block_size", "total", "used", "reserve", "allocator", "cohort_held",
                 "swap", "host_total", "host_used", "host", "bytes_per_block", "swap_bytes_per_s")

    def __init__(self, total_blocks: int, block_size: int, *, reserve: bool = False, allocator=None,
                 swap: bool = False, host_blocks: int = 0, bytes_per_block: int = 0,
                 swap_bytes_per_s: float = 1.0):
        self.block_size = block_size
        self.total = total_blocks
        self.used = 0
        self.reserve = reserve  # conservative reservation of prompt + max_output at admission
        self.allocator = allocator  # hands out real block ids when the runner needs them
        self.cohort_held = 0  # blocks the decode cohort's members grew into since joining
        self.swap = swap  # preemption swaps to the host pool while it has room (else recomputes)
        self.host_total = host_blocks
        self.host_used = 0
        self.host: dict[Request, int] = {}  # swapped-out request -> its host blocks
        self.bytes_per_block = bytes_per_block
        self.swap_bytes_per_s = swap_bytes_per_s

    @property
    def free(self) -> int:
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

    def can_ever_fit(self, req: Request) -> bool:
        return -(-(req.prompt_tokens + req.max_output_tokens) // self.block_size) <= self.total

    def blocks_to_finish(self, req: Request) -> int:
        return blocks_for(req.prompt_tokens + req.max_output_tokens, self.block_size)

    # -- GPU blocks ---------------------------------------------------------------------------
    def grow(self, req: Request, target: int) -> None:
        """Make ``req`` hold ``target`` blocks (callers checked that they fit)."""
        extra = target - req.kv_blocks
        if extra <= 0:
            return
        self.used += extra
        if self.used > self.total:
            self._over_committed()
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

    def settle(self, req: Request, target: int) -> None:
        """A cohort member materialises: the blocks it grew into in the cohort become its own."""
        self.cohort_held -= target - req.kv_blocks
        req.kv_blocks = target

    def release(self, req: Request) -> None:
        """``req`` gives back every GPU block it holds."""
        self.used -= req.kv_blocks
        req.kv_blocks = 0
        if self.allocator is not None and req.block_table:
            self.allocator.free(req.block_table)
            req.block_table = None

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

    # -- invariants ---------------------------------------------------------------------------
    def check(self, holders: Iterable[Request]) -> None:
        """Assert the block accounting adds up (``holders``: every request holding GPU blocks)."""
        assert 0 <= self.used <= self.total, (self.used, self.total)
        assert self.used + self.free == self.total
        held = sum(req.kv_blocks for req in holders)
        assert self.used == held + self.cohort_held, (self.used, held, self.cohort_held)
        assert 0 <= self.host_used <= self.host_total, (self.host_used, self.host_total)
        assert self.host_used == sum(self.host.values()), (self.host_used, sum(self.host.values()))
        assert all(req.swapped and req.kv_blocks == 0 for req in self.host)


__all__ = ["KVManager", "blocks_for"]
