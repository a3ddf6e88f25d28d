"""Offload tiers below GPU memory (replay/core/kv/tiers.py) and the purge list, against hand-traced timelines.

Timelines use ``linear:base=1,prefill_token=0.25`` (an iteration computing p prompt tokens takes
1 + p/4 s), 16-token blocks and 16-token hash blocks, and 1 MB of KV per token (a block: 16 MB), so
that loading b blocks from a tier of read bandwidth R GB/s and latency L ms takes b * 16e6 / (R * 1e9)
+ L / 1e3 seconds.
"""

from __future__ import annotations

import json

import pytest

from helpers_engine import column, run
from servelab.common.errors import ServelabError
from servelab.replay.config import EngineConfig
from servelab.traces.synth import synth_trace
from test_prefix_cache import RUNNER, chain, hashed

MB_PER_TOKEN = {"kv_bytes_per_token": 1_000_000}
DRAM = "dram:capacity_gb=1,read_gbps=32,write_gbps=16,latency_ms=0.5"


def load_s(blocks: int, read_gbps: float, latency_ms: float) -> float:
    return blocks * 16 * 1e6 / (read_gbps * 1e9) + latency_ms / 1e3


def evicting_trace(**extra):
    """A (4 blocks) runs alone on a 5-block GPU; B (79 tokens, other hashes) takes all 5 blocks,
    evicting A's 4 cached ones; C repeats A's prompt: nothing of it is left in GPU memory."""
    return hashed([0, 20, 60], [64, 79, 64], [1, 1, 1], [chain(1, 4), chain(2, 4), chain(1, 4)], **extra)


def test_a_dram_hit_adds_exactly_bytes_over_bandwidth_plus_latency():
    trace = evicting_trace()
    gpu_only = run(trace, runner=RUNNER, num_gpu_blocks=5)
    assert column(gpu_only, "cached_tokens") == [0, 0, 0] and column(gpu_only, "ttft_s") == [17.0, 20.75, 17.0]
    r = run(trace, runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), **MB_PER_TOKEN)
    # C finds A's 4 blocks in DRAM (written back when B evicted them): it loads them, computes its last
    # token (1.25 s) and the load comes first.
    assert column(r, "cached_tokens") == [0, 0, 63]
    assert column(r, "cached_tokens_dram") == [0, 0, 63] and column(r, "cached_tokens_gpu") == [0, 0, 0]
    assert column(r, "ttft_s")[:2] == [17.0, 20.75]
    assert column(r, "ttft_s")[2] == pytest.approx(1.25 + load_s(4, 32, 0.5), rel=1e-12, abs=0)
    assert column(r, "kv_load_s") == [0.0, 0.0, pytest.approx(load_s(4, 32, 0.5), rel=1e-12)]
    (tier,) = r.meta["kv_tiers"]
    # written: A's 4 blocks (evicted by B), then 3 of B's 4 full blocks (C's 4 loaded blocks take the
    # free partial block and 3 cached ones); read: A's 4
    assert (tier["bytes_written"], tier["bytes_read"]) == (7 * 16_000_000, 4 * 16_000_000)


def test_a_slower_tier_costs_more_and_a_small_tier_keeps_the_prefix():
    trace = evicting_trace()
    ssd = run(trace, runner=RUNNER, num_gpu_blocks=5, kv_tiers=("ssd:capacity_gb=1,read_gbps=4,latency_ms=2",),
              **MB_PER_TOKEN)
    assert column(ssd, "ttft_s")[2] == pytest.approx(1.25 + load_s(4, 4, 2), rel=1e-12)
    # 0.03 GB holds one 16 MB block: A's blocks are evicted tail first, so A's first block stays: C loads
    # it and computes the other 48 tokens (1 + 12 s)
    tiny = run(trace, runner=RUNNER, num_gpu_blocks=5, kv_tiers=("dram:capacity_gb=0.03,read_gbps=32,latency_ms=0.5",),
               **MB_PER_TOKEN)
    assert column(tiny, "cached_tokens_dram") == [0, 0, 16]
    assert column(tiny, "ttft_s")[2] == pytest.approx(13 + load_s(1, 32, 0.5), rel=1e-12)


def test_the_second_tier_receives_what_the_first_evicts():
    # DRAM holds 4 blocks. B evicts A's 4 into it; X (79 tokens) evicts B's 4, which push A's down to the
    # SSD, where C finds them.
    trace = hashed([0, 20, 60, 100], [64, 79, 79, 64], [1] * 4, [chain(1, 4), chain(2, 4), chain(3, 4), chain(1, 4)])
    r = run(trace, runner=RUNNER, num_gpu_blocks=5, **MB_PER_TOKEN,
            kv_tiers=("dram:capacity_gb=0.064,read_gbps=32,latency_ms=0.5", "ssd:capacity_gb=1,read_gbps=4,latency_ms=2"))
    assert column(r, "cached_tokens_dram") == [0, 0, 0, 0] and column(r, "cached_tokens_ssd") == [0, 0, 0, 63]
    assert column(r, "ttft_s")[3] == pytest.approx(1.25 + load_s(4, 4, 2), rel=1e-12)


def test_write_through_writes_when_computed_and_eviction_writes_nothing():
    r = run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), kv_tier_write="through",
            **MB_PER_TOKEN)
    assert column(r, "cached_tokens_dram") == [0, 0, 63]
    (tier,) = r.meta["kv_tiers"]
    # A's 4 blocks and B's 4 when computed; C's (loaded from DRAM, then cached in GPU memory) are there already
    assert tier["bytes_written"] == 8 * 16_000_000 and tier["bytes_read"] == 4 * 16_000_000


def test_a_remote_tier_is_shared_by_the_replicas():
    # round-robin over 2 replicas: A and X on replica 0 (X evicts A into the store), B and C = A on
    # replica 1, which never computed A: only the shared store can serve C.
    trace = hashed([0, 20, 40, 60], [64, 64, 79, 64], [1] * 4, [chain(1, 4), chain(2, 4), chain(3, 4), chain(1, 4)])
    remote = "remote:capacity_gb=1,read_gbps=10,latency_ms=1"
    r = run(trace, runner=RUNNER, num_gpu_blocks=5, replicas=2, kv_tiers=(remote,), **MB_PER_TOKEN)
    assert column(r, "replica") == [0, 1, 0, 1]
    assert column(r, "cached_tokens_remote") == [0, 0, 0, 63]
    assert column(r, "ttft_s")[3] == pytest.approx(1.25 + load_s(4, 10, 1), rel=1e-12)
    per_replica = run(trace, runner=RUNNER, num_gpu_blocks=5, replicas=2, kv_tiers=(remote + ",shared=0",),
                      **MB_PER_TOKEN)
    assert column(per_replica, "cached_tokens") == [0, 0, 0, 0]


def test_a_purged_tenants_blocks_are_dropped_from_every_tier_when_its_requests_end():
    trace = hashed([0, 20, 40], [64, 64, 64], [1, 1, 1], [chain(1, 4), chain(2, 4), chain(1, 4)],
                   tenant=["secret", "other", "secret"])
    kept = run(trace, runner=RUNNER, num_gpu_blocks=64)
    assert column(kept, "cached_tokens") == [0, 0, 63]
    purged = run(trace, runner=RUNNER, num_gpu_blocks=64, purge_tenants=("secret",))
    assert column(purged, "cached_tokens") == [0, 0, 0]
    # with write-through, A's blocks were in DRAM as soon as computed: purged there too
    tiered = run(trace, runner=RUNNER, num_gpu_blocks=64, purge_tenants=("secret",), kv_tiers=(DRAM,),
                 kv_tier_write="through", **MB_PER_TOKEN)
    assert column(tiered, "cached_tokens") == [0, 0, 0]
    # another tenant's repeated prompt still hits
    other = hashed([0, 20, 40], [64, 64, 64], [1, 1, 1], [chain(2, 4), chain(1, 4), chain(2, 4)],
                   tenant=["other", "secret", "other"])
    assert column(run(other, runner=RUNNER, num_gpu_blocks=64, purge_tenants=("secret",)), "cached_tokens") == [0, 0, 63]


def test_hit_rate_falls_with_gpu_capacity_and_a_dram_tier_recovers_part_of_the_loss():
    trace = synth_trace(n=600, rate=4.0, tenants="a=1,b=1,c=1", shared_prefix_tokens=512, turns=5.0, think_s=2.0,
                        prompt="lognormal:300:0.6", output="lognormal:20:0.6", prefix_block_tokens=16, seed=3)
    # requests seldom overlap (a few ms each, 4 a second): the GPU cache is what limits reuse, not
    # which requests happen to run together
    runner = "linear:base=0.001,prefill_token=0.000001,decode_seq=0.00001"
    prompts = sum(column(run(trace, runner=runner, enable_prefix_caching=False), "prompt_tokens"))

    def rate(**engine) -> float:
        return sum(column(run(trace, runner=runner, **engine), "cached_tokens")) / prompts

    sweep = [rate(num_gpu_blocks=blocks) for blocks in (100_000, 6000, 3000, 1500, 800)]
    assert all(a >= b for a, b in zip(sweep, sweep[1:])), sweep
    assert sweep[0] > sweep[-1] + 0.1, sweep  # the small caches do lose hits
    with_dram = rate(num_gpu_blocks=800, kv_tiers=("dram:capacity_gb=0.2",), kv_bytes_per_token=4096)
    assert sweep[-1] < with_dram <= sweep[0], (sweep, with_dram)


@pytest.mark.parametrize("spec, message", [
    ("dram", "needs capacity_gb"),
    ("dram:capacity_gb=x", "as numbers"),
    ("nvme:capacity_gb=10", "as numbers"),
    ("dram:capacity_gb=10,speed=3", "unknown field 'speed'"),
    ("dram:capacity_gb=10,read_gbps=0", "bandwidths > 0"),
])
def test_a_bad_tier_spec_is_a_one_line_error(spec, message):
    with pytest.raises(ServelabError, match=message):
        EngineConfig(kv_tiers=(spec,))


def test_tiers_need_the_kv_size_and_prefix_caching():
    trace = evicting_trace()
    with pytest.raises(ServelabError, match="KV size per token"):
        run(trace, runner=RUNNER, kv_tiers=(DRAM,))
    with pytest.raises(ServelabError, match="need enable_prefix_caching"):
        run(trace, runner=RUNNER, kv_tiers=(DRAM,), enable_prefix_caching=False, **MB_PER_TOKEN)


def test_tiers_in_a_toml_config_and_in_run_json(tmp_path):
    from servelab.api import write_run
    from servelab.replay.config import ReplayConfig

    path = tmp_path / "c.toml"
    path.write_text('kv_tiers = ["dram:capacity_gb=64", "ssd:capacity_gb=1000"]\nkv_tier_write = "through"\n'
                    'purge_tenants = ["secret"]\n')
    cfg = ReplayConfig.from_toml(path)
    assert cfg.engine.kv_tiers == ("dram:capacity_gb=64", "ssd:capacity_gb=1000")
    assert cfg.engine.purge_tenants == ("secret",) and cfg.engine.kv_tier_write == "through"
    r = run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), **MB_PER_TOKEN)
    meta = json.loads((write_run(r, tmp_path / "run") / "run.json").read_text())
    assert meta["kv_tiers"][0]["name"] == "dram" and meta["kv_tiers"][0]["bytes_read"] == 4 * 16_000_000


def test_views_give_hit_rate_per_tier_and_the_ttft_breakdown(tmp_path):
    from servelab.api import write_run
    from servelab.scoring import connect

    r = run(evicting_trace(tenant=["a", "b", "a"]), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), **MB_PER_TOKEN)
    write_run(r, tmp_path / "r")
    con = connect([tmp_path / "r"])
    rows = con.execute("SELECT tier, cached_tokens, prompt_tokens, hit_rate FROM kv_tiers "
                       "WHERE scope = 'overall' ORDER BY tier").fetchall()
    assert rows == [("dram", 63, 207, 63 / 207), ("gpu", 0, 207, 0.0)]
    tenant = con.execute("SELECT name, cached_tokens FROM kv_tiers WHERE scope = 'tenant' AND tier = 'dram' "
                         "ORDER BY name").fetchall()
    assert tenant == [("a", 63), ("b", 0)]
    (row,) = con.execute("SELECT requests, mean_ttft_s, mean_queue_s, mean_load_s, mean_compute_s FROM ttft_breakdown "
                         "WHERE scope = 'overall'").fetchall()
    load = load_s(4, 32, 0.5)
    assert row[0] == 3
    assert row[1] == pytest.approx((17 + 20.75 + 1.25 + load) / 3)
    assert row[2] == pytest.approx(0.0) and row[3] == pytest.approx(load / 3)
    assert row[4] == pytest.approx((17 + 20.75 + 1.25) / 3)
    # bytes moved: B's step wrote back A's 4 cached blocks, C's loaded them and wrote back 3 of B's
    # (test_each_step_logs_the_bytes_it_moved_between_tiers), 16 MB a block
    (moved,) = con.execute("SELECT replica, bytes_moved, max_step_bytes, steps_moving FROM kv_bytes_moved").fetchall()
    assert moved == (0, 11 * 16_000_000, 7 * 16_000_000, 2)


def test_the_tier_views_count_only_the_requests_the_run_was_offered(tmp_path):
    """A horizon before C's arrival (60 s): C was never offered, so its prompt is in no tier's share
    (before, kv_tiers divided by every row's prompt tokens, horizon or not)."""
    from servelab.api import write_run
    from servelab.scoring import connect

    r = run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), until_s=50.0, **MB_PER_TOKEN)
    write_run(r, tmp_path / "r")
    con = connect([tmp_path / "r"])
    rows = con.execute("SELECT tier, prompt_tokens FROM kv_tiers WHERE scope = 'overall' ORDER BY tier").fetchall()
    assert rows == [("dram", 64 + 79), ("gpu", 64 + 79)]
    (row,) = con.execute("SELECT requests FROM ttft_breakdown WHERE scope = 'overall'").fetchall()
    assert row == (2,)


def test_the_report_shows_each_tier_and_the_ttft_breakdown(tmp_path):
    from servelab.api import write_run
    from servelab.scoring import connect
    from servelab.scoring.report import render_text

    write_run(run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), **MB_PER_TOKEN), tmp_path / "r")
    text = render_text(connect([tmp_path / "r"]), width=140)
    assert "by tier: dram 63 (30.4%), gpu 0 (0.0%)" in text, text
    assert "KV load 0.8 + compute" in text  # 2.5 ms / 3 requests, in ms as every latency of the report


def test_swap_preemption_uses_the_dram_tier_at_its_bandwidths_and_latency():
    """tests/test_engine.py's swap timeline with a DRAM tier instead of the host pool: B holds 3 blocks
    (48 tokens x 1 MB) when swapped out: 48 MB / 0.5 GB/s + 2 ms out, 48 MB / 1 GB/s + 2 ms back in."""
    from conftest import make_trace

    trace = make_trace([0, 0.5], [16, 16], [40, 40])
    dram = "dram:capacity_gb=1,read_gbps=1,write_gbps=0.5,latency_ms=2"
    r = run(trace, runner="linear:base=1", num_gpu_blocks=6, block_size=16, preemption="swap",
            kv_tiers=(dram,), **MB_PER_TOKEN)
    assert column(r, "num_preemptions") == [0, 1]
    assert sum(r.steps.column("prefill_tokens").to_pylist()) == 32  # nothing recomputed
    out_s, in_s = 0.048 / 0.5 + 0.002, 0.048 / 1 + 0.002
    durations = r.steps.column("duration_s").to_pylist()
    assert any(d == pytest.approx(1 + out_s) for d in durations)
    iterations = sum(r.steps.column("num_iterations").to_pylist())
    assert sum(durations) == pytest.approx(iterations + out_s + in_s)
    assert r.meta["engine"]["swap_host_blocks"] == 62  # the tier's 1 GB of 16 MB blocks, not swap_space_gb
    (tier,) = r.meta["kv_tiers"]
    assert tier["bytes_written"] == tier["bytes_read"] == 48_000_000
    # a tier too small for B's 3 blocks: recompute instead
    small = run(trace, runner="linear:base=1", num_gpu_blocks=6, block_size=16, preemption="swap",
                kv_tiers=("dram:capacity_gb=0.04",), **MB_PER_TOKEN)
    assert sum(small.steps.column("prefill_tokens").to_pylist()) > 32 and small.meta["swap_fallbacks"] == 1


@pytest.mark.parametrize("spec, load", [
    (DRAM, load_s(4, 32, 0.5)),  # 2.5 ms, shorter than C's 1.25 s of compute: hidden but for one layer's share
    ("dram:capacity_gb=1,read_gbps=0.032,latency_ms=0", load_s(4, 0.032, 0)),  # 2 s: the compute hides under it
])
def test_an_overlapped_load_costs_the_longer_of_load_and_compute_plus_one_layer_of_the_shorter(spec, load):
    layers = 4
    r = run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(spec,), kv_load_overlap_layers=layers,
            **MB_PER_TOKEN)
    assert column(r, "cached_tokens_dram") == [0, 0, 63]
    compute = 1.25
    expected = max(load, compute) + min(load, compute) / layers
    assert column(r, "ttft_s")[2] == pytest.approx(expected, rel=1e-12)
    serial = run(evicting_trace(), runner=RUNNER, num_gpu_blocks=5, kv_tiers=(spec,), **MB_PER_TOKEN)
    assert column(serial, "ttft_s")[2] == pytest.approx(compute + load, rel=1e-12)
    assert column(serial, "ttft_s")[2] > column(r, "ttft_s")[2]


def test_prefix_affinity_prefers_the_replica_holding_the_prefix_in_gpu_memory_over_the_shared_store():
    # B goes to replica 0, A (arriving while B runs) to replica 1; with write-through A's blocks are in
    # the shared store too. C = A, both replicas idle: each would serve 63 tokens, replica 1 from its GPU.
    trace = hashed([0, 0.5, 40], [64, 64, 64], [1] * 3, [chain(2, 4), chain(1, 4), chain(1, 4)])
    r = run(trace, runner=RUNNER, num_gpu_blocks=64, replicas=2, router="prefix-affinity",
            kv_tiers=("remote:capacity_gb=1",), kv_tier_write="through", **MB_PER_TOKEN)
    assert column(r, "replica") == [0, 1, 1]
    assert column(r, "cached_tokens_gpu") == [0, 0, 63] and column(r, "kv_load_s")[2] == 0.0


@pytest.mark.parametrize("purge", [False, True])
def test_a_purged_tenants_request_dropped_after_a_preemption_leaves_nothing_cached(purge):
    """A (tenant "secret", 96 tokens: 4 hashed blocks, then 2 of its own) computes its prompt on a
    16-block GPU over a write-through DRAM tier, is preempted by recompute (its own 2 blocks stay
    as a segment only it can hit, its 4 hashed blocks stay cached, in GPU and DRAM) and is then
    dropped while waiting (``KVManager.forget``, called by Platform.drop). Kept: A would hit 95
    tokens (all but its last) and B (another tenant, A's 64-token hashed prefix) 63. Purged: nothing
    is left in any tier; every block is plainly free again."""
    from servelab.replay.core.kv.manager import KVManager
    from servelab.replay.core.kv.prefix_cache import PrefixCache
    from servelab.replay.core.request import Request
    from servelab.replay.core.kv.tiers import build_stacks, parse_tiers

    stack = build_stacks(parse_tiers((DRAM,)), 1, 16 * 1_000_000, True)[0]
    cache = PrefixCache(16, 16, 16, tiers=stack, purge=frozenset({"secret"} if purge else ()))
    kv = KVManager(16, 16, prefix_cache=cache)
    a = Request(0, 0.0, 96, 4, tenant="secret", prefix_hashes=chain(1, 4), index=0)
    b = Request(1, 0.0, 64, 4, tenant="other", prefix_hashes=chain(1, 4), index=1)
    kv.grow(a, 6)
    a.num_computed_tokens = 96
    kv.register(a)
    assert stack.tiers[0].used == 4  # written through as computed
    kv.release(a, may_return=True)  # preempted by recompute
    a.num_computed_tokens = 0
    kv.check([])
    assert kv.cached_tokens(a) == 95 and kv.cached_tokens(b) == 63
    kv.forget(a)  # dropped while waiting
    kv.check([])
    if not purge:
        assert kv.cached_tokens(a) == 95 and kv.cached_tokens(b) == 63 and stack.tiers[0].used == 4
        return
    assert kv.cached_tokens(a) == 0 and kv.cached_tokens(b) == 0
    assert cache.entries == {} and cache.segments == {} and stack.tiers[0].used == 0
    assert kv.used == 0 and kv.free == 16 and cache.queued == 16


def test_in_a_replay_a_purged_tenants_preempted_then_dropped_requests_leave_nothing_cached(monkeypatch):
    """srpt preempting by recompute under KV pressure, edf-style shedding by a queue cap, tenant "a"
    purged over a write-through DRAM tier: right after each drop of a request of "a" that had been
    preempted, no own segment of it is left, and none of its prompt's entries is cached in DRAM, nor
    in GPU memory unless a running request holds it."""
    from servelab.replay.core.engine import Engine
    from servelab.replay.platform.hooks import Platform

    checked, dropped = [], []
    real_drop, real_enact = Platform.drop, Engine.enact

    def drop(self, replica, req, reason):
        dropped.append((replica, req))
        return real_drop(self, replica, req, reason)

    def enact(self, intents, now):  # a drop takes effect when the engine applies its intents
        out = real_enact(self, intents, now)
        while dropped:
            replica, req = dropped.pop()
            if replica is None or req.tenant != "a" or not req.num_preemptions:
                continue
            cache = replica.kv.cache
            assert req.index not in cache.segments
            hashed = cache.hashed_blocks(req)
            for key, _, _ in cache.groups(req, 0, hashed) if hashed else ():
                e = cache.entries.get(key)
                assert e is None or (e.top and not e.runs), key
                assert all(key not in tier.store for tier in cache.tiers.tiers), key
            replica.kv.check(replica.running)
            checked.append(req.request_id)
        return out

    monkeypatch.setattr(Platform, "drop", drop)
    monkeypatch.setattr(Engine, "enact", enact)
    trace = synth_trace(n=300, rate=40.0, tenants="a=1,b=1", shared_prefix_tokens=256, turns=3.0, think_s=0.5,
                        prompt="lognormal:700:1.0", output="lognormal:150:1.0", prefix_block_tokens=32, seed=2,
                        tiers="priority=1,standard=1,flex=1")
    run(trace, policy="srpt", policy_params={"preempt": True},
        runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", num_gpu_blocks=350, max_num_seqs=8,
        queue_cap=12, purge_tenants=("a",), kv_tiers=("dram:capacity_gb=0.0005",), kv_tier_write="through",
        kv_bytes_per_token=1024)
    assert checked  # the path ran


def test_each_step_logs_the_bytes_it_moved_between_tiers():
    """steps.parquet ``tier_bytes``, hand-traced on the evicting timeline (16 MB blocks, write-back
    DRAM): A's step moves nothing; B's allocation evicts A's 4 cached blocks, written back (64 MB);
    C loads them (64 MB read) and its 4 GPU blocks take the free partial block and evict 3 of B's,
    written back (48 MB). Without tiers the column is null."""
    trace = evicting_trace()
    r = run(trace, runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), **MB_PER_TOKEN)
    block = 16_000_000
    assert r.steps.column("tier_bytes").to_pylist() == [0, 4 * block, 4 * block + 3 * block]
    (tier,) = r.meta["kv_tiers"]
    assert sum(r.steps.column("tier_bytes").to_pylist()) == tier["bytes_written"] + tier["bytes_read"]
    through = run(trace, runner=RUNNER, num_gpu_blocks=5, kv_tiers=(DRAM,), kv_tier_write="through", **MB_PER_TOKEN)
    # write-through: A's 4 blocks are written as computed (A's step), B's 4 full ones as computed (B's
    # step); C loads A's 4 (its own blocks are in DRAM already: nothing written back)
    assert through.steps.column("tier_bytes").to_pylist() == [4 * block, 4 * block, 4 * block]
    gpu_only = run(trace, runner=RUNNER, num_gpu_blocks=5)
    assert gpu_only.steps.column("tier_bytes").to_pylist() == [None, None, None]
