"""Policies and KV for agents (#28 item 5): least attained service per task, KV retention across
tool waits, task-affinity routing. Timelines are hand-computed on the linear runner."""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import checking_engine, column, run

from servelab.common.errors import ServelabError

ONE_AT_A_TIME = dict(max_num_seqs=1, max_num_batched_tokens=4096)


# -- las ----------------------------------------------------------------------------------------
def _las_trace():
    """Task 1's first call (1 + 3 tokens of service) runs alone from t=0 to t=3 (1 s iterations:
    prefill + first token, then two decodes); task 1's second call and task 2's first wait."""
    return make_trace([0.0, 0.5, 0.6], [1, 1, 1], [3, 2, 2], session_id=[1, 1, 2])


def test_las_serves_the_least_served_task_first():
    fcfs = run(_las_trace(), policy="sarathi", **ONE_AT_A_TIME)
    assert column(fcfs, "finish_s") == [3.0, 5.0, 7.0]
    las = run(_las_trace(), policy="las", **ONE_AT_A_TIME)
    # at t=3 task 1 has 4 tokens of service, task 2 none: task 2's call goes first
    assert column(las, "first_scheduled_s") == [0.0, 5.0, 3.0]
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def test_las_weights_count_service():
    # w_in = 0, w_out = 0.1: task 1 has 0.3; task 2 none still: the same order
    las = run(_las_trace(), policy="las", policy_params={"w_in": 0, "w_out": 0.1}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def test_las_requests_without_session_are_their_own_tasks():
    trace = make_trace([0.0, 0.5, 0.6], [1, 1, 1], [3, 2, 2])
    # every task has 0 service at t=3 (the first call's task is done): arrival order
    assert column(run(trace, policy="las", **ONE_AT_A_TIME), "finish_s") == [3.0, 5.0, 7.0]


def test_las_starvation_bound_promotes_the_oldest():
    # task 1's second call has waited 2.5 s at t=3: past a 1 s bound it goes first, oldest first
    las = run(_las_trace(), policy="las", policy_params={"max_wait_s": 1.0}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 5.0, 7.0]
    # a 3 s bound is not reached by then: least attained service decides
    las = run(_las_trace(), policy="las", policy_params={"max_wait_s": 3.0}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def _starving_trace(n_new=30):
    """Task 1 (two calls) against a stream of new one-call tasks arriving faster than they are served:
    each new task has no service, so without a bound task 1's second call waits for all of them."""
    arrivals = [0.0, 0.1] + [0.2 + i for i in range(n_new)]
    return make_trace(arrivals, [1] * len(arrivals), [3, 2] + [2] * n_new,
                      session_id=[1, 1] + list(range(2, 2 + n_new)))


def test_las_without_bound_starves_a_served_task():
    las = run(_starving_trace(), policy="las", **ONE_AT_A_TIME)
    start = column(las, "first_scheduled_s")
    assert start[1] == max(start)  # served last of all


@pytest.mark.parametrize("bound", [2.0, 5.0, 11.0])
def test_las_starvation_bound_holds(bound):
    """Task 1's second call waits at most the bound plus the service under way when it is reached
    (one at a time; the longest service: 3 s), and requests that reached the bound are served
    oldest first (the stream overloads the replica, so most of them do)."""
    las = run(_starving_trace(), policy="las", policy_params={"max_wait_s": bound}, **ONE_AT_A_TIME)
    arrival, start = column(las, "arrival_s"), column(las, "first_scheduled_s")
    assert start[1] - arrival[1] <= bound + 3.0
    assert start[1] < max(start)
    starved = sorted((s, a) for a, s in zip(arrival, start) if s - a >= bound + 3.0)
    assert len(starved) > 5
    assert [a for _, a in starved] == sorted(a for _, a in starved)


def test_las_params_are_checked():
    with pytest.raises(ServelabError, match="max_wait_s"):
        run(_las_trace(), policy="las", policy_params={"max_wait_s": -1})
    with pytest.raises(ServelabError, match="w_in and w_out"):
        run(_las_trace(), policy="las", policy_params={"w_in": 0, "w_out": 0})


def test_las_does_not_count_cached_prefix_as_service(monkeypatch):
    """Task 1's second call reuses its first call's two full 16-token blocks from the prefix cache:
    only its 17 other prompt tokens and its output count (task 1: 33 + 1, then 17 + 1; task 2: 21 + 1)."""
    from servelab.policies.las import LeastAttainedService

    seen = {}
    orig = LeastAttainedService.on_step

    def spy(self, batch, num_iterations):
        orig(self, batch, num_iterations)
        seen.update(self.attained)

    monkeypatch.setattr(LeastAttainedService, "on_step", spy)
    trace = make_trace([0.0, 5.0, 10.0], [33, 49, 21], [1, 1, 1], session_id=[1, 1, 2],
                       prefix_hashes=[[1, 2, 3], [1, 2, 4, 5], [9, 10]])
    trace = trace.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    result = run(trace, policy="las", **ONE_AT_A_TIME)
    assert column(result, "cached_tokens")[1] == 32
    assert seen == {1: 33 + 1 + 17 + 1, 2: 21 + 1}


# -- kv retention -------------------------------------------------------------------------------
RET_RUNNER = "linear:base=1,prefill_token=0.01"
RET_ENGINE = dict(num_gpu_blocks=10, block_size=16, max_num_batched_tokens=64)


def _session_trace(c_prompt=96, think_s=20.0):
    """Session 1: call A (t=0, 32-token prompt, 17 output tokens: 48 tokens in KV at its end, 3
    blocks) then, ``think_s`` after A ends (t=17.64), call B (its prompt: A's 49 tokens + 15 new).
    E (t=0.5) ends at 31.64 leaving 2 cached blocks newer than A's; C (t=32, ``c_prompt`` tokens,
    no hashes) then needs 6 blocks of the 10, evicting cached blocks from the free queue's head."""
    t = make_trace([0.0, 0.0, 0.5, 32.0], [32, 64, 32, c_prompt], [17, 1, 30, 1],
                   session_id=[1, 1, None, None], think_s=[None, think_s, None, None],
                   prefix_hashes=[[1, 2], [1, 2, 3, 4], [7, 8], None])
    return t.replace_schema_metadata({b"prefix_block_tokens": b"16"})


def _check_pins(engine) -> None:
    """Each replica's KV adds up with the pinned contexts counted as holders (``KVManager.check``)."""
    for replica in engine.replicas:
        pins = engine.retention.holders(replica) if engine.retention is not None else []
        replica.kv.check(list(replica.running) + pins)


@pytest.fixture
def retained(monkeypatch):
    import servelab.assembly

    monkeypatch.setattr(servelab.assembly, "Engine", checking_engine(_check_pins, every=1))

    def go(mode, trace=None, runner=RET_RUNNER, **engine):
        return run(trace if trace is not None else _session_trace(), runner=runner, kv_retention=mode,
                   **{**RET_ENGINE, **engine})

    return go


def test_retention_keep_prefills_only_the_new_tokens(retained):
    lru, keep = retained("lru"), retained("keep")
    # lru: C evicted A's two cached prompt blocks (the oldest), B computes its whole prompt
    assert column(lru, "cached_tokens") == [0, 0, 0, 0]
    # keep: A's 3 blocks (its prompt and 16 of its 17 output tokens) were pinned: B reuses 48
    # tokens and computes 16 (its 15 new ones and A's last output token, never computed by A)
    assert column(keep, "cached_tokens") == [0, 48, 0, 0]
    b_start = column(keep, "first_scheduled_s")[1]
    assert column(keep, "first_token_s")[1] == pytest.approx(b_start + 1 + 0.01 * 16)
    assert column(lru, "first_token_s")[1] == pytest.approx(column(lru, "first_scheduled_s")[1] + 1 + 0.01 * 64)
    assert keep.meta["kv_retention"]["retained"] == 1 and keep.meta["kv_retention"]["admitted"] == 1
    assert keep.meta["kv_retention"]["continued_blocks"] == 1
    assert "kv_retention" not in lru.meta
    # the rest of the timeline is the same: the pin took no block anyone needed
    for name in ("finish_s",):
        a, b = column(lru, name), column(keep, name)
        assert [a[i] for i in (0, 2, 3)] == [b[i] for i in (0, 2, 3)]


def test_retention_keep_ttl_releases_the_pin(retained):
    # a 10 s TTL expires at 27.64, before C (32): A's blocks are cached again, the oldest: C evicts them
    short = retained("keep", kv_retention_ttl_s=10.0)
    assert column(short, "cached_tokens")[1] == 0
    assert short.meta["kv_retention"]["ttl"] == 1 and short.meta["kv_retention"]["admitted"] == 0
    # a 30 s TTL outlives the 20 s tool wait
    long = retained("keep", kv_retention_ttl_s=30.0)
    assert column(long, "cached_tokens")[1] == 48
    assert long.meta["kv_retention"]["ttl"] == 0


def test_retention_ttl_without_c_keeps_the_continued_context_cached(retained):
    """After the TTL, the pinned blocks are cached like any released ones: nothing evicts them here,
    so B still reuses A's prompt and output (which lru does not cache under B's hashes)."""
    trace = _session_trace().slice(0, 3)
    short = retained("keep", trace=trace, kv_retention_ttl_s=5.0)
    assert column(short, "cached_tokens")[1] == 48
    assert column(retained("lru", trace=trace), "cached_tokens")[1] == 32


def test_retention_keep_gives_way_under_memory_pressure(retained):
    # C needs 8 blocks + 1 to start while 7 are free: A's pin goes; C is never preempted
    keep = retained("keep", trace=_session_trace(c_prompt=128))
    assert keep.meta["kv_retention"]["pressure"] == 1
    assert column(keep, "num_preemptions") == [0, 0, 0, 0]
    lru = retained("lru", trace=_session_trace(c_prompt=128))
    assert column(keep, "finish_s")[3] == column(lru, "finish_s")[3]


def test_retention_offload_loads_the_context_from_the_tier(retained):
    tiers = dict(kv_tiers=("dram:capacity_gb=1",), kv_bytes_per_token=1024)
    off = retained("offload", **tiers)
    # A's 3 blocks went to DRAM at its end and left GPU memory first: B loads all 48 tokens from there
    assert column(off, "cached_tokens")[1] == 48
    assert column(off, "kv_load_s")[1] > 0
    # lru with the same tier: C's eviction wrote A's 2 prompt blocks back to DRAM: B loads 32
    lru = retained("lru", **tiers)
    assert column(lru, "cached_tokens")[1] == 32
    assert off.meta["kv_retention"]["retained"] == 1


def test_retention_is_deterministic(retained, tmp_path):
    from servelab.replay import write_run

    for name in ("a", "b"):
        result = retained("keep", kv_retention_ttl_s=30.0)
        result.meta["wall_time_s"] = 0.0
        write_run(result, tmp_path / name)
    for table in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes()


def test_retention_options_are_checked():
    from servelab.api import EngineConfig

    with pytest.raises(ServelabError, match="kv_retention must be one of"):
        EngineConfig(kv_retention="pin")
    with pytest.raises(ServelabError, match="applies to kv_retention = keep"):
        EngineConfig(kv_retention="offload", kv_retention_ttl_s=5.0)
    with pytest.raises(ServelabError, match="kv_retention_ttl_s must be"):
        EngineConfig(kv_retention="keep", kv_retention_ttl_s=0.0)
    with pytest.raises(ServelabError, match="set kv_tiers"):
        run(_session_trace(), kv_retention="offload")
    with pytest.raises(ServelabError, match="enable_prefix_caching"):
        run(_session_trace(), kv_retention="keep", enable_prefix_caching=False)


def _agentic(n=300, seed=7):
    from servelab.traces.synth import synth_trace

    return synth_trace(n=n, rate=2.0, turns=5.0, think_s=2.0, prompt="lognormal:60:0.5",
                       output="lognormal:30:0.5", prefix_block_tokens=16, shared_prefix_tokens=64,
                       tenants="a=1,b=1", seed=seed)


@pytest.mark.parametrize("mode,setup", [
    ("keep", dict(router="session")),
    ("keep", dict(router="round-robin", kv_retention_ttl_s=3.0)),
    ("keep", dict(router="session", preemption="swap", kv_bytes_per_token=1024, swap_space_gb=0.001)),
    ("keep", dict(router="session", fail=("replica=1,at=20,for=10",))),
    ("offload", dict(router="session", kv_tiers=("dram:capacity_gb=0.01",), kv_bytes_per_token=1024)),
])
def test_retention_keeps_the_kv_accounting_under_pressure(retained, mode, setup):
    """Sessions over two small replicas: every event keeps KV held = KV of running requests and pins
    (``_check_pins``), every request finishes or never fits, and every pin made is let go."""
    result = retained(mode, trace=_agentic(), runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
                      num_gpu_blocks=100, max_num_batched_tokens=256, replicas=2, **setup)
    statuses = column(result, "status")
    assert set(statuses) == {"finished", "rejected"}  # (sessions whose context outgrew a replica's KV)
    assert statuses.count("finished") > 250
    meta = result.meta["kv_retention"]
    assert meta["retained"] > 50 and meta["pins_left"] == 0
    if mode == "keep":
        released = sum(meta[k] for k in ("admitted", "moved", "ended", "ttl", "pressure", "failed"))
        assert released == meta["retained"]


# -- task-affinity routing ----------------------------------------------------------------------
def test_session_router_brings_a_task_back_to_its_kept_context(retained):
    """Two replicas; A and B of session 1, X and Y (other requests) arriving between them.
    Round-robin (by arrival: A, X, Y, B) sends B to replica 1: A's pin on replica 0 is released
    ("moved") and B reuses nothing; the session router sends B home, onto its pinned context."""
    t = make_trace([0.0, 0.0, 1.0, 2.0], [32, 64, 16, 16], [17, 1, 1, 1], session_id=[1, 1, None, None],
                   think_s=[None, 5.0, None, None], prefix_hashes=[[1, 2], [1, 2, 3, 4], [9], [10]])
    t = t.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    rr = retained("keep", trace=t, replicas=2, router="round-robin")
    assert column(rr, "replica") == [0, 1, 1, 0]
    assert column(rr, "cached_tokens")[1] == 0 and rr.meta["kv_retention"]["moved"] == 1
    sticky = retained("keep", trace=t, replicas=2, router="session")
    assert column(sticky, "replica")[1] == column(sticky, "replica")[0]
    assert column(sticky, "cached_tokens")[1] == 48 and sticky.meta["kv_retention"]["admitted"] == 1


# -- retention with dependent requests (trace schema v2) ------------------------------------------
def _v2_mix(block=16, tasks=80):
    from servelab.traces.agentic_synth import generate_agentic, make_agent_config

    return generate_agentic(make_agent_config(shape="mix", tasks=tasks, arrival={"rate_per_s": 6.0},
                                              prompt="lognormal:200:0.5", output="lognormal:40:0.5",
                                              new_tokens="lognormal:60:0.5", tool_s="exp:0.5",
                                              user_think_s="exp:0.5", prefix_block_tokens=block, seed=block))


@pytest.mark.parametrize("mode,setup", [
    ("keep", dict(router="session")),
    ("keep", dict(router="round-robin", kv_retention_ttl_s=0.3)),
    ("offload", dict(router="session", kv_tiers=("dram:capacity_gb=0.01",), kv_bytes_per_token=1024)),
])
def test_retention_with_dependent_requests(retained, mode, setup):
    """ReAct chains, fan-outs and chats (``depends_on``): a parent's context waits for all its
    children (a fan-out's branches share it); the accounting adds up after every event."""
    result = retained(mode, trace=_v2_mix(), runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
                      num_gpu_blocks=160, max_num_batched_tokens=256, replicas=2, **setup)
    assert set(column(result, "status")) == {"finished"}
    meta = result.meta["kv_retention"]
    assert meta["retained"] > 50 and meta["pins_left"] == 0
    if mode == "keep":
        assert meta["admitted"] > 0
        assert sum(meta[k] for k in ("admitted", "moved", "ended", "ttl", "pressure", "failed")) == meta["retained"]


def test_retention_keep_holds_a_fan_out_root_for_all_branches(retained):
    """A root then four branches (each the root's context + 16 new tokens) and an aggregator: the
    root's pin waits for the branches; the first one admitted takes it over, and every branch
    reuses the root's 64 computed tokens (its prompt and 16 of its output tokens: v2 hashes cover
    outputs). Each branch's pin waits for the aggregator, which releases all four."""
    import pyarrow as pa

    root = [1, 2, 3, 4]  # 16-token blocks over the root's 48-token prompt + 17 output tokens
    branches = [root[:4] + [10 + i] for i in range(4)]
    trace = make_trace([0.0] * 6, [48, 80, 80, 80, 80, 32], [17, 2, 2, 2, 2, 2], session_id=[1] * 6,
                       depends_on=pa.array([[], [0], [0], [0], [0], [1, 2, 3, 4]], pa.list_(pa.int64())),
                       think_s=pa.array([None, 1.0, 1.0, 1.0, 1.0, 1.0], pa.float64()),
                       prefix_hashes=[root] + branches + [[99, 98]])
    trace = trace.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    keep = retained("keep", trace=trace, num_gpu_blocks=64)
    assert column(keep, "cached_tokens")[1:5] == [64] * 4
    meta = keep.meta["kv_retention"]
    assert meta["retained"] == 5 and meta["admitted"] == 5 and meta["pins_left"] == 0
