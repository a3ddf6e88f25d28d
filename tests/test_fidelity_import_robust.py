"""run import / validate --real on real runs' rough edges: no silent model or GPU, cut rows, the
format detected, and the settings the run's own files record (with where each came from)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"


def test_run_import_refuses_to_guess_model_or_gpu(tmp_path, capsys):
    src = FIX / "otel_llm_request.jsonl"
    code, _, err = run_main(["run", "import", "--format", "otel", src, "-o", tmp_path / "a"], capsys)
    assert code == 1 and "names no model; pass --setting model=MODEL" in err
    code, _, err = run_main(["run", "import", "--format", "otel", src, "-o", tmp_path / "a",
                             "--setting", "model=llama-2-7b"], capsys)
    assert code == 1 and "names no GPU; pass --setting gpu=GPU" in err and "rtx-4090" in err
    assert not (tmp_path / "a").exists()


def test_validate_real_refuses_a_run_without_model_or_gpu(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve.json", "-o", run, "--setting", "gpu=h100-80gb"],
                            capsys)
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    del meta["config"]["model"]  # a run imported by an older version, say
    (run / "run.json").write_text(json.dumps(meta))
    code, _, err = run_main(["validate", "--real", run], capsys)
    assert code == 1 and "names no model" in err and "--model MODEL" in err
    del meta["config"]["gpu"]
    meta["config"]["model"] = "llama-3.1-8b"
    (run / "run.json").write_text(json.dumps(meta))
    code, _, err = run_main(["validate", "--real", run], capsys)
    assert code == 1 and "--gpu GPU" in err
    code, out, err = run_main(["validate", "--real", run, "--gpu", "a40", "--format", "json"], capsys)
    assert code == 0, err
    used = {s["setting"]: s for s in json.loads(out)["settings"]}
    assert used["gpu"] == {"setting": "gpu", "value": "a40", "from": "option"}
    assert used["model"]["from"].startswith("run") and used["block_size"]["from"] == "default"


def test_timestamps_meta_json_gives_gpu_kv_blocks_and_data_parallel(tmp_path, capsys):
    folder = tmp_path / "src"
    shutil.copytree(FIX / "rtx4090", folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["engine_kwargs"]["data_parallel_size"] = 2
    meta.update(num_gpu_blocks=2588, hardware={"gpu": "NVIDIA GeForce RTX 4090", "count": 2})
    (folder / "meta.json").write_text(json.dumps(meta))
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", folder / "requests.jsonl", "-o", run], capsys)
    assert code == 0, err
    got = json.loads((run / "run.json").read_text())
    assert got["config"]["gpu"] == "rtx-4090" and got["source"]["gpu_recorded"] == "NVIDIA GeForce RTX 4090"
    assert got["config"]["num_gpu_blocks"] == 2588 and got["config"]["replicas"] == 2
    assert got["config_sources"]["num_gpu_blocks"] == "meta.json"
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["num_gpu_blocks"] == 2588 and rep["config"]["gpu"] == "rtx-4090"
    # the two DP ranks of one server: one replica of dp = 2 engines (docs/runners.md "Parallelism")
    assert (rep["config"]["replicas"], rep["config"]["dp"]) == (1, 2)


@pytest.mark.parametrize(("recorded", "preset"), [
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA L4", "l4"), ("NVIDIA A10", "a10"), ("NVIDIA RTX A6000", "rtx-a6000"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"), ("NVIDIA L40S", "l40s"), ("NVIDIA A40", "a40"),
    ("NVIDIA A10G", None), ("Tesla T4", None),  # no preset: the import stops and asks (above)
    # a sibling of a preset's card with other memory or links is not that card (before: h200, h100-80gb, ...)
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA GH200 144G HBM3e", None),
    ("NVIDIA H200 NVL", None), ("NVIDIA H200", "h200"), ("NVIDIA A100 80GB PCIe", None), ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA GB200", None), ("NVIDIA B200", "b200"),
    # a bare family name (LLMServingSim's "hardware": "H100") is the family's usual part, with a note (below)
    ("NVIDIA H100", "h100-80gb"), ("H100", "h100-80gb"), ("A100", "a100-80gb"), ("GH200", "gh200"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA L40", None),
])
def test_a_recorded_device_name_maps_to_its_preset(recorded, preset):
    from servelab.fidelity.sidecars import gpu_preset

    assert gpu_preset(recorded) == preset


def test_a_bare_family_name_is_read_as_its_usual_part_with_a_note():
    from servelab.fidelity.sidecars import bare_gpu_note

    assert bare_gpu_note("H100") == ("the recorded GPU 'H100' names no variant: read as h100-80gb; "
                                     "--setting gpu=h100-pcie or h100-nvl if it was another")
    assert bare_gpu_note("NVIDIA H100 80GB HBM3") is None and bare_gpu_note("RTX4090") is None


def test_server_log_and_sidecars_beside_the_run(tmp_path, capsys):
    """The layout of the calibration runs: exp-config.yaml, vllm_logging.json naming the log, the log
    with the engine config line and the KV size in tokens only."""
    folder = tmp_path / "exp"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    (folder / "exp-config.yaml").write_text("model: meta-llama/Llama-2-7b-hf\ntensor_parallelism: 1\n"
                                            "max_num_batched_tokens: 2048\nmax_num_seqs: 64\n")
    (folder / "vllm_logging.json").write_text(json.dumps(
        {"handlers": {"file": {"class": "logging.FileHandler", "filename": "/mnt/exp/x/server.log"}}}))
    (folder / "server.log").write_text(
        "x INFO vllm.entrypoints.utils: non-default args: {'model': '/m/Llama-2-7b-hf', 'max_num_seqs': 256, "
        "'served_model_name': ['meta-llama/Llama-2-7b-hf']}\n"
        "x INFO vllm.v1.engine.core: Initializing a V1 LLM engine (v0.11.0) with config: model='/m/Llama-2-7b-hf', "
        "tensor_parallel_size=1, data_parallel_size=1, dtype=torch.float16, served_model_name=meta-llama/Llama-2-7b-hf, "
        "enable_prefix_caching=False, chunked_prefill_enabled=True\n"
        "x INFO vllm.v1.core.kv_cache_utils: GPU KV cache size: 119,008 tokens\n")
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert "format: otel (detected" in err
    meta = json.loads((run / "run.json").read_text())
    cfg, src = meta["config"], meta["config_sources"]
    assert cfg["max_num_seqs"] == 256 and src["max_num_seqs"] == "server.log line 1"  # the log wins
    assert cfg["max_num_batched_tokens"] == 2048 and src["max_num_batched_tokens"] == "exp-config.yaml"
    assert cfg["enable_prefix_caching"] is False and src["enable_prefix_caching"] == "server.log line 2"
    assert cfg["num_gpu_blocks"] == 119008 // 16 and "KV cache tokens" in src["num_gpu_blocks"]
    assert cfg["model"] == "meta-llama/Llama-2-7b-hf"


def test_blis_cut_last_row_is_a_failed_request(tmp_path, capsys):
    folder = tmp_path / "b"
    shutil.copytree(FIX / "blis", folder)
    csv = folder / "trace.csv"
    text = csv.read_text()
    csv.write_text(text + "4,c1,t2,standard,,0,,0,true,128,9,128,0,0,0,0,,0,0,\n")  # cut after arrival_time_us
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", folder, "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert "row 5: row cut short" in err
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert len(rows) == 4 and rows[-1]["status"] == "failed" and "cut short" in rows[-1]["reason"]
    meta = json.loads((run / "run.json").read_text())
    assert meta["measured_span_s"] < 10 and meta["counts"]["failed"] == 2
    # an ok row whose chunk times never came is failed too, not a request finishing at time 0
    csv.write_text(text + "4,c1,t2,standard,,0,,0,true,128,9,128,0,0,0,0,,0,0,1800000,1800050,0,0,0,ok,,\n")
    code, out, err = run_main(["run", "import", folder, "-o", tmp_path / "run2", "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert "status ok but no first or last chunk time" in err


def test_timestamps_cut_lines(tmp_path, capsys):
    src = tmp_path / "requests.jsonl"
    lines = (FIX / "rtx4090" / "requests.jsonl").read_text().splitlines()
    aborted = json.loads(lines[1])
    del aborted["last_token_ts"]
    src.write_text("\n".join([lines[0], json.dumps(aborted), lines[2], lines[3][:40]]) + "\n")
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", "--format", "timestamps-jsonl", src, "-o", run,
                               "--setting", "model=llama-3.1-8b", "--setting", "gpu=rtx-4090"], capsys)
    assert code == 0, err
    assert "line 4: cut short" in err and "line 2: no last_token_ts" in err
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["finished", "failed", "finished"]
    # a cut line in the middle is still an error naming it
    src.write_text("\n".join([lines[0], lines[1][:40], lines[2]]) + "\n")
    code, out, err = run_main(["run", "import", "--format", "timestamps-jsonl", src, "-o", tmp_path / "r2",
                               "--setting", "model=llama-3.1-8b", "--setting", "gpu=rtx-4090"], capsys)
    assert code == 1 and "row 2: not valid JSON" in err


@pytest.mark.parametrize("src, fmt", [("otel_llm_request.jsonl", "otel"), ("vllm_bench_serve.json", "vllm-bench"),
                                      ("guidellm_report.json", "guidellm"), ("rtx4090/requests.jsonl", "timestamps-jsonl"),
                                      ("blis", "blis"), ("blis/trace.csv", "blis")])
def test_format_detected(tmp_path, capsys, src, fmt):
    from servelab.fidelity.base import detect_format

    assert detect_format([FIX / src]) == fmt


def test_trace_import_detects_formats(tmp_path):
    from servelab.traces.importers import detect_format

    cases = {"azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n", "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens\n",
             "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n",
             "lengths": "num_prefill_tokens,num_decode_tokens\n",
             "mooncake": '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n'}
    for fmt, text in cases.items():
        p = tmp_path / f"{fmt}.txt"
        p.write_text(text)
        assert detect_format([p]) == fmt
    assert detect_format([tmp_path]) == "servegen"


def test_unknown_recorded_gpu_is_an_error_unless_given(tmp_path, capsys):
    folder = tmp_path / "src"
    shutil.copytree(FIX / "rtx4090", folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["gpu_name"] = "Acme Tensor 9000"
    (folder / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_main(["run", "import", folder / "requests.jsonl", "-o", tmp_path / "a"], capsys)
    assert code == 1 and "recorded GPU 'Acme Tensor 9000' (meta.json) matches no GPU preset" in err
    code, _, err = run_main(["run", "import", folder / "requests.jsonl", "-o", tmp_path / "a",
                             "--setting", "gpu=a40"], capsys)
    assert code == 0, err


def test_server_log_v0_block_line_and_restarts(tmp_path):
    from servelab.fidelity.vllm_log import read_log

    log = tmp_path / "vllm.log"
    log.write_text(
        "a INFO non-default args: {'model': 'm1', 'max_num_seqs': 8}\n"
        "a INFO # GPU blocks: 99, # CPU blocks: 2048\n"
        "a INFO Prefix cache hit rate: 50.0%\n"
        "b INFO non-default args: {'model': 'm2', 'block_size': 32, 'data_parallel_size': 2}\n"
        "b INFO GPU KV cache size: 64,000 tokens\n")
    settings, source, origin = read_log(log)
    # the second start only: no blocks line, so KV tokens / its block size; the first start's hit rate is gone
    assert settings == {"model": "m2", "block_size": 32, "replicas": 2, "num_gpu_blocks": 2000}
    assert origin["model"] == "vllm.log line 4" and "prefix_cache_hit_rate" not in source
    assert source["data_parallel_size"] == 2
    log.write_text("a INFO non-default args: {'model': 'm1'}\na INFO # GPU blocks: 99, # CPU blocks: 2048\n")
    assert read_log(log)[0]["num_gpu_blocks"] == 99


def test_llmservingsim_layout_gives_the_gpu_from_the_simulators_config_one_folder_up(tmp_path, capsys):
    """LLMServingSim publishes a vLLM run as <GPU>/<model>/vllm/{meta.json, requests.jsonl} beside the
    simulator's <GPU>/<model>/config.json, which names the hardware the run was made on."""
    real = Path(__file__).parent.parent / "bench" / "real_runs"
    for name, device in (("llmservingsim-rtxpro6000-qwen3-32b", None),
                         ("llmservingsim-rtxpro6000-deepseek-v32-16l64e", "meta.json's device name")):
        setup = tmp_path / name
        (setup / "vllm").mkdir(parents=True)
        for f in ("meta.json", "requests.jsonl"):
            shutil.copy(real / name / f, setup / "vllm" / f)
        shutil.copy(real / name / "sim-config.json", setup / "config.json")
        run = tmp_path / f"{name}-run"
        code, _, err = run_main(["run", "import", setup / "vllm" / "requests.jsonl", "-o", run], capsys)
        assert code == 0, err  # (the DeepSeek run's meta.json names the device too: the same preset, no conflict)
        meta = json.loads((run / "run.json").read_text())
        assert meta["config"]["gpu"] == "rtx-pro-6000"
        if device is None:
            assert meta["config_sources"]["gpu"] == "config.json (LLMServingSim's config of the run)"
