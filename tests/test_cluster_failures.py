"""Replica failures in pools whose membership something else changes too: an autoscaler, a fleet of
instance types (docs/cluster.md "Failures with autoscaling and instance types"). The engine owns which
replicas serve: a replica serves when its pool's controller wants it and it is up.

Every step takes 1 s (``linear:base=1``), one request per replica at a time (``max_num_seqs = 1``): a
request of 1 prompt token and 4 output tokens emits tokens at 1, 2, 3, 4 after it starts.
"""

from __future__ import annotations

from conftest import make_trace
from helpers_engine import rows
from servelab.api import ReplayConfig, replay

TRACE = make_trace([0, 0], [1, 1], [4, 4])  # A and B at t=0


def config(pool: dict, **top) -> ReplayConfig:
    return ReplayConfig.from_dict({"runner": "linear:base=1", "num_gpu_blocks": 100, "max_num_seqs": 1,
                                   "router": "round-robin", **top, "cluster": {"pools": [dict(name="web", **pool)]}})


def faults(result):
    f = result.meta["platform"]["faults"]
    return f["failures"], f["requests_moved"], f["requests_interrupted"], f["work_lost_s"]


SCALE = {"min": 1, "max": 2, "signal": "running", "target": 1, "interval_s": 1, "cooldown_s": 0, "startup_s": 0}


def test_a_failed_replica_in_an_autoscaled_pool_moves_its_work_and_is_counted_out():
    result = replay(TRACE, config({"replicas": 2, "autoscale": SCALE}, fail=["replica=1,at=2.5"]))
    # A on replica 0, B on replica 1: tokens at 1 and 2. At 2.5 replica 1 fails: the autoscaler counts
    # it out (1 active), its step [2, 3] is lost (0.5 s) and B (journal: keeps its 2 tokens) waits on
    # replica 0, busy with A until 4. Ticks from 3 on: at most 1 request running -> 1 replica wanted,
    # which it has. At 4 B recomputes prompt + 2 tokens in [4, 5] (token 3), then token 4 at 6.
    # Every request once, all finished.
    assert rows(result, "replica", "status", "first_token_s", "finish_s", "generated_tokens") == [
        (0, "finished", 1.0, 4.0, 4), (0, "finished", 1.0, 6.0, 4)]
    assert rows(result, "num_resumes", "recomputed_tokens", "tokens_lost") == [(0, 0, 0), (1, 2, 0)]
    assert faults(result) == (1, 1, 1, 0.5)
    assert result.meta["cluster"]["pools"][0]["autoscale"]["timeline"] == [[0.0, 2, 0, 0], [2.5, 1, 0, 0]]


def test_a_failed_replica_serves_again_only_when_its_pool_starts_it():
    # as above, back at 3.5: the autoscaler wants one replica and has it, so replica 1 stays off
    back = replay(TRACE, config({"replicas": 2, "autoscale": SCALE}, fail=["replica=1,at=2.5,for=1"]))
    assert rows(back, "replica", "finish_s") == [(0, 4.0), (0, 6.0)]
    assert back.meta["cluster"]["pools"][0]["autoscale"]["timeline"] == [[0.0, 2, 0, 0], [2.5, 1, 0, 0]]
    # pinned at 2 (min = max): the tick at 3 wants 2 but the only other replica is down; the tick at 4
    # starts it again (back since 3.5; start-up 0). B stays where it was moved (requests never move
    # for scaling). C at 4.5 takes round-robin's fourth turn (A -> 0, B -> 1, B moved -> 0 of one live
    # replica) over two live replicas: replica 1, idle: its one token at 5.5.
    result = replay(make_trace([0, 0, 4.5], [1, 1, 1], [4, 4, 1]),
                    config({"replicas": 2, "autoscale": dict(SCALE, min=2)}, fail=["replica=1,at=2.5,for=1"]))
    assert rows(result, "replica", "status", "finish_s") == [(0, "finished", 4.0), (0, "finished", 6.0),
                                                           (1, "finished", 5.5)]
    assert result.meta["cluster"]["pools"][0]["autoscale"]["timeline"] == [
        [0.0, 2, 0, 0], [2.5, 1, 0, 0], [4.0, 2, 0, 0]]


def test_a_failure_in_a_pool_of_instance_types_is_refilled_at_once():
    # One H100 (replica 0) and two A100s (replicas 1, 2); the pool of fixed size wants 2: replicas 0
    # and 1. A on 0, B on 1 (least outstanding). Replica 0 fails at 2.5 (for 2 s): the pool refills at
    # once from the types with room (the H100 is down; A100 replica 2), then A (2 tokens) moves there:
    # it recomputes in [2.5, 3.5] (token 3) and ends at 4.5. Back at 4.5, replica 0 is not wanted
    # (the pool has its 2) and takes nothing.
    instances = [{"gpu": "h100-80gb", "available": 1}, {"gpu": "a100-80gb", "available": 2}]
    result = replay(TRACE, config({"replicas": 2, "instances": instances}, router="least-outstanding",
                                  fail=["replica=0,at=2.5,for=2"]))
    assert rows(result, "replica", "instance", "status", "finish_s", "num_resumes") == [
        (2, "a100-80gb", "finished", 4.5, 1), (1, "a100-80gb", "finished", 4.0, 0)]
    assert faults(result) == (1, 1, 1, 0.5)
    types = {t["gpu"]: t for t in result.meta["cluster"]["pools"][0]["instances"]}
    assert types["h100-80gb"]["timeline"] == [[0.0, 1, 0, 0], [2.5, 0, 0, 0]]
    assert types["a100-80gb"]["timeline"] == [[0.0, 1, 0, 0], [2.5, 2, 0, 0]]
    assert types["h100-80gb"]["reclaimed"] == 0


def test_a_decode_replica_fails_in_an_autoscaled_decode_pool():
    # Prefill replica 0; decode replicas 1 and 2 pinned at 2 by their autoscaler, one request each;
    # KV 1,000 B per token over a 10,000 B/s link. A and B (1-token prompts, 4 tokens) prefill in
    # [0, 1] (token 1), go to decode replicas 1 and 2, sharing the link: both land at 1.2 and decode
    # token 2 in [1.2, 2.2]. Replica 2 fails at 2: the autoscaler counts it out (and cannot start it
    # again: down for good), its step is lost (0.8 s), and B goes back to the prefill pool: it
    # recomputes prompt + token 1 in [2, 3], emitting token 2 at 3, and waits for a decode seat while
    # A ends on replica 1 at 4.2 (tokens 3, 4 at 3.2, 4.2); its 2,000 B move in [4.2, 4.4]; tokens 3,
    # 4 at 5.4, 6.4.
    import pytest

    pools = [{"name": "p", "role": "prefill", "replicas": 1},
             {"name": "d", "role": "decode", "replicas": 2, "max_num_seqs": 1,
              "autoscale": dict(SCALE, min=2)}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 1000, "kv_bytes_per_token": 1000, "fail": ["replica=2,at=2"],
        "cluster": {"pools": pools, "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-5}]}})
    result = replay(TRACE, cfg)
    a, b = result.requests.to_pylist()
    assert (a["status"], a["decode_replica"], a["finish_s"]) == ("finished", 1, pytest.approx(4.2))
    assert (b["status"], b["prefill_replica"], b["decode_replica"]) == ("finished", 0, 1)
    assert (b["first_token_s"], b["finish_s"]) == (1.0, pytest.approx(6.4))
    assert (b["handoff_wait_s"], b["transfer_s"]) == (pytest.approx(1.2), pytest.approx(0.2))
    assert (b["num_resumes"], b["recomputed_tokens"], b["generated_tokens"]) == (1, 1, 4)
    assert faults(result) == (1, 1, 1, pytest.approx(0.8))
    assert result.meta["cluster"]["pools"][1]["autoscale"]["timeline"] == [[0.0, 2, 0, 0], [2.0, 1, 0, 0]]


def test_a_replica_failing_while_it_starts_is_counted_out_and_started_again_once_back():
    # One replica active (0), one off (1); target 0.5 waiting requests per replica, start-up 2 s.
    # A and B at 0 both go to replica 0 (the only live one); B waits. Tick at 1: 1 waiting -> 2
    # replicas: replica 1 starts (due at 3). It fails at 2 (for 0.5 s): counted out, its start-up
    # forgotten. Tick at 3: 1 waiting, 1 held -> it starts again (back since 2.5), due at 5. A ends
    # at 4 and B runs on replica 0 (tokens at 5..8). At 5 replica 1 serves, and the tick at 5 (nothing
    # waits) drains it at once: one row at 5.
    scale = dict(SCALE, signal="queue_depth", target=0.5, startup_s=2)
    result = replay(TRACE, config({"replicas": 1, "autoscale": scale}, fail=["replica=1,at=2,for=0.5"]))
    assert rows(result, "replica", "status", "finish_s") == [(0, "finished", 4.0), (0, "finished", 8.0)]
    assert faults(result) == (1, 0, 0, 0.0)
    assert result.meta["cluster"]["pools"][0]["autoscale"]["timeline"] == [
        [0.0, 1, 0, 0], [1.0, 1, 1, 0], [2.0, 1, 0, 0], [3.0, 1, 1, 0], [5.0, 1, 0, 0]]
