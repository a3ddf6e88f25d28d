"""Integer sums past 255 and 65,535 (preemptions, tokens, iterations) come out exact in every view,
in `report`, in ad-hoc `query` SQL and in a collected DuckDB file.

DuckDB 2.0.0/2.0.1 wrapped them at 256 (`preemptions -78` for 10674) or failed with "Type INT128 ...
can't be cast ... INT8" once a query over the views had an ORDER BY (its compressed
materialization optimizer used wrong statistics below a LEFT JOIN); servelab's connections switch
that optimizer off.
"""

from __future__ import annotations

import json
import random

import pytest
from helpers_scoring import req, step, write_run

from servelab.cli.main import main
from servelab.scoring.db import connect, query_arrow
from servelab.scoring.report import report_text

N_BIG = 3000


def _requests(n: int, preemptions, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        arrival = i * 0.01
        rows.append(req(i, arrival=arrival, first_token=arrival + 0.1, finish=arrival + 0.3, output=3,
                        prompt=rng.randint(1000, 4000), tenant=f"t{i % 3}", tier=("standard", "priority")[i % 2],
                        preemptions=preemptions(rng)))  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("large_counts")
    # "big": about 75,000 preemptions (> 65,535), "mid": 300 (> 255), "tiny": 3
    big = _requests(N_BIG, lambda rng: rng.randint(0, 50), seed=1)
    mid = _requests(300, lambda rng: 1, seed=2)
    tiny = _requests(30, lambda rng: int(rng.random() < 0.1), seed=3)
    tiny[0]["num_preemptions"], tiny[1]["num_preemptions"], tiny[2]["num_preemptions"] = 1, 1, 1
    big_steps = [step(i * 0.01, 0.01, batch=4, kv_used=50, iterations=70, preemptions=100, prefill_tokens=1000,
                      prefill_requests=1) for i in range(1000)]  # fmt: skip
    dirs = {
        "big": write_run(root / "big", big, big_steps),
        "mid": write_run(root / "mid", mid, [step(0.0, 1.0, preemptions=300)]),
        "tiny": write_run(root / "tiny", tiny, [step(0.0, 1.0, preemptions=3)]),
    }
    expected = {}
    for name, rows in (("big", big), ("mid", mid), ("tiny", tiny)):
        expected[name] = {
            "preemptions": sum(r["num_preemptions"] for r in rows),
            "preempted": sum(r["num_preemptions"] > 0 for r in rows),
            "by_tier": {t: sum(r["num_preemptions"] for r in rows if r["tier"] == t) for t in ("standard", "priority")},
            "tokens_demanded": {t: sum(r["prompt_tokens"] + r["output_tokens"] for r in rows if r["tenant"] == t)
                                for t in ("t0", "t1", "t2")},  # fmt: skip
        }
    expected["big"]["step_preemptions"] = 100_000
    expected["big"]["iterations"] = 70_000
    expected["big"]["prefill_tokens"] = 70_000_000
    expected["mid"]["step_preemptions"] = 300
    expected["tiny"]["step_preemptions"] = 3
    assert expected["big"]["preemptions"] > 65_535 and expected["mid"]["preemptions"] == 300
    return dirs, expected


def _check_views(con, expected) -> None:
    rows = query_arrow(con, "SELECT run_id, scope, name, preemptions, preempted_requests FROM slo_attainment").to_pylist()
    for r in rows:
        e = expected[r["run_id"]]
        if r["scope"] == "overall":
            assert (r["preemptions"], r["preempted_requests"]) == (e["preemptions"], e["preempted"]), r
        elif r["scope"] == "tier":
            assert r["preemptions"] == e["by_tier"][r["name"]], r
    assert {r["run_id"] for r in rows if r["scope"] == "overall"} == set(expected)
    for r in query_arrow(con, "SELECT run_id, tenant, tokens_demanded FROM tenant_summary").to_pylist():
        assert r["tokens_demanded"] == expected[r["run_id"]]["tokens_demanded"][r["tenant"]], r
    res = {r["run_id"]: r for r in query_arrow(con, "SELECT * FROM resource_summary WHERE scope = 'overall'").to_pylist()}
    for run_id, e in expected.items():
        assert res[run_id]["preemptions"] == e["step_preemptions"]
    assert res["big"]["iterations"] == 70_000 and res["big"]["prefill_tokens"] == 70_000_000
    # the ad-hoc queries of the report: an aggregate over a view, with ORDER BY
    for sql in (
        "SELECT run_id, sum(num_preemptions) AS s FROM requests GROUP BY run_id ORDER BY run_id",
        "SELECT run_id, sum(num_preemptions) AS s FROM request_metrics GROUP BY run_id ORDER BY run_id",
        "SELECT run_id, CAST(sum(num_preemptions) AS BIGINT) AS s FROM request_metrics GROUP BY ALL ORDER BY s DESC",
    ):
        got = {r["run_id"]: r["s"] for r in query_arrow(con, sql).to_pylist()}
        assert got == {k: e["preemptions"] for k, e in expected.items()}, sql


def test_views_and_ad_hoc_sums_are_exact(runs):
    dirs, expected = runs
    con = connect([str(d) for d in dirs.values()])
    try:
        _check_views(con, expected)
    finally:
        con.close()


def test_report_prints_exact_preemptions(runs):
    dirs, expected = runs
    for name in ("big", "mid"):
        e = expected[name]
        assert f"preemptions {e['preemptions']} ({e['preempted']} requests)" in report_text(dirs[name])


def test_cli_report_json_query_and_collected_file(runs, tmp_path, capsys):
    dirs, expected = runs
    paths = [str(d) for d in dirs.values()]
    main(["report", *paths, "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    for run in data:
        overall = next(a for a in run["attainment"] if a["scope"] == "overall")
        assert overall["preemptions"] == expected[run["run"]["run_id"]]["preemptions"]
    main(["query", *paths, "SELECT run_id, sum(num_preemptions) AS s FROM request_metrics GROUP BY run_id ORDER BY run_id",
          "--format", "json"])  # fmt: skip
    got = {r["run_id"]: int(r["s"]) for r in json.loads(capsys.readouterr().out)}  # HUGEINT: a JSON string
    assert got == {k: e["preemptions"] for k, e in expected.items()}
    collected = tmp_path / "runs.duckdb"
    main(["runs", "collect", *paths, "-o", str(collected)])
    capsys.readouterr()
    con = connect(str(collected))
    try:
        _check_views(con, expected)
    finally:
        con.close()
