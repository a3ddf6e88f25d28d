"""A pytest plugin (loaded by conftest.py): the long invariant suites run a fixed sample by default.

A test marked ``@pytest.mark.sampled(keep=K)`` is a suite of parametrized cases that all check the
same invariants (bookkeeping after every event, byte-identical results with and without the decode
cohort, ...). A developer's run keeps K of its cases, chosen by a fixed seed from the case ids (the
same K every time, on every machine, with or without pytest-xdist); ``SERVELAB_FULL_SUITES=1`` runs
every case, and CI sets it. The closing lines say how many cases the sample left out. A suite whose
cases replay a trace may also take a smaller one in a developer's run (``size``): the same checks
on fewer requests; CI replays the full size. A test that loops over many combinations itself may
loop over a fixed sample of them (``cases``). The engine that checks the books of the invariant
suites (tests/helpers_engine.py ``checking_engine``) checks after every fourth event in a developer's
run, after every event in CI.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict

SEED = 20261204
FULL_ENV = "SERVELAB_FULL_SUITES"


def full_suites() -> bool:
    return os.environ.get(FULL_ENV, "") not in ("", "0")


def size(full: int, sampled: int) -> int:
    """How many requests a long suite's trace has: ``full`` under SERVELAB_FULL_SUITES=1 (CI), else ``sampled``."""
    return full if full_suites() else sampled


def cases(items: list, keep: int, key: str) -> list:
    """A loop's cases inside one test: all of ``items`` under SERVELAB_FULL_SUITES=1 (CI), else a fixed
    sample of ``keep`` of them (seeded by ``key``), in their order."""
    if full_suites() or keep >= len(items):
        return list(items)
    kept = set(random.Random(f"{SEED}:{key}").sample(range(len(items)), keep))
    return [item for i, item in enumerate(items) if i in kept]


def sample(ids: list[str], keep: int, key: str) -> set[str]:
    """The ``keep`` ids of ``ids`` kept for the suite named ``key`` (sorted first: collection order does not matter)."""
    ordered = sorted(ids)
    return set(random.Random(f"{SEED}:{key}").sample(ordered, min(keep, len(ordered))))


def pytest_collection_modifyitems(config, items) -> None:
    if full_suites():
        return
    suites: dict[tuple[str, str], list] = defaultdict(list)
    keeps: dict[tuple[str, str], int] = {}
    for item in items:
        marker = item.get_closest_marker("sampled")
        if marker is None:
            continue
        key = (item.path.name, item.originalname)
        suites[key].append(item)
        keeps[key] = int(marker.kwargs.get("keep", marker.args[0] if marker.args else 3))
    dropped = []
    for key, members in suites.items():
        kept = sample([m.nodeid for m in members], keeps[key], "::".join(key))
        dropped += [m for m in members if m.nodeid not in kept]
    if dropped:
        gone = set(id(m) for m in dropped)
        items[:] = [i for i in items if id(i) not in gone]
        config.hook.pytest_deselected(items=dropped)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not full_suites():
        terminalreporter.write_line(f"long suites ran a fixed sample of their cases (the deselected ones), on smaller traces, "
                                    f"their books checked every fourth event; {FULL_ENV}=1 runs them all in full")
