"""Read and write trace files (Arrow IPC with zstd, or Parquet), validating both ways."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from servelab.common.atomic import atomic_path
from servelab.common.errors import InputError, require_file
from servelab.traces import schema

ARROW_SUFFIXES = (".arrow", ".ipc", ".feather")
PARQUET_SUFFIXES = (".parquet", ".pq")
_BATCH_ROWS = 1 << 20


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in ARROW_SUFFIXES:
        return "arrow"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise InputError(path, f"unknown trace file type '{suffix}' (use .arrow or .parquet)")


def _read_raw(path: Path) -> pa.Table:
    kind = _kind(path)
    require_file(path, "trace file")
    try:
        if kind == "arrow":
            with pa.memory_map(str(path)) as source:
                return ipc.open_file(source).read_all()
        import pyarrow.parquet as pq  # only for Parquet: an .arrow replay starts without it (~10 ms)

        return pq.read_table(path)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as err:
        raise InputError(path, f"not a readable {kind} file ({err})") from None


def read_trace(path: str | os.PathLike) -> pa.Table:
    """Load and validate a trace; optional columns max_output_tokens, tenant and tier are filled in."""
    path = Path(path)
    table = _read_raw(path)
    meta = table.schema.metadata or {}
    version = meta.get(schema.META_VERSION)
    if version is not None and version not in [str(v).encode() for v in schema.READ_VERSIONS]:
        raise InputError(
            path, f"schema version {version.decode()} is not supported (this servelab reads {schema.SCHEMA_VERSION})"
        )
    schema.validate(table, path, require_sorted=True)
    if "prefix_hashes" in table.column_names:
        _block_tokens(meta.get(schema.META_BLOCK_TOKENS), path)
    return schema.with_defaults(table)


def _block_tokens(value: bytes | str | int | None, path: object) -> int:
    """The tokens per ``prefix_hashes`` block: a whole number >= 1, required whenever the column is present."""
    if value is None:
        raise InputError(path, "needs the file metadata key 'prefix_block_tokens' (tokens per KV block)",
                         column="prefix_hashes")  # fmt: skip
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    try:
        block = int(text)
    except ValueError:
        block = 0
    if block < 1:
        raise InputError(path, f"metadata 'prefix_block_tokens' must be a whole number >= 1, got '{text}'",
                         column="prefix_hashes")  # fmt: skip
    return block


def trace_metadata(table: pa.Table) -> dict[str, str]:
    """The file-level metadata of a loaded trace as plain strings."""
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def prepare(
    table: pa.Table, path: object, source: str, prefix_block_tokens: int | None = None
) -> pa.Table:
    """Validate (order aside), sort by arrival, cast to canonical types and attach the metadata."""
    schema.validate(table, path, require_sorted=False)
    arrival = table.column("arrival_s").to_numpy()
    if not np.all(arrival[1:] >= arrival[:-1]):
        # A stable sort keeps simultaneous arrivals in input order, so output is deterministic.
        import pyarrow.compute as pc  # only to sort: a replay's start-up goes without it

        table = table.take(pc.sort_indices(table, [("arrival_s", "ascending")]))
    table = schema.canonical(table)
    meta = {
        schema.META_VERSION: str(schema.version_of(table)).encode(),
        schema.META_SOURCE: source.encode(),
    }
    if "prefix_hashes" in table.column_names:
        if prefix_block_tokens is None:
            prefix_block_tokens = (table.schema.metadata or {}).get(schema.META_BLOCK_TOKENS)
        meta[schema.META_BLOCK_TOKENS] = str(_block_tokens(prefix_block_tokens, path)).encode()
    return table.replace_schema_metadata(meta).unify_dictionaries().combine_chunks()


def write_trace(
    table: pa.Table, path: str | os.PathLike, source: str, prefix_block_tokens: int | None = None
) -> Path:
    """Validate, sort and write atomically; .arrow (zstd IPC) or .parquet chosen by suffix."""
    path = Path(path)
    kind = _kind(path)
    table = prepare(table, path, source, prefix_block_tokens)
    with atomic_path(path) as tmp:
        if kind == "arrow":
            options = ipc.IpcWriteOptions(compression="zstd")
            with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema, options=options) as w:
                w.write_table(table, max_chunksize=_BATCH_ROWS)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, tmp, compression="zstd", row_group_size=_BATCH_ROWS)
    return path


def trace_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's bytes (identifies the exact trace a run replayed)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as err:
        raise InputError(path, f"cannot read file ({err.strerror})") from None
    return digest.hexdigest()
