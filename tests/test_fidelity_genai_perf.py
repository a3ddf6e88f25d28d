"""`servelab run import` of an NVIDIA genai-perf export (Perf Analyzer's ``profile_export.json`` and the
``profile_export_genai_perf.json`` summary beside it): detection, times from the responses with content,
token counts (the server's usage, max_tokens with ignore_eos, else the text at the run's characters per
token), errors kept as failed requests, the closed loop of ``--concurrency``, a sweep of experiments,
malformed input as a one-line error, and `validate --real` of the imported run.

The fixture (tests/fixtures/real_runs/genai_perf/) was written for these tests from the published
schema: triton-inference-server/perf_analyzer @ 069e4034 ``src/profile_data_exporter.cc`` (the export's
members), @ 00168fe7 ``genai-perf/genai_perf/profile_data_parser/llm_profile_data_parser.py`` (which
responses count), @ 09628cd6 ``genai-perf/genai_perf/export_data/json_exporter.py`` and @ 120a6ede
``genai-perf/tests/test_exporters/test_json_exporter.py`` (the summary's ``input_config``); BSD-3-Clause.
No real export file was found in a public repository; the numbers are made up to be easy to check."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs" / "genai_perf"
H100 = ["--setting", "gpu=h100-80gb"]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def copy_run(tmp_path: Path, mutate=None, summary: bool = True) -> Path:
    """The fixture's two files in a folder of their own, the export changed by ``mutate(doc)``."""
    folder = tmp_path / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    doc = json.loads((FIX / "profile_export.json").read_text())
    if mutate is not None:
        mutate(doc)
    (folder / "profile_export.json").write_text(json.dumps(doc))
    if summary:
        (folder / "profile_export_genai_perf.json").write_text((FIX / "profile_export_genai_perf.json").read_text())
    return folder / "profile_export.json"


def imported(tmp_path, capsys, src, *extra):
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", src, "-o", out, *H100, *extra], capsys)
    assert code == 0, err
    return json.loads((out / "run.json").read_text()), pq.read_table(out / "requests.parquet").to_pylist(), err


def test_the_export_is_detected_and_read_as_genai_perf_counts_it(tmp_path, capsys):
    meta, rows, err = imported(tmp_path, capsys, FIX / "profile_export.json")
    assert "format: genai-perf (detected" in err
    assert meta["source"]["format"] == "genai-perf" and meta["clock"] == "client"
    assert meta["source"]["service_kind"] == "openai" and meta["source"]["experiment"] == {"mode": "concurrency",
                                                                                           "value": 2.0}
    assert meta["config"]["model"] == MODEL and meta["config_sources"]["model"] == "profile_export.json (genai-perf)"
    ok = [r for r in rows if r["status"] == "finished"]
    assert len(ok) == 4 and [r["source_request_id"] for r in rows] == ["0", "1", "2", "3", "4"]
    # the first token is the first response with content (not the role chunk at +30 ms), the last the last
    # one with content (not [DONE] a millisecond later)
    assert [r["arrival_s"] for r in ok] == pytest.approx([0.0, 0.005, 0.062, 0.071])
    assert [r["ttft_s"] for r in ok] == pytest.approx([0.040, 0.040, 0.038, 0.039])
    assert [r["e2e_s"] for r in ok] == pytest.approx([0.060, 0.064, 0.058, 0.059])
    assert [r["max_itl_s"] for r in ok] == pytest.approx([0.010, 0.012, 0.010, 0.010])
    # ignore_eos with max_tokens 3: the server generated 3; the prompts (equal text) at the summary's mean
    assert {r["output_tokens"] for r in ok} == {3} and {r["prompt_tokens"] for r in rows} == {150}
    assert any("max_tokens (ignore_eos)" in n for n in meta["notes"])
    assert any("mean characters per token" in n and "input_sequence_length" in n for n in meta["notes"])
    # the prompts' shared system text gives the prefix sharing
    assert meta["prefix"]["origin"].startswith("the prompts' text") and meta["prefix"]["ideal_hit_share"] > 0.5


def test_an_sse_error_event_is_a_failed_request_kept(tmp_path, capsys):
    _, rows, _ = imported(tmp_path, capsys, FIX / "profile_export.json")
    failed = [r for r in rows if r["status"] != "finished"]
    assert len(failed) == 1 and failed[0]["status"] == "failed"
    assert failed[0]["reason"] == "error: Internal server error" and failed[0]["source_request_id"] == "4"

    def no_content(doc):  # a request whose only response is [DONE]: no token came
        req = doc["experiments"][0]["requests"][0]
        req["response_timestamps"], req["response_outputs"] = req["response_timestamps"][-1:], [
            {"response": "data: [DONE]\n\n"}]
    _, rows, _ = imported(tmp_path / "b", capsys, copy_run(tmp_path / "b", no_content))
    assert rows[0]["status"] == "failed" and rows[0]["reason"] == "no response with content"


def test_concurrency_is_a_closed_loop_and_a_request_rate_an_open_one(tmp_path, capsys):
    from servelab.traces.io import read_trace

    meta, _, _ = imported(tmp_path, capsys, FIX / "profile_export.json")
    assert meta["load"] == {"shape": "closed", "users": 2, "request_rate": None}
    assert any("closed loop of 2 users" in n for n in meta["notes"])
    trace = read_trace(tmp_path / "run" / "trace.arrow")
    assert sorted(set(trace.column("session_id").to_pylist())) == [0, 1]
    # request 2 sent 1 ms after request 0's last response (0.060 s) freed its slot
    assert trace.column("think_s").to_pylist()[2] == pytest.approx(0.002)

    def rate(doc):
        doc["experiments"][0]["experiment"] = {"mode": "request_rate", "value": 10.0}
    meta, _, _ = imported(tmp_path / "r", capsys, copy_run(tmp_path / "r", rate))
    assert meta["load"] == {"shape": "open", "request_rate": 10.0}
    assert "session_id" not in read_trace(tmp_path / "r" / "run" / "trace.arrow").column_names


def test_the_servers_usage_wins_and_without_it_or_the_summary_the_run_is_refused(tmp_path, capsys):
    def usage(doc):  # stream_options.include_usage: a last chunk with the server's counts
        for req in doc["experiments"][0]["requests"][:4]:
            req["response_outputs"].insert(-1, {"response": 'data: {"object":"chat.completion.chunk","choices":[],'
                                                            '"usage":{"prompt_tokens":140,"completion_tokens":3}}\n\n'})
            req["response_timestamps"].insert(-1, req["response_timestamps"][-1])
    meta, rows, _ = imported(tmp_path, capsys, copy_run(tmp_path, usage, summary=False))
    assert [r["prompt_tokens"] for r in rows[:4]] == [140] * 4
    assert not any("input_sequence_length" in n for n in meta["notes"])
    # no usage, no summary beside the export: the prompt counts are not recorded anywhere
    src = copy_run(tmp_path / "bare", summary=False)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "bare" / "run", *H100], capsys)
    line = err.strip().splitlines()[-1]
    assert code == 1 and line.startswith(f"error: {src}, column 'usage.prompt_tokens', row 1: no prompt token count")
    assert "profile_export_genai_perf.json is not beside it" in line and not (tmp_path / "bare" / "run").exists()


def test_several_experiments_are_a_sweep(tmp_path, capsys):
    def two(doc):
        second = json.loads(json.dumps(doc["experiments"][0]))
        second["experiment"] = {"mode": "concurrency", "value": 4}
        doc["experiments"].append(second)
    src = copy_run(tmp_path, two)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "sweep", *H100], capsys)
    assert code == 0, err
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert sweep["format"] == "genai-perf" and [r["load"]["users"] for r in sweep["runs"]] == [2, 4]
    meta, _, _ = imported(tmp_path / "one", capsys, src, "--benchmark", "1")
    assert meta["load"]["users"] == 4 and meta["source"]["benchmark"] == 1
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "x", *H100, "--benchmark", "2"], capsys)
    assert code == 1 and "--benchmark 2: the export has experiments 0..1" in err


def test_the_model_comes_from_the_summary_when_the_payloads_name_none(tmp_path, capsys):
    def triton(doc):  # Triton's service kind: text_input / text_output, no model in the request
        doc["service_kind"] = "triton"
        for i, req in enumerate(doc["experiments"][0]["requests"]):
            req["request_inputs"] = {"text_input": "You are a helpful assistant. " * 20 + "Question?"}
            if i < 4:
                req["response_outputs"] = [{"text_output": ""}] + [{"text_output": w} for w in ("I", " like", " dogs")] + [
                {"text_output": ""}]
    meta, rows, _ = imported(tmp_path, capsys, copy_run(tmp_path, triton))
    assert meta["config"]["model"] == MODEL  # the summary's input_config.model
    assert rows[0]["ttft_s"] == pytest.approx(0.040)
    src = copy_run(tmp_path / "nomodel", triton)
    summary = json.loads((FIX / "profile_export_genai_perf.json").read_text())
    del summary["input_config"]
    (src.parent / "profile_export_genai_perf.json").write_text(json.dumps(summary))
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "nomodel" / "run", *H100], capsys)
    assert code == 1 and "names no model; pass --setting model=MODEL" in err


def _bad(tmp_path, capsys, mutate, mention: str):
    src = copy_run(tmp_path, mutate)
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "genai-perf", src, "-o", out, *H100], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {src}") and mention in lines[0], lines[0]
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("case", ["timestamp", "stamps", "outputs", "payload", "mode", "request"])
def test_malformed_export_is_a_one_line_error(tmp_path, capsys, case):
    def req(doc, i):
        return doc["experiments"][0]["requests"][i]
    mutate, mention = {
        "timestamp": (lambda d: req(d, 1).update(timestamp="soon"), "column 'timestamp', row 2: needs a whole number"),
        "stamps": (lambda d: req(d, 2).update(response_timestamps=[1, "x", 3, 4, 5]), "'response_timestamps', row 3"),
        "outputs": (lambda d: req(d, 0)["response_outputs"].pop(), "'response_outputs', row 1: needs one response "
                                                                    "output per response timestamp"),
        "payload": (lambda d: req(d, 3)["request_inputs"].update(payload="{not json"), "'request_inputs.payload', "
                                                                                       "row 4: the request body is not JSON"),
        "mode": (lambda d: d["experiments"][0]["experiment"].update(mode="sweep"), "experiments[0].experiment.mode"),
        "request": (lambda d: d["experiments"][0]["requests"].append(7), "'experiments[0].requests[5]', row 6"),
    }[case]
    _bad(tmp_path, capsys, mutate, mention)


@pytest.mark.parametrize(("text", "says"), [("", "is empty"), ("{}", "column 'experiments': needs a list")])
def test_an_empty_file_is_said_to_be_empty(tmp_path, capsys, text, says):
    src = tmp_path / "profile_export.json"
    src.write_text(text)
    fmt = [] if not text else ["--format", "genai-perf"]
    code, _, err = run_main(["run", "import", *fmt, src, "-o", tmp_path / "r", *H100], capsys)
    assert code == 1 and says in err and not (tmp_path / "r").exists()


def test_validate_real_replays_the_imported_export(tmp_path, capsys):
    imported(tmp_path, capsys, FIX / "profile_export.json")
    code, out, err = run_main(["validate", "--real", tmp_path / "run", "--format", "json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["clock"] == "client" and report["requests"] == 4  # the failed request is not replayed
    assert report["per_request"]["matched"] == 4
    assert {s["setting"]: s["value"] for s in report["settings"]}["model"] == "llama-3.1-8b"  # MODEL's preset
