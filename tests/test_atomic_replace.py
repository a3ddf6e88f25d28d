"""Replacing a result directory survives kill -9 at any point, and temporaries of killed runs are cleaned up.

The kill is simulated deterministically: a child process runs `atomic_dir` with a file-system call
patched to do its work and then `os._exit` at once (no cleanup, like kill -9 at that instant).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from servelab.common.atomic import atomic_dir, atomic_path, owner_tag, remove_stale_temps

CHILD = """
import os, shutil, sys
from pathlib import Path
import servelab.common.atomic as atomic

dest = Path(sys.argv[1])
mode = sys.argv[2]
if mode == "after-rmtree":  # die right after any directory is deleted
    real = shutil.rmtree
    def rmtree(path, *a, **k):
        real(path, *a, **k)
        os._exit(137)
    atomic.shutil.rmtree = rmtree
elif mode == "between-renames":  # no RENAME_EXCHANGE: die after the old result is renamed aside
    atomic._exchange = lambda a, b: False
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        os._exit(137)
    atomic.os.rename = rename
with atomic.atomic_dir(dest) as tmp:
    (tmp / "result.txt").write_text("new")
    (tmp / "big.bin").write_bytes(b"x" * 100_000)
"""


def _old_run(dest: Path) -> None:
    dest.mkdir(parents=True)
    (dest / "result.txt").write_text("old")


def _run_child(dest: Path, mode: str) -> int:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(dest), mode],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode in (0, 137), proc.stderr
    return proc.returncode


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_kill_while_replacing_keeps_a_complete_result(tmp_path):
    dest = tmp_path / "R"
    _old_run(dest)
    _run_child(dest, "after-rmtree")
    # the old code deleted R first and died before moving the new one in: both were lost
    assert dest.is_dir(), "the kill lost both the old and the new result"
    assert (dest / "result.txt").read_text() in ("old", "new")
    # the next write to R removes what the killed one left behind
    with atomic_dir(dest) as tmp:
        (tmp / "result.txt").write_text("next")
    assert (dest / "result.txt").read_text() == "next"
    assert _hidden(tmp_path) == []


def test_kill_between_the_renames_of_the_fallback_restores_the_old_result(tmp_path):
    dest = tmp_path / "R"
    _old_run(dest)
    assert _run_child(dest, "between-renames") == 137
    assert not dest.exists() and len(_hidden(tmp_path)) == 2  # the old one aside, the new one not moved in
    remove_stale_temps(dest)
    assert (dest / "result.txt").read_text() == "old"
    assert _hidden(tmp_path) == []


def test_replacing_moves_the_new_result_in_and_leaves_nothing(tmp_path):
    dest = tmp_path / "R"
    _old_run(dest)
    (dest / "extra.txt").write_text("gone after the replace")
    assert _run_child(dest, "none") == 0
    assert sorted(p.name for p in dest.iterdir()) == ["big.bin", "result.txt"]
    assert (dest / "result.txt").read_text() == "new"
    assert _hidden(tmp_path) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dest = tmp_path / "rate_2"
    dead = tmp_path / f".rate_2.{owner_tag(_dead_pid())}.abcd1234.tmp"
    dead.mkdir()
    (dead / "requests.parquet").write_bytes(b"x" * 1_000_000)
    dead_file = tmp_path / f".rate_2.{owner_tag(_dead_pid())}.q1w2e3r4.tmp"
    dead_file.write_text("half a file")
    legacy = tmp_path / ".rate_2.k2j4h5g6.tmp"  # before the owner tag: stale once untouched for an hour
    legacy.mkdir()
    old = time.time() - 7200
    os.utime(legacy, (old, old))
    recent_legacy = tmp_path / ".rate_2.a1b2c3d4.tmp"
    recent_legacy.mkdir()
    live = tmp_path / f".rate_2.{owner_tag()}.zzzz9999.tmp"  # this process: still writing
    live.mkdir()
    other = tmp_path / f".rate_2.5.{owner_tag(_dead_pid())}.abcd1234.tmp"  # another destination, rate_2.5
    other.mkdir()
    with atomic_dir(dest) as tmp:
        (tmp / "run.json").write_text("{}")
    left = _hidden(tmp_path)
    assert dead.name not in left and dead_file.name not in left and legacy.name not in left
    assert {live.name, recent_legacy.name, other.name} <= set(left)
    # files written with atomic_path clean up after themselves the same way
    stale = tmp_path / f".out.csv.{owner_tag(_dead_pid())}.abcdefgh.tmp"
    stale.write_text("half")
    with atomic_path(tmp_path / "out.csv") as tmp:
        tmp.write_text("a,b\n")
    assert not stale.exists() and (tmp_path / "out.csv").read_text() == "a,b\n"
