"""Lazy re-exports for package ``__init__`` modules (PEP 562): heavy modules load on first use."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) when ``name`` is used."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        return getattr(importlib.import_module(module), name)

    return __getattr__
