"""Sweep batch shapes through any runner and record its step times as a profile table (Parquet).

A profile has one row per timed iteration: the ``StepShape`` counts and the measured ``step_s``;
the file metadata (key ``servelab.profile``) names the runner, model, GPU and TP it was taken
with. ``servelab fit`` learns a ``fitted`` cost model from it. Cost-model runners are priced from
shapes; runners that execute iterations (torch) get real ``StepItem``s over stand-in requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from servelab.common.atomic import atomic_path
from servelab.common.errors import InputError, ServelabError
from servelab.runners.base import Runner, StepItem, StepPlan, StepShape

PROFILE_META_KEY = b"servelab.profile"
PROFILE_FORMAT = 1
FEATURES = (
    "prefill_tokens",
    "prefill_seqs",
    "prefill_context_tokens",
    "prefill_attention_pairs",
    "decode_seqs",
    "decode_context_tokens",
)
PROFILE_SCHEMA = pa.schema([(f, pa.int64()) for f in FEATURES] + [("step_s", pa.float64())])


@dataclass(frozen=True, slots=True)
class Grid:
    """The batch shapes a profile sweeps; every list is a set of values crossed with the others."""

    prefill_chunks: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    prefill_contexts: tuple[int, ...] = (0, 256, 1024, 4096)  # tokens already in KV before the chunk
    prefill_batch: tuple[int, ...] = (1, 2, 4)  # equal chunks side by side
    decode_batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (64, 256, 1024, 4096)  # KV tokens per decoding request
    mixed_chunks: tuple[int, ...] = (128, 512, 1024)  # one chunk riding with a decode batch
    mixed_decode_batch: tuple[int, ...] = (8, 32, 128)
    max_batched_tokens: int = 8192
    max_kv_tokens: int | None = None  # shapes holding more KV are skipped (runner capacity)


GRIDS = {
    "default": Grid(),
    # A few dozen shapes: for real runners on small machines and for tests.
    "small": Grid((16, 64, 256), (0, 128), (1, 2), (1, 4, 16), (32, 128), (64,), (4,)),
}


@dataclass(frozen=True, slots=True)
class Batch:
    """A shape as requests: prefill chunks (new tokens, tokens already in KV) and decode contexts."""

    chunks: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()  # KV tokens each decode reads, its new token included

    def shape(self) -> StepShape:
        return StepShape(
            prefill_tokens=sum(c for c, _ in self.chunks),
            prefill_seqs=len(self.chunks),
            prefill_context_tokens=sum(c + p for c, p in self.chunks),
            prefill_attention_pairs=sum(c * p + c * (c + 1) // 2 for c, p in self.chunks),
            decode_seqs=len(self.decodes),
            decode_context_tokens=sum(self.decodes),
        )

    @property
    def kv_tokens(self) -> int:
        return sum(c + p for c, p in self.chunks) + sum(self.decodes)


def batches(grid: Grid) -> Iterator[Batch]:
    """Every shape of the grid, in a fixed order, within the token budget and KV capacity."""

    def fits(b: Batch) -> bool:
        tokens = sum(c for c, _ in b.chunks) + len(b.decodes)
        return tokens <= grid.max_batched_tokens and (grid.max_kv_tokens is None or b.kv_tokens <= grid.max_kv_tokens)

    candidates: list[Batch] = []
    for c in grid.prefill_chunks:
        for p in grid.prefill_contexts:
            for k in grid.prefill_batch:
                candidates.append(Batch(chunks=((c, p),) * k))
    for n in grid.decode_batch:
        for t in grid.decode_contexts:
            candidates.append(Batch(decodes=(t,) * n))
    for c in grid.mixed_chunks:
        for n in grid.mixed_decode_batch:
            for t in grid.decode_contexts:
                candidates.append(Batch(chunks=((c, 0),), decodes=(t,) * n))
    yield from (b for b in candidates if fits(b))


def plan_for(batch: Batch, runner: Runner, allocator=None, block_size: int = 16) -> tuple[StepPlan, list]:
    """A StepPlan with stand-in requests (progress counters set) for runners that execute items."""
    from servelab.replay.core.request import Request

    items: list[StepItem] = []
    requests = []
    for i, (c, p) in enumerate(batch.chunks):
        req = Request(i, 0.0, p + c, 1, index=i)
        req.num_computed_tokens = p
        items.append(StepItem(req, p, c))
        requests.append(req)
    for j, t in enumerate(batch.decodes):
        if t < 2:
            raise ServelabError(f"profile grid: a decode needs >= 2 KV tokens (prompt + one generated), got {t}")
        req = Request(len(requests), 0.0, t - 1, t + 1, index=len(requests))
        req.num_generated_tokens = 1
        req.num_computed_tokens = t - 1
        items.append(StepItem(req, t - 1, 1))
        requests.append(req)
    for req in requests:  # (stand-ins: a runner reads their counters and block tables, never their status)
        if allocator is not None:
            needed = req.num_computed_tokens + next(it.num_tokens for it in items if it.request is req)
            req.block_table = allocator.allocate(math.ceil(needed / block_size))
            req.kv_blocks = len(req.block_table)
    return StepPlan(batch.shape(), tuple(items)), requests


def measure(runner: Runner, batch: Batch, repeats: int, allocator=None, block_size: int = 16) -> list[float]:
    if not runner.needs_block_tables:
        plan = StepPlan(batch.shape())
        return [runner.step_time(plan) for _ in range(repeats)]
    plan, requests = plan_for(batch, runner, allocator, block_size)
    try:
        return [runner.step_time(plan) for _ in range(repeats)]
    finally:
        for req in requests:
            if req.block_table:
                allocator.free(req.block_table)
                req.block_table = None


def profile(
    runner: Runner,
    output: str | Path,
    *,
    spec: str,
    grid: Grid = Grid(),
    repeats: int = 1,
    warmup: int = 0,
    context: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> pa.Table:
    """Time every grid shape ``repeats`` times (after ``warmup`` untimed runs) and write the table."""
    if repeats < 1 or warmup < 0:
        raise ServelabError(f"profile: repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    capacity = runner.kv_capacity_tokens
    if grid.max_kv_tokens is None and capacity is not None:
        try:
            grid = _with_capacity(grid, capacity())
        except ServelabError:
            pass  # a runner whose model does not fit reports that when it runs, not here
    shapes = list(batches(grid))
    if not shapes:
        raise ServelabError("profile: the grid has no shape within the token budget and KV capacity")
    allocator, block_size = None, int(getattr(runner, "block_size", 16))
    if runner.needs_block_tables:
        allocator = _allocator(runner, shapes, block_size)
    rows: dict[str, list] = {name: [] for name in PROFILE_SCHEMA.names}
    for i, batch in enumerate(shapes):
        if warmup:
            measure(runner, batch, warmup, allocator, block_size)
        shape = batch.shape()
        for step_s in measure(runner, batch, repeats, allocator, block_size):
            if not (step_s > 0 and math.isfinite(step_s)):
                raise ServelabError(f"profile: runner '{runner.name}' priced {shape} at {step_s} s")
            for name in FEATURES:
                rows[name].append(getattr(shape, name))
            rows["step_s"].append(float(step_s))
        if progress is not None:
            progress(i + 1, len(shapes))
    meta = {
        "format": PROFILE_FORMAT,
        "runner": spec,
        **{k: v for k, v in (context or {}).items() if v is not None},
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "repeats": repeats,
        "warmup": warmup,
        "grid": asdict(grid),
        "describe": runner.describe(),
    }
    table = pa.Table.from_pydict(rows, schema=PROFILE_SCHEMA).replace_schema_metadata(
        {PROFILE_META_KEY: json.dumps(meta, sort_keys=True, default=str).encode()}
    )
    write_profile(table, output)
    return table


def _allocator(runner: Runner, shapes: list[Batch], block_size: int):
    """Block ids inside the runner's KV pool: its own allocator if it has one, else lowest-first."""
    from servelab.runners.paged_kv import BlockAllocator

    needed = max(sum(math.ceil((c + p) / block_size) for c, p in b.chunks) + sum(math.ceil(t / block_size) for t in b.decodes)
                 for b in shapes)
    blocks = int(getattr(runner, "total_blocks", needed))
    if blocks < needed:
        raise ServelabError(f"profile: the largest shape needs {needed} KV blocks, runner '{runner.name}' has {blocks}")
    return runner.make_allocator(0, blocks) or BlockAllocator(blocks)


def _with_capacity(grid: Grid, tokens: int) -> Grid:
    from dataclasses import replace

    return replace(grid, max_kv_tokens=tokens)


def write_profile(table: pa.Table, output: str | Path) -> None:
    with atomic_path(output) as tmp:
        pq.write_table(table, tmp)


def read_profile(path: str | Path) -> tuple[pa.Table, dict]:
    """Read and validate a profile: every feature column, positive finite times, counts >= 0."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "profile file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise InputError(path, f"not a Parquet file ({err})") from None
    for name in (*FEATURES, "step_s"):
        if name not in table.column_names:
            raise InputError(path, "required column missing", column=name)
    for name in (*FEATURES, "step_s"):
        col = table.column(name)
        if name in FEATURES and not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise InputError(path, f"must be numeric, got {col.type}", column=name)
        values = col.to_pylist()
        for row, v in enumerate(values):
            if v is None:
                raise InputError(path, "must not be null", column=name, row=row)
            if name == "step_s":
                if not (math.isfinite(v) and v > 0):
                    raise InputError(path, f"step times must be positive and finite, got {v}", column=name, row=row)
            elif v < 0 or v != int(v):
                raise InputError(path, f"counts must be non-negative integers, got {v}", column=name, row=row)
    if table.num_rows == 0:
        raise InputError(path, "profile has no rows")
    raw = (table.schema.metadata or {}).get(PROFILE_META_KEY)
    meta = json.loads(raw) if raw else {}
    return table, meta
