"""bench/ab.py, what the A/B benchmarks share: ABBA interleaving, the medians-and-ratios summary, and
an instruction count under callgrind that sees only what runs inside ``functools.reduce``."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def _ab():
    spec = importlib.util.spec_from_file_location("ab", REPO / "bench" / "ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AB = _ab()


def test_interleaved_runs_pairs_in_abba_order_and_keeps_each_sides_figures():
    order, reported = [], []

    def run(side):
        order.append(side)
        return (side, len(order))

    runs = AB.interleaved(3, run, lambda k, side, figures: reported.append((k, side, figures)))
    assert order == ["A", "B", "B", "A", "A", "B"]
    assert runs == {"A": [("A", 1), ("A", 4), ("A", 5)], "B": [("B", 2), ("B", 3), ("B", 6)]}
    assert reported == [(0, "A", ("A", 1)), (0, "B", ("B", 2)), (1, "B", ("B", 3)), (1, "A", ("A", 4)),
                        (2, "A", ("A", 5)), (2, "B", ("B", 6))]


def test_compare_gives_medians_ranges_and_the_pairs_ratios():
    line = AB.compare([1.0, 2.0, 4.0], [1.5, 2.0, 2.0])
    assert line == ("A median 2.000 s (1.000-4.000), B median 2.000 s (1.500-2.000); "
                    "B/A per pair: median 1.000 (range 0.500-1.500)")
    assert AB.compare([10, 0], [12, 5], "").startswith("A median 5.000 (0.000-10.000), B median 8.500 (5.000-12.000); "
                                                       "B/A per pair: median 1.200 (range 1.200-1.200)")
    assert AB.compare([0.0, 0.0], [1.0, 2.0]) is None  # no nonzero A: no ratio


def _can_callgrind() -> bool:
    """valgrind installed, and setarch allowed to turn address randomisation off (a container's
    seccomp profile may refuse it)."""
    if shutil.which("valgrind") is None or shutil.which("setarch") is None:
        return False
    return subprocess.run(["setarch", platform.machine(), "-R", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _can_callgrind(), reason="needs valgrind and setarch -R")
def test_callgrind_counts_only_inside_functools_reduce():
    def count(n):
        code = f"import functools; functools.reduce(lambda a, b: a + b, range({n}))"
        # (-I -S: no site-packages at start-up, a third of the child's time under valgrind; reduce is stdlib)
        return AB.callgrind(lambda prefix: subprocess.run([*prefix, sys.executable, "-I", "-S", "-c", code],
                                                          check=True).returncode)

    (big, rc), (small, _) = count(20_000), count(2)
    assert rc == 0
    # 20,000 Python calls inside reduce are millions of instructions; the interpreter's start-up
    # (tens of millions) is outside it and not counted
    assert big > 1_000_000 and small < 100_000, (big, small)
