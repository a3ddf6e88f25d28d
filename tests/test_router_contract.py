"""One contract over every registered router (as tests/test_policy_contract.py is over the policies):
a choice among the replicas offered, the same choices for the same seed, and in a replay every request
served once, on a replica that was up, byte-identically across runs."""

from __future__ import annotations

import pytest
from helpers_engine import run, synthetic
from servelab.routers.base import make_router, router_names
from test_routers import REQ, replica

ROUTERS = router_names()
STATES = [  # (outstanding tokens, KV blocks used, waiting) per replica: ties, one idle, one full
    [(0, 0, 0)],
    [(500, 10, 2), (500, 10, 2)],
    [(900, 90, 5), (0, 0, 0), (300, 40, 1)],
    [(100, 99, 0), (50, 5, 9), (700, 20, 3), (0, 100, 0)],
]


def _replicas(state):
    out = [replica(i, outstanding=o, used=u, waiting=w) for i, (o, u, w) in enumerate(state)]
    for r in out:  # prefix-affinity's question: (cached prefix tokens, of which in GPU memory)
        r.kv.affinity = lambda req, tokens=r.kv.used: (tokens, tokens)
    return out


def test_the_contract_covers_every_router():
    assert len(ROUTERS) >= 7 and {"round-robin", "least-outstanding", "session"} <= set(ROUTERS)


@pytest.mark.parametrize("name", ROUTERS)
def test_the_choice_is_one_of_the_replicas_offered_and_seeded(name):
    picks = []
    for seed in (0, 0, 7):
        router = make_router(name, seed=seed)
        seq = []
        for _ in range(5):
            for state in STATES:
                offered = _replicas(state)
                chosen = router.route(REQ, offered)
                assert any(chosen is r for r in offered), (name, state)  # one of those offered, not a copy
                seq.append(chosen.id)
        picks.append(seq)
    assert picks[0] == picks[1]  # the same seed, the same choices


@pytest.mark.parametrize("name", ROUTERS)
def test_a_replay_serves_every_request_once_and_reruns_identically(name):
    trace = synthetic(n=150, rate=40.0, seed=4)
    kwargs = dict(runner="linear:base=0.01,prefill_token=0.0001", replicas=3, router=name, num_gpu_blocks=2000)
    first, second = run(trace, **kwargs), run(trace, **kwargs)
    assert first.requests.equals(second.requests) and first.steps.equals(second.steps)
    rows = first.requests.to_pylist()
    assert len(rows) == 150 and len({r["request_id"] for r in rows}) == 150
    assert {r["status"] for r in rows} == {"finished"} and {r["replica"] for r in rows} <= {0, 1, 2}


@pytest.mark.parametrize("name", ROUTERS)
def test_nothing_arriving_after_a_failure_lands_on_the_failed_replica(name):
    trace = synthetic(n=150, rate=40.0, seed=5)
    result = run(trace, runner="linear:base=0.01,prefill_token=0.0001", replicas=3, router=name,
                 num_gpu_blocks=2000, fail=("replica=0,at=1.0",))  # fmt: skip
    rows = result.requests.to_pylist()
    assert {r["status"] for r in rows} == {"finished"}
    assert not [r for r in rows if r["arrival_s"] > 1.0 and r["replica"] == 0], name


@pytest.mark.parametrize("name", ROUTERS)
def test_a_lora_replay_serves_every_request_once_with_every_router(name):
    # adapters on the requests and slots on the replicas (lora-affinity's question): the contract holds
    from servelab.api import EngineConfig, ReplayConfig, replay
    from test_lora import adapter_trace, runner

    trace = adapter_trace(120, adapters=5, seed=6)
    cfg = ReplayConfig(engine=EngineConfig(max_loras=2, replicas=3, router=name, num_gpu_blocks=4000),
                       model="llama-3.1-8b", gpu="h100-80gb")
    first, second = replay(trace, cfg, runner=runner()), replay(trace, cfg, runner=runner())
    assert first.requests.equals(second.requests)
    rows = first.requests.to_pylist()
    assert len({r["request_id"] for r in rows}) == 120 and {r["status"] for r in rows} == {"finished"}
