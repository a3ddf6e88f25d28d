"""A victim preempted after its batch admitted requests onto blocks only it held frees none of those
blocks: the admitted requests keep them in use. (The builder counted them free, and srpt preempting
over a shared prefix over-committed KV: 403 of 400 blocks. Found by the smaller invariant suites.)"""

from __future__ import annotations

import servelab.assembly
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.kv.prefix_cache import PrefixCache
from servelab.traces.synth import synth_trace
from test_engine_invariants import CheckedEngine


def covered_counts(monkeypatch, cache_class) -> list[int]:
    """Replays check their bookkeeping after every event, and the list returned collects what each of
    ``cache_class.covered``'s answers was: the blocks a victim could not free because the batch's
    admissions reuse them."""
    kept: list[int] = []
    covered = cache_class.covered

    def counting(hits, sole):
        n = covered(hits, sole)
        kept.append(n)
        return n

    monkeypatch.setattr(cache_class, "covered", staticmethod(counting))
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    return kept


def test_srpt_preempting_over_a_shared_prefix_never_over_commits_kv(monkeypatch):
    kept = covered_counts(monkeypatch, PrefixCache)
    trace = synth_trace(n=150, rate=6.0, tenants="a=1,b=1", shared_prefix_tokens=1024, turns=3.0, think_s=2.0,
                        prompt="lognormal:1500:0.7", output="lognormal:40:0.7", prefix_block_tokens=48, seed=11)
    events = CheckedEngine.events
    result = replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=400, max_num_seqs=6), policy="srpt",
                                        policy_params={"preempt": True}))
    assert CheckedEngine.events > events  # the bookkeeping was checked after every event
    assert max(kept, default=0) > 0, kept  # the case happened: a victim's sole blocks reused by an admission
    statuses = result.requests.column("status").to_pylist()
    # every request ends; the only ones not finished are refused at arrival (a prompt larger than the 400 blocks)
    assert len(statuses) == 150 and set(statuses) == {"finished", "rejected"}
    too_big = [p + o > 400 * 16 for p, o in zip(trace.column("prompt_tokens").to_pylist(),
                                               trace.column("output_tokens").to_pylist())]
    assert [s == "rejected" for s in statuses] == too_big


def test_covered_counts_each_block_once_whatever_the_hits_overlap():
    class Hit:
        def __init__(self, *keys):
            self.keys = list(keys)

    a, b = object(), object()
    sole = {a: (2, 10), b: (0, 4)}  # entry -> the span of blocks the victim alone holds
    hits = [Hit((a, 0, 6)), Hit((a, 0, 8), (b, 0, 1)), Hit((a, 9, 12))]
    # a: [2, 8) from the first two (overlapping), [9, 10) from the third; b: [0, 1)
    assert PrefixCache.covered(hits, sole) == 6 + 1 + 1
    assert PrefixCache.covered([], sole) == 0
    assert PrefixCache.covered([Hit((object(), 0, 5))], sole) == 0


def test_the_same_holds_for_a_hybrid_models_per_group_cache(monkeypatch):
    """Gemma 3 (full and sliding-window groups: replay/core/kv/hybrid_prefix.py) under the same load: its
    cache answers the builder's ``covered`` too, and the bookkeeping adds up after every event."""
    from servelab.replay.core.kv.hybrid_prefix import HybridPrefixCache

    kept = covered_counts(monkeypatch, HybridPrefixCache)
    trace = synth_trace(n=150, rate=6.0, tenants="a=1,b=1", shared_prefix_tokens=1024, turns=3.0, think_s=2.0,
                        prompt="lognormal:1500:0.7", output="lognormal:40:0.7", prefix_block_tokens=16, seed=11)
    result = replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=1500, max_num_seqs=6), policy="srpt",
                                        policy_params={"preempt": True},
                                        runner="roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2"))
    assert max(kept, default=0) > 0, kept
    assert set(result.requests.column("status").to_pylist()) == {"finished", "rejected"}
