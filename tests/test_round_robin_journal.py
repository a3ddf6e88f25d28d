"""round-robin ends a turn by preemption only if the request keeps its output tokens. Without the
journal a recomputed request starts over, so rotating it out at the end of every turn would throw
away its tokens each time: a request longer than ``quantum`` never finished while others waited, and
the replay ran forever. Each replay here has a horizon (``until_s``) far past the time it needs, so
a livelock shows as unfinished requests, not as a hang."""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import run, synthetic
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.policies.round_robin import RoundRobin

HORIZON_S = 1_000.0  # simulated seconds; every replay here needs well under 100


def statuses(result) -> set:
    return set(result.requests.column("status").to_pylist())


def column_sum(result, name: str) -> int:
    return sum(result.requests.column(name).to_pylist())


def test_three_requests_two_seats_finish_without_the_journal():
    """Two seats, three requests of 40 tokens, quantum 8: someone always waits, so each turn's end
    used to restart a request (it never got 40 tokens in a row)."""
    trace = make_trace([0.0, 0.0, 0.0], [32, 32, 32], [40, 40, 40])
    result = run(trace, policy="round-robin", policy_params={"quantum": 8}, journal=False, max_num_seqs=2,
                 until_s=HORIZON_S)
    assert statuses(result) == {"finished"}
    assert result.requests.column("output_tokens").to_pylist() == [40, 40, 40]
    assert column_sum(result, "tokens_lost") == 0  # no turn ended by throwing away its tokens
    assert column_sum(result, "num_preemptions") == 0  # recompute only: nobody may yield
    assert result.requests.column("finish_s").to_pylist() == [40.0, 40.0, 80.0]  # 1 s an iteration: in turn


def test_with_the_journal_turns_still_rotate():
    trace = make_trace([0.0, 0.0, 0.0], [32, 32, 32], [40, 40, 40])
    result = run(trace, policy="round-robin", policy_params={"quantum": 8}, max_num_seqs=2, until_s=HORIZON_S)
    assert statuses(result) == {"finished"}
    assert column_sum(result, "num_preemptions") > 0


def brief_trace():
    return synthetic(n=300, rate=20.0, prompt="lognormal:400:1.0", output="lognormal:80:1.0")


@pytest.mark.parametrize("engine", [
    {"num_gpu_blocks": 300, "max_num_seqs": 10},
    {"num_gpu_blocks": 600, "max_num_seqs": 10},
    {"num_gpu_blocks": 300, "max_num_seqs": 10, "replicas": 2},
    # a host pool too small for most requests: a swap falls back to recompute (and would start over)
    {"num_gpu_blocks": 300, "max_num_seqs": 10, "preemption": "swap", "swap_space_gb": 0.02},
])
def test_kv_pressure_and_a_seat_cap_finish_without_the_journal(engine):
    """The reported configurations (300 requests; they ran for many minutes before)."""
    config = ReplayConfig(engine=EngineConfig(journal=False, until_s=HORIZON_S, **engine), policy="round-robin")
    result = replay(brief_trace(), config)
    outcomes = set(zip(result.requests.column("status").to_pylist(), result.requests.column("reason").to_pylist()))
    assert ("finished", None) in outcomes
    for status, reason in outcomes - {("finished", None)}:  # only requests too large for a replica's KV
        assert status == "rejected" and "KV blocks for prompt + max output" in reason
    assert column_sum(result, "tokens_lost") > 0  # KV pressure still restarts requests (not the turns)
    assert max(s for s in result.requests.column("finish_s").to_pylist() if s is not None) < 100.0


def test_swap_with_room_still_rotates_without_the_journal(monkeypatch):
    """A swapped-out request keeps its KV and its tokens: its turn may end by preemption."""
    engine = EngineConfig(num_gpu_blocks=300, max_num_seqs=10, preemption="swap", swap_space_gb=2.0, journal=False,
                          until_s=HORIZON_S)
    yielded = []
    original = RoundRobin._yielding
    monkeypatch.setattr(RoundRobin, "_yielding", lambda self, *args: (
        split := original(self, *args), yielded.extend(split[0]))[0])
    result = replay(brief_trace(), ReplayConfig(engine=engine, policy="round-robin", policy_params={"quantum": 16}))
    assert statuses(result) <= {"finished", "rejected"}
    assert yielded
