"""Prefix caching (replay/core/kv/prefix_cache.py), checked against hand-traced timelines and against the
reuse a trace's hashes allow, computed here independently of the engine.

Timelines use ``linear:base=1,prefill_token=0.25``: an iteration computing p prompt tokens takes
1 + p/4 seconds. Blocks are 16 tokens and the traces' hash blocks 16 tokens too (aligned).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import make_trace
from helpers_engine import column, run
from servelab.traces.io import prepare
from servelab.traces.synth import synth_trace

RUNNER = "linear:base=1,prefill_token=0.25"


def hashed(arrivals, prompts, outputs, hashes, **extra) -> pa.Table:
    table = make_trace(arrivals, prompts, outputs, **extra)
    table = table.append_column("prefix_hashes", pa.array(hashes, pa.list_(pa.int64())))
    return prepare(table, "test", "test", prefix_block_tokens=16)


def chain(tag: int, blocks: int) -> list[int]:
    """A prompt's hash chain: equal tags, equal prefixes."""
    return [tag * 1000 + i for i in range(blocks)]


def test_an_identical_prompt_computes_only_its_last_token():
    trace = hashed([0, 20], [64, 64], [1, 1], [chain(1, 4), chain(1, 4)])
    r = run(trace, runner=RUNNER)
    # A: 64 tokens in 1 + 16 = 17 s. B: 63 cached, computes 1 token: 1.25 s.
    assert column(r, "ttft_s") == [17.0, 1.25]
    assert column(r, "cached_tokens") == [0, 63]
    off = run(trace, runner=RUNNER, enable_prefix_caching=False)
    assert column(off, "ttft_s") == [17.0, 17.0] and column(off, "cached_tokens") == [0, 0]


def test_a_shared_prefix_is_reused_and_the_rest_computed():
    # B shares A's first two blocks (32 tokens) and then differs: it computes 96 - 32 = 64 tokens.
    trace = hashed([0, 20], [64, 96], [1, 1], [chain(1, 4), chain(1, 2) + chain(2, 4)[2:]])
    r = run(trace, runner=RUNNER)
    assert column(r, "cached_tokens") == [0, 32]
    assert column(r, "ttft_s") == [17.0, 1 + 64 / 4]


def test_least_recently_freed_blocks_are_evicted_first_tail_first():
    # 8 blocks. A (4 blocks) and B (4, other hashes) run one after another: B takes the 4 never
    # used blocks, so both stay cached; the free queue is A3 A2 A1 A0 B3 B2 B1 B0 (a request's
    # blocks are freed tail first). C (2 new blocks) evicts A3 and A2. D = A hits A0 A1 (32 tokens)
    # and its 2 new blocks evict B3 B2; E = B then hits B0 B1 only.
    trace = hashed([0, 20, 40, 60, 80], [64, 64, 32, 64, 64], [1] * 5,
                   [chain(1, 4), chain(2, 4), chain(3, 2), chain(1, 4), chain(2, 4)])
    r = run(trace, runner=RUNNER, num_gpu_blocks=8)
    assert column(r, "cached_tokens") == [0, 0, 0, 32, 32]
    assert column(r, "ttft_s") == [17.0, 17.0, 9.0, 9.0, 9.0]
    roomy = run(trace, runner=RUNNER, num_gpu_blocks=64)  # nothing evicted: D and E hit all but one token
    assert column(roomy, "cached_tokens") == [0, 0, 0, 63, 63]


def test_a_tenant_scoped_cache_gives_no_cross_tenant_hit():
    trace = hashed([0, 20, 40], [64, 64, 64], [1, 1, 1], [chain(1, 4)] * 3, tenant=["a", "b", "a"])
    shared = run(trace, runner=RUNNER)
    assert column(shared, "cached_tokens") == [0, 63, 63]
    scoped = run(trace, runner=RUNNER, prefix_cache_scope="tenant")
    assert column(scoped, "cached_tokens") == [0, 0, 63]  # b computes its own copy; a's second request hits a's


def test_a_request_preempted_by_recompute_finds_its_own_blocks_again():
    # A (prompt 16, 60 tokens out): prefill [0, 5], then a token a second until B arrives at 10, when
    # A has 6 tokens and 21 computed (one full block). srpt with preemption ranks the short B first
    # and one slot fits one request: A is preempted. B prefills 64 tokens [10, 27]. A returns, finds its
    # full block (16 tokens) cached and computes only 22 - 16 = 6: [27, 29.5] emits token 7, then 53
    # more a second each: done at 82.5. Recomputing all 22 tokens would take 6.5 s: done at 86.5.
    trace = hashed([0, 10], [16, 64], [60, 1], [chain(1, 1), chain(2, 4)])
    r = run(trace, runner=RUNNER, policy="srpt", policy_params={"preempt": True}, max_num_seqs=1)
    assert column(r, "num_preemptions") == [1, 0]
    assert column(r, "cached_tokens") == [16, 0]
    assert column(r, "finish_s") == [82.5, 27.0]
    off = run(trace, runner=RUNNER, policy="srpt", policy_params={"preempt": True}, max_num_seqs=1,
              enable_prefix_caching=False)
    assert column(off, "cached_tokens") == [0, 0] and column(off, "finish_s") == [86.5, 27.0]


@pytest.mark.parametrize("seed", [1, 2])
def test_an_unbounded_cache_serves_exactly_the_reuse_the_hashes_allow(seed):
    """Σ cached_tokens = Σ per request of the tokens in its leading blocks whose hash an earlier request
    had (what `trace info` calls the ideal reuse), less the last token a full hit still computes."""
    from servelab.traces.info import prefix_reuse_share

    trace = synth_trace(n=300, rate=0.05, tenants="a=1,b=1", shared_prefix_tokens=128, turns=3.0, think_s=5.0,
                        prompt="lognormal:200:0.5", output="fixed:4", prefix_block_tokens=16, seed=seed)
    r = run(trace, runner="linear:base=0.01,prefill_token=0.0001", num_gpu_blocks=1_000_000)
    assert set(column(r, "status")) == {"finished"}
    seen: set[int] = set()
    expected = ideal = 0
    # requests arrive far apart and finish before the next: trace order is completion order
    by_arrival = sorted(zip(column(r, "arrival_s"), range(r.requests.num_rows)))
    hashes = trace.column("prefix_hashes").to_pylist()
    prompts = trace.column("prompt_tokens").to_pylist()
    ids = column(r, "request_id")
    for _, i in by_arrival:
        row = ids[i]  # the trace row of this result row
        blocks = hashes[row]
        hit = 0
        while hit < len(blocks) and blocks[hit] in seen:
            hit += 1
        ideal += hit * 16
        expected += min(hit * 16, prompts[row] - 1)
        seen.update(blocks)
    assert expected > 0
    assert sum(column(r, "cached_tokens")) == expected
    assert ideal == pytest.approx(prefix_reuse_share(trace) * sum(prompts), abs=0.5)


def test_prefix_affinity_routing_beats_round_robin_on_a_multi_turn_trace():
    """Four replicas, multi-turn sessions whose turns carry the conversation so far and tenants'
    system prompts: routing each turn to the replica that holds its prefix serves more from cache
    and starts answers sooner than spreading turns round-robin."""
    trace = synth_trace(n=1200, rate=6.0, tenants="a=1,b=1,c=1", shared_prefix_tokens=512, turns=6.0, think_s=3.0,
                        prompt="lognormal:400:0.6", output="lognormal:60:0.6", prefix_block_tokens=16, seed=4)
    runner = "linear:base=0.01,prefill_token=0.0002,decode_seq=0.0002"
    results = {router: run(trace, runner=runner, replicas=4, router=router, num_gpu_blocks=3000)
               for router in ("round-robin", "prefix-affinity", "session")}
    cached = {name: sum(column(r, "cached_tokens")) for name, r in results.items()}
    ttft = {name: sum(column(r, "ttft_s")) / r.requests.num_rows for name, r in results.items()}
    assert cached["prefix-affinity"] > 1.3 * cached["round-robin"], cached
    assert ttft["prefix-affinity"] < ttft["round-robin"], (ttft, cached)
    assert cached["session"] > cached["round-robin"], cached  # a session's turns find their own history


def test_the_prefix_cache_view_gives_hit_rates_overall_per_tenant_and_per_replica(tmp_path):
    from servelab.api import write_run
    from servelab.scoring import connect

    trace = hashed([0, 20, 40], [64, 64, 64], [1, 1, 1], [chain(1, 4)] * 3, tenant=["a", "b", "a"])
    write_run(run(trace, runner=RUNNER, replicas=2, router="prefix-affinity"), tmp_path / "r")
    con = connect([tmp_path / "r"])
    rows = con.execute("SELECT scope, name, prompt_tokens, cached_tokens, hit_rate FROM prefix_cache").fetchall()
    overall = [r for r in rows if r[0] == "overall"]
    assert overall == [("overall", None, 192, 126, 126 / 192)]  # the 2nd and 3rd reuse 63 tokens each
    assert {r[1]: r[3] for r in rows if r[0] == "tenant"} == {"a": 63, "b": 63}
    assert sum(r[3] for r in rows if r[0] == "replica") == 126


def test_the_report_says_what_the_prefix_cache_served(tmp_path):
    from servelab.api import write_run
    from servelab.scoring import connect
    from servelab.scoring.report import render_text

    trace = hashed([0, 20, 40], [64, 64, 64], [1, 1, 1], [chain(1, 4)] * 3)
    write_run(run(trace, runner=RUNNER), tmp_path / "on")
    write_run(run(trace, runner=RUNNER, enable_prefix_caching=False), tmp_path / "off")
    on = render_text(connect([tmp_path / "on"]), width=120)
    assert "prefix cache: 126 of 192 prompt tokens served from cache" in on
    assert "prefix cache" not in render_text(connect([tmp_path / "off"]), width=120)


@pytest.mark.parametrize("tb, settings", [
    (128, {"num_gpu_blocks": 700, "max_num_batched_tokens": 100}),  # chunks end mid hash block; KV pressure
    (128, {"num_gpu_blocks": 500, "policy": "srpt", "policy_params": {"preempt": True}, "max_num_seqs": 6}),
    (48, {"num_gpu_blocks": 500, "preemption": "swap", "kv_bytes_per_token": 1024, "swap_space_gb": 0.0003}),
    (48, {"replicas": 3, "router": "prefix-affinity", "num_gpu_blocks": 400, "prefix_cache_scope": "tenant"}),
])
def test_hash_blocks_of_many_engine_blocks_behave_as_one_hash_per_engine_block(tb, settings):
    """The cache keeps a trace block's engine blocks together (one entry per hash); giving every engine
    block its own hash instead (the same equalities, 16-token hash blocks) must not change one result."""
    trace = synth_trace(n=400, rate=8.0, tenants="a=1,b=1", shared_prefix_tokens=200, turns=4.0, think_s=1.0,
                        prompt="lognormal:300:0.7", output="lognormal:30:0.7", prefix_block_tokens=tb, seed=9)
    per = tb // 16
    fine = [[h * per + k for h in chain_ for k in range(per)] for chain_ in trace.column("prefix_hashes").to_pylist()]
    table = trace.drop_columns(["prefix_hashes"]).append_column("prefix_hashes", pa.array(fine, pa.list_(pa.int64())))
    table = table.replace_schema_metadata({**(trace.schema.metadata or {}), b"prefix_block_tokens": b"16"})
    runner = "linear:base=0.01,prefill_token=0.0004,decode_seq=0.0002"
    coarse_r, fine_r = run(trace, runner=runner, **settings), run(table, runner=runner, **settings)
    assert sum(column(coarse_r, "cached_tokens")) > 0
    assert sum(column(coarse_r, "num_preemptions")) > 0 or settings.get("replicas")
    for name in ("cached_tokens", "ttft_s", "finish_s", "num_preemptions", "replica"):
        assert column(coarse_r, name) == column(fine_r, name), name


class TableRecorder:
    """The linear cost model, but asking for block tables: the KV manager then names the cache's
    blocks with real ids (replay/core/kv/block_names.py); records each step's (request id, block table)."""

    needs_block_tables = True

    def __init__(self, spec: str):
        from servelab.runners.base import make_runner

        self.inner = make_runner(spec)
        self.name = self.inner.name
        self.tables: dict[int, list[list[int]]] = {}

    def make_allocator(self, replica_id, num_blocks):
        from servelab.runners.paged_kv import BlockAllocator

        return BlockAllocator(num_blocks)

    def step_time(self, plan):
        for item in plan.items:
            self.tables.setdefault(item.request.request_id, []).append(list(item.request.block_table))
        return self.inner.step_time(plan)

    def decode_affine(self, num_seqs):
        return None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_real_block_ids_follow_the_cache_shared_on_hits_reused_only_after_eviction():
    """The eviction timeline above, with ids (8 blocks, handed out lowest first). A takes 0-3, B 4-7;
    both stay cached (queue: A's run, B's run). C's 2 blocks evict A3, A2: C gets ids 2, 3. D = A hits
    A0, A1 (ids 0, 1: A's) and its 2 new blocks evict B3, B2: ids 6, 7. E = B hits B0, B1 (4, 5) and
    evicts C's run (2, 3), the head of the queue once B0, B1 left it."""
    from servelab.api import EngineConfig, ReplayConfig, replay

    trace = hashed([0, 20, 40, 60, 80], [64, 64, 32, 64, 64], [1] * 5,
                   [chain(1, 4), chain(2, 4), chain(3, 2), chain(1, 4), chain(2, 4)])
    runner = TableRecorder(RUNNER)
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=8), policy="sarathi", runner=RUNNER)
    r = replay(trace, cfg, runner=runner)
    assert column(r, "cached_tokens") == [0, 0, 0, 32, 32]
    assert column(r, "ttft_s") == [17.0, 17.0, 9.0, 9.0, 9.0]  # the same timeline as without ids
    assert runner.tables == {0: [[0, 1, 2, 3]], 1: [[4, 5, 6, 7]], 2: [[2, 3]], 3: [[0, 1, 6, 7]], 4: [[4, 5, 2, 3]]}
