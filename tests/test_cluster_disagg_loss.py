"""Instance types on prefill/decode pools, and replicas lost under them (failures, reclaimed
instances), and pausing, against hand-traced timelines (replay/cluster/disagg.py ``lose``, replay/cluster/fleet.py,
replay/platform/hooks.py ``evict``; docs/cluster.md "Losing a prefill or decode replica").

Every step costs 1 s (``linear:base=1``); KV is 1,000 bytes per token. A lost replica is either
failed (``fail``) or reclaimed (its instance type's availability drops): both go through the one
eviction path and give the same timeline.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay, write_run
from servelab.common.errors import ServelabError

UNIT = "linear:base=1"
KEYS = ("status", "first_token_s", "finish_s", "prefill_replica", "decode_replica", "transfer_s", "max_itl_s",
        "num_resumes", "tokens_lost")


def config(prefill, decode, bandwidth_gbps, **top):
    data = dict(dict(runner=UNIT, num_gpu_blocks=1000, kv_bytes_per_token=1000, max_num_batched_tokens=4096), **top)
    data["cluster"] = {"pools": [dict(name="p", role="prefill", **prefill), dict(name="d", role="decode", **decode)],
                       "links": [{"from": "p", "to": "d", "bandwidth_gbps": bandwidth_gbps}]}
    return ReplayConfig.from_dict(data)


def rows(result, keys=KEYS):
    return [{k: r[k] for k in keys} for r in result.requests.to_pylist()]


def test_prefill_falls_back_to_another_type_and_decode_runs_on_a_third_with_cost_per_type(tmp_path):
    # The prefill pool wants 1 replica: an H100 (replica 0) until t=5, then an A100 (replica 1); the
    # decode pool is one L40S (replica 2). 8,000 B at 8,000 B/s: a transfer takes 1 s.
    # A (t=0): prefill [0, 1] on the H100, transfer [1, 2], decodes [2, 3], [3, 4]: finished at 4.
    # At 5 the H100 is reclaimed (idle) and the A100 starts at once (a pool of fixed size).
    # B (t=6): prefill [6, 7] on the A100, transfer [7, 8], decodes to 10.
    cfg = config({"replicas": 1, "instances": [
                     {"gpu": "h100-80gb", "price_per_gpu_hour": 3.6, "available": [[0, 1], [5, 0]]},
                     {"gpu": "a100-80gb", "price_per_gpu_hour": 1.8}]},
                 {"replicas": 1, "instances": [{"gpu": "l40s", "price_per_gpu_hour": 0.9}]}, 8e-6)
    result = replay(make_trace([0, 6], [8, 8], [3, 3]), cfg)
    got = rows(result, ("finish_s", "prefill_replica", "decode_replica", "instance", "prefill_instance"))
    assert got == [{"finish_s": 4.0, "prefill_replica": 0, "decode_replica": 2, "instance": "l40s",
                    "prefill_instance": "h100-80gb"},
                   {"finish_s": 10.0, "prefill_replica": 1, "decode_replica": 2, "instance": "l40s",
                    "prefill_instance": "a100-80gb"}]
    pools = {p["name"]: p for p in result.meta["cluster"]["pools"]}
    h100, a100 = pools["p"]["instances"]
    assert h100["timeline"] == [[0.0, 1, 0, 0], [5.0, 0, 0, 0]] and h100["reclaimed"] == 1
    assert a100["timeline"] == [[0.0, 0, 0, 0], [5.0, 1, 0, 0]]
    from servelab.scoring.db import connect

    con = connect([str(write_run(result, tmp_path / "run"))])
    cost = {(r[0], r[1]): r[2:] for r in con.execute("SELECT scope, name, gpus, gpu_s, dollars FROM cost").fetchall()}
    # window: first arrival 0 to last finish 10. H100 [0, 5]: 5 GPU-s x $3.6/h = $0.005; A100 [5, 10]:
    # 5 GPU-s x $1.8/h = $0.0025; L40S [0, 10]: 10 GPU-s x $0.9/h = $0.0025
    assert cost[("gpu", "h100-80gb")] == (1, pytest.approx(5.0), pytest.approx(0.005))
    assert cost[("gpu", "a100-80gb")] == (1, pytest.approx(5.0), pytest.approx(0.0025))
    assert cost[("gpu", "l40s")] == (1, pytest.approx(10.0), pytest.approx(0.0025))
    assert cost[("pool", "p")] == (2, pytest.approx(10.0), pytest.approx(0.0075))
    assert cost[("pool", "d")] == (1, pytest.approx(10.0), pytest.approx(0.0025))
    assert cost[("overall", None)][1:] == (pytest.approx(20.0), pytest.approx(0.01))
    assert con.execute("SELECT instance, prefill_instance FROM requests ORDER BY request_id").fetchall() == [
        ("l40s", "h100-80gb"), ("l40s", "a100-80gb")]


def lose_prefill(mechanism, journal):
    # Two prefill replicas (0, 1; round-robin: A on 0, B on 1), one decode replica (2), 1,000 B/s.
    # Replica 1 is lost at t=3: failed, or reclaimed (its type drops from 2 to 1: the highest id goes).
    prefill = {"replicas": 2, "router": "round-robin"}
    top = {"journal": journal}
    if mechanism == "fail":
        top["fail"] = ["replica=1,at=3"]
    else:
        prefill["instances"] = [{"gpu": "h100-80gb", "available": [[0, 2], [3, 1]]}]
    return replay(make_trace([0, 0], [8, 8], [3, 3]), config(prefill, {"replicas": 1}, 1e-6, **top))


@pytest.mark.parametrize("mechanism", ["fail", "reclaim"])
def test_losing_a_prefill_replica_mid_transfer_cancels_it_and_the_request_prefills_again(mechanism):
    result = lose_prefill(mechanism, journal=True)
    # A and B prefill in [0, 1] and both send 8,000 B from 1 at 500 B/s each: 1,000 B each by 3.
    # At 3 B's source is lost: B's transfer is cancelled; A alone moves 1,000 B/s.
    # B (journal: keeps token 1) goes back to the prefill router: replica 0 recomputes 8 + 1 tokens
    # in [3, 4], emitting token 2 at 4; B sends 9,000 B from 4.
    # A: 6,000 B left at 4, 500 B/s: lands at 16 (transfer 15 s); decodes [16, 17], [17, 18].
    # B: 6,000 B by 16, its last 3,000 B alone: lands at 19 (15 s); decodes token 3 in [19, 20].
    assert rows(result) == [
        {"status": "finished", "first_token_s": 1.0, "finish_s": 18.0, "prefill_replica": 0, "decode_replica": 2,
             "transfer_s": 15.0, "max_itl_s": 16.0, "num_resumes": 0, "tokens_lost": 0},
        {"status": "finished", "first_token_s": 1.0, "finish_s": 20.0, "prefill_replica": 0, "decode_replica": 2,
             "transfer_s": 15.0, "max_itl_s": 16.0, "num_resumes": 1, "tokens_lost": 0}]
    transfers = result.meta["cluster"]["transfers"]
    # A's 8,000 B and B's second 9,000 B arrived (the 1,000 B of B's first are not counted)
    assert (transfers["bytes_moved"], transfers["transfers_cancelled"], transfers["requests_lost_kv"]) == (17000, 1, 1)
    faults = result.meta["platform"]["faults"]
    assert (faults["failures"], faults["requests_moved"], faults["tokens_recomputed"]) == (
        1 if mechanism == "fail" else 0, 1, 8)


@pytest.mark.parametrize("mechanism", ["fail", "reclaim"])
def test_without_the_journal_a_request_whose_prefill_replica_is_lost_starts_over(mechanism):
    # B loses its first token: prefill [3, 4] emits a new first token at 4; 8,000 B from 4: A lands at
    # 16 as above, B has 2,000 B left then: lands at 18; decodes [18, 19], [19, 20].
    a, b = rows(lose_prefill(mechanism, journal=False))
    assert (a["finish_s"], a["transfer_s"]) == (18.0, 15.0)
    assert (b["first_token_s"], b["finish_s"], b["transfer_s"], b["tokens_lost"]) == (4.0, 20.0, 14.0, 1)


def lose_decode(mechanism, at, journal):
    # One prefill replica (0), two decode replicas (1, 2; round-robin: A lands on 1), 8,000 B/s.
    # Replica 1 is lost at ``at``: failed, or reclaimed (its type, the H100, drops to 0; the A100,
    # replica 2, is already the one it may hold).
    decode = {"replicas": 2, "router": "round-robin"}
    top = {"journal": journal}
    if mechanism == "fail":
        top["fail"] = [f"replica=1,at={at}"]
    else:
        decode["instances"] = [{"gpu": "h100-80gb", "available": [[0, 1], [at, 0]]},
                               {"gpu": "a100-80gb", "available": 1}]
    return replay(make_trace([0], [8], [6]), config({"replicas": 1}, decode, 8e-6, **top))


@pytest.mark.parametrize("mechanism", ["fail", "reclaim"])
def test_losing_a_decode_replica_sends_its_running_request_back_to_prefill(mechanism):
    # A: prefill [0, 1] (token 1), transfer [1, 2] to replica 1, decodes tokens 2 and 3 at 3 and 4.
    # Lost at 4.5: the iteration [4, 5] is lost (0.5 s of work). Journal: A keeps 3 tokens and
    # re-prefills prompt + generated = 11 tokens on replica 0 in [4.5, 5.5] (token 4 at 5.5); its
    # 11,000 B take 1.375 s: lands on replica 2 at 6.875; tokens 5 and 6 at 7.875 and 8.875.
    (a,) = rows(lose_decode(mechanism, 4.5, journal=True))
    assert a == {"status": "finished", "first_token_s": 1.0, "finish_s": 8.875, "prefill_replica": 0, "decode_replica": 2,
                     "transfer_s": 1.375, "max_itl_s": 2.375, "num_resumes": 1, "tokens_lost": 0}
    result = lose_decode(mechanism, 4.5, journal=True)
    faults = result.meta["platform"]["faults"]
    # 10 tokens computed on replica 1 (prompt 8 + tokens 2, 3 fed back) are recomputed
    assert (faults["requests_moved"], faults["work_lost_s"], faults["tokens_recomputed"]) == (1, 0.5, 10)
    assert result.meta["cluster"]["transfers"]["transfers_cancelled"] == 0
    if mechanism == "reclaim":
        assert result.requests.column("instance").to_pylist() == ["a100-80gb"]


@pytest.mark.parametrize("mechanism", ["fail", "reclaim"])
def test_without_the_journal_a_request_on_a_lost_decode_replica_starts_from_scratch(mechanism):
    # A loses its 3 tokens: prefill [4.5, 5.5] emits a new first token; 8,000 B: lands on 2 at 6.5;
    # tokens 2..6 at 7.5 .. 11.5
    (a,) = rows(lose_decode(mechanism, 4.5, journal=False))
    assert (a["first_token_s"], a["finish_s"], a["decode_replica"], a["tokens_lost"]) == (5.5, 11.5, 2, 3)


@pytest.mark.parametrize("mechanism", ["fail", "reclaim"])
def test_a_request_landing_on_a_lost_decode_replica_loses_its_kv_and_prefills_again(mechanism):
    # A's transfer [1, 2] to replica 1 is cut at 1.5: cancelled; replica 0 frees A's KV. Journal: A
    # recomputes 8 + 1 tokens in [1.5, 2.5] (token 2), sends 9,000 B in 1.125 s: lands on replica 2 at
    # 3.625; tokens 3..6 at 4.625 .. 7.625.
    result = lose_decode(mechanism, 1.5, journal=True)
    (a,) = rows(result)
    assert (a["first_token_s"], a["finish_s"], a["decode_replica"], a["transfer_s"], a["num_resumes"]) == (
        1.0, 7.625, 2, 1.125, 1)
    transfers = result.meta["cluster"]["transfers"]
    assert (transfers["bytes_moved"], transfers["transfers_cancelled"], transfers["requests_lost_kv"]) == (9000, 1, 1)


def test_a_failed_decode_replica_that_comes_back_takes_handoffs_again():
    # one decode replica (1), down in [0.5, 3.5): A's first token at 1 waits for it (holding its KV on
    # the prefill replica), its transfer starts at 3.5 and lands at 4.5 (8,000 B/s); tokens 2, 3 at
    # 5.5, 6.5
    result = replay(make_trace([0], [8], [3]), config({"replicas": 1}, {"replicas": 1}, 8e-6,
                                                      fail=["replica=1,at=0.5,for=3"]))
    (a,) = result.requests.to_pylist()
    assert (a["handoff_wait_s"], a["transfer_s"], a["finish_s"]) == (2.5, 1.0, 6.5)


def test_pausing_holds_a_tier_on_prefill_replicas():
    # One prefill replica taking one request at a time (max_num_seqs = 1); F (flex), S1, S2 arrive at
    # 0 (1 prompt token, 2 output tokens). Pause flex while more than 1 other request waits, resume at
    # 0: at 0, 2 others wait: F is held; S1 prefills [0, 1], S2 [1, 2]; at 2 none waits: F queues
    # again and prefills [2, 3] (paused 2 s). Each 1,000 B transfer takes 1 s, then one decode step:
    # S1 finishes at 3, S2 at 4, F at 5.
    cfg = config({"replicas": 1, "max_num_seqs": 1}, {"replicas": 1}, 1e-6, pause="tier=flex,waiting=1,resume=0")
    result = replay(make_trace([0, 0, 0], [1, 1, 1], [2, 2, 2], tier=["flex", "standard", "standard"]), cfg)
    assert rows(result, ("tier", "first_token_s", "finish_s", "paused_s")) == [
        {"tier": "flex", "first_token_s": 3.0, "finish_s": 5.0, "paused_s": 2.0},
        {"tier": "standard", "first_token_s": 1.0, "finish_s": 3.0, "paused_s": 0.0},
        {"tier": "standard", "first_token_s": 2.0, "finish_s": 4.0, "paused_s": 0.0}]
    assert result.meta["platform"]["pauses"] == 1


def test_decode_replicas_never_pause():
    # F (flex, 40 prompt tokens = 3 of 4 blocks of 16) lands on the decode replica at 2 (40,000 B at
    # 40,000 B/s): 75% of its KV in use, above the pause's 50%; a decode replica does not pause (its
    # requests hold KV moved to it), so F decodes [2, 3] and finishes at 3. (The prefill replica pauses
    # at 1, its KV holding F's 3 blocks for the transfer: nothing of flex is left there to hold.)
    cfg = config({"replicas": 1}, {"replicas": 1}, 4e-5, num_gpu_blocks=4, pause="tier=flex,kv=0.5,resume=0.2")
    result = replay(make_trace([0], [40], [2], tier=["flex"]), cfg)
    assert rows(result, ("finish_s", "paused_s", "num_preemptions")) == [
        {"finish_s": 3.0, "paused_s": 0.0, "num_preemptions": 0}]
    assert result.meta["platform"]["pauses"] == 1


@pytest.mark.parametrize("pools, message", [
    ([{"name": "p", "role": "prefill", "instances": [{"price_per_gpu_hour": 2}]}],
     r"cluster.pools\[0\].instances\[0\]: missing 'gpu'"),
    ([{"name": "p", "role": "prefill", "gpu": "h100-80gb", "instances": [{"gpu": "a"}]}],
     r"pool 'p': 'gpu' is set per instance type"),
    ([{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "instances": []}],
     r"cluster.pools\[1\].instances: must be a non-empty array"),
    ([{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "instances": [{"gpu": "a", "available": [[5]]}]}],
     r"cluster.pools\[1\].instances\[0\].available\[0\]: must be a pair"),
    ([{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "instances": [{"gpu": "a", "gpus": 2}]}],
     r"cluster.pools\[1\].instances\[0\]: unknown key 'gpus'"),
    ([{"name": "p", "role": "prefill", "rebalance": True}], r"pool 'p': rebalance .* needs instances"),
    ([{"name": "p", "role": "prefill", "rebalance": "maybe", "instances": [{"gpu": "a"}]}],
     r"cluster.pools\[0\].rebalance"),
])
def test_bad_instances_on_prefill_decode_pools_are_one_line_errors(pools, message):
    with pytest.raises(ServelabError, match=message):
        ReplayConfig.from_dict({"runner": UNIT, "num_gpu_blocks": 10, "kv_bytes_per_token": 10,
                                "cluster": {"pools": pools, "links": [{"from": "p", "to": "d"}]}}, source="c.toml")


def test_failures_name_replicas_across_the_pools():
    # prefill replica 0, decode replica 1: replica=2 does not exist
    with pytest.raises(ServelabError, match=r"fail replica=2: there are only 2 replica\(s\)"):
        replay(make_trace([0], [8], [3]), config({"replicas": 1}, {"replicas": 1}, 1e-6, fail=["replica=2,at=1"]))


RANDOM_CASES = {  # pools (prefill, decode) and top-level settings; replicas: prefill 0, 1, decode 2, 3, 4
    "failures, journal": ({"replicas": 2}, {"replicas": 3},
                          {"fail": ["replica=1,at=1.5,for=2", "replica=3,at=2", "replica=2,at=3,for=1.5"]}),
    "failures, no journal, swap on decode": (
        {"replicas": 2}, {"replicas": 3, "preemption": "swap", "swap_space_gb": 0.0002, "num_gpu_blocks": 300},
        {"journal": False, "fail": ["replica=0,at=1,for=1", "replica=4,at=2.5,for=2"]}),
    "pause and failures": ({"replicas": 2}, {"replicas": 3},
                           {"policy": "tiers", "policy_params": {"preempt": True},
                            "pause": "tier=flex,waiting=4,resume=1", "fail": ["replica=1,at=2,for=2", "replica=2,at=3"]}),
    "instance types, reclaims": (
        {"replicas": 2, "rebalance": True,
         "instances": [{"gpu": "h100-80gb", "available": [[0, 2], [1.5, 1], [3, 0], [4, 2]]},
                                      {"gpu": "a100-80gb", "available": [[0, 0], [2, 1]], "num_gpu_blocks": 300}]},
        {"replicas": 3, "instances": [{"gpu": "h100-80gb", "available": [[0, 3], [2, 1], [4.5, 2]]},
                                      {"gpu": "l40s", "available": 1, "runner": "linear:base=0.02,decode_seq=0.001"}]},
        {}),
    "instance types, autoscaled, reclaims": (
        {"replicas": 1, "autoscale": {"min": 1, "max": 3, "signal": "queue_depth", "target": 2, "interval_s": 0.5,
                                      "cooldown_s": 1.0, "startup_s": 0.3},
         "instances": [{"gpu": "h100-80gb", "available": [[0, 2], [2.5, 0], [4, 1]]}, {"gpu": "a100-80gb"}]},
        {"replicas": 2, "autoscale": {"min": 1, "max": 3, "signal": "handoffs_waiting", "target": 1,
                                      "interval_s": 0.5, "cooldown_s": 1.0, "startup_s": 0.4},
         "instances": [{"gpu": "h100-80gb", "available": [[0, 2], [3, 1]]}, {"gpu": "a100-80gb", "available": 1}]},
        {"journal": False}),
    # failures where an autoscaler or a fleet changes membership too (replica ids: prefill 0, 1; decode 2, 3, 4)
    "failures, autoscaled pools": (
        {"replicas": 1, "autoscale": {"min": 1, "max": 2, "signal": "queue_depth", "target": 2, "interval_s": 0.5,
                                      "cooldown_s": 1.0, "startup_s": 0.3}},
        {"replicas": 2, "autoscale": {"min": 1, "max": 3, "signal": "handoffs_waiting", "target": 1,
                                      "interval_s": 0.5, "cooldown_s": 1.0, "startup_s": 0.4}},
        {"fail": ["replica=0,at=1,for=1.5", "replica=3,at=1.5,for=1", "replica=2,at=2.5"]}),
}
# the autoscaled instance-type pools above, with failures on top (prefill h100 0, 1, a100 2, 3, 4;
# decode h100 5, 6, a100 7)
RANDOM_CASES["failures, instance types, autoscaled"] = (
    *RANDOM_CASES["instance types, autoscaled, reclaims"][:2],
    {"fail": ["replica=0,at=1.2,for=1", "replica=5,at=2,for=1.5", "replica=7,at=2.2,for=0.5"]})


def every_event_engine(monkeypatch) -> list:
    """Engines that also check the invariants after every timed event (transfers, availability
    changes, autoscaler ticks) and every failure or recovery, not only after arrivals and steps."""
    import servelab.assembly
    from servelab.replay.core.engine import TIMER
    from test_engine_invariants import CheckedEngine

    engines = []

    class EveryEvent(CheckedEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            fault = self.platform.fault

            def checked_fault(replica, down, now):  # (a failure's intents enacted, then checked)
                self.enact(fault(replica, down, now), now)
                self._check()
                return []

            self.platform.fault = checked_fault
            engines.append(self)

        def push(self, time_s, kind, payload):
            if kind == TIMER:
                fn = payload

                def payload(t, fn=fn):  # (the intents a timed event returns, enacted before the check)
                    intents = fn(t)
                    if intents:
                        self.enact(intents, t)
                    self._check()

            super().push(time_s, kind, payload)

    monkeypatch.setattr(servelab.assembly, "Engine", EveryEvent)
    return engines


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(RANDOM_CASES))
@pytest.mark.sampled(keep=3)
def test_losses_keep_the_bookkeeping_after_every_event_and_lose_no_request(monkeypatch, case, seed):
    """KV per replica (with the KV held for and reserved by transfers), outstanding tokens, every
    request accounted for; at the end nothing waits, nothing is held, KV is back to zero."""
    from helpers_engine import synthetic, with_tiers
    from test_engine_invariants import disaggregation

    prefill, decode, top = RANDOM_CASES[case]
    engines = every_event_engine(monkeypatch)
    trace = synthetic(n=300, rate=50.0, seed=seed)
    if top.get("policy") == "tiers":
        trace = with_tiers(trace)
    data = dict({"runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "num_gpu_blocks": 400,
                 "kv_bytes_per_token": 1024, "policy": "sarathi"}, **top)
    data["cluster"] = {"pools": [dict(name="p", role="prefill", router="least-outstanding", **prefill),
                                 dict(name="d", role="decode", **decode)],
                       "links": [{"from": "p", "to": "d", "bandwidth_gbps": 0.02, "latency_s": 0.002}]}
    from test_engine_invariants import CheckedEngine

    before = CheckedEngine.events
    result = replay(trace, ReplayConfig.from_dict(data))
    assert CheckedEngine.events - before > 500
    statuses = result.requests.column("status").to_pylist()
    assert set(statuses) <= {"finished", "rejected"} and statuses.count("finished") > 250
    (engine,) = engines
    disagg = disaggregation(engine)
    transfers = result.meta["cluster"]["transfers"]
    # replicas were lost with requests on them and with KV held for or in transfers
    assert transfers["requests_lost_kv"] > 0 and result.meta["platform"]["faults"]["requests_moved"] > 0
    assert not disagg.pending and not disagg.source and not any(disagg.landing.values())
    for replica in engine.replicas:
        assert replica.outstanding_tokens == 0
        assert replica.kv.used == 0 and replica.kv.host_used == 0 and replica.kv.aggregate_held == 0
    # every finished request has all its tokens, and its last handoff's columns
    for r in result.requests.to_pylist():
        if r["status"] == "finished":
            assert r["generated_tokens"] == r["output_tokens"]
            if r["output_tokens"] > 1 and r["decode_replica"] is not None:
                assert r["replica"] == r["decode_replica"] and r["transfer_s"] >= 0
