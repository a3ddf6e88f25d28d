"""A real GuideLLM 0.8.1 report (a 4-benchmark sweep run against `servelab serve` by bench/guidellm_serve.sh,
trimmed to 3 successful and 2 incomplete requests per benchmark) imports with `servelab run import
--format guidellm`: one run per benchmark with its load shape, each request's times as GuideLLM recorded
them (checked against the report's own fields here), the tokens the server sent."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from servelab.cli.main import main

REPORT = Path(__file__).parent / "fixtures" / "real_runs" / "guidellm_0.8.1_serve_sweep.json"


def test_a_real_guidellm_sweep_against_serve_imports(tmp_path, capsys):
    out = tmp_path / "imported"
    try:
        main(["run", "import", "--format", "guidellm", str(REPORT), "-o", str(out),
              "--setting", "model=llama-3.1-8b", "--setting", "gpu=h100-80gb"])  # fmt: skip
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    report = json.loads(REPORT.read_text())
    assert report["metadata"]["guidellm_version"] == "0.8.1"
    sweep = json.loads((out / "sweep.json").read_text())
    loads = [(r["load"]["strategy"], r["load"]["shape"]) for r in sweep["runs"]]
    assert loads == [("synchronous", "closed"), ("throughput", "closed"), ("constant", "open"), ("constant", "open")]
    assert sweep["runs"][1]["load"]["users"] == 512
    for i, bench in enumerate(report["benchmarks"]):
        rows = pq.read_table(out / f"benchmark_{i}" / "requests.parquet").to_pylist()
        given = bench["requests"]
        assert len(rows) == sum(len(v) for v in given.values() if isinstance(v, list))
        finished = [r for r in rows if r["status"] == "finished"]
        assert len(finished) == len(given["successful"]) == 3
        assert {r["status"] for r in rows if r["status"] != "finished"} <= {"cancelled"}
        t0 = min(r["request_start_time"] for v in given.values() if isinstance(v, list) for r in v)
        for row, req in zip(finished, given["successful"]):
            timings = req["info"]["timings"]
            assert row["output_tokens"] == req["output_tokens"] == 32  # every token the server sent
            assert row["prompt_tokens"] == req["prompt_tokens"]
            assert row["arrival_s"] == pytest.approx(req["request_start_time"] - t0, abs=1e-6)
            ttft = timings["first_token_iteration"] - req["request_start_time"]
            assert row["ttft_s"] == pytest.approx(ttft, abs=1e-6)
            assert row["tpot_s"] == pytest.approx(
                (timings["last_token_iteration"] - timings["first_token_iteration"]) / 31, abs=1e-6)
