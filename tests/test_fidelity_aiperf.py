"""`servelab run import` of NVIDIA AIPerf's per-request records (``profile_export.jsonl``, with the
``profile_export_aiperf.json`` summary and ``inputs.json`` beside it): a slice of AIPerf's own example
run (older schema: ``timestamp_ns``, ``ttft``), the current schema as AIPerf documents it
(``request_start_ns``, ``time_to_first_token``), cancelled and failed requests kept, the closed loop of
``--concurrency``, the prompts' text from inputs.json, malformed input as a one-line error, and
`validate --real` of the imported run.

tests/fixtures/real_runs/aiperf_run1/: ai-dynamo/aiperf @ 7c31f579 ``examples/artifacts/run1/``
(Apache-2.0), trimmed as tests/fixtures/real_runs/NOTICE.md says. The current schema below follows
ai-dynamo/aiperf @ 13992dbd ``docs/tutorials/working-with-profile-exports.md`` (its example records)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs" / "aiperf_run1"
H100 = ["--setting", "gpu=h100-80gb"]
T0 = 1759813207532900363


def record(i: int, start_ms: float, ttft_ms: float = 40.0, latency_ms: float = 90.0, osl: int = 6,
           error: dict | None = None, phase: str = "profiling", cancelled: bool = False) -> dict:
    """A record as AIPerf >= 0.2 writes it (docs/tutorials/working-with-profile-exports.md)."""
    start = T0 + int(start_ms * 1e6)
    meta = {"session_num": i, "x_request_id": f"req-{i}", "x_correlation_id": f"corr-{i}",
            "conversation_id": f"conv-{i}", "turn_index": 0, "request_start_ns": start,
            "request_ack_ns": None if error else start + 5_000_000,
            "request_end_ns": start + int((1.0 if error else latency_ms) * 1e6), "worker_id": "worker_1",
            "record_processor_id": "record_processor_1", "benchmark_phase": phase, "was_cancelled": cancelled,
            "cancellation_time_ns": start + 1_000_000 if cancelled else None}
    if error:
        return {"metadata": meta, "metrics": {"error_isl": {"value": 120, "unit": "tokens"}}, "error": error}
    gaps = [(latency_ms - ttft_ms) / (osl - 1)] * (osl - 1)
    metrics = {"input_sequence_length": {"value": 100 + i, "unit": "tokens"},
               "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
               "request_latency": {"value": latency_ms, "unit": "ms"},
               "output_token_count": {"value": osl, "unit": "tokens"},
               "inter_chunk_latency": {"value": gaps, "unit": "ms"},
               "output_sequence_length": {"value": osl, "unit": "tokens"}}
    return {"metadata": meta, "metrics": metrics, "error": None}


SUMMARY = {"input_config": {"endpoint": {"model_names": ["Qwen/Qwen3-0.6B"], "type": "chat", "streaming": True},
                            "loadgen": {"concurrency": 2, "request_count": 5}}}


def layout(tmp_path: Path, records: list[dict], summary: dict | None = SUMMARY, inputs: bool = False) -> Path:
    folder = tmp_path / "artifacts"
    folder.mkdir(parents=True)
    (folder / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (folder / "profile_export_aiperf.json").write_text(json.dumps(summary))
    if inputs:
        data = [{"session_id": r["metadata"]["conversation_id"], "payloads": [
            {"model": "Qwen/Qwen3-0.6B", "stream": True,
             "messages": [{"role": "user", "content": "Shared system text. " * 40 + f"question {k}"}]}]}
                for k, r in enumerate(records)]
        (folder / "inputs.json").write_text(json.dumps({"data": data}))
    return folder / "profile_export.jsonl"


def imported(tmp_path, capsys, src, *extra):
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", src, "-o", out, *H100, *extra], capsys)
    assert code == 0, err
    return json.loads((out / "run.json").read_text()), pq.read_table(out / "requests.parquet").to_pylist(), err


def test_aiperfs_example_run_is_detected_and_read(tmp_path, capsys):
    meta, rows, err = imported(tmp_path, capsys, FIX / "profile_export.jsonl")
    assert "format: aiperf (detected" in err
    assert meta["source"]["format"] == "aiperf" and meta["clock"] == "client"
    assert meta["config"]["model"] == "openai/gpt-oss-20b"
    assert meta["load"] == {"shape": "closed", "users": 100, "request_rate": None, "strategy": "concurrency_burst"}
    by_id = {r["source_request_id"]: r for r in rows}
    ok = by_id["1ed40a0d-e708-434d-bb8e-fb1b44cb8717"]
    assert ok["status"] == "finished" and ok["prompt_tokens"] == 550
    assert ok["output_tokens"] == 193  # output_sequence_length: 61 answer + 132 reasoning tokens, all generated
    assert ok["ttft_s"] == pytest.approx(1.680543782) and ok["e2e_s"] == pytest.approx(7.936968269)
    # sends on the records' own clock (ns since the epoch), rebased to the first record's
    assert ok["arrival_s"] == pytest.approx((1759522419159192408 - 1759522419154829652) / 1e9)
    cancelled = by_id["c087da26-5552-4785-958a-cad75c7b22de"]
    assert cancelled["status"] == "cancelled" and "RequestCancellationError (499)" in cancelled["reason"]
    assert meta["counts"] == {"finished": 2, "cancelled": 2, "unfinished": 0}


def test_the_current_schema_with_itls_errors_and_warmup(tmp_path, capsys):
    records = [record(0, 0.0), record(1, 10.0, ttft_ms=60.0, latency_ms=160.0),
               record(2, 95.0, error={"code": 500, "type": "HTTPError", "message": "Internal Server Error"}),
               record(3, 100.0, error={"code": 499, "type": "RequestCancellationError",
                                       "message": "Request was cancelled"}, cancelled=True),
               record(4, -50.0, phase="warmup")]
    meta, rows, _ = imported(tmp_path, capsys, layout(tmp_path, records))
    assert [r["source_request_id"] for r in rows] == ["req-0", "req-1", "req-2", "req-3"]  # the warm-up left out
    assert any("1 warm-up records left out" in n for n in meta["notes"])
    assert [r["arrival_s"] for r in rows] == pytest.approx([0.0, 0.010, 0.095, 0.100])
    assert [r["ttft_s"] for r in rows[:2]] == pytest.approx([0.040, 0.060])
    assert [r["e2e_s"] for r in rows[:2]] == pytest.approx([0.090, 0.160])
    assert [r["max_itl_s"] for r in rows[:2]] == pytest.approx([0.010, 0.020])
    assert [r["prompt_tokens"] for r in rows] == [100, 101, 120, 120]  # a failed request's error_isl
    assert [r["status"] for r in rows] == ["finished", "finished", "failed", "cancelled"]
    assert rows[2]["reason"] == "HTTPError (500): Internal Server Error"
    tokens = pq.read_table(tmp_path / "run" / "tokens.parquet")  # the chunk gaps, one row per chunk
    assert tokens.num_rows == 12


def test_concurrency_is_a_closed_loop_a_rate_an_open_one_and_no_summary_says_so(tmp_path, capsys):
    from servelab.traces.io import read_trace

    records = [record(i, 50.0 * i) for i in range(5)]
    meta, _, _ = imported(tmp_path, capsys, layout(tmp_path, records))
    assert meta["load"] == {"shape": "closed", "users": 2, "request_rate": None}
    assert sorted(set(read_trace(tmp_path / "run" / "trace.arrow").column("session_id").to_pylist())) == [0, 1]
    rate = {"input_config": {"endpoint": {"model_names": ["m"]}, "loadgen": {"request_rate": 8.0,
                                                                           "request_rate_mode": "poisson"}}}
    meta, _, _ = imported(tmp_path / "r", capsys, layout(tmp_path / "r", records, rate))
    assert meta["load"] == {"shape": "open", "request_rate": 8.0, "strategy": "poisson"}
    command = {"input_config": {"endpoint": {"model_names": ["m"]},
                                "cli_command": "aiperf profile -m m --concurrency 3 --request-count 5"}}
    meta, _, _ = imported(tmp_path / "c", capsys, layout(tmp_path / "c", records, command))
    assert meta["load"]["users"] == 3
    meta, _, _ = imported(tmp_path / "n", capsys, layout(tmp_path / "n", records, None), "--setting", "model=m")
    assert "load" not in meta and any("load shape is not recorded" in n for n in meta["notes"])


def test_inputs_json_gives_the_prompts_text_and_the_model(tmp_path, capsys):
    records = [record(i, 50.0 * i) for i in range(4)]
    meta, _, _ = imported(tmp_path, capsys, layout(tmp_path, records, summary=None, inputs=True))
    assert meta["config"]["model"] == "Qwen/Qwen3-0.6B" and meta["config_sources"]["model"].endswith("(aiperf)")
    assert meta["prefix"]["origin"].startswith("the prompts' text") and meta["prefix"]["ideal_hit_share"] > 0.3
    src = layout(tmp_path / "bare", records, summary=None)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "bare" / "run", *H100], capsys)
    assert code == 1 and "names no model; pass --setting model=MODEL" in err


def _bad(tmp_path, capsys, mutate, mention: str):
    records = [record(i, 50.0 * i) for i in range(3)]
    mutate(records)
    src = layout(tmp_path, records)
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "aiperf", src, "-o", out, *H100], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {src}") and mention in lines[0], lines[0]
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("case", ["start", "ttft", "unit", "isl", "gaps", "line"])
def test_malformed_records_are_a_one_line_error(tmp_path, capsys, case):
    mutate, mention = {
        "start": (lambda r: r[1]["metadata"].update(request_start_ns="soon"),
                  "column 'metadata.request_start_ns', row 2: needs a whole number"),
        "ttft": (lambda r: r[2]["metrics"]["time_to_first_token"].update(value="fast"),
                 "column 'metrics.time_to_first_token.value', row 3: needs a number"),
        "unit": (lambda r: r[0]["metrics"]["request_latency"].update(unit="fortnights"),
                 "column 'metrics.request_latency.unit', row 1: needs a time unit"),
        "isl": (lambda r: r[1]["metrics"].pop("input_sequence_length"), "column 'metrics.input_sequence_length.value', "
                                                                        "row 2: needs a whole number"),
        "gaps": (lambda r: r[0]["metrics"]["inter_chunk_latency"].update(value=3.0),
                 "column 'metrics.inter_chunk_latency.value', row 1: needs a list of gaps"),
        "line": (lambda r: r.append([1, 2]), "row 4: each line must be a JSON object"),
    }[case]
    _bad(tmp_path, capsys, mutate, mention)


def test_an_empty_file_is_said_to_be_empty(tmp_path, capsys):
    src = tmp_path / "profile_export.jsonl"
    src.write_text("")
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "r", *H100], capsys)
    assert code == 1 and "is empty" in err and not (tmp_path / "r").exists()
    code, _, err = run_main(["run", "import", "--format", "aiperf", src, "-o", tmp_path / "r", *H100], capsys)
    assert code == 1 and "no requests found" in err and not (tmp_path / "r").exists()


def test_validate_real_replays_the_imported_records(tmp_path, capsys):
    records = [record(i, 50.0 * i) for i in range(6)]
    imported(tmp_path, capsys, layout(tmp_path, records))
    code, out, err = run_main(["validate", "--real", tmp_path / "run", "--format", "json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["clock"] == "client" and report["requests"] == 6 and report["per_request"]["matched"] == 6


@pytest.mark.parametrize("endpoint_extra, command, expected, where", [
    ({}, None, 600.0, "AIPerf's default --request-timeout-seconds"),
    ({"timeout_seconds": 45.0}, None, 45.0, "input_config.endpoint.timeout_seconds"),
    ({}, "aiperf profile -m m --request-timeout-seconds=30 --concurrency 2", 30.0, "input_config.cli_command"),
])
def test_the_clients_request_timeout_is_replayed(tmp_path, capsys, endpoint_extra, command, expected, where):
    """AIPerf's aiohttp client gives each request --request-timeout-seconds in all; the replay abandons a
    request still unfinished then (client_timeout_s until finish), where the run records it or by default."""
    summary = {"input_config": {"endpoint": {"model_names": ["m"], **endpoint_extra}}}
    if command is not None:
        summary["input_config"]["cli_command"] = command
    meta, _, _ = imported(tmp_path, capsys, layout(tmp_path, [record(i, 50.0 * i) for i in range(3)], summary))
    assert meta["config"]["client_timeout_s"] == expected and meta["config"]["client_timeout_until"] == "finish"
    assert any(f"AIPerf's request timeout {expected:g} s ({where})" in n for n in meta["notes"])


def test_a_request_timeout_that_is_not_one_is_named(tmp_path, capsys):
    summary = {"input_config": {"endpoint": {"model_names": ["m"], "timeout_seconds": 0}}}
    src = layout(tmp_path, [record(0, 0.0)], summary)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", *H100], capsys)
    assert code != 0 and "profile_export_aiperf.json" in err and "timeout_seconds" in err
    assert not (tmp_path / "run").exists()
