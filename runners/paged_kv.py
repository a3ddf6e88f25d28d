"""Paged KV storage for the torch runner: a deterministic block allocator, the step layout, and the K/V pools.

Three pieces, none of which imports torch at module import (the engine imports ``BlockAllocator``
on the replay path):

- ``BlockAllocator`` hands out block ids; the engine calls it and stores the ids in
  ``request.block_table`` (the runner then reads and writes exactly those blocks).
- ``build_layout`` turns one iteration's items into flat numpy index arrays (token ids, positions,
  KV slots, query offsets, padded block tables) — all host-side work of a step in a few vectorised
  numpy calls.
- ``PagedKVCache`` holds, per layer, a K and a V pool of shape
  ``[num_blocks, block_size, kv_heads, head_dim]``; token ``p`` of a request lives in block
  ``block_table[p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from servelab.common.errors import ServelabError

ATTENTION_KINDS = ("sdpa", "paged", "gather")


class BlockAllocator:
    """Free-list of KV block ids that always hands out the lowest free ids first.

    Lowest-first (a min-heap) makes block tables a pure function of the allocation/free sequence,
    so a replay is reproducible. ``allocate(n)`` and ``free(ids)`` cost O(n log N) and create no
    objects beyond the returned list. Invariant: ``num_free + num_used == num_blocks``; an id is
    either in the free heap or marked used, never both.
    """

    __slots__ = ("num_blocks", "first_id", "_free", "_used")

    def __init__(self, num_blocks: int, first_id: int = 0):
        """Ids ``first_id .. first_id + num_blocks - 1`` (replicas sharing one pool get disjoint ranges)."""
        if num_blocks < 1:
            raise ServelabError(f"KV block allocator needs num_blocks >= 1, got {num_blocks}")
        if first_id < 0:
            raise ServelabError(f"KV block allocator needs first_id >= 0, got {first_id}")
        self.num_blocks = num_blocks
        self.first_id = first_id
        self._free = list(range(first_id, first_id + num_blocks))  # sorted, hence already a valid heap
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise ServelabError(
                f"KV block allocator: asked for {n} blocks, only {len(self._free)} of {self.num_blocks} free"
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for i in ids:
            self._used[i - self.first_id] = 1
        return ids

    def free(self, ids: Sequence[int]) -> None:
        for i in ids:
            j = i - self.first_id
            if not 0 <= j < self.num_blocks or not self._used[j]:
                raise ValueError(f"KV block {i} is not allocated (double free or foreign id)")
            self._used[j] = 0
            heapq.heappush(self._free, i)


@dataclass(frozen=True)
class StepLayout:
    """Index arrays of one iteration (numpy on the host; ``to(device)`` gives the torch twin).

    Rows are the iteration's new tokens, item by item in plan order: item ``b`` owns rows
    ``cu_q[b]:cu_q[b+1]`` at positions ``starts[b] ..``; ``ctx_lens[b]`` KV tokens exist for it once
    this step's K/V are written. Fields for the chosen attention kind only; the others are None.
    """

    kind: str
    token_ids: Any  # [T] int64
    positions: Any  # [T] int64
    slots: Any  # [T] int64: block_id * block_size + offset, where this row's K/V go
    sample_rows: Any  # [S] int64: last row of each item that completes a known token sequence
    cu_q: Any  # [B+1] int32
    ctx_lens: Any  # [B] int32
    max_q: int
    max_k: int
    block_table: Any  # [B, max_blocks] int32 (padded with block 0, never read past ctx_lens)
    # "paged" and "gather": cumulative ctx_lens (gather packs every item's keys end to end)
    cu_k: Any = None  # [B+1] int32
    total_k: int = 0
    # "sdpa": q_len == 1 items ("dec") and longer chunks ("pf") are two padded batches
    dec_rows: Any = None  # [Bd] int64 row of each single-token item
    dec_table: Any = None  # [Bd, nbd] int64
    dec_ctx: Any = None  # [Bd] int64
    pf_gather: Any = None  # [Bp * Qp] int64 row feeding each padded query slot (padding repeats row 0 of the item)
    pf_qpos: Any = None  # [Bp, Qp] int64 position of each padded query slot (padding: 0, sees key 0 only)
    pf_table: Any = None  # [Bp, nbp] int64
    pf_src: Any = None  # [Np] int64 padded slot of each real prefill row
    pf_dst: Any = None  # [Np] int64 that row
    num_rows: int = 0

    def to(self, device: Any) -> "StepLayout":
        """The same layout with torch tensors on ``device``: one host-to-device copy per dtype, then views."""
        import torch

        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if isinstance(getattr(self, f.name), np.ndarray)}
        moved: dict[str, Any] = {}
        for dtype in (np.int64, np.int32):
            names = [n for n, a in arrays.items() if a.dtype == dtype]
            if not names:
                continue
            flat = torch.from_numpy(np.concatenate([arrays[n].ravel() for n in names]))
            if torch.device(device).type != "cpu":
                flat = flat.to(device)
            for name, part in zip(names, flat.split([arrays[n].size for n in names])):
                moved[name] = part.view(arrays[name].shape)
        return dataclasses.replace(self, **moved)


def synthetic_token_ids(request_ids: np.ndarray, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """Deterministic stand-in tokens (traces carry lengths only): a hash of (request id, position).

    Generated positions use the same rule instead of the model's own samples, so the runner keeps
    no per-request state and recompute after preemption rebuilds exactly the same KV.
    """
    mixed = (request_ids.astype(np.uint64) * np.uint64(0x9E3779B1)) ^ (positions.astype(np.uint64) * np.uint64(0x85EBCA77))
    mixed ^= mixed >> np.uint64(15)
    return (mixed % np.uint64(vocab_size)).astype(np.int64)


HASHED_SEED = np.uint64(0xD1B54A32D192ED03)  # keeps a prefix hash's tokens apart from a request id's


def token_seeds(request_id: int, positions: np.ndarray, prompt_len: int, prefix_hashes, hash_block_tokens) -> np.ndarray:
    """What each token's stand-in id derives from: the trace hash of the block holding it for prompt
    tokens the trace's ``prefix_hashes`` cover (equal hashes, equal tokens: requests that share a
    cached prefix share its KV exactly), else the request id."""
    seeds = np.full(len(positions), request_id, dtype=np.int64).astype(np.uint64)
    if prefix_hashes is not None and len(prefix_hashes) and hash_block_tokens:
        covered = min(prompt_len, len(prefix_hashes) * hash_block_tokens)
        inside = positions < covered
        if inside.any():
            hashes = np.asarray(prefix_hashes, dtype=np.int64).astype(np.uint64)
            seeds[inside] = hashes[positions[inside] // hash_block_tokens] ^ HASHED_SEED
    return seeds


def build_layout(
    request_ids: Sequence[int],
    prompt_lens: Sequence[int],
    starts: Sequence[int],
    counts: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    kind: str,
    prefix_hashes: Sequence | None = None,
    hash_block_tokens: int | None = None,
) -> StepLayout:
    """Index arrays for computing tokens ``[starts[b], starts[b] + counts[b])`` of each item ``b``.

    ``block_tables[b]`` must cover the item's ``starts[b] + counts[b]`` tokens with valid block ids.
    ``prefix_hashes[b]`` (with the trace's ``hash_block_tokens``): the item's hash chain, whose prompt
    tokens then derive from the hashes (``token_seeds``), so that items may share cached blocks.
    """
    if kind not in ATTENTION_KINDS:
        raise ServelabError(f"unknown attention kind '{kind}' (known: {', '.join(ATTENTION_KINDS)})")
    num_items = len(counts)
    start = np.asarray(starts, dtype=np.int64)
    count = np.asarray(counts, dtype=np.int64)
    rid = np.asarray(request_ids, dtype=np.int64)
    if num_items == 0 or (count <= 0).any() or (start < 0).any():
        raise ServelabError("a step needs at least one item, each with num_tokens >= 1 and start >= 0")
    ctx = start + count
    need = -(-ctx // block_size)
    max_blocks = int(need.max())
    table = np.zeros((num_items, max_blocks), dtype=np.int64)
    for b, ids in enumerate(block_tables):
        n = int(need[b])
        if ids is None or len(ids) < n:
            have = 0 if ids is None else len(ids)
            raise ServelabError(
                f"request {request_ids[b]}: block_table has {have} blocks, needs {n} for {int(ctx[b])} tokens "
                f"(block_size {block_size}); the engine must assign block ids before the step"
            )
        table[b, :n] = ids[:n]
    if table.size and (table.min() < 0 or table.max() >= num_blocks):
        raise ServelabError(f"block_table holds an id outside [0, {num_blocks})")

    cu = np.zeros(num_items + 1, dtype=np.int64)
    np.cumsum(count, out=cu[1:])
    total = int(cu[-1])
    item = np.repeat(np.arange(num_items), count)
    offset = np.arange(total, dtype=np.int64) - cu[:-1][item]
    pos = start[item] + offset
    slots = table[item, pos // block_size] * block_size + pos % block_size
    produces = ctx >= np.asarray(prompt_lens, dtype=np.int64)
    layout: dict[str, Any] = dict(
        kind=kind,
        token_ids=synthetic_token_ids(_seeds(rid, prompt_lens, prefix_hashes, hash_block_tokens, item, pos, cu),
                                      pos, vocab_size),
        positions=pos,
        slots=slots,
        sample_rows=(cu[1:] - 1)[produces],
        cu_q=cu.astype(np.int32),
        ctx_lens=ctx.astype(np.int32),
        max_q=int(count.max()),
        max_k=int(ctx.max()),
        block_table=table.astype(np.int32),
        num_rows=total,
    )
    if kind in ("paged", "gather"):  # key offsets of each item, as FlashAttention's varlen API wants them
        cu_k = np.zeros(num_items + 1, dtype=np.int64)
        np.cumsum(ctx, out=cu_k[1:])
        layout["cu_k"] = cu_k.astype(np.int32)
        layout["total_k"] = int(cu_k[-1])
    if kind == "sdpa":
        layout.update(_sdpa_groups(start, count, ctx, need, table, cu))
    return StepLayout(**layout)


def _seeds(rid, prompt_lens, prefix_hashes, hash_block_tokens, item, pos, cu) -> np.ndarray:
    if prefix_hashes is None or not hash_block_tokens or not any(h is not None and len(h) for h in prefix_hashes):
        return rid[item]
    seeds = np.empty(len(pos), dtype=np.uint64)
    for b in range(len(rid)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        seeds[lo:hi] = token_seeds(int(rid[b]), pos[lo:hi], int(prompt_lens[b]), prefix_hashes[b], hash_block_tokens)
    return seeds


def _sdpa_groups(start, count, ctx, need, table, cu) -> dict[str, Any]:
    """Split items into single-token queries and multi-token chunks, each padded into one batch."""
    out: dict[str, Any] = {}
    dec = np.flatnonzero(count == 1)
    pf = np.flatnonzero(count > 1)
    if dec.size:
        nbd = int(need[dec].max())
        out.update(dec_rows=cu[dec], dec_table=table[dec, :nbd], dec_ctx=ctx[dec])
    if pf.size:
        qp = int(count[pf].max())
        nbp = int(need[pf].max())
        slot = np.arange(qp, dtype=np.int64)[None, :]
        valid = slot < count[pf][:, None]  # [Bp, Qp]
        rows = cu[pf][:, None] + np.where(valid, slot, 0)
        out.update(
            pf_gather=rows.reshape(-1),
            pf_qpos=np.where(valid, start[pf][:, None] + slot, 0),
            pf_table=table[pf, :nbp],
            pf_src=np.flatnonzero(valid.reshape(-1)),
            pf_dst=rows[valid],
        )
    return out


class PagedKVCache:
    """Per-layer K and V block pools, zero-filled so masked-out padding never carries NaNs."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: Any, device: Any):
        import torch

        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: Any, k: Any, v: Any) -> None:
        """Store rows ``k``/``v`` ``[T, kv_heads, head_dim]`` at flat slots ``[T]``."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, table: Any) -> tuple[Any, Any]:
        """K, V of whole blocks ``table [B, nb]`` -> ``[B, nb * block_size, kv_heads, head_dim]``."""
        b, nb = table.shape
        k = self.k[layer][table].view(b, nb * self.block_size, *self.k[layer].shape[2:])
        v = self.v[layer][table].view(b, nb * self.block_size, *self.v[layer].shape[2:])
        return k, v
