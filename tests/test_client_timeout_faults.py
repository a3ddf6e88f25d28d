"""Client timeouts combined with replica failures and with prefill/decode pools (replay/platform/abort.py,
``Disaggregation.abandon``, ``Engine.evict``): every request is accounted once, a request whose
client gives up inside a KV transfer or on a replica that then fails is ended once, at its deadline,
and what it held is freed then. Hand-traced timelines: every step costs 1 s (``linear:base=1``),
KV is 1,000 bytes per token, blocks of 16 tokens."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest
from conftest import make_trace
from helpers_engine import synthetic

import servelab.replay.core.engine as engine_module
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError

UNIT = "linear:base=1"


def pd_config(bandwidth_gbps, decode=None, **top):
    data = dict(dict(runner=UNIT, num_gpu_blocks=1000, kv_bytes_per_token=1000, max_num_batched_tokens=4096), **top)
    data["cluster"] = {"pools": [dict(name="p", role="prefill", replicas=1),
                                 dict(name="d", role="decode", replicas=1, **(decode or {}))],
                       "links": [{"from": "p", "to": "d", "bandwidth_gbps": bandwidth_gbps}]}
    return ReplayConfig.from_dict(data)


def col(result, name):
    return result.requests.column(name).to_pylist()


def used_at(result, replica, start_s):
    return next(s["kv_blocks_used"] for s in result.steps.to_pylist()
                if s["replica"] == replica and s["start_s"] == start_s)


@pytest.fixture
def ends(monkeypatch):
    """Every ``Engine.ended`` call by request index: a request is ended once, or it was accounted twice."""
    calls: Counter = Counter()
    ended = engine_module.Engine.ended

    def counted(self, req, now):
        calls[req.index] += 1
        ended(self, req, now)

    monkeypatch.setattr(engine_module.Engine, "ended", counted)
    return calls


def test_a_timeout_inside_a_kv_transfer_cancels_it_and_frees_both_ends_at_t(ends):
    # Link 1,000 B/s (1e-6 GB/s). A (t=0, 8-token prompt, 3 out, timeout 5): prefill [0, 1], first token
    # at 1, its 8,000 B transfer starts at 1. B (t=2, 8 out of 3): prefill [2, 3], transfer from 3,
    # sharing the link with A (500 B/s each). At 5 A's client gives up: A has sent 2,000 + 1,000 B; its
    # transfer is cancelled, its landing block on the decode replica and its prompt block on the prefill
    # replica are freed at 5. B has 7,000 B left alone on the link: lands at 12, decodes [12, 13],
    # [13, 14]. (Without the timeout A would land at 15 and B at 17.) C (t=6, one output token) finishes
    # in its prefill [6, 7] on the prefill replica, which holds B's block and C's: A's is gone.
    trace = make_trace([0, 2, 6], [8, 8, 8], [3, 3, 1], timeout_s=pa.array([5.0, None, None], pa.float64()))
    r = replay(trace, pd_config(1e-6))
    assert col(r, "status") == ["aborted", "finished", "finished"]
    assert col(r, "refused_s")[0] == 5.0 and col(r, "reason")[0] == "client timeout after 5 s"
    assert col(r, "first_token_s")[0] == 1.0  # seen before the deadline
    assert col(r, "transfer_s")[0] is None  # never landed
    assert col(r, "finish_s")[1:] == [14.0, 7.0]
    assert col(r, "transfer_s")[1] == pytest.approx(9.0)
    assert used_at(r, 0, 6.0) == 2  # B's block (still sending) and C's; A's freed at 5
    assert used_at(r, 1, 12.0) == 1  # the decode replica holds B's block only
    assert dict(ends) == {0: 1, 1: 1, 2: 1}
    untimed = replay(trace.drop_columns(["timeout_s"]), pd_config(1e-6))
    assert col(untimed, "finish_s")[:2] == [17.0, 19.0]


def test_a_timeout_while_waiting_for_a_decode_replica_leaves_the_handoff_queue(ends):
    # The decode replica seats one request (max_num_seqs 1); transfers take 1 s (8,000 B/s). A and B
    # (t=0) prefill together [0, 1]; A is placed (transfer [1, 2], decodes [2, 7]: 6 tokens), B waits
    # for a seat holding its prefill KV. C (t=2) prefills [2, 3] and queues behind B at 3. B's client
    # gives up at 3 (after the step's handoff: completions come before timers), so B leaves the queue
    # and frees its prefill block; when A finishes at 7, C (not B) takes the seat: transfer [7, 8],
    # decode [8, 9]. Without B's timeout C would wait for B: B decodes [9, 11], C lands at 12.
    trace = make_trace([0, 0, 2], [8, 8, 8], [6, 3, 2], timeout_s=pa.array([None, 3.0, None], pa.float64()))
    cfg = pd_config(8e-6, decode={"max_num_seqs": 1})
    r = replay(trace, cfg)
    assert col(r, "status") == ["finished", "aborted", "finished"]
    assert col(r, "refused_s")[1] == 3.0 and col(r, "first_token_s")[1] == 1.0
    assert col(r, "decode_replica")[1] is None and col(r, "transfer_s")[1] is None
    assert col(r, "finish_s")[0] == 7.0 and col(r, "finish_s")[2] == 9.0
    assert col(r, "handoff_wait_s")[2] == 4.0  # first token at 3, transfer from 7
    assert dict(ends) == {0: 1, 1: 1, 2: 1}
    untimed = replay(trace.drop_columns(["timeout_s"]), cfg)
    assert col(untimed, "finish_s")[2] > 9.0


def test_an_aborted_request_on_a_replica_that_fails_is_not_moved(ends):
    # Two replicas (round-robin: A on 0, B on 1). A (32 in, 30 out, timeout 5.5): first token at 1,
    # decode stretch from 1; its client gives up at 5.5, inside the iteration [5, 6], so A would leave
    # at 6. Replica 0 fails at 5.7: the iteration [5, 6] is lost with A's blocks, and A, ended at 5.5,
    # is not moved to replica 1 (it would be served a second time there).
    trace = make_trace([0, 0], [32, 32], [30, 3], timeout_s=pa.array([5.5, None], pa.float64()))
    cfg = ReplayConfig.from_dict({"runner": UNIT, "replicas": 2, "router": "round-robin", "num_gpu_blocks": 100,
                                  "fail": ["replica=0,at=5.7"]})
    r = replay(trace, cfg)
    assert col(r, "status") == ["aborted", "finished"]
    assert col(r, "refused_s")[0] == 5.5 and col(r, "finish_s")[0] is None
    assert col(r, "generated_tokens")[0] == 5  # tokens at 1..5; the iteration [5, 6] was lost
    assert col(r, "finish_s")[1] == 3.0
    assert r.meta["platform"]["faults"]["requests_moved"] == 0 and r.meta["platform"]["faults"]["failures"] == 1
    assert not [s for s in r.steps.to_pylist() if s["replica"] == 1 and s["start_s"] >= 5.7]  # nothing moved there
    assert dict(ends) == {0: 1, 1: 1}


def test_a_request_moved_by_a_failure_times_out_once_where_it_landed(ends):
    # A (32 in, 30 out, timeout 8) on replica 0; replica 0 fails at 3.5: the iteration [3, 4] is lost
    # (tokens at 1, 2, 3 kept), A moves to replica 1, which re-prefills prompt + 3 tokens [3.5, 4.5] and
    # decodes from there; the client gives up at 8, inside the iteration [7.5, 8.5]: A leaves replica 1
    # at 8.5 and B (t=8.2, one output token, waiting for A's blocks: 7 of 7) is admitted then.
    trace = make_trace([0, 8.2], [32, 64], [30, 1], timeout_s=pa.array([8.0, None], pa.float64()))
    cfg = ReplayConfig.from_dict({"runner": UNIT, "replicas": 2, "router": "round-robin", "num_gpu_blocks": 7,
                                  "kv_allocation": "reserve", "fail": ["replica=0,at=3.5"]})
    r = replay(trace, cfg)
    assert col(r, "status") == ["aborted", "finished"]
    assert col(r, "refused_s")[0] == 8.0
    assert r.meta["platform"]["faults"]["requests_moved"] == 1
    assert col(r, "first_scheduled_s")[1] == 8.5 and col(r, "finish_s")[1] == 9.5
    assert dict(ends) == {0: 1, 1: 1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_request_is_accounted_once_with_timeouts_failures_and_pools(ends, seed):
    trace = synthetic(n=160, rate=30.0, seed=seed)
    timeouts = [2.0 + (i % 9) * 6.0 for i in range(trace.num_rows)]
    trace = trace.append_column("timeout_s", pa.array(timeouts, pa.float64()))
    data = dict(runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", num_gpu_blocks=400,
                kv_bytes_per_token=2000, fail=["replica=0,at=2,for=3", "replica=2,at=4,for=2"],
                cluster={"pools": [dict(name="p", role="prefill", replicas=2),
                                   dict(name="d", role="decode", replicas=2, max_num_seqs=8)],
                         "links": [{"from": "p", "to": "d", "bandwidth_gbps": 0.05}]})
    r = replay(trace, ReplayConfig.from_dict(data))
    status = col(r, "status")
    assert len(status) == trace.num_rows
    assert Counter(status)["aborted"] > 5 and Counter(status)["finished"] > 5
    arrival, finish, refused = col(r, "arrival_s"), col(r, "finish_s"), col(r, "refused_s")
    for i, s in enumerate(status):
        assert ends[i] == (1 if s != "unfinished" else 0), (i, s, ends[i])
        if s == "finished":
            assert finish[i] - arrival[i] <= timeouts[i] + 1e-9
        elif s == "aborted":
            assert refused[i] == pytest.approx(arrival[i] + timeouts[i]) and finish[i] is None


def reclaim_config(**top):
    """Two H100s until 5, then one (replica 1 is reclaimed), and one A100 from the start: one request at a
    time per replica, every step 1 s (as tests/test_cluster_instances.py)."""
    return ReplayConfig.from_dict({"runner": UNIT, "num_gpu_blocks": 100, "max_num_seqs": 1,
                                   "router": "least-outstanding", **top, "cluster": {"pools": [{
                                       "name": "web", "replicas": 2, "instances": [
                                           {"gpu": "h100-80gb", "available": [[0, 2], [5, 1]]},
                                           {"gpu": "a100-80gb", "available": 1}]}]}})


def test_a_request_moved_by_a_reclaim_times_out_once_where_it_landed(ends):
    # A and B (t=0, 1 prompt token, 10 out) on the two H100s: first tokens at 1, one more each second.
    # At 5 replica 1 (B's) is reclaimed: the iteration [5, 6] is lost, B moves (journal: its 5 tokens
    # kept) to the A100 that refills the pool, recomputes [5, 6] (token 6) and decodes on; B's client
    # gives up at 7.5, inside the iteration [7, 8]: B leaves the A100 at 8 with 8 tokens, ended once, at
    # 7.5. A finishes at 10 on replica 0.
    trace = make_trace([0, 0], [1, 1], [10, 10], timeout_s=pa.array([None, 7.5], pa.float64()))
    r = replay(trace, reclaim_config())
    assert col(r, "status") == ["finished", "aborted"]
    assert col(r, "finish_s")[0] == 10.0 and col(r, "refused_s")[1] == 7.5
    assert col(r, "replica")[1] == 2 and col(r, "generated_tokens")[1] == 8
    faults = r.meta["platform"]["faults"]
    assert (faults["failures"], faults["requests_moved"]) == (0, 1)
    assert max(s["start_s"] + s["duration_s"] for s in r.steps.to_pylist() if s["replica"] == 2) == 8.0
    assert dict(ends) == {0: 1, 1: 1}


def test_an_aborted_request_on_a_reclaimed_replica_is_not_moved(ends):
    # B's client gives up at 4.5, inside the iteration [4, 5]: B would leave at 5, but at 5 its replica is
    # reclaimed first (the iteration [4, 5] ends at 5: completions come before timers and changes of
    # availability alike, so B's fifth token counts and it leaves with its replica); it is not moved to
    # the A100, which serves nothing.
    trace = make_trace([0, 0], [1, 1], [10, 10], timeout_s=pa.array([None, 4.5], pa.float64()))
    r = replay(trace, reclaim_config())
    assert col(r, "status") == ["finished", "aborted"]
    assert col(r, "refused_s")[1] == 4.5 and col(r, "replica")[1] == 1
    assert r.meta["platform"]["faults"]["requests_moved"] == 0
    assert not [s for s in r.steps.to_pylist() if s["replica"] == 2]
    assert dict(ends) == {0: 1, 1: 1}


@pytest.mark.parametrize("autoscale", [None, {"min": 1, "max": 4, "signal": "queue_depth", "target": 2,
                                              "interval_s": 0.5, "cooldown_s": 1.0, "startup_s": 0.7}])
def test_every_request_is_accounted_once_with_timeouts_and_reclaims(ends, monkeypatch, autoscale):
    """Availability rises and falls (down to nothing for a while) under a bursty trace whose clients give
    up after 1.5-13.5 s: KV and outstanding tokens add up after every event, every request ends once (or
    is rejected on arrival), an aborted one at its deadline, a finished one before it."""
    import servelab.assembly
    from test_engine_invariants import CheckedEngine

    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=300, rate=40.0, seed=5)
    timeouts = [1.5 + (i % 7) * 2.0 for i in range(trace.num_rows)]
    trace = trace.append_column("timeout_s", pa.array(timeouts, pa.float64()))
    types = [{"gpu": "h100-80gb", "available": [[0, 3], [2, 1], [4, 0], [6, 2]]},
             {"gpu": "a100-80gb", "available": [[0, 0], [3, 1], [3.5, 0], [4.5, 2]]}]
    cfg = ReplayConfig.from_dict({
        "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "num_gpu_blocks": 400,
        "max_num_seqs": 8, "router": "least-outstanding",
        "cluster": {"pools": [{"name": "a", "replicas": 3, "instances": types,
                               **({"autoscale": autoscale} if autoscale else {})}]}})
    r = replay(trace, cfg)
    status = col(r, "status")
    counts = Counter(status)
    assert counts["aborted"] > 5 and counts["finished"] > 5 and set(counts) <= {"finished", "aborted", "rejected"}
    assert r.meta["platform"]["faults"]["requests_moved"] > 0
    assert sum(ty["reclaimed"] for ty in r.meta["cluster"]["pools"][0]["instances"]) > 0
    arrival, finish, refused = col(r, "arrival_s"), col(r, "finish_s"), col(r, "refused_s")
    for i, s in enumerate(status):
        assert ends[i] == 1, (i, s, ends[i])
        if s == "finished":
            assert finish[i] - arrival[i] <= timeouts[i] + 1e-9
        elif s == "aborted":
            assert refused[i] == pytest.approx(arrival[i] + timeouts[i]) and finish[i] is None
