"""A live `servelab bench` run whose client held a concurrency cap (a closed loop of users, or an open
loop with --max-in-flight) is written with closed-loop sessions in its trace.arrow
(live/results.py ``sent_trace``), so `validate --real` replays it as a loop that never has more than
the cap in flight, not as fixed arrivals that pile up when the replay is slower than the server."""

from __future__ import annotations

import json

import pytest
from helpers_cli import run_main, write_small_trace
from helpers_live_server import Reply, ServerThread, chunk, usage
from test_fidelity_load_shape import max_in_flight

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.traces.io import read_trace

DONE = b"data: [DONE]\n\n"
# 8 chunks 10 ms apart: each request streams for ~80 ms at the client
SLOW = Reply(pieces=[(0.01, chunk(c)) for c in "abcdefgh"] + [(0, usage(8)), (0, DONE)])
# every iteration 50 ms: the replay is far slower than the server, so fixed arrivals pile up
SLOW_REPLAY = ReplayConfig(engine=EngineConfig(num_gpu_blocks=10_000, max_num_seqs=64), runner="linear:base=0.05")


def live_bench(tmp_path, capsys, *args, n=12):
    trace = write_small_trace(tmp_path, n)
    out = tmp_path / "run"
    with ServerThread({}, default=SLOW) as srv:
        code, _, err = run_main(["bench", srv.url, trace, "-o", out, "--no-metrics", "--no-report",
                                 "--extensions", "off", *args], capsys)  # fmt: skip
    assert code == 0, err
    return out


def in_flight_replayed(trace) -> int:
    r = replay(trace, SLOW_REPLAY).requests
    assert set(r.column("status").to_pylist()) == {"finished"}
    return max_in_flight(r.column("arrival_s").to_pylist(), r.column("finish_s").to_pylist())


def test_a_closed_loop_bench_replays_as_a_loop_of_its_users(tmp_path, capsys):
    out = live_bench(tmp_path, capsys, "--shape", "closed", "--users", "3")
    trace = read_trace(out / "trace.arrow")
    assert sorted(set(trace.column("session_id").to_pylist())) == [0, 1, 2]
    think = trace.column("think_s").to_pylist()
    assert sum(t is None for t in think) == 3  # each user's first request keeps its send time
    assert all(0 <= t < 0.05 for t in think if t is not None)  # the client's own time between two turns
    assert in_flight_replayed(trace) == 3
    # the same send times as fixed arrivals (what was written before) exceed the cap
    assert in_flight_replayed(trace.drop_columns(["session_id", "think_s"])) > 3


def test_an_open_loop_with_a_cap_replays_within_the_cap(tmp_path, capsys):
    out = live_bench(tmp_path, capsys, "--shape", "constant", "--rate", "100", "--max-in-flight", "2")
    trace = read_trace(out / "trace.arrow")
    assert sorted(set(trace.column("session_id").to_pylist())) == [0, 1]
    assert in_flight_replayed(trace) == 2
    assert in_flight_replayed(trace.drop_columns(["session_id", "think_s"])) > 2


def test_validate_real_replays_the_live_closed_loop_within_its_cap(tmp_path, capsys):
    out = live_bench(tmp_path, capsys, "--shape", "closed", "--users", "2", n=8)
    code, text, err = run_main(["validate", "--real", str(out), "--candidate", "linear:base=0.05", "--model",
                                "llama-3.1-8b", "--gpu", "h100-80gb", "--num-gpu-blocks", "10000",
                                "--client-model", "none", "--format", "json"], capsys)  # fmt: skip
    assert code == 0, err
    report = json.loads(text)
    # 8 requests of 8 tokens (the server's usage count), two at a time: each user's 4 turns one after
    # another, each at least 8 iterations of 50 ms; as fixed arrivals (all sent within ~0.4 s, since
    # the server answered in ~80 ms) the replay would run them side by side and end within ~0.9 s
    duration = {r["metric"]: r for r in report["throughput"]}["duration_s"]["simulated"]
    assert duration >= 4 * 8 * 0.05
    assert json.loads((out / "run.json").read_text())["load"]["users"] == 2


def test_an_uncapped_open_loop_stays_fixed_arrivals(tmp_path, capsys):
    out = live_bench(tmp_path, capsys, "--shape", "constant", "--rate", "100", n=6)
    assert "session_id" not in read_trace(out / "trace.arrow").column_names or \
        set(read_trace(out / "trace.arrow").column("session_id").to_pylist()) == {None}


def session_trace(tmp_path):
    """3 sessions of 3 turns, turns 0.03 s apart with a think time: the server (SLOW, ~80 ms a request)
    has not finished a turn when the next is due, so an open loop sends it before then."""
    from conftest import make_trace
    from servelab.traces.io import write_trace

    arrivals = [s * 0.01 + t * 0.03 for t in range(3) for s in range(3)]
    path = tmp_path / "sess.arrow"
    write_trace(make_trace(arrivals, [50] * 9, [8] * 9, session_id=[i % 3 for i in range(9)],
                           think_s=[None if i < 3 else 0.02 for i in range(9)]), path, source="test")  # fmt: skip
    return path


@pytest.mark.parametrize("scale", ["1", "0.5"])
def test_an_open_loop_session_run_replays_at_its_send_times(tmp_path, capsys, scale):
    # bench sends a session's turns at their arrival_s (times --time-scale), not after the previous turn
    # and a think time: its trace.arrow must replay as those sends, not as a closed loop
    trace_path = session_trace(tmp_path)
    out = tmp_path / "run"
    with ServerThread({}, default=SLOW) as srv:
        code, _, err = run_main(["bench", srv.url, trace_path, "-o", out, "--no-metrics", "--no-report",
                                 "--extensions", "off", "--time-scale", scale], capsys)  # fmt: skip
    assert code == 0, err
    trace = read_trace(out / "trace.arrow")
    assert trace.column("session_id").to_pylist() == [i % 3 for i in range(9)]  # the sessions are kept
    sent = trace.column("arrival_s").to_pylist()
    replayed = replay(trace, SLOW_REPLAY).requests.column("arrival_s").to_pylist()
    assert replayed == pytest.approx(sent, abs=1e-9)
    assert "think_s" not in trace.column_names  # the turns' think times were not how they were sent
