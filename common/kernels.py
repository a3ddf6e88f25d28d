"""Arrow compute kernels called by name, without importing ``pyarrow.compute``.

``import pyarrow.compute`` costs ~75 ms of CPU: it builds a Python function, docstring included, for
each of Arrow's several hundred kernels. A 20-trial search on a 2,000-request trace paid that once
for the three kernels its scoring and trace preparation call, 1.5% of its replays' CPU
(bench/RESULTS.md, Session 25). `call` runs a kernel through ``call_function``, the function those
wrappers themselves end in, imported from its home ``pyarrow._compute`` (~10 ms): the same kernel
with the same arguments, so the same result. Code that needs more of ``pyarrow.compute`` (or a
kernel's options) imports it where it needs it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

try:
    from pyarrow._compute import call_function as _call_function
except ImportError:  # (a pyarrow that moved it: the public name, at the import's cost)
    from pyarrow.compute import call_function as _call_function

_ARROW = (pa.Array, pa.ChunkedArray, pa.Scalar, pa.Table, pa.RecordBatch)


def call(name: str, *args: Any) -> Any:
    """``pyarrow.compute.<name>(*args)`` for a kernel without options: a Python value is passed as an Arrow
    scalar (``pa.scalar(value)``), as the ``pyarrow.compute`` wrappers pass it."""
    return _call_function(name, [a if isinstance(a, _ARROW) else pa.scalar(a) for a in args])


__all__ = ["call"]
