"""Typed reads of one field of a parsed JSON source, each failure a one-line InputError naming the
file, the field and the row (importers check every value they use through these, so a malformed
file is an error message, never a traceback)."""

from __future__ import annotations

import math
from pathlib import Path

from servelab.common.errors import InputError


def _bad(path: Path, field: str, row: int | None, want: str, value: object) -> InputError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InputError(path, f"needs {want}, got {shown}", column=field, row=row)


def number(path: Path, value: object, field: str, row: int | None = None, *, optional: bool = False) -> float | None:
    """A finite number (a JSON number, or a string holding one as OTLP writes 64-bit values)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(path, field, row, "a number", value)
    try:
        out = float(value)
    except ValueError:
        raise _bad(path, field, row, "a number", value) from None
    if not math.isfinite(out):
        raise _bad(path, field, row, "a finite number", value)
    return out


def integer(path: Path, value: object, field: str, row: int | None = None, *, optional: bool = False) -> int | None:
    """A whole number (a JSON integer, an integral float, or a string holding one)."""
    if value is None and optional:
        return None
    if isinstance(value, bool):
        raise _bad(path, field, row, "a whole number", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _bad(path, field, row, "a whole number", value)


def mapping(path: Path, value: object, field: str, row: int | None = None, *, optional: bool = False) -> dict:
    """A JSON object; None gives {} when ``optional``."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise _bad(path, field, row, "a JSON object", value)
    return value


def array(path: Path, value: object, field: str, row: int | None = None, *, optional: bool = False,
          length: int | None = None) -> list:  # fmt: skip
    """A JSON list (of ``length`` items when given); None gives [] when ``optional``."""
    if value is None and optional:
        return []
    if not isinstance(value, list):
        raise _bad(path, field, row, "a list", value)
    if length is not None and len(value) != length:
        raise InputError(path, f"needs a list of {length} values (one per request), got {len(value)}",
                         column=field, row=row)  # fmt: skip
    return value
