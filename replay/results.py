"""A replay's results: Request objects from a trace table, and the requests/steps tables and run
directory (requests.parquet, steps.parquet, run.json) built from them. Columns: docs/results.md."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from servelab.common.atomic import atomic_dir
from servelab.replay.platform.hooks import NO_FAULTS
from servelab.replay.core.logs import TokenTable
from servelab.replay.core.encoder import MM_COLUMNS, attach
from servelab.replay.core.request import Request, Status
from servelab.replay.core.schema import PLATFORM_SCHEMA, REQUESTS_SCHEMA, numeric_column

if TYPE_CHECKING:
    from servelab.replay.core.engine import Engine


@dataclass
class RunResult:
    """A replay's tables (requests, steps, tokens) and its run.json metadata."""

    requests: pa.Table
    steps: pa.Table
    meta: dict[str, Any] = field(default_factory=dict)
    # One row per output token, with --token-log: a TokenTable (tokens.parquet in a temporary file,
    # read on demand) from ``replay``; a pa.Table works too.
    tokens: TokenTable | pa.Table | None = None


MM_SET = frozenset(MM_COLUMNS)


def requests_from_table(trace: pa.Table, first_index: int = 0) -> tuple[list[Request], dict[int, Request]]:
    """Trace rows -> Request objects (trace order) and the closed-loop follower map; ``first_index``:
    the trace row of ``trace``'s first (a streamed trace's batch: replay/stream.py).

    Converted in record batches so that a million-row trace never exists as Python lists. A
    million requests hold ~450 MB of Python objects, so the fields share objects where they can: the
    token counts repeat (one int object per distinct value, not one per row) and a row's index is
    its ``request_id`` object when the ids are the row numbers.
    """
    names = set(trace.column_names)
    requests: list[Request] = []
    index = first_index
    counts: dict[int, int] = {}  # each distinct token count once (ints above 256 are not cached by Python)
    for batch in trace.to_batches(max_chunksize=65536):
        n = batch.num_rows

        def col(name: str, default=None, shared: dict | None = None):
            if name not in names:
                return repeat(default, n)
            column = batch.column(name)
            if pa.types.is_dictionary(column.type):  # tenants, tiers: one shared str per distinct value
                labels = column.dictionary.to_pylist()
                values = [None if i is None else labels[i] for i in column.indices.to_pylist()]
            else:
                values = column.to_pylist()
            if default is not None and column.null_count:
                values = [default if v is None else v for v in values]
            if shared is not None:
                values = list(map(shared.setdefault, values, values))
            return values

        ids = col("request_id")
        rows = range(index, index + n)
        if "request_id" in names and batch.column("request_id").null_count == 0 and n and ids[0] == index \
                and ids[-1] == index + n - 1 and np.array_equal(batch.column("request_id").to_numpy(), rows):
            rows = ids  # the same int objects (an index of its own costs 32 bytes a request)
        # Positional, in Request.__init__'s order: one C-level map instead of a call with keywords per row.
        requests.extend(map(
            Request, ids, col("arrival_s"), col("prompt_tokens", shared=counts),
            col("output_tokens", shared=counts), col("max_output_tokens", shared=counts),
            col("tenant", "default"), col("tier", "standard"), col("session_id"), col("think_s"),
            col("ttft_slo_s"), col("tpot_slo_s"), col("prefix_hashes"), rows,
        ))
        if "lora_adapter" in names:  # (set apart: a trace without adapters pays nothing)
            for req, adapter in zip(requests[index - first_index:], col("lora_adapter")):
                req.lora_adapter = adapter
        if names & MM_SET:  # images, video, audio (replay/core/encoder.py)
            attach(requests[index - first_index:], {name: list(col(name)) for name in MM_COLUMNS if name in names})
        index += n
    followers: dict[int, Request] = {}
    last_in_session: dict[int, Request] = {}
    dependent = _dependent_rows(trace, first_index) if "depends_on" in names else ()
    for i in dependent:  # arrives when its parents have finished (replay/core/depends.py)
        requests[i - first_index].arrival_s = None
    for req in requests:  # the trace is sorted by arrival: that orders each session's turns
        if req.session_id is None or (dependent and req.index in dependent):
            continue
        prev = last_in_session.get(req.session_id)
        if prev is not None and req.think_s is not None:
            followers[prev.index] = req
            req.arrival_s = None  # arrives when its predecessor ends
        last_in_session[req.session_id] = req
    return requests, followers


def _dependent_rows(trace: pa.Table, first_index: int = 0) -> set[int]:
    """Rows with a non-empty ``depends_on``: no closed-loop turn, their arrival is decided in the replay."""
    import pyarrow.compute as pc

    lengths = pc.fill_null(pc.list_value_length(trace.column("depends_on")), 0)
    return set((np.flatnonzero(lengths.to_numpy() > 0) + first_index).tolist())


def requests_table_from(requests: list[Request], chunk: int = 65536, release: bool = False) -> pa.Table:
    """One row per request in trace order, built a chunk at a time (bounded temporary memory).

    ``release``: each chunk's slots of ``requests`` become None once its rows are built, so that
    Request objects nothing else holds are freed as the table grows (a million of them hold
    ~500 MB after a replay, more than twice their rows)."""
    batches = []
    for i in range(0, len(requests), chunk):
        batches.append(_requests_batch(requests[i:i + chunk]))
        if release:
            requests[i:i + chunk] = repeat(None, min(chunk, len(requests) - i))
    return pa.Table.from_batches(batches, schema=REQUESTS_SCHEMA)


STATUS_NAMES = {s: s.name.lower() for s in Status}


def _requests_batch(requests: list[Request]) -> pa.RecordBatch:
    finished = Status.FINISHED
    ttft, tpot, e2e = [], [], []
    for r in requests:
        ttft.append(r.first_token_s - r.arrival_s if r.first_token_s is not None else None)
        if r.status is finished:
            e2e.append(r.finish_s - r.arrival_s)
            tpot.append((r.finish_s - r.first_token_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0)
        else:
            e2e.append(None)
            tpot.append(None)
    columns = {
        "request_id": [r.request_id for r in requests],
        "tenant": [r.tenant for r in requests],
        "tier": [r.tier for r in requests],
        "session_id": [r.session_id for r in requests],
        "replica": [r.replica for r in requests],
        "status": [STATUS_NAMES[r.status] for r in requests],
        "reason": [r.reason for r in requests],
        "arrival_s": [r.arrival_s for r in requests],
        "first_scheduled_s": [r.first_scheduled_s for r in requests],
        "first_token_s": [r.first_token_s for r in requests],
        "finish_s": [r.finish_s for r in requests],
        "prompt_tokens": [r.prompt_tokens for r in requests],
        "output_tokens": [r.output_tokens for r in requests],
        "generated_tokens": [r.num_generated_tokens for r in requests],
        "num_preemptions": [r.num_preemptions for r in requests],
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "max_itl_s": [r.max_itl_s for r in requests],
        "ttft_slo_s": [r.ttft_slo_s for r in requests],
        "tpot_slo_s": [r.tpot_slo_s for r in requests],
        "cached_tokens": [r.num_cached_tokens for r in requests],
    }
    return pa.RecordBatch.from_arrays([pa.array(columns[f.name], type=f.type) for f in REQUESTS_SCHEMA],
                                      schema=REQUESTS_SCHEMA)


def with_platform_columns(table: pa.Table, ledger) -> pa.Table:
    """Append the PLATFORM_SCHEMA columns from the engine's per-request ledger (sparse dicts)."""
    n = table.num_rows
    for f, values, fill in (
        (PLATFORM_SCHEMA.field("num_retries"), ledger.retries, 0),
        (PLATFORM_SCHEMA.field("paused_s"), ledger.paused_s, 0.0),
        (PLATFORM_SCHEMA.field("num_resumes"), ledger.resumes, 0),
        (PLATFORM_SCHEMA.field("tokens_lost"), ledger.tokens_lost, 0),
        (PLATFORM_SCHEMA.field("recomputed_tokens"), ledger.recomputed, 0),
        (PLATFORM_SCHEMA.field("refused_s"), ledger.refused_s, None),
    ):
        if fill is None:
            column = pa.array([values.get(i) for i in range(n)], type=f.type) if values else pa.nulls(n, f.type)
        else:
            array = np.full(n, fill, dtype=f.type.to_pandas_dtype())
            for i, v in values.items():
                array[i] = v
            column = numeric_column(array)
        table = table.append_column(f, column)
    return table


def tier_columns(requests: list[Request], tier_names: list[str]) -> list[tuple[pa.Field, pa.Array]]:
    """With offload tiers (replay/core/kv/tiers.py), the columns appended to the requests table: ``kv_load_s``
    (seconds loading KV from lower tiers), ``cached_tokens_gpu`` and ``cached_tokens_<tier>`` per tier
    (of ``cached_tokens``, the tokens each served); ``requests`` in row order."""
    load = pa.array([r.kv_load_s for r in requests], pa.float64())
    per_tier = [[0] * len(requests) for _ in tier_names]
    for i, r in enumerate(requests):
        if r.tier_tokens is not None:
            for level, tokens in enumerate(r.tier_tokens):
                per_tier[level][i] = tokens
    gpu = [r.num_cached_tokens - (sum(r.tier_tokens) if r.tier_tokens else 0) for r in requests]
    return [(pa.field("kv_load_s", pa.float64()), load),
            (pa.field("cached_tokens_gpu", pa.int64()), pa.array(gpu, pa.int64()))] + \
        [(pa.field(f"cached_tokens_{name}", pa.int64()), pa.array(values, pa.int64()))
         for name, values in zip(tier_names, per_tier)]


def tier_meta(replicas) -> list[dict]:
    """run.json: per tier, its capacity and the bytes written to and read from it over the run
    (a shared tier once, per-replica tiers summed)."""
    out: dict[str, dict] = {}
    seen: set[int] = set()
    for replica in replicas:
        cache = replica.kv.cache
        for tier in cache.tiers.tiers if cache is not None and cache.tiers is not None else ():
            row = out.setdefault(tier.spec.name, {"name": tier.spec.name, "shared": tier.spec.shared,
                                                  "capacity_blocks": tier.capacity, "bytes_written": 0,
                                                  "bytes_read": 0})
            if id(tier) in seen:
                continue
            seen.add(id(tier))
            row["bytes_written"] += tier.bytes_written
            row["bytes_read"] += tier.bytes_read
    return list(out.values())


def schema_columns(schema: pa.Schema, columns: dict[str, list]) -> list[tuple[pa.Field, pa.Array]]:
    """``schema``'s fields with their columns built from ``columns`` (values per row, in trace order)."""
    return [(f, pa.array(columns[f.name], type=f.type)) for f in schema]


def platform_meta(engine: Engine) -> dict:
    """run.json counters of the platform features (throttling, shedding, pausing, faults, journal)."""
    platform = engine.platform.meta() if engine.platform is not None else \
        {"throttles": 0, "dropped": 0, "pauses": 0, "faults": dict(NO_FAULTS)}
    journal = engine.journal
    return {
        "throttles": platform["throttles"],
        "retries": sum(engine.ledger.retries.values()),
        "dropped": platform["dropped"],
        "pauses": platform["pauses"],
        "paused_s": sum(engine.ledger.paused_s.values()),
        "journal": {"enabled": journal.enabled, "requests_interrupted": journal.requests_interrupted,
                    "tokens_lost": journal.tokens_lost, "tokens_recomputed": journal.tokens_recomputed},
        "faults": platform["faults"],
    }


def write_run(result: RunResult, run_dir: str | Path) -> Path:
    """Write requests.parquet, steps.parquet and run.json into ``run_dir`` (all or nothing)."""
    run_dir = Path(run_dir)
    meta = dict(result.meta, run_id=run_dir.name)
    with atomic_dir(run_dir) as tmp:
        write_parquet(result.requests, tmp / "requests.parquet")
        write_parquet(result.steps, tmp / "steps.parquet")
        if isinstance(result.tokens, TokenTable):
            result.tokens.write(tmp / "tokens.parquet")  # already tokens.parquet: streamed while replaying
        elif result.tokens is not None:
            write_parquet(result.tokens, tmp / "tokens.parquet")
        (tmp / "run.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return run_dir


# The file is written through a buffer of this size: Arrow's local file is unbuffered, and its Parquet writer
# sends each page header, page and position query to the kernel on its own (~150 calls for a 2,000-request run)
WRITE_BUFFER_BYTES = 1 << 20


def write_parquet(table: pa.Table, path: Path) -> None:
    """zstd, with dictionary encoding only for the string columns (tenant, tier, status, reason):
    on the numeric columns nearly every value is distinct, and trying a dictionary there doubled the
    write time and grew the files (10 k requests and 43 k step rows: 26 ms, 1.67 MB -> 13 ms, 1.41 MB).
    Buffered (the same bytes): ~0.2 ms less CPU a file of a 2,000-request run, a search trial writing two."""
    from servelab.common import parquet_out  # (not pyarrow.parquet: common/parquet_out.py)

    if not isinstance(path, (str, os.PathLike)):  # (a file object: pyarrow writes to it as given)
        parquet_out.write_table(table, path, **parquet_options(table.schema))
        return
    with pa.BufferedOutputStream(pa.OSFile(os.fspath(path), "wb"), buffer_size=WRITE_BUFFER_BYTES) as sink:
        parquet_out.write_table(table, sink, **parquet_options(table.schema))


def parquet_options(schema: pa.Schema) -> dict:
    """The writer settings of every results file, in memory (``write_parquet``) or streamed in row
    groups (replay/stream.py), so that both write the same bytes."""
    strings = [f.name for f in schema
               if pa.types.is_string(f.type) or pa.types.is_large_string(f.type) or pa.types.is_dictionary(f.type)]
    return {"compression": "zstd", "use_dictionary": strings or False}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value
