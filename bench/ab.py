"""What the A/B benchmarks share (bench_ab.py, bench_ab_cluster.py, bench_instructions.py): runs of two
versions interleaved ABBA, the summary of their figures, and an instruction count under callgrind.

- ``interleaved``: pair k runs A then B when k is even, B then A when odd, so that drift in the
  machine's load reaches both versions alike.
- ``compare``: each side's median and range, and the median and range of the pairs' B/A ratios.
- ``callgrind``: a command run under ``valgrind --tool=callgrind`` (hash seed and address layout fixed)
  collecting only inside ``functools.reduce``, which the child calls ``Engine.run`` through and
  nothing else calls: the count is Engine.run's alone, whatever the machine's load.
"""

from __future__ import annotations

import platform
import re
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def interleaved(pairs: int, run: Callable[[str], T], report: Callable[[int, str, T], None]) -> dict[str, list[T]]:
    """``pairs`` runs of each side ("A", "B") in ABBA order: ``run(side)`` gives a run's figures and
    ``report(k, side, figures)`` is called after each; returns each side's figures in pair order."""
    runs: dict[str, list[T]] = {"A": [], "B": []}
    for k in range(pairs):
        for side in ("A", "B") if k % 2 == 0 else ("B", "A"):
            runs[side].append(run(side))
            report(k, side, runs[side][-1])
    return runs


def compare(a: Sequence[float], b: Sequence[float], unit: str = " s") -> str | None:
    """"A median … (min-max), B median … (min-max); B/A per pair: median … (range …)"; None when no
    pair has a nonzero A (no ratio to take)."""
    ratios = sorted(y / x for x, y in zip(a, b) if x)
    if not ratios:
        return None
    return (f"A median {statistics.median(a):.3f}{unit} ({min(a):.3f}-{max(a):.3f}), B median "
            f"{statistics.median(b):.3f}{unit} ({min(b):.3f}-{max(b):.3f}); B/A per pair: median "
            f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


def callgrind(run: Callable[[tuple[str, ...]], T]) -> tuple[int, T]:
    """``run(prefix)`` (a child started with ``prefix`` before its command) under callgrind: the
    instructions counted inside ``functools.reduce``, and what ``run`` returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        prefix = ("setarch", platform.machine(), "-R", "valgrind", "--tool=callgrind",
                  "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}")
        result = run(prefix)
        match = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        if match is None:
            raise SystemExit("callgrind's output has no summary or totals line: no instruction count")
        return int(match.group(1)), result
