"""Policies that order the waiting queue keep that order incrementally (no sort per decision); the
replay must be byte-identical to one that sorts ``replica.waiting`` from scratch at every decision."""

from __future__ import annotations

import pytest
from helpers_engine import synthetic

from servelab.policies.ordering import WaitingQueue
from servelab.policies.round_robin import RoundRobin
from servelab.policies.srpt import ShortestJobFirst, ShortestRemainingFirst
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.replay.core.request import Request


def test_waiting_queue_orders_live_requests_and_forgets_removed_ones():
    q = WaitingQueue()
    reqs = [Request(i, 0.0, 10, 10, index=i) for i in range(300)]
    for r in reqs:
        q.push(r, ((r.index * 37) % 101, r.index))
    for r in reqs[::3]:
        q.remove(r)
    for r in reqs[1::3]:  # pushed again with a new key: only the new entry counts
        q.push(r, (-r.index, r.index))
    expected = sorted((r for r in reqs if r.index % 3), key=lambda r: (-r.index, r.index) if r.index % 3 == 1
                      else ((r.index * 37) % 101, r.index))
    assert list(q.in_order()) == expected and len(q) == len(expected)
    assert len(q.heap) <= 2 * len(q) + 64  # dead entries are dropped once they dominate


def _overload(**overrides):
    return synthetic(**dict(dict(n=2500, rate=25.0, seed=5), **overrides))


CASES = {
    "overload, plenty of KV": dict(engine=dict(max_num_seqs=64)),
    "overload, KV pressure, recompute, no journal": dict(engine=dict(num_gpu_blocks=900, journal="off")),
    "KV pressure, swap": dict(engine=dict(num_gpu_blocks=900, preemption="swap", swap_space_gb=0.5)),
    "preempt, noisy predictor": dict(engine=dict(max_num_seqs=32), params=dict(preempt=True, noise_sigma=0.5)),
    "preempt, KV pressure": dict(engine=dict(num_gpu_blocks=900), params=dict(preempt=True), trace=dict(n=500)),
    "head of line skip, horizon": dict(engine=dict(num_gpu_blocks=900, head_of_line="skip", until_s=40.0)),
    "sessions, 2 replicas": dict(engine=dict(replicas=2, max_num_seqs=32), trace=dict(turns=3, think_s=1.0)),
}


RR_CASES = {  # round-robin preempts at every quantum: smaller traces
    "quantum 4, recompute": dict(engine=dict(max_num_seqs=16), params=dict(quantum=4), trace=dict(n=400)),
    "quantum 8, swap, KV pressure": dict(engine=dict(max_num_seqs=32, num_gpu_blocks=900, preemption="swap",
                                                     swap_space_gb=0.5), params=dict(quantum=8), trace=dict(n=400)),
    "quantum 16, KV pressure, sessions": dict(engine=dict(num_gpu_blocks=900), params=dict(quantum=16),
                                              trace=dict(n=400, turns=3, think_s=1.0)),
}
PAIRS = [(c, p) for p in ("srpt", "sjf") for c in CASES] + [(c, "round-robin") for c in RR_CASES]


def _sorted_from_scratch(monkeypatch) -> None:
    for cls in (ShortestJobFirst, ShortestRemainingFirst):
        monkeypatch.setattr(cls, "waiting_in_order", lambda self, replica: sorted(replica.waiting, key=self.rank))
    monkeypatch.setattr(RoundRobin, "waiting_in_order",
                        lambda self, replica: sorted(replica.waiting, key=lambda r: r.policy_data.ticket))


@pytest.mark.parametrize(("case", "policy"), PAIRS)
@pytest.mark.sampled(keep=2)
def test_incremental_waiting_order_equals_a_full_sort(case, policy, monkeypatch):
    spec = (RR_CASES if policy == "round-robin" else CASES)[case]
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy=policy, policy_params=spec.get("params", {}))
    trace = _overload(**spec.get("trace", {}))
    incremental = replay(trace, config)
    _sorted_from_scratch(monkeypatch)
    sorted_each_time = replay(trace, config)
    assert incremental.requests.equals(sorted_each_time.requests)
    assert incremental.steps.equals(sorted_each_time.steps)
    assert max(incremental.steps.column("waiting").to_pylist()) > 20  # a queue did build up
