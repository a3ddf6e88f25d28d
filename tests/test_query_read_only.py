"""`servelab query --read-only` (and report/compare, always) run SQL that can read the runs and nothing else:
no COPY ... TO, no other local file, no extension installs, no way to turn it back on (issue 16 item 20)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from helpers_scoring import req, step, write_run

from servelab.cli.main import cli
from servelab.scoring import db

ROWS = [req(1, first_token=0.5, finish=1.0, output=5), req(2, arrival=1.0, first_token=1.5, finish=2.0, output=5)]


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "a", ROWS, [step(0.0, 1.0)])
    b = write_run(tmp_path / "b", ROWS, [step(0.0, 1.0)])
    secret = tmp_path / "secret.csv"
    secret.write_text("k,v\n1,2\n")
    return a, b, secret


def query(*args):
    return CliRunner().invoke(cli, ["query", *map(str, args)])


def test_read_only_query_reads_the_runs(runs):
    a, b, _ = runs
    r = query(a, b, "--read-only", "--format", "csv",
              "SELECT count(*) AS n, (SELECT count(*) FROM steps) AS s, (SELECT count(*) FROM goodput) AS g FROM requests")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1] == "4,2,6"


@pytest.mark.parametrize("sql", [
    "COPY (SELECT 1) TO '{out}'",
    "COPY requests TO '{out}' (FORMAT parquet)",
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM read_parquet('{other}')",
    "ATTACH '{out}' AS x",
    "INSTALL httpfs",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
])  # fmt: skip
def test_read_only_query_refuses_outside_access(runs, tmp_path, sql):
    a, b, secret = runs
    out = tmp_path / "written.csv"
    text = sql.format(out=out, secret=secret, other=b / "requests.parquet")
    r = query(a, "--read-only", text)
    assert r.exit_code == 1
    message = str(r.exception)  # the CLI prints it as one "error: query failed: ..." line
    assert "query failed" in message and ("disabled by configuration" in message or "locked" in message), message
    assert not out.exists()


def test_query_without_read_only_keeps_full_duckdb(runs, tmp_path):
    a, _, secret = runs
    out = tmp_path / "written.csv"
    assert query(a, f"COPY (SELECT 1 AS x) TO '{out}'").exit_code == 0 and out.exists()
    assert query(a, f"SELECT * FROM read_csv('{secret}')").exit_code == 0


def test_read_only_collected_file(runs, tmp_path):
    a, b, secret = runs
    dest = tmp_path / "all.duckdb"
    assert CliRunner().invoke(cli, ["runs", "collect", str(a), str(b), "-o", str(dest)]).exit_code == 0
    r = query(dest, "--read-only", "--format", "csv", "SELECT count(*) AS n FROM request_metrics")
    assert r.exit_code == 0 and r.output.splitlines()[1] == "4"
    assert query(dest, "--read-only", f"SELECT * FROM read_csv('{secret}')").exit_code == 1


@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_and_compare_are_read_only(runs, monkeypatch, command):
    a, b, _ = runs
    seen = []
    real = db.connect

    def spy(*args, **kwargs):
        con = real(*args, **kwargs)
        seen.append(con.execute("SELECT current_setting('enable_external_access')").fetchone()[0])
        return con

    monkeypatch.setattr(db, "connect", spy)
    r = CliRunner().invoke(cli, [command, str(a), str(b)])
    assert r.exit_code == 0, r.output
    assert seen == [False]


def test_connect_read_only_locks_settings(runs):
    a, _, secret = runs
    con = db.connect(a, read_only=True)
    assert con.execute("SELECT count(*) FROM request_metrics").fetchone()[0] == 2
    with pytest.raises(Exception, match="locked"):
        con.execute("SET enable_external_access = true")
    with pytest.raises(Exception, match="disabled"):
        con.execute(f"SELECT * FROM read_csv('{secret}')")
