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


def json_lines(path: Path, what: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-empty line of a JSON-lines file whose lines are ``what``
    ("AIPerf record", "bench_serving result"): anything else on a line is an error naming it."""
    import json

    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise InputError(path, f"not UTF-8 text (expected JSON lines, one {what} each)") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg}, column {err.colno}); the file holds one {what} "
                                   "per line", row=lineno) from None  # fmt: skip
        if not isinstance(doc, dict):
            raise InputError(path, f"each line must be a JSON object (one {what})", row=lineno)
        out.append((lineno, doc))
    return out


def json_body(path: Path, value: object, field: str, row: int | None = None) -> dict:
    """A request body that a report keeps as JSON text (or as an object); None gives {}."""
    import json

    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InputError(path, f"needs the request body as JSON text, got {type(value).__name__}", column=field,
                         row=row)  # fmt: skip
    try:
        out = json.loads(value)
    except json.JSONDecodeError as err:
        raise InputError(path, f"the request body is not JSON ({err.msg})", column=field, row=row) from None
    return out if isinstance(out, dict) else {}


def prompt_text(body: dict, *more: object) -> str | None:
    """The prompt a request body sent, as text for the prefix-sharing hashes: its chat messages' text
    (string contents and text parts, in order), a completion's ``prompt`` (a string or a list of them),
    Triton's ``text_input``, then ``more`` values a source keeps beside the body; None without any."""
    parts: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str))
    for value in (body.get("prompt"), body.get("text_input"), *more):
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(v for v in value if isinstance(v, str))
    return "\n".join(parts) if parts else None
