"""Importers that turn public trace formats (Azure, Mooncake, BurstGPT, Vidur, length-only CSVs) into traces.

Every importer parses each source file, checks its rows (reporting file, column and 1-based data
row), and hands the parts to ``merge``, which rebases times to the earliest arrival over all files,
sorts stably and renumbers request ids from 0. ServeGen lives in ``servegen.py`` and the agentic and
multi-turn formats (llmservingsim, mooncake-chains, sharegpt) in ``agentic_importers.py`` (a format
is registered by its file being in this package: common/registry.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa

from servelab.common.errors import InputError, ServelabError, require_distinct, require_file
from servelab.common.sniff import detect, detects
from servelab.traces import schema
from servelab.traces.arrivals import ArrivalConfig, arrival_times
from servelab.traces.csvscan import COUNT, SECONDS, TEXT, TIMESTAMP, Want, read_columns
from servelab.traces.imported import IMPORTERS, Imported


@dataclass(frozen=True)
class Part:
    """One parsed source file. ``time`` is int64 ns for wall-clock sources, float64 seconds otherwise."""

    path: Path
    time: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    extra: dict[str, pa.Array] = field(default_factory=dict)
    rows_read: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def import_trace(fmt: str, paths: list[Path], **options) -> Imported:
    """Run the named importer over one or more source files."""
    if not paths:
        raise ServelabError("no source files given")
    paths = [Path(p) for p in paths]
    require_distinct(paths)
    return IMPORTERS.get(fmt)(paths, **options)


def detect_format(paths: list[Path]) -> str:
    """The trace format of ``paths``: the first importer (by its ``@detects`` order) whose test of the first
    one's name, header or first line passes (common/sniff.py)."""
    return detect(IMPORTERS, [Path(p) for p in paths], 1 << 14, "cannot tell the trace format from its first line; "
                  "pass --format")


def has_columns(*names: str):
    """A test for a CSV whose header holds ``names`` (lower case)."""
    need = set(names)
    return lambda probe: need <= probe.columns


MAX_TOKENS = int(np.iinfo(np.int32).max)  # token counts are int32 in the trace schema


def check_counts(path: Path, column: str, values: np.ndarray, allow_zero: bool = False, hint: str = "") -> None:
    """Token counts must be >= 1 (>= 0 where a zero has a meaning the importer handles)."""
    too_big = values > MAX_TOKENS
    if too_big.any():  # the trace stores int32 counts: a larger one would wrap around
        row = int(np.flatnonzero(too_big)[0])
        raise InputError(path, f"token count too large (got {values[row]}, at most {MAX_TOKENS:,})", column=column,
                         row=row + 1)  # fmt: skip
    bad = values < (0 if allow_zero else 1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        rule = "token count must be >= 0" if allow_zero else "token count must be >= 1"
        extra = f"; {hint}" if hint and values[row] == 0 else ""
        raise InputError(path, f"{rule} (got {values[row]}){extra}", column=column, row=row + 1)


def _drop_zero(part_path: Path, cols: dict[str, str], prompt, output, drop_zero: bool):
    """Either reject zero/negative counts or, when asked, drop zero ones (negatives are always errors)."""
    if not drop_zero:
        hint = "--drop-zero drops such rows"
        check_counts(part_path, cols["prompt"], prompt, hint=hint)
        check_counts(part_path, cols["output"], output, hint=hint)
        return None
    check_counts(part_path, cols["prompt"], prompt, allow_zero=True)
    check_counts(part_path, cols["output"], output, allow_zero=True)
    return (prompt > 0) & (output > 0)


def _length_part(path: Path, cols: dict, time, prompt, output, drop_zero: bool) -> Part:
    """One file's (time, prompt, output) columns, zero-token rows refused or dropped (and counted)."""
    keep = _drop_zero(path, cols, prompt, output, drop_zero)
    n = len(time)
    dropped = {}
    if keep is not None:
        dropped["zero-token rows"] = int(n - keep.sum())
        time, prompt, output = time[keep], prompt[keep], output[keep]
    return Part(path, time, prompt, output, rows_read=n, dropped=dropped)


def merge(parts: list[Part], source: str, prefix_block_tokens: int | None = None, tag_tenant: bool = False) -> Imported:
    """Rebase times to the earliest arrival, sort stably (file order breaks ties), renumber ids."""
    if not any(len(p.time) for p in parts):
        raise InputError(parts[0].path, "no requests left to import (every row was dropped)")
    base = min(p.time.min() for p in parts if len(p.time))
    tables = []
    for part in parts:
        # In-place arithmetic: with tens of millions of rows every temporary array counts.
        if part.time.dtype.kind in "iu":
            arrival = (part.time - base).astype(np.float64)
            arrival /= 1e9
        else:
            arrival = part.time.astype(np.float64)
            arrival -= float(base)
        cols = {
            "arrival_s": pa.array(arrival, pa.float64()),
            "prompt_tokens": pa.array(part.prompt.astype(np.int32, copy=False)),
            "output_tokens": pa.array(part.output.astype(np.int32, copy=False)),
        }
        cols.update(part.extra)
        if tag_tenant:
            cols["tenant"] = schema.constant_dict(part.path.stem, len(arrival))
        tables.append(pa.table(cols))
    table = _concat(tables)
    arrival = table.column("arrival_s").to_numpy()
    if not np.all(arrival[1:] >= arrival[:-1]):  # most sources are already in order: skip the copy
        table = table.take(pa.array(np.argsort(arrival, kind="stable")))
    table = table.add_column(0, "request_id", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    dropped: dict[str, int] = {}
    for part in parts:
        for why, n in part.dropped.items():
            dropped[why] = dropped.get(why, 0) + n
    return Imported(
        table=table,
        source=source,
        prefix_block_tokens=prefix_block_tokens,
        rows_read=sum(p.rows_read for p in parts),
        dropped=dropped,
        files=tuple(str(p.path) for p in parts),
    )


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Concatenate parts; a string column some files lack is filled with the schema default."""
    names = [n for t in tables for n in t.column_names]
    names = list(dict.fromkeys(names))
    fixed = []
    for t in tables:
        for name in names:
            if name in t.column_names:
                continue
            default = {"tenant": schema.DEFAULT_TENANT, "tier": schema.DEFAULT_TIER}.get(name)
            if default is not None:
                t = t.append_column(name, schema.constant_dict(default, t.num_rows))
            elif name == "model":
                t = t.append_column(name, pa.nulls(t.num_rows, pa.dictionary(pa.int32(), pa.string())))
            else:
                typ = next(x.schema.field(name).type for x in tables if name in x.column_names)
                t = t.append_column(name, pa.nulls(t.num_rows, typ))
        fixed.append(t.select(names))
    fixed = [schema.canonical(t) for t in fixed]
    if len(fixed) == 1:
        return fixed[0]
    return pa.concat_tables(fixed).unify_dictionaries().combine_chunks()


def _text_column(parsed, name: str, transform: Callable[[pl.Expr], pl.Expr] | None = None) -> pa.Array:
    series = parsed.frame.select((transform or (lambda e: e))(pl.col(name))).to_series()
    return series.cast(pl.Categorical).to_arrow().cast(pa.dictionary(pa.int32(), pa.string()))


# ---------------------------------------------------------------- Azure (2023 and 2024 forms)


@IMPORTERS.register("azure")
@detects(has_columns("timestamp", "contexttokens"), order=40)
def import_azure(paths: list[Path], drop_zero: bool = False, tenant_from_file: bool = False) -> Imported:
    """Azure LLM inference traces: TIMESTAMP (wall clock), ContextTokens, GeneratedTokens."""
    parts = []
    for path in paths:
        wants = [Want("TIMESTAMP", TIMESTAMP), Want("ContextTokens", COUNT), Want("GeneratedTokens", COUNT)]
        parsed = read_columns(path, wants)
        cols = {"prompt": parsed.columns["ContextTokens"], "output": parsed.columns["GeneratedTokens"]}
        time, prompt, output = (parsed.numpy(n) for n in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
        parts.append(_length_part(path, cols, time, prompt, output, drop_zero))
    return merge(parts, source="azure", tag_tenant=tenant_from_file)


# ---------------------------------------------------------------- Vidur processed traces


@IMPORTERS.register("vidur")
@detects(has_columns("arrived_at", "num_prefill_tokens"), order=50)
def import_vidur(paths: list[Path], drop_zero: bool = False, tenant_from_file: bool = False) -> Imported:
    """Vidur processed traces: arrived_at (s), num_prefill_tokens, num_decode_tokens."""
    parts = []
    for path in paths:
        wants = [Want("arrived_at", SECONDS), Want("num_prefill_tokens", COUNT), Want("num_decode_tokens", COUNT)]
        parsed = read_columns(path, wants)
        time, prompt, output = (parsed.numpy(w.name) for w in wants)
        bad = time < 0
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise InputError(path, f"negative arrival time ({time[row]})", column=parsed.columns["arrived_at"], row=row + 1)
        cols = {"prompt": parsed.columns["num_prefill_tokens"], "output": parsed.columns["num_decode_tokens"]}
        parts.append(_length_part(path, cols, time, prompt, output, drop_zero))
    return merge(parts, source="vidur", tag_tenant=tenant_from_file)


# ---------------------------------------------------------------- BurstGPT


def _log_type_label(e: pl.Expr) -> pl.Expr:
    """'Conversation log' -> 'conversation', 'API log' -> 'api' (a short tenant/tier name)."""
    return (
        e.fill_null("unknown")
        .str.to_lowercase()
        .str.replace(r"\s*log$", "")
        .str.strip_chars()
        .str.replace_all(r"\s+", "-")
        .replace("", "unknown")
    )


@IMPORTERS.register("burstgpt")
@detects(has_columns("request tokens", "response tokens"), order=60)
def import_burstgpt(paths: list[Path], log_type_as: str = "tenant", tenant_from_file: bool = False) -> Imported:
    """BurstGPT: Timestamp (s), Model, Request tokens, Response tokens, Log Type.

    Rows with 0 response tokens are failed requests: dropped and counted. ``log_type_as`` puts the
    Log Type into the tenant or tier column (or nowhere: 'none').
    """
    if log_type_as not in ("tenant", "tier", "none"):
        raise ServelabError(f"--log-type-as must be tenant, tier or none (got '{log_type_as}')")
    if log_type_as == "tenant" and tenant_from_file:
        raise ServelabError("--tenant-from-file needs --log-type-as tier or none (both would set tenant)")
    parts = []
    for path in paths:
        wants = [
            Want("Timestamp", SECONDS),
            Want("Request tokens", COUNT),
            Want("Response tokens", COUNT),
            Want("Model", TEXT, required=False),
            Want("Log Type", TEXT, required=False),
        ]
        parsed = read_columns(path, wants)
        time, prompt, output = (parsed.numpy(n) for n in ("Timestamp", "Request tokens", "Response tokens"))
        if (time < 0).any():
            row = int(np.flatnonzero(time < 0)[0])
            raise InputError(path, f"negative timestamp ({time[row]})", column=parsed.columns["Timestamp"], row=row + 1)
        check_counts(path, parsed.columns["Response tokens"], output, allow_zero=True)
        keep = output > 0
        # A failed request often logs 0 request tokens too; only kept rows must have a prompt.
        check_counts(path, parsed.columns["Request tokens"], np.where(keep, prompt, 1))
        extra = {}
        if "Model" in parsed.columns:
            extra["model"] = _text_column(parsed, "Model")
        if "Log Type" in parsed.columns and log_type_as != "none":
            extra[log_type_as] = _text_column(parsed, "Log Type", _log_type_label)
        mask = pa.array(keep)
        extra = {k: v.filter(mask) for k, v in extra.items()}
        parts.append(
            Part(
                path,
                time[keep],
                prompt[keep],
                output[keep],
                extra=extra,
                rows_read=len(time),
                dropped={"failed (0 response tokens)": int((~keep).sum())},
            )
        )
    return merge(parts, source="burstgpt", tag_tenant=tenant_from_file)


# ---------------------------------------------------------------- Mooncake (JSON lines)

_MOONCAKE_SCHEMA = {
    "timestamp": pl.Float64,
    "input_length": pl.Int64,
    "output_length": pl.Int64,
    "hash_ids": pl.List(pl.Int64),
}


_INT64 = (-(2**63), 2**63 - 1)


def _mooncake_diagnose(path: Path) -> InputError:
    """Find the first bad record with the json module (only when the fast reader has failed)."""
    with open(path, "rb") as f:
        row = 0
        for raw in f:
            if not raw.strip():
                continue
            row += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return InputError(path, f"not UTF-8 text (byte 0x{raw[err.start]:02x})", row=row)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                return InputError(path, f"not valid JSON ({err.msg})", row=row)
            if not isinstance(rec, dict):
                return InputError(path, "record is not a JSON object", row=row)
            for name in _MOONCAKE_SCHEMA:
                value = rec.get(name)
                if value is None:
                    return InputError(path, "missing value", column=name, row=row)
                if name == "hash_ids":
                    ok = isinstance(value, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in value)
                    if not ok:
                        return InputError(path, "must be a list of integers", column=name, row=row)
                    big = next((h for h in value if not _INT64[0] <= h <= _INT64[1]), None)
                    if big is not None:
                        return InputError(path, f"block id {big} is outside the signed 64-bit range (-2^63 .. 2^63 - 1) "
                                                "the trace stores", column=name, row=row)
                elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    return InputError(path, f"not a number: {value!r}", column=name, row=row)
                elif name != "timestamp" and not float(value).is_integer():
                    return InputError(path, f"not an integer: {value!r}", column=name, row=row)
                elif name != "timestamp" and not _INT64[0] <= value <= _INT64[1]:
                    return InputError(path, f"too large: {value!r}", column=name, row=row)
    return InputError(path, "unreadable JSON lines file (no single line is at fault)")


def _read_mooncake(path: Path) -> pl.DataFrame:
    require_file(path)
    if path.stat().st_size == 0:
        raise InputError(path, "file is empty")
    try:
        df = pl.scan_ndjson(path, schema=_MOONCAKE_SCHEMA).collect()
    except (pl.exceptions.PolarsError, OSError):
        raise _mooncake_diagnose(path) from None
    for name in _MOONCAKE_SCHEMA:
        if df[name].null_count():
            raise _mooncake_diagnose(path)
    return df


def _fitting_blocks(prompt: np.ndarray, ids: np.ndarray) -> str:
    """The block sizes b with ceil(prompt / b) == ids on every row, said in words."""
    if (ids < 1).any():
        return "no block size fits them (a row has no ids)"
    lo = int((-(-prompt // ids)).max())  # b >= prompt / ids
    more = ids > 1
    hi = int(((prompt[more] - 1) // (ids[more] - 1)).min()) if more.any() else None  # b < prompt / (ids - 1)
    if hi is not None and lo > hi:
        return "no single block size fits them"
    power = 1 << max(0, (lo - 1).bit_length())  # the smallest power of two >= lo: block sizes usually are
    if hi is None or power <= hi:
        return f"they fit --block-tokens {power}"
    return f"they fit --block-tokens {lo}" + (f" to {hi}" if hi > lo else "")


def check_block_count(path: Path, prompt: np.ndarray, ids: np.ndarray, block_tokens: int) -> str | None:
    """Each row's hash_ids must number ceil(input_length / block) blocks. Most rows off: the block size is
    wrong (an error saying which fits); a few: a warning naming the first (None when all agree)."""
    bad = ids != -(-prompt // block_tokens)
    if not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    what = (f"{int(bad.sum()):,} of {len(bad):,} rows have len(hash_ids) != ceil(input_length / {block_tokens}) "
            f"(this one: {prompt[first]} tokens, {ids[first]} ids)")
    if bad.sum() * 2 > len(bad):
        raise InputError(path, f"{what}: the block size is not {block_tokens}; {_fitting_blocks(prompt, ids)}",
                         column="hash_ids", row=first + 1)
    return f"{path}, column 'hash_ids', row {first + 1}: {what}; their prefix reuse follows the ids"


@IMPORTERS.register("mooncake")
@detects(lambda p: p.json_line and ('"hash_ids"' in p.line or '"input_length"' in p.line), order=30)
def import_mooncake(paths: list[Path], block_tokens: int = 512, tenant_from_file: bool = False) -> Imported:
    """Mooncake JSON lines: timestamp (ms), input_length, output_length, hash_ids (block ids)."""
    if block_tokens < 1:
        raise ServelabError(f"--block-tokens must be >= 1 (got {block_tokens})")
    from servelab.traces.transforms import file_namespace

    parts, warnings = [], []
    for index, path in enumerate(paths):
        df = _read_mooncake(path)
        time = df["timestamp"].to_numpy() / 1000.0
        if (time < 0).any():
            row = int(np.flatnonzero(time < 0)[0])
            raise InputError(path, "negative timestamp", column="timestamp", row=row + 1)
        prompt, output = df["input_length"].to_numpy(), df["output_length"].to_numpy()
        check_counts(path, "input_length", prompt)
        check_counts(path, "output_length", output)
        warning = check_block_count(path, prompt, df["hash_ids"].list.len().to_numpy(), block_tokens)
        if warning:
            warnings.append(warning)
        # Each file numbers its block ids from 0: equal ids in two files are different blocks.
        hashes = file_namespace(df["hash_ids"].to_arrow().cast(pa.list_(pa.int64())), index)
        parts.append(Part(path, time, prompt, output, extra={"prefix_hashes": hashes}, rows_read=len(time)))
    result = merge(parts, source="mooncake", prefix_block_tokens=block_tokens, tag_tenant=tenant_from_file)
    return replace(result, warnings=tuple(warnings)) if warnings else result


# ---------------------------------------------------------------- length-only CSVs + generated arrivals

LENGTH_WANTS = [Want("num_prefill_tokens", COUNT), Want("num_decode_tokens", COUNT)]


def read_length_pairs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) pairs from a length-only CSV or from a trace file (.arrow / .parquet)."""
    path = Path(path)
    if path.suffix.lower() in (".arrow", ".ipc", ".feather", ".parquet", ".pq"):
        from servelab.traces.io import read_trace

        table = read_trace(path)
        return table.column("prompt_tokens").to_numpy(), table.column("output_tokens").to_numpy()
    parsed = read_columns(path, LENGTH_WANTS)
    prompt, output = parsed.numpy("num_prefill_tokens"), parsed.numpy("num_decode_tokens")
    check_counts(path, parsed.columns["num_prefill_tokens"], prompt)
    check_counts(path, parsed.columns["num_decode_tokens"], output)
    return prompt, output


@IMPORTERS.register("lengths")
@detects(has_columns("num_prefill_tokens", "num_decode_tokens"), order=70)
def import_lengths(
    paths: list[Path],
    arrival: ArrivalConfig = ArrivalConfig(),
    seed: int = 0,
    limit: int | None = None,
    shuffle: bool = False,
    tenant_from_file: bool = False,
) -> Imported:
    """Length pairs in file order (or shuffled, seeded) given arrivals from ``arrival``."""
    pairs = [(p, *read_length_pairs(p)) for p in paths]
    rows_read = sum(len(pr) for _, pr, _ in pairs)
    prompt = np.concatenate([pr for _, pr, _ in pairs])
    output = np.concatenate([o for _, _, o in pairs])
    label = np.concatenate([np.full(len(pr), i, np.int32) for i, (_, pr, _) in enumerate(pairs)])
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompt)) if shuffle else np.arange(len(prompt))
    if limit is not None:
        if limit < 1:
            raise ServelabError(f"--limit must be >= 1 (got {limit})")
        order = order[:limit]
    times = arrival_times(arrival, rng, n=len(order))
    table = pa.table(
        {
            "request_id": pa.array(np.arange(len(order), dtype=np.int64)),
            "arrival_s": pa.array(times),
            "prompt_tokens": pa.array(prompt[order].astype(np.int32)),
            "output_tokens": pa.array(output[order].astype(np.int32)),
        }
    )
    if tenant_from_file:
        names = pa.array([p.stem for p, _, _ in pairs], pa.string())
        table = table.append_column("tenant", pa.DictionaryArray.from_arrays(pa.array(label[order]), names))
    return Imported(
        table=table,
        source=f"lengths+{arrival.process}",
        prefix_block_tokens=None,
        rows_read=rows_read,
        dropped={"not sampled (--limit)": rows_read - len(order)},
        files=tuple(str(p) for p, _, _ in pairs),
    )
