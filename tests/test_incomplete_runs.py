"""Incomplete run folders are refused or flagged, never read as complete: a folder without run.json
(its GPUs, duration and settings unknown), a live run stopped by a signal (its requests never sent),
an interrupted level of a live sweep (not a point of the attainment curve)."""

from __future__ import annotations

import pytest
from helpers_cli import run_main
from helpers_scoring import req, write_run


def _requests(n: int, gap_s: float, status_after: int | None = None) -> list[dict]:
    out = []
    for i in range(n):
        a = i * gap_s
        if status_after is not None and i >= status_after:
            out.append(req(i, status="cancelled", arrival=a, first_token=a + 0.05))
        else:
            out.append(req(i, arrival=a, first_token=a + 0.05, finish=a + 0.2, output=5))
    return out


def test_a_run_folder_without_run_json_is_refused(tmp_path, capsys):
    run = write_run(tmp_path / "r", _requests(4, 0.5), meta={"engine": {"replicas": 2}})
    (run / "run.json").unlink()
    for argv in (["report", run], ["query", run, "SELECT * FROM goodput"]):
        code, _, err = run_main(argv, capsys)
        assert code == 1 and err.strip().splitlines() == [f"error: {run / 'run.json'}: missing: an incomplete run "
                                                          "folder (its GPUs, duration and settings are unknown)"]


def test_report_shows_stopped_by_and_requests_never_sent(tmp_path, capsys):
    run = write_run(tmp_path / "live", _requests(4, 0.5, status_after=3),
                    meta={"kind": "live", "stopped_by": "interrupt", "signal": "SIGTERM",
                          "counts": {"finished": 3, "cancelled": 1, "not_sent": 16}})
    code, out, err = run_main(["report", run], capsys)
    assert code == 0, err
    assert "stopped by interrupt (SIGTERM): 16 requests of the trace never sent (not counted above)" in out


def test_an_interrupted_sweep_level_is_not_a_point_of_the_curve(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    write_run(sweep / "rate_2", _requests(10, 0.5), meta={"kind": "live", "stopped_by": None})
    write_run(sweep / "rate_4", _requests(10, 0.25), meta={"kind": "live", "stopped_by": None})
    write_run(sweep / "rate_8", _requests(10, 0.125, status_after=2),
              meta={"kind": "live", "stopped_by": "interrupt", "counts": {"not_sent": 30}})
    code, out, err = run_main(["query", sweep, "SELECT run_id, offered_rate_rps FROM attainment_vs_rate",
                               "--format", "csv"], capsys)  # fmt: skip
    assert code == 0, err
    assert [line.split(",")[0].strip("\"") for line in out.strip().splitlines()[1:]] == ["rate_2", "rate_4"]
    code, out, err = run_main(["query", sweep, "SELECT run_id, stopped_by, not_sent FROM runs ORDER BY run_id",
                               "--format", "csv"], capsys)  # fmt: skip
    assert out.replace("\"", "").strip().splitlines()[1:] == ["rate_2,,0", "rate_4,,0", "rate_8,interrupt,30"]


def test_a_file_collected_before_the_new_runs_columns_still_scores(tmp_path, capsys):
    import duckdb

    run = write_run(tmp_path / "r", _requests(4, 0.5))
    db = tmp_path / "c.duckdb"
    code, _, err = run_main(["runs", "collect", run, "-o", db], capsys)
    assert code == 0, err
    with duckdb.connect(str(db)) as con:  # as an older servelab wrote it
        for column in ("source_duration_s", "stopped_by", "not_sent"):
            con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    code, out, err = run_main(["query", db, "SELECT count(*) AS n FROM attainment_vs_rate", "--format", "csv"], capsys)
    assert code == 0 and out.strip().splitlines()[-1] == "1", err
