"""Real clients' load shapes (fidelity/load_shape.py): a concurrency-capped benchmark is imported as
closed-loop sessions and replayed as a loop; a GuideLLM sweep's benchmarks are runs of their own."""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.traces.io import read_trace

FIX = Path(__file__).parent / "fixtures" / "real_runs"


def bench_result(n=40, users=8, rate=None, seed=0) -> dict:
    """A ``vllm bench serve --max-concurrency`` result, made by a semaphore of ``users`` slots:
    a request is sent when a slot frees (plus 1 ms of client time) or at its rate's time."""
    import random

    rng = random.Random(seed)
    slots = [0.0] * users
    start, ttft, lat, out = [], [], [], []
    t_rate = 0.0
    for i in range(n):
        free = heapq.heappop(slots)
        send = max(free + (0.001 if free else 0.0), t_rate)
        if rate is not None:
            t_rate += rng.expovariate(rate)
        o = rng.randint(8, 40)
        first = 0.02 + rng.random() * 0.02
        latency = first + 0.005 * (o - 1)
        heapq.heappush(slots, send + latency)
        start.append(100.0 + send)
        ttft.append(first)
        lat.append(latency)
        out.append(o)
    return {"model_id": "m", "request_rate": "inf" if rate is None else rate, "max_concurrency": users,
            "start_times": start, "ttfts": ttft, "latencies": lat, "input_lens": [64] * n, "output_lens": out,
            "itls": [[0.005] * (o - 1) for o in out], "errors": [""] * n}


GIVEN = ("--setting", "model=llama-3.1-8b", "--setting", "gpu=h100-80gb")  # what these hand-made files do not record


def _import(tmp_path, capsys, doc, fmt="vllm-bench", name="res.json", extra=()):
    src = tmp_path / name
    src.write_text(json.dumps(doc))
    out = tmp_path / "run"
    code, text, err = run_main(["run", "import", "--format", fmt, str(src), "-o", str(out), *GIVEN, *extra], capsys)
    assert code == 0, text + err
    return out


def max_in_flight(arrival, finish) -> int:
    events = sorted([(a, 1) for a in arrival] + [(f, -1) for f in finish])  # ends before starts at a tie
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def test_a_closed_loop_of_8_users_never_has_more_than_8_requests_in_flight(tmp_path, capsys):
    out = _import(tmp_path, capsys, bench_result(n=60, users=8))
    meta = json.loads((out / "run.json").read_text())
    assert meta["load"] == {"shape": "closed", "users": 8, "request_rate": None}
    trace = read_trace(out / "trace.arrow")
    sessions = trace.column("session_id").to_pylist()
    assert sorted(set(sessions)) == list(range(8))
    think = trace.column("think_s").to_pylist()
    assert sum(t is None for t in think) == 8  # each user's first request keeps its send time
    assert all(t == pytest.approx(0.001, abs=1e-6) for t in think if t is not None)  # the client's 1 ms
    # replayed slower than measured (every iteration 50 ms): the loop holds 8 in flight, never 9
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=10_000, max_num_seqs=64), runner="linear:base=0.05")
    r = replay(trace, cfg).requests
    arrival, finish = r.column("arrival_s").to_pylist(), r.column("finish_s").to_pylist()
    assert set(r.column("status").to_pylist()) == {"finished"}
    assert max_in_flight(arrival, finish) == 8
    # the same send times as fixed arrivals (the open-loop import) pile up far beyond 8
    open_trace = trace.drop_columns(["session_id", "think_s"])
    o = replay(open_trace, cfg).requests
    assert max_in_flight(o.column("arrival_s").to_pylist(), o.column("finish_s").to_pylist()) > 8


def test_without_a_cap_the_import_stays_open_loop(tmp_path, capsys):
    doc = bench_result(n=20, users=4, rate=5.0)
    doc["max_concurrency"] = None
    out = _import(tmp_path, capsys, doc)
    assert json.loads((out / "run.json").read_text())["load"] == {"shape": "open", "request_rate": 5.0}
    assert "session_id" not in read_trace(out / "trace.arrow").column_names


def test_the_recorded_vllm_bench_result_is_open_loop_at_4_per_s(tmp_path, capsys):
    src = Path("/work/shared/calibration/real_clients/vllm-bench-serve-vllm0.32cpu-tiny-40req.json")
    if not src.exists():
        pytest.skip("the shared calibration data is not here")
    out = _import(tmp_path, capsys, json.loads(src.read_text()))
    assert json.loads((out / "run.json").read_text())["load"] == {"shape": "open", "request_rate": 4.0}


def test_bad_max_concurrency_is_refused(tmp_path, capsys):
    doc = bench_result(n=4, users=2)
    doc["max_concurrency"] = 0
    (tmp_path / "r.json").write_text(json.dumps(doc))
    code, text, err = run_main(["run", "import", "--format", "vllm-bench", str(tmp_path / "r.json"), "-o",
                                str(tmp_path / "o")], capsys)
    assert code != 0 and "max_concurrency" in text + err and not (tmp_path / "o").exists()


def test_a_guidellm_sweep_is_one_run_per_benchmark_with_its_strategy(tmp_path, capsys):
    doc = json.loads((FIX / "guidellm_report.json").read_text())
    doc["benchmarks"][0]["args"] = {"strategy": {"type_": "synchronous"}}  # v0.2
    doc["benchmarks"][1]["config"] = {"strategy": {"type_": "concurrent", "streams": 4}}  # v0.4+
    out = _import(tmp_path, capsys, doc, fmt="guidellm", name="report.json")
    sweep = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in sweep["runs"]] == ["benchmark_0", "benchmark_1"]
    first = json.loads((out / "benchmark_0" / "run.json").read_text())
    second = json.loads((out / "benchmark_1" / "run.json").read_text())
    assert first["load"]["shape"] == "closed" and first["load"]["users"] == 1
    assert second["load"] == {"shape": "closed", "users": 4, "strategy": "concurrent", "request_rate": None}
    assert len(pq.read_table(out / "benchmark_0" / "requests.parquet")) == 3
    assert len(pq.read_table(out / "benchmark_1" / "requests.parquet")) == 1
    assert read_trace(out / "benchmark_0" / "trace.arrow").column("session_id").to_pylist() == [0, 0]
