"""`validate --real`: the comparison's arithmetic on hand-built tables, and the command end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from helpers_cli import run_main
from servelab.fidelity.validate import compare
from servelab.replay.core.schema import REQUESTS_SCHEMA

FIX = Path(__file__).parent / "fixtures" / "real_runs"


def _requests(arrival, ttft, e2e, out, queue=None) -> pa.Table:
    n = len(arrival)
    cols = {f.name: [None] * n for f in REQUESTS_SCHEMA}
    cols.update(request_id=list(range(n)), tenant=["default"] * n, tier=["standard"] * n, status=["finished"] * n,
                arrival_s=arrival, first_token_s=[a + t for a, t in zip(arrival, ttft)],
                finish_s=[a + e for a, e in zip(arrival, e2e)], ttft_s=ttft, e2e_s=e2e, output_tokens=out,
                tpot_s=[(e - t) / (o - 1) for t, e, o in zip(ttft, e2e, out)],
                first_scheduled_s=[a + q for a, q in zip(arrival, queue or [0.0] * n)])
    return pa.Table.from_pydict(cols, schema=REQUESTS_SCHEMA)


def test_errors_by_hand():
    real = _requests([0.0, 1.0, 2.0, 3.0], [0.1, 0.2, 0.3, 0.4], [1.1, 2.2, 3.3, 4.4], [11, 21, 31, 41])
    # simulated: TTFT 10% longer for every request, decode identical
    sim = _requests([0.0, 1.0, 2.0, 3.0], [0.11, 0.22, 0.33, 0.44], [1.11, 2.22, 3.33, 4.44], [11, 21, 31, 41])
    rep = compare(real, sim)
    rows = {(r["metric"], r["stat"]): r for r in rep["latency"]}
    assert rows[("ttft", "mean")]["measured_s"] == pytest.approx(0.25)
    assert rows[("ttft", "mean")]["error_pct"] == pytest.approx(10.0)
    assert rows[("ttft", "p90")]["measured_s"] == pytest.approx(0.37)  # linear: 0.3 + 0.7 x 0.1
    assert rows[("tpot", "mean")]["error_pct"] == pytest.approx(0.0, abs=1e-9)
    # e2e: (11.1 x 1.0 + 0.1) / 11 = 1.009090...: mean error 0.25 x 0.1 / 2.75 = +0.909%
    assert rows[("e2e", "mean")]["error_pct"] == pytest.approx(100 * 0.025 / 2.75)
    assert rows[("itl", "pooled mean")]["measured_s"] == pytest.approx(10.0 / 100)
    assert rep["per_request"]["ttft_s"]["mape_pct"] == pytest.approx(10.0)
    # throughput: 104 tokens over 3 + 4.4 s measured, 3 + 4.44 s simulated
    tp = {r["metric"]: r for r in rep["throughput"]}
    assert tp["output_throughput_tps"]["measured"] == pytest.approx(104 / 7.4)
    assert tp["output_throughput_tps"]["error_pct"] == pytest.approx((7.4 / 7.44 - 1) * 100)


def test_validate_real_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                               "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    code, out, err = run_main(["validate", "--real", run, "--format", "json", "--plot", tmp_path / "cdf.png",
                               "--set", "max_num_seqs=64"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["config"]["model"] == "llama-3.1-8b" and rep["config"]["max_num_seqs"] == 64
    assert rep["config"]["max_num_batched_tokens"] == 2048  # from meta.json
    assert rep["finished"] == {"measured": 4, "simulated": 4}
    mean_ttft = next(r for r in rep["latency"] if r["metric"] == "ttft" and r["stat"] == "mean")
    expected = (0.244371776 + 0.123777118 + 0.147537068 + 0.206351402) / 4  # first_token_ts - queued_ts
    assert mean_ttft["measured_s"] == pytest.approx(expected, abs=1e-8)
    assert (tmp_path / "cdf.png").stat().st_size > 1000
    code, out, err = run_main(["validate", "--real", run], capsys)
    assert code == 0 and "measured vs simulated" in out


def test_validate_real_refuses_a_replayed_run(tmp_path, capsys):
    from helpers_cli import write_small_trace

    trace = write_small_trace(tmp_path)
    code, _, err = run_main(["replay", trace, "-o", tmp_path / "sim"], capsys)
    assert code == 0
    code, _, err = run_main(["validate", "--real", tmp_path / "sim"], capsys)
    assert code == 1 and "not a measured run" in err


def test_validate_real_refuses_a_run_against_a_time_scaled_server(tmp_path, capsys):
    """A live run against `servelab serve --time-scale 10` holds wall seconds of a clock 10x as fast: compared
    with a replay's simulated seconds its every latency would read 10x off (before: compared all the same)."""
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "endpoint": {"server_time_scale": 10.0}}))
    code, _, err = run_main(["validate", "--real", run], capsys)
    assert code == 1 and "column 'endpoint.server_time_scale'" in err and "--time-scale 10" in err


def test_validate_real_says_why_a_replay_finished_nothing(tmp_path, capsys):
    """A KV cache too small for any prompt: no simulated cell is a figure (no -100% duration), the report
    says why (counts by status, the KV cache beside the shortest prompt, its refusal), no empty line."""
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", run, "--setting", "gpu=h100-80gb", "--setting", "num_gpu_blocks=2"], capsys)
    assert code == 0, err
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["finished"] == {"measured": 4, "simulated": 0}
    duration = next(r for r in rep["throughput"] if r["metric"] == "duration_s")
    assert duration["simulated"] is None and duration["error_pct"] is None and duration["measured"] > 0
    left = rep["not_finished_simulated"]
    assert left["by_status"] == {"rejected": 4} and left["kv_capacity_tokens"] == 32
    assert left["shortest_prompt_tokens"] > 32 and "a replica has 2" in left["example"]["reason"]
    code, out, err = run_main(["validate", "--real", run], capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "no simulated request finished" in flat and "4 rejected; no prompt fits the 32 tokens of KV cache" in flat
    assert "per request" not in flat and "-100.0%" not in flat


def test_validate_real_says_where_the_kv_blocks_came_from(tmp_path, capsys):
    """The KV line names the block count's origin as the settings list does: --setting at import is the
    run's (run.json config_sources), --set is an option, else derived."""
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", run, "--setting", "gpu=h100-80gb", "--setting", "num_gpu_blocks=900"], capsys)
    assert code == 0, err
    for extra, origin in (([], "run: --setting"), (["--set", "num_gpu_blocks=800"], "option")):
        code, out, err = run_main(["validate", "--real", run, "--format", "json", *extra], capsys)
        assert code == 0, err
        assert json.loads(out)["kv_blocks_from"] == origin
    code, out, _ = run_main(["validate", "--real", run], capsys)
    assert "KV cache 900 blocks = 14,400 tokens (run: --setting)" in " ".join(out.split())


def test_validate_real_says_why_a_vllm_bench_runs_queue_is_not_measured(tmp_path, capsys):
    """vLLM bench's queue_times is the client's wait for its own --max-concurrency slot, not the server's
    queue (arrival to first scheduling): the measured queue stays n/a, and the report says why."""
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve_real_40req.json", "-o", run,
                             "--setting", "gpu=h100-80gb", "--setting", "model=llama-3.1-8b"], capsys)
    assert code == 0, err
    base = ["validate", "--real", run, "--candidate", "linear:base=0.002", "--num-gpu-blocks", "1000"]
    code, out, err = run_main([*base, "--format", "json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert all(r["measured_s"] is None for r in rep["latency"] if r["metric"] == "queue")
    assert "queue_times is the client's wait for one of its own --max-concurrency slots" in rep["not_measured"]["queue"]
    code, out, _ = run_main(base, capsys)
    assert "queue: measured n/a: vLLM's bench records no server queue" in " ".join(out.split())
    # a server-side run measures its queue: nothing to explain
    code, out, _ = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", tmp_path / "server", "--setting", "gpu=h100-80gb"], capsys)
    code, out, err = run_main(["validate", "--real", tmp_path / "server", "--format", "json"], capsys)
    assert code == 0, err
    assert json.loads(out)["not_measured"] == {}


def test_validate_real_suggests_the_key_a_set_option_meant(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    code, _, err = run_main(["validate", "--real", run, "--set", "max_num_seq=64"], capsys)
    assert code == 1 and "unknown key 'max_num_seq'; did you mean 'max_num_seqs'? (known: " in err
    code, _, err = run_main(["validate", "--real", run, "--gpu", "h100"], capsys)
    assert code == 1 and "unknown GPU preset 'h100'; did you mean 'h100-80gb'?" in err


def _break_empty(run):
    (run / "requests.parquet").write_bytes(b"")


def _break_cut(run):
    path = run / "requests.parquet"
    path.write_bytes(path.read_bytes()[:500])


def _break_deleted(run):
    (run / "requests.parquet").unlink()


def _break_column(run):
    import pyarrow.parquet as pq

    path = run / "requests.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["ttft_s"]), path)


def _break_run_json(run):
    path = run / "run.json"
    path.write_text(path.read_text()[:100])


@pytest.mark.parametrize("damage, file, says", [
    (_break_empty, "requests.parquet", "not a readable Parquet file (Could not open Parquet input source"),
    (_break_cut, "requests.parquet", "not a readable Parquet file ("),
    (_break_deleted, "requests.parquet", "file not found"),
    (_break_column, "requests.parquet", "column 'ttft_s': missing required column"),
    (_break_run_json, "run.json", "not valid JSON: "),
])
def test_validate_real_names_a_broken_file_of_the_run_in_one_line(tmp_path, capsys, damage, file, says):
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl",
                             "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    damage(run)
    code, out, err = run_main(["validate", "--real", run], capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"error: {run / file}") and says in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_fit_host_grid_reports_fit_and_held_out_halves(tmp_path, capsys):
    from servelab.fidelity.fit_host import main as fit_main

    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "otel", FIX / "otel_llm_request.jsonl", "-o", run,
                             "--setting", "model=llama-2-7b", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    fit_main([str(run), "--launch-scales", "0.5,1.0", "--cpu-base-ms", "0.5", "--compute-scales", "1.0"])
    out = capsys.readouterr().out
    assert out.count("objective") == 2 and "held_out run" in out and "fit      run" in out
    fit_main([str(run), "--gpu-from", "a40", "--memory-scales", "1.0", "--compute-scales", "1.0"])
    assert "a40 x memory 1.00 x compute 1.00" in capsys.readouterr().out


def test_fit_real_takes_run_directories_only(tmp_path, capsys):
    code, _, err = run_main(["fit", "--real", tmp_path, "-o", tmp_path / "m.json"], capsys)
    assert code == 1 and "fit --real takes measured run directories only" in err
    code, _, err = run_main(["fit"], capsys)
    assert code == 2 and "fit needs PROFILE and -o" in err


def test_engine_intake_starts_a_simulated_queue_where_vllm_starts_its_own():
    """vLLM's time_in_queue starts when the engine core takes a request in, between iterations: the
    simulated queue starts at the first iteration at or after the arrival, capped at the first scheduling."""
    import numpy as np
    import pyarrow as pa
    from servelab.fidelity.validate import engine_intake

    steps = pa.table({"replica": pa.array([0, 0, 1], pa.int32()), "start_s": [1.0, 2.0, 0.5],
                      "duration_s": [0.3, 0.9, 1.0], "num_iterations": pa.array([1, 3, 1], pa.int32())})
    # replica 0: one iteration 1.0-1.3, idle, three of 0.3 s from 2.0 (2.0, 2.3, 2.6 -> 2.9); replica 1: 0.5-1.5
    requests = pa.table({"replica": pa.array([0, 0, 0, 0, 1, 1], pa.int32()),
                         "arrival_s": [1.1, 1.5, 2.35, 3.5, 0.7, 0.7],
                         "first_scheduled_s": [1.3, 1.5, 2.6, None, 1.5, 1.2]})
    got = engine_intake(requests, steps)
    # mid-iteration -> its end; idle -> at once; mid second of three -> the third's start; after the last
    # stretch -> at once (unscheduled: no cap); another replica's steps; capped at the first scheduling
    assert np.allclose(got, [1.3, 1.5, 2.6, 3.5, 1.5, 1.2])
