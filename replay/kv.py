"""Paged KV-cache accounting for one replica: integer block counts, optional real block ids.

Invariant (asserted in tests and by ``check``): ``used + free == total`` and ``0 <= used <= total``.
A request holds ``req.kv_blocks`` blocks covering its computed tokens (on-demand, vLLM) or its
whole reservation of prompt + max_output tokens (reserve mode, fixed at admission).
"""

from __future__ import annotations

from servelab.replay.request import Request


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVCache:
    __slots__ = ("block_size", "total", "used", "reserve", "allocator", "host_total", "host_used")

    def __init__(self, total_blocks: int, block_size: int, *, reserve: bool = False,
                 host_blocks: int = 0, allocator=None):
        self.block_size = block_size
        self.total = total_blocks
        self.used = 0
        self.reserve = reserve  # conservative reservation of prompt + max_output at admission
        self.allocator = allocator  # hands out real block ids when the runner needs them
        self.host_total = host_blocks  # swap pool
        self.host_used = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks ``req`` must add to compute ``num_new_tokens`` more tokens (0 if it holds enough)."""
        if self.reserve:
            target = -(-(req.prompt_tokens + req.max_output_tokens) // self.block_size)
        else:
            target = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        extra = target - req.kv_blocks
        return extra if extra > 0 else 0

    def grow(self, req: Request, target: int) -> None:
        """Make ``req`` hold ``target`` blocks (callers checked that they fit)."""
        extra = target - req.kv_blocks
        if extra <= 0:
            return
        self.used += extra
        if self.used > self.total:
            raise AssertionError(f"KV over-committed: {self.used} > {self.total} blocks")
        req.kv_blocks = target
        if self.allocator is not None:
            if req.block_table is None:
                req.block_table = []
            req.block_table.extend(self.allocator.allocate(extra))

    def release(self, req: Request) -> None:
        self.used -= req.kv_blocks
        req.kv_blocks = 0
        if self.allocator is not None and req.block_table:
            self.allocator.free(req.block_table)
            req.block_table = None

    def can_ever_fit(self, req: Request) -> bool:
        need = blocks_for(req.prompt_tokens + req.max_output_tokens, self.block_size)
        return need <= self.total

    def check(self) -> None:
        assert 0 <= self.used <= self.total, (self.used, self.total)
        assert 0 <= self.host_used <= self.host_total, (self.host_used, self.host_total)
