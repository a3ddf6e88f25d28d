"""User CPU of one invariant-suite case with a git ref's KV check methods against the checkout's, in one process.

    .venv/bin/python bench/ab_kv_checks.py "hash blocks below the block size" --base main --rounds 1

The case is a ``test_block_ids_add_up_after_every_event`` case (tests/test_engine_invariants.py); the
``--base`` ref's ``KVManager.check``, ``PrefixCache.check`` and ``BlockNames.check`` (read with ``git
show``) are swapped in for its "base" replays, interleaved with the checkout's. The trace size follows
SERVELAB_FULL_SUITES (250 requests when set, else the developer's size).
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = {"manager": "KVManager", "prefix_cache": "PrefixCache", "block_names": "BlockNames"}


def base_checks(ref: str) -> dict:
    """class name -> the ``check`` method of ``ref``'s replay/core/kv/<module>.py."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for module, cls in FILES.items():
            path = Path(tmp) / f"{module}.py"
            path.write_text(subprocess.run(["git", "show", f"{ref}:replay/core/kv/{module}.py"], cwd=REPO,
                                           capture_output=True, text=True, check=True).stdout)
            spec = importlib.util.spec_from_file_location(f"servelab.replay.core.kv.{module}_base", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            out[cls] = getattr(mod, cls).check
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("--base", default="main")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import pytest
    import test_engine_invariants as suite

    from servelab.replay.core.kv.block_names import BlockNames
    from servelab.replay.core.kv.manager import KVManager
    from servelab.replay.core.kv.prefix_cache import PrefixCache

    classes = {"KVManager": KVManager, "PrefixCache": PrefixCache, "BlockNames": BlockNames}
    sides = {"base": base_checks(args.base), "checkout": {name: cls.check for name, cls in classes.items()}}
    for r in range(args.rounds):
        for side in ("base", "checkout") if r % 2 == 0 else ("checkout", "base"):
            for name, cls in classes.items():
                cls.check = sides[side][name]
            patch = pytest.MonkeyPatch()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
            suite.test_block_ids_add_up_after_every_event(patch, args.case)
            patch.undo()
            print(f"{side}\t{resource.getrusage(resource.RUSAGE_SELF).ru_utime - before:.2f} s user", flush=True)


if __name__ == "__main__":
    main()
