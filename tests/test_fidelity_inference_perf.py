"""`servelab run import` of an inference-perf per-request report (``per_request_lifecycle_metrics.json``):
both shapes inference-perf has written, the settings from the files a run leaves (``config.yaml`` beside
the report, the server's files one folder up), token counts the server generated rather than the
client's re-tokenised count, stages, and malformed input as a one-line error."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

H100 = ["--setting", "gpu=h100-80gb"]
CONFIG = """\
api: {type: completion, streaming: true}
data:
  type: shared_prefix
  shared_prefix: {num_groups: 3, num_prompts_per_group: 5, system_prompt_len: 96, question_len: 200}
load:
  type: constant
  stages:
  - {rate: 5.0, duration: 2}
  - {rate: 10.0, duration: 1}
server: {type: vllm, model_name: meta-llama/Llama-2-7b-hf, ignore_eos: true}
"""
# the server that ran the model exp-config.yaml names (a log of another model is another run's: refused)
LOG = """\
2026-01-20 06:08:53,171 INFO vllm.entrypoints.openai.api_server: vLLM API server version 0.11.0
2026-01-20 06:08:53,173 INFO vllm.entrypoints.utils: non-default args: {'model': \
'codellama/CodeLlama-34b-Instruct-hf', 'max_num_batched_tokens': 512, 'max_num_seqs': 32}
2026-01-20 06:10:32,708 INFO vllm.v1.metrics.loggers: Engine 000: vllm cache_config_info with initialization \
after num_gpu_blocks is: 2790
"""


def old_request(i: int, start: float, output: int = 48, counted: int | None = None, error=None) -> dict:
    """A request as inference-perf wrote it before 2026: info.input_tokens, output_tokens, output_token_times."""
    body = {"model": "meta-llama/Llama-2-7b-hf", "prompt": f"system {i % 3} " + "lorem " * 80 + f"question {i}",
            "max_tokens": output, "ignore_eos": True, "stream": True}
    times = [] if error else [start + 0.040 + 0.008 * k for k in range(output)]
    return {"start_time": start, "end_time": start + 0.05 if error else times[-1] + 0.0005,
            "request": json.dumps(body), "response": None if error else "text",
            "info": {"input_tokens": 310, "output_tokens": output if counted is None else counted,
                     "output_token_times": times},
            "error": error}


def new_request(i: int, start: float, stage: int, output: int = 32) -> dict:
    """The newer shape: request_metrics / response_metrics with the server's usage, and a stage per request."""
    times = [start + 0.030 + 0.010 * k for k in range(output)]
    return {"stage_id": stage, "scheduled_time": start - 0.001, "start_time": start, "end_time": times[-1] + 0.001,
            "request": json.dumps({"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}],
                                   "max_tokens": 999, "ignore_eos": False}),
            "response": "", "error": None,
            "info": {"request_metrics": {"text": {"input_tokens": 200 + i}}, "input_tokens": 200 + i,
                     "response_metrics": {"output_tokens": output - 3, "output_token_times": times,
                                          "chunk_times": times, "server_usage": {"prompt_tokens": 205 + i,
                                                                                 "completion_tokens": output}}}}


def layout(tmp_path, requests, config: str | None = CONFIG, log: bool = True):
    """inference-perf's layout: RUN/results/{per_request_lifecycle_metrics.json, config.yaml}, the server's files in RUN/."""
    results = tmp_path / "exp" / "results"
    results.mkdir(parents=True)
    (results / "per_request_lifecycle_metrics.json").write_text(json.dumps(requests))
    if config is not None:
        (results / "config.yaml").write_text(config)
    (tmp_path / "exp" / "exp-config.yaml").write_text("model: codellama/CodeLlama-34b-Instruct-hf\n"
                                                      "tensor_parallelism: 1\nmax_num_batched_tokens: 4096\n")
    if log:
        (tmp_path / "exp" / "vllm.log").write_text(LOG)
    return results / "per_request_lifecycle_metrics.json"


def run_import(tmp_path, capsys, src, *extra):
    out = tmp_path / "run"
    code, text, err = run_main(["run", "import", src, "-o", out, *H100, *extra], capsys)
    assert code == 0, err
    return out, json.loads((out / "run.json").read_text()), pq.read_table(out / "requests.parquet"), err


def test_an_old_report_with_the_server_files_one_folder_up(tmp_path, capsys):
    reqs = [old_request(i, 100.0 + 0.2 * i, counted=40 + i % 5) for i in range(12)]
    reqs.append(old_request(12, 102.5, error={"error_type": "ClientConnectorError", "error_msg": "connection reset"}))
    out, meta, table, err = run_import(tmp_path, capsys, layout(tmp_path, reqs))
    assert "format: inference-perf (detected" in err
    assert meta["clock"] == "client" and meta["source"]["format"] == "inference-perf"
    # the server log (one folder up) wins over exp-config.yaml; exp-config.yaml still gives tp
    assert meta["config"]["max_num_batched_tokens"] == 512 and meta["config"]["max_num_seqs"] == 32
    assert meta["config"]["num_gpu_blocks"] == 2790 and meta["config"]["tp"] == 1
    assert meta["config_sources"]["max_num_batched_tokens"].startswith("vllm.log")
    assert meta["config_sources"]["tp"] == "exp-config.yaml"
    assert meta["load"] == {"shape": "open", "strategy": "constant", "request_rate": None, "stage_rates": [5.0, 10.0]}
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == "finished"]
    assert len(ok) == 12 and [r["status"] for r in rows].count("failed") == 1
    failed = next(r for r in rows if r["status"] != "finished")
    assert "ClientConnectorError: connection reset" in failed["reason"]
    # ignore_eos with max_tokens 48: the server generated 48 tokens, whatever the client counted (40-44)
    assert {r["output_tokens"] for r in ok} == {48}
    assert any("max_tokens (ignore_eos" in n for n in meta["notes"])
    first = ok[0]
    assert first["ttft_s"] == pytest.approx(0.040) and first["e2e_s"] == pytest.approx(0.040 + 0.008 * 47 + 0.0005)
    assert first["tpot_s"] == pytest.approx((0.008 * 47 + 0.0005) / 47)
    assert first["prompt_tokens"] == 310
    # the prompts' text gives the sharing (the system prompts and the filler), not the generator's settings
    assert meta["prefix"]["origin"].startswith("the prompts' text") and meta["prefix"]["ideal_hit_share"] > 0.5
    from servelab.traces.io import read_trace

    trace = read_trace(out / "trace.arrow")
    assert trace.num_rows == 13 and "prefix_hashes" in trace.column_names


def test_a_newer_report_uses_the_servers_usage_and_keeps_a_stage(tmp_path, capsys):
    reqs = [new_request(i, 10.0 + 0.1 * i, stage=0 if i < 6 else 1) for i in range(10)]
    src = layout(tmp_path, reqs, log=False)
    out, meta, table, err = run_import(tmp_path, capsys, src)
    rows = table.to_pylist()
    assert [r["prompt_tokens"] for r in rows] == [205 + i for i in range(10)]  # usage, not the client's 200 + i
    assert {r["output_tokens"] for r in rows} == {32}  # usage, not max_tokens (no ignore_eos) nor the client's 29
    assert not any("max_tokens" in n for n in meta["notes"])
    assert meta["config"]["model"] == "codellama/CodeLlama-34b-Instruct-hf"  # exp-config.yaml wins over config.yaml
    out2 = tmp_path / "stage1"
    code, _, err = run_main(["run", "import", src, "-o", out2, *H100, "--benchmark", "1"], capsys)
    assert code == 0, err
    stage1 = pq.read_table(out2 / "requests.parquet")
    assert stage1.num_rows == 4 and sorted(stage1.column("prompt_tokens").to_pylist()) == [211, 212, 213, 214]
    meta1 = json.loads((out2 / "run.json").read_text())
    assert meta1["load"]["request_rate"] == 10.0 and meta1["source"]["benchmark"] == 1


def test_stages_need_stage_ids_to_be_split(tmp_path, capsys):
    src = layout(tmp_path, [old_request(i, 1.0 + i) for i in range(3)])
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "r", *H100, "--benchmark", "0"], capsys)
    assert code != 0 and "records no stage_id" in err and not (tmp_path / "r").exists()
    src2 = layout(tmp_path / "b", [new_request(i, 1.0 + i, stage=0) for i in range(3)])
    code, _, err = run_main(["run", "import", src2, "-o", tmp_path / "r", *H100, "--benchmark", "2"], capsys)
    assert code != 0 and "no request of stage 2" in err


def test_without_prompt_text_the_generator_settings_give_the_sharing(tmp_path, capsys):
    reqs = [old_request(i, 1.0 + 0.3 * i) for i in range(9)]
    for r in reqs:
        r["request"] = json.dumps({"max_tokens": 48, "ignore_eos": True})
    _, meta, _, _ = run_import(tmp_path, capsys, layout(tmp_path, reqs))
    assert meta["prefix"]["origin"].startswith("generator settings in config.yaml")
    assert "96-token shared prefix in 3 group(s)" in meta["prefix"]["origin"]


def test_a_concurrency_stage_is_a_closed_loop(tmp_path, capsys):
    config = CONFIG.replace("type: constant", "type: concurrent").replace(
        "  - {rate: 5.0, duration: 2}\n  - {rate: 10.0, duration: 1}\n", "  - {concurrency_level: 4, num_requests: 9}\n")
    reqs = [old_request(i, 1.0 + 0.1 * i) for i in range(9)]
    _, meta, _, _ = run_import(tmp_path, capsys, layout(tmp_path, reqs, config=config))
    assert meta["load"]["shape"] == "closed" and meta["load"]["users"] == 4


def _bad(tmp_path, capsys, mutate, mention: str):
    reqs = [old_request(i, 1.0 + 0.2 * i) for i in range(3)]
    mutate(reqs)
    src = layout(tmp_path, reqs)
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", "--format", "inference-perf", src, "-o", out, *H100], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {src}") and mention in lines[0], lines[0]
    assert "row " in lines[0], lines[0]  # every case here is one request's field
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("case", ["start", "tokens", "body", "times", "info", "row"])
def test_malformed_report_is_a_one_line_error(tmp_path, capsys, case):
    mutate, mention = {
        "start": (lambda r: r[1].update(start_time="soon"), "start_time"),
        "tokens": (lambda r: r[2]["info"].update(input_tokens="many"), "info.input_tokens"),
        "body": (lambda r: r[0].update(request="{not json"), "request"),
        "times": (lambda r: r[1]["info"].update(output_token_times="late"), "output_token_times"),
        "info": (lambda r: r[0].update(info=[1]), "info"),
        "row": (lambda r: r.append("x"), "[3]"),
    }[case]
    _bad(tmp_path, capsys, mutate, mention)


def test_not_a_list_is_refused(tmp_path, capsys):
    src = tmp_path / "per_request_lifecycle_metrics.json"
    src.write_text(json.dumps({"start_time": 1}))
    code, _, err = run_main(["run", "import", "--format", "inference-perf", src, "-o", tmp_path / "r", *H100], capsys)
    assert code != 0 and "expected a JSON list" in err


def test_a_report_with_long_prompts_is_still_detected(tmp_path, capsys):
    """The first request's prompt (~120 KB of text) pushes its info past the detection probe's 64 KB."""
    reqs = [old_request(i, 1.0 + 0.2 * i) for i in range(3)]
    body = json.loads(reqs[0]["request"])
    body["prompt"] = "lorem ipsum " * 10_000
    reqs[0]["request"] = json.dumps(body)
    out, meta, table, err = run_import(tmp_path, capsys, layout(tmp_path, reqs))
    assert "format: inference-perf (detected" in err and table.num_rows == 3


@pytest.mark.parametrize("config, mention", [
    ("load: {stages: 5}", "load.stages"),
    ("load: {stages: [3]}", "load.stages"),
    ("server: [x]", "server"),
    ("data: {shared_prefix: {system_prompt_len: many}}", "data.shared_prefix.system_prompt_len"),
    ("load: [", "not valid YAML"),
])
def test_a_malformed_config_yaml_is_named(tmp_path, capsys, config, mention):
    src = layout(tmp_path, [old_request(i, 1.0 + 0.2 * i) for i in range(3)], config=config)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "r", *H100], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and lines[-1].startswith(f"error: {src.parent / 'config.yaml'}") and mention in lines[-1], err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("timeout, expected, said", [
    (None, 300.0, "aiohttp's default total timeout"),
    (60, 60.0, "config.yaml request_timeout"),
])
def test_the_clients_timeout_is_replayed(tmp_path, capsys, timeout, expected, said):
    """inference-perf gives aiohttp its request_timeout as a total timeout, else aiohttp's own 300 s: the
    replay abandons a request at that time after its send, as the client did."""
    config = CONFIG.replace("  type: constant\n", f"  type: constant\n  request_timeout: {timeout or 'null'}\n")
    reqs = [old_request(i, 1.0 + 0.3 * i) for i in range(4)]
    _, meta, _, _ = run_import(tmp_path, capsys, layout(tmp_path, reqs, config=config))
    assert meta["config"]["client_timeout_s"] == expected and meta["config"]["client_timeout_until"] == "finish"
    assert any(said in n for n in meta["notes"])
    code, out, err = run_main(["validate", "--real", tmp_path / "run", "--format", "json"], capsys)
    assert code == 0, err
    used = {s["setting"]: s for s in json.loads(out)["settings"]}
    assert used["client_timeout_s"]["value"] == expected


def test_a_run_against_another_server_gets_none_of_vllms_defaults(tmp_path, capsys):
    """config.yaml's server.type names the server the client talked to: a run of an SGLang server that
    records no version is not replayed with vLLM 0.14+'s defaults (fidelity/vllm_defaults.py); a vLLM one is."""
    reqs = [new_request(i, 10.0 + 0.1 * i, stage=0) for i in range(6)]
    for kind, assumed in (("sglang", False), ("vllm", True)):
        case = tmp_path / kind
        case.mkdir()
        src = layout(case, reqs, config=CONFIG.replace("type: vllm", f"type: {kind}"), log=False)
        out = case / "run"
        code, _, err = run_main(["run", "import", src, "-o", out, *H100], capsys)
        assert code == 0, err
        meta = json.loads((out / "run.json").read_text())
        assert meta["source"]["server_type"] == kind
        assert ("async_scheduling" in meta["config"]) is assumed
        assert any("records no vLLM version" in w for w in meta["warnings"]) is assumed
