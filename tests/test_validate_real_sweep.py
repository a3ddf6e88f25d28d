"""validate --real as a new user reaches it: a GuideLLM sweep that run import split into one run per
benchmark is validated run by run (with a summary), and a recorded model that matches no preset
stops with the option to pass."""

from __future__ import annotations

import json
from pathlib import Path

from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"
GIVEN = ("--setting", "model=llama-3.1-8b", "--setting", "gpu=h100-80gb")


def _sweep(tmp_path, capsys) -> Path:
    out = tmp_path / "sweep"
    code, text, err = run_main(["run", "import", FIX / "guidellm_0.8.1_serve_sweep.json", "-o", out, *GIVEN], capsys)
    assert code == 0, text + err
    assert "format: guidellm (detected" in err
    return out


def test_validate_real_of_a_sweep_validates_each_benchmark(tmp_path, capsys):
    out = _sweep(tmp_path, capsys)
    runs = [r["name"] for r in json.loads((out / "sweep.json").read_text())["runs"]]
    assert len(runs) == 4
    code, text, err = run_main(["validate", "--real", out, "--format", "json", "-o", tmp_path / "rep.json"], capsys)
    assert code == 0, err
    whole = json.loads(text)
    assert [Path(r["run"]).name for r in whole["runs"]] == runs
    assert [s["run"] for s in whole["summary"]] == runs
    # each run's report is the one validate --real gives that run alone
    code, alone, err = run_main(["validate", "--real", out / runs[1], "--format", "json"], capsys)
    assert code == 0, err
    one = json.loads(alone)
    assert whole["runs"][1]["latency"] == one["latency"] and whole["runs"][1]["errors"] == one["errors"]
    mean_e2e = next(r["error_pct"] for r in one["latency"] if r["metric"] == "e2e" and r["stat"] == "mean")
    assert whole["summary"][1]["e2e_mean_error_pct"] == mean_e2e
    assert json.loads((tmp_path / "rep.json").read_text())["summary"] == whole["summary"]
    code, text, err = run_main(["validate", "--real", out], capsys)
    assert code == 0, err
    assert "sweep of 4 runs" in text and all(name in text for name in runs)
    code, text, err = run_main(["validate", "--real", out, "--plot", tmp_path / "p.png"], capsys)
    assert code == 1 and "--plot takes one" in err and not (tmp_path / "p.png").exists()


def test_a_recorded_model_without_a_preset_names_the_option(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve.json", "-o", run, "--setting", "gpu=h100-80gb",
                             "--setting", "model=Acme/Foo-13B"], capsys)
    assert code == 0, err
    code, _, err = run_main(["validate", "--real", run], capsys)
    assert code == 1 and "model 'Acme/Foo-13B' (from --setting) matches no model preset; pass --model MODEL" in err
    code, _, err = run_main(["validate", "--real", run, "--model", "llama-3.1-8b", "--format", "json"], capsys)
    assert code == 0, err


def test_a_gpu_given_by_its_device_name_maps_to_its_preset(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve.json", "-o", run,
                             "--setting", "gpu=NVIDIA H100 80GB HBM3"], capsys)
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["gpu"] == "h100-80gb" and meta["source"]["gpu_given"] == "NVIDIA H100 80GB HBM3"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve.json", "-o", tmp_path / "bad",
                             "--setting", "gpu=Acme Tensor 9000"], capsys)
    assert code == 1 and "--setting gpu=Acme Tensor 9000: matches no GPU preset (one of a100-80gb" in err
    assert not (tmp_path / "bad").exists()
