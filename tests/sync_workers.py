"""Run `servelab` so that search workers meet after their first trial: a test of sharing cannot race.

Usage: python tests/sync_workers.py SYNC_DIR N servelab-args...

Each worker process (the ones `search` spawns re-run this file's top level as ``__mp_main__``, so
they are patched too) finishes its first trial, leaves a file in SYNC_DIR and waits until N workers
have (at most WAIT_S; then it goes on and the test's "both took part" fails instead of hanging).
Without this, on a loaded machine one worker can finish every trial before another has started.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

WAIT_S = 120.0
SYNC = "SERVELAB_TEST_SYNC"


def _patch(sync_dir: Path, n: int) -> None:
    from servelab.search.objective import Evaluator

    call = Evaluator.__call__
    met = False

    def call_then_meet(self, trial):
        nonlocal met
        try:
            return call(self, trial)
        finally:
            if not met:
                met = True
                (sync_dir / str(os.getpid())).touch()
                deadline = time.monotonic() + WAIT_S
                while sum(1 for _ in sync_dir.iterdir()) < n and time.monotonic() < deadline:
                    time.sleep(0.02)

    Evaluator.__call__ = call_then_meet


if __name__ == "__main__":
    os.environ[SYNC] = f"{sys.argv[1]}:{sys.argv[2]}"
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
if os.environ.get(SYNC):
    folder, count = os.environ[SYNC].rsplit(":", 1)
    _patch(Path(folder), int(count))
if __name__ == "__main__":
    from servelab.cli.main import main

    sys.exit(main(sys.argv[3:]))
