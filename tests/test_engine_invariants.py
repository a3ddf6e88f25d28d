"""The engine's bookkeeping adds up after every event of randomised replays.

- KV (replay/core/kv/manager.py, ``KVManager.check``): used + free == total, the blocks held by running requests
  plus the decode cohort's aggregate equal ``used``, the host pool equals its swapped requests'.
- ``Replica.outstanding_tokens`` equals what the requests on the replica still owe, and drains to 0.
- The dependency rule: nothing in replay/ imports a concrete policy or runner, or the layers above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import servelab.assembly
from helpers_engine import PagedLinear, checking_engine, run, synthetic, with_tiers
from sampled_suites import size
from servelab.policies.base import POLICIES, policy_names
from servelab.replay.core.engine import Engine
from servelab.replay.core.protocols import Policy, Runner
from servelab.replay.core.replica import owed
from servelab.replay.core.request import Status

REPO = Path(__file__).resolve().parents[1]
LIVE = (Status.WAITING, Status.RUNNING)


def disaggregation(engine: Engine):
    """The prefill/decode handoff of a cluster replay (replay/cluster/disagg.py), or None."""
    from servelab.replay.cluster.disagg import Disaggregation

    owners = [getattr(listener, "__self__", None) for listener in engine.step_listeners]
    return next((o for o in owners if isinstance(o, Disaggregation)), None)


def check(engine: Engine) -> None:
    held_elsewhere = {id(r) for rs in (engine.platform.paused.values() if engine.platform else ()) for r in rs}
    disagg = disaggregation(engine)
    for replica in engine.replicas:
        # with disaggregation a prefill replica also holds the KV of requests handed off (waiting for
        # a decode replica or in transfer), and a decode replica the blocks reserved for landing ones
        replica.kv.check(disagg.holders(replica) if disagg is not None else replica.running)
        cohort = replica.aggregate
        owes = 0
        for req in engine.requests:
            if req.replica != replica.id:
                continue
            # an aborted request still in its replica's running set waits for its iteration to end (a
            # client timeout inside it: replay/platform/abort.py) and is still owed its tokens
            aborted_in_flight = req.status is Status.ABORTED and req in replica.running
            if not (req.status in LIVE or id(req) in held_elsewhere or aborted_in_flight):
                continue
            if disagg is not None and req in disagg.source:
                continue  # handed off: owed to no replica until it lands on a decode replica
            if req.status is Status.PENDING:
                continue
            # a cohort member's counters are frozen at joining: add the iterations since then
            lag = cohort.d - req.aggregate_mark if cohort is not None and req.aggregate_mark is not None else 0
            owes += owed(req) - lag
        if disagg is not None and replica.id in disagg.landing:  # owed from the start of their transfer
            owes += sum(owed(req) for req in disagg.landing[replica.id])
        assert replica.outstanding_tokens == owes, (replica.id, replica.outstanding_tokens, owes)


# checks the invariants after every arrival, decision and completed step
CheckedEngine = checking_engine(check)


CASES = {
    "cohort, KV pressure": ("sarathi", {}, {"num_gpu_blocks": 300}),
    "swap": ("sarathi", {}, {"num_gpu_blocks": 300, "preemption": "swap", "kv_bytes_per_token": 1024,
                              "swap_space_gb": 0.0002}),
    "reserve": ("orca", {}, {"num_gpu_blocks": 900, "kv_allocation": "reserve"}),
    "restart without journal": ("vllm-v0", {}, {"num_gpu_blocks": 300, "journal": False}),
    "srpt preempting": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "max_num_seqs": 8}),
    "platform": ("tiers", {"preempt": True}, {"replicas": 2, "num_gpu_blocks": 400, "queue_cap": 30,
                                              "quota": ("tenant=*:rpm=1500",), "retries": 1,
                                              "pause": "tier=flex,waiting=8,resume=2",
                                              "fail": ("replica=1,at=5,for=4",), "swap_space_gb": 0.0001,
                                              "preemption": "swap", "kv_bytes_per_token": 1024}),
    "edf dropping": ("edf", {"drop": True, "ttft_slo_s": 2.0}, {"num_gpu_blocks": 400}),
    "horizon": ("sarathi", {}, {"num_gpu_blocks": 300, "until_s": 6.0}),
    "no prefix cache": ("sarathi", {}, {"num_gpu_blocks": 300, "enable_prefix_caching": False}),
    # vLLM's async scheduling: arrivals seen a step later, no stretch while one waits to be seen
    "async scheduling, KV pressure": ("sarathi", {}, {"num_gpu_blocks": 300, "async_scheduling": True}),
    "async scheduling, platform": ("tiers", {"preempt": True}, {"replicas": 2, "num_gpu_blocks": 400, "queue_cap": 30,
                                                                "pause": "tier=flex,waiting=8,resume=2",
                                                                "fail": ("replica=1,at=5,for=4",),
                                                                "async_scheduling": True}),
    # turns end while others wait: cohort members are preempted through the builder
    "round-robin rotating": ("round-robin", {"quantum": 4}, {"num_gpu_blocks": 400, "max_num_seqs": 8}),
    "round-robin rotating, swap": ("round-robin", {"quantum": 4}, {"num_gpu_blocks": 400, "max_num_seqs": 8,
                                                                   "preemption": "swap", "kv_bytes_per_token": 1024,
                                                                   "swap_space_gb": 0.0002}),
}
# traces whose prefix hashes make requests share cached blocks (sessions, tenants' system prompts)
HASHED = dict(tenants="a=1,b=1,c=1", shared_prefix_tokens=256, turns=3.0, think_s=0.5)
CASES.update({
    "prefix cache, aligned hashes": ("sarathi", {}, {"num_gpu_blocks": 400}, dict(HASHED, prefix_block_tokens=32)),
    "prefix cache, unaligned hashes": ("vllm-v0", {}, {"num_gpu_blocks": 400}, dict(HASHED, prefix_block_tokens=24)),
    "prefix cache, swap": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "preemption": "swap",
                                                        "kv_bytes_per_token": 1024, "swap_space_gb": 0.0002},
                           dict(HASHED, prefix_block_tokens=16)),
    "prefix cache, long hash blocks, small chunks": ("sarathi", {}, {"num_gpu_blocks": 300, "max_num_batched_tokens": 40},
                                                     dict(HASHED, prefix_block_tokens=128)),
    "prefix cache, hash blocks below the block size": ("srpt", {"preempt": True}, {"num_gpu_blocks": 350, "max_num_seqs": 8},
                                                       dict(HASHED, prefix_block_tokens=8)),
    "prefix cache, tiers": ("sarathi", {}, {"num_gpu_blocks": 300, "replicas": 2, "router": "prefix-affinity",
                                             "kv_tiers": ("dram:capacity_gb=0.0005", "remote:capacity_gb=0.002"),
                                             "kv_bytes_per_token": 1024, "kv_load_overlap_layers": 32},
                            dict(HASHED, prefix_block_tokens=64)),
    "prefix cache, unaligned hashes, two tiers": ("vllm-v0", {}, {"num_gpu_blocks": 400, "kv_bytes_per_token": 1024,
                                                                "kv_tiers": ("dram:capacity_gb=0.0003",
                                                                             "ssd:capacity_gb=0.001")},
                                                   dict(HASHED, prefix_block_tokens=40)),
    "prefix cache, write-through tiers, purge": ("srpt", {"preempt": True},
                                                 {"num_gpu_blocks": 350, "kv_tiers": ("dram:capacity_gb=0.0005",),
                                                  "kv_tier_write": "through", "kv_bytes_per_token": 1024,
                                                  "purge_tenants": ("a",)}, dict(HASHED, prefix_block_tokens=32)),
    "prefix cache, swap into the DRAM tier, faults": ("srpt", {"preempt": True},
                                                      {"num_gpu_blocks": 400, "preemption": "swap", "replicas": 2,
                                                       "kv_bytes_per_token": 1024, "fail": ("replica=0,at=4,for=3",),
                                                       "kv_tiers": ("dram:capacity_gb=0.002", "ssd:capacity_gb=0.004")},
                                                      dict(HASHED, prefix_block_tokens=32)),
    "prefix cache, faults": ("orca", {}, {"replicas": 2, "num_gpu_blocks": 400, "fail": ("replica=0,at=4,for=3",)},
                             dict(HASHED, prefix_block_tokens=64)),
})


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.sampled(keep=8)
def test_bookkeeping_adds_up_after_every_event(monkeypatch, case, seed):
    policy, params, engine, *shape = CASES[case]
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=size(250, 150), rate=40.0, seed=seed, **(shape[0] if shape else {}))
    if policy == "tiers":
        trace = with_tiers(trace)
    before = CheckedEngine.events
    result = run(trace, policy=policy, runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
                 policy_params=params, **engine)
    assert CheckedEngine.events - before > 300  # it really ran and checked
    statuses = set(result.requests.column("status").to_pylist())
    assert statuses <= {"finished", "unfinished", "throttled", "dropped", "rejected"}


DISAGG_CASES = {
    "sarathi, KV pressure on both pools": ("sarathi", {}, {"num_gpu_blocks": 300}, {}),
    "decode seats short, power-of-two": ("sarathi", {}, {"num_gpu_blocks": 600},
                                         {"max_num_seqs": 6, "router": "power-of-two"}),
    "srpt preempting, swap on decode": ("srpt", {"preempt": True}, {"num_gpu_blocks": 400, "preemption": "swap",
                                                                   "swap_space_gb": 0.0002}, {"router": "least-kv"}),
    "round-robin rotating": ("round-robin", {"quantum": 4}, {"num_gpu_blocks": 400, "max_num_seqs": 8},
                             {"router": "weighted"}),
    "orca, reserve": ("orca", {}, {"num_gpu_blocks": 900, "kv_allocation": "reserve"}, {}),
    "prefix cache, sessions": ("sarathi", {}, {"num_gpu_blocks": 400}, {}),
    "horizon": ("sarathi", {}, {"num_gpu_blocks": 300, "until_s": 5.0}, {}),
}


def checked_engines(monkeypatch) -> list:
    """Replays through ``servelab.api`` use ``CheckedEngine`` (checks after every event); the list
    fills with the engines they build."""
    return _keep_engines(monkeypatch, CheckedEngine)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(DISAGG_CASES))
@pytest.mark.sampled(keep=4)
def test_disaggregated_bookkeeping_adds_up_after_every_event(monkeypatch, case, seed):
    """KV per replica (the prefill replica still holds a handed-off request's KV until its transfer
    ends; the decode replica holds the blocks reserved for it), outstanding tokens, and every
    request accounted for at the end; KV drains to zero everywhere."""
    from servelab.api import ReplayConfig, replay

    policy, params, engine_settings, decode = DISAGG_CASES[case]
    engines = checked_engines(monkeypatch)
    shape = dict(HASHED, prefix_block_tokens=32) if "prefix" in case else {}
    trace = synthetic(n=250, rate=40.0, seed=seed, **shape)
    config = ReplayConfig.from_dict(dict(
        engine_settings, policy=policy, policy_params=params, kv_bytes_per_token=1024,
        runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005",
        cluster={"pools": [{"name": "p", "role": "prefill", "replicas": 2, "router": "least-outstanding"},
                           dict({"name": "d", "role": "decode", "replicas": 3}, **decode)],
                 "links": [{"from": "p", "to": "d", "bandwidth_gbps": 2.0, "latency_s": 0.002}]}))
    before = CheckedEngine.events
    result = replay(trace, config)
    assert CheckedEngine.events - before > 300
    statuses = result.requests.column("status").to_pylist()
    assert len(statuses) == trace.num_rows
    if "horizon" in case:
        assert set(statuses) <= {"finished", "unfinished", "rejected"} and "unfinished" in statuses
        return
    assert set(statuses) <= {"finished", "rejected"}
    assert sum(result.meta["counts"].values()) == trace.num_rows
    moved = [d for d in result.requests.column("decode_replica").to_pylist() if d is not None]
    assert len(moved) > 100 and set(moved) <= {2, 3, 4}
    (engine,) = engines
    disagg = disaggregation(engine)
    assert not disagg.pending and not disagg.source and disagg.meta()["transfers"] == len(moved)
    for replica in engine.replicas:
        assert replica.outstanding_tokens == 0
        assert replica.kv.used == 0 and replica.kv.host_used == 0 and replica.kv.aggregate_held == 0


@pytest.mark.parametrize("signal", ["queue_depth", "running", "pending_prompt_tokens", "kv_use", "request_rate"])
def test_autoscaled_bookkeeping_adds_up_and_no_request_is_lost(monkeypatch, signal):
    """Replicas start, drain and stop under a bursty trace; every event keeps KV and outstanding
    tokens consistent, and every request finishes (draining drops nothing)."""
    from servelab.api import ReplayConfig, replay

    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    target = {"queue_depth": 2, "running": 4, "pending_prompt_tokens": 1500, "kv_use": 0.3, "request_rate": 10}[signal]
    config = ReplayConfig.from_dict({
        "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "num_gpu_blocks": 400,
        "max_num_seqs": 8, "router": "least-outstanding",
        "cluster": {"pools": [{"name": "a", "replicas": 1, "autoscale": {
            "min": 1, "max": 4, "signal": signal, "target": target, "interval_s": 0.5, "cooldown_s": 1.0,
            "startup_s": 0.7}}]}})
    result = replay(synthetic(n=400, rate=40.0, seed=5), config)
    assert set(result.requests.column("status").to_pylist()) <= {"finished", "rejected"}
    timeline = result.meta["cluster"]["pools"][0]["autoscale"]["timeline"]
    assert max(row[1] for row in timeline) > 1 and any(row[3] for row in timeline)  # it scaled out and drained
    assert all(1 <= row[1] + row[3] and row[1] + row[2] + row[3] <= 4 for row in timeline)


def _keep_engines(monkeypatch, base: type[Engine] = Engine) -> list[Engine]:
    """Every Engine (a ``base``) the replays build from now on, to look at after they ran."""
    engines: list[Engine] = []

    class Keep(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(servelab.assembly, "Engine", Keep)
    return engines


def test_outstanding_tokens_and_kv_drain_to_zero(monkeypatch):
    engines = _keep_engines(monkeypatch)
    for policy in policy_names():
        run(synthetic(n=200, rate=40.0), policy=policy, runner="linear:base=0.01,prefill_token=0.0001",
            num_gpu_blocks=500, replicas=2, router="least-outstanding")
    assert len(engines) == len(policy_names())
    for engine in engines:
        for replica in engine.replicas:
            assert replica.outstanding_tokens == 0
            assert replica.kv.used == 0 and replica.kv.host_used == 0 and replica.kv.aggregate_held == 0


def test_replay_imports_no_concrete_policy_runner_or_layer_above():
    forbidden = ("servelab.policies", "servelab.routers", "servelab.runners", "servelab.api", "servelab.assembly", "servelab.cli", "servelab.scoring",
                 "servelab.search")
    for path in sorted((REPO / "replay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"


def _protocol_members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_has_every_member_the_engine_uses(name):
    from servelab.api import EngineConfig
    from servelab.policies.base import make_policy

    policy = make_policy(name, None, EngineConfig())
    for member in _protocol_members(Policy):
        assert hasattr(policy, member), f"policy '{name}' lacks {member}"
    assert policy.name == name and POLICIES.get(name) is type(policy)


@pytest.mark.parametrize("spec", ["linear:base=1", "roofline"])
def test_runners_have_every_member_the_engine_uses(spec):
    from servelab.runners.base import make_runner

    runner = make_runner(spec)
    assert isinstance(runner, Runner)
    for member in _protocol_members(Runner):
        assert hasattr(runner, member), f"runner '{spec}' lacks {member}"


def test_without_platform_features_no_platform_component_is_built(monkeypatch):
    engines = _keep_engines(monkeypatch)
    run(synthetic(n=50), policy="sarathi", runner="linear:base=0.01")
    run(synthetic(n=50), policy="sarathi", runner="linear:base=0.01", queue_cap=10)
    assert engines[0].platform is None and engines[1].platform is not None


ALLOCATOR_CASES = {
    "aligned hashes": ("sarathi", {}, {"num_gpu_blocks": 400}, dict(HASHED, prefix_block_tokens=32)),
    "unaligned hashes, preempting": ("srpt", {"preempt": True}, {"num_gpu_blocks": 350, "max_num_seqs": 8},
                                     dict(HASHED, prefix_block_tokens=24)),
    "hash blocks below the block size": ("vllm-v0", {}, {"num_gpu_blocks": 300}, dict(HASHED, prefix_block_tokens=8)),
    "purge, dropping": ("edf", {"drop": True, "ttft_slo_s": 2.0},
                        {"num_gpu_blocks": 350, "purge_tenants": ("a",)}, dict(HASHED, prefix_block_tokens=32)),
    "faults": ("orca", {}, {"replicas": 2, "num_gpu_blocks": 400, "fail": ("replica=0,at=4,for=3",)},
               dict(HASHED, prefix_block_tokens=64)),
}


@pytest.mark.parametrize("case", sorted(ALLOCATOR_CASES))
@pytest.mark.sampled(keep=2)
def test_block_ids_add_up_after_every_event(monkeypatch, case):
    """With an allocator (a runner that needs block tables) and prefix caching, every block id is in
    exactly one place (allocator, a cached entry, an own segment, a running request's private
    blocks), holders' tables start with their entries' ids (replay/core/kv/block_names.py: ``check``)."""
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.runners.base import make_runner

    policy, params, engine, shape = ALLOCATOR_CASES[case]
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    spec = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005"
    cfg = ReplayConfig(engine=EngineConfig(**engine), policy=policy, policy_params=params, runner=spec)
    runner = PagedLinear(make_runner(spec))
    engines = []
    real_init = CheckedEngine.__init__

    def keep(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(CheckedEngine, "__init__", keep)
    before = CheckedEngine.events
    result = replay(synthetic(n=size(250, 100), rate=40.0, seed=1, **shape), cfg, runner=runner)
    assert CheckedEngine.events - before > 300
    assert all(r.kv.cache is not None and r.kv.cache.names is not None for e in engines for r in e.replicas)
    assert sum(result.requests.column("cached_tokens").to_pylist()) > 0  # prefixes were really shared
