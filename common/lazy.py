"""Heavy modules loaded on first use: lazy re-exports for package ``__init__`` modules (PEP 562), and
``pyarrow.compute`` for code that needs it only on some paths."""

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


def pyarrow_compute():
    """``pyarrow.compute``, imported when first needed: importing it builds a Python wrapper for each of
    Arrow's kernels (~30-75 ms of CPU), which a replay of a canonical trace or a search's trace preparation
    never needs (bench/bench_startup.py; common/kernels.py calls a few kernels without it)."""
    import pyarrow.compute

    return pyarrow.compute
