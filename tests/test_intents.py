"""Intents (replay/core/intents.py): the cluster and the platform say what they want, ``Engine.enact`` applies it.

The timelines combine replica failures with autoscaling, fleets of instance types and prefill/decode
pools, recording every intent the engine enacts (time, kind, replica, request). Every step takes 1 s
(``linear:base=1``); KV is 1,000 B per token over a 10,000 B/s link where there is one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import make_trace
from helpers_engine import rows
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError
from servelab.replay.core import intents as I
from servelab.replay.core.engine import Engine

REPLAY = Path(__file__).resolve().parent.parent / "replay"


def describe(intent) -> str:
    name = type(intent).__name__
    if isinstance(intent, I.Serve):
        return f"{name}({intent.pool},{[r.id for r in intent.replicas]})"
    if isinstance(intent, I.Route):
        return f"{name}({[r.index for r in intent.reqs]})"
    args = [str(intent.replica.id)] if hasattr(intent, "replica") else []
    if hasattr(intent, "req"):
        args.append(str(intent.req.index))
    return f"{name}({','.join(args)})" if args else name


@pytest.fixture
def enacted(monkeypatch):
    """Every intent the engine enacts during the test, as ``(now, description)``."""
    log: list[tuple[float, str]] = []
    enact = Engine.enact

    def recording(self, intents, now):
        log.extend((round(now, 9), describe(i)) for i in intents)
        return enact(self, intents, now)

    monkeypatch.setattr(Engine, "enact", recording)
    return log


def faults(result) -> tuple:
    f = result.meta["platform"]["faults"]
    return f["failures"], f["requests_moved"], f["requests_interrupted"], round(f["work_lost_s"], 9)


TYPES = [{"gpu": "h100-80gb", "available": 1}, {"gpu": "a100-80gb", "available": 1}]


def test_an_autoscaled_fleet_refills_after_a_failure_and_adopts_the_requests_that_waited(enacted):
    # One H100 replica (0) wanted, an A100 (1) in reserve; start-up 2 s. A (4 tokens) at 0: tokens at
    # 1, 2; replica 0 fails at 2.5 for good: [2, 3] is lost (0.5 s), the fleet counts it out and starts
    # the A100 (due 4.5); A (journal: keeps 2 tokens) has no live replica and waits, as does B at 3.
    # At 4.5 the A100 serves: A then B are routed to it in their order. A recomputes prompt + 2 in
    # [4.5, 5.5] (token 3), ends at 6.5; B (one at a time) runs [6.5, 7.5], [7.5, 8.5].
    scale = {"min": 1, "max": 1, "signal": "running", "target": 1, "interval_s": 100, "cooldown_s": 0, "startup_s": 2}
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 100, "max_num_seqs": 1, "fail": ["replica=0,at=2.5"],
        "cluster": {"pools": [{"name": "web", "replicas": 1, "instances": TYPES, "autoscale": scale}]}})
    result = replay(make_trace([0, 3], [1, 1], [4, 2]), cfg)
    assert rows(result, "replica", "status", "first_token_s", "finish_s", "num_resumes") == [
        (1, "finished", 1.0, 6.5, 1), (1, "finished", 7.5, 8.5, 0)]
    assert faults(result) == (1, 1, 1, 0.5)
    pool = result.meta["cluster"]["pools"][0]
    assert pool["autoscale"]["timeline"] == [[0.0, 1, 0, 0], [2.5, 0, 1, 0], [4.5, 1, 0, 0]]
    after_start = [e for e in enacted if e[0] > 0]
    assert after_start == [
        (2.5, "FailReplica(0)"),  # the engine fails it; the fleet hears it and answers with its serving set
        (2.5, "Serve(entry,[])"), (2.5, "AdoptOrphans"),  # counted out: none serves
        (2.5, "Serve(entry,[])"), (2.5, "AdoptOrphans"),  # the refill: the A100 starts, not serving yet
        (4.5, "Serve(entry,[1])"), (4.5, "AdoptOrphans")]  # its start-up is over: A and B are routed to it


def test_the_only_prefill_replica_fails_and_its_return_routes_what_waited(enacted):
    # Prefill replica 0, decode replica 1 (autoscaled, pinned at 1). A at 0 prefills [0, 1]; replica 0
    # fails at 0.5 for 1.5 s: 0.5 s lost, A (nothing computed yet) waits for a prefill replica, as
    # does B at 1. At 2 replica 0 is back: A and B prefill together [2, 3] (token 1), are handed off,
    # share the link (2,000 B: both land at 3.2) and decode tokens 2 and 3 at 4.2 and 5.2.
    pools = [{"name": "p", "role": "prefill", "replicas": 1},
             {"name": "d", "role": "decode", "replicas": 1,
              "autoscale": {"min": 1, "max": 1, "signal": "running", "target": 1, "interval_s": 100, "cooldown_s": 0}}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 1000, "kv_bytes_per_token": 1000, "fail": ["replica=0,at=0.5,for=1.5"],
        "cluster": {"pools": pools, "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-5}]}})
    result = replay(make_trace([0, 1], [1, 1], [3, 3]), cfg)
    assert rows(result, "prefill_replica", "decode_replica", "status", "first_token_s", "finish_s") == [
        (0, 1, "finished", 3.0, pytest.approx(5.2)), (0, 1, "finished", 3.0, pytest.approx(5.2))]
    assert faults(result) == (1, 1, 0, 0.5)
    assert enacted == [
        (0.0, "Serve(entry,[0])"), (0.0, "Serve(decode,[1])"),  # the handoff's prefill pool, the decode autoscaler's
        (0.5, "FailReplica(0)"), (2.0, "RestoreReplica(0)"),
        (3.0, "HandOff(0,0)"), (3.0, "HandOff(0,1)"),
        (3.2, "Land(1,0)"), (3.2, "Land(1,1)")]  # (each landing wakes its decode replica)


def test_a_decode_replica_of_a_pool_of_instance_types_fails_and_is_replaced(enacted):
    # Prefill replica 0; a decode pool of one replica from [H100 (1), A100 (2)]. A (1-token prompt,
    # 4 tokens) prefills [0, 1], its 1,000 B land on replica 1 at 1.1: tokens 2 and 3 at 2.1, 3.1.
    # Replica 1 fails at 2.5 (0.4 s lost): the fleet takes the A100 at once; A (journal: 2 tokens)
    # recomputes prompt + token 1 on the prefill replica in [2.5, 3.5] (token 3 there), its 3,000 B
    # land on replica 2 at 3.8, token 4 at 4.8.
    pools = [{"name": "p", "role": "prefill", "replicas": 1},
             {"name": "d", "role": "decode", "replicas": 1, "max_num_seqs": 1, "instances": TYPES}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 1000, "kv_bytes_per_token": 1000, "fail": ["replica=1,at=2.5"],
        "cluster": {"pools": pools, "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-5}]}})
    result = replay(make_trace([0], [1], [4]), cfg)
    (a,) = result.requests.to_pylist()
    assert (a["status"], a["prefill_replica"], a["decode_replica"], a["generated_tokens"]) == ("finished", 0, 2, 4)
    assert (a["first_token_s"], a["finish_s"], a["transfer_s"]) == (1.0, pytest.approx(4.8), pytest.approx(0.3))
    assert faults(result) == (1, 1, 1, 0.4)
    types = {t["gpu"]: t["timeline"] for t in result.meta["cluster"]["pools"][1]["instances"]}
    assert types == {"h100-80gb": [[0.0, 1, 0, 0], [2.5, 0, 0, 0]], "a100-80gb": [[0.0, 0, 0, 0], [2.5, 1, 0, 0]]}
    assert [e for e in enacted if e[0] > 0] == [
        (1.0, "HandOff(0,0)"), (1.1, "Land(1,0)"),
        (2.5, "FailReplica(1)"), (2.5, "Serve(decode,[])"), (2.5, "Serve(decode,[2])"),  # counted out, refilled
        (3.5, "HandOff(0,0)"), (3.8, "Land(2,0)")]


def test_a_handoff_no_decode_replica_can_hold_is_rejected_by_intent(enacted):
    # decode KV of 2 blocks (16 tokens each): a 40-token prompt can never fit; it is handed off, then rejected
    pools = [{"name": "p", "role": "prefill", "replicas": 1}, {"name": "d", "role": "decode", "replicas": 1,
                                                               "num_gpu_blocks": 2}]
    cfg = ReplayConfig.from_dict({"runner": "linear:base=1", "num_gpu_blocks": 100, "kv_bytes_per_token": 1000,
                                  "cluster": {"pools": pools, "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-5}]}})
    result = replay(make_trace([0], [40], [3]), cfg)
    assert rows(result, "status") == [("rejected",)]
    assert enacted[-2:] == [(1.0, "HandOff(0,0)"), (1.0, "Reject(0)")]


# -- the platform and client timeouts: one replica, one sequence at a time, 1 s per step --------------
ONE = {"runner": "linear:base=1", "num_gpu_blocks": 100, "max_num_seqs": 1}


def test_client_timeouts_take_off_refuse_and_let_go_by_intent(enacted):
    # A (4 tokens) prefills [0, 1] (token 1), then decodes alone in a stretch [1, 4]; B at 0.5 waits.
    # A's client leaves at 2.2, inside the stretch: it is refused then, the stretch is cut at 3 and A is
    # let go there (tokens 2, 3 made: 3 generated; its first token was seen). B's leaves at 2.5 while it
    # waits: taken off, refused, and the (busy) replica asked to decide.
    result = replay(make_trace([0, 0.5], [1, 1], [4, 1], timeout_s=[2.2, 2.0]), ReplayConfig.from_dict(ONE))
    assert rows(result, "status", "first_token_s", "generated_tokens") == [("aborted", 1.0, 3), ("aborted", None, 0)]
    assert enacted == [(2.2, "Refuse(0)"), (2.2, "LeaveAtBoundary(0,0)"),
                       (2.5, "TakeOff(0,1)"), (2.5, "Refuse(1)"), (2.5, "Decide(0)"),
                       (3.0, "LetGo(0,0)"), (3.0, "Decide(0)")]


def test_the_front_door_retries_and_throttles_by_intent(enacted):
    # One request at a time (concurrency 1): A holds the slot over [0, 2]. B (0.5) and C (0.6) are
    # throttled and retry once 1 s later (an arrival event the front door pushes: no intent), throttled
    # again: out of retries, they end throttled.
    cfg = ReplayConfig.from_dict({**ONE, "quota": ["tenant=*:concurrency=1"], "retries": 1, "retry_backoff_s": 1.0,
                                  "retry_jitter": 0})
    result = replay(make_trace([0, 0.5, 0.6], [1, 1, 1], [2, 1, 1]), cfg)
    assert rows(result, "status", "finish_s") == [("finished", 2.0), ("throttled", None), ("throttled", None)]
    assert enacted == [(1.5, "Refuse(1)"), (1.6, "Refuse(2)")]
    assert result.meta["platform"]["retries"] == 2


def test_the_queue_cap_sheds_by_intent(enacted):
    # One waiting place: A runs [0, 2], flex B waits from 0.1; priority C at 0.2 finds the queue full and
    # B ranks lowest: B is taken off and dropped, C goes on (runs [2, 3]).
    result = replay(make_trace([0, 0.1, 0.2], [1, 1, 1], [2, 1, 1], tier=["standard", "flex", "priority"]),
                    ReplayConfig.from_dict({**ONE, "queue_cap": 1}))
    assert rows(result, "status", "finish_s") == [("finished", 2.0), ("dropped", None), ("finished", 3.0)]
    assert enacted == [(0.2, "TakeOff(0,1)"), (0.2, "Refuse(1)"), (0.2, "Enter(2)")]


def test_a_tier_is_paused_and_resumed_by_intent(enacted):
    # Flex F prefills [0, 1] (token 1); standard S1 (0.2) and S2 (0.4) wait. At 1, two standard requests
    # wait (> 1): F is preempted (recompute: it keeps token 1) and set aside; S1 runs [1, 2], S2 [2, 3].
    # At 3 none waits (<= 0): F queues again, recomputes prompt + 1 in [3, 4] (token 2), token 3 at 5.
    result = replay(make_trace([0, 0.2, 0.4], [1, 1, 1], [3, 1, 1], tier=["flex", "standard", "standard"]),
                    ReplayConfig.from_dict({**ONE, "pause": "tier=flex,waiting=1,resume=0"}))
    assert rows(result, "first_token_s", "finish_s") == [(1.0, 5.0), (2.0, 2.0), (3.0, 3.0)]
    assert enacted == [(1.0, "Preempt(0,0)"), (1.0, "SetAside(0)"), (3.0, "Resume(0)")]
    assert (result.meta["platform"]["pauses"], result.meta["platform"]["paused_s"]) == (1, 2.0)


def test_what_waits_for_a_replica_at_the_end_is_stranded_by_intent(enacted):
    # The only replica fails for good at 0.5, during A's prefill [0, 1] (0.5 s lost): A is moved, finds
    # no live replica and waits for one; B at 0.7 too. Nothing is left to happen: both end unfinished
    # when the replay ends (its clock at the last event, the lost step's stale completion at 1).
    cfg = ReplayConfig.from_dict({**ONE, "fail": ["replica=0,at=0.5"]})
    result = replay(make_trace([0, 0.7], [1, 1], [2, 2]), cfg)
    assert rows(result, "status") == [("unfinished",), ("unfinished",)]
    assert enacted == [(0.5, "FailReplica(0)"), (1.0, "Strand")]
    assert faults(result) == (1, 1, 0, 0.5)


def test_autoscaled_pd_pools_of_instance_types_with_failures_account_for_every_request():
    """Failures on both pools of autoscaled PD instance-type pools: every request finishes once (journal on)."""
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=120, rate=20.0, arrival="gamma", cv=2.0, prompt="lognormal:60:0.5",
                        output="lognormal:20:0.5", seed=5)
    scale = {"min": 1, "max": 3, "signal": "queue_depth", "target": 2, "interval_s": 0.5, "cooldown_s": 1, "startup_s": 0.5}
    pools = [{"name": "p", "role": "prefill", "replicas": 2, "autoscale": scale,
              "instances": [{"gpu": "h100-80gb", "available": 2}, {"gpu": "a100-80gb", "available": 2}]},
             {"name": "d", "role": "decode", "replicas": 2, "autoscale": dict(scale, signal="running", target=8),
              "instances": [{"gpu": "h100-80gb", "available": 2}, {"gpu": "a100-80gb", "available": 2}]}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=0.01,prefill_token=0.0001", "num_gpu_blocks": 400, "kv_bytes_per_token": 1000,
        "fail": ["replica=0,at=1", "replica=4,at=1.5,for=1", "replica=1,at=3,for=0.5"],
        "cluster": {"pools": pools, "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-3}]}})
    result = replay(trace, cfg)
    statuses = result.requests.column("status").to_pylist()
    assert len(statuses) == 120 and set(statuses) == {"finished"}
    assert result.meta["platform"]["faults"]["failures"] == 3
    assert result.meta["platform"]["faults"]["requests_moved"] > 0


def test_enact_applies_membership_and_refuses_what_it_does_not_know():
    from servelab.assembly import build_cluster

    cfg = ReplayConfig.from_dict({"runner": "linear:base=1", "num_gpu_blocks": 100, "replicas": 2})
    cluster = build_cluster(cfg, None, None)
    pool = cluster.pools[0]
    engine = Engine([], cluster.replicas, pool.router, pool.runner, cfg.engine)
    first, second = cluster.replicas
    engine.enact([I.Serve("entry", (second,))], 0.0)
    assert engine.live == [second]
    engine.enact([I.Serve("entry", (first, second))], 0.0)
    assert engine.live == [first, second]
    with pytest.raises(ServelabError, match="cannot enact"):
        engine.enact(["publish everything"], 0.0)
    with pytest.raises(AttributeError):  # (immutable)
        I.Serve("entry", ()).pool = "decode"


def test_the_cluster_and_failures_reach_membership_and_handoffs_only_through_intents():
    """The converted components call none of the engine's membership or handoff verbs themselves."""
    verbs = re.compile(r"engine\.(publish|fail|restore|hand_off|land|route_all|_cut_stretch|end)\(|adopt_orphans")
    for name in ("autoscale", "fleet", "disagg", "encode_pool", "transfer"):
        found = verbs.findall((REPLAY / "cluster" / f"{name}.py").read_text())
        assert not found, (name, found)
    platform = (REPLAY / "platform" / "hooks.py").read_text()
    fault = platform[platform.index("def fault("):platform.index("def take_held(")]
    assert not verbs.findall(fault)
