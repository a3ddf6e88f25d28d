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


def test_the_clients_http_timeout_is_replayed_as_a_read_timeout(tmp_path, capsys):
    # GuideLLM (>= 0.4) records its HTTP client's timeout under each benchmark's config.backend (as
    # inference-sim's jan20 reports do: 60 s); httpx's is a read timeout: no first byte by then, dropped
    from servelab.fidelity.validate import config_for, settings_used

    report = json.loads(REPORT.read_text())
    report["benchmarks"] = report["benchmarks"][:1]
    report["benchmarks"][0]["config"]["backend"] = {"type_": "openai_http", "timeout": 60.0, "http2": True}
    src = tmp_path / "report.json"
    src.write_text(json.dumps(report))
    out = tmp_path / "run"
    try:
        main(["run", "import", str(src), "-o", str(out), "--setting", "model=llama-3.1-8b",
              "--setting", "gpu=h100-80gb"])  # fmt: skip
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["client_timeout_s"] == 60.0 and meta["config"]["client_timeout_until"] == "first_token"
    assert meta["config_sources"]["client_timeout_s"] == "report.json (guidellm)"
    assert any("read timeout" in n for n in meta["notes"])
    config = config_for(meta, {})
    assert (config.engine.client_timeout_s, config.engine.client_timeout_until) == (60.0, "first_token")
    used = {row["setting"]: row for row in settings_used(meta, set(), config, 1000)}
    assert used["client_timeout_s"]["value"] == 60.0 and used["client_timeout_s"]["from"].startswith("run:")
    # a report without one replays without a timeout, and says nothing of it
    plain = tmp_path / "plain"
    report["benchmarks"][0]["config"].pop("backend")
    src.write_text(json.dumps(report))
    try:
        main(["run", "import", str(src), "-o", str(plain), "--setting", "model=llama-3.1-8b",
              "--setting", "gpu=h100-80gb"])  # fmt: skip
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    assert "client_timeout_s" not in json.loads((plain / "run.json").read_text())["config"]


BODIES = Path(__file__).parent / "fixtures" / "real_runs" / "guidellm_0.8.1_chat_bodies.json"


def test_the_model_and_the_prompts_come_from_what_guidellm_sent(tmp_path, capsys):
    """GuideLLM >= 0.4 records the model in config.backend and each request's HTTP body in request_args
    (a JSON string): the import names the model without --setting and hashes the chat messages' text."""
    from servelab.fidelity.guidellm import import_guidellm
    from servelab.traces.io import read_trace

    report = json.loads(BODIES.read_text())
    measured = import_guidellm([BODIES])
    assert measured.settings["model"] == report["benchmarks"][0]["config"]["backend"]["model"] == "sim"
    sent = [json.loads(r["request_args"])["body"] for r in report["benchmarks"][0]["requests"]["successful"]]
    texts = ["\n".join(part["text"] for m in body["messages"] for part in m["content"]) for body in sent]
    assert all(texts) and measured.rows.prompt_text == texts
    out = tmp_path / "run"
    try:
        main(["run", "import", str(BODIES), "-o", str(out), "--setting", "gpu=h100-80gb"])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["model"] == "sim" and meta["config_sources"]["model"].startswith(BODIES.name)
    assert meta["prefix"]["origin"].startswith("the prompts' text")
    # prompts that open alike share their leading blocks; without the backend's model, a body's names it
    for i, req in enumerate(report["benchmarks"][0]["requests"]["successful"]):
        body = json.loads(req["request_args"])
        body["body"]["messages"][0]["content"][0]["text"] = "You are a careful assistant. " * 40 + f"task {i} " * 30
        req["request_args"] = json.dumps(body)
    del report["benchmarks"][0]["config"]["backend"]
    src = tmp_path / "shared.json"
    src.write_text(json.dumps(report))
    assert import_guidellm([src]).settings["model"] == "sim"
    try:
        main(["run", "import", str(src), "-o", str(tmp_path / "shared"), "--setting", "gpu=h100-80gb"])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    hashes = read_trace(tmp_path / "shared" / "trace.arrow").column("prefix_hashes").to_pylist()
    assert len(hashes) == 3 and hashes[0][0] == hashes[1][0] == hashes[2][0] and hashes[0][-1] != hashes[1][-1]
