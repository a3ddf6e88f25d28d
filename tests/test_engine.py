"""Engine mechanics one behaviour at a time: KV accounting, preemption, rejection, sessions, horizon."""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import column, run

from servelab.common.errors import ServelabError
from servelab.replay import EngineConfig, ReplayConfig

UNIT = "linear:base=1"


def test_reserve_mode_makes_requests_wait_with_free_slots():
    trace = make_trace([0, 0.5], [16, 16], [16, 16])
    on_demand = run(trace, runner=UNIT, num_gpu_blocks=3, block_size=16)
    reserve = run(trace, runner=UNIT, num_gpu_blocks=3, block_size=16, kv_allocation="reserve")
    # on demand, B joins at the next iteration boundary after it arrives
    assert column(on_demand, "first_scheduled_s")[1] == 1.0
    # reserving prompt + max_output (2 blocks each) leaves no room for B until A finishes at 16
    assert column(reserve, "first_scheduled_s")[1] == column(reserve, "finish_s")[0] == 16.0


def test_recompute_preempts_the_most_recent_and_redoes_its_prefill():
    # each needs ceil((16 + 40) / 16) = 4 blocks at the end; 6 blocks cannot hold both
    trace = make_trace([0, 0.5], [16, 16], [40, 40])
    r = run(trace, runner=UNIT, num_gpu_blocks=6, block_size=16)
    assert column(r, "num_preemptions") == [0, 1]
    assert set(column(r, "status")) == {"finished"}
    prefill = sum(r.steps.column("prefill_tokens").to_pylist())
    assert prefill > 32  # B's prompt and generated tokens were computed again


def test_swap_keeps_progress_and_costs_transfer_time():
    trace = make_trace([0, 0.5], [16, 16], [40, 40])
    swap = run(trace, runner=UNIT, num_gpu_blocks=6, block_size=16, preemption="swap",
               kv_bytes_per_token=1_000_000, swap_bandwidth_gbps=1.0)
    assert column(swap, "num_preemptions") == [0, 1]
    assert sum(swap.steps.column("prefill_tokens").to_pylist()) == 32  # nothing recomputed
    # B held 3 blocks (48 tokens x 1 MB) when swapped out: 0.048 s out and 0.048 s back in
    durations = swap.steps.column("duration_s").to_pylist()
    assert any(d == pytest.approx(1.048) for d in durations)
    assert sum(durations) == pytest.approx(sum(n for n in swap.steps.column("num_iterations").to_pylist()) + 0.096)


def test_request_larger_than_all_kv_is_rejected_not_looped_on():
    trace = make_trace([0, 1], [1000, 10], [10, 10])
    r = run(trace, runner=UNIT, num_gpu_blocks=10, block_size=16)
    assert column(r, "status") == ["rejected", "finished"]
    assert "KV blocks" in column(r, "reason")[0]


def test_head_of_line_strict_vs_skip():
    # C needs 4 blocks of 5 while A holds 2; D behind it needs 1 block
    trace = make_trace([0, 0.1, 0.2], [16, 60, 8], [20, 4, 4])
    strict = run(trace, runner=UNIT, num_gpu_blocks=5, block_size=16, kv_allocation="reserve")
    skip = run(trace, runner=UNIT, num_gpu_blocks=5, block_size=16, kv_allocation="reserve", head_of_line="skip")
    assert column(strict, "first_scheduled_s")[2] >= column(strict, "finish_s")[0]
    assert column(skip, "first_scheduled_s")[2] == 1.0


def test_closed_loop_turn_arrives_after_think_time():
    trace = make_trace([0, 0.0], [8, 8], [5, 3], session_id=[7, 7], think_s=[None, 2.5])
    r = run(trace, runner=UNIT)
    finish = column(r, "finish_s")
    assert finish[0] == 5.0
    assert column(r, "arrival_s")[1] == 7.5
    assert finish[1] == 10.5


def test_closed_loop_turn_never_arrives_before_horizon():
    trace = make_trace([0, 0.0], [8, 8], [50, 3], session_id=[7, 7], think_s=[None, 1.0])
    r = run(trace, runner=UNIT, until_s=10)
    assert column(r, "status") == ["unfinished", "unfinished"]
    assert column(r, "arrival_s")[1] is None


def test_horizon_cuts_a_decode_stretch_exactly():
    r = run(make_trace([0], [4], [100]), runner=UNIT, until_s=50.5)
    assert column(r, "status") == ["unfinished"]
    assert column(r, "generated_tokens") == [50]  # tokens at t = 1, 2, ..., 50
    assert sum(r.steps.column("num_iterations").to_pylist()) == 50


def test_arrival_cuts_a_stretch_at_the_next_boundary():
    # A decodes from t=1; B arrives at 10.5 and is prefilled in the iteration starting at 11
    r = run(make_trace([0, 10.5], [4, 4], [100, 2]), runner=UNIT)
    assert column(r, "first_scheduled_s")[1] == 11.0
    assert column(r, "first_token_s")[1] == 12.0


def test_least_outstanding_router_balances_work():
    trace = make_trace([0, 0.1, 0.2, 0.3], [8, 8, 8, 8], [100, 5, 5, 5])
    r = run(trace, runner=UNIT, replicas=2, router="least-outstanding")
    assert column(r, "replica") == [0, 1, 1, 1]
    rr = run(trace, runner=UNIT, replicas=2, router="round-robin")
    assert column(rr, "replica") == [0, 1, 0, 1]


def test_one_token_output_has_zero_tpot_and_no_itl():
    r = run(make_trace([0], [8], [1]), runner=UNIT)
    assert column(r, "tpot_s") == [0.0]
    assert column(r, "max_itl_s") == [None]
    assert column(r, "ttft_s") == [1.0]


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(preemption="evict"), "preemption must be one of recompute, swap"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_bad_engine_config_is_a_clear_error(bad, message):
    with pytest.raises(ServelabError, match=message):
        EngineConfig(**bad)


def test_config_unknown_key_and_bad_policy_param():
    with pytest.raises(ServelabError, match="unknown key 'max_seqs'"):
        ReplayConfig.from_dict({"max_seqs": 3})
    with pytest.raises(ServelabError, match="unknown parameter 'quantumm'"):
        run(make_trace([0], [1], [1]), policy="round-robin", policy_params={"quantumm": 2})
    with pytest.raises(ServelabError, match="unknown policy 'fifo'.*sarathi"):
        run(make_trace([0], [1], [1]), policy="fifo")


def test_linear_runner_needs_blocks_and_swap_needs_kv_size():
    with pytest.raises(ServelabError, match="num_gpu_blocks"):
        from servelab.api import replay
        replay(make_trace([0], [1], [1]), ReplayConfig(runner=UNIT))
    with pytest.raises(ServelabError, match="kv_bytes_per_token"):
        run(make_trace([0], [1], [1]), runner=UNIT, preemption="swap")


def test_config_round_trips_through_dict():
    cfg = ReplayConfig.from_dict({"policy": "srpt", "max_num_seqs": "12", "until_s": 5,
                                  "policy_params": {"preempt": True}})
    assert cfg.engine.max_num_seqs == 12 and cfg.engine.until_s == 5.0
    assert ReplayConfig.from_dict(cfg.to_dict()) == cfg


def test_token_log_matches_per_iteration_times_and_max_itl():
    from helpers_engine import NoStretch  # noqa: F401  (reference: every iteration one by one)
    from servelab.api import replay
    from servelab.runners.base import make_runner

    trace = make_trace([0, 0.3, 2.0], [8, 40, 8], [30, 12, 5])
    runner_spec = "linear:base=0.1,prefill_token=0.01,decode_seq=0.02,decode_context_token=0.001"
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000), runner=runner_spec)
    fast = replay(trace, cfg, runner=make_runner(runner_spec), token_log=True)
    slow = replay(trace, cfg, runner=NoStretch(make_runner(runner_spec)), token_log=True)
    assert fast.steps.num_rows < slow.steps.num_rows  # stretches happened
    a, b = fast.tokens.to_pydict(), slow.tokens.to_pydict()
    assert a["request_id"] == b["request_id"] and a["token_index"] == b["token_index"]
    assert a["time_s"] == pytest.approx(b["time_s"], rel=1e-12)
    assert fast.tokens.num_rows == 30 + 12 + 5
    req = fast.requests.to_pydict()
    for i, rid in enumerate(req["request_id"]):
        rows = [k for k, r in enumerate(a["request_id"]) if r == rid]
        assert a["time_s"][rows[0]] == pytest.approx(req["first_token_s"][i])
        assert a["time_s"][rows[-1]] == pytest.approx(req["finish_s"][i])
        assert a["itl_s"][rows[0]] is None
        assert max(a["itl_s"][k] for k in rows[1:]) == pytest.approx(req["max_itl_s"][i])


def test_progress_callback_reports_arrivals():
    from servelab.api import replay
    from servelab.runners.base import make_runner

    n = 20_000
    trace = make_trace([i * 0.01 for i in range(n)], [4] * n, [2] * n)
    seen = []
    replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000), runner=UNIT),
           runner=make_runner("linear:base=0.001"), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, n), (8192, n), (16384, n)]


def test_batch_without_builder_summary_gives_the_same_timeline(monkeypatch):
    """A policy may build its Batch by hand; the engine then counts the items itself."""

    from servelab.policies.sarathi import Sarathi

    trace = make_trace([0, 0.2, 0.5, 3.0], [16, 90, 16, 40], [40, 4, 40, 10])
    runner = "linear:base=0.1,prefill_token=0.001,decode_seq=0.01,decode_context_token=0.0001"
    engine = dict(max_num_batched_tokens=64, num_gpu_blocks=9)
    expected = run(trace, runner=runner, **engine)
    original = Sarathi.schedule
    monkeypatch.setattr(Sarathi, "reads_running", None)  # a hand-built batch lists every request
    monkeypatch.setattr(Sarathi, "schedule",
                        lambda self, replica: original(self, replica)._replace(summary=None))
    bare = run(trace, runner=runner, **engine)
    assert bare.requests.equals(expected.requests)
    assert bare.steps.equals(expected.steps)
    assert sum(expected.requests.column("num_preemptions").to_pylist()) > 0  # KV pressure was exercised


@pytest.mark.parametrize("arrival, sync_s, async_s", [(0.5, 1.0, 2.0),  # during A's prefill step
                                                       (5.5, 6.0, 7.0)])  # during A's decode stretch
def test_async_scheduling_takes_an_arrival_one_step_later(arrival, sync_s, async_s):
    """vLLM's async scheduling picks step N+1 while step N runs: a request arriving during step N is first
    scheduled in step N+2, one iteration later than without (1 s iterations here)."""
    trace = make_trace([0, arrival], [16, 16], [20, 4])
    sync = run(trace, runner=UNIT, num_gpu_blocks=20, block_size=16)
    asyn = run(trace, runner=UNIT, num_gpu_blocks=20, block_size=16, async_scheduling=True)
    assert column(sync, "first_scheduled_s")[1] == sync_s
    assert column(asyn, "first_scheduled_s")[1] == async_s
    assert column(asyn, "finish_s")[0] == column(sync, "finish_s")[0]  # the running request is not slowed


def test_async_scheduling_takes_an_arrival_at_once_when_nothing_runs():
    """With nothing running, vLLM's scheduler has no step picked ahead: the request starts when it arrives."""
    trace = make_trace([0, 30.0], [16, 16], [4, 4])
    sync = run(trace, runner=UNIT, num_gpu_blocks=20, block_size=16)
    asyn = run(trace, runner=UNIT, num_gpu_blocks=20, block_size=16, async_scheduling=True)
    assert column(asyn, "first_scheduled_s") == column(sync, "first_scheduled_s") == [0.0, 30.0]
    assert column(asyn, "finish_s") == column(sync, "finish_s")


@pytest.mark.parametrize("stretch", [True, False])
def test_async_scheduling_takes_a_retried_request_one_step_after_it_comes(stretch):
    """A request that reaches its replica after its arrival_s (a client's retry after a throttle; likewise
    an encode pool's, or one routed again after a failure) is first seen by the decision after the one that
    starts when it comes, in a decode stretch and one iteration at a time alike. (Its arrival_s was taken
    for the time it came: the retry landing at 21.7 s, during the step [21, 22], went in at 22.)"""
    # request 0 decodes 1 s iterations; request 2 is over tenant b's tpm quota at 0.3 s and retries when it
    # has refilled (21.7 s)
    trace = make_trace([0, 0.0, 0.3], [16, 16, 17], [100, 4, 4], tenant=["a", "b", "b"])
    engine = dict(runner=UNIT, num_gpu_blocks=50, block_size=16, quota=("tenant=b:tpm=30",), retries=3,
                  retry_after=True, stretch=stretch)
    assert column(run(trace, **engine), "first_scheduled_s")[2] == 22.0
    assert column(run(trace, async_scheduling=True, **engine), "first_scheduled_s")[2] == 23.0


@pytest.mark.parametrize("policy", ["tiers", "drr", "vtc"])
def test_async_scheduling_a_request_not_seen_yet_blocks_no_admission(policy):
    """A policy walking its own order (tiers, fair sharing) passes over a request the decision does not
    know of yet, as vLLM's scheduler has not got it: it is no head-of-line blocker. Request 1 (seen at 2 s)
    was held behind request 2 (priority tier, tenant b: first in those policies' order), which came during
    the step that ended at 2 s, and both went in at 3 s."""
    trace = make_trace([0, 0.5, 1.5], [16, 16, 16], [20, 4, 4], tier=["standard", "standard", "priority"],
                       tenant=["a", "a", "b"])
    sync = run(trace, policy=policy, runner=UNIT, num_gpu_blocks=20, block_size=16)
    asyn = run(trace, policy=policy, runner=UNIT, num_gpu_blocks=20, block_size=16, async_scheduling=True)
    assert column(sync, "first_scheduled_s") == [0.0, 1.0, 2.0]
    assert column(asyn, "first_scheduled_s") == [0.0, 2.0, 3.0]


@pytest.mark.parametrize("policy, params, sync_s, async_s", [
    ("srpt", {"preempt": True}, 2.0, 3.0),
    ("tiers", {"preempt": True}, 2.0, 3.0),
    ("edf", {"preempt": True, "ttft_slo_s": 1.0}, 2.0, 3.0),
    ("round-robin", {"quantum": 2}, 2.0, 4.0),  # request 0's turn ends at 2 s with no one known to wait: a new one
])
def test_async_scheduling_preempts_nothing_for_a_request_not_seen_yet(policy, params, sync_s, async_s):
    """A running request keeps its slot against a request the decision does not know of yet: request 1
    (first in each policy's order) comes during the iteration [1, 2] s and takes request 0's only slot at
    the decision after the next. (Request 0 was preempted at 2 s for it, nothing could run without it, and
    it went in at 2 s as if async scheduling were off.)"""
    trace = make_trace([0, 1.5], [16, 16], [10, 2], tier=["flex", "priority"])
    engine = dict(policy=policy, policy_params=params, runner=UNIT, num_gpu_blocks=20, block_size=16,
                  max_num_seqs=1, stretch=False)
    sync = run(trace, **engine)
    asyn = run(trace, async_scheduling=True, **engine)
    assert column(sync, "first_scheduled_s")[1] == sync_s
    assert column(asyn, "first_scheduled_s")[1] == async_s
    assert column(asyn, "num_preemptions") == column(sync, "num_preemptions") == [1, 0]
