"""One typed coercion for every key=value and TOML setting: the CLI, replay configs, policy
parameters and search specs turn values into a dataclass field's annotated type here.

Besides the scalars (int, float, bool, str) two structured kinds are typed here, once, so that what
holds them (a policy's frozen ``Params``) never parses a string again: ``Names`` (``"a,b"`` on the
command line, an array of strings in TOML) and ``NamedFloats`` (``"a=2,b=1"``, or a table
``{a = 2, b = 1}``), each a tuple in the order given. ``plain`` writes them back as TOML does."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from servelab.common.errors import ServelabError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# the structured kinds a field may be annotated with (by these names)
Names = tuple[str, ...]
NamedFloats = tuple[tuple[str, float], ...]


def type_name(annotation: Any) -> tuple[str, bool]:
    """A field annotation (a string under ``from __future__ import annotations``) -> (base type, optional)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return text.replace("| None", "").replace("None |", "").strip(), "None" in text


def base_type(annotation: Any) -> str:
    return type_name(annotation)[0]


def is_a(value: Any, base: str) -> bool:
    """Is a TOML value already of type ``base``? An integral float counts as an int; a bool is never a number."""
    if base in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return base == "float" or float(value) == int(value)
    if base == "bool":
        return isinstance(value, bool)
    if base == "str":
        return isinstance(value, str)
    return True


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a CLI string or a TOML value to ``annotation``'s type, or say clearly why not.

    Strings are parsed (``"64"``, ``"0.5"``, ``"true"``, ``"none"`` for optional fields); other values
    must already be of the type. Numbers must be finite, and a boolean is not a number.
    """
    base, optional = type_name(annotation)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "")):
        if optional:
            return None
        raise ServelabError(f"{where}: a value is required")
    if base in STRUCTURED:
        return STRUCTURED[base](value, where)
    if isinstance(value, str) and base != "str":
        value = _parse(value.strip(), base)
    if value is None or not is_a(value, base):
        raise ServelabError(f"{where}: expected {'a finite ' if base in ('int', 'float') else ''}{base}, "
                            f"got {value!r}")
    return int(value) if base == "int" else float(value) if base == "float" else value


def _parse(text: str, base: str) -> Any:
    try:
        if base == "int":
            number = float(text)
            return int(number) if math.isfinite(number) and number == int(number) else text
        if base == "float":
            return float(text)
    except ValueError:
        return text
    if base == "bool":
        lowered = text.lower()
        return True if lowered in TRUE else False if lowered in FALSE else text
    return text


def _names(value: Any, where: str) -> tuple[str, ...]:
    """``"a, b"`` or ``["a", "b"]`` -> ``("a", "b")`` (blank entries of a string left out)."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ServelabError(f"{where}: expected names (\"a,b\" or an array of strings), got {value!r}")


def _named_floats(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``"a=2,b=1"``, ``{a = 2, b = 1}`` or typed pairs -> ``(("a", 2.0), ("b", 1.0))``; a name given twice,
    a part without ``=`` or a value that is not a finite number is an error naming the part."""
    if isinstance(value, str):
        pairs = []
        for part in value.split(","):
            if not part.strip():
                continue
            name, eq, raw = part.partition("=")
            if not eq or not name.strip():
                raise ServelabError(f"{where} '{value}': '{part.strip()}' is not NAME=NUMBER")
            number = _parse(raw.strip(), "float")
            if not is_a(number, "float"):
                raise ServelabError(f"{where} '{value}': '{name.strip()}' needs a number, got '{raw.strip()}'")
            pairs.append((name.strip(), number))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ServelabError(f"{where}: expected NAME=NUMBER pairs (\"a=2,b=1\" or a table), got {value!r}")
    out: dict[str, float] = {}
    for name, number in pairs:
        if not isinstance(name, str) or not name:
            raise ServelabError(f"{where}: {name!r} is not a name")
        if name in out:
            raise ServelabError(f"{where}: '{name}' given twice")
        out[name] = coerce(number, "float", f"{where}.{name}")
    return tuple(out.items())


STRUCTURED = {"Names": _names, "NamedFloats": _named_floats}


def plain(value: Any) -> Any:
    """A typed value as a TOML or JSON file writes it: ``NamedFloats`` pairs as a table, ``Names`` as an
    array; anything else as it is (``coerce`` reads each back to the same value)."""
    if isinstance(value, tuple):
        if value and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value):
            return dict(value)
        return list(value)
    return value


def option_text(value: Any) -> str:
    """A value as the command line writes it (``--policy-param K=...``): ``Names`` as ``a,b``,
    ``NamedFloats`` as ``a=2,b=1``, anything else as its ``repr``."""
    if isinstance(value, tuple):
        if value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            return repr(",".join(f"{name}={number:g}" for name, number in value))
        return repr(",".join(value))
    return repr(value)


__all__ = ["NamedFloats", "Names", "base_type", "coerce", "is_a", "option_text", "plain", "type_name"]
