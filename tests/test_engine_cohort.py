"""The decode cohort (replay/core/cohort.py) is an optimisation only: its aggregates equal a per-request
count, and a replay with cohorts is byte-identical to one that visits every request."""

from __future__ import annotations

import random

import pytest

from helpers_engine import NoStretch, synthetic
from sampled_suites import size
from servelab.policies.orca import Orca
from servelab.policies.sarathi import Sarathi
from servelab.policies.srpt import ShortestJobFirst, ShortestRemainingFirst
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.batch import UNLIMITED, BatchBuilder
from servelab.replay.core.cohort import DecodeCohort
from servelab.replay.config import EngineConfig as Cfg
from servelab.replay.core.kv.manager import KVManager
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request
from servelab.runners.base import make_runner


def _decoder(i: int, prompt: int, generated: int, output: int) -> Request:
    req = Request(i, 0.0, prompt, output, index=i)
    req.num_generated_tokens = generated
    req.num_computed_tokens = prompt + generated - 1
    req.kv_blocks = -(-req.num_computed_tokens // 16)
    req.last_token_s = 0.0
    req.admitted_seq = i
    return req


@pytest.mark.parametrize("seed", range(5))
def test_aggregates_equal_a_per_request_count(seed):
    rng = random.Random(seed)
    replica = Replica(0, Cfg(), KVManager(10**9, 16), policy=None)
    cohort = DecodeCohort(replica, UNLIMITED, UNLIMITED)
    members: list[Request] = []
    shadow: dict[int, list] = {}  # request index -> [computed, generated, blocks, largest gap since joining]
    t = 0.0
    for i in range(60):
        req = _decoder(i, rng.randint(1, 200), rng.randint(1, 5), rng.randint(6, 90))
        req.last_token_s = t
        cohort.outside.append(req)  # admitted (running, not yet a member), as the engine does
        cohort.join(req)
        members.append(req)
        shadow[i] = [req.num_computed_tokens, req.num_generated_tokens, req.kv_blocks, None]
        for j in range(1, 40):  # what the next j iterations would add, before running them
            assert cohort.blocks_added(j) == sum(-(-(c + j) // 16) - b for c, _, b, _ in shadow.values())
        next_blocks, decode_ctx, decodes_left = cohort.next_iteration()
        assert next_blocks == cohort.blocks_added(1)
        assert decode_ctx == sum(c + 1 for c, _, _, _ in shadow.values())
        assert decodes_left == min(m.output_tokens - shadow[m.index][1] for m in members)
        j = rng.randint(1, decodes_left)
        gap = rng.uniform(0.01, 1.0)
        t += 1.0
        done = cohort.advance(j, gap, t)
        for m in members:
            c, g, _, worst = shadow[m.index]
            shadow[m.index] = [c + j, g + j, -(-(c + j) // 16), gap if worst is None else max(worst, gap)]
        assert [m.index for m in done] == sorted(m.index for m in members if shadow[m.index][1] >= m.output_tokens)
        for m in done:  # materialised: the true counters, the largest gap logged since it joined
            c, g, blocks, worst = shadow.pop(m.index)
            assert (m.num_computed_tokens, m.num_generated_tokens, m.kv_blocks, m.max_itl_s) == (c, g, blocks, worst)
            assert m.last_token_s == t and m.aggregate_mark is None
            members.remove(m)
        assert cohort.n == len(members)
    cohort.dissolve()
    for m in members:
        c, g, blocks, worst = shadow[m.index]
        assert (m.num_computed_tokens, m.num_generated_tokens, m.kv_blocks, m.max_itl_s) == (c, g, blocks, worst)
        assert m.aggregate_mark is None and m.last_token_s == t


def test_max_itl_is_the_largest_gap_since_joining():
    replica = Replica(0, Cfg(), KVManager(10**6, 16), policy=None)
    cohort = DecodeCohort(replica, UNLIMITED, UNLIMITED)
    early, late = _decoder(0, 10, 1, 100), _decoder(1, 10, 1, 100)
    cohort.outside.extend((early, late))
    cohort.join(early)
    cohort.advance(3, 0.5, 1.0)
    cohort.advance(2, 0.2, 2.0)
    late.last_token_s = 2.0
    cohort.join(late)
    cohort.advance(1, 0.3, 3.0)
    cohort.advance(1, 0.1, 4.0)
    cohort.dissolve()
    assert early.max_itl_s == 0.5 and late.max_itl_s == 0.3
    assert early.num_generated_tokens == 1 + 7 and late.num_generated_tokens == 1 + 2
    assert early.last_token_s == late.last_token_s == 4.0


CASES = {
    "plenty of KV, 2 replicas": dict(engine=dict(replicas=2)),
    "KV pressure, recompute": dict(engine=dict(num_gpu_blocks=700)),
    "KV pressure, swap": dict(engine=dict(num_gpu_blocks=700, preemption="swap", swap_space_gb=0.5)),
    "reserve allocation": dict(engine=dict(num_gpu_blocks=900, kv_allocation="reserve")),
    "small token budget": dict(engine=dict(max_num_batched_tokens=200, num_gpu_blocks=4000)),
    "seq cap and chunk cap": dict(engine=dict(max_num_seqs=12), params=dict(long_prefill_threshold=256)),
    "horizon": dict(engine=dict(replicas=2, until_s=20.0)),
    "sessions": dict(engine=dict(replicas=2, router="least-outstanding"), trace=dict(turns=4, think_s=2.0)),
    "one iteration at a time": dict(engine=dict(num_gpu_blocks=1500), stretch=False),
    "block size 1": dict(engine=dict(block_size=1, num_gpu_blocks=12000)),
    "quotas, retries and a queue cap": dict(
        engine=dict(quota=("tenant=tenant-0:rpm=300",), retries=2, retry_backoff_s=1.0, queue_cap=40),
        trace=dict(tenants=(("tenant-0", 2.0), ("tenant-1", 1.0)))),
}


def _shape(spec: dict) -> dict:
    """The synthetic trace of a case: 1,000 requests under SERVELAB_FULL_SUITES=1 (CI), 400 in a developer's run."""
    return {"n": size(1000, 400), **spec.get("trace", {})}


# sjf/srpt sort their waiting queue at every decision: the slow pressure cases only run for the others
LENGTH_CASES = ["plenty of KV, 2 replicas", "KV pressure, swap", "seq cap and chunk cap", "horizon", "sessions"]
PAIRS = [(c, p) for p in ("sarathi", "orca") for c in CASES] + [(c, p) for p in ("srpt", "sjf") for c in LENGTH_CASES]


@pytest.mark.parametrize(("case", "policy"), PAIRS)
@pytest.mark.sampled(keep=6)
def test_replay_with_cohorts_is_byte_identical(case, policy, monkeypatch):
    spec = CASES[case]
    params = spec.get("params", {}) if policy == "sarathi" else {}
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy=policy, policy_params=params)
    trace = synthetic(**_shape(spec))
    joins = []
    original_join = DecodeCohort.join
    monkeypatch.setattr(DecodeCohort, "join", lambda self, req: (joins.append(1), original_join(self, req)))

    def run():
        runner = make_runner(config.runner, model=config.model, gpu=config.gpu, tp=config.tp,
                             block_size=config.engine.block_size)
        return replay(trace, config, runner=runner if spec.get("stretch", True) else NoStretch(runner))

    with_cohort = run()
    assert joins, "the cohort was never used: the comparison would prove nothing"
    monkeypatch.setattr(Sarathi, "reads_running", None)
    monkeypatch.setattr(Orca, "reads_running", None)
    monkeypatch.setattr(ShortestJobFirst, "reads_running", None)
    monkeypatch.setattr(ShortestRemainingFirst, "reads_running", None)
    joins.clear()
    without = run()
    assert not joins
    assert with_cohort.requests.equals(without.requests)
    assert with_cohort.steps.equals(without.steps)
    assert with_cohort.meta["counts"] == without.meta["counts"]


def same_without_cohort(trace, config, policy_cls, monkeypatch, check_first=None, watch: str = "join"):
    """Replay with cohorts (it must call ``DecodeCohort.<watch>``: ``join`` uses the cohort, ``remove``
    rotates a member out of it), then with ``policy_cls.reads_running`` off (it must call it never):
    requests, steps and counts byte-identical. ``check_first`` runs between the two replays. Returns
    the replay with cohorts."""
    calls = []
    original = getattr(DecodeCohort, watch)
    monkeypatch.setattr(DecodeCohort, watch, lambda self, req: (calls.append(1), original(self, req)))
    with_cohort = replay(trace, config)
    assert calls, f"DecodeCohort.{watch} was never called: the comparison would prove nothing"
    if check_first is not None:
        check_first()
    monkeypatch.setattr(policy_cls, "reads_running", None)
    calls.clear()
    without = replay(trace, config)
    assert not calls
    assert with_cohort.requests.equals(without.requests)
    assert with_cohort.steps.equals(without.steps)
    assert with_cohort.meta["counts"] == without.meta["counts"]
    return with_cohort


FAIR_CASES = ["plenty of KV, 2 replicas", "KV pressure, recompute", "small token budget", "horizon", "sessions",
              "quotas, retries and a queue cap"]


@pytest.mark.parametrize("policy", ["vtc", "drr"])
@pytest.mark.parametrize("case", FAIR_CASES)
@pytest.mark.sampled(keep=4)
def test_fair_sharing_with_cohorts_is_byte_identical(case, policy, monkeypatch):
    """vtc and drr keep decodes in a cohort counted per class (cohort_group): service is charged per
    class from the counts, and a replay is byte-identical to one that visits every request."""
    from servelab.policies.fair import _FairShare

    spec = CASES[case]
    shape = _shape(spec)
    shape.setdefault("tenants", (("a", 3.0), ("b", 1.0), ("c", 1.0)))
    trace = synthetic(**shape)
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy=policy)
    same_without_cohort(trace, config, _FairShare, monkeypatch)


@pytest.mark.parametrize("policy", ["vtc", "drr"])
@pytest.mark.parametrize("tenants", [None, (("a", 3.0), ("b", 1.0), ("c", 1.0))])
def test_fair_sharing_without_the_journal_is_byte_identical_with_cohorts(policy, tenants, monkeypatch):
    """Without the journal a recomputed request starts over and makes again tokens it was already
    charged for: ``on_step`` charges only tokens past its high-water mark (``charged_out``), and the
    cohort's per-class count cannot, so such a request stays outside until past it
    (``ReadsRunning.may_bulk``). drr's steps differed here before (7,519 with cohorts against 7,515)."""
    from servelab.policies.fair import _FairShare

    refused = []
    original = _FairShare._may_bulk
    monkeypatch.setattr(_FairShare, "_may_bulk",
                        lambda self, req: (ok := original(self, req), ok or refused.append(req.index))[0])
    shape = {"n": 300, "rate": 20.0, "prompt": "lognormal:400:1.0", "output": "lognormal:80:1.0"}
    if tenants is not None:
        shape["tenants"] = tenants
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=300, journal=False), policy=policy)
    same_without_cohort(synthetic(**shape), config, _FairShare, monkeypatch,
                        check_first=lambda: assert_some(refused, "no restarted request was kept out of the cohort"))


def assert_some(seen: list, message: str) -> None:
    assert seen, message


RR_ONLY = {  # without the journal a turn ends by preemption only if the request is swapped out (a
    # host pool that holds a few requests: members' blocks are counted while they are in the cohort)
    "KV pressure, small swap, no journal": dict(engine=dict(num_gpu_blocks=700, preemption="swap",
                                                            swap_space_gb=0.05, journal=False)),
}
RR_CASES = ["plenty of KV, 2 replicas", "KV pressure, recompute", "KV pressure, swap", "small token budget",
            "seq cap and chunk cap", "horizon", "sessions", *RR_ONLY]


@pytest.mark.parametrize("quantum", [3, 16])
@pytest.mark.parametrize("case", RR_CASES)
@pytest.mark.sampled(keep=2)
def test_round_robin_with_cohorts_is_byte_identical(case, quantum, monkeypatch):
    """round-robin preempts members of the cohort when their turn ends (``DecodeCohort.remove``, via
    ``BatchBuilder.preempt``) and reads their progress through ``BatchBuilder.generated``: a replay
    is byte-identical to one that keeps every request's counters current."""
    from servelab.policies.round_robin import RoundRobin

    spec = CASES[case] if case in CASES else RR_ONLY[case]
    engine = dict(spec["engine"])
    engine.setdefault("max_num_seqs", 8)  # demand above the seat count: turns end while others wait
    config = ReplayConfig(engine=EngineConfig(**engine), policy="round-robin", policy_params={"quantum": quantum})
    trace = synthetic(**_shape(spec))
    with_cohort = same_without_cohort(trace, config, RoundRobin, monkeypatch, watch="remove")
    assert sum(with_cohort.requests.column("num_preemptions").to_pylist()) > 0


TIERS_CASES = {  # (policy params, trace tiers): one tier (the cohort every decision), or several
    "one tier": ({}, ("standard",) * 3),
    "one tier, reserve": ({"reserve": "standard=0.2"}, ("standard",) * 3),
    "three tiers": ({}, ("priority", "standard", "flex")),
    "three tiers, preempt": ({"preempt": True}, ("priority", "standard", "flex")),
    "three tiers, reserve, promotion": ({"reserve": "flex=0.25", "max_wait_s": 5.0}, ("priority", "standard", "flex")),
}


@pytest.mark.parametrize("tiers", list(TIERS_CASES))
@pytest.mark.parametrize("case", ["plenty of KV, 2 replicas", "KV pressure, recompute", "KV pressure, swap",
                                  "small token budget", "seq cap and chunk cap", "sessions"])
@pytest.mark.sampled(keep=4)
def test_tiers_with_cohorts_is_byte_identical(case, tiers, monkeypatch):
    """tiers walks running requests in tier order, not decodes first: the builder takes the cohort
    whole only when its members come first in that order anyway (``DecodeCohort.leads``), and the
    policy dissolves it when several tiers run (``BatchBuilder.running``)."""
    import pyarrow as pa

    from servelab.policies.tiers import Tiers

    params, names = TIERS_CASES[tiers]
    spec = CASES[case]
    trace = synthetic(**_shape(spec))
    trace = trace.append_column("tier", pa.array([names[i % 3] for i in range(trace.num_rows)]))
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy="tiers", policy_params=params)
    led = []  # what DecodeCohort.leads answered: False = the walk dissolved the cohort
    original_leads = DecodeCohort.leads
    monkeypatch.setattr(DecodeCohort, "leads", lambda self, skip: led.append(original_leads(self, skip)) or led[-1])

    def both_answers() -> None:
        if (case, tiers) == ("plenty of KV, 2 replicas", "one tier, reserve"):  # reserved chunks come before members
            assert True in led and False in led

    same_without_cohort(trace, config, Tiers, monkeypatch, both_answers)


@pytest.mark.parametrize("variant", ["no SLOs", "SLOs from the middle on", "SLOs from the middle on, preempt"])
@pytest.mark.parametrize("case", ["plenty of KV, 2 replicas", "KV pressure, recompute", "small token budget",
                                  "seq cap and chunk cap"])
@pytest.mark.sampled(keep=2)
def test_edf_with_cohorts_is_byte_identical(case, variant, monkeypatch):
    """edf without SLOs walks running requests in admission order (the cohort serves, as for
    `tiers`); when the first request with an SLO arrives it sorts them by deadline and gives the
    cohort up for good (``BatchBuilder.running(for_good=True)``)."""
    import pyarrow as pa

    from servelab.policies.edf import EarliestDeadlineFirst

    spec = CASES[case]
    trace = synthetic(**_shape(spec))
    params = {}
    if variant != "no SLOs":
        half = trace.num_rows // 2
        trace = trace.append_column("ttft_slo_s", pa.array([None] * half + [2.0] * (trace.num_rows - half), pa.float64()))
        trace = trace.append_column("tpot_slo_s", pa.array([None] * half + [0.05] * (trace.num_rows - half), pa.float64()))
        if "preempt" in variant:
            params = {"preempt": True}
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy="edf", policy_params=params)
    given_up = []  # replicas whose cohort edf dropped when SLOs began
    original_running = BatchBuilder.running
    monkeypatch.setattr(BatchBuilder, "running", lambda self, for_good=False: (
        given_up.append(self.replica.id) if for_good and self.replica.aggregate is not None else None,
        original_running(self, for_good))[1])

    def given_up_with_slos() -> None:
        assert bool(given_up) == (variant != "no SLOs")

    same_without_cohort(trace, config, EarliestDeadlineFirst, monkeypatch, given_up_with_slos)


OVERLOAD_CASES = ["plenty of KV, 2 replicas", "KV pressure, recompute", "KV pressure, swap", "reserve allocation",
                  "small token budget", "horizon", "sessions", "quotas, retries and a queue cap"]


@pytest.mark.parametrize("case", OVERLOAD_CASES)
@pytest.mark.sampled(keep=4)
def test_vllm_v0_with_cohorts_is_byte_identical(case, monkeypatch):
    """vllm-v0's decode iterations take the cohort whole; its prefill iterations leave it idle, and a
    request prefilled there joins only after its next token (its first gap is shorter than the members')."""
    from servelab.policies.vllm_v0 import VllmV0

    spec = CASES[case]
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy="vllm-v0")
    same_without_cohort(synthetic(**_shape(spec)), config, VllmV0, monkeypatch)


@pytest.mark.parametrize("case", [c for c in OVERLOAD_CASES if c != "sessions"])  # (sessions: below)
@pytest.mark.parametrize("params", [{}, {"w_in": 2, "w_out": 3}, {"max_wait_s": 1.0}])
@pytest.mark.sampled(keep=6)
def test_las_with_cohorts_is_byte_identical(case, params, monkeypatch):
    """las keeps single-call tasks' decodes in the cohort and charges their tokens when they leave it;
    the same service (whole-number weights), so the same decisions as charging them step by step."""
    from servelab.policies.las import LeastAttainedService

    spec = CASES[case]
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy="las", policy_params=params)
    same_without_cohort(synthetic(**_shape(spec)), config, LeastAttainedService, monkeypatch)


def test_las_keeps_calls_of_multi_call_tasks_out_of_the_cohort(monkeypatch):
    """A task's service is read while one of its calls waits and another runs: a call with a session
    never decodes in the cohort (its tokens are charged step by step)."""
    members = []
    original_join = DecodeCohort.join
    monkeypatch.setattr(DecodeCohort, "join", lambda self, req: (members.append(req), original_join(self, req)))
    trace = synthetic(n=600, turns=4, think_s=2.0)
    replay(trace, ReplayConfig(engine=EngineConfig(), policy="las"))
    assert trace.column("session_id").null_count < trace.num_rows
    assert all(req.session_id is None for req in members)


def test_las_with_fractional_weights_walks_every_request(monkeypatch):
    """Charging a cohort member's tokens in one sum is exact only for whole-number weights: with
    fractional ones las keeps no cohort."""
    joins = []
    original_join = DecodeCohort.join
    monkeypatch.setattr(DecodeCohort, "join", lambda self, req: (joins.append(1), original_join(self, req)))
    config = ReplayConfig(engine=EngineConfig(), policy="las", policy_params={"w_out": 0.3})
    replay(synthetic(n=200), config)
    assert not joins
    replay(synthetic(n=200), ReplayConfig(engine=EngineConfig(), policy="las"))
    assert joins
