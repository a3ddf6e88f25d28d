"""One typed coercion for every key=value and TOML setting: the CLI, replay configs, policy
parameters and search specs turn values into a dataclass field's annotated type here."""

from __future__ import annotations

import math
from typing import Any

from servelab.common.errors import ServelabError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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


__all__ = ["base_type", "coerce", "is_a", "type_name"]
