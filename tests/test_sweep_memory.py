"""Issue #31: a sweep (a goodput trial) scores each point from its tables in memory, on one connection,
with the same figures the written run directory gives."""

from __future__ import annotations

import pytest

import servelab.scoring.db as db
from servelab.scoring.sweep import run_sweep
from test_sweep import CONFIG, SLO, trace_path  # noqa: F401  (trace_path: the module's fixture)


def _from_files(run_dir) -> dict:
    """A point's figures the way the sweep read them before: from the run directory's Parquet files."""
    con = db.connect(run_dir, SLO)
    try:
        rel = con.execute("SELECT * FROM slo_attainment WHERE scope = 'overall'")
        att = dict(zip([d[0] for d in rel.description], rel.fetchall()[0]))
        g = con.execute("SELECT goodput_rps, request_throughput_rps, num_gpus FROM goodput WHERE scope = 'overall'").fetchall()[0]
        lat = dict(con.execute("SELECT metric, p99 FROM latency_summary WHERE scope = 'overall' "
                               "AND metric IN ('ttft_s', 'tpot_s')").fetchall())
    finally:
        con.close()
    return {"requests": att["requests"], "attainment": att["attainment"], "attainment_ttft": att["attainment_ttft"],
            "attainment_tpot": att["attainment_tpot"], "goodput_rps": g[0], "request_throughput_rps": g[1],
            "num_gpus": g[2], "ttft_p99_s": lat.get("ttft_s"), "tpot_p99_s": lat.get("tpot_s"),
            "unfinished": att["unfinished"], "refused": att["rejected"] + att["throttled"] + att["dropped"]}


def test_sweep_points_are_scored_in_memory_with_the_files_figures(trace_path, tmp_path, monkeypatch):  # noqa: F811
    real_connect = db.connect

    def no_files(*args, **kwargs):
        raise AssertionError("a sweep point was read back from its files")

    monkeypatch.setattr(db, "connect", no_files)
    res = run_sweep(trace_path, CONFIG, tmp_path / "s", slo=SLO, rates=[4.0, 9.0, 10.5, 16.0])
    monkeypatch.setattr(db, "connect", real_connect)
    assert len(res.points) == 4
    assert len({p.attainment for p in res.points}) > 1  # the rates differ in what they score
    for point in res.points:
        expected = _from_files(tmp_path / "s" / point.run_dir)
        assert {k: getattr(point, k) for k in expected} == expected, point.run_dir


def test_parallel_points_score_the_same_in_memory(trace_path, tmp_path):  # noqa: F811
    serial = run_sweep(trace_path, CONFIG, tmp_path / "s", slo=SLO, rates=[7.0, 12.0])
    parallel = run_sweep(trace_path, CONFIG, tmp_path / "p", slo=SLO, rates=[7.0, 12.0], jobs=2)
    assert [p.to_dict() if hasattr(p, "to_dict") else p for p in serial.points] == \
        [p.to_dict() if hasattr(p, "to_dict") else p for p in parallel.points]
    for point in parallel.points:
        expected = _from_files(tmp_path / "p" / point.run_dir)
        assert {k: getattr(point, k) for k in expected} == expected, point.run_dir
