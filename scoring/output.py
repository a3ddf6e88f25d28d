"""Write a result table as an aligned text table, CSV, JSON or Parquet (to stdout or atomically to a file)."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from servelab.common.atomic import atomic_path
from servelab.common.errors import ServelabError

FORMATS = ("table", "csv", "json", "parquet")


SIGNIFICANT = 6


def format_number(value: float, significant: int = SIGNIFICANT) -> str:
    """A float with ``significant`` (6) digits in plain notation (``10123456``, ``0.0000529241``, ``0.5``).

    Scientific notation only outside 1e-6 <= |value| < 1e15, where plain digits would mislead or sprawl.
    """
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    size = abs(value)
    if size == 0:
        return "0"
    if not 1e-6 <= size < 1e15:
        return f"{value:.{significant}g}"
    decimals = max(0, significant - 1 - math.floor(math.log10(size)))
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _cell(value, significant: int = SIGNIFICANT) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return format_number(value, significant)
    return str(value)


def render_table(table: pa.Table, limit: int | None = None, width: int | None | str = "auto",
                 significant: int = SIGNIFICANT) -> str:
    """An aligned text table (rich); numbers right-aligned, floats to ``significant`` digits; at most
    ``limit`` rows shown.

    Nothing is cut: columns fit ``width`` ("auto": the terminal's or ``COLUMNS``; piped output and
    None: one line per row) by wrapping headers, and the table grows wider when they cannot.
    """
    from rich import box
    from rich.table import Table

    from servelab.common.tables import available_width, table_text

    t = Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, show_edge=False)  # the report's style
    for field in table.schema:
        numeric = pa.types.is_integer(field.type) or pa.types.is_floating(field.type) or pa.types.is_decimal(field.type)
        t.add_column(field.name, justify="right" if numeric else "left", no_wrap=numeric)
    shown = table if limit is None or table.num_rows <= limit else table.slice(0, limit)
    for row in shown.to_pylist():
        t.add_row(*(_cell(v, significant) for v in row.values()))
    text = table_text(t, available_width() if width == "auto" else width)
    if shown.num_rows < table.num_rows:
        text += f"({table.num_rows - shown.num_rows} more rows; use --limit 0 or --format csv)\n"
    return text


def _json_default(value):
    return str(value)


def to_json(table: pa.Table) -> str:
    rows = table.to_pylist()
    for row in rows:
        for k, v in row.items():
            if isinstance(v, float) and not math.isfinite(v):
                row[k] = None
    return json.dumps(rows, indent=1, default=_json_default) + "\n"


def write_result(table: pa.Table, fmt: str, out: str | None, limit: int | None = None,
                 significant: int = SIGNIFICANT) -> None:
    """Print to stdout, or write ``out`` atomically (nothing is left behind on failure); ``significant``:
    digits of a float in the text table (CSV, JSON and Parquet keep every digit)."""
    if fmt not in FORMATS:
        raise ServelabError(f"unknown format '{fmt}' (known: {', '.join(FORMATS)})")
    if fmt == "parquet":
        if not out:
            raise ServelabError("--format parquet needs -o FILE")
        with atomic_path(out) as tmp:
            pq.write_table(table, tmp)
        return
    if fmt == "csv":
        buf = io.BytesIO()
        try:
            pacsv.write_csv(table, buf)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise ServelabError(f"CSV cannot hold this result ({err}); use --format json or parquet") from None
        text = buf.getvalue().decode()
    elif fmt == "json":
        text = to_json(table)
    else:
        text = render_table(table, limit=None if out else limit, significant=significant)
    if out:
        with atomic_path(out) as tmp:
            Path(tmp).write_text(text)
    else:
        sys.stdout.write(text)
