"""Prefix caching per KV layer group of a hybrid model (replay/core/kv/hybrid_prefix.py, #29 item 2): a hit
is the longest block-aligned prefix every group can serve (vLLM's hybrid KV cache manager), checked
on hand-computed shared prefixes and against the cache's own contents, with the pool's bookkeeping
checked after every event."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers_engine import column, run, synthetic
from servelab.common.errors import ServelabError
from servelab.replay.core.kv.hybrid_prefix import HybridPrefixCache
from servelab.replay.core.kv.kv_groups import KVLayout, LayerKinds
from test_prefix_cache import chain, hashed

GEMMA = "roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2"
GPT_OSS = "roofline:model=gpt-oss-120b,gpu=h100-80gb,tp=2"
QWEN3_NEXT = "roofline:model=qwen3-next-80b-a3b,gpu=h200,tp=2"


# -- hand-computed shared prefixes ------------------------------------------------------------------
@pytest.mark.parametrize("runner", [GEMMA, GPT_OSS])
def test_a_shared_prefix_hits_in_full_and_sliding_groups(runner):
    # A: 2048 tokens, computed in one step: its 128 full blocks stay cached, and its sliding blocks
    # too (those that left the window are freed to the queue, still cached). B shares A's 2048 tokens
    # then differs: the full group serves blocks 0..127; a sliding group needs only the window
    # before token 2048, blocks (2048 - w + 1) // 16 .. 127 (gemma-3: w 1024, blocks 64..127; gpt-oss:
    # w 128, blocks 120..127), all cached: B reuses 2048 tokens. Off: it computes all 3072.
    trace = hashed([0, 50], [2048, 3072], [1, 1], [chain(1, 128), chain(1, 128) + chain(2, 192)[128:]])
    on = run(trace, runner=runner, block_size=16, num_gpu_blocks=20_000)
    off = run(trace, runner=runner, block_size=16, num_gpu_blocks=20_000, enable_prefix_caching=False)
    assert column(on, "cached_tokens") == [0, 2048]
    assert column(off, "cached_tokens") == [0, 0]
    assert column(on, "ttft_s")[1] < column(off, "ttft_s")[1]
    assert column(on, "ttft_s")[0] == column(off, "ttft_s")[0]


def test_an_identical_prompt_reuses_whole_blocks_only():
    # vLLM: the hit is at most (tokens - 1) // block_size blocks; 64 tokens in 16-token blocks: 48.
    trace = hashed([0, 50], [64, 64], [1, 1], [chain(1, 4), chain(1, 4)])
    assert column(run(trace, runner=GEMMA, block_size=16, num_gpu_blocks=20_000), "cached_tokens") == [0, 48]


def test_qwen3_next_hits_only_where_a_state_was_saved():
    # block_size 544 (one page holds a linear-attention state). A: 2000 tokens in one step; its state
    # is saved at the last block boundary it reached, 3 * 544 = 1632 tokens. B shares A's 2000 tokens:
    # the full group serves 3 blocks and the state at 1632 exists: 1632. C shares only 1200 tokens:
    # the full group could serve 2 blocks (1088 tokens) but no state was saved at 1088 (nor 544): no
    # hit, though the full group's blocks are cached.
    trace = hashed([0, 50, 60], [2000, 3000, 3000], [1, 1, 1],
                   [chain(1, 125), chain(1, 125) + chain(2, 188)[125:], chain(1, 75) + chain(3, 188)[75:]])
    one_step = run(trace, runner=QWEN3_NEXT, block_size=544, num_gpu_blocks=2000)
    assert column(one_step, "cached_tokens") == [0, 1632, 0]
    # prefilled in 544-token chunks, A's state is saved at 544, 1088 and 1632: C now hits 1088
    chunked = run(trace, runner=QWEN3_NEXT, block_size=544, num_gpu_blocks=2000, max_num_batched_tokens=544)
    assert column(chunked, "cached_tokens") == [0, 1632, 1088]


# -- the hit never claims what a group cannot serve -------------------------------------------------
def _req(tokens: int, hashes: list[int]):
    return SimpleNamespace(prefix_hashes=hashes, prompt_tokens=tokens, output_tokens=1, num_tokens=tokens,
                           num_computed_tokens=tokens, tenant="t", lora_adapter=None, cached_keys=None, kv_blocks=0)


def _cache(full: int, sliding: int, state: int, window: int = 64, bs: int = 16):
    layout = KVLayout(LayerKinds(full=full, sliding=sliding, state=state, window=window, token_bytes=64,
                                 state_bytes=64 * bs if state else 0), bs)
    return HybridPrefixCache(10_000, layout, 16)


def _cached_by(cache: HybridPrefixCache, tokens: int, hashes: list[int]) -> None:
    """A request of ``tokens`` computes them in one step and is released (its units stay cached)."""
    req = _req(tokens, hashes)
    req.kv_blocks = cache.layout.held(0, tokens)
    cache.take(req.kv_blocks)
    cache.register(req)
    cache.release(req, req.kv_blocks, False)


@pytest.mark.parametrize("drop", [60, 63, 58, 57, 10])
def test_a_missing_window_block_limits_the_hit_to_a_prefix_the_window_group_serves(drop):
    # full + sliding (window 64 tokens = 4 blocks + 1 token: blocks (16h - 63) // 16 .. h - 1).
    cache = _cache(full=1, sliding=1, state=0)
    hashes = chain(1, 64)
    _cached_by(cache, 1024, hashes)
    del cache.units[("S", None, hashes[drop], drop, drop)]  # (evicted: its key gone)
    hit = cache.lookup(_req(1024, hashes))
    h = hit.tokens // 16 if hit is not None else 0
    # the longest h <= 63 whose window blocks avoid `drop`: h <= drop, or h - 1 - 3 > drop
    want = max(x for x in range(0, 64) if x <= drop or (16 * x - 63) // 16 > drop)
    assert h == want


def test_brute_force_every_hit_is_served_by_every_group():
    """Random evictions from all three kinds: the lookup equals the longest h that a direct reading of
    each group's rule allows."""
    import random

    rng = random.Random(7)
    for _ in range(60):
        cache = _cache(full=2, sliding=2, state=1)
        hashes = chain(1, 40)
        for step in range(1, 41, 3):  # cached states at several boundaries: computed in steps
            req = _req(640, hashes)
            req.num_computed_tokens = 16 * step
            req.kv_blocks = cache.layout.held(0, 16 * step)
            cache.take(req.kv_blocks)
            cache.register(req)
            cache.release(req, req.kv_blocks, False)
        keys = list(cache.units)
        for key in rng.sample(keys, rng.randrange(len(keys))):
            del cache.units[key]
        units = cache.units

        def cached(kind, j):
            return (kind, None, hashes[j], j, j) in units

        def serves(h):
            return (all(cached("F", j) for j in range(h)) and cached("M", h - 1)
                    and all(cached("S", j) for j in range(max(0, 16 * h - 63) // 16, h)))
        want = max([h for h in range(1, 40) if serves(h)], default=0)
        hit = cache.lookup(_req(640, hashes))
        assert (hit.tokens // 16 if hit is not None else 0) == want


# -- bookkeeping ------------------------------------------------------------------------------------
CASES = {
    "sarathi, KV pressure": ("sarathi", {}, {"num_gpu_blocks": 400}),
    "srpt preempting": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400}),
    "srpt preempting, swap, per tenant": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "preemption": "swap",
                                                                      "swap_space_gb": 0.05,
                                                                      "prefix_cache_scope": "tenant"}),
    "vllm-v0, small chunks": ("vllm-v0", {}, {"num_gpu_blocks": 400, "max_num_batched_tokens": 256}),
}


@pytest.mark.parametrize("model", ["gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.sampled(keep=4)
def test_bookkeeping_adds_up_after_every_event_with_prefix_caching(monkeypatch, case, model):
    """KVManager.check (and the cache's own check) after every event, with shared prefixes hitting
    in every group while sliding groups free blocks and state copies are cached."""
    import servelab.assembly
    from test_engine_invariants import CheckedEngine

    policy, params, engine = CASES[case]
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=120, rate=40.0, seed=5, prompt="lognormal:500:0.6", output="lognormal:60:0.8",
                      shared_prefix_tokens=600, prefix_groups=3, prefix_block_tokens=16)
    gpu, bs = ("h200", 544) if model.startswith("qwen3") else ("h100-80gb", 16)
    blocks = engine["num_gpu_blocks"] if bs == 16 else engine["num_gpu_blocks"] // 8
    before = CheckedEngine.events
    result = run(trace, policy=policy, runner=f"roofline:model={model},gpu={gpu},tp=2", policy_params=params,
                 **{**engine, "num_gpu_blocks": blocks, "block_size": bs})
    assert CheckedEngine.events - before > 300
    assert set(column(result, "status")) <= {"finished", "rejected"}
    assert sum(column(result, "cached_tokens")) > 0


def test_what_per_group_caching_does_not_model_is_refused_by_name():
    trace = hashed([0.0], [100], [5], [chain(1, 6)])
    with pytest.raises(ServelabError, match="kv_tiers with a hybrid"):
        run(trace, runner=GEMMA, num_gpu_blocks=2000, kv_tiers=("dram:capacity_gb=1",))
