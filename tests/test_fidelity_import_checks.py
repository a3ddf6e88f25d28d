"""run import refuses what it cannot import faithfully: settings out of range, sources of several runs,
a run's files that disagree, and says what a file it cannot read looks like."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"
BENCH = FIX / "vllm_bench_serve.json"


@pytest.mark.parametrize(("setting", "rule"), [
    ("max_num_seqs=-3", "must be at least 1"), ("block_size=0", "must be at least 1"),
    ("num_gpu_blocks=0", "must be at least 1"), ("tp=0", "must be at least 1"), ("replicas=0", "must be at least 1"),
    ("gpu_memory_utilization=1.5", "must be above 0 and at most 1"), ("max_num_seqs=abc", "is not a whole number"),
    ("tp=1.5", "is not a whole number"), ("enable_prefix_caching=maybe", "is not true or false"),
])
def test_a_setting_out_of_range_is_refused_naming_the_option(tmp_path, capsys, setting, rule):
    # before: exit 0 with max_num_seqs -3 in run.json; 'abc' was blamed on the source file
    code, _, err = run_main(["run", "import", BENCH, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb",
                             "--setting", setting], capsys)
    assert code == 1 and f"--setting {setting}: {rule}" in err and str(BENCH) not in err
    assert not (tmp_path / "run").exists()


def test_a_recorded_setting_out_of_range_names_the_file_that_recorded_it(tmp_path, capsys):
    folder = tmp_path / "run_files"
    folder.mkdir()
    shutil.copy(BENCH, folder / "res.json")
    (folder / "meta.json").write_text(json.dumps({"engine_kwargs": {"max_num_seqs": 0}}))
    code, _, err = run_main(["run", "import", folder / "res.json", "-o", tmp_path / "run", "--setting",
                             "gpu=h100-80gb"], capsys)
    assert code == 1 and "column 'max_num_seqs': setting 'max_num_seqs' must be at least 1, got 0 (from meta.json)" in err


def _bench_without(tmp_path: Path, change) -> Path:
    doc = json.loads(BENCH.read_text())
    change(doc)
    path = tmp_path / "res.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("key", ["ttfts", "input_lens", "errors", "itls"])
def test_vllm_bench_a_cut_list_is_the_one_named(tmp_path, capsys, key):
    # before: ttfts cut to n - 1 blamed 'errors' (every other list was measured against ttfts)
    src = _bench_without(tmp_path, lambda doc: doc[key].pop())
    n = len(json.loads(BENCH.read_text())["ttfts"])
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and f"column '{key}': needs a list of {n} values like" in err and f"got {n - 1}" in err


def test_vllm_bench_without_ttfts_but_every_other_list_is_not_a_summary(tmp_path, capsys):
    src = _bench_without(tmp_path, lambda doc: doc.pop("ttfts"))
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and "column 'ttfts': no per-request 'ttfts' list (the result has start_times" in err
    assert "summary" not in err and "--save-detailed" not in err


def _server_log(model: str, batched: int, version: str = "0.11.0") -> str:
    """The lines of a vLLM server log that name the model, the version and a batch limit."""
    return (f"(APIServer pid=1) INFO 01-20 06:08:53 [api_server.py:1] vLLM API server version {version}\n"
            f"(APIServer pid=1) INFO 01-20 06:08:53 [utils.py:1] non-default args: {{'model': '{model}', "
            f"'max_num_batched_tokens': {batched}}}\n")


def _otel_run(folder: Path, log: str, tag: str = "", lines: slice = slice(None)) -> Path:
    """A run folder as inference-sim's calibration runs hold one: traces.json (OTel) and vllm.log."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (FIX / "otel_llm_request.jsonl").read_text().replace("cmpl-", f"cmpl-{tag}")
    (folder / "traces.json").write_text("".join(text.splitlines(keepends=True)[lines]))
    (folder / "vllm.log").write_text(log)
    return folder / "traces.json"


def test_sources_of_two_servers_are_refused(tmp_path, capsys):
    # before: 397 requests over 14,521 s with the first run's settings only
    a = _otel_run(tmp_path / "a", _server_log("meta-llama/Llama-2-7b-hf", 64))
    b = _otel_run(tmp_path / "b", _server_log("meta-llama/Llama-2-7b-hf", 4096), tag="b")
    code, _, err = run_main(["run", "import", a, b, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and f"{a} and {b} are not one run's files" in err
    assert f"max_num_batched_tokens 64 in {tmp_path / 'a' / 'vllm.log'} line 2 but 4096 in " in err
    assert not (tmp_path / "run").exists()


def test_one_file_twice_or_the_same_requests_in_two_files_are_refused(tmp_path, capsys):
    a = _otel_run(tmp_path / "a", _server_log("meta-llama/Llama-2-7b-hf", 64))
    code, _, err = run_main(["run", "import", a, tmp_path / "a" / ".." / "a" / "traces.json", "-o",
                             tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and "given twice" in err  # before: 12 requests at double load
    b = _otel_run(tmp_path / "b", _server_log("meta-llama/Llama-2-7b-hf", 64))  # a copy: the same request ids
    code, _, err = run_main(["run", "import", a, b, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and f"{b}, column 'request_id', row 7: request id 'cmpl-" in err and f"is also {a}'s row 1" in err


def test_the_files_of_one_run_still_import_together(tmp_path, capsys):
    """An OTel exporter's output in two files of one run (one folder, one server log): one timeline."""
    log = _server_log("meta-llama/Llama-2-7b-hf", 4096)
    first = _otel_run(tmp_path / "run_files", log, lines=slice(0, 2))
    second = first.with_name("traces.1.json")
    second.write_text("".join((FIX / "otel_llm_request.jsonl").read_text().splitlines(keepends=True)[2:]))
    code, _, err = run_main(["run", "import", first, second, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"],
                            capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["counts"]["finished"] == 6 and meta["config"]["max_num_batched_tokens"] == 4096


def _rtx4090_run(tmp_path: Path) -> Path:
    folder = tmp_path / "rtx4090"
    shutil.copytree(FIX / "rtx4090", folder)
    return folder / "requests.jsonl"


def test_a_server_log_of_another_run_is_refused_unless_a_setting_decides(tmp_path, capsys):
    # before: config.model CodeLlama-34B from the log over meta.json's Llama-3.1-8B, vLLM 0.11.0 over 0.19.0
    src = _rtx4090_run(tmp_path)
    other = tmp_path / "other.log"
    other.write_text(_server_log("codellama/CodeLlama-34b-Instruct-hf", 2048))
    args = ["run", "import", src, "--vllm-log", other, "-o", tmp_path / "run", "--setting", "gpu=rtx-4090"]
    code, _, err = run_main(args, capsys)
    assert code == 1 and "the run's files disagree: " in err
    assert (f"model 'meta-llama/Llama-3.1-8B' in {src.parent / 'meta.json'} but 'codellama/CodeLlama-34b-Instruct-hf' "
            f"in {other} line 2") in err
    assert f"vllm_version '0.19.0' in {src.parent / 'meta.json'} but '0.11.0' in {other}" in err
    other.write_text(_server_log("codellama/CodeLlama-34b-Instruct-hf", 1024, version="0.19.0"))
    code, _, err = run_main(args, capsys)
    assert code == 1 and "max_num_batched_tokens 2048 in" in err and "but 1024 in" in err
    assert "--setting max_num_batched_tokens=VALUE --setting model=VALUE to say which is right" in err
    code, _, err = run_main([*args, "--setting", "model=meta-llama/Llama-3.1-8B", "--setting",
                             "max_num_batched_tokens=2048"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["config"]["model"] == "meta-llama/Llama-3.1-8B" and meta["config_sources"]["model"] == "--setting"
    assert any("the run's files disagree: model" in n and "--setting model=meta-llama/Llama-3.1-8B decides" in n
               for n in meta["notes"])


def test_a_server_log_with_nothing_recognised_is_a_warning(tmp_path, capsys):
    src = _rtx4090_run(tmp_path)
    log = tmp_path / "garbage.log"
    log.write_text("garbage line\n")
    code, _, err = run_main(["run", "import", src, "--vllm-log", log, "-o", tmp_path / "run", "--setting",
                             "gpu=rtx-4090"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert f"warning: {log}: no vLLM line recognised in it" in err
    assert any("no vLLM line recognised" in w for w in meta["warnings"])


def test_repeated_request_ids_in_one_file_are_kept_unique_with_a_warning(tmp_path, capsys):
    src = _rtx4090_run(tmp_path)
    lines = src.read_text().splitlines()
    lines[2] = lines[2].replace('"bench-2"', '"bench-1"')
    src.write_text("\n".join(lines) + "\n")
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", "--setting", "gpu=rtx-4090"], capsys)
    assert code == 0, err
    assert "requests.jsonl: 1 request id(s) used more than once (first 'bench-1', rows 2 and 3)" in err
    ids = pq.read_table(tmp_path / "run" / "requests.parquet").column("source_request_id").to_pylist()
    assert sorted(ids) == ["bench-0", "bench-1", "bench-1#2", "bench-3"]


SGLANG = FIX / "sglang_bench_serving.jsonl"
GIVEN = ["--setting", "gpu=h100-80gb", "--setting", "model=llama-3.1-8b"]


def test_sglang_bench_serving_runs_are_a_sweep_and_a_paced_run_gets_its_clients_arrival_process(tmp_path, capsys):
    # before: read as an older vLLM result ("vLLM before late 2025"); two lines: "Extra data at line 2"
    code, _, err = run_main(["run", "import", SGLANG, "-o", tmp_path / "sweep", *GIVEN], capsys)
    assert "format: sglang-bench (detected" in err
    assert code == 0, err
    paced = tmp_path / "sweep" / "benchmark_1"  # 4 req/s, no send times: drawn from the client's process
    meta = json.loads((paced / "run.json").read_text())
    assert meta["load"] == {"shape": "open", "request_rate": 4.0, "arrivals": "regenerated"}
    assert any("SGLang bench_serving records none" in n and "arrivals regenerated" in n and "1.000 s" in n
               for n in meta["notes"])
    # two requests of 0.2 s in a run of 1.0 s: the second is sent 0.8 s after the first
    rows = pq.read_table(paced / "requests.parquet").to_pylist()
    assert [r["arrival_s"] for r in rows] == pytest.approx([0.0, 0.8])
    code, out, err = run_main(["validate", "--real", paced], capsys)
    assert code == 0, err
    assert "recorded no send times" in out and "single requests do not" in out
    code, out, err = run_main(["run", "import", SGLANG, "-o", tmp_path / "run", "--benchmark", "0", *GIVEN], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["source"]["format"] == "sglang-bench" and meta["source"]["backend"] == "sglang"
    assert meta["load"] == {"shape": "closed", "users": 2, "request_rate": None}
    assert any("SGLang bench_serving records none" in n for n in meta["notes"])
    rows = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
    # two slots: requests 0 and 1 at 0; request 2 when request 0 (0.1 + 0.05 + 0.05 = 0.2 s) frees its slot
    assert [r["arrival_s"] for r in rows] == pytest.approx([0.0, 0.0, 0.2])
    assert [r["e2e_s"] for r in rows] == pytest.approx([0.2, 0.4, 0.2])


def test_sglang_bench_serving_file_of_unpaced_runs_becomes_one_run_each(tmp_path, capsys):
    src = tmp_path / "results.jsonl"
    first = SGLANG.read_text().splitlines()[0]
    src.write_text(first + "\n" + first.replace('"max_concurrency": 2', '"max_concurrency": null') + "\n")
    code, out, err = run_main(["run", "import", src, "-o", tmp_path / "sweep", *GIVEN], capsys)
    assert code == 0, err
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert sweep["format"] == "sglang-bench" and [r["name"] for r in sweep["runs"]] == ["benchmark_0", "benchmark_1"]
    assert [r["load"]["shape"] for r in sweep["runs"]] == ["closed", "open"]


@pytest.mark.parametrize(("text", "says"), [("", "is empty"), ("\n \n", "holds only blank lines")])
def test_an_empty_file_says_it_is_empty(tmp_path, capsys, text, says):
    # before: "cannot tell the format"
    src = tmp_path / "requests.jsonl"
    src.write_text(text)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", *GIVEN], capsys)
    assert code == 1 and f"{src}: {says}" in err


@pytest.mark.parametrize(("given", "looks"), [("timestamps-jsonl", "vllm-bench"), ("otel", "vllm-bench")])
def test_a_wrong_format_says_what_the_file_looks_like(tmp_path, capsys, given, looks):
    # before: only "column 'input_toks' missing" (or "not valid JSON"), no word of the file being another format
    code, _, err = run_main(["run", "import", BENCH, "--format", given, "-o", tmp_path / "run", "--setting",
                             "gpu=h100-80gb"], capsys)
    assert code == 1 and f"read as --format {given}; the file looks like {looks}: pass --format {looks}" in err
    assert not (tmp_path / "run").exists()


def test_a_broken_file_of_the_format_given_gets_no_format_hint(tmp_path, capsys):
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({**json.loads(BENCH.read_text()), "ttfts": "x"}))
    code, _, err = run_main(["run", "import", cut, "--format", "vllm-bench", "-o", tmp_path / "run", "--setting",
                             "gpu=h100-80gb"], capsys)
    assert code == 1 and "ttfts" in err and "looks like" not in err


@pytest.mark.parametrize(("a", "b", "same"), [
    ("meta-llama/Llama-3.1-8B", "/models/Llama-3.1-8B", True),  # the folder it was loaded from
    ("meta-llama/Llama-3.1-8B-Instruct", "/m/Meta-Llama-3.1-8B", True),  # the same preset's shapes
    ("meta-llama/Llama-3.1-8B-Instruct", "/data/llama31-8b", True),  # a local name no preset knows: not told apart
    ("meta-llama/Llama-3.1-8B", "codellama/CodeLlama-34b-hf", False),  # two models: another run's file
])
def test_two_files_name_the_same_model_by_its_preset(a, b, same):
    from servelab.fidelity.sidecars import same_setting

    assert same_setting("model", a, b) is same and same_setting("model", b, a) is same


def _older_vllm_result(n: int, **extra) -> dict:
    """A vLLM bench result from before late 2025: no start_times, no latencies."""
    return {"backend": "vllm", "model_id": "meta-llama/Llama-3.1-8B", "num_prompts": n, "input_lens": [128] * n,
            "output_lens": [4] * n, "ttfts": [0.05] * n, "itls": [[0.01, 0.01, 0.01]] * n, "errors": [""] * n,
            **extra}


@pytest.mark.parametrize("extra, shape", [
    ({"request_rate": 5.0, "burstiness": 1.0, "max_concurrency": None}, "open"),
    ({"request_rate": 5.0, "burstiness": 0.5, "max_concurrency": 3}, "closed"),
])
def test_an_older_paced_vllm_result_replays_its_clients_process_fitted_to_its_duration(tmp_path, capsys, extra, shape):
    n = 400
    src = tmp_path / "result.json"
    src.write_text(json.dumps(_older_vllm_result(n, duration=100.0, **extra)))
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", src, "-o", out, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    meta = json.loads((out / "run.json").read_text())
    assert meta["load"]["arrivals"] == "regenerated" and meta["load"]["shape"] == shape
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    sends = [r["arrival_s"] for r in rows]
    assert sends == sorted(sends) and sends[0] == 0.0
    # the run lasts its recorded duration: the last response 100 s after the first send
    assert max(r["arrival_s"] + r["e2e_s"] for r in rows) == pytest.approx(100.0, abs=1e-6)
    # the same file gives the same arrivals (seeded)
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "again", "--setting", "gpu=h100-80gb"], capsys)
    assert [r["arrival_s"] for r in pq.read_table(tmp_path / "again" / "requests.parquet").to_pylist()] == sends


def test_an_older_paced_result_without_a_duration_keeps_the_rate(tmp_path, capsys):
    src = tmp_path / "result.json"
    src.write_text(json.dumps(_older_vllm_result(2000, request_rate=10.0)))
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    sends = [r["arrival_s"] for r in pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()]
    assert sends[-1] / (len(sends) - 1) == pytest.approx(0.1, rel=0.1)  # Poisson gaps of mean 1 / rate



@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_an_older_ramped_up_result_draws_each_gap_at_its_requests_rate(tmp_path, capsys, strategy):
    src = tmp_path / "result.json"
    src.write_text(json.dumps(_older_vllm_result(4000, request_rate="inf", ramp_up_strategy=strategy,
                                                 ramp_up_start_rps=2, ramp_up_end_rps=20)))
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "run", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["load"]["arrivals"] == "regenerated" and any(f"({strategy} ramp-up)" in n for n in meta["notes"])
    sends = [r["arrival_s"] for r in pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()]
    first, last = sends[99] / 99, (sends[-1] - sends[-100]) / 99  # mean gaps at the start and at the end
    assert first == pytest.approx(1 / 2, rel=0.25) and last == pytest.approx(1 / 20, rel=0.25)
    src.write_text(json.dumps(_older_vllm_result(3, request_rate=10.0, ramp_up_strategy="steps")))
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "r2", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 1 and "unknown ramp_up_strategy 'steps'" in err and not (tmp_path / "r2").exists()
