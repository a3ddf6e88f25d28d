"""vLLM's request journey trace (the scheduler's ``llm_core`` spans: journey.QUEUED ... FINISHED events per
request) imported as a server-side run when a trace has no ``llm_request`` span (fidelity/otel.py)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main

GIVEN = ["--setting", "gpu=h100-80gb", "--setting", "model=llama-2-7b"]


def attr(key, value):
    kind = "doubleValue" if isinstance(value, float) else "intValue" if isinstance(value, int) else "stringValue"
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


def event(name, step, ts, prompt, done=0, max_tokens=64, kind="", status=""):
    attrs = [attr("scheduler.step", step), attr("ts.monotonic", ts), attr("prefill.total_tokens", prompt),
             attr("prefill.done_tokens", prompt if name != "QUEUED" else 0), attr("decode.done_tokens", done),
             attr("decode.max_tokens", max_tokens)]
    if kind:
        attrs.append(attr("schedule.kind", kind))
    if status:
        attrs.append(attr("finish.status", status))
    return {"name": f"journey.{name}", "timeUnixNano": str(int(ts * 1e9)), "attributes": attrs}


def span(request, events):
    return {"name": "llm_core", "traceId": "t", "spanId": request, "startTimeUnixNano": events[0]["timeUnixNano"],
            "attributes": [attr("gen_ai.request.id", request)], "events": events}


def doc(spans):
    return {"resourceSpans": [{"resource": {"attributes": [attr("service.name", "vllm")]},
                               "scopeSpans": [{"scope": {"name": "vllm.scheduler"}, "spans": spans}]}]}


def test_a_journey_trace_is_a_server_side_run(tmp_path, capsys):
    spans = [
        # queued at 100.0, scheduled 100.01, first token 100.05, finished 100.50 with 40 tokens
        span("r1", [event("QUEUED", 0, 100.0, 300), event("SCHEDULED", 1, 100.01, 300, kind="FIRST"),
                    event("FIRST_TOKEN", 1, 100.05, 300, done=1), event("FINISHED", 40, 100.50, 300, done=40,
                                                                         status="length")]),
        # preempted once: its events in two spans, the second exported first
        span("r2", [event("SCHEDULED", 30, 100.40, 200, done=20, kind="RESUME"),
                    event("FINISHED", 60, 100.90, 200, done=50, status="stop")]),
        span("r2", [event("QUEUED", 2, 100.02, 200), event("SCHEDULED", 3, 100.03, 200, kind="FIRST"),
                    event("FIRST_TOKEN", 3, 100.06, 200, done=1), event("PREEMPTED", 20, 100.30, 200, done=20)]),
        span("r3", [event("QUEUED", 4, 100.04, 100), event("SCHEDULED", 5, 100.05, 100, kind="FIRST"),
                    event("FIRST_TOKEN", 5, 100.07, 100, done=1), event("FINISHED", 6, 100.08, 100, done=2,
                                                                         status="abort")]),
        span("r4", [event("QUEUED", 7, 100.09, 50)]),  # the trace ends before it finishes
    ]
    src = tmp_path / "traces.json"
    src.write_text("\n".join(json.dumps(doc([s])) for s in spans) + "\n")
    out = tmp_path / "run"
    code, text, err = run_main(["run", "import", src, "-o", out, *GIVEN], capsys)
    assert code == 0, err
    assert "format: otel (detected" in err and "request journey trace (4 requests" in text
    meta = json.loads((out / "run.json").read_text())
    assert meta["clock"] == "server"
    assert meta["source"]["times"] == "engine-core"  # no API server time is added to the simulated (validate)
    rows = {r["source_request_id"]: r for r in pq.read_table(out / "requests.parquet").to_pylist()}
    r1, r2 = rows["r1"], rows["r2"]
    assert r1["arrival_s"] == pytest.approx(0.0) and r1["ttft_s"] == pytest.approx(0.05)
    assert r1["e2e_s"] == pytest.approx(0.5) and (r1["prompt_tokens"], r1["output_tokens"]) == (300, 40)
    assert r2["arrival_s"] == pytest.approx(0.02) and r2["ttft_s"] == pytest.approx(0.04)
    assert r2["e2e_s"] == pytest.approx(0.88) and r2["output_tokens"] == 50
    assert rows["r3"]["status"] == "failed" and "abort" in rows["r3"]["reason"]
    assert rows["r4"]["status"] == "failed" and "no FINISHED" in rows["r4"]["reason"]
    code, out_text, err = run_main(["validate", "--real", out, "--format", "json"], capsys)
    assert code == 0, err


def test_journey_events_beside_request_spans_leave_the_request_spans_in_charge(tmp_path, capsys):
    request_span = {"name": "llm_request", "startTimeUnixNano": "1000000000",
                    "attributes": [attr("gen_ai.request.id", "r1"), attr("gen_ai.usage.prompt_tokens", 300),
                                   attr("gen_ai.usage.completion_tokens", 40),
                                   attr("gen_ai.latency.time_to_first_token", 0.06), attr("gen_ai.latency.e2e", 0.6)]}
    journey = span("r1", [event("QUEUED", 0, 100.0, 300), event("FINISHED", 40, 100.5, 300, done=40)])
    src = tmp_path / "traces.json"
    src.write_text(json.dumps(doc([request_span, journey])) + "\n")
    code, text, err = run_main(["run", "import", src, "-o", tmp_path / "run", *GIVEN], capsys)
    assert code == 0, err
    assert "beside the 'llm_request' spans" in text
    [row] = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
    assert row["ttft_s"] == pytest.approx(0.06)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["source"]["times"] == "api-server"
