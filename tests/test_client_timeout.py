"""Client timeouts (replay/platform/abort.py): a request its client abandons ends ``aborted`` and frees its KV.

Golden timelines on one slot where every iteration costs 1 (``linear:base=1``) and KV is reserved
at admission (``kv_allocation = reserve``), so a waiting request is admitted exactly when the blocks
of the running one come back.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import make_trace
from helpers_engine import check_after_each_abort, column, run, synthetic, with_tiers
from test_engine_invariants import CheckedEngine

import servelab.assembly
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.common.errors import InputError, ServelabError
from servelab.traces.schema import validate

# A: prompt 32, 30 output tokens: reserves ceil(62 / 16) = 4 blocks, all there are. B: prompt 32,
# one output token, arrives at 0.5 and waits for A's blocks. A's first token at 1, then a decode
# stretch [1, 30]: without a timeout A finishes at 30 and B runs [30, 31].
KV = dict(kv_allocation="reserve", num_gpu_blocks=4, block_size=16)


def two(timeouts):
    return make_trace([0.0, 0.5], [32, 32], [30, 1], timeout_s=pa.array(timeouts, pa.float64()))


def steps_at(result, start_s):
    steps = result.steps.to_pylist()
    return next(s for s in steps if s["start_s"] == start_s)


def test_without_a_timeout_b_waits_for_a_to_finish():
    r = run(two([None, None]), **KV)
    assert column(r, "status") == ["finished", "finished"]
    assert column(r, "finish_s") == [30.0, 31.0]
    assert column(r, "first_scheduled_s")[1] == 30.0


def test_a_request_whose_client_times_out_at_t_frees_its_blocks_at_t():
    r = run(two([5.0, None]), **KV)
    assert column(r, "status") == ["aborted", "finished"]
    assert column(r, "refused_s")[0] == 5.0
    assert column(r, "reason")[0] == "client timeout after 5 s"
    assert column(r, "finish_s")[0] is None and column(r, "e2e_s")[0] is None
    assert column(r, "first_token_s")[0] == 1.0  # seen before the deadline: its TTFT stands
    assert column(r, "generated_tokens")[0] == 5  # tokens at 1, 2, 3, 4, 5: the last one at the deadline
    # the stretch [1, 30] was cut at 5; B is admitted at 5 onto A's freed blocks
    assert column(r, "first_scheduled_s")[1] == 5.0
    assert column(r, "finish_s")[1] == 6.0
    step = steps_at(r, 5.0)
    assert step["kv_blocks_used"] == 3  # B's reservation, ceil(33 / 16); A's 4 blocks are gone
    assert r.meta["counts"]["aborted"] == 1 and r.meta["client_timeouts"] == {"aborted": 1}


def test_inside_an_iteration_the_blocks_come_back_at_its_end():
    # 5.5 falls inside iteration [5, 6]: the engine cannot drop A half-way; it leaves at 6
    r = run(two([5.5, None]), **KV)
    assert column(r, "refused_s")[0] == 5.5  # the client left at 5.5
    assert column(r, "first_scheduled_s")[1] == 6.0
    assert column(r, "generated_tokens")[0] == 6


def test_a_last_token_exactly_at_the_deadline_counts():
    r = run(two([30.0, None]), **KV)
    assert column(r, "status") == ["finished", "finished"]
    assert column(r, "finish_s") == [30.0, 31.0]


def test_a_first_token_after_the_deadline_is_not_a_ttft():
    r = run(two([0.25, None]), **KV)  # the prefill [0, 1] was under way
    assert column(r, "status")[0] == "aborted"
    assert column(r, "first_token_s")[0] is None and column(r, "ttft_s")[0] is None
    assert column(r, "generated_tokens")[0] == 1  # the engine did produce it
    assert column(r, "first_scheduled_s")[1] == 1.0


def test_a_waiting_request_leaves_the_queue_at_its_deadline():
    r = run(two([None, 3.0]), **KV)
    assert column(r, "status") == ["finished", "aborted"]
    assert column(r, "refused_s")[1] == 3.5  # arrived at 0.5
    assert column(r, "first_scheduled_s")[1] is None
    assert column(r, "finish_s")[0] == 30.0


def test_the_option_applies_to_requests_without_their_own_timeout():
    r = run(two([None, 100.0]), client_timeout_s=4.0, **KV)
    assert column(r, "status") == ["aborted", "finished"]
    assert column(r, "refused_s")[0] == 4.0
    assert column(r, "finish_s")[1] == 5.0


def test_a_closed_loop_turn_leaves_when_its_predecessor_is_abandoned():
    # one session: turn 2 (think 2 s) is sent 2 s after turn 1's client gave up at 5
    trace = make_trace([0.0, 0.0], [32, 32], [30, 1], session_id=[7, 7], think_s=[None, 2.0],
                       timeout_s=pa.array([5.0, None], pa.float64()))
    r = run(trace, **KV)
    assert column(r, "status") == ["aborted", "finished"]
    assert column(r, "arrival_s")[1] == 7.0
    assert column(r, "finish_s")[1] == 8.0


def test_timeouts_nobody_reaches_change_nothing():
    trace = synthetic(n=300, rate=40.0, seed=4)
    cfg = dict(policy="sarathi", runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
               num_gpu_blocks=400)
    plain = run(trace, **cfg)
    far = run(trace.append_column("timeout_s", pa.array([1e6] * trace.num_rows, pa.float64())), **cfg)
    assert far.requests.equals(plain.requests)
    assert far.steps.equals(plain.steps)


# KV and outstanding tokens add up after every event, aborts included (tests/test_engine_invariants.py's
# check counts an aborted request still in its replica's running set: it waits for its iteration to end)
@pytest.mark.parametrize("policy,params,engine", [
    ("sarathi", {}, {"num_gpu_blocks": 300}),
    ("sarathi", {}, {"num_gpu_blocks": 300, "preemption": "swap", "kv_bytes_per_token": 1024,
                     "swap_space_gb": 0.0002}),
    ("orca", {}, {"num_gpu_blocks": 900, "kv_allocation": "reserve"}),
    ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "max_num_seqs": 8}),
    ("round-robin", {"quantum": 4}, {"num_gpu_blocks": 400, "max_num_seqs": 8}),
    ("vtc", {}, {"num_gpu_blocks": 300}),
    ("tiers", {"preempt": True}, {"replicas": 2, "num_gpu_blocks": 400, "queue_cap": 30,
                                  "quota": ("tenant=*:rpm=1500",), "retries": 1,
                                  "pause": "tier=flex,waiting=8,resume=2"}),
])
def test_bookkeeping_adds_up_with_aborts_after_every_event(monkeypatch, policy, params, engine):
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    check_after_each_abort(monkeypatch)
    trace = synthetic(n=250, rate=40.0, seed=2)
    timeouts = [5.0 + (i % 7) * 40.0 for i in range(trace.num_rows)]  # latencies here: 24-222 s (p10-p90)
    trace = trace.append_column("timeout_s", pa.array(timeouts, pa.float64()))
    if policy == "tiers":
        trace = with_tiers(trace)
    before = CheckedEngine.events
    result = run(trace, policy=policy, runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
                 policy_params=params, **engine)
    assert CheckedEngine.events - before > 300
    status = column(result, "status")
    assert status.count("aborted") > 5 and status.count("finished") > 5
    arrival, finish, refused = column(result, "arrival_s"), column(result, "finish_s"), column(result, "refused_s")
    for i, s in enumerate(status):
        if s == "finished":
            assert finish[i] - arrival[i] <= timeouts[i] + 1e-9
        elif s == "aborted":
            assert refused[i] == pytest.approx(arrival[i] + timeouts[i])


def test_bad_timeouts_are_refused_with_column_and_row():
    with pytest.raises(InputError, match="timeout_s.*row 2.*must be > 0"):
        validate(two([1.0, 0.0]), "t.arrow")
    with pytest.raises(ServelabError, match="client_timeout_s must be"):
        EngineConfig(client_timeout_s=0.0)


def test_timeouts_with_failures_are_replayed():
    # (with failures and with prefill/decode pools: tests/test_client_timeout_faults.py)
    cfg = ReplayConfig(engine=EngineConfig(replicas=2, fail=("replica=1,at=1",), num_gpu_blocks=100),
                       runner="linear:base=1")
    assert replay(two([1.0, None]), cfg).requests.column("status").to_pylist() == ["aborted", "finished"]


def test_a_read_timeout_abandons_only_requests_still_without_a_first_token():
    # client_timeout_until = first_token (an HTTP read timeout, GuideLLM's): at 3 s A has had its first
    # token since 1 s and keeps streaming to 30; B, queued behind A's blocks, has none by 3.5 and is
    # abandoned then. With the total deadline A is abandoned at 3 and B gets A's blocks.
    r = run(two([3.0, 3.0]), client_timeout_until="first_token", **KV)
    assert column(r, "status") == ["finished", "aborted"]
    assert column(r, "finish_s")[0] == 30.0 and column(r, "refused_s")[1] == 3.5
    assert column(r, "first_scheduled_s")[1] is None  # never admitted
    total = run(two([3.0, 3.0]), **KV)
    assert column(total, "status")[0] == "aborted" and column(total, "refused_s")[0] == 3.0
    with pytest.raises(ServelabError, match="client_timeout_until must be one of finish, first_token"):
        EngineConfig(client_timeout_until="last_byte")
