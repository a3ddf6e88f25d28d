"""Autoscaled prefill and decode pools (replay/cluster/autoscale.py through replay/cluster/disagg.py) against
hand-computed replica timelines.

Every step costs 1 s (``linear:base=1``); KV is 1,000 bytes per token. Arrivals sit at half
seconds and the autoscalers look at whole seconds, so no tick shares an instant with a step.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError

UNIT = "linear:base=1"


def config(prefill, decode, bandwidth_gbps, **top):
    pools = [dict(dict(name="p", role="prefill", replicas=1), **prefill),
             dict(dict(name="d", role="decode", replicas=1), **decode)]
    links = [{"from": "p", "to": "d", "bandwidth_gbps": bandwidth_gbps}]
    data = dict(dict(runner=UNIT, num_gpu_blocks=1000, kv_bytes_per_token=1000, max_num_batched_tokens=4096), **top)
    data["cluster"] = {"pools": pools, "links": links}
    return ReplayConfig.from_dict(data)


def approx_rows(rows):
    return [[pytest.approx(x) for x in row] for row in rows]


def test_a_decode_pool_scales_out_on_handoffs_waiting_and_drains_a_replica_with_a_transfer_landing():
    # Decode replicas take one request each (max_num_seqs 1); the decode pool (ids 1, 2) scales on
    # handoffs waiting, target 0.5, every 1 s, cooldown 2 s, start-up 1.5 s, 1..2 replicas. Prompts of
    # 1 token move 1,000 B: 1 s alone on the 1,000 B/s link. Outputs of 3 tokens: 2 decode steps.
    cfg = config({}, {"max_num_seqs": 1, "autoscale": dict(min=1, max=2, signal="handoffs_waiting", target=0.5,
                                                            interval_s=1, cooldown_s=2, startup_s=1.5)}, 1e-6)
    result = replay(make_trace([0.5, 0.5], [1, 1], [3, 3]), cfg)
    a, b = result.requests.to_pylist()
    # A and B prefill together [0.5, 1.5]; A goes to decode replica 1 (lands 2.5, decodes [2.5, 4.5]);
    # B waits: replica 1 has its one seat taken by A's landing.
    # t=2: 1 handoff waiting -> ceil(1 / 0.5) = 2 replicas: replica 2 starts, serves from 3.5, when B's
    #      transfer starts at once (lands 4.5; decodes [4.5, 6.5]).
    # t=3: 2 held (1 active + 1 starting): nothing. t=4 (cooldown 2 since t=2 passed): nothing waits ->
    #      1 replica: replica 2 drains while B's KV is still on the link; B lands there and is served;
    #      replica 2 stops when B finishes at 6.5.
    assert (a["decode_replica"], b["decode_replica"]) == (1, 2)
    assert a["finish_s"] == pytest.approx(4.5) and b["finish_s"] == pytest.approx(6.5)
    assert b["handoff_wait_s"] == pytest.approx(2.0) and b["transfer_s"] == pytest.approx(1.0)
    pools = result.meta["cluster"]["pools"]
    assert "autoscale" not in pools[0]
    decode = pools[1]
    assert decode["autoscale"]["timeline"] == approx_rows(
        [[0, 1, 0, 0], [2, 1, 1, 0], [3.5, 2, 0, 0], [4, 1, 0, 1], [6.5, 1, 0, 0]])
    # held over first arrival 0.5 .. last finish 6.5: 1 x 1.5 + 2 x 1.5 + 2 x 0.5 + 2 x 2.5 = 10.5
    assert decode["replica_seconds"] == pytest.approx(10.5)


def test_a_draining_decode_replica_gets_no_new_handoffs():
    # Two decode replicas (ids 1, 2), least-outstanding, scaled on running sequences, target 2, cooldown 0,
    # every 1 s; the link moves 10,000 B/s (a 1-token prompt: 0.1 s). A (20 tokens) and B (3) prefill
    # [0, 1] and go to replicas 1 and 2 at 1 (landing at 1.2). At t=1 nothing runs yet -> 1 replica:
    # replica 2 drains while B is in transfer, serves B [1.2, 3.2] and stops at 3.2. C (3 tokens,
    # prefill [1.5, 2.5]) goes to replica 1, which owes more than replica 2: only replica 1 takes
    # handoffs. It lands at 2.6 and joins A's batch at A's next step boundary, 3.2: finishes at 5.2.
    cfg = config({}, {"replicas": 2, "router": "least-outstanding",
                      "autoscale": dict(min=1, max=2, signal="running", target=2, interval_s=1, cooldown_s=0)}, 1e-5)
    result = replay(make_trace([0, 0, 1.5], [1, 1, 1], [20, 3, 3]), cfg)
    a, b, c = result.requests.to_pylist()
    assert (a["decode_replica"], b["decode_replica"], c["decode_replica"]) == (1, 2, 1)
    assert [r["finish_s"] for r in (a, b, c)] == [pytest.approx(x) for x in (20.2, 3.2, 5.2)]
    timeline = result.meta["cluster"]["pools"][1]["autoscale"]["timeline"]
    assert timeline == approx_rows([[0, 2, 0, 0], [1, 1, 0, 1], [3.2, 1, 0, 0]])


def test_a_prefill_pool_scales_on_queue_depth_and_a_draining_replica_holds_kv_until_it_lands():
    # Prefill replicas (ids 0, 1) prefill one request at a time (max_num_seqs 1), least-outstanding
    # router; the prefill pool scales on its queue depth, target 0.5, every 1 s, cooldown 2 s, start-up
    # 1 s, 1..2 replicas. Prompts of 2 tokens move 2,000 B: 0.5 s alone on the 4,000 B/s link. Outputs
    # of 2 tokens: one decode step on the decode replica (id 2).
    cfg = config({"max_num_seqs": 1, "router": "least-outstanding",
                  "autoscale": dict(min=1, max=2, signal="queue_depth", target=0.5, interval_s=1, cooldown_s=2,
                                    startup_s=1)}, {}, 4e-6)
    result = replay(make_trace([0.5, 0.5, 2.2], [2, 2, 2], [2, 2, 2]), cfg)
    a, b, c = result.requests.to_pylist()
    # A prefills [0.5, 1.5] on replica 0, B waits behind it, then [1.5, 2.5].
    # t=1: queue 1 -> ceil(1 / 0.5) = 2 replicas: replica 1 starts, serves from 2.
    # C (2.2) goes to replica 1 (idle; replica 0 owes B): prefill [2.2, 3.2], transfer [3.2, 3.7].
    # t=2: cooldown. t=3: queue 0 -> 1 replica: replica 1 drains while prefilling C; after C's first
    #      token it still holds C's KV until the transfer lands at 3.7, and stops then.
    # Transfers: A [1.5, 2.0], B [2.5, 3.0], C [3.2, 3.7]; decode steps: A [2, 3], B [3, 4], C [4, 5].
    assert [r["prefill_replica"] for r in (a, b, c)] == [0, 0, 1]
    assert [r["first_token_s"] for r in (a, b, c)] == [pytest.approx(x) for x in (1.5, 2.5, 3.2)]
    assert [r["finish_s"] for r in (a, b, c)] == [pytest.approx(x) for x in (3.0, 4.0, 5.0)]
    prefill = result.meta["cluster"]["pools"][0]
    assert prefill["autoscale"]["timeline"] == approx_rows(
        [[0, 1, 0, 0], [1, 1, 1, 0], [2, 2, 0, 0], [3, 1, 0, 1], [3.7, 1, 0, 0]])
    # over 0.5 .. 5.0: 1 x 0.5 + 2 x 1 + 2 x 1 + 2 x 0.7 + 1 x 1.3 = 7.2
    assert prefill["replica_seconds"] == pytest.approx(7.2)


def test_gpu_seconds_of_autoscaled_pools_reach_the_cost_view(tmp_path):
    from servelab.api import write_run
    from servelab.scoring.db import connect

    cfg = config({"price_per_gpu_hour": 3.6}, {
        "max_num_seqs": 1, "price_per_gpu_hour": 7.2,
        "autoscale": dict(min=1, max=2, signal="handoffs_waiting", target=0.5, interval_s=1, cooldown_s=2,
                          startup_s=1.5)}, 1e-6)
    run = write_run(replay(make_trace([0.5, 0.5], [1, 1], [3, 3]), cfg), tmp_path / "run")
    con = connect([str(run)])
    rows = dict(con.execute("SELECT name, gpu_s FROM cost WHERE scope = 'pool'").fetchall())
    # the fixed prefill pool: 1 GPU over 0.5 .. 6.5; the decode pool: its timeline (see above)
    assert rows == {"p": pytest.approx(6.0), "d": pytest.approx(10.5)}
    dollars = con.execute("SELECT dollars FROM cost WHERE scope = 'overall'").fetchone()[0]
    assert dollars == pytest.approx(6.0 / 3600 * 3.6 + 10.5 / 3600 * 7.2)


SIGNALS = {"prefill": [("queue_depth", 2), ("pending_prompt_tokens", 1500), ("request_rate", 10)],
           "decode": [("running", 4), ("kv_use", 0.3), ("handoffs_waiting", 1)]}


@pytest.mark.parametrize("prefill_signal,decode_signal", list(zip(SIGNALS["prefill"], SIGNALS["decode"])))
def test_scaled_pools_keep_the_books_after_every_event_and_lose_no_request(monkeypatch, prefill_signal,
                                                                            decode_signal):
    """Both pools start, drain and stop under a bursty trace, with a slow link and small decode KV
    (transfers share the link, handoffs wait for room): after every event KV and outstanding tokens
    add up (tests/test_engine_invariants.py), every request finishes, both pools drained replicas,
    and at the end no KV is held anywhere."""
    from helpers_engine import synthetic
    from test_engine_invariants import CheckedEngine, checked_engines, disaggregation

    engines = checked_engines(monkeypatch)

    def scale(signal, target):
        return dict(min=1, max=3, signal=signal, target=target, interval_s=0.5, cooldown_s=1.0, startup_s=0.7)

    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "kv_bytes_per_token": 1024,
        "max_num_seqs": 8, "router": "least-outstanding",
        "cluster": {"pools": [
            {"name": "p", "role": "prefill", "replicas": 1, "num_gpu_blocks": 400,
             "autoscale": scale(*prefill_signal)},
            {"name": "d", "role": "decode", "replicas": 2, "num_gpu_blocks": 300,
             "autoscale": scale(*decode_signal)}],
            "links": [{"from": "p", "to": "d", "bandwidth_gbps": 0.5, "latency_s": 0.001}]}})
    before = CheckedEngine.events
    result = replay(synthetic(n=400, rate=40.0, seed=5), cfg)
    assert CheckedEngine.events - before > 300
    statuses = result.requests.column("status").to_pylist()
    reasons = {r for r in result.requests.column("reason").to_pylist() if r is not None}
    assert set(statuses) <= {"finished", "rejected"} and statuses.count("finished") > 350
    assert all("KV blocks for prompt + max output" in r for r in reasons)
    for pool in result.meta["cluster"]["pools"]:
        timeline = pool["autoscale"]["timeline"]
        assert any(row[1] > 1 for row in timeline) and any(row[3] for row in timeline), pool["name"]
        assert all(row[1] >= 1 and row[1] + row[2] + row[3] <= 3 for row in timeline)
        assert timeline[-1][2:] == [0, 0]  # nothing left starting or draining
    (engine,) = engines
    disagg = disaggregation(engine)
    assert not disagg.pending and not disagg.source
    assert all(not held for held in disagg.landing.values())
    for replica in engine.replicas:
        assert replica.outstanding_tokens == 0 and replica.kv.used == 0


def test_an_autoscaled_pair_pinned_at_the_fixed_counts_replays_like_the_fixed_cluster():
    from helpers_engine import synthetic

    def cluster(pinned):
        def pool(name, role, n):
            out = {"name": name, "role": role, "replicas": n, "num_gpu_blocks": 500}
            if pinned:
                out["autoscale"] = {"min": n, "max": n, "interval_s": 0.25}
            return out
        return ReplayConfig.from_dict({
            "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "kv_bytes_per_token": 1024,
            "router": "least-outstanding",
            "cluster": {"pools": [pool("p", "prefill", 2), pool("d", "decode", 3)],
                        "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1.0}]}})

    trace = synthetic(n=400, rate=40.0)
    fixed, pinned = replay(trace, cluster(False)), replay(trace, cluster(True))
    assert fixed.requests.equals(pinned.requests) and fixed.steps.equals(pinned.steps)


def test_handoffs_waiting_is_a_decode_pools_signal():
    with pytest.raises(ServelabError, match="'handoffs_waiting' is a decode pool's"):
        config({"autoscale": dict(min=1, max=2, signal="handoffs_waiting")}, {}, 1.0)


def test_the_example_config_replays_and_both_pools_scale():
    from pathlib import Path

    from helpers_engine import synthetic

    cfg = ReplayConfig.from_toml(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "disagg-autoscale.toml")
    assert cfg.cluster.link().stream_layers == 32
    # a burst of long prompts: 600 requests at 6 per second, prompts around 4,000 tokens
    result = replay(synthetic(n=600, rate=6.0, prompt="lognormal:4000:0.5", output="lognormal:200:0.5"), cfg)
    assert set(result.requests.column("status").to_pylist()) == {"finished"}
    assert result.meta["cluster"]["transfers"]["bytes_streamed"] > 0
    for pool in result.meta["cluster"]["pools"]:
        timeline = pool["autoscale"]["timeline"]
        assert max(row[1] for row in timeline) > pool["autoscale"]["config"]["min"], pool["name"]
