"""Online mode (replay/platform/online.py): requests submitted one by one at their arrival times get the offline
replay's times exactly, for one replica and several behind a router; tokens are reported one by one."""

from __future__ import annotations

import pytest

from servelab.assembly import replay
from servelab.replay.config import ReplayConfig
from servelab.replay.core.request import Request, Status
from servelab.serve.sim import Simulation
from servelab.traces.synth import synth_trace

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0002"


def online_times(table, config):
    sim = Simulation(config, 1.0)
    seen: dict[int, list[float]] = {}
    sim.listeners.append(lambda req, times, ended: seen.setdefault(req.request_id, []).extend(times))
    reqs = []
    for a, p, o in zip(*(table.column(c).to_pylist() for c in ("arrival_s", "prompt_tokens", "output_tokens"))):
        sim.online.advance(a)  # the clock reaches the arrival, then the request comes in
        req = Request(len(reqs), a, p, o)
        reqs.append(req)
        sim.online.submit(req, a)
    sim.online.advance(float("inf"))
    return reqs, seen


@pytest.mark.parametrize("extra", [{}, {"replicas": 3, "router": "round-robin"}, {"policy": "orca"}])
def test_online_equals_replay(extra):
    table = synth_trace(n=60, rate=8.0, prompt="uniform:50:900", output="uniform:1:40", seed=3)
    config = ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 600, **extra}, source="test")
    reqs, seen = online_times(table, config)
    offline = replay(table, config).requests
    assert all(r.status is Status.FINISHED for r in reqs)
    assert [r.first_token_s - r.arrival_s for r in reqs] == pytest.approx(offline.column("ttft_s").to_pylist(), abs=1e-9)
    assert [r.finish_s - r.arrival_s for r in reqs] == pytest.approx(offline.column("e2e_s").to_pylist(), abs=1e-9)
    for r in reqs:  # every token reported once, in time order, the first at first_token_s and the last at finish_s
        times = seen[r.request_id]
        assert len(times) == r.output_tokens and times == sorted(times)
        assert times[0] == r.first_token_s and times[-1] == r.finish_s


def test_submit_never_goes_back_in_time():
    sim = Simulation(ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 100}, source="test"), 1.0)
    first = Request(0, 0.0, 100, 5)
    sim.online.submit(first, 0.0)
    sim.online.advance(0.5)
    last = sim.online.now_s  # the last event processed (the first request's end), before 0.5
    assert 0.0 < last < 0.5
    late = Request(1, last / 2, 100, 5)
    assert sim.online.submit(late, last / 2) == last  # clamped: the engine does not go back in time
    assert sim.online.submit(Request(2, 0.4, 100, 5), 0.4) == 0.4
    sim.online.advance(float("inf"))
    assert late.status is Status.FINISHED and late.first_token_s >= late.arrival_s


def test_too_long_for_the_kv_is_rejected_with_a_reason():
    sim = Simulation(ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 4}, source="test"), 1.0)
    ended = []
    sim.listeners.append(lambda req, times, done: ended.append((req, times, done)))
    req = Request(0, 0.0, 1000, 5)
    sim.online.submit(req, 0.0)
    sim.online.advance(1.0)
    assert ended == [(req, [], True)] and req.status is Status.REJECTED and "KV blocks" in req.reason


def test_settings_not_simulated_online_are_refused():
    from servelab.common.errors import ServelabError

    config = ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 100, "client_timeout_s": 5.0}, source="test")
    with pytest.raises(ServelabError, match="client_timeout_s"):
        Simulation(config, 1.0)
    with pytest.raises(ValueError, match="time_scale"):
        Simulation(ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 100}, source="test"), 0.0)


def test_a_horizon_is_refused_not_ignored():
    # a server runs until it is stopped: a horizon (--until) would be silently ignored
    from servelab.common.errors import ServelabError

    config = ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 100, "until_s": 3.0}, source="test")
    with pytest.raises(ServelabError, match=r"does not simulate until_s \(--until\)"):
        Simulation(config, 1.0)


@pytest.mark.parametrize("name", ["disagg-1p1d", "colocated-2"])
def test_online_equals_replay_for_cluster_configs(name):
    from pathlib import Path

    config = ReplayConfig.from_toml(Path(__file__).resolve().parent.parent / "examples" / "clusters" / f"{name}.toml")
    table = synth_trace(n=40, rate=4.0, prompt="uniform:50:900", output="uniform:2:40", seed=3)
    reqs, _ = online_times(table, config)
    offline = replay(table, config).requests
    assert [r.first_token_s - r.arrival_s for r in reqs] == pytest.approx(offline.column("ttft_s").to_pylist(), abs=1e-9)
    assert [r.finish_s - r.arrival_s for r in reqs] == pytest.approx(offline.column("e2e_s").to_pylist(), abs=1e-9)
