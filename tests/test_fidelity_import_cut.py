"""Item 8 of issue 25 on every format: a request that did not complete (a cut last line, a row the
source calls successful without its token times or tokens) is kept as a failed request with a
warning, never a request finishing at time 0; the run's span stays the run's."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"
GIVEN = ("--setting", "model=llama-2-7b", "--setting", "gpu=h100-80gb")


def _import(tmp_path, capsys, src, name="run"):
    out = tmp_path / name
    code, text, err = run_main(["run", "import", src, "-o", out, *GIVEN], capsys)
    assert code == 0, text + err
    return out, err, json.loads((out / "run.json").read_text())


def test_otel_lines_cut_while_the_exporter_appended(tmp_path, capsys):
    lines = (FIX / "otel_llm_request.jsonl").read_text().splitlines()
    src = tmp_path / "spans.jsonl"
    src.write_text("\n".join([*lines[:2], lines[2][:200]]) + "\n")
    out, err, meta = _import(tmp_path, capsys, src)
    assert "spans.jsonl line 3: cut short (not valid JSON); its spans are left out" in err
    assert meta["warnings"][0] == "spans.jsonl line 3: cut short (not valid JSON); its spans are left out"
    assert [w for w in meta["warnings"][1:] if "records no vLLM version" not in w] == []
    whole = _import(tmp_path, capsys, FIX / "otel_llm_request.jsonl", "whole")[2]
    assert 0 < meta["counts"]["finished"] < whole["counts"]["finished"]
    # a cut line before the last is an error naming it, and nothing is written
    src.write_text("\n".join([lines[0], lines[1][:200], lines[2]]) + "\n")
    code, _, err = run_main(["run", "import", src, "-o", tmp_path / "bad", *GIVEN], capsys)
    assert code == 1 and "line 2 is not valid JSON" in err and not (tmp_path / "bad").exists()


def test_a_successful_guidellm_request_without_its_first_token_is_failed(tmp_path, capsys):
    doc = json.loads((FIX / "guidellm_report.json").read_text())
    req = doc["benchmarks"][0]["requests"]["successful"][0]
    req.update(first_token_time=None, last_token_time=None, output_tokens=0)
    src = tmp_path / "report.json"
    src.write_text(json.dumps(doc))
    code, text, err = run_main(["run", "import", src, "-o", tmp_path / "sweep", *GIVEN], capsys)
    assert code == 0, text + err
    run = tmp_path / "sweep" / "benchmark_0"  # the report holds two benchmarks: a sweep
    meta = json.loads((run / "run.json").read_text())
    assert "report.json row 1: reported successful but has no first token or output token" in err  # end_time stands for the last
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    cut = next(r for r in rows if r["source_request_id"] == req["request_id"])
    assert cut["status"] == "failed" and cut["finish_s"] is None and "not completed" in cut["reason"]
    assert meta["measured_span_s"] < 10  # no request finishing at time 0 of the epoch


def test_a_vllm_bench_row_without_output_is_failed_not_an_error(tmp_path, capsys):
    doc = json.loads((FIX / "vllm_bench_serve.json").read_text())
    doc["output_lens"][1] = 0  # the client counted no token in the text it got, and recorded no error
    src = tmp_path / "res.json"
    src.write_text(json.dumps(doc))
    out, err, meta = _import(tmp_path, capsys, src)
    assert "res.json row 2: reported successful but has no output token" in err
    assert meta["counts"]["failed"] == 1 + json.loads((FIX / "vllm_bench_serve.json").read_text())["failed"]
