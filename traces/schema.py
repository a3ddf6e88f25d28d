"""The request-trace schema (version 2; version 1 files still read) and the validation every load and write runs.

One row per request, sorted by arrival. Validation reports the first offending row as a 1-based row
number of the table (row 1 = the first request), so a user can find it with `servelab trace info`
or any Arrow/Parquet viewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from servelab.common.errors import InputError
from servelab.common.lazy import pyarrow_compute as _pc
from servelab.traces import depends

SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)  # a file without version 2's columns is written as version 1, as before
META_VERSION = b"servelab.schema_version"
META_SOURCE = b"source"
META_BLOCK_TOKENS = b"prefix_block_tokens"

DEFAULT_TENANT = "default"
DEFAULT_TIER = "standard"

_DICT_STRING = pa.dictionary(pa.int32(), pa.string())
# Largest arrival_s: float64 seconds keep microseconds up to 2**32 s (136 years, past any Unix epoch
# in seconds); beyond, times round to whole seconds and more (256 s at a nanosecond epoch, 1.7e18),
# so every TTFT would come out exactly 0.
MAX_ARRIVAL_S = float(2**32)


@dataclass(frozen=True)
class Column:
    """One column of the trace schema: name, Arrow type, whether required, meaning."""

    name: str
    type: pa.DataType
    required: bool
    meaning: str


COLUMNS: tuple[Column, ...] = (
    Column("request_id", pa.int64(), True, "unique id"),
    Column("arrival_s", pa.float64(), True, "seconds since trace start, >= 0"),
    Column("prompt_tokens", pa.int32(), True, "prompt length, >= 1"),
    Column("output_tokens", pa.int32(), True, "tokens the request generates, >= 1"),
    Column("max_output_tokens", pa.int32(), False, "client cap, >= output_tokens"),
    Column("tenant", _DICT_STRING, False, "customer / API key"),
    Column("tier", _DICT_STRING, False, "service tier (priority, standard, flex, ...)"),
    Column("session_id", pa.int64(), False, "conversation / agent session"),
    Column("think_s", pa.float64(), False, "closed loop: delay after the session's previous request finishes"),
    Column("prefix_hashes", pa.list_(pa.int64()), False, "hash chain of the prompt's KV blocks"),
    Column("ttft_slo_s", pa.float64(), False, "per-request TTFT SLO override"),
    Column("tpot_slo_s", pa.float64(), False, "per-request TPOT SLO override"),
    Column("model", _DICT_STRING, False, "model name"),
    Column("timeout_s", pa.float64(), False, "client timeout: the client abandons the request this long after it arrives"),
    Column("depends_on", pa.list_(pa.int64()), False,
           "request_ids it waits for (null/empty: none); it arrives think_s after the last of them finishes"),
    Column("task_deadline_s", pa.float64(), False, "deadline of its task (session_id), seconds after the task starts"),
    Column("spec_acceptance", pa.float64(), False,
           "speculative decoding: each draft token's acceptance probability in [0, 1] (null: the engine's spec_acceptance)"),
    Column("lora_adapter", _DICT_STRING, False, "LoRA adapter the request runs with (null: the base model)"),
    Column("images", pa.int32(), False, "images in the prompt (null: 0)"),
    Column("image_tokens", pa.int32(), False, "prompt tokens the images become, all together (part of prompt_tokens)"),
    Column("image_hashes", pa.list_(pa.int64()), False, "one content hash per image (the encoder cache's key)"),
    Column("audio_tokens", pa.int32(), False, "prompt tokens the audio becomes (part of prompt_tokens)"),
    Column("video_tokens", pa.int32(), False, "prompt tokens the video becomes (part of prompt_tokens)"),
)
V2_COLUMNS = ("depends_on", "task_deadline_s")
COLUMN_BY_NAME = {c.name: c for c in COLUMNS}
REQUIRED = tuple(c.name for c in COLUMNS if c.required)


def version_of(table: pa.Table) -> int:
    """The schema version a file of ``table`` is written as: 2 when it has a version 2 column, else 1."""
    return 2 if any(name in table.column_names for name in V2_COLUMNS) else 1


def _type_ok(name: str, actual: pa.DataType) -> bool:
    """Accept the canonical type or a lossless relative (plain strings for dictionaries, any int width)."""
    want = COLUMN_BY_NAME[name].type
    if pa.types.is_dictionary(want):
        if pa.types.is_dictionary(actual):
            actual = actual.value_type
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    if pa.types.is_list(want):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and pa.types.is_integer(
            actual.value_type
        )
    if pa.types.is_integer(want):
        return pa.types.is_integer(actual)
    if pa.types.is_floating(want):
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    return actual == want


def _first(mask: np.ndarray) -> int | None:
    """1-based index of the first True, or None."""
    idx = np.flatnonzero(mask)
    return int(idx[0]) + 1 if idx.size else None


def _numpy(col: pa.ChunkedArray) -> np.ndarray:
    return col.to_numpy(zero_copy_only=False)


def _cast(col: pa.ChunkedArray, type_: pa.DataType) -> pa.ChunkedArray:
    return col if col.type == type_ else col.cast(type_)


def _check(path: object, column: str, mask: np.ndarray, rule: str) -> None:
    row = _first(mask)
    if row is not None:
        raise InputError(path, rule, column=column, row=row)


def _check_nulls(table: pa.Table, path: object, name: str) -> None:
    col = table.column(name)
    if col.null_count:
        mask = _numpy(_pc().is_null(col))
        _check(path, name, mask, "missing value (null)")


def validate(table: pa.Table, path: object, require_sorted: bool = True) -> None:
    """Raise InputError naming the file, column, first offending row and rule, or return silently.

    ``require_sorted=False`` is for importers, which sort afterwards; loads always require order.
    """
    if table.num_rows == 0:
        raise InputError(path, "trace is empty (no requests)")
    for name in REQUIRED:
        if name not in table.column_names:
            raise InputError(path, "required column is missing", column=name)
    for name in table.column_names:
        if name in COLUMN_BY_NAME and not _type_ok(name, table.schema.field(name).type):
            want = COLUMN_BY_NAME[name].type
            raise InputError(
                path, f"wrong type {table.schema.field(name).type} (expected {want})", column=name
            )
    for name in REQUIRED:
        _check_nulls(table, path, name)
    _check_int_range(table, path)

    ids = _numpy(table.column("request_id"))
    if not np.all(ids[1:] > ids[:-1]):  # increasing ids (the usual case) cannot repeat
        order = np.argsort(ids, kind="stable")
        dup = np.zeros(len(ids), dtype=bool)
        same = ids[order][1:] == ids[order][:-1]
        dup[order[1:][same]] = True
        _check(path, "request_id", dup, "duplicate request_id")

    arrival = _numpy(table.column("arrival_s")).astype(np.float64)
    _check(path, "arrival_s", ~np.isfinite(arrival), "not a finite number (NaN or infinite)")
    _check(path, "arrival_s", arrival < 0, "negative arrival time")
    row = _first(arrival > MAX_ARRIVAL_S)
    if row is not None:
        value = arrival[row - 1]
        raise InputError(path, f"arrival {value:.4g} s is too large: float64 seconds resolve only {np.spacing(value):.3g} s "
                               f"there (at most {MAX_ARRIVAL_S:,.0f} s keeps microseconds); nanoseconds or milliseconds? "
                               "give seconds since the trace start", column="arrival_s", row=row)  # fmt: skip
    if require_sorted:
        unsorted = np.zeros(len(arrival), dtype=bool)
        unsorted[1:] = arrival[1:] < arrival[:-1]
        _check(path, "arrival_s", unsorted, "arrivals not sorted (earlier than the previous row)")

    for name in ("prompt_tokens", "output_tokens"):
        _check(path, name, _numpy(table.column(name)) < 1, "token count must be >= 1")
    _check_optional(table, path)


def _check_int_range(table: pa.Table, path: object) -> None:
    """Integers wider than the canonical type (int64 token counts, uint64 ids) must fit it: a cast would fail or wrap."""
    for c in COLUMNS:
        if c.name not in table.column_names:
            continue
        want = c.type.value_type if pa.types.is_list(c.type) else c.type
        if not pa.types.is_integer(want):
            continue
        col = table.column(c.name)
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        actual = col.type.value_type if is_list else col.type
        if not pa.types.is_integer(actual):
            continue
        wider = actual.bit_width > want.bit_width or (pa.types.is_unsigned_integer(actual) and actual.bit_width == want.bit_width)
        if not wider:
            continue
        hi = int(np.iinfo(want.to_pandas_dtype()).max)
        if not is_list:
            values = _numpy(_pc().fill_null(col, pa.scalar(0, col.type)))
            row = _first(values > hi)
            if row is not None:
                raise InputError(path, f"value {values[row - 1]} is too large (the column is {want}: at most {hi:,})",
                                 column=c.name, row=row)  # fmt: skip
            continue
        flat = col.combine_chunks()  # list<uint64> prefix_hashes: report the row holding the value
        values = flat.values.to_numpy(zero_copy_only=False)
        big = np.flatnonzero(values > hi)
        if big.size:
            offsets = flat.offsets.to_numpy()
            row = int(np.searchsorted(offsets, big[0], side="right"))  # 1-based row
            raise InputError(path, f"block id {values[big[0]]} does not fit in {want}", column=c.name, row=row)


def _check_optional(table: pa.Table, path: object) -> None:
    names = set(table.column_names)
    if "max_output_tokens" in names:
        col = table.column("max_output_tokens")
        # no nulls (the common case): no pyarrow.compute import (~30 ms of a small replay's start-up)
        cap = _numpy(_pc().fill_null(col, pa.scalar(np.iinfo(np.int32).max, col.type)) if col.null_count else col)
        out = _numpy(table.column("output_tokens"))
        _check(path, "max_output_tokens", cap < out, "max_output_tokens < output_tokens")
    for name in ("think_s", "ttft_slo_s", "tpot_slo_s"):
        if name in names:
            values = _numpy(_pc().fill_null(table.column(name).cast(pa.float64()), 0.0))
            _check(path, name, ~np.isfinite(values), "not a finite number (NaN or infinite)")
            _check(path, name, values < 0, "must be >= 0")
    for name in ("timeout_s", "task_deadline_s"):
        if name in names:
            values = _numpy(_pc().fill_null(table.column(name).cast(pa.float64()), 1.0))
            _check(path, name, ~np.isfinite(values), "not a finite number (NaN or infinite)")
            _check(path, name, values <= 0, f"must be > 0 (null: no {'timeout' if name == 'timeout_s' else 'deadline'})")
    if "spec_acceptance" in names:
        values = _numpy(_pc().fill_null(table.column("spec_acceptance").cast(pa.float64()), 0.0))
        _check(path, "spec_acceptance", ~np.isfinite(values), "not a finite number (NaN or infinite)")
        _check(path, "spec_acceptance", (values < 0) | (values > 1), "an acceptance rate must be in [0, 1]")
    for name in ("tenant", "tier"):
        if name in names:
            _check_nulls(table, path, name)
    if names & _MM:
        _check_multimodal(table, path, names)
    if "prefix_hashes" in names and table.column("prefix_hashes").null_count:
        mask = _numpy(_pc().is_null(table.column("prefix_hashes")))
        _check(path, "prefix_hashes", mask, "missing value (null); use an empty list")
    if depends.COLUMN in names:
        depends.check(table, path)


_MM = {"images", "image_tokens", "image_hashes", "audio_tokens", "video_tokens"}


def _check_multimodal(table: pa.Table, path: object, names: set) -> None:
    """Counts >= 0, the modalities' tokens within the prompt, one hash per image."""
    def counts(name: str) -> np.ndarray:
        return _numpy(_pc().fill_null(table.column(name), 0)).astype(np.int64)

    total = np.zeros(table.num_rows, dtype=np.int64)
    for name in ("images", "image_tokens", "audio_tokens", "video_tokens"):
        if name in names:
            values = counts(name)
            _check(path, name, values < 0, "must be >= 0 (null: 0)")
            if name != "images":
                total += values
    _check(path, "image_tokens" if "image_tokens" in names else "audio_tokens" if "audio_tokens" in names
           else "video_tokens", total > _numpy(table.column("prompt_tokens")),
           "image + audio + video tokens exceed prompt_tokens (they are part of the prompt)")
    if "image_hashes" in names:
        lengths = _numpy(_pc().fill_null(_pc().list_value_length(table.column("image_hashes")), 0))
        images = counts("images") if "images" in names else np.zeros(table.num_rows, dtype=np.int64)
        given = lengths > 0
        _check(path, "image_hashes", given & (lengths != images), "needs one hash per image (column images)")
        if "image_tokens" in names:
            _check(path, "image_tokens", (images > 0) & (counts("image_tokens") < images),
                   "fewer image tokens than images")


def _as_dict_string(col: pa.ChunkedArray) -> pa.ChunkedArray:
    if col.type == _DICT_STRING:
        return col  # already canonical: no need to materialise millions of strings
    if pa.types.is_dictionary(col.type) and pa.types.is_string(col.type.value_type):
        return col.cast(_DICT_STRING)
    return _pc().dictionary_encode(col.cast(pa.string())).cast(_DICT_STRING)


def constant_dict(value: str, n: int) -> pa.DictionaryArray:
    """A dictionary-string column holding one value n times (no per-row Python objects)."""
    # pa.repeat, not pa.array(np.zeros(...)): the same column, without importing numpy.ma (pa.array
    # checks ndarrays for masks), which would cost a replay's start-up ~10 ms
    return pa.DictionaryArray.from_arrays(pa.repeat(pa.scalar(0, pa.int32()), n), pa.array([value], pa.string()))


def canonical(table: pa.Table) -> pa.Table:
    """Cast known columns to their canonical types, in schema order, unknown columns after."""
    known = [c for c in COLUMNS if c.name in table.column_names]
    arrays, fields = [], []
    for c in known:
        col = table.column(c.name)
        if pa.types.is_dictionary(c.type):
            col = _as_dict_string(col)
        elif col.type != c.type:
            col = col.cast(c.type)
        arrays.append(col)
        fields.append(pa.field(c.name, c.type, nullable=not c.required))
    for name in table.column_names:
        if name not in COLUMN_BY_NAME:
            arrays.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=table.schema.metadata))


def with_defaults(table: pa.Table) -> pa.Table:
    """Add max_output_tokens, tenant and tier where absent (null caps become output_tokens)."""
    n = table.num_rows
    out = table.column("output_tokens")
    if "max_output_tokens" not in table.column_names:
        table = table.append_column("max_output_tokens", _cast(out, pa.int32()))
    else:
        cap = table.column("max_output_tokens")
        if cap.null_count:
            idx = table.column_names.index("max_output_tokens")
            table = table.set_column(idx, "max_output_tokens", _pc().coalesce(cap, out.cast(cap.type)))
    for name, value in (("tenant", DEFAULT_TENANT), ("tier", DEFAULT_TIER)):
        if name not in table.column_names:
            table = table.append_column(name, constant_dict(value, n))
    return canonical(table)
