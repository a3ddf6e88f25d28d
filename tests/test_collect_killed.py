"""A `runs collect` killed mid-write leaves nothing behind once the next collect to the same file runs (#26 item 19).

DuckDB keeps a write-ahead log beside the database temporary (``.NAME.<owner>.<random>.tmp.wal``);
it used to outlive every later collect (11.6 MB on a real one).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from servelab.api import replay, write_run
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.scoring.collect import collect
from servelab.traces.synth import synth_trace


def make_run(folder, seed: int):
    config = ReplayConfig(runner="linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002",
                          engine=EngineConfig(num_gpu_blocks=4000))  # fmt: skip
    write_run(replay(synth_trace(n=300, rate=20.0, seed=seed), config), folder)
    return folder


def test_a_killed_collect_leaves_no_temporary_after_the_next(tmp_path):
    runs = [make_run(tmp_path / f"r{i}", seed=i) for i in range(2)]
    out = tmp_path / "all.duckdb"
    killed = textwrap.dedent(f"""
        import os, signal
        import servelab.scoring.collect as c
        def die(con):  # the runs are written into the temporary database: its WAL is on disk
            os.kill(os.getpid(), signal.SIGKILL)
        c.create_views = die
        c.collect({[str(r) for r in runs]!r}, {str(out)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", killed], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".all.duckdb."))
    assert any(name.endswith(".tmp.wal") for name in left), left  # what the kill left
    assert collect([str(r) for r in runs], out) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".all.duckdb")) == []
    assert out.is_file()
