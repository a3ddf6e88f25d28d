"""An MoE model's data-parallel ranks step together (replay/core/lockstep.py, docs/runners.md "Parallelism").

vLLM's DP ranks of an MoE model meet in every forward pass (the experts gather every rank's tokens), so
no rank starts a step before the slowest has finished the last; the ranks of a dense model are
independent engines. Pricing follows vLLM's rule: all ranks within the CUDA-graph sizes pad to the
largest; else all run eager, unpadded, the experts seeing every rank's tokens.
"""

import itertools

import pyarrow.compute as pc
import pytest
from conftest import make_trace
from servelab.api import replay
from servelab.replay.config import ReplayConfig
from servelab.runners.base import StepPlan, StepShape, make_runner

MOE = dict(model="qwen3-30b-a3b", gpu="h100-80gb", dp=2, enable_expert_parallel=True)


def _trace(n: int = 40):
    return make_trace([i * 0.02 for i in range(n)], [200 + 97 * (i % 9) for i in range(n)],
                      [8 + i % 13 for i in range(n)])


def _steps(result, replica: int) -> list[tuple[float, float]]:
    steps = result.steps.filter(pc.equal(result.steps.column("replica"), replica))
    start = steps.column("start_s").to_pylist()
    return [(s, s + d) for s, d in zip(start, steps.column("duration_s").to_pylist())]


def test_an_moe_models_dp_ranks_step_together():
    result = replay(_trace(), ReplayConfig.from_dict({**MOE, "replicas": 2}))
    ranks = {r: _steps(result, r) for r in range(4)}
    assert all(ranks.values())
    both = 0
    for a, b in ((0, 1), (2, 3)):  # each replica's two ranks: a step of one is a step of the other, or apart
        for (s0, e0), (s1, e1) in itertools.product(ranks[a], ranks[b]):
            if s0 < e1 and s1 < e0:
                assert (s0, e0) == (s1, e1)
                both += 1
    assert both > 10  # (the ranks did work at the same time)
    # the two replicas are separate servers: their steps need not line up
    assert any(s0 < e2 and s2 < e0 and (s0, e0) != (s2, e2)
               for (s0, e0), (s2, e2) in itertools.product(ranks[0], ranks[2]))
    assert pc.all(pc.equal(result.requests.column("status"), "finished")).as_py()
    again = replay(_trace(), ReplayConfig.from_dict({**MOE, "replicas": 2}))
    assert again.requests.equals(result.requests) and again.steps.equals(result.steps)


@pytest.mark.parametrize("model,locked", [("qwen3-30b-a3b", True), ("llama-3.1-8b", False)])
def test_a_request_reaching_an_idle_rank_waits_for_the_step_in_flight(model, locked):
    # request 0 (a long prompt) goes to rank 0; request 1 reaches the idle rank 1 while rank 0 prefills
    trace = make_trace([0.0, 0.001], [2000, 50], [4, 4])
    config = dict(MOE, model=model, enable_expert_parallel=model == "qwen3-30b-a3b")
    result = replay(trace, ReplayConfig.from_dict(config))
    rows = result.requests.sort_by("request_id")
    assert rows.column("replica").to_pylist() == [0, 1]
    first_step_end = _steps(result, 0)[0][1]
    assert first_step_end > 0.001
    scheduled = rows.column("first_scheduled_s").to_pylist()[1]
    # an MoE model's rank 1 starts with rank 0's next step; a dense model's at once
    assert scheduled == (first_step_end if locked else 0.001)


def _runner():
    return make_runner("roofline", max_num_seqs=128, max_num_batched_tokens=2048, **MOE)


def _alone(runner, seqs: int) -> float:
    return runner.step_time(StepPlan(StepShape(decode_seqs=seqs)))


def test_lockstep_pricing_follows_vllms_padding_rule():
    r = _runner()
    assert r.dp_lockstep and r.dp_capture_tokens == 256  # min(2 x max_num_seqs, 512, max_num_batched_tokens)
    tokens = r._by_tokens
    layers = r.model.num_layers

    def terms(n):
        layer, head, comm, _, _ = tokens(n)
        return layers * (layer + comm) + head

    # within the graph sizes: the smaller rank pads to the larger, which pays nothing more
    assert r.dp_lockstep_s(8, (8, 64)) == pytest.approx(terms(64) - terms(8))
    assert r.dp_lockstep_s(8, (8, 64)) > 0 and r.dp_lockstep_s(64, (8, 64)) == 0.0
    # balanced ranks beyond the graph sizes price as one rank alone, bit for bit
    assert r.dp_lockstep_s(1000, (1000, 1000)) == 0.0
    # beyond them: unpadded; the big rank's experts see the mean (fewer tokens than its own), the small
    # rank runs eager and its experts see the big rank's tokens too
    assert r.dp_lockstep_s(2048, (2048, 16)) < 0 < r.dp_lockstep_s(16, (2048, 16))
    # a dense model's ranks do not step together
    assert not make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb", dp=2).dp_lockstep


@pytest.mark.parametrize("a,b", [(1, 7), (8, 64), (30, 34), (100, 156), (128, 384), (16, 2032)])
def test_a_locked_step_is_never_faster_than_its_tokens_spread_evenly(a, b):
    # the physics floor: the ranks wait for the slowest, so uneven ranks take at least as long as the
    # same tokens split evenly (each rank's own work, experts and collectives are monotone in tokens)
    r = _runner()
    group = (a, b)
    locked = max(_alone(r, n) + r.dp_lockstep_s(n, group) for n in group)
    even = (a + b) // 2
    assert locked >= _alone(r, even) + r.dp_lockstep_s(even, (even, even)) - 1e-12
    assert locked >= max(_alone(r, n) for n in group) * 0.5  # (and no rank's own step vanished)


@pytest.mark.parametrize("extra", [{"num_gpu_blocks": 300}, {"num_gpu_blocks": 300, "preemption": "swap"},
                                   {"client_timeout_s": 2.0}, {"router": "vllm-dp", "policy": "vllm-v0"},
                                   {"fail": ("replica=0,at=2,for=3",)}],
                         ids=["kv-pressure", "swap", "timeouts", "vllm-dp-v0", "rank-fails"])
def test_locked_ranks_keep_the_engines_books_after_every_event(monkeypatch, extra):
    # the engine's invariants (tests/test_engine_invariants.py) checked after every event, with the
    # ranks locked: KV, outstanding tokens, every request accounted for; and the rounds still line up
    from servelab.traces.synth import synth_trace
    from test_engine_invariants import CheckedEngine, checked_engines

    engines = checked_engines(monkeypatch)
    trace = synth_trace(n=200, rate=40, arrival="gamma", cv=2.0, prompt="lognormal:600:0.8",
                        output="lognormal:60:0.8", seed=11)
    before = CheckedEngine.events
    result = replay(trace, ReplayConfig.from_dict({**MOE, "kv_bytes_per_token": 1024, **extra}))
    assert CheckedEngine.events - before > 200
    assert sum(result.meta["counts"].values()) == trace.num_rows
    (engine,) = engines
    assert engine.replicas[0].group is engine.replicas[1].group is not None
    for replica in engine.replicas:
        assert replica.outstanding_tokens == 0 and replica.kv.used == 0
    ranks = [_steps(result, r) for r in (0, 1)]
    for (s0, e0), (s1, e1) in itertools.product(*ranks):
        assert not (s0 < e1 and s1 < e0) or (s0, e0) == (s1, e1)
