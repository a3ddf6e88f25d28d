"""Platform policies (tiers, vtc, drr, edf): the engine contract under their options, and hand-checked timelines.

Timelines use one processor doing one unit of work per iteration (``linear:base=1``, prompts of
one token that cost nothing, ``max_num_seqs = 1``), as in test_engine_golden.py.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import column, run
from test_policy_contract import ENGINE, RUNNER, check_invariants, workload

from servelab.common.errors import ServelabError
from servelab.policies.ordering import predicted_output
from servelab.replay.core.request import Request

VARIANTS = [
    ("tiers", {"preempt": True}),
    ("tiers", {"within": "srpt", "noise_sigma": 0.5}),
    ("tiers", {"max_wait_s": 0.5, "preempt": True}),
    ("tiers", {"reserve": "flex=0.25,standard=0.25"}),
    ("vtc", {"preempt": True}),
    ("vtc", {"preempt": True, "preempt_margin": 0, "weights": "a=2"}),
    ("vtc", {"weights": "a=3,b=1", "tiers": "priority,standard,flex"}),
    ("vtc", {"preempt": True, "tiers": "priority,standard,flex", "within": "sjf"}),
    ("drr", {"preempt": True}),
    ("drr", {"preempt": True, "preempt_margin": 0, "quantum": 16}),
    ("drr", {"quantum": 64, "weights": "c=2"}),
    ("edf", {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05}),
    ("edf", {"tier_ttft": "priority=0.2,standard=1", "preempt": True, "tpot_slo_s": 0.02}),
]
IDS = [f"{p}-{'-'.join(f'{k}={v}' for k, v in params.items())}" for p, params in VARIANTS]


@pytest.mark.parametrize("policy, params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_variants_keep_the_contract(policy, params, preemption):
    result = run(workload(), policy=policy, policy_params=params, runner=RUNNER, preemption=preemption,
                 kv_bytes_per_token=1024, **ENGINE)
    assert set(column(result, "status")) == {"finished"}
    check_invariants(result, policy)


@pytest.mark.parametrize("policy, params", VARIANTS, ids=IDS)
def test_variants_stretches_match_single_iterations(policy, params):
    trace = workload(n=60, seed=5)
    fast = run(trace, policy=policy, policy_params=params, runner=RUNNER, **ENGINE)
    slow = run(trace, policy=policy, policy_params=params, runner=RUNNER, stretch=False, **ENGINE)
    for col in ("first_token_s", "finish_s", "max_itl_s", "num_preemptions"):
        a, b = column(fast, col), column(slow, col)
        assert [x is None for x in a] == [x is None for x in b], col
        pairs = [(x, y) for x, y in zip(a, b) if x is not None]
        assert [x for x, _ in pairs] == pytest.approx([y for _, y in pairs], rel=1e-9, abs=1e-9), col


def long_and_short(tenants=True):
    """A 20-token job at t=0 and twenty 1-token jobs at t=1..20 (test_engine_golden.py's jobs)."""
    extra = {"tenant": ["a"] + ["b"] * 20} if tenants else {}
    return make_trace([0] + list(range(1, 21)), [1] * 21, [20] + [1] * 20, **extra)


@pytest.mark.parametrize("policy", ["vtc", "drr"])
def test_fair_share_serves_the_long_job_every_other_iteration(policy):
    params = {"preempt": True, "preempt_margin": 0}
    r = run(long_and_short(), policy=policy, policy_params=params, max_num_seqs=1)
    finish = column(r, "finish_s")
    assert set(column(r, "status")) == {"finished"} and max(finish) == 40.0  # work-conserving
    assert column(r, "max_itl_s")[0] <= 2.0  # never two short jobs in a row
    # tenant b gets served before a's job ends, unlike FCFS where every short job waits for it
    assert sum(1 for f in finish[1:] if f < finish[0]) >= 5
    fcfs = run(long_and_short(), policy="sarathi", max_num_seqs=1)
    assert column(fcfs, "finish_s")[0] == 20.0 and min(column(fcfs, "finish_s")[1:]) == 21.0


def test_vtc_hand_traced_order():
    # counters (w_in=1, w_out=2): a's job costs 3 then 2 per token, a short job costs 3.
    # t=0 a: 3. t=1 b lifted to 3; tie -> a (earlier head) -> 5. b (3) -> 6. a -> 7. b (6) -> 9...
    r = run(long_and_short(), policy="vtc", policy_params={"preempt": True, "preempt_margin": 0}, max_num_seqs=1)
    assert column(r, "finish_s")[1:4] == [3.0, 5.0, 8.0]


def test_fair_share_is_fcfs_for_one_tenant():
    one = run(long_and_short(tenants=False), policy="vtc", policy_params={"preempt": True}, max_num_seqs=1)
    fcfs = run(long_and_short(tenants=False), policy="sarathi", max_num_seqs=1)
    assert column(one, "finish_s") == column(fcfs, "finish_s")


def test_vtc_weights_split_service():
    # two tenants each with 30 long requests at t=0, 4 slots: weight 3 gets ~3x the service early on
    n = 30
    trace = make_trace([0.0] * (2 * n), [1] * (2 * n), [10] * (2 * n), tenant=["a", "b"] * n)
    r = run(trace, policy="vtc", policy_params={"weights": "a=3,b=1"}, max_num_seqs=4)
    finish, tenant = column(r, "finish_s"), column(r, "tenant")
    cut = sorted(finish)[2 * n // 2]
    done_a = sum(1 for f, t in zip(finish, tenant) if t == "a" and f <= cut)
    done_b = sum(1 for f, t in zip(finish, tenant) if t == "b" and f <= cut)
    assert done_a >= 2.5 * done_b


def test_vtc_lift_banks_no_credit():
    # a runs alone for 100 units; b arrives later with a counter lifted to a's, so a is not starved
    trace = make_trace([0, 0, 100, 100, 100], [1] * 5, [200, 200, 10, 10, 10], tenant=["a", "a", "b", "b", "b"])
    r = run(trace, policy="vtc", policy_params={"preempt": True, "preempt_margin": 0}, max_num_seqs=1)
    itl = column(r, "max_itl_s")
    assert max(itl[0], itl[1]) < 30  # without the lift b would hold the server for ~100 units


def test_predictor_matches_srpt():
    from servelab.policies.srpt import LengthParams, ShortestRemainingFirst
    from servelab.replay.config import EngineConfig

    srpt = ShortestRemainingFirst(LengthParams(noise_sigma=0.7), EngineConfig(seed=4))
    for rid in (0, 7, 123456):
        req = Request(rid, 0.0, 10, 50)
        srpt.on_arrival(req, None)
        assert predicted_output(req, 4, 0.7) == req.policy_data


# -- tiers ----------------------------------------------------------------------------------------
def tiered(arrivals, outputs, tiers, tenants=None):
    extra = {"tier": tiers}
    if tenants:
        extra["tenant"] = tenants
    return make_trace(arrivals, [1] * len(arrivals), outputs, **extra)


def test_tiers_strict_priority_and_preemption():
    trace = tiered([0, 0.5, 0.6], [5, 2, 2], ["standard", "standard", "priority"])
    off = run(trace, policy="tiers", max_num_seqs=1)
    assert column(off, "finish_s") == [5.0, 9.0, 7.0]  # priority overtakes the waiting standard job
    on = run(trace, policy="tiers", policy_params={"preempt": True}, max_num_seqs=1)
    # at t=1 the running standard job is preempted for the priority one; being older than the other
    # standard job it resumes first (recompute is free here): tokens 2..5 in [3, 7]
    assert column(on, "finish_s") == [7.0, 9.0, 3.0]
    assert column(on, "num_preemptions") == [1, 0, 0]


def test_flex_yields_without_preempt_unless_told_not_to():
    trace = tiered([0, 0.5], [5, 2], ["flex", "standard"])
    yields = run(trace, policy="tiers", max_num_seqs=1)
    assert column(yields, "finish_s") == [7.0, 3.0]
    keeps = run(trace, policy="tiers", policy_params={"best_effort": ""}, max_num_seqs=1)
    assert column(keeps, "finish_s") == [5.0, 7.0]


def test_flex_starvation_bound_promotes_it():
    arrivals = [0.0] + [float(t) for t in range(20)]
    trace = tiered([0.0] + arrivals[1:], [2] + [1] * 20, ["flex"] + ["standard"] * 20)
    starved = run(trace, policy="tiers", max_num_seqs=1)
    assert column(starved, "first_scheduled_s")[0] == 20.0
    bounded = run(trace, policy="tiers", policy_params={"max_wait_s": 4.5}, max_num_seqs=1)
    # promoted at 4.5, admitted at the next boundary (5) and never preempted for a tier after
    assert column(bounded, "first_scheduled_s")[0] == 5.0
    assert column(bounded, "finish_s")[0] == 7.0


def test_tiers_reservation_is_a_minimum_share():
    # two slots; standard jobs of 4, 6 and 4 tokens at t=0, a one-token flex job at t=0.5
    trace = tiered([0, 0, 0, 0.5], [4, 6, 4, 1], ["standard", "standard", "standard", "flex"])
    plain = run(trace, policy="tiers", max_num_seqs=2)
    assert column(plain, "finish_s") == [4.0, 6.0, 8.0, 7.0]  # flex yields to the waiting standard job
    share = run(trace, policy="tiers", policy_params={"reserve": "flex=0.5"}, max_num_seqs=2)
    assert column(share, "finish_s") == [4.0, 6.0, 9.0, 5.0]  # flex takes its reserved slot at t=4


def test_tiers_srpt_within_a_tier():
    trace = tiered([0, 0.5, 0.5, 0.5], [2, 9, 3, 1], ["standard", "flex", "standard", "standard"])
    r = run(trace, policy="tiers", policy_params={"within": "srpt"}, max_num_seqs=1)
    # after the first job: the 1-token then the 3-token standard job, then flex
    assert column(r, "finish_s") == [2.0, 15.0, 6.0, 3.0]


def test_unknown_tiers_rank_last():
    trace = tiered([0, 0.5, 0.6], [2, 1, 1], ["standard", "gold", "flex"])
    r = run(trace, policy="tiers", policy_params={"tiers": "priority,standard", "best_effort": ""}, max_num_seqs=1)
    assert column(r, "finish_s") == [2.0, 3.0, 4.0]  # flex is unlisted too: ties go by arrival


@pytest.mark.parametrize("policy, params, message", [
    ("tiers", {"tiers": "a,b,a"}, "names a tier twice"),
    ("tiers", {"within": "lifo"}, "within must be one of fcfs, sjf, srpt"),
    ("tiers", {"reserve": "priority=0.7,standard=0.6"}, "reserves more than the whole batch"),
    ("tiers", {"reserve": "priority=x"}, "'priority' needs a number"),
    ("vtc", {"weights": "a=0"}, "'a' must be > 0"),
    ("vtc", {"weights": "a"}, "is not NAME=NUMBER"),
    ("drr", {"quantum": 0}, "quantum must be > 0"),
    ("edf", {"tier_ttft": "priority=-1"}, "must be > 0"),
])
def test_bad_params_are_clear_errors(policy, params, message):
    with pytest.raises(ServelabError, match=message):
        run(make_trace([0], [1], [1]), policy=policy, policy_params=params)


# -- edf ------------------------------------------------------------------------------------------
def test_edf_orders_by_first_token_deadline():
    trace = make_trace([0, 0.5, 0.5, 0.5], [1] * 4, [3, 1, 1, 1], ttft_slo_s=[None, 10.0, 2.0, 5.0])
    r = run(trace, policy="edf", max_num_seqs=1)
    assert column(r, "finish_s") == [3.0, 6.0, 4.0, 5.0]
    fcfs = run(trace, policy="sarathi", max_num_seqs=1)
    assert column(fcfs, "finish_s") == [3.0, 4.0, 5.0, 6.0]


def test_edf_tier_defaults_and_preemption():
    trace = make_trace([0, 0.5], [1, 1], [5, 1], tier=["flex", "priority"])
    params = {"tier_ttft": "priority=1,flex=100", "preempt": True}
    r = run(trace, policy="edf", policy_params=params, max_num_seqs=1)
    assert column(r, "finish_s") == [6.0, 2.0]


def test_drr_stretches_make_the_same_decisions_as_deciding_every_iteration(monkeypatch):
    """drr may let identical decode iterations run as one stretch until the tenant whose turn it is has
    spent its credit; with every time a power of two (exact float sums) the timeline is the one a
    decision at every iteration gives, with far fewer steps."""
    from helpers_engine import run as run_engine, synthetic

    from servelab.policies.fair import DeficitRoundRobin

    trace = synthetic(n=600, rate=8.0, tenants="a=3,b=1,c=1,d=1")
    runner = "linear:base=0.25,decode_seq=0.0078125,prefill_token=0.0009765625"
    for engine in ({"max_num_seqs": 16}, {"max_num_seqs": 64, "num_gpu_blocks": 400}):
        fast = run_engine(trace, policy="drr", runner=runner, **engine)
        with monkeypatch.context() as m:
            m.setattr(DeficitRoundRobin, "_repeat", lambda self, b, blocked: 1)
            every = run_engine(trace, policy="drr", runner=runner, **engine)
        assert fast.requests.equals(every.requests)
        assert fast.steps.num_rows < every.steps.num_rows, (fast.steps.num_rows, every.steps.num_rows)
