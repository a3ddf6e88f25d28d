"""`--token-log`: tokens.parquet and the `tokens` / `itl_summary` views (vLLM's pooled ITL)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import make_trace

from servelab.cli.main import cli
from servelab.scoring import connect
from servelab.traces.io import write_trace


def test_replay_token_log_cli_and_itl_views(tmp_path):
    trace = make_trace([0, 0.5, 1.0], [16, 64, 8], [20, 10, 4])
    write_trace(trace, tmp_path / "t.arrow", source="test")
    runner = "linear:base=0.01,prefill_token=0.001,decode_seq=0.002"
    result = CliRunner().invoke(cli, ["replay", str(tmp_path / "t.arrow"), "-o", str(tmp_path / "run"),
                                      "--runner", runner, "--num-gpu-blocks", "100", "--token-log", "--no-report"])
    assert result.exit_code == 0, result.output
    con = connect([str(tmp_path / "run")])
    assert con.execute("select count(*) from tokens").fetchone()[0] == 34
    gaps = np.array(con.execute("select itl_s from tokens where itl_s is not null").fetchall(), dtype=float)[:, 0]
    row = con.execute("select gaps, p50_itl_s, p99_itl_s, max_itl_s from itl_summary").fetchone()
    assert row[0] == 31  # 34 tokens, 3 first tokens have no gap
    assert row[1] == pytest.approx(np.percentile(gaps, 50))
    assert row[2] == pytest.approx(np.percentile(gaps, 99))
    per_request_max = con.execute("select max(max_itl_s) from requests").fetchone()[0]
    assert row[3] == pytest.approx(per_request_max)
