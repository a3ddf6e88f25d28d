"""Heterogeneous and capacity-aware pools (replay/cluster/instances.py, replay/cluster/fleet.py) against hand-traced
goldens.

Every step takes 1 s (``linear:base=1``) and a replica runs one request at a time
(``max_num_seqs = 1``): a request of 1 prompt token and n output tokens emits its first token after
1 s and one more every second, so it holds a replica for n seconds.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import rows
from servelab.api import ReplayConfig, replay, write_run
from servelab.common.errors import ServelabError
from servelab.scoring.db import connect


def config(instances, replicas=2, autoscale=None, floor=None, rebalance=None, **top):
    pool = {"name": "web", "replicas": replicas, "instances": instances}
    if rebalance is not None:
        pool["rebalance"] = rebalance
    if autoscale is not None:
        pool["autoscale"] = autoscale
    if floor is not None:
        pool["floor"] = floor
    return ReplayConfig.from_dict({"runner": "linear:base=1", "num_gpu_blocks": 100, "max_num_seqs": 1,
                                   "router": "least-outstanding", **top, "cluster": {"pools": [pool]}})


def instances(result):
    return {i["gpu"]: i for i in result.meta["cluster"]["pools"][0]["instances"]}


def test_the_pool_falls_back_when_the_preferred_type_is_short():
    # 3 replicas wanted; one H100 available: H100 replica 0, then A100 replicas 1 and 2 (3 is built, off)
    result = replay(make_trace([0, 0, 0], [1] * 3, [10] * 3), config(
        [{"gpu": "h100-80gb", "available": 1}, {"gpu": "a100-80gb"}], replicas=3))
    assert rows(result, "replica", "instance", "finish_s") == [
        (0, "h100-80gb", 10.0), (1, "a100-80gb", 10.0), (2, "a100-80gb", 10.0)]
    types = instances(result)
    assert types["h100-80gb"]["replicas"] == [0] and types["a100-80gb"]["replicas"] == [1, 2, 3]
    assert types["h100-80gb"]["timeline"] == [[0.0, 1, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 2, 0, 0]]
    # [0, 10]: 1 H100 and 2 A100 replicas held
    assert (types["h100-80gb"]["replica_seconds"], types["a100-80gb"]["replica_seconds"]) == (10.0, 20.0)


def test_a_fallback_replica_keeps_serving_when_the_preferred_type_comes_back():
    # no H100 until t=5: two A100s serve; at 5 two H100s appear but the pool is full (2 of 2)
    result = replay(make_trace([0, 6], [1, 1], [3, 3]), config(
        [{"gpu": "h100-80gb", "available": [[0, 0], [5, 2]]}, {"gpu": "a100-80gb"}]))
    assert rows(result, "replica", "instance") == [(2, "a100-80gb"), (2, "a100-80gb")]
    assert instances(result)["h100-80gb"]["timeline"] == [[0.0, 0, 0, 0]]


def reclaim_run(journal=True):
    # Two H100s until t=5, then one; one A100 always. A and B (10 output tokens) start at 0 on the
    # H100 replicas 0 and 1; at 5 replica 1 is reclaimed, the A100 (replica 2) starts at once and B,
    # which emitted tokens at 1, 2, 3, 4 and 5, moves there.
    return replay(make_trace([0, 0], [1, 1], [10, 10]), config(
        [{"gpu": "h100-80gb", "price_per_gpu_hour": 3.6, "available": [[0, 2], [5, 1]]},
         {"gpu": "a100-80gb", "price_per_gpu_hour": 1.8, "available": 1}], journal=journal))


def test_a_reclaimed_replica_moves_its_requests_with_the_journal():
    result = reclaim_run()
    # journal: B keeps its 5 tokens and recomputes its KV in [5, 6], which emits token 6; tokens 7..10
    # at 7..10. A is untouched on replica 0.
    assert rows(result, "replica", "instance", "status", "first_token_s", "finish_s", "generated_tokens") == [
        (0, "h100-80gb", "finished", 1.0, 10.0, 10), (2, "a100-80gb", "finished", 1.0, 10.0, 10)]
    assert rows(result, "num_resumes", "tokens_lost") == [(0, 0), (1, 0)]
    faults = result.meta["platform"]["faults"]
    assert (faults["failures"], faults["requests_moved"], faults["requests_interrupted"]) == (0, 1, 1)
    types = instances(result)
    assert types["h100-80gb"]["timeline"] == [[0.0, 2, 0, 0], [5.0, 1, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 0, 0, 0], [5.0, 1, 0, 0]]
    assert (types["h100-80gb"]["reclaimed"], types["a100-80gb"]["reclaimed"]) == (1, 0)
    # over [0, 10]: H100 2 x 5 + 1 x 5 = 15 replica-seconds, A100 1 x 5 = 5
    assert (types["h100-80gb"]["replica_seconds"], types["a100-80gb"]["replica_seconds"]) == (15.0, 5.0)
    # the replica -> type record: steps of replica 2 are the A100's, from 5 on
    steps = result.steps.to_pylist()
    assert min(s["start_s"] for s in steps if s["replica"] == 2) == 5.0


def test_without_the_journal_a_reclaimed_request_starts_over():
    result = reclaim_run(journal=False)
    # B loses its 5 tokens: a new first token at 6 ([5, 6]), then 9 more: finish at 15
    assert rows(result, "first_token_s", "finish_s", "tokens_lost") == [(1.0, 10.0, 0), (6.0, 15.0, 5)]


def test_cost_splits_gpu_time_and_dollars_by_type(tmp_path):
    run_dir = write_run(reclaim_run(), tmp_path / "run")
    con = connect([str(run_dir)])
    got = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT scope, name, gpus, gpu_s, dollars FROM cost").fetchall()}
    # first arrival 0 to last finish 10; H100: 15 GPU-s at $3.6/h = $0.015; A100: 5 GPU-s at $1.8/h = $0.0025
    assert got[("gpu", "h100-80gb")] == (2, pytest.approx(15.0), pytest.approx(0.015))
    assert got[("gpu", "a100-80gb")] == (1, pytest.approx(5.0), pytest.approx(0.0025))
    assert got[("pool", "web")] == (3, pytest.approx(20.0), pytest.approx(0.0175))
    assert got[("overall", None)][1:] == (pytest.approx(20.0), pytest.approx(0.0175))
    per_m = con.execute("SELECT dollars_per_million_output_tokens FROM cost WHERE scope = 'overall'").fetchone()[0]
    assert per_m == pytest.approx(0.0175 / 20 * 1e6)  # 20 output tokens
    by_type = dict(con.execute("SELECT instance, count(*) FROM requests GROUP BY instance").fetchall())
    assert by_type == {"h100-80gb": 1, "a100-80gb": 1}


def test_an_autoscaled_pool_refills_after_its_start_up_delay_and_requests_wait_meanwhile():
    # one replica wanted (min = max = 1); the H100 is reclaimed at 5; the A100 starts then and serves
    # from 5 + 3 = 8. A (10 tokens, 5 emitted) waits with no live replica from 5 to 8, recomputes in
    # [8, 9] (token 6), then tokens 7..10 at 10..13.
    result = replay(make_trace([0], [1], [10]), config(
        [{"gpu": "h100-80gb", "available": [[0, 1], [5, 0]]}, {"gpu": "a100-80gb"}], replicas=1,
        autoscale={"min": 1, "max": 1, "interval_s": 50, "cooldown_s": 0, "startup_s": 3}))
    assert rows(result, "replica", "instance", "finish_s", "num_resumes") == [(1, "a100-80gb", 13.0, 1)]
    pool = result.meta["cluster"]["pools"][0]
    assert pool["autoscale"]["timeline"] == [[0.0, 1, 0, 0], [5.0, 0, 1, 0], [8.0, 1, 0, 0]]
    assert instances(result)["a100-80gb"]["timeline"] == [[0.0, 0, 0, 0], [5.0, 0, 1, 0], [8.0, 1, 0, 0]]
    # held over [0, 13]: the H100 for 5 s, the A100 (starting, then active) for 8 s
    assert pool["replica_seconds"] == 13.0


def test_an_autoscaler_short_of_capacity_starts_the_rest_when_it_becomes_available():
    # tests/test_cluster_autoscale.py's load step: eight 10-token requests at 0.5 on replica 0 (queue 7),
    # A (t=5) and B (t=6) of 40 tokens; queue depth target 2, 1..3 replicas, start-up 2 s. One H100
    # (replica 0); A100s (replicas 1, 2) only from t=2.
    trace = make_trace([0.5] * 8 + [5, 6], [1] * 10, [10] * 8 + [40, 40])
    result = replay(trace, config(
        [{"gpu": "h100-80gb", "available": 1}, {"gpu": "a100-80gb", "available": [[0, 0], [2, 2]]}], replicas=1,
        autoscale={"min": 1, "max": 3, "signal": "queue_depth", "target": 2, "interval_s": 1, "cooldown_s": 5,
                   "startup_s": 2}))
    # t=1: the queue of 7 wants 3; no room: nothing starts (and no cooldown is spent). t=2: two A100s
    # become available and start, serving from 4, where A and B find them idle. As in the one-type
    # case: t=31 (queue 4) replica 2 drains until B ends at 46; t=51 (queue 2) replica 1, idle, stops.
    pool = result.meta["cluster"]["pools"][0]
    assert pool["autoscale"]["timeline"] == [
        [0.0, 1, 0, 0], [2.0, 1, 2, 0], [4.0, 3, 0, 0], [31.0, 2, 0, 1], [46.0, 2, 0, 0], [51.0, 1, 0, 0]]
    types = instances(result)
    assert types["a100-80gb"]["timeline"] == [
        [0.0, 0, 0, 0], [2.0, 0, 2, 0], [4.0, 2, 0, 0], [31.0, 1, 0, 1], [46.0, 1, 0, 0], [51.0, 0, 0, 0]]
    assert rows(result, "replica", "instance")[7:] == [(0, "h100-80gb"), (1, "a100-80gb"), (2, "a100-80gb")]
    assert [r for r, _ in rows(result, "replica", "status")] == [0] * 8 + [1, 2]
    # over [0.5, 80.5]: the H100 80 s; A100s 2 x 2 (starting) + 2 x 27 + 2 x 15 + 1 x 5 = 93 s
    assert (types["h100-80gb"]["replica_seconds"], types["a100-80gb"]["replica_seconds"]) == (80.0, 93.0)


def test_with_nothing_available_requests_wait_and_the_queue_cap_refuses():
    types = [{"gpu": "h100-80gb", "available": [[0, 0], [4, 1]]}]
    # A (t=0) and B (t=1) wait until the H100 arrives at 4: A [4, 6], B [6, 8]
    waited = replay(make_trace([0, 1], [1, 1], [2, 2]), config(types, replicas=1))
    assert rows(waited, "status", "first_scheduled_s", "finish_s") == [("finished", 4.0, 6.0), ("finished", 6.0, 8.0)]
    # queue_cap 1: B finds A waiting and is the lowest-ranked: dropped at once, counted
    capped = replay(make_trace([0, 1], [1, 1], [2, 2]), config(types, replicas=1, queue_cap=1))
    assert rows(capped, "status", "finish_s", "refused_s") == [("finished", 6.0, None), ("dropped", None, 1.0)]
    assert capped.meta["platform"]["dropped"] == 1
    # the H100 leaves at 2 and never comes back: A finished at 2; B (t=3) waits to the end, unfinished
    gone = replay(make_trace([0, 3], [1, 1], [2, 2]), config(
        [{"gpu": "h100-80gb", "available": [[0, 1], [2, 0]]}], replicas=1))
    assert rows(gone, "status", "reason") == [("finished", None), ("unfinished", "no live replica to serve it")]


def test_the_performance_floor_skips_slow_types_and_the_run_says_why():
    # the preferred type's step takes 2 s, over the floor's 1.5 s: every request runs on the other
    result = replay(make_trace([0, 0], [1, 1], [3, 3]), config(
        [{"gpu": "slow", "runner": "linear:base=2"}, {"gpu": "fast", "runner": "linear:base=1"}],
        floor={"decode_batch": 8, "context_tokens": 100, "max_step_s": 1.5}))
    assert rows(result, "instance", "finish_s") == [("fast", 3.0), ("fast", 3.0)]
    types = instances(result)
    assert types["slow"]["replicas"] == [] and types["slow"]["reference_step_s"] == 2.0
    assert types["slow"]["skipped"] == "its reference step takes 2 s > floor max_step_s 1.5"
    assert types["fast"]["reference_step_s"] == 1.0 and "skipped" not in types["fast"]
    with pytest.raises(ServelabError, match="no instance type is usable: slow: its reference step takes 2 s"):
        replay(make_trace([0], [1], [3]), config([{"gpu": "slow", "runner": "linear:base=2"}],
                                                 floor={"max_step_s": 1.5}))


def test_a_type_the_model_does_not_fit_is_skipped():
    # Llama-3.1-70B (about 141 GB of weights) at TP 2: about 70 GB per GPU does not fit a 40 GB A100; it fits an H200
    cfg = ReplayConfig.from_dict({
        "runner": "roofline", "model": "llama-3.1-70b", "tp": 2,
        "cluster": {"pools": [{"name": "web", "replicas": 1, "instances": [
            {"gpu": "a100-40gb", "price_per_gpu_hour": 1.0}, {"gpu": "h200", "price_per_gpu_hour": 4.0}]}]}})
    result = replay(make_trace([0], [100], [5]), cfg)
    types = instances(result)
    assert types["a100-40gb"]["replicas"] == [] and "does not fit at tp 2" in types["a100-40gb"]["skipped"]
    assert types["h200"]["replicas"] == [0] and rows(result, "instance", "status") == [("h200", "finished")]


@pytest.mark.parametrize("pool, message", [
    ({"instances": [{"gpu": "h100-80gb", "prise_per_gpu_hour": 1}]},
     r"cluster.pools\[0\].instances\[0\]: unknown key 'prise_per_gpu_hour'; did you mean 'price_per_gpu_hour'"),
    ({"instances": [{"price_per_gpu_hour": 1}]}, r"cluster.pools\[0\].instances\[0\]: missing 'gpu'"),
    ({"instances": [{"gpu": "a"}, {"gpu": "b", "available": [[0, 2], [0, 1]]}]},
     r"cluster.pools\[0\].instances\[1\].available\[1\]: times must increase"),
    ({"instances": [{"gpu": "a", "available": [[0, -1]]}]}, r"instances\[0\].available\[0\]: t_s and count must be >= 0"),
    ({"instances": [{"gpu": "a", "available": "lots"}]}, r"instances\[0\].available"),
    ({"instances": [{"gpu": "a"}, {"gpu": "a"}]}, r"instances\[1\].gpu: 'a' is listed twice"),
    ({"instances": []}, r"cluster.pools\[0\].instances: must be a non-empty array"),
    ({"instances": [{"gpu": "a"}], "gpu": "h100-80gb"}, r"pool 'web': 'gpu' is set per instance type"),
    ({"instances": [{"gpu": "a"}], "price_per_gpu_hour": 2}, r"'price_per_gpu_hour' is set per instance type"),
    ({"instances": [{"gpu": "a"}], "floor": {"decode_batch": 4}}, r"cluster.pools\[0\].floor: missing 'max_step_s'"),
    ({"instances": [{"gpu": "a"}], "floor": {"max_step_s": 1, "batch": 4}},
     r"cluster.pools\[0\].floor: unknown key 'batch'"),
    ({"floor": {"max_step_s": 1}}, r"floor .* needs instances"),
])
def test_bad_instance_settings_are_one_line_errors_naming_the_field(pool, message):
    with pytest.raises(ServelabError, match=message):
        ReplayConfig.from_dict({"runner": "linear:base=1", "num_gpu_blocks": 10,
                                "cluster": {"pools": [{"name": "web", **pool}]}}, source="c.toml")


def test_the_config_round_trips_and_a_toml_file_reads(tmp_path):
    cfg = config([{"gpu": "h100-80gb", "price_per_gpu_hour": 2.5, "available": [[0, 8], [1800, 4]]},
                  {"gpu": "a100-80gb", "price_per_gpu_hour": 1.6, "runner": "linear:base=2", "num_gpu_blocks": 50}],
                 floor={"max_step_s": 0.5, "decode_batch": 32, "context_tokens": 2048})
    assert ReplayConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "c.toml"
    path.write_text('runner = "linear:base=1"\nnum_gpu_blocks = 100\n[[cluster.pools]]\nname = "web"\nreplicas = 2\n'
                    'instances = [{gpu = "h100-80gb", price_per_gpu_hour = 2.5, available = [[0, 8], [1800, 4]]},\n'
                    '             {gpu = "a100-80gb", price_per_gpu_hour = 1.6}]\n'
                    'floor = {decode_batch = 32, context_tokens = 2048, max_step_s = 0.5}\n')
    loaded = ReplayConfig.from_toml(path)
    pool = loaded.cluster.pools[0]
    assert [t.gpu for t in pool.instances] == ["h100-80gb", "a100-80gb"]
    assert pool.instances[0].available == ((0.0, 8), (1800.0, 4)) and pool.instances[0].count_at(1799.9) == 8
    assert pool.instances[0].count_at(1800) == 4 and pool.instances[1].available is None


@pytest.mark.parametrize("autoscale", [None, {"min": 1, "max": 4, "signal": "queue_depth", "target": 2,
                                              "interval_s": 0.5, "cooldown_s": 1.0, "startup_s": 0.7}])
def test_bookkeeping_adds_up_through_reclaims_and_no_request_is_lost(monkeypatch, autoscale):
    """Availability rises and falls under a bursty trace (down to nothing for a while): after every
    event KV and outstanding tokens add up (tests/test_engine_invariants.py), every request
    finishes, and the pool never holds more of a type than is available."""
    import servelab.assembly
    from helpers_engine import synthetic
    from test_engine_invariants import CheckedEngine

    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    types = [{"gpu": "h100-80gb", "available": [[0, 3], [2, 1], [4, 0], [6, 2]]},
             {"gpu": "a100-80gb", "available": [[0, 0], [3, 1], [3.5, 0], [4.5, 2]]}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "num_gpu_blocks": 400,
        "max_num_seqs": 8, "router": "least-outstanding", "policy": "sarathi",
        "cluster": {"pools": [{"name": "a", "replicas": 3, "instances": types,
                               **({"autoscale": autoscale} if autoscale else {})}]}})
    result = replay(synthetic(n=400, rate=40.0, seed=5), cfg)
    statuses = result.requests.column("status").to_pylist()
    reasons = {r for r in result.requests.column("reason").to_pylist() if r is not None}
    # none lost: finished, or rejected on arrival for a size no replica can ever hold
    assert set(statuses) == {"finished", "rejected"} and all("KV blocks for prompt + max output" in r for r in reasons)
    assert result.meta["platform"]["faults"]["requests_moved"] > 0
    for ty in instances(result).values():
        assert ty["reclaimed"] > 0
        spec = next(t for t in types if t["gpu"] == ty["gpu"])["available"]
        for t, active, starting, draining in ty["timeline"]:
            allowed = max(n for at, n in spec if at <= t)
            assert active + starting + draining <= allowed, (ty["gpu"], t)
    # requests arriving while nothing is available (3.5 .. 4.5) waited and were served afterwards
    rows_ = result.requests.to_pylist()
    assert any(3.5 <= r["arrival_s"] < 4.5 and r["first_scheduled_s"] >= 4.5 for r in rows_)


def test_the_example_config_replays():
    from pathlib import Path

    cfg = ReplayConfig.from_toml(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "spot-fallback.toml")
    # a request every 25 s for 1,000 s: the H100s drop from 6 to 2 at t=600 (the pool wants 6)
    result = replay(make_trace([25.0 * i for i in range(40)], [2000] * 40, [400] * 40), cfg)
    types = instances(result)
    assert "reference step" in types["l40s"]["skipped"] and types["l40s"]["replicas"] == []
    assert types["h100-80gb"]["timeline"] == [[0.0, 6, 0, 0], [600.0, 2, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 0, 0, 0], [600.0, 3, 0, 0]]
    assert set(result.requests.column("status").to_pylist()) == {"finished"}
    late = {(r["replica"], r["instance"]) for r in result.requests.to_pylist() if r["arrival_s"] > 600}
    assert {i for _, i in late} <= {"h100-80gb", "a100-80gb"} and all(rid in (0, 1, 6, 7, 8) for rid, _ in late)


@pytest.mark.parametrize("rebalance", [False, True])
def test_rebalance_drains_a_fallback_replica_once_the_preferred_type_has_room(rebalance):
    # One replica wanted; no H100 until t=5: the A100 (replica 1) serves A (t=0, 20 tokens: [0, 20]).
    # At 5 an H100 is available. Without rebalance the A100 keeps the pool's one seat: B (t=6, 2
    # tokens) queues behind A and runs [20, 22]. With it, the H100 (replica 0) starts at once, the A100
    # drains (A finishes there at 20, then it stops) and B runs on the H100 in [6, 8].
    result = replay(make_trace([0, 6], [1, 1], [20, 2]), config(
        [{"gpu": "h100-80gb", "available": [[0, 0], [5, 1]]}, {"gpu": "a100-80gb"}], replicas=1,
        **({"rebalance": True} if rebalance else {})))
    types = instances(result)
    if not rebalance:
        assert rows(result, "replica", "instance", "finish_s") == [(1, "a100-80gb", 20.0), (1, "a100-80gb", 22.0)]
        assert types["h100-80gb"]["timeline"] == [[0.0, 0, 0, 0]]
        return
    assert rows(result, "replica", "instance", "finish_s") == [(1, "a100-80gb", 20.0), (0, "h100-80gb", 8.0)]
    assert types["h100-80gb"]["timeline"] == [[0.0, 0, 0, 0], [5.0, 1, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 1, 0, 0], [5.0, 0, 0, 1], [20.0, 0, 0, 0]]
    # over [0, 20]: the A100 held 20 s (5 serving, 15 draining), the H100 15 s
    assert (types["a100-80gb"]["replica_seconds"], types["h100-80gb"]["replica_seconds"]) == (20.0, 15.0)


def test_an_autoscaled_pool_rebalances_after_the_start_up_delay():
    # as above, autoscaled (min = max = 1, start-up 3 s): the H100 starts at 5 and serves from 8, when
    # the A100 drains; B (t=9) runs on the H100 in [9, 11]
    result = replay(make_trace([0, 9], [1, 1], [20, 2]), config(
        [{"gpu": "h100-80gb", "available": [[0, 0], [5, 1]]}, {"gpu": "a100-80gb"}], replicas=1, rebalance=True,
        autoscale={"min": 1, "max": 1, "interval_s": 50, "cooldown_s": 0, "startup_s": 3}))
    assert rows(result, "replica", "instance", "finish_s") == [(1, "a100-80gb", 20.0), (0, "h100-80gb", 11.0)]
    types = instances(result)
    assert types["h100-80gb"]["timeline"] == [[0.0, 0, 0, 0], [5.0, 0, 1, 0], [8.0, 1, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 1, 0, 0], [8.0, 0, 0, 1], [20.0, 0, 0, 0]]
    assert result.meta["cluster"]["pools"][0]["autoscale"]["timeline"] == [
        [0.0, 1, 0, 0], [5.0, 1, 1, 0], [8.0, 1, 0, 1], [20.0, 1, 0, 0]]
