"""`KEY=VALUE` options (`--policy-param`, `--router-param`, `--set`, `--setting`): one parser, one error."""

from __future__ import annotations

from collections.abc import Iterable

from servelab.common.errors import ServelabError


def parse_key_values(items: Iterable[str], option: str, known: Iterable[str] | None = None,
                     underscores: bool = False) -> dict[str, str]:
    """``{key: value}`` from ``KEY=VALUE`` strings (both stripped; ``underscores``: ``-`` in a key read
    as ``_``); a malformed item, or a key not in ``known``, is a one-line error naming ``option``."""
    known = tuple(known) if known is not None else None
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if underscores:
            key = key.replace("-", "_")
        if not eq or not key or (known is not None and key not in known):
            if known is not None:
                raise ServelabError(f"{option} expects KEY=VALUE with KEY one of {', '.join(known)}; got '{item}'")
            raise ServelabError(f"{option} expects KEY=VALUE, got '{item}'")
        out[key] = value.strip()
    return out
