"""The contract every registered policy must keep, checked over the same workloads.

Every request ends finished (or unfinished with a horizon); token budget and max_num_seqs are
never exceeded; KV is never over-committed; each replica's clock only moves forward; two runs
of the same inputs are byte-identical.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import make_trace
from helpers_engine import run
from sampled_suites import cases

from servelab.policies.base import policy_class, policy_names
from servelab.replay import write_run

POLICIES = policy_names()
RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005,decode_context_token=0.000001"
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_gpu_blocks=64, block_size=16)


def workload(n=120, seed=1, tenants=("a", "b", "c"), tiers=("priority", "standard", "flex")):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    prompts = rng.integers(1, 300, n).tolist()
    outputs = rng.integers(1, 120, n).tolist()
    return make_trace(arrivals.tolist(), prompts, outputs,
                      tenant=[tenants[i % len(tenants)] for i in range(n)],
                      tier=[tiers[(i * 7) % len(tiers)] for i in range(n)])


def test_registry_has_the_classic_policies():
    assert {"static", "orca", "vllm-v0", "sarathi", "sjf", "srpt", "round-robin"} <= set(POLICIES)


def check_invariants(result, policy, engine=ENGINE):
    req = result.requests.to_pydict()
    steps = result.steps.to_pydict()
    uses_budget = getattr(policy_class(policy), "uses_token_budget", True)
    for i in range(result.steps.num_rows):
        batch = steps["batch_requests"][i]
        assert batch <= engine["max_num_seqs"]
        assert batch == steps["prefill_requests"][i] + steps["decode_requests"][i]
        tokens = steps["prefill_tokens"][i] + steps["decode_requests"][i]
        if uses_budget and batch > 1:
            assert tokens <= engine["max_num_batched_tokens"], (policy, i, tokens)
        assert 0 <= steps["kv_blocks_used"][i] <= steps["kv_blocks_total"][i]
        assert steps["duration_s"][i] > 0
    by_replica: dict[int, float] = {}
    for i in range(result.steps.num_rows):
        rep, start = steps["replica"][i], steps["start_s"][i]
        assert start >= by_replica.get(rep, 0.0) - 1e-12, "clock went backwards"
        by_replica[rep] = start + steps["duration_s"][i]
    for i, status in enumerate(req["status"]):
        if status == "finished":
            assert req["generated_tokens"][i] == req["output_tokens"][i]
            assert req["arrival_s"][i] <= req["first_scheduled_s"][i] <= req["first_token_s"][i] <= req["finish_s"][i]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_contract_drained(policy, preemption):
    result = run(workload(), policy=policy, runner=RUNNER, preemption=preemption,
                 kv_bytes_per_token=1024, **ENGINE)
    statuses = set(result.requests.column("status").to_pylist())
    assert statuses == {"finished"}, (policy, statuses)
    check_invariants(result, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_drained_with_async_scheduling(policy):
    """vLLM's async scheduling (arrivals seen one step later) keeps every policy's contract."""
    result = run(workload(), policy=policy, runner=RUNNER, async_scheduling=True, **ENGINE)
    assert set(result.requests.column("status").to_pylist()) == {"finished"}, policy
    check_invariants(result, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_horizon_keeps_every_request(policy):
    trace = workload()
    result = run(trace, policy=policy, runner=RUNNER, until_s=2.0, **ENGINE)
    assert result.requests.num_rows == trace.num_rows
    req = result.requests.to_pydict()
    assert set(req["status"]) <= {"finished", "unfinished"}
    assert "unfinished" in req["status"]
    for i, status in enumerate(req["status"]):
        if status == "finished":
            assert req["finish_s"][i] <= 2.0
        else:
            assert req["finish_s"][i] is None and req["generated_tokens"][i] < req["output_tokens"][i]
    check_invariants(result, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_byte_identical(policy, tmp_path):
    for name in ("a", "b"):
        result = run(workload(seed=3), policy=policy, runner=RUNNER, replicas=2, **ENGINE)
        result.meta["wall_time_s"] = 0.0
        write_run(result, tmp_path / name)
    for table in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes()
    assert pq.read_table(tmp_path / "a" / "requests.parquet").num_rows == 120


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_stretches_match_single_iterations(policy):
    """Advancing identical decode iterations in one event gives the same timeline as one by one."""
    trace = workload(n=60, seed=5)
    fast = run(trace, policy=policy, runner=RUNNER, **ENGINE)
    slow = run(trace, policy=policy, runner=RUNNER, stretch=False, **ENGINE)
    for col in ("first_token_s", "finish_s", "max_itl_s"):
        a, b = fast.requests.column(col).to_pylist(), slow.requests.column(col).to_pylist()
        assert [x is None for x in a] == [x is None for x in b], col
        pairs = [(x, y) for x, y in zip(a, b) if x is not None]
        assert [x for x, _ in pairs] == pytest.approx([y for _, y in pairs], rel=1e-9, abs=1e-9), col
    assert fast.steps.num_rows <= slow.steps.num_rows
    assert sum(fast.steps.column("num_iterations").to_pylist()) == slow.steps.num_rows


def test_vllm_v0_never_stretches_a_readmission_onto_a_cached_prompt():
    """vllm-v0 prefills apart from decodes; a request preempted by recompute and readmitted onto its fully
    cached prompt computes one token, which looked like a decode iteration to repeat as a stretch, though
    the next decision decodes every running request (seed 8 of this workload: stretched and one-by-one
    timelines differed before)."""
    trace = workload(n=60, seed=8)
    fast = run(trace, policy="vllm-v0", runner=RUNNER, **ENGINE)
    slow = run(trace, policy="vllm-v0", runner=RUNNER, stretch=False, **ENGINE)
    assert sum(fast.requests.column("num_preemptions").to_pylist()) > 0
    for col in ("first_token_s", "finish_s"):
        assert fast.requests.column(col).to_pylist() == pytest.approx(slow.requests.column(col).to_pylist(),
                                                                       rel=1e-9, abs=1e-9), col


@pytest.mark.parametrize("policy", POLICIES)
def test_contract_stretches_match_single_iterations_with_async_scheduling(policy):
    """With async scheduling the decision at the end of each single iteration sees requests it does not know
    of yet, which a stretch (cut one boundary after they come) never decides with: a policy must not act on
    them (drr's credit turns and contention, vtc's lifts, tiers' and srpt's preemptions), or one iteration at
    a time gives another timeline."""
    trace = workload(n=60, seed=5)
    fast = run(trace, policy=policy, runner=RUNNER, async_scheduling=True, **ENGINE)
    slow = run(trace, policy=policy, runner=RUNNER, stretch=False, async_scheduling=True, **ENGINE)
    for col in ("first_scheduled_s", "first_token_s", "finish_s"):
        a, b = fast.requests.column(col).to_pylist(), slow.requests.column(col).to_pylist()
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9), col


def assert_same_timeline(fast, slow, case, cols=("first_scheduled_s", "first_token_s", "finish_s")) -> None:
    """A stretched replay's per-request times equal the one-iteration-at-a-time replay's (within 1e-9 s;
    the same requests unfinished)."""
    for col in cols:
        a, b = fast.requests.column(col).to_pylist(), slow.requests.column(col).to_pylist()
        assert [x is None for x in a] == [y is None for y in b], (*case, col)
        pairs = [(x, y) for x, y in zip(a, b) if x is not None]
        assert [x for x, _ in pairs] == pytest.approx([y for _, y in pairs], rel=0, abs=1e-9), (*case, col)


STRETCH_SEEDS = range(30)


@pytest.mark.parametrize("policy", POLICIES)
def test_stretches_match_single_iterations_over_seeds(policy):
    """A decode stretch repeats a decision only while the decisions one iteration at a time would repeat
    it, for every policy, on the contract workload's seeds 0..29, with and without async scheduling. What
    a stretch advances at once can change the next decision: vtc's per-tenant counters reorder the heads
    of the waiting queues (policies/fair.py ``_repeat``); fewer free KV blocks make a tier's waiting
    request preempt (BatchBuilder.preempt_to_admit); a blocked request's prefix-cache hit shrinks as the
    decodes' growth evicts blocks, and with it what it needs (BatchBuilder._keep_cached). A developer's
    run checks a fixed sample of the 60 (seed, async) cases of each policy; SERVELAB_FULL_SUITES=1, all."""
    combos = [(seed, async_scheduling) for seed in STRETCH_SEEDS for async_scheduling in (False, True)]
    for seed, async_scheduling in cases(combos, keep=12, key=f"stretch-seeds:{policy}"):
        trace = workload(n=60, seed=seed)
        settings = dict(policy=policy, runner=RUNNER, async_scheduling=async_scheduling, **ENGINE)
        fast = run(trace, **settings)
        slow = run(trace, stretch=False, **settings)
        assert_same_timeline(fast, slow, (seed, async_scheduling),
                             cols=("first_scheduled_s", "first_token_s", "finish_s", "max_itl_s"))


@pytest.mark.parametrize("router", ["least-outstanding", "power-of-two", "session", "least-kv", "weighted"])
def test_stretches_match_single_iterations_across_replicas(router):
    """A router that reads a replica's outstanding tokens (or KV use) at an arrival sees them as one iteration
    at a time has them: a decode stretch in flight subtracts what it produced, and grows its KV, only when it
    completes, so the iterations of it that ended before the arrival are counted for the router's look
    (engine.py ``route_at``). Before, it saw every busy replica as of its stretch's start, and 2 or 3
    replicas under least-outstanding (or least-kv) gave another timeline than one iteration at a time on
    every seed."""
    combos = [(seed, replicas, policy) for seed in range(10) for replicas in (2, 3)
              for policy in ("sarathi", "vtc", "srpt")]
    for seed, replicas, policy in cases(combos, keep=8, key=f"stretch-replicas:{router}"):
        trace = workload(n=60, seed=seed)
        settings = dict(policy=policy, runner=RUNNER, replicas=replicas, router=router,
                        async_scheduling=seed % 2 == 1, **ENGINE)
        fast = run(trace, **settings)
        slow = run(trace, stretch=False, **settings)
        assert_same_timeline(fast, slow, (seed, replicas, policy))


@pytest.mark.parametrize("pause", ["tier=flex,kv=0.25,resume=0.15", "tier=flex,waiting=2,resume=1"])
def test_stretches_match_single_iterations_with_a_pause_rule(pause):
    """A pause rule checks a replica's load before each decision, so a decode stretch ends where the check
    would act (platform/hooks.py ``stretch_min_free``): a tier not paused is paused at the first boundary
    whose KV share (which the decodes' growth raises) passes ``above``; a paused tier resumes at the first
    boundary if the decision that paused it already freed enough (its preemptions). Under async scheduling
    an arrival is counted by a waiting-count rule before the policy sees it, so it cuts the stretch at the
    first boundary after it. Before, pausing on the KV share differed from one iteration at a time on most
    seeds, and on the waiting count with async scheduling."""
    combos = [(seed, async_scheduling, policy) for seed in range(8) for async_scheduling in (False, True)
              for policy in ("sarathi", "vtc", "srpt", "tiers")]
    for seed, async_scheduling, policy in cases(combos, keep=16, key=f"stretch-pause:{pause}"):
        trace = workload(n=60, seed=seed)
        settings = dict(policy=policy, runner=RUNNER, async_scheduling=async_scheduling, pause=pause, **ENGINE)
        fast = run(trace, **settings)
        slow = run(trace, stretch=False, **settings)
        assert_same_timeline(fast, slow, (seed, async_scheduling, policy))
