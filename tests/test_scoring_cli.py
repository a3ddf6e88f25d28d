"""The scoring commands end to end: query formats, report, compare, runs collect, plot; errors leave no files."""

from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main as run
from helpers_scoring import req, step, write_run

from servelab.scoring.db import connect, query_arrow
from servelab.scoring.report import report_text
from servelab.scoring.slo import SloTable

REQUESTS = [
    req(1, arrival=0.0, first_token=0.5, finish=2.5, output=5, prompt=100, tenant="acme", max_itl=0.6),
    req(2, arrival=1.0, first_token=1.2, finish=1.2, output=1, prompt=50, tenant="beta", tier="priority"),
    req(3, "unfinished", arrival=2.0, output=10, prompt=30, tenant="beta"),
    req(4, "rejected", arrival=3.0, output=5, prompt=40, tenant="beta", tier="priority"),
]
STEPS = [step(0.0, 1.0, batch=1, kv_used=10), step(1.0, 1.5, batch=2, kv_used=40, waiting=2, iterations=3)]


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "a", REQUESTS, STEPS)
    slower = [dict(r) for r in REQUESTS]
    slower[0] = req(1, arrival=0.0, first_token=1.5, finish=4.5, output=5, prompt=100, tenant="acme", max_itl=0.6)
    b = write_run(tmp_path / "b", slower, STEPS)
    return a, b


def test_query_csv(runs, capsys):
    a, b = runs
    code, out, _ = run(["query", str(a), str(b), "--slo", "ttft=1", "--format", "csv",
                        "SELECT run_id, attainment FROM slo_attainment WHERE scope = 'overall' ORDER BY run_id"], capsys)  # fmt: skip
    assert code == 0
    assert list(csv.DictReader(io.StringIO(out))) == [{"run_id": "a", "attainment": "0.5"}, {"run_id": "b", "attainment": "0.25"}]


def test_query_table_json_parquet(runs, tmp_path, capsys):
    a, _ = runs
    sql = "SELECT request_id, ttft_s FROM request_metrics ORDER BY request_id"
    code, out, _ = run(["query", str(a), sql], capsys)
    assert code == 0 and "request_id" in out and "0.5" in out and "0.2" in out
    code, out, _ = run(["query", str(a), "--format", "json", sql], capsys)
    assert json.loads(out)[0] == {"request_id": 1, "ttft_s": 0.5}
    dest = tmp_path / "out" / "r.parquet"
    code, _, _ = run(["query", str(a), "--format", "parquet", "-o", str(dest), sql], capsys)
    assert code == 0 and pq.read_table(dest).num_rows == 4


def test_query_table_limit(runs, capsys):
    code, out, _ = run(["query", str(runs[0]), "--limit", "2", "SELECT * FROM range(5)"], capsys)
    assert code == 0 and "(3 more rows" in out


def test_query_errors_leave_no_file(runs, tmp_path, capsys):
    a, _ = runs
    dest = tmp_path / "x.csv"
    code, _, err = run(["query", str(a), "--format", "csv", "-o", str(dest), "SELECT nope FROM requests"], capsys)
    assert code == 1 and err.startswith("error: query failed") and not dest.exists()
    code, _, err = run(["query", str(a), "--format", "parquet", "SELECT 1"], capsys)
    assert code == 1 and "--format parquet needs -o FILE" in err
    code, _, err = run(["query", "SELECT 1"], capsys)
    assert code == 1 and "query needs at least one RUN_DIR" in err
    code, _, err = run(["query", str(a), "--slo", "ttft=x", "SELECT 1"], capsys)
    assert code == 1 and "--slo 'ttft=x': 'ttft' needs a number of seconds" in err
    code, _, err = run(["query", str(tmp_path / "nope"), "SELECT 1"], capsys)
    assert code == 1 and "no such run directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_slo_file_and_flag(runs, tmp_path, capsys):
    a, _ = runs
    f = tmp_path / "slo.toml"
    f.write_text("ttft_s = 0.1\n[tenant.acme]\nttft_s = 1.0\n")
    sql = "SELECT request_id, met_all FROM request_metrics WHERE finished ORDER BY request_id"
    code, out, _ = run(["query", str(a), "--slo-file", str(f), "--format", "json", sql], capsys)
    assert [r["met_all"] for r in json.loads(out)] == [True, False]  # acme 0.5 <= 1.0; beta 0.2 > 0.1
    code, out, _ = run(["query", str(a), "--slo-file", str(f), "--slo", "ttft=0.3", "--format", "json", sql], capsys)
    assert [r["met_all"] for r in json.loads(out)] == [True, True]  # flag replaces the file's global ttft
    f.write_text("ttft_s = 'soon'\n")
    code, _, err = run(["query", str(a), "--slo-file", str(f), sql], capsys)
    assert code == 1 and f"error: {f}, column 'ttft_s': needs a number of seconds" in err


def test_report_text_and_json(runs, tmp_path, capsys):
    a, _ = runs
    text = report_text(a, SloTable.parse_cli(["ttft=1,tpot=1"]))
    assert "run a" in text
    assert "requests 4: 2 finished, 1 unfinished, 1 rejected, 0 throttled, 0 dropped" in text
    assert "50.0%" in text  # joint attainment 2/4
    assert "tier=priority" in text and "tenant=beta" in text
    assert "SLO: global: ttft_s=1, tpot_s=1" in text
    code, out, _ = run(["report", str(a), "--slo", "ttft=1,tpot=1"], capsys)
    assert code == 0 and out == text
    code, out, _ = run(["report", str(a), "--format", "json"], capsys)
    data = json.loads(out)[0]
    overall = next(r for r in data["attainment"] if r["scope"] == "overall")
    assert overall["attainment"] == 0.5 and data["run"]["policy_name"] == "fcfs"


def test_report_is_deterministic(runs):
    assert report_text(runs[0]) == report_text(runs[0])


def test_compare_deltas(runs, capsys):
    a, b = runs
    code, out, _ = run(["compare", str(a), str(b), "--slo", "ttft=1", "--format", "json"], capsys)
    assert code == 0
    rows = {r["metric"]: r for r in json.loads(out)}
    assert rows["attainment_pct"]["a"] == 50.0 and rows["attainment_pct"]["b"] == 25.0
    assert rows["attainment_pct"]["delta b"] == pytest.approx(-25.0) and rows["attainment_pct"]["delta_pct b"] == pytest.approx(-50.0)
    assert rows["ttft_p50_ms"]["a"] == pytest.approx(350) and rows["ttft_p50_ms"]["b"] == pytest.approx(850)
    assert rows["e2e_mean_ms"]["delta b"] == pytest.approx(1000 * ((4.5 + 0.2) - (2.5 + 0.2)) / 2)
    assert rows["attainment_pct tier=priority"]["a"] == 50.0
    code, _, err = run(["compare", str(a)], capsys)
    assert code == 1 and "compare needs at least two runs" in err


def test_runs_collect_matches_direct_query(runs, tmp_path, capsys):
    dest = tmp_path / "all.duckdb"
    code, out, _ = run(["runs", "collect", str(tmp_path / "*"), "--slo", "ttft=1", "-o", str(dest)], capsys)
    assert code == 0 and "collected 2 run(s)" in out
    sql = "SELECT * FROM slo_attainment ORDER BY ALL"
    direct = query_arrow(connect([str(runs[0]), str(runs[1])], SloTable.parse_cli(["ttft=1"])), sql)
    collected = query_arrow(connect(str(dest)), sql)  # the stored SLO table is used
    assert collected.equals(direct)
    code, out, _ = run(["query", str(dest), "--format", "csv", "SELECT count(*) AS n FROM requests"], capsys)
    assert out.splitlines()[1] == "8"
    import duckdb

    con = duckdb.connect(str(dest), read_only=True)  # the file stands alone, views included
    assert con.execute("SELECT count(*) FROM request_metrics").fetchall()[0][0] == 8


def test_runs_collect_failure_keeps_old_file(runs, tmp_path, capsys):
    dest = tmp_path / "all.duckdb"
    dest.write_text("previous")
    code, _, err = run(["runs", "collect", str(tmp_path / "missing"), "-o", str(dest)], capsys)
    assert code == 1 and dest.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_plot_writes_pngs(runs, tmp_path, capsys):
    out_dir = tmp_path / "plots"
    code, out, _ = run(["plot", str(runs[0]), str(runs[1]), "--slo", "ttft=1", "-o", str(out_dir)], capsys)
    assert code == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["tenant_attainment.png", "timeline_a.png", "timeline_b.png",
                     "tpot_cdf.png", "ttft_cdf.png"]  # fmt: skip  (one offered rate: no attainment_vs_rate.png)
    for p in out_dir.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    run(["plot", str(runs[0]), str(runs[1]), "--slo", "ttft=1", "-o", str(out_dir)], capsys)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == first


def test_bench_generator_small(tmp_path):
    """The benchmark's synthetic run scores cleanly (keeps bench/bench_scoring.py from rotting)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_scoring", Path(__file__).resolve().parents[1] / "bench" / "bench_scoring.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run_dir = tmp_path / "bench_run"
    run_dir.mkdir()
    bench.synth_run(run_dir, 2000, 500)
    con = connect(run_dir, SloTable.parse_cli(["ttft=0.3,tpot=0.03"]))
    o = query_arrow(con, "SELECT * FROM slo_attainment WHERE scope = 'overall'").to_pylist()[0]
    assert o["requests"] == 2000 and o["finished"] + o["unfinished"] + o["rejected"] == 2000
    assert 0 < o["attainment"] < 1
    assert "run bench_run" in report_text(run_dir)


def test_report_and_plot_errors_write_nothing(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, _, err = run(["report", str(missing), "-o", str(tmp_path / "r.txt")], capsys)
    assert code == 1 and err.strip() == f"error: {missing}: no such run directory"
    code, _, err = run(["plot", str(missing), "-o", str(tmp_path / "plots")], capsys)
    assert code == 1 and "no such run directory" in err
    code, _, err = run(["compare", str(missing), str(missing), "--format", "csv", "-o", str(tmp_path / "c.csv")], capsys)
    assert code == 1
    assert list(tmp_path.iterdir()) == []


def test_report_to_file(runs, tmp_path, capsys):
    dest = tmp_path / "out" / "report.txt"
    code, out, _ = run(["report", str(runs[0]), "-o", str(dest)], capsys)
    assert code == 0 and out == "" and dest.read_text().startswith("run a")


def test_collected_file_with_new_slo(runs, tmp_path, capsys):
    dest = tmp_path / "all.duckdb"
    run(["runs", "collect", str(runs[0]), "--slo", "ttft=1", "-o", str(dest)], capsys)
    sql = "SELECT attainment FROM slo_attainment WHERE scope = 'overall'"
    assert query_arrow(connect(str(dest)), sql).to_pylist() == [{"attainment": 0.5}]
    tight = SloTable.parse_cli(["ttft=0.3"])  # replaces the stored table, in memory only
    assert query_arrow(connect(str(dest), tight), sql).to_pylist() == [{"attainment": 0.25}]
    assert query_arrow(connect(str(dest)), sql).to_pylist() == [{"attainment": 0.5}]
