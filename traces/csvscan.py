"""Stream-parse the columns an importer needs from a CSV, reporting the first bad value by data row.

Polars scans the file lazily with the streaming engine, so memory grows with the parsed numeric
columns (a few bytes per row), never with the CSV text. Rows are numbered from 1 at the first data
row (the header is not counted), the number a user sees in a spreadsheet minus one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from servelab.common.errors import InputError, require_file

# Parsed kinds: token counts (integers, "12" or "12.0"), seconds (floats), wall-clock timestamps (ns).
COUNT, SECONDS, TIMESTAMP, TEXT = "count", "seconds", "timestamp", "text"

_HINT = {
    COUNT: "not an integer",
    SECONDS: "not a number",
    TIMESTAMP: "unparsable timestamp (expected YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM])",
}


@dataclass(frozen=True)
class Want:
    """A column an importer reads: its logical name in the source format and how to parse it."""

    name: str
    kind: str
    required: bool = True


def normalize_name(name: str) -> str:
    """Header matching ignores case, surrounding spaces, quotes and a UTF-8 byte-order mark."""
    return name.replace("\ufeff", "").strip().strip('"').strip("'").strip().lower()


def _scan(path: Path, **kwargs) -> pl.LazyFrame:
    return pl.scan_csv(path, infer_schema=False, quote_char='"', **kwargs)


def header(path: Path) -> list[str]:
    require_file(path)
    try:
        return _scan(path).collect_schema().names()
    except pl.exceptions.NoDataError:
        raise InputError(path, "file is empty (no header)") from None
    except pl.exceptions.PolarsError as err:
        raise unreadable(path, err) from None


def utf8_error(path: Path) -> InputError | None:
    """The first line that is not UTF-8, as an InputError naming its data row (None when all decode)."""
    names: list[str] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line_no == 1:
                names = line.decode("utf-8", errors="replace").rstrip("\r\n").split(",")
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                rule = f"not UTF-8 text (byte 0x{line[err.start]:02x})"
                if line_no == 1:
                    return InputError(path, rule + " in the header")
                field = line[: err.start].count(b",")
                column = names[field].strip() if b'"' not in line and field < len(names) else None
                return InputError(path, rule, column=column, row=line_no - 1)
    return None


def unreadable(path: Path, err: Exception) -> InputError:
    """A polars failure as an InputError: the offending row for bytes that are not UTF-8."""
    text = " ".join(str(err).split())
    if "utf-8" in text.lower() or "utf8" in text.lower():
        found = utf8_error(path)
        if found is not None:
            return found
    return InputError(path, f"not a readable CSV file ({text[:300]})")


def resolve(path: Path, names: list[str], wants: list[Want]) -> dict[str, str]:
    """Logical name -> the file's actual header, for every wanted column the file has."""
    by_norm: dict[str, str] = {}
    for actual in names:
        by_norm.setdefault(normalize_name(actual), actual)
    found = {}
    for want in wants:
        actual = by_norm.get(normalize_name(want.name))
        if actual is None:
            if want.required:
                raise InputError(path, "required column is missing", column=want.name)
            continue
        found[want.name] = actual
    return found


_ZONE = re.compile(r"(Z|[+-]\d\d:?\d\d)$")


def _first_value(path: Path, actual: str) -> str | None:
    head = _scan(path).select(pl.col(actual)).drop_nulls().head(1).collect()
    return head[0, 0] if head.height else None


def _timestamp_expr(raw: pl.Expr, zoned: bool) -> pl.Expr:
    """Wall-clock strings -> int64 ns (UTC where a zone is given). 'T' and 'Z' are accepted.

    One format per file, chosen from its first value: trying both on every row costs twice the time
    on tens of millions of rows, and a row in the other form is reported as unparsable.
    """
    e = raw.str.replace("T", " ", literal=True)
    if zoned:
        e = e.str.replace(r"Z$", "+00:00")
        parsed = e.str.to_datetime("%Y-%m-%d %H:%M:%S%.f%:z", strict=False, time_unit="ns")
        return parsed.dt.replace_time_zone(None).cast(pl.Int64)
    return e.str.to_datetime("%Y-%m-%d %H:%M:%S%.f", strict=False, time_unit="ns").cast(pl.Int64)


def _parse_expr(actual: str, kind: str, zoned: bool = False) -> pl.Expr:
    raw = pl.col(actual).str.strip_chars()
    if kind == TEXT:
        return raw
    if kind == TIMESTAMP:
        return _timestamp_expr(raw, zoned)
    value = raw.cast(pl.Float64, strict=False)
    if kind == SECONDS:
        return pl.when(value.is_finite()).then(value)
    # Counts: whole numbers only; anything else becomes null and is reported below.
    return pl.when(value.is_finite() & (value == value.floor()) & (value.abs() < 2**31)).then(value).cast(pl.Int32)


def _too_large(text: str) -> bool:
    try:
        value = float(text.strip())
    except ValueError:
        return False
    return np.isfinite(value) and value == np.floor(value) and abs(value) >= 2**31


def _timestamp_rule(raw: str, zoned: bool) -> str:
    """Why a timestamp did not parse: the other form than the file's first one (parsed in the other
    form it would have), or no timestamp at all."""
    text = raw.strip()
    other = _timestamp_expr(pl.lit(text), not zoned)
    if pl.select(other).item() is not None:
        has, first = ("a zone offset", "none") if not zoned else ("no zone offset", "one")
        return (f"timestamp '{text}' has {has} but the file's first timestamp has {first} "
                "(a file is read in the form of its first timestamp)")
    return f"{_HINT[TIMESTAMP]}: '{raw}'"


@dataclass(frozen=True)
class Parsed:
    """Parsed columns under their logical names, and the file's own header for each (for messages)."""

    frame: pl.DataFrame
    columns: dict[str, str]

    def numpy(self, name: str) -> np.ndarray:
        return self.frame[name].to_numpy()  # zero-copy: the frame is one chunk without nulls


def read_columns(path: Path, wants: list[Want]) -> Parsed:
    """Parse the wanted columns; raises InputError on the first unparsable or missing value."""
    path = Path(path)
    try:
        return _read_columns(path, wants)
    except pl.exceptions.PolarsError as err:  # any scan, not only the main one: bad bytes show up anywhere
        raise unreadable(path, err) from None


_BLANK = "\0blank"  # (a name no header has) rows whose every field is empty: blank lines


def _read_columns(path: Path, wants: list[Want]) -> Parsed:
    names = header(path)
    found = resolve(path, names, wants)
    kinds = {w.name: w.kind for w in wants}
    exprs, zones = [], {}
    for name, actual in found.items():
        zoned = False
        if kinds[name] == TIMESTAMP:
            first = _first_value(path, actual)
            zoned = zones[name] = first is not None and _ZONE.search(first.strip()) is not None
        exprs.append(_parse_expr(actual, kinds[name], zoned).alias(name))
    exprs.append(pl.all_horizontal([pl.col(n).is_null() for n in names]).alias(_BLANK))
    df = _scan(path).select(exprs).collect(engine="streaming")
    blank = df[_BLANK].to_numpy()
    for name in found:  # rows keep their numbers in the file: a blank line still counts as a row
        if kinds[name] != TEXT and df[name].null_count():
            missing = df[name].is_null().to_numpy() & ~blank
            if not missing.any():
                continue
            idx = int(np.flatnonzero(missing)[0])
            raw = _scan(path).select(pl.col(found[name])).slice(idx, 1).collect()[0, 0]
            rule = "missing value" if raw is None or not raw.strip() else f"{_HINT[kinds[name]]}: '{raw}'"
            if kinds[name] == COUNT and raw is not None and _too_large(raw):
                rule = f"token count too large (got {raw.strip()}, at most {2**31 - 1:,})"
            if kinds[name] == TIMESTAMP and raw is not None and raw.strip():
                rule = _timestamp_rule(raw, zones[name])
            raise InputError(path, rule, column=found[name], row=idx + 1)
    df = (df.filter(~pl.col(_BLANK)) if blank.any() else df).drop(_BLANK).rechunk()
    if df.height == 0:
        raise InputError(path, "file has no data rows")
    return Parsed(df, found)
