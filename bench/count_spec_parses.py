"""Count the parses of each engine spec string (fail, quota, pause, kv_tiers, tier_order) during
``servelab replay --config`` of tests/test_engine_specs_typed_once.py's cluster config (3 replicas,
all five set): the test's own counters, printed instead of asserted.

    .venv/bin/python bench/count_spec_parses.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_engine_specs_typed_once as case  # noqa: E402


def main() -> None:
    patch = pytest.MonkeyPatch()
    try:
        log = case.parsed.__wrapped__(patch)
        try:
            case.test_a_cluster_replay_parses_each_engine_spec_once(Path(tempfile.mkdtemp()), log)
        except AssertionError:  # (more than once each: the counts say by how much)
            pass
    finally:
        patch.undo()
    for key, specs in log.items():
        print(f"{key:<10} {len(specs):>3} parses of {len(set(specs))} strings")
    print(f"{'total':<10} {sum(map(len, log.values())):>3}")


if __name__ == "__main__":
    main()
