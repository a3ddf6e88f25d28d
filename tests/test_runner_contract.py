"""One contract over every pricing runner (as tests/test_policy_contract.py is over the policies): a
positive, finite, repeatable step time that never falls when an iteration gains work, a closed-form
decode stretch that equals pricing each iteration, and a description that run.json can hold."""

from __future__ import annotations

import json
import math

import pytest
from servelab.replay.core.protocols import Runner
from servelab.runners.base import RUNNERS, StepPlan, StepShape, make_runner
from test_runner_fitted import TRUE


def _fitted():
    from servelab.runners.fitted import FittedModel, FittedRunner

    return FittedRunner(FittedModel((16, 256), tuple(tuple(v * (1 + b) for v in TRUE.values()) for b in range(3))))


FACTORIES = {  # every built-in runner that prices a shape, in a few of its configurations
    "linear": lambda: make_runner("linear:base=0.01,prefill_token=0.0001,decode_seq=0.0002,decode_context_token=1e-8"),
    "roofline": lambda: make_runner("roofline"),
    "roofline, 70B TP4 over PCIe": lambda: make_runner("roofline:model=llama-3.1-70b,gpu=l40s,tp=4"),
    "roofline, PP2": lambda: make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb,pp=2"),
    "fitted": _fitted,
    # hybrid attention (runners/hybrid.py): sliding-window layers, and linear-attention state layers
    "roofline, Gemma-3-27B sliding windows": lambda: make_runner("roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2"),
    "roofline, Qwen3-Next state layers": lambda: make_runner("roofline:model=qwen3-next-80b-a3b,gpu=h200,tp=2"),
    "roofline, gpt-oss-120b": lambda: make_runner("roofline:model=gpt-oss-120b,gpu=h100-80gb,tp=2", block_size=16),
}
# torch executes the batch on a paged KV cache rather than pricing a shape: its own suite
# (tests/test_torch_runner.py, bench/gpu_check.py) checks it against a plain forward pass
EXECUTING = {"torch"}


def _shape(prefill: int = 0, prefill_seqs: int = 0, context: int = 0, decodes: int = 0, decode_context: int = 0):
    pairs = sum(c * context // max(1, prefill_seqs) + c * (c + 1) // 2
                for c in ([prefill // prefill_seqs] * prefill_seqs if prefill_seqs else []))
    return StepShape(prefill_tokens=prefill, prefill_seqs=prefill_seqs, prefill_context_tokens=context + prefill,
                     prefill_attention_pairs=pairs, decode_seqs=decodes, decode_context_tokens=decode_context)


SHAPES = [_shape(decodes=1, decode_context=100), _shape(decodes=64, decode_context=64 * 2000),
          _shape(prefill=512, prefill_seqs=1), _shape(prefill=2048, prefill_seqs=4, context=4096),
          _shape(prefill=256, prefill_seqs=1, decodes=32, decode_context=32 * 1000)]


def test_the_contract_covers_every_runner():
    names = {key.split(",")[0] for key in FACTORIES}
    assert names | EXECUTING == set(RUNNERS.names())


@pytest.mark.parametrize("key", FACTORIES)
def test_a_runner_has_every_member_and_describes_itself_in_json(key):
    runner = FACTORIES[key]()
    assert isinstance(runner, Runner) and runner.name == key.split(",")[0]
    json.dumps(runner.describe())  # run.json holds it


@pytest.mark.parametrize("key", FACTORIES)
def test_step_times_are_positive_finite_and_repeatable(key):
    runner = FACTORIES[key]()
    for shape in SHAPES:
        t = runner.step_time(StepPlan(shape))
        assert math.isfinite(t) and t > 0, (key, shape)
        assert runner.step_time(StepPlan(shape)) == t


@pytest.mark.parametrize("key", FACTORIES)
def test_more_work_never_takes_less_time(key):
    runner = FACTORIES[key]()

    def price(**kw):
        return runner.step_time(StepPlan(_shape(**kw)))

    for decodes in (1, 8, 64):
        assert price(decodes=decodes + 1, decode_context=(decodes + 1) * 1000) >= price(decodes=decodes, decode_context=decodes * 1000)
        assert price(decodes=decodes, decode_context=decodes * 4000) >= price(decodes=decodes, decode_context=decodes * 1000)
    for tokens in (64, 512, 2048):
        assert price(prefill=2 * tokens, prefill_seqs=1) >= price(prefill=tokens, prefill_seqs=1)
        assert (price(prefill=tokens, prefill_seqs=1, decodes=16, decode_context=16000)
                >= price(decodes=16, decode_context=16000))  # fmt: skip


@pytest.mark.parametrize("key", FACTORIES)
def test_the_decode_stretch_in_closed_form_equals_pricing_each_iteration(key):
    runner = FACTORIES[key]()
    for n in (1, 7, 64):
        affine = runner.decode_affine(n)
        if getattr(runner, "prices_items", False):  # a sliding window's reads are not linear in the total
            assert affine is None, key  # context: the engine prices every iteration, from its items
            continue
        assert affine is not None, key  # a pricing runner promises it: the engine's speed rests on it
        a, b = affine
        for context in (n, 1000 * n + 3, 30_000 * n):
            assert runner.step_time(StepPlan(StepShape(decode_seqs=n, decode_context_tokens=context))) == pytest.approx(
                a + b * context, rel=1e-12)
