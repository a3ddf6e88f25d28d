"""Replay progress in simulated time and requests done, through the queue's drain (issue 16, item 19)."""

from __future__ import annotations

import io

import pytest
from conftest import make_trace

from servelab.api import replay
from servelab.replay import EngineConfig, ReplayConfig
from servelab.runners.base import make_runner

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.001"


def overloaded(n=3000):
    """Every request arrives within 3 s; serving them takes far longer: most of the run is the drain."""
    return make_trace([i * 0.001 for i in range(n)], [20] * n, [8] * n)


def test_progress_reports_simulated_time_and_requests_done_while_draining(monkeypatch):
    monkeypatch.setattr("servelab.replay.core.engine.PROGRESS_STEPS", 64)
    trace = overloaded()
    seen = []
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=4000, max_num_seqs=4), runner=RUNNER)
    result = replay(trace, config, runner=make_runner(RUNNER), progress=lambda *a: seen.append(a))
    end_s = result.meta["simulated_span_s"]
    last_arrival = 2.999
    assert end_s > 10 * last_arrival
    assert seen[0] == (0.0, 0, 3000)
    assert seen[-1] == (end_s, 3000, 3000)  # the last report: everything ended
    times = [s[0] for s in seen]
    ended = [s[1] for s in seen]
    assert times == sorted(times) and ended == sorted(ended)
    draining = [s for s in seen if s[0] > last_arrival]
    assert len(draining) > 20  # reports keep coming after the last arrival ...
    assert draining[0][1] < 500 < 2500 < draining[-2][1]  # ... as the requests end


def test_progress_changes_nothing_in_the_results(monkeypatch):
    monkeypatch.setattr("servelab.replay.core.engine.PROGRESS_STEPS", 16)
    trace = overloaded(800)
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=300, max_num_seqs=8, replicas=2), runner=RUNNER)
    quiet = replay(trace, config)
    loud = replay(trace, config, progress=lambda *a: None)
    assert loud.requests.equals(quiet.requests) and loud.steps.equals(quiet.steps)


def test_two_argument_callbacks_still_get_arrivals():
    n = 20_000
    trace = make_trace([i * 0.01 for i in range(n)], [4] * n, [2] * n)
    seen = []
    replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000), runner="linear:base=0.001"),
           progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, n), (8192, n), (16384, n)]


@pytest.mark.parametrize("width", [40, 50, 80, 120])
def test_progress_bar_shows_time_then_drain_with_eta_and_never_cuts(width):
    from rich.console import Console

    from servelab.cli.replay_cmd import ReplayProgress

    bar = ReplayProgress(1030.0, Console(file=io.StringIO(), width=width))

    def shown(now_s, ended):
        bar(now_s, ended, 86_136)
        out = Console(width=width, record=True, file=io.StringIO())
        out.print(bar.progress.get_renderable())
        return out.export_text().split()

    def has(words, phrase):  # every word of phrase, in order, whole (a wrapped line interleaves columns)
        it = iter(words)
        return all(any(w == p for w in it) for p in phrase.split())

    text = shown(400.0, 30_000)
    assert has(text, "replay 400 of 1,030 s simulated, 30,000 of 86,136 done,") and has(text, "elapsed, ETA")
    text = shown(1100.0, 81_920)  # past the last arrival: the queue drains
    assert has(text, "draining 4,216 in flight, 81,920 of 86,136 done,")
    assert bar.progress.tasks[0].completed == 0
    text = shown(1500.0, 85_000)
    assert has(text, "1,136 in flight, 85,000 of 86,136 done,")
    assert bar.progress.tasks[0].completed == 85_000 - 81_920 and bar.progress.tasks[0].total == 86_136 - 81_920
    assert not any("…" in w for w in text)


def test_no_bar_without_a_terminal(tmp_path):
    """stderr not a terminal (a pipe, a log file): no progress output at all, so no cut line."""
    import subprocess
    import sys

    from servelab.traces.io import write_trace

    n = 50_000
    write_trace(make_trace([i * 0.001 for i in range(n)], [4] * n, [2] * n), tmp_path / "t.arrow", source="test")
    done = subprocess.run([sys.executable, "-m", "servelab", "replay", str(tmp_path / "t.arrow"), "--runner",
                           "linear:base=0.0001", "--num-gpu-blocks", "1000", "--no-report"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stderr.splitlines()] == ["replaying", "simulated"]
