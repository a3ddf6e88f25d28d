"""Prefill/decode disaggregation (replay/cluster/disagg.py, replay/cluster/transfer.py) against hand-traced timelines.

Every step costs 1 s (``linear:base=1``); KV is 1,000 bytes per token, so an 8-token prompt moves
8,000 bytes: at 1,000 B/s (``bandwidth_gbps = 1e-6``) that is 8 s alone on the link.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError

UNIT = "linear:base=1"


def cluster_config(prefill=None, decode=None, link=None, **top):
    pools = [dict(dict(name="p", role="prefill", replicas=1), **(prefill or {})),
             dict(dict(name="d", role="decode", replicas=1), **(decode or {}))]
    links = [dict({"from": "p", "to": "d", "bandwidth_gbps": 1e-6, "latency_s": 0.0}, **(link or {}))]
    data = dict(dict(runner=UNIT, num_gpu_blocks=1000, kv_bytes_per_token=1000, max_num_batched_tokens=4096), **top)
    data["cluster"] = {"pools": pools, "links": links}
    return ReplayConfig.from_dict(data)


def rows(result):
    return result.requests.to_pylist()


def test_gap_between_first_and_second_token_is_transfer_plus_one_decode_step():
    # prefill [0, 1] emits token 1; 8,000 B at 1,000 B/s + 0.5 s latency lands at 9.5;
    # decode steps [9.5, 10.5] and [10.5, 11.5] emit tokens 2 and 3.
    r = rows(replay(make_trace([0], [8], [3]), cluster_config(link={"latency_s": 0.5})))[0]
    assert r["status"] == "finished"
    assert r["ttft_s"] == pytest.approx(1.0)
    assert r["transfer_s"] == pytest.approx(8.5)
    assert r["handoff_wait_s"] == 0.0
    assert r["finish_s"] == pytest.approx(11.5)
    second_token_s = r["finish_s"] - 1.0  # the last decode step is 1 s
    assert second_token_s - r["first_token_s"] == pytest.approx(8.5 + 1.0)
    assert r["max_itl_s"] == pytest.approx(9.5)
    assert (r["prefill_replica"], r["decode_replica"], r["replica"]) == (0, 1, 1)


def test_async_scheduling_decodes_a_landed_request_from_the_step_after_the_next():
    """vLLM's decode instance learns that a request's KV has arrived from a step's output; with async
    scheduling it had picked the next step already, so the request first decodes in the one after. Request
    1's KV lands at 29.3 s, during request 0's decode step [29, 30]: it decodes [31, 32] .. [34, 35], not
    from 30 s (what it did: a landing was taken at the next boundary as without async scheduling)."""
    trace = make_trace([0, 20.3], [8, 8], [40, 5])
    sync = rows(replay(trace, cluster_config()))
    asyn = rows(replay(trace, cluster_config(async_scheduling=True)))
    assert sync[1]["first_token_s"] + sync[1]["transfer_s"] == pytest.approx(29.3)
    assert sync[1]["finish_s"] == 34.0
    assert asyn[1]["finish_s"] == 35.0
    assert asyn[0]["finish_s"] == sync[0]["finish_s"]


def test_two_transfers_on_one_link_take_twice_as_long():
    # both prompts prefill in one step [0, 1]; 16,000 B share 1,000 B/s: both land at 17
    out = rows(replay(make_trace([0, 0], [8, 8], [2, 2]), cluster_config()))
    assert [r["transfer_s"] for r in out] == [pytest.approx(16.0)] * 2
    assert [r["finish_s"] for r in out] == [pytest.approx(18.0)] * 2  # one decode step [17, 18] for both


def test_overlapping_transfers_share_the_bandwidth_while_both_are_in_flight():
    # A: prefill [0, 1], 8,000 B from 1. B: arrives at 2, prefill [2, 3], 8,000 B from 3.
    # Alone until 3 A moves 2,000 B; then 500 B/s each: A's last 6,000 B take 12 s (lands at 15),
    # B has moved 6,000 B by then and its last 2,000 B alone take 2 s (lands at 17).
    a, b = rows(replay(make_trace([0, 2], [8, 8], [2, 2]), cluster_config()))
    assert a["transfer_s"] == pytest.approx(14.0) and b["transfer_s"] == pytest.approx(14.0)
    assert a["finish_s"] == pytest.approx(16.0) and b["finish_s"] == pytest.approx(18.0)


@pytest.mark.parametrize("decode", [dict(max_num_seqs=1), dict(num_gpu_blocks=1, block_size=16)],
                         ids=["no seat", "no KV"])
def test_back_pressure_holds_the_request_until_a_decode_slot_frees(decode):
    # Both prefill in [0, 1] (block_size 16 everywhere: one block each). The link moves 8,000 B in
    # 1 s. A lands at 2 and decodes [2, 3], [3, 4]: finished at 4. B found no room at 1 (A's seat or
    # A's KV block is taken): it waits, holding its KV on the prefill replica, until A finishes at 4;
    # its transfer [4, 5], decodes [5, 6], [6, 7].
    config = cluster_config(decode=decode, link={"bandwidth_gbps": 8e-6}, block_size=16)
    a, b = rows(replay(make_trace([0, 0], [8, 8], [3, 3]), config))
    assert a["handoff_wait_s"] == 0.0 and a["finish_s"] == pytest.approx(4.0)
    assert b["handoff_wait_s"] == pytest.approx(3.0)
    assert b["transfer_s"] == pytest.approx(1.0)
    assert b["finish_s"] == pytest.approx(7.0)
    assert b["max_itl_s"] == pytest.approx(5.0)  # first token at 1, second at 6


def test_back_pressure_keeps_the_prefill_replicas_kv_held():
    # Prefill KV of 2 blocks: A and B (one block each) fill it; C (arrives at 0.5) cannot be
    # admitted until B's transfer ends and frees B's block. Decode: one seat, as above.
    config = cluster_config(prefill=dict(num_gpu_blocks=2), decode=dict(max_num_seqs=1),
                            link={"bandwidth_gbps": 8e-6}, block_size=16)
    a, b, c = rows(replay(make_trace([0, 0, 0.5], [8, 8, 8], [3, 3, 2]), config))
    # A: transfer [1, 2], decodes to 4. B waits [1, 4], transfer [4, 5], decodes to 7.
    # C: its prefill can start only when A's block is free: A's transfer ends at 2 -> prefill [2, 3];
    # it waits for the decode seat until B finishes at 7, transfer [7, 8], decode [8, 9].
    assert a["finish_s"] == pytest.approx(4.0) and b["finish_s"] == pytest.approx(7.0)
    assert c["first_scheduled_s"] == pytest.approx(2.0) and c["first_token_s"] == pytest.approx(3.0)
    assert c["handoff_wait_s"] == pytest.approx(4.0)
    assert c["finish_s"] == pytest.approx(9.0)


def test_a_request_no_decode_replica_can_hold_is_rejected_with_its_reason_not_lost():
    config = cluster_config(decode=dict(num_gpu_blocks=1), block_size=16)
    r = replay(make_trace([0, 0], [8, 40], [2, 2]), config)
    ok, big = rows(r)
    assert ok["status"] == "finished"
    assert big["status"] == "rejected" and "decode replica has 1" in big["reason"]
    assert r.meta["counts"]["rejected"] == 1 and r.meta["counts"]["finished"] == 1


def test_one_token_answers_finish_on_the_prefill_replica_without_a_transfer():
    r = rows(replay(make_trace([0], [8], [1]), cluster_config()))[0]
    assert r["status"] == "finished" and r["finish_s"] == pytest.approx(1.0)
    assert r["decode_replica"] is None and r["transfer_s"] is None


def test_horizon_counts_requests_in_transfer_as_unfinished():
    r = replay(make_trace([0], [8], [3]), cluster_config(until_s=5.0))
    assert rows(r)[0]["status"] == "unfinished"


def test_disaggregation_needs_the_kv_size_and_refuses_what_it_does_not_model():
    config = cluster_config()
    with pytest.raises(ServelabError, match="kv_bytes_per_token"):
        replay(make_trace([0], [8], [3]), ReplayConfig.from_dict(dict(config.to_dict(), kv_bytes_per_token=None)))


def test_disaggregated_replays_are_deterministic():
    from helpers_engine import synthetic

    trace = synthetic(n=300, rate=30.0)
    config = cluster_config(runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
                            link={"bandwidth_gbps": 5.0, "latency_s": 0.001},
                            decode=dict(replicas=2, router="power-of-two"))
    a, b = replay(trace, config), replay(trace, config)
    assert a.requests.equals(b.requests) and a.steps.equals(b.steps)
    assert a.meta["counts"]["finished"] == 300


def test_a_transfer_shorter_than_the_clocks_resolution_still_lands():
    # at t = 1e9 s a 8,000 B transfer at 1e6 GB/s (8e-12 s) ends where the clock cannot move:
    # it lands at the same instant instead of being planned again and again
    r = rows(replay(make_trace([1e9], [8], [2]), cluster_config(link={"bandwidth_gbps": 1e6})))[0]
    assert r["status"] == "finished" and r["finish_s"] == pytest.approx(1e9 + 2.0)
