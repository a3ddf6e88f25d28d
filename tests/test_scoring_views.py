"""Hand-computed checks of every scoring view on a five-request run (see the table in each test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers_scoring import req, step, write_run

from servelab.common.errors import InputError
from servelab.scoring.db import connect, query_arrow, query_polars
from servelab.scoring.slo import SloTable

# id tenant tier      arrival sched first_tok finish out prompt  ttft  tpot  e2e   note
# 1  acme  standard  0.0     0.5   1.0       3.0    5   100     1.0   0.5   3.0
# 2  acme  priority  1.0     1.0   1.2       1.2    1   50      0.2   0     0.2   one-token output
# 3  beta  standard  2.0     2.0   2.4       4.4    3   20      0.4   1.0   2.4   ttft_slo_s override 0.3
# 4  beta  standard  3.0     -     -         -      10  30      unfinished, never scheduled
# 5  beta  priority  3.5     -     -         -      5   40      rejected
REQUESTS = [
    req(1, arrival=0.0, first_scheduled=0.5, first_token=1.0, finish=3.0, output=5, prompt=100, tenant="acme", max_itl=0.8),
    req(2, arrival=1.0, first_token=1.2, finish=1.2, output=1, prompt=50, tenant="acme", tier="priority", preemptions=0),
    req(3, arrival=2.0, first_token=2.4, finish=4.4, output=3, prompt=20, tenant="beta", max_itl=1.5, ttft_slo=0.3, preemptions=1),
    req(4, "unfinished", arrival=3.0, output=10, prompt=30, tenant="beta"),
    req(5, "rejected", arrival=3.5, output=5, prompt=40, tenant="beta", tier="priority"),
]
STEPS = [
    step(0.0, 1.0, batch=1, kv_used=10, waiting=0),
    step(1.0, 2.0, batch=2, kv_used=30, waiting=1, iterations=4, preemptions=1, prefill_tokens=5, prefill_requests=1),
    step(3.0, 1.4, batch=1, kv_used=20, waiting=0),
]
SLO = SloTable.parse_cli(["ttft=1.0,tpot=0.6", "tier=priority:ttft=0.1", "tenant=beta:tpot=2.0"])


@pytest.fixture
def run_a(tmp_path):
    return write_run(tmp_path / "a", REQUESTS, STEPS)


@pytest.fixture
def con(run_a):
    c = connect(run_a, SLO)
    yield c
    c.close()


def rows(con, sql):
    return query_arrow(con, sql).to_pylist()


def by_id(con, view="request_metrics"):
    return {r["request_id"]: r for r in rows(con, f"SELECT * FROM {view} ORDER BY request_id")}


def test_request_metrics_latencies(con):
    m = by_id(con)
    assert m[1]["ttft_s"] == pytest.approx(1.0)
    assert m[1]["tpot_s"] == pytest.approx(0.5)  # (3.0 - 1.0) / (5 - 1)
    assert m[1]["e2e_s"] == pytest.approx(3.0)
    assert m[1]["queue_s"] == pytest.approx(0.5)
    assert m[2]["tpot_s"] is None  # one-token output: no TPOT (vLLM keeps only outputs > 1 token)
    assert m[2]["max_stall_s"] == 0.0 and m[2]["max_itl_s"] is None
    assert m[3]["tpot_s"] == pytest.approx(1.0)
    assert m[4]["ttft_s"] is None and m[4]["tpot_s"] is None and m[4]["e2e_s"] is None
    assert m[4]["wait_s"] == pytest.approx(1.4)  # never scheduled: run end 4.4 - arrival 3.0
    assert m[5]["wait_s"] is None  # rejected: not waiting
    assert [m[i]["finished"] for i in range(1, 6)] == [True, True, True, False, False]


def test_slo_precedence_and_flags(con):
    m = by_id(con)
    assert m[1]["ttft_slo_s"] == 1.0 and m[1]["tpot_slo_s"] == 0.6  # global
    assert m[2]["ttft_slo_s"] == 0.1 and m[2]["tpot_slo_s"] == 0.6  # tier over global, field by field
    assert m[3]["ttft_slo_s"] == 0.3 and m[3]["tpot_slo_s"] == 2.0  # request override; tenant
    assert m[3]["e2e_slo_s"] is None and m[3]["met_e2e"] is None  # not specified anywhere
    flags = {i: (m[i]["met_ttft"], m[i]["met_tpot"], m[i]["met_all"]) for i in m}
    assert flags == {
        1: (True, True, True),  # ttft 1.0 <= 1.0 (inclusive, like vLLM)
        2: (False, True, False),  # 0.2 > 0.1
        3: (False, True, False),  # 0.4 > 0.3 override (the global 1.0 would pass)
        4: (False, False, False),  # unfinished: a miss
        5: (False, False, False),  # rejected: a miss
    }


def test_one_token_outputs_meet_tpot_but_are_left_out_of_its_summaries(tmp_path):
    # vLLM bench serve: TPOT only for outputs > 1 token; its goodput check counts a 1-token one as TPOT 0 (met)
    reqs = [req(1, arrival=0.0, first_token=0.1, finish=0.1, output=1),
            req(2, arrival=0.0, first_token=0.1, finish=0.5, output=3),  # tpot 0.2
            req(3, arrival=0.0, first_token=0.1, finish=0.9, output=3)]  # tpot 0.4
    c = connect(write_run(tmp_path / "one", reqs, [step(0.0, 0.9)]), SloTable.parse_cli(["tpot=0.3"]))
    m = by_id(c)
    assert m[1]["tpot_s"] is None and m[1]["met_tpot"] is True and m[1]["met_all"] is True
    assert [m[i]["met_tpot"] for i in (2, 3)] == [True, False]
    tpot = rows(c, "SELECT * FROM latency_summary WHERE scope = 'overall' AND metric = 'tpot_s'")[0]
    assert (tpot["n"], tpot["mean"]) == (2, pytest.approx(0.3))
    assert rows(c, "SELECT tpot_p50_s FROM tenant_summary")[0]["tpot_p50_s"] == pytest.approx(0.3)
    a = rows(c, "SELECT * FROM slo_attainment WHERE scope = 'overall'")[0]
    assert (a["attainment"], a["attainment_tpot"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    # the other tools keep their own definitions: a one-token output has a TPOT there
    assert by_id(c, "request_metrics_guidellm")[1]["tpot_s"] == pytest.approx(0.1)
    assert by_id(c, "request_metrics_distserve")[1]["tpot_s"] == 0.0


def test_request_override_is_what_fails_request_3(run_a, tmp_path):
    plain = [dict(r, ttft_slo_s=None) for r in REQUESTS]
    c = connect(write_run(tmp_path / "plain", plain, STEPS), SLO)
    assert by_id(c)[3]["met_all"] is True


def test_tenant_beats_tier_beats_global(tmp_path):
    reqs = [
        req(1, arrival=0, first_token=0.3, finish=0.3, tenant="gold", tier="fast"),  # tenant 0.35 > tier 0.25
        req(2, arrival=0, first_token=0.3, finish=0.3, tenant="x", tier="fast"),  # tier 0.25 < 0.3 -> miss
        req(3, arrival=0, first_token=0.3, finish=0.3, tenant="x", tier="slow"),  # global 0.5
        req(4, arrival=0, first_token=0.3, finish=0.3, tenant="gold", tier="fast", ttft_slo=0.2),  # request
    ]
    slo = SloTable.parse_cli(["ttft=0.5", "tier=fast:ttft=0.25", "tenant=gold:ttft=0.35"])
    m = by_id(connect(write_run(tmp_path / "p", reqs), slo))
    assert [m[i]["ttft_slo_s"] for i in (1, 2, 3, 4)] == [0.35, 0.25, 0.5, 0.2]
    assert [m[i]["met_all"] for i in (1, 2, 3, 4)] == [True, False, True, False]


def test_slo_attainment(con):
    a = {(r["scope"], r["name"]): r for r in rows(con, "SELECT * FROM slo_attainment")}
    o = a[("overall", None)]
    assert (o["requests"], o["finished"], o["unfinished"], o["rejected"], o["met_all"]) == (5, 3, 1, 1, 1)
    assert o["attainment"] == pytest.approx(1 / 5)
    assert o["attainment_ttft"] == pytest.approx(1 / 5)
    assert o["attainment_tpot"] == pytest.approx(3 / 5)
    assert o["attainment_e2e"] is None
    assert o["preemptions"] == 1 and o["preempted_requests"] == 1
    assert a[("tier", "standard")]["attainment"] == pytest.approx(1 / 3)
    assert a[("tier", "priority")]["attainment"] == 0.0
    assert a[("tenant", "acme")]["attainment"] == pytest.approx(1 / 2)
    assert a[("tenant", "beta")]["attainment"] == 0.0
    assert [r["scope"] for r in rows(con, "SELECT scope FROM slo_attainment")] == ["overall"] + ["tier"] * 2 + ["tenant"] * 2


def test_latency_summary_matches_numpy_linear_percentiles(con):
    lat = {(r["scope"], r["name"], r["metric"]): r for r in rows(con, "SELECT * FROM latency_summary")}
    for metric, values in {"ttft_s": [1.0, 0.2, 0.4], "tpot_s": [0.5, 1.0], "e2e_s": [3.0, 0.2, 2.4]}.items():
        r = lat[("overall", None, metric)]
        assert r["n"] == len(values)  # the one-token output has no TPOT
        assert r["mean"] == pytest.approx(np.mean(values))
        for name, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("p999", 99.9)):
            assert r[name] == pytest.approx(np.percentile(values, q)), (metric, name)
    assert lat[("overall", None, "ttft_s")]["p90"] == pytest.approx(0.88)  # 0.4 + 0.8 * (1.0 - 0.4)
    assert lat[("overall", None, "max_itl_s")]["n"] == 2  # the one-token output has no gap
    assert lat[("tier", "priority", "ttft_s")]["p50"] == pytest.approx(0.2)
    assert lat[("tenant", "beta", "e2e_s")]["n"] == 1


def test_goodput_and_throughput(con):
    g = {(r["scope"], r["name"]): r for r in rows(con, "SELECT * FROM goodput")}
    o = g[("overall", None)]
    assert o["duration_s"] == pytest.approx(4.4)  # first arrival 0.0 to last finish 4.4
    assert o["request_throughput_rps"] == pytest.approx(3 / 4.4)
    assert o["output_throughput_tps"] == pytest.approx((5 + 1 + 3) / 4.4)
    assert o["total_token_throughput_tps"] == pytest.approx((105 + 51 + 23) / 4.4)
    assert o["goodput_rps"] == pytest.approx(1 / 4.4)
    assert o["num_gpus"] == 1 and o["goodput_rps_per_gpu"] == pytest.approx(1 / 4.4)
    assert o["offered_rate_rps"] == pytest.approx(4 / 3.5)  # (n - 1) / (last - first arrival)
    assert g[("tenant", "acme")]["goodput_rps"] == pytest.approx(1 / 4.4)
    assert g[("tenant", "beta")]["request_throughput_rps"] == pytest.approx(1 / 4.4)


def test_goodput_per_gpu_uses_replicas_and_tp(tmp_path):
    run = write_run(tmp_path / "g", REQUESTS, STEPS, meta={"engine": {"replicas": 2}, "runner": {"params": {"tp": 2}}})
    o = rows(connect(run, SLO), "SELECT * FROM goodput WHERE scope = 'overall'")[0]
    assert o["num_gpus"] == 4
    assert o["goodput_rps_per_gpu"] == pytest.approx(1 / 4.4 / 4)


def test_tenant_summary_and_fairness(con):
    t = {r["tenant"]: r for r in rows(con, "SELECT * FROM tenant_summary")}
    assert t["acme"]["tokens_demanded"] == 156 and t["acme"]["tokens_served"] == 156
    assert t["beta"]["tokens_demanded"] == 23 + 40 + 45
    assert t["beta"]["tokens_served"] == 23  # request 4 never started, 5 was rejected
    assert t["beta"]["refused"] == 1 and t["beta"]["unfinished"] == 1
    assert t["acme"]["max_wait_s"] == pytest.approx(0.5)
    assert t["beta"]["max_wait_s"] == pytest.approx(1.4)
    f = rows(con, "SELECT * FROM fairness")[0]
    x = [1.0, 23 / 108]
    assert f["jain_service"] == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))
    assert f["jain_attainment"] == pytest.approx(0.5)  # (0.5 + 0)^2 / (2 * 0.25)
    assert f["worst_tenant"] == "beta" and f["worst_tenant_attainment"] == 0.0
    assert f["max_wait_s"] == pytest.approx(1.4) and f["longest_wait_tenant"] == "beta"


def test_resource_views_weight_by_duration(con):
    r = rows(con, "SELECT * FROM resource_summary WHERE scope = 'overall'")[0]
    assert r["busy_s"] == pytest.approx(4.4)
    assert r["iterations"] == 6
    assert r["mean_batch_requests"] == pytest.approx((1 * 1.0 + 2 * 2.0 + 1 * 1.4) / 4.4)
    assert r["mean_kv_util"] == pytest.approx((0.1 * 1.0 + 0.3 * 2.0 + 0.2 * 1.4) / 4.4)
    assert r["max_kv_util"] == pytest.approx(0.3)
    assert r["mean_waiting"] == pytest.approx(2.0 / 4.4)
    assert r["prefill_tokens"] == 20 and r["preemptions"] == 1
    b = rows(con, "SELECT * FROM replica_balance")[0]
    assert b["replicas"] == 1 and b["jain_busy"] == pytest.approx(1.0)


def test_replica_balance_two_replicas(tmp_path):
    reqs = [req(i, arrival=i, first_token=i + 0.1, finish=i + 0.2, replica=i % 2) for i in range(3)]
    steps = [step(0, 3.0, replica=0), step(0, 1.0, replica=1)]
    b = rows(connect(write_run(tmp_path / "r", reqs, steps)), "SELECT * FROM replica_balance")[0]
    assert (b["replicas"], b["min_requests"], b["max_requests"]) == (2, 1, 2)
    assert b["busy_max_over_mean"] == pytest.approx(3.0 / 2.0)
    assert b["jain_busy"] == pytest.approx(16 / (2 * 10))
    assert b["jain_requests"] == pytest.approx(9 / (2 * 5))


def test_metric_variants(con):
    g = by_id(con, "request_metrics_guidellm")
    d = by_id(con, "request_metrics_distserve")
    assert [g[i]["tpot_s"] for i in (1, 2, 3)] == pytest.approx([3.0 / 5, 0.2 / 1, 2.4 / 3])  # e2e / out
    assert [d[i]["tpot_s"] for i in (1, 2, 3)] == pytest.approx([2.0 / 5, 0.0, 2.0 / 3])  # (e2e - ttft) / out
    assert g[1]["met_tpot"] is True  # 0.6 <= 0.6
    assert g[4]["tpot_s"] is None and g[4]["met_all"] is False
    assert g[1]["ttft_s"] == by_id(con)[1]["ttft_s"]


def test_no_slo_means_attainment_is_share_finished(run_a, tmp_path):
    plain = write_run(tmp_path / "plain", [dict(r, ttft_slo_s=None) for r in REQUESTS])
    o = rows(connect(plain), "SELECT * FROM slo_attainment WHERE scope = 'overall'")[0]
    assert o["attainment"] == pytest.approx(3 / 5)
    assert o["attainment_ttft"] is None and o["attainment_tpot"] is None
    c = connect(run_a)  # no table, but request 3 brings its own ttft SLO (0.3) and misses it
    o = rows(c, "SELECT * FROM slo_attainment WHERE scope = 'overall'")[0]
    assert o["attainment"] == pytest.approx(2 / 5)
    assert o["attainment_ttft"] == 0.0
    assert rows(c, "SELECT count(*) AS n FROM slo_table")[0]["n"] == 0


def test_max_stall_and_e2e_slo(run_a):
    c = connect(run_a, SloTable.parse_cli(["e2e=2.5,max_stall=1.0"]))
    m = by_id(c)
    assert [m[i]["met_e2e"] for i in (1, 2, 3)] == [False, True, True]
    assert [m[i]["met_stall"] for i in (1, 2, 3)] == [True, True, False]  # max itl 0.8, none, 1.5
    assert [m[i]["met_all"] for i in (1, 2, 3)] == [False, True, False]  # request 3: ttft override 0.3 too


def test_two_runs_in_one_query(tmp_path):
    write_run(tmp_path / "a", REQUESTS, STEPS)
    faster = [dict(r) for r in REQUESTS]
    faster[1] = req(2, arrival=1.0, first_token=1.05, finish=1.05, output=1, prompt=50, tenant="acme", tier="priority")
    write_run(tmp_path / "b", faster, STEPS[:1])
    c = connect([str(tmp_path / "*")], SLO)
    att = rows(c, "SELECT run_id, attainment FROM slo_attainment WHERE scope = 'overall' ORDER BY run_id")
    assert att == [{"run_id": "a", "attainment": pytest.approx(0.2)}, {"run_id": "b", "attainment": pytest.approx(0.4)}]
    counts = rows(c, "SELECT run_id, count(*) AS n FROM requests GROUP BY run_id ORDER BY run_id")
    assert [r["n"] for r in counts] == [5, 5]
    steps = rows(c, "SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id")
    assert [r["n"] for r in steps] == [3, 1]
    assert rows(c, "SELECT count(*) AS n FROM runs")[0]["n"] == 2
    df = query_polars(c, "SELECT run_id FROM runs ORDER BY run_id")
    assert df["run_id"].to_list() == ["a", "b"]


def test_same_run_name_in_two_folders_gets_distinct_ids(tmp_path):
    write_run(tmp_path / "s1" / "rate_1", REQUESTS)
    write_run(tmp_path / "s2" / "rate_1", REQUESTS)
    c = connect([tmp_path / "s1" / "rate_1", tmp_path / "s2" / "rate_1"])
    ids = [r["run_id"] for r in rows(c, "SELECT run_id FROM runs ORDER BY run_id")]
    assert ids == ["s1/rate_1", "s2/rate_1"]
    assert rows(c, "SELECT count(DISTINCT run_id) AS n FROM requests")[0]["n"] == 2


def test_search_directory_is_expanded(tmp_path):
    for i in range(3):
        write_run(tmp_path / "study" / "trials" / f"t{i}", REQUESTS)
    c = connect(tmp_path / "study")
    assert rows(c, "SELECT count(*) AS n FROM runs")[0]["n"] == 3


def test_runs_view_flattens_run_json(con):
    r = rows(con, "SELECT * FROM runs")[0]
    assert r["run_id"] == "a"
    assert r["policy_name"] == "fcfs" and r["runner_name"] == "linear" and r["runner_base"] == 0.01
    assert r["engine_max_num_seqs"] == 8 and r["engine_router"] == "round-robin"
    assert r["trace_rows"] == 5 and r["counts_unfinished"] == 1 and r["seed"] == 0


def test_absent_optional_columns_and_new_statuses(tmp_path):
    old = write_run(tmp_path / "old", REQUESTS, drop_columns=("max_itl_s", "ttft_slo_s", "tpot_slo_s", "session_id", "reason"))
    new_rows = [
        req(1, arrival=0, first_token=0.1, finish=0.2, output=2, num_retries=2, paused_s=0.5),
        req(2, "throttled", arrival=0.5, num_retries=0, paused_s=0.0),
        req(3, "dropped", arrival=0.6, num_retries=1, paused_s=0.0),
    ]
    new = write_run(tmp_path / "new", new_rows)
    c = connect([old, new], SloTable.parse_cli(["ttft=10"]))
    o = {r["run_id"]: r for r in rows(c, "SELECT * FROM slo_attainment WHERE scope = 'overall'")}
    assert o["old"]["attainment"] == pytest.approx(3 / 5)  # no override column: request 3 uses ttft=10
    assert (o["new"]["throttled"], o["new"]["dropped"], o["new"]["attainment"]) == (1, 1, pytest.approx(1 / 3))
    m = rows(c, "SELECT run_id, num_retries, paused_s FROM request_metrics ORDER BY run_id, request_id")
    assert [r["num_retries"] for r in m] == [2, 0, 1, None, None, None, None, None]


def test_missing_required_column_names_file_and_column(tmp_path):
    run = write_run(tmp_path / "bad", REQUESTS, drop_columns=("arrival_s",))
    with pytest.raises(InputError) as err:
        connect(run)
    assert str(err.value) == f"{run / 'requests.parquet'}, column 'arrival_s': missing required column"


def test_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no requests.parquet in it or below it"):
        connect(tmp_path / "empty")
    with pytest.raises(InputError, match="no such run directory"):
        connect(tmp_path / "missing")


def test_bad_run_json(tmp_path):
    run = write_run(tmp_path / "a", REQUESTS)
    (run / "run.json").write_text("{not json")
    with pytest.raises(InputError) as err:
        connect(run)
    assert str(err.value).startswith(f"{run / 'run.json'}, row 1: not valid JSON")


def test_run_without_steps(tmp_path):
    run = write_run(tmp_path / "a", REQUESTS)
    (run / "steps.parquet").unlink()
    c = connect(run, SLO)
    assert rows(c, "SELECT count(*) AS n FROM resource_summary")[0]["n"] == 0
    assert rows(c, "SELECT duration_s FROM goodput WHERE scope = 'overall'")[0]["duration_s"] == pytest.approx(4.4)


def test_empty_requests_table(tmp_path):
    c = connect(write_run(tmp_path / "e", []))
    assert rows(c, "SELECT * FROM slo_attainment") == []
    assert rows(c, "SELECT * FROM goodput") == []


def test_query_error_is_servelab_error(con):
    from servelab.common.errors import ServelabError

    with pytest.raises(ServelabError, match="query failed"):
        query_arrow(con, "SELECT nope FROM requests")


def test_deterministic_results(run_a):
    a = query_arrow(connect(run_a, SLO), "SELECT * FROM latency_summary")
    b = query_arrow(connect(run_a, SLO), "SELECT * FROM latency_summary")
    assert a.equals(b)
    assert not any(isinstance(v, float) and math.isnan(v) for row in a.to_pylist() for v in row.values())


def test_resource_timeline_splits_stretches_across_buckets(con):
    # buckets of 2 s: [0,2) holds 1.0 s of batch 1 and 1.0 s of batch 2; [2,4) 1.0 s of batch 2 and
    # 1.0 s of batch 1; [4,6) the last 0.4 s of batch 1
    t = rows(con, "SELECT * FROM resource_timeline(2.0)")
    assert [r["t_s"] for r in t] == [0.0, 2.0, 4.0]
    assert [r["busy_share"] for r in t] == pytest.approx([1.0, 1.0, 0.2])
    assert [r["mean_batch_requests"] for r in t] == pytest.approx([1.5, 1.5, 1.0])
    assert [r["mean_kv_util"] for r in t] == pytest.approx([0.2, 0.25, 0.2])
    assert [r["mean_waiting"] for r in t] == pytest.approx([0.5, 0.5, 0.0])


def test_unreadable_parquet_names_the_file(tmp_path):
    run = write_run(tmp_path / "a", REQUESTS)
    (run / "requests.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError) as err:
        connect(run)
    assert str(err.value).startswith(f"{run / 'requests.parquet'}: not a readable Parquet file")


def test_views_over_parquet_match_loaded_tables(tmp_path, monkeypatch):
    import servelab.scoring.sources as sources

    write_run(tmp_path / "a", REQUESTS, STEPS)
    write_run(tmp_path / "b", REQUESTS[:3], drop_columns=("max_itl_s", "ttft_slo_s"))
    sql = [f"SELECT * FROM {v} ORDER BY ALL" for v in ("request_metrics", "slo_attainment", "latency_summary",
                                                       "goodput", "fairness", "resource_summary")]  # fmt: skip
    loaded = [query_arrow(connect(tmp_path / "*", SLO), q) for q in sql]
    monkeypatch.setattr(sources, "MATERIALIZE_MAX_ROWS", -1)
    con = connect(tmp_path / "*", SLO)
    assert con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'requests'").fetchall()[0][0] == "VIEW"
    assert [query_arrow(con, q) for q in sql] == loaded


def test_hidden_folders_are_not_runs(tmp_path):
    write_run(tmp_path / "study" / "t1", REQUESTS)
    write_run(tmp_path / "study" / ".t2.abc.tmp", REQUESTS)  # a run being written
    assert rows(connect(tmp_path / "study"), "SELECT run_id FROM runs") == [{"run_id": "t1"}]


def test_wait_is_measured_to_the_replay_horizon(tmp_path):
    reqs = [*REQUESTS, req(6, "unfinished", arrival=5.0, tenant="acme")]  # arrives after the horizon
    c = connect(write_run(tmp_path / "h", reqs, STEPS, meta={"simulated_span_s": 4.5}))
    m = by_id(c)
    assert m[4]["wait_s"] == pytest.approx(1.5)  # 4.5 - 3.0: the replay stopped at 4.5
    assert 6 not in m  # never arrived before the end: not offered
    assert rows(c, "SELECT end_s FROM run_span")[0]["end_s"] == 4.5


def test_requests_arriving_after_the_horizon_are_counted_apart_not_as_misses(tmp_path):
    reqs = [*REQUESTS, req(6, "unfinished", arrival=5.0, tenant="acme"), req(7, "unfinished", arrival=6.0, tenant="beta")]
    c = connect(write_run(tmp_path / "h", reqs, STEPS, meta={"simulated_span_s": 4.5}), SLO)
    sp = rows(c, "SELECT * FROM run_span")[0]
    assert (sp["requests"], sp["after_horizon"], sp["last_arrival_s"]) == (5, 2, 3.5)
    assert sp["offered_rate_rps"] == pytest.approx(4 / 3.5)  # the arrivals the run was offered
    a = {(r["scope"], r["name"]): r for r in rows(c, "SELECT * FROM slo_attainment")}
    o = a[("overall", None)]
    assert (o["requests"], o["unfinished"], o["after_horizon"], o["met_all"]) == (5, 1, 2, 1)
    assert o["attainment"] == pytest.approx(1 / 5)  # as without the late ones: they were never offered
    assert a[("tenant", "acme")]["after_horizon"] == 1 and a[("tier", "standard")]["after_horizon"] == 2
    assert a[("tier", "priority")]["after_horizon"] == 0
    g = rows(c, "SELECT requests, after_horizon, attainment FROM goodput WHERE scope = 'overall'")[0]
    assert (g["requests"], g["after_horizon"], g["attainment"]) == (5, 2, pytest.approx(1 / 5))
    t = {r["tenant"]: r for r in rows(c, "SELECT * FROM tenant_summary")}
    assert (t["beta"]["requests"], t["beta"]["unfinished"], t["beta"]["after_horizon"]) == (3, 1, 1)


def test_duration_is_to_the_run_end_when_a_horizon_run_finished_nothing(tmp_path):
    reqs = [req(1, "unfinished", arrival=0.1, first_token=0.25), req(2, "unfinished", arrival=0.2),
            req(3, "unfinished", arrival=40.0)]  # after the 0.3 s horizon
    c = connect(write_run(tmp_path / "h", reqs, [step(0.1, 0.2)], meta={"simulated_span_s": 0.3}))
    sp = rows(c, "SELECT * FROM run_span")[0]
    assert sp["duration_s"] == pytest.approx(0.2)  # run end 0.3 - first arrival 0.1, not the last arrival's 40
    assert sp["duration_to_finish"] is False
    assert rows(c, "SELECT duration_s FROM goodput WHERE scope = 'overall'")[0]["duration_s"] == pytest.approx(0.2)
