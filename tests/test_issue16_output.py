"""Issue 16, item 21: SQL-safe `runs` columns, integer token percentiles in `trace info`, a one-line
summary of why tests were skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner
from helpers_scoring import req, step, write_run

from servelab.cli.main import cli
from servelab.scoring.db import connect, query_arrow
from servelab.scoring.sources import flatten_meta
from servelab.traces.io import write_trace

TESTS = Path(__file__).resolve().parent


def test_runs_columns_need_no_quoting(tmp_path):
    meta = {"run_id": "a", "runner": {"name": "roofline", "params": {"kv_capacity_tokens_at_0.9": 449098,
                                                                     "odd-name x": 1}}}  # fmt: skip
    flat = flatten_meta(meta)
    assert flat["runner_kv_capacity_tokens_at_0_9"] == 449098 and flat["runner_odd_name_x"] == 1
    assert all(k.replace("_", "").isalnum() for k in flat)
    write_run(tmp_path / "a", [req(1, first_token=0.5, finish=1.0)], [step(0.0, 1.0)], meta=meta)
    con = connect([tmp_path / "a"])
    rows = query_arrow(con, "select runner_kv_capacity_tokens_at_0_9 as kv from runs").to_pylist()
    assert rows == [{"kv": 449098}]


def test_real_run_has_the_sql_safe_kv_capacity_column(tmp_path):
    from servelab.replay.config import ReplayConfig
    from servelab.replay.results import write_run as write_real_run
    from servelab.api import replay
    from conftest import make_trace

    result = replay(make_trace([0.0, 0.1], [10, 20], [2, 3]), ReplayConfig())
    write_real_run(result, tmp_path / "r")
    con = connect([tmp_path / "r"])
    names = query_arrow(con, "select column_name from (describe runs)").column(0).to_pylist()
    assert "runner_kv_capacity_tokens_at_0_9" in names
    assert not [n for n in names if not n.replace("_", "").isalnum()]


def test_trace_info_prints_integer_percentiles_as_integers(tmp_path, trace_factory):
    path = write_trace(trace_factory([0.0, 1.0, 2.0], [13, 13, 13], [7, 7, 7]), tmp_path / "t.arrow", "test")
    r = CliRunner().invoke(cli, ["trace", "info", str(path)], terminal_width=200)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if "prompt tokens" in ln)
    assert "p50 13 " in line and "max 13" in line and "13.000" not in line


def test_skip_reasons_are_summarised_in_one_line(tmp_path):
    import conftest

    assert conftest.skip_summary.pytest_terminal_summary  # the suite's conftest calls the plugin
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text("from skip_summary import pytest_terminal_summary  # noqa\n")
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest
        def test_a(): pytest.skip("shared trace data not available: /x/a")
        def test_b(): pytest.skip("shared trace data not available: /x/b")
        @pytest.mark.skipif(True, reason="needs a CUDA GPU")
        def test_c(): pass
        def test_d(): pass
    """))
    env_path = f"{TESTS}:{':'.join(sys.path)}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    lines = out.strip().splitlines()
    assert "3 skipped: 2 shared trace data not available, 1 needs a CUDA GPU (-rs lists each)" in lines
    assert lines[-1].startswith("1 passed, 3 skipped in ")  # pytest's own closing line stays last
    out = subprocess.run([*cmd, "-rs"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    assert "(-rs lists each)" not in out and "SKIPPED" in out
