"""vLLM's async scheduling overlaps the host's work for a step (scheduling, input preparation) with the
GPU's work on the step before: with async scheduling on, the roofline runner adds only the host profile's
``async_host_share`` of the host's time to a step's GPU time, and the step lasts at least the host's time
(runners/roofline.py ``host_overlap``)."""

from __future__ import annotations

import pickle

import pytest
from conftest import make_trace

from servelab.assembly import build_runner, replay
from servelab.replay.config import ReplayConfig
from servelab.replay.core.engine_config import EngineConfig
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.roofline import RooflineRunner

SHAPES = [StepShape(decode_seqs=1), StepShape(decode_seqs=64, decode_context_tokens=64 * 900),
          StepShape(prefill_tokens=2048, prefill_seqs=1), StepShape(prefill_tokens=512, prefill_seqs=2, decode_seqs=30,
                                                                     decode_context_tokens=30 * 1500)]


def _runners(model: str = "llama-3.1-8b", gpu: str = "h100-80gb", tp: int = 1):
    sync = make_runner("roofline", model=model, gpu=gpu, tp=tp)
    overlapped = make_runner("roofline", model=model, gpu=gpu, tp=tp, async_scheduling=True)
    return sync, overlapped


@pytest.mark.parametrize("model, tp", [("llama-3.1-8b", 1), ("llama-3.1-70b", 4), ("qwen3-30b-a3b", 2)])
def test_a_step_adds_only_the_hosts_share_left_on_its_path(model, tp):
    sync, overlapped = _runners(model, tp=tp)
    assert not sync.host_overlap and overlapped.host_overlap
    share = overlapped.host_profile.async_host_share
    assert 0 <= share < 1
    for shape in SHAPES:
        cpu = sync.cpu_overhead_s(shape.prefill_seqs + shape.decode_seqs)
        t_sync, t_async = sync.step_time(StepPlan(shape)), overlapped.step_time(StepPlan(shape))
        gpu = t_sync - cpu
        assert cpu > 0 and gpu > cpu  # a real model's step: the GPU's work is the longer
        assert t_async == pytest.approx(gpu + share * cpu, rel=1e-12, abs=1e-15)
        assert t_async < t_sync


def test_a_host_longer_than_the_gpu_sets_the_step():
    sync, overlapped = _runners("tiny")
    shape = StepShape(decode_seqs=1)
    cpu = sync.cpu_overhead_s(1)
    assert sync.step_time(StepPlan(shape)) - cpu < cpu  # (the tiny model's GPU work is shorter)
    assert overlapped.step_time(StepPlan(shape)) == pytest.approx(cpu, rel=1e-12)


def test_decode_steps_stay_affine_in_the_context_read():
    _, overlapped = _runners("llama-3.1-8b")
    for n in (1, 8, 200):
        a, b = overlapped.decode_affine(n)
        for context in (0, 10_000, 300_000):
            assert overlapped.step_time(StepPlan(StepShape(decode_seqs=n, decode_context_tokens=context))) == a + b * context


def test_the_runner_a_run_used_is_rebuilt_with_its_overlap():
    _, overlapped = _runners("llama-3.1-8b")
    again = RooflineRunner.from_describe(overlapped.describe())
    assert again.host_overlap and again == overlapped
    assert pickle.loads(pickle.dumps(overlapped)).host_overlap
    sync, _ = _runners("llama-3.1-8b")
    assert "host_overlap" not in sync.describe()  # (run.json of a synchronous replay as before)


def test_the_2023_host_profile_has_no_async_engine_to_overlap():
    runner = make_runner("roofline:host=vidur-2023", model="llama-3.1-8b", gpu="a100-80gb", async_scheduling=True)
    assert not runner.host_overlap


def test_a_replay_with_async_scheduling_overlaps_the_host_and_one_without_does_not():
    trace = make_trace([0.0, 0.0, 0.0, 0.0], [100] * 4, [50] * 4)
    runs = {}
    for on in (False, True):
        config = ReplayConfig(engine=EngineConfig(async_scheduling=on))
        runner = build_runner(config)
        assert runner.host_overlap is on
        runs[on] = replay(trace, config, runner=runner).requests
    tpot = {on: sum(runs[on].column("tpot_s").to_pylist()) for on in runs}
    assert tpot[True] < tpot[False]  # the host's ~0.5 ms a step behind the GPU's
