"""Parse the ``key=value,key=value`` option strings used on the command line (quotas, faults, ...)."""

from __future__ import annotations

from servelab.common.errors import ServelabError


def parse_fields(text: str, allowed: tuple[str, ...], where: str) -> dict[str, str]:
    """``"a=1, b=x"`` -> ``{"a": "1", "b": "x"}``; unknown or repeated fields are errors naming ``where``."""
    values: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ServelabError(f"{where}: unknown field '{part.strip()}' (fields: {', '.join(allowed)})")
        if key in values:
            raise ServelabError(f"{where}: '{key}' given twice")
        values[key] = raw.strip()
    return values
