"""`run import` of a run's folder (issue #25 item 8, import robustness): the folder stands for the run's
file in it, found by the formats' own detection; a TraceV2 folder stays the source; a folder of several
runs or kinds of file, or of none, is an error that lists what it found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_cli import run_main

from servelab.common.errors import InputError
from servelab.fidelity.base import sources_in_folders

FIX = Path(__file__).parent / "fixtures" / "real_runs"


def _run_json(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


@pytest.mark.parametrize("folder, expected, fmt", [
    ("rtx4090", "requests.jsonl", "timestamps-jsonl"),  # beside its meta.json (a sidecar, not a run file)
    ("aiperf_run1", "profile_export.jsonl", "aiperf"),  # beside AIPerf's summary (profile_export_aiperf.json)
])
def test_a_folder_stands_for_the_run_file_in_it(folder, expected, fmt):
    files, notes = sources_in_folders([FIX / folder])
    assert files == [FIX / folder / expected]
    assert notes == [f"{FIX / folder}: a folder; its run file {expected} ({fmt})"]


def test_files_and_a_tracev2_folder_pass_as_given():
    given = [FIX / "otel_llm_request.jsonl", FIX / "blis"]
    assert sources_in_folders(given) == (given, [])


def test_an_exporters_files_of_one_run_are_all_taken(tmp_path):
    first, second = tmp_path / "spans-1.jsonl", tmp_path / "spans-2.jsonl"
    lines = (FIX / "otel_llm_request.jsonl").read_text().splitlines(keepends=True)
    first.write_text("".join(lines[: len(lines) // 2]))
    second.write_text("".join(lines[len(lines) // 2:]))
    (tmp_path / "exp-config.yaml").write_text("model: x\n")  # (a sidecar: TraceV2's loose-YAML test does not count)
    files, _ = sources_in_folders([tmp_path])
    assert files == [first, second]


def test_a_folder_of_a_subfolder_finds_the_run_there(tmp_path):
    (tmp_path / "results").mkdir()
    shutil.copy(FIX / "vllm_bench_serve.json", tmp_path / "results" / "result.json")
    (tmp_path / "README.txt").write_text("notes\n")
    assert sources_in_folders([tmp_path])[0] == [tmp_path / "results" / "result.json"]


def test_a_folder_of_two_runs_or_two_kinds_is_refused_with_what_it_holds(tmp_path):
    shutil.copy(FIX / "vllm_bench_serve.json", tmp_path / "a.json")
    shutil.copy(FIX / "vllm_bench_serve.json", tmp_path / "b.json")
    with pytest.raises(InputError, match=r"several runs' files .*a\.json \(vllm-bench\), b\.json \(vllm-bench\)"):
        sources_in_folders([tmp_path])
    (tmp_path / "b.json").unlink()
    shutil.copy(FIX / "otel_llm_request.jsonl", tmp_path / "traces.json")
    with pytest.raises(InputError, match=r"a\.json \(vllm-bench\), traces\.json \(otel\); pass the one to import"):
        sources_in_folders([tmp_path])


def test_a_folder_without_a_run_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing\n")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(InputError, match="no run file in it that a format recognises"):
        sources_in_folders([tmp_path])


def test_run_import_of_a_folder_is_the_import_of_its_file(tmp_path, capsys):
    code, _, err = run_main(["run", "import", FIX / "rtx4090", "-o", tmp_path / "a", "--setting", "gpu=rtx-4090"],
                            capsys)
    assert code == 0, err
    assert f"source: {FIX / 'rtx4090'}: a folder; its run file requests.jsonl (timestamps-jsonl)" in err
    code, _, err = run_main(["run", "import", FIX / "rtx4090" / "requests.jsonl", "-o", tmp_path / "b",
                             "--setting", "gpu=rtx-4090"], capsys)
    assert code == 0, err
    a, b = _run_json(tmp_path / "a"), _run_json(tmp_path / "b")
    assert a["config"] == b["config"] and a["source"]["files"] == b["source"]["files"]
    assert (tmp_path / "a" / "requests.parquet").read_bytes() == (tmp_path / "b" / "requests.parquet").read_bytes()


def _summary_only_inference_perf(tmp_path: Path) -> Path:
    run = tmp_path / "exp"
    (run / "results").mkdir(parents=True)
    (run / "results" / "config.yaml").write_text("load:\n  type: constant\n")
    for name in ("stage_0_lifecycle_metrics.json", "summary_lifecycle_metrics.json"):
        (run / "results" / name).write_text(json.dumps({"load_summary": {"count": 3}, "successes": {"count": 3}}))
    return run


def test_a_tools_summary_report_is_named_with_the_per_request_file_to_import(tmp_path, capsys):
    run = _summary_only_inference_perf(tmp_path)
    with pytest.raises(InputError, match=r"inference-perf's summary report \(results/stage_0_lifecycle_metrics.json, "
                                         r"results/summary_lifecycle_metrics.json\).*per_request_lifecycle_metrics.json"):
        sources_in_folders([run])
    # given the summary file itself: the same words, not "cannot tell the format"
    code, _, err = run_main(["run", "import", str(run / "results" / "stage_0_lifecycle_metrics.json"),
                             "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "inference-perf's summary report" in err and "per_request: true" in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_a_folder_with_the_per_request_report_beside_the_summaries_imports_it(tmp_path):
    run = _summary_only_inference_perf(tmp_path)
    record = {"start_time": 1.0, "end_time": 1.5, "request": json.dumps({"prompt": "hi", "max_tokens": 4}),
              "response": "", "error": None,
              "info": {"input_tokens": 10, "output_tokens": 4, "output_token_times": [1.1, 1.2, 1.3, 1.4]}}
    (run / "results" / "per_request_lifecycle_metrics.json").write_text(json.dumps([record]))
    files, notes = sources_in_folders([run])
    assert files == [run / "results" / "per_request_lifecycle_metrics.json"]
    assert notes == [f"{run}: a folder; its run file results/per_request_lifecycle_metrics.json (inference-perf)"]
