"""The package's own source files, parsed once per test process: what the layer and one-owner checks
(tests/test_layers.py, tests/test_lifecycle_owner.py) read."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def package_files(root: Path = ROOT) -> tuple[tuple[str, Path, ast.Module], ...]:
    """(path relative to ``root``, path, parsed tree) of each of the package's files, sorted by relative
    path: tests, bench and hidden folders (a virtualenv beside the code: thousands of files) are pruned
    from the walk, not filtered after it."""
    out = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (here == root and d in ("tests", "bench"))]
        for name in files:
            if name.endswith(".py"):
                path = here / name
                rel = path.relative_to(root).as_posix()
                out.append((rel, path, ast.parse(path.read_text(), rel)))
    return tuple(sorted(out, key=lambda item: item[0]))
