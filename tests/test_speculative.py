"""Speculative decoding (replay/core/speculative.py, runners/speculative.py): the acceptance golden, the
token budget and KV the drafts take, the policy contract with speculation on, determinism, pricing."""

from __future__ import annotations

import math
import random

import pyarrow.parquet as pq
import pytest
from conftest import make_trace
from helpers_engine import run
from test_policy_contract import ENGINE, RUNNER, check_invariants, workload

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.common.errors import ServelabError
from servelab.policies.base import policy_class, policy_names
from servelab.replay.core.protocols import StepPlan, StepShape
from servelab.replay.core.speculative import accepted_length, expected_tokens_per_step, parse_speculative_config
from servelab.runners.base import make_runner
from servelab.runners.speculative import SpeculativeRunner, speculative_runner

LINEAR = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005,decode_context_token=0.000001"


class Recording(SpeculativeRunner):
    """A linear runner with n-gram speculation that keeps every shape the engine handed it."""

    def __init__(self, spec: str = LINEAR):
        super().__init__(make_runner(spec), "ngram", 0)
        self.shapes: list[StepShape] = []

    def step_time(self, plan):
        self.shapes.append(plan.shape)
        return super().step_time(plan)


def spec_run(trace, runner=None, policy="sarathi", **engine):
    engine.setdefault("num_gpu_blocks", 100_000)
    cfg = ReplayConfig(engine=EngineConfig(**engine), policy=policy, runner=LINEAR)
    return replay(trace, cfg, runner=runner if runner is not None else make_runner(LINEAR))


# -- the acceptance golden ----------------------------------------------------------------------------
def test_closed_form_value():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0


@pytest.mark.parametrize("rate,k", [(0.8, 4), (0.5, 2), (0.9, 7), (0.3, 1)])
def test_sampler_mean_matches_closed_form(rate, k):
    rng = random.Random(7)
    steps = 10_000
    tokens = sum(1 + accepted_length(1.0 - rng.random(), rate, k) for _ in range(steps))
    assert tokens / steps == pytest.approx(expected_tokens_per_step(rate, k), rel=0.02)


@pytest.mark.parametrize("rate,k", [(0.8, 4), (0.6, 3)])
def test_engine_mean_tokens_per_step_golden(rate, k):
    """One request decoding alone for ~10,000 steps: output tokens per decode step, counted from the
    steps table (not from the spec counters), approach (1 - a^(k+1)) / (1 - a) within 2%."""
    expected = expected_tokens_per_step(rate, k)
    output = int(10_000 * expected) + 1
    trace = make_trace([0.0], [64], [output])
    result = spec_run(trace, spec_method="ngram", spec_k=k, spec_acceptance=str(rate), max_num_batched_tokens=4096)
    steps = result.steps.to_pydict()
    decode_steps = sum(n for n, d, p in zip(steps["num_iterations"], steps["decode_requests"], steps["prefill_requests"])
                       if d == 1 and p == 0)
    assert 9_500 < decode_steps < 10_500
    # the last step may be cut by the trace's length: it counts as a step with fewer tokens (< 0.01%)
    assert (output - 1) / decode_steps == pytest.approx(expected, rel=0.02)
    req = result.requests.to_pylist()[0]
    assert req["status"] == "finished" and req["generated_tokens"] == output
    assert req["spec_num_drafts"] == decode_steps
    assert req["spec_num_draft_tokens"] == k * decode_steps
    assert req["spec_mean_acceptance_length"] == pytest.approx(expected, rel=0.02)
    assert req["spec_acceptance_rate"] == pytest.approx((expected - 1) / k, rel=0.03)
    assert result.meta["spec_decode"]["num_drafts"] == decode_steps


@pytest.mark.parametrize("rate,per_step", [("0", 1), ("1", 5)])
def test_extreme_rates_are_exact(rate, per_step):
    trace = make_trace([0.0], [16], [401])
    result = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance=rate)
    steps = result.steps.to_pydict()
    decodes = sum(n for n, p in zip(steps["num_iterations"], steps["prefill_requests"]) if p == 0)
    assert decodes == 400 // per_step


# -- the token budget and the KV drafts take ---------------------------------------------------------
def test_drafts_count_against_the_token_budget_and_are_trimmed():
    """vLLM v1: a decode is scheduled for 1 + k tokens; the last one the budget reaches gets what is left."""
    trace = make_trace([0.0, 0.0, 0.0], [4, 4, 4], [60, 60, 60])
    rec = Recording()
    spec_run(trace, runner=rec, spec_method="ngram", spec_k=4, spec_acceptance="0.5", max_num_batched_tokens=12)
    decode_shapes = [s for s in rec.shapes if s.decode_seqs and not s.prefill_seqs]
    assert decode_shapes
    for s in rec.shapes:
        assert s.prefill_tokens + s.decode_seqs + s.spec_tokens <= 12
    # three decodes: 1 + 4, 1 + 4, then 1 + 1 (the budget's last 2 tokens)
    assert any(s.decode_seqs == 3 and s.spec_tokens == 9 for s in decode_shapes)
    # without speculation the same trace schedules one token per decode
    rec_off = Recording()
    spec_run(trace, runner=rec_off, max_num_batched_tokens=12)
    assert all(s.spec_tokens == 0 for s in rec_off.shapes)


def test_budget_limits_how_many_decodes_a_step_takes():
    trace = make_trace([0.0] * 4, [4] * 4, [30] * 4, max_output_tokens=[100] * 4)
    rec = Recording()
    spec_run(trace, runner=rec, spec_method="ngram", spec_k=4, spec_acceptance="0", max_num_batched_tokens=10)
    assert max(s.decode_seqs for s in rec.shapes) == 2  # 5 + 5 tokens fill the budget


def test_kv_blocks_cover_the_proposed_tokens():
    """With acceptance 0 each decode step advances one token, and the request holds KV blocks for its
    KV so far plus the token and the k drafts scheduled: ceil((c + 1 + k) / block_size), the slots of
    rejected drafts being written again by the next step."""
    bs, k, prompt = 4, 4, 4
    trace = make_trace([0.0], [prompt], [40])
    on = spec_run(trace, spec_method="ngram", spec_k=k, spec_acceptance="0", block_size=bs).steps.to_pydict()
    used = on["kv_blocks_used"]
    assert on["prefill_requests"][0] == 1 and used[0] == 1
    for j in range(1, len(used)):  # decode step j: computed c = prompt + j - 1 before it
        c = prompt + j - 1
        assert used[j] == math.ceil((c + 1 + k) / bs), j  # (drafts past the last token too, as vLLM's)
    assert sum(used[j] > math.ceil((prompt + j) / bs) for j in range(1, len(used))) >= 30  # more than without drafts


def test_drafts_preempt_when_their_kv_does_not_fit():
    """Two requests of at most 24 tokens (6 blocks of 4) fit 12 blocks without speculation; with 4 drafts
    each may hold 7 blocks near its end (max_output_tokens 40 leaves room for drafts), so one is preempted."""
    trace = make_trace([0.0, 0.0], [4, 4], [20, 20], max_output_tokens=[40, 40])
    kw = dict(block_size=4, num_gpu_blocks=12)
    off = spec_run(trace, **kw).requests.to_pydict()
    on = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance="0", **kw).requests.to_pydict()
    assert sum(off["num_preemptions"]) == 0
    assert set(on["status"]) == {"finished"} and sum(on["num_preemptions"]) >= 1


def test_a_request_alone_drops_its_drafts_rather_than_its_place():
    """A request that fits the cache alone keeps fitting: when its drafts' slots do not fit and there is
    nobody else to preempt, it decodes without drafts that step."""
    trace = make_trace([0.0], [4], [20])
    on = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance="0", block_size=4, num_gpu_blocks=6)
    assert on.requests.column("status").to_pylist() == ["finished"]
    assert max(on.steps.column("kv_blocks_used").to_pylist()) == 6


# -- trace column, options --------------------------------------------------------------------------------
def test_trace_column_sets_each_requests_rate():
    trace = make_trace([0.0, 0.0], [16, 16], [3001, 3001], spec_acceptance=[0.9, None])
    result = spec_run(trace, spec_method="ngram", spec_k=3, spec_acceptance="0.2")
    rows = result.requests.to_pylist()
    assert [r["spec_acceptance"] for r in rows] == [0.9, 0.2]
    assert rows[0]["spec_mean_acceptance_length"] == pytest.approx(expected_tokens_per_step(0.9, 3), rel=0.03)
    assert rows[1]["spec_mean_acceptance_length"] == pytest.approx(expected_tokens_per_step(0.2, 3), rel=0.03)


def test_trace_column_out_of_range_names_column_and_row(tmp_path):
    from servelab.common.errors import InputError
    from servelab.traces.schema import validate

    trace = make_trace([0.0, 1.0], [16, 16], [4, 4], spec_acceptance=[0.5, 1.5])
    with pytest.raises(InputError) as err:
        validate(trace, "t.parquet")
    assert "spec_acceptance" in str(err.value) and "row 2" in str(err.value)


def test_workload_distribution_draws_per_request_and_is_seeded():
    trace = make_trace([0.0] * 20, [16] * 20, [50] * 20)
    a = spec_run(trace, spec_method="ngram", spec_acceptance="uniform:0.2,0.9").requests.column("spec_acceptance")
    b = spec_run(trace, spec_method="ngram", spec_acceptance="uniform:0.2,0.9").requests.column("spec_acceptance")
    assert a.to_pylist() == b.to_pylist()
    values = a.to_pylist()
    assert len(set(values)) == 20 and all(0.2 <= v <= 0.9 for v in values)
    c = spec_run(trace, spec_method="ngram", spec_acceptance="uniform:0.2,0.9", seed=1).requests.column("spec_acceptance")
    assert c.to_pylist() != values


def test_speculative_config_json_mirrors_vllm():
    cfg = EngineConfig(speculative_config='{"method": "eagle", "num_speculative_tokens": 5}')
    assert (cfg.spec_method, cfg.spec_k) == ("eagle", 5)
    cfg = EngineConfig(speculative_config='{"model": "llama-3.2-1b", "num_speculative_tokens": 2}')
    assert (cfg.spec_method, cfg.spec_k, cfg.spec_draft_model) == ("draft_model", 2, "llama-3.2-1b")
    assert EngineConfig(speculative_config='{"method": "deepseek_mtp", "num_speculative_tokens": 1}').spec_method == "mtp"
    assert parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 3}')["spec_method"] == "ngram"
    # a run.json's config holds both the JSON and the fields it set: it loads again
    again = EngineConfig(speculative_config='{"method": "deepseek_mtp", "num_speculative_tokens": 2}',
                         spec_method="mtp", spec_k=2)
    assert (again.spec_method, again.spec_k) == ("mtp", 2)


@pytest.mark.parametrize("bad,message", [
    (dict(spec_method="medusa2"), "spec_method must be one of"),
    (dict(spec_method="ngram", spec_k=0), "spec_k"),
    (dict(spec_method="ngram", spec_acceptance="1.2"), "spec_acceptance"),
    (dict(spec_method="ngram", spec_acceptance="beta:0,1"), "beta"),
    (dict(spec_method="eagle", spec_draft_model="llama-3.2-1b"), "spec_draft_model"),
    (dict(speculative_config='{"method": "eagle"}'), "num_speculative_tokens"),
    (dict(speculative_config='{"method": "eagle", "num_speculative_tokens": 2, "temp": 1}'), "unknown key 'temp'"),
    (dict(speculative_config="{eagle"), "not JSON"),
    (dict(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}', spec_k=5), "disagrees"),
    (dict(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}', spec_method="ngram"), "disagrees"),
])
def test_bad_options_are_refused(bad, message):
    with pytest.raises(ServelabError, match=message):
        EngineConfig(**bad)


# -- the policy contract with speculation on ----------------------------------------------------------------
@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_policy_contract_with_speculation(policy, preemption):
    rec = Recording(RUNNER)
    cfg = ReplayConfig(engine=EngineConfig(preemption=preemption, kv_bytes_per_token=1024, spec_method="ngram",
                                           spec_k=3, spec_acceptance="uniform:0.3,0.9", **ENGINE),
                       policy=policy, runner=RUNNER)
    result = replay(workload(), cfg, runner=rec)
    assert set(result.requests.column("status").to_pylist()) == {"finished"}, policy
    check_invariants(result, policy)
    if policy_class(policy).uses_token_budget:
        for s in rec.shapes:
            if s.prefill_seqs + s.decode_seqs > 1:
                assert s.prefill_tokens + s.decode_seqs + s.spec_tokens <= ENGINE["max_num_batched_tokens"], policy
    assert sum(result.requests.column("spec_num_accepted_tokens").to_pylist()) > 0


@pytest.mark.parametrize("policy", ["sarathi", "fcfs" if "fcfs" in policy_names() else "vllm-v0", "srpt"])
def test_byte_identical_reruns(policy, tmp_path):
    from servelab.replay import write_run

    digests = []
    for i in range(2):
        result = run(workload(seed=3), policy=policy, runner=RUNNER, replicas=2, spec_method="ngram", spec_k=4,
                     spec_acceptance="beta:6,2", **{**ENGINE, "num_gpu_blocks": 200})
        out = write_run(result, tmp_path / str(i))
        digests.append([(out / f).read_bytes() for f in ("requests.parquet", "steps.parquet")])
    assert digests[0] == digests[1]


def test_speculation_turns_off_the_decode_cohort_and_stretches():
    """Both advance every decode by one token per iteration in closed form; with speculation every
    step is priced and applied alone (the speed cost is measured in bench/RESULTS_runners.md)."""
    from servelab.assembly import build_cluster
    from servelab.replay.core.engine import Engine

    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000, spec_method="ngram"), policy="sarathi", runner=LINEAR)
    cluster = build_cluster(cfg, None, None)
    entry = cluster.pools[0]
    engine = Engine([], cluster.replicas, entry.router, entry.runner, cfg.engine)
    assert all(r.aggregate is None and r.decode_affine(4) is None for r in engine.replicas)
    off = ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000), policy="sarathi", runner=LINEAR)
    cluster = build_cluster(off, None, None)
    engine = Engine([], cluster.replicas, cluster.pools[0].router, cluster.pools[0].runner, off.engine)
    assert all(r.aggregate is not None and r.decode_affine(4) is not None for r in engine.replicas)


def test_speculation_shortens_decoding():
    trace = workload(n=60)
    off = run(trace, runner=RUNNER, **ENGINE).requests.to_pydict()
    on = run(trace, runner=RUNNER, spec_method="ngram", spec_k=4, spec_acceptance="0.8", **ENGINE).requests.to_pydict()
    assert sum(on["e2e_s"]) < sum(off["e2e_s"])
    assert on["generated_tokens"] == off["generated_tokens"]


# -- pricing ------------------------------------------------------------------------------------------------
def roofline():
    return make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb")


def engine_cfg(**kw):
    return EngineConfig(**kw)


def test_verification_is_the_target_pricing_chunks_of_one_plus_k():
    target = roofline()
    spec = speculative_runner(target, engine_cfg(spec_method="ngram", spec_k=4))
    shape = StepShape(decode_seqs=8, decode_context_tokens=8 * 1000, spec_tokens=32)
    chunks = StepShape(prefill_tokens=40, prefill_seqs=8, prefill_context_tokens=8 * 1004,
                       prefill_attention_pairs=8 * (5 * 999 + 15))
    assert spec.step_time(StepPlan(shape)) == target.step_time(StepPlan(chunks))  # n-gram: proposing is free
    plain = StepShape(decode_seqs=8, decode_context_tokens=8000)
    assert spec.step_time(StepPlan(plain)) == target.step_time(StepPlan(plain))
    assert spec.step_time(StepPlan(shape)) > target.step_time(StepPlan(plain))
    assert spec.decode_affine(8) is None


def test_proposer_costs_rank_ngram_eagle_draft():
    target = roofline()
    shape = StepShape(decode_seqs=16, decode_context_tokens=16 * 2000, spec_tokens=16 * 4)
    times = {m: speculative_runner(target, engine_cfg(spec_method=m, spec_k=4)).step_time(StepPlan(shape))
             for m in ("ngram", "eagle", "mtp", "draft_model")}
    assert times["ngram"] < times["eagle"] == times["mtp"] < times["draft_model"]
    # a prefill-only step: the head and the draft run over its tokens too; n-gram costs nothing
    prefill = StepPlan(StepShape(prefill_tokens=512, prefill_seqs=1, prefill_context_tokens=512,
                                 prefill_attention_pairs=512 * 513 // 2))
    alone = {m: speculative_runner(target, engine_cfg(spec_method=m, spec_k=4)).step_time(prefill)
             for m in ("ngram", "eagle", "draft_model")}
    assert alone["ngram"] == target.step_time(prefill) < alone["eagle"] < alone["draft_model"]
    # a one-layer head's 4 forwards cost about 4 layers of the 32-layer target, not 4 whole steps
    assert times["eagle"] - times["ngram"] < 0.5 * target.step_time(StepPlan(StepShape(decode_seqs=16,
                                                                                       decode_context_tokens=32000)))


def test_proposer_memory_shrinks_kv_capacity():
    target = roofline()
    draft = speculative_runner(target, engine_cfg(spec_method="draft_model", spec_k=4))
    eagle = speculative_runner(target, engine_cfg(spec_method="eagle", spec_k=4))
    ngram = speculative_runner(target, engine_cfg(spec_method="ngram", spec_k=4))
    base = target.kv_capacity_tokens(0.9)
    assert ngram.kv_capacity_tokens(0.9) == base
    assert draft.kv_capacity_tokens(0.9) < eagle.kv_capacity_tokens(0.9) < base
    # llama-3.2-1b: 16 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes = 32 KiB per token besides the target's 128 KiB
    assert draft.kv_bytes_per_token == target.kv_bytes_per_token + 16 * 8 * 64 * 2 * 2
    assert eagle.kv_bytes_per_token == target.kv_bytes_per_token + target.kv_bytes_per_token // 32
    assert draft.describe()["speculative"]["method"] == "draft_model"
    import pickle  # (sweeps and searches send runners to worker processes)

    again = pickle.loads(pickle.dumps(draft))
    plan = StepPlan(StepShape(decode_seqs=4, decode_context_tokens=4000, spec_tokens=16))
    assert again.step_time(plan) == draft.step_time(plan) and again.kv_capacity_tokens(0.9) == draft.kv_capacity_tokens(0.9)


def test_head_and_draft_methods_need_a_model():
    with pytest.raises(ServelabError, match="roofline"):
        speculative_runner(make_runner(LINEAR), engine_cfg(spec_method="eagle"))
    assert isinstance(speculative_runner(make_runner(LINEAR), engine_cfg(spec_method="ngram")), SpeculativeRunner)


def test_roofline_replay_with_eagle_runs_and_reports(tmp_path):
    trace = workload(n=40)
    cfg = ReplayConfig(engine=EngineConfig(spec_method="eagle", spec_k=3, spec_acceptance="0.7"), policy="sarathi",
                       runner="roofline:model=llama-3.1-8b,gpu=h100-80gb")
    result = replay(trace, cfg)
    assert set(result.requests.column("status").to_pylist()) == {"finished"}
    assert result.meta["runner"]["name"] == "roofline+eagle"
    assert result.meta["spec_decode"]["mean_acceptance_length"] > 1


def test_spec_decode_view(tmp_path):
    from servelab.replay import write_run
    from servelab.scoring.db import connect, query_arrow

    trace = make_trace([0.0, 0.0, 0.0], [16, 16, 16], [400, 400, 1], tenant=["a", "b", "b"])
    result = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance="0.8")
    out = write_run(result, tmp_path / "run")
    con = connect([str(out)])
    rows = query_arrow(con, "SELECT * FROM spec_decode ORDER BY scope, name").to_pylist()
    req = result.requests.to_pydict()
    overall = next(r for r in rows if r["scope"] == "overall")
    assert overall["requests"] == 2  # the one-token request never verified drafts
    assert overall["num_drafts"] == sum(req["spec_num_drafts"])
    assert overall["num_accepted_tokens"] == sum(req["spec_num_accepted_tokens"])
    assert overall["mean_acceptance_length"] == pytest.approx(
        1 + sum(req["spec_num_accepted_tokens"]) / sum(req["spec_num_drafts"]))
    assert {r["name"] for r in rows if r["scope"] == "tenant"} == {"a", "b"}
    from servelab.scoring.report import report_data

    run_id = query_arrow(con, "SELECT run_id FROM runs").column(0)[0].as_py()
    assert report_data(con, run_id)["spec_decode"]["num_drafts"] == overall["num_drafts"]


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "mtp", "draft_model"])
def test_speculative_runner_contract(method):
    """As for every pricing runner (tests/test_runner_contract.py): positive, finite, repeatable, and
    more work never cheaper: more drafts, more decodes, longer contexts, added prefill."""
    runner = speculative_runner(roofline(), engine_cfg(spec_method=method, spec_k=4))
    base = StepShape(prefill_tokens=128, prefill_seqs=1, prefill_context_tokens=128, prefill_attention_pairs=128 * 129 // 2,
                     decode_seqs=8, decode_context_tokens=8 * 500, spec_tokens=8 * 2)
    t = runner.step_time(StepPlan(base))
    assert 0 < t < math.inf and t == runner.step_time(StepPlan(base))
    for more in (base._replace(spec_tokens=8 * 4), base._replace(decode_seqs=9, decode_context_tokens=9 * 500, spec_tokens=18),
                 base._replace(decode_context_tokens=8 * 5000), base._replace(prefill_tokens=256, prefill_context_tokens=256,
                                                                             prefill_attention_pairs=256 * 257 // 2)):
        assert runner.step_time(StepPlan(more)) >= t, more


def test_token_log_has_every_accepted_token_at_its_steps_end():
    """tokens.parquet: one row per output token; a verified step's tokens share its end time."""
    trace = make_trace([0.0, 0.5], [32, 16], [200, 150])
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=10_000, spec_method="ngram", spec_k=4,
                                           spec_acceptance="0.8"), policy="sarathi", runner=LINEAR)
    result = replay(trace, cfg, token_log=True)
    tokens = result.tokens.read().to_pydict()
    for rid, n in ((0, 200), (1, 150)):
        idx = [i for i, r in zip(tokens["token_index"], tokens["request_id"]) if r == rid]
        assert sorted(idx) == list(range(1, n + 1))
    times = [t for r, t in zip(tokens["request_id"], tokens["time_s"]) if r == 0]
    assert len(set(times)) < len(times) / 2  # several tokens per step (3.36 on average)


def test_disaggregated_decode_pool_speculates():
    """Prefill and decode pools: the decode replica verifies drafts (the engine's spec settings apply)."""
    data = dict(runner="linear:base=1", num_gpu_blocks=1000, kv_bytes_per_token=1000, max_num_batched_tokens=4096,
                spec_method="ngram", spec_k=3, spec_acceptance="1")
    data["cluster"] = {"pools": [dict(name="p", role="prefill", replicas=1), dict(name="d", role="decode", replicas=1)],
                       "links": [{"from": "p", "to": "d", "bandwidth_gbps": 1e-6, "latency_s": 0.0}]}
    r = replay(make_trace([0], [8], [9]), ReplayConfig.from_dict(data)).requests.to_pylist()[0]
    # prefill [0, 1] (token 1), 8,000 B land at 9, then two steps of 1 + 3 tokens: [9, 10], [10, 11]
    assert r["status"] == "finished" and r["finish_s"] == pytest.approx(11.0)
    assert r["spec_num_drafts"] == 2 and r["spec_num_accepted_tokens"] == 6


@pytest.mark.parametrize("policy", ["sarathi", "vllm-v0", "srpt", "round-robin", "orca"])
def test_inlined_walk_equals_the_general_path(policy, monkeypatch, tmp_path):
    """SpecBatchBuilder._walk inlines a decode's drafts, budget and KV; walking every request through
    add_running instead gives byte-identical results (KV pressure and preemption included)."""
    from servelab.replay import write_run
    from servelab.replay.core.speculative import SpecBatchBuilder

    kw = dict(policy=policy, runner=RUNNER, spec_method="ngram", spec_k=4, spec_acceptance="uniform:0.2,0.9",
              **{**ENGINE, "num_gpu_blocks": 48})
    fast = write_run(run(workload(seed=5), **kw), tmp_path / "fast")
    monkeypatch.setattr(SpecBatchBuilder, "_walk", SpecBatchBuilder._walk_each)
    slow = write_run(run(workload(seed=5), **kw), tmp_path / "slow")
    for f in ("requests.parquet", "steps.parquet"):
        assert (fast / f).read_bytes() == (slow / f).read_bytes(), f
    assert sum(pq.read_table(fast / "requests.parquet").column("num_preemptions").to_pylist()) > 0


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_trace_column_round_trips(tmp_path, suffix):
    from servelab.traces.io import read_trace, write_trace

    path = tmp_path / f"t.{suffix}"
    write_trace(make_trace([0.0, 1.0], [16, 16], [4, 4], spec_acceptance=[0.75, None]), path, "test")
    back = read_trace(path)
    assert back.column("spec_acceptance").to_pylist() == [0.75, None]
    assert str(back.schema.field("spec_acceptance").type) == "double"


def test_short_outputs_keep_the_closed_form_in_the_counters():
    """Drafts are verified up to the request's last step (vLLM does not trim them to max_tokens), so
    vLLM's mean acceptance length over many short requests still approaches the closed form."""
    n = 1000
    trace = make_trace([i * 0.01 for i in range(n)], [16] * n, [12] * n)
    result = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance="0.8")
    meta = result.meta["spec_decode"]
    assert meta["num_drafts"] > 3000
    assert meta["mean_acceptance_length"] == pytest.approx(expected_tokens_per_step(0.8, 4), rel=0.02)


def test_drafts_stop_below_max_model_len():
    """vLLM trims the scheduled positions to max_model_len - 1: a request at the context's end verifies
    fewer drafts, and its KV never passes max_model_len - 1 tokens."""
    trace = make_trace([0.0], [10], [20])
    result = spec_run(trace, spec_method="ngram", spec_k=4, spec_acceptance="0", block_size=1, max_model_len=30)
    assert result.requests.column("status").to_pylist() == ["finished"]
    assert max(result.steps.column("kv_blocks_used").to_pylist()) == 29
    assert result.requests.column("spec_num_draft_tokens").to_pylist()[0] < 4 * 19


@pytest.mark.parametrize("policy", ["sarathi", "vllm-v0", "round-robin"])
def test_horizon_with_speculation_keeps_every_request(policy):
    trace = workload()
    result = run(trace, policy=policy, runner=RUNNER, until_s=2.0, spec_method="ngram", spec_k=3,
                 spec_acceptance="0.7", **ENGINE)
    req = result.requests.to_pydict()
    assert result.requests.num_rows == trace.num_rows
    assert set(req["status"]) == {"finished", "unfinished"}
    for status, gen, out in zip(req["status"], req["generated_tokens"], req["output_tokens"]):
        assert gen == out if status == "finished" else gen < out
