"""run import refuses what it cannot import faithfully: settings out of range, sources of several runs,
a run's files that disagree, and says what a file it cannot read looks like."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
