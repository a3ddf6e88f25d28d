"""Scoring over real engine output: the views' recomputed metrics agree with the columns the engine wrote."""

from __future__ import annotations

import json

import pytest

from servelab.api import ReplayConfig, replay, write_run
from servelab.replay.config import EngineConfig
from servelab.scoring import SloTable, connect, query_arrow, report_text
from servelab.traces.bundled import default_trace_path
from servelab.traces.io import read_trace
from servelab.traces.transforms import head, scale_rate


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """2,000 Azure conversation requests at 4x their rate, with a horizon so some stay unfinished."""
    trace = scale_rate(head(read_trace(default_trace_path()), 2000), 4.0)
    config = ReplayConfig(engine=EngineConfig(max_num_seqs=32, until_s=60.0))
    run_dir = tmp_path_factory.mktemp("engine") / "azure_head"
    write_run(replay(trace, config), run_dir)
    return run_dir


def test_views_agree_with_engine_columns(engine_run):
    con = connect(engine_run, SloTable.parse_cli(["ttft=2,tpot=0.1"]))
    diff = query_arrow(con, """
        SELECT count(*) AS n,
               max(abs(m.ttft_s - r.ttft_s)) AS d_ttft,
               max(abs(m.tpot_s - r.tpot_s)) AS d_tpot,
               max(abs(m.e2e_s - r.e2e_s)) AS d_e2e,
               -- (the engine writes TPOT 0 for a one-token output; the views leave it NULL, as vLLM)
               count(*) FILTER (WHERE (m.tpot_s IS NULL) <> (r.tpot_s IS NULL)
                                AND NOT (r.output_tokens <= 1 AND r.tpot_s = 0)) AS null_mismatch,
               (SELECT count(*) FROM requests WHERE arrival_s <= 60.0) AS arrived
        FROM request_metrics m JOIN requests r USING (run_id, request_id)
    """).to_pylist()[0]  # fmt: skip
    # every request that arrived by the 60 s horizon; the later ones were never offered
    assert diff["n"] == diff["arrived"] < 2000 and diff["null_mismatch"] == 0
    assert diff["d_ttft"] < 1e-9 and diff["d_tpot"] < 1e-9 and diff["d_e2e"] < 1e-9


def test_counts_match_run_json(engine_run):
    counts = json.loads((engine_run / "run.json").read_text())["counts"]
    con = connect(engine_run)
    o = query_arrow(con, "SELECT * FROM slo_attainment WHERE scope = 'overall'").to_pylist()[0]
    # run.json counts the requests arriving after the horizon as unfinished; the views count them apart
    assert (o["finished"], o["unfinished"] + o["after_horizon"], o["rejected"]) == \
        (counts["finished"], counts["unfinished"], counts["rejected"])
    assert o["after_horizon"] > 0
    assert o["unfinished"] > 0  # the horizon cut some off: they count as misses
    assert o["attainment"] == pytest.approx(o["finished"] / o["requests"])
    r = query_arrow(con, "SELECT * FROM resource_summary WHERE scope = 'overall'").to_pylist()[0]
    assert 0 < r["mean_kv_util"] <= r["max_kv_util"] <= 1
    assert 1 <= r["mean_batch_requests"] <= r["max_batch_requests"] <= 32
    assert r["preemptions"] == o["preemptions"]  # steps and requests agree


def test_report_of_engine_run(engine_run):
    text = report_text(engine_run, ("ttft=2,tpot=0.1",))
    assert "run azure_head" in text and "policy sarathi" in text
