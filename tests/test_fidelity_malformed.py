"""`servelab run import` on malformed vLLM-bench, GuideLLM and OTel files: every one is a one-line
error naming the file (and the field and row where there is one), never a traceback, and nothing is
written. The table covers wrong types, missing keys, lists of unequal length, non-JSON, an empty
file and nulls."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"
VLLM = json.loads((FIX / "vllm_bench_serve.json").read_text())
GUIDE = json.loads((FIX / "guidellm_report.json").read_text())
OTEL_LINE = (FIX / "otel_llm_request.jsonl").read_text().splitlines()[0]


def vllm(**changes) -> str:
    doc = copy.deepcopy(VLLM)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc)


def guide(edit) -> str:
    doc = copy.deepcopy(GUIDE)
    edit(doc)
    return json.dumps(doc)


def req0(doc) -> dict:
    return doc["benchmarks"][0]["requests"]["successful"][0]


def otel(edit) -> str:
    doc = json.loads(OTEL_LINE)
    edit(doc)
    return json.dumps(doc)


def span0(doc) -> dict:
    return doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


def attr(doc, key: str) -> dict:
    return next(a for a in span0(doc)["attributes"] if a["key"] == key)


# (format, file text, what the error must mention besides the file name)
CASES = {
    # vLLM bench
    "vllm-empty-file": ("vllm-bench", "", "not valid JSON"),
    "vllm-not-json": ("vllm-bench", "{'ttfts': [", "not valid JSON"),
    "vllm-a-list": ("vllm-bench", "[1, 2]", "JSON object"),
    "vllm-ttfts-null": ("vllm-bench", vllm(ttfts=None), "'ttfts'"),
    "vllm-ttfts-a-number": ("vllm-bench", vllm(ttfts=3), "'ttfts'"),
    "vllm-unequal-lists": ("vllm-bench", vllm(latencies=[1.0, 2.0]), "'latencies'"),
    "vllm-missing-input-lens": ("vllm-bench", vllm(input_lens=...), "'input_lens'"),
    "vllm-a-null-time": ("vllm-bench", vllm(start_times=[100.0, None, 101.25, 101.3]), "row 2"),
    "vllm-a-string-length": ("vllm-bench", vllm(input_lens=[100, "lots", 50, 300]), "row 2"),
    "vllm-a-null-length": ("vllm-bench", vllm(output_lens=[11, None, 0, 6]), "row 2"),
    "vllm-a-list-for-a-time": ("vllm-bench", vllm(ttfts=[0.05, [0.08], 0.0, 0.1]), "row 2"),
    "vllm-itls-unequal": ("vllm-bench", vllm(itls=[[0.1]]), "'itls'"),
    "vllm-itls-a-string": ("vllm-bench", vllm(itls=[[0.1], "x", [], [0.1]]), "row 2"),
    "vllm-a-string-gap": ("vllm-bench", vllm(itls=[[0.1], ["x"], [], [0.1]]), "row 2"),
    "vllm-errors-unequal": ("vllm-bench", vllm(errors=["", "x"]), "'errors'"),
    "vllm-errors-a-number": ("vllm-bench", vllm(errors=5), "'errors'"),
    # GuideLLM
    "guide-empty-file": ("guidellm", "", "not valid JSON"),
    "guide-not-json": ("guidellm", "benchmarks:", "not valid JSON"),
    "guide-benchmarks-null": ("guidellm", json.dumps({"benchmarks": None}), "'benchmarks'"),
    "guide-benchmark-a-string": ("guidellm", json.dumps({"benchmarks": ["x"]}), "benchmarks[0]"),
    "guide-requests-a-list": ("guidellm", guide(lambda d: d["benchmarks"][0].update(requests=[])), "'requests'"),
    "guide-successful-a-dict": ("guidellm", guide(lambda d: d["benchmarks"][0]["requests"].update(successful={})),
                                "successful"),
    "guide-request-a-string": ("guidellm", guide(lambda d: d["benchmarks"][0]["requests"].update(successful=["x"])),
                               "successful[0]"),
    "guide-start-a-string": ("guidellm", guide(lambda d: req0(d).update(start_time="soon")), "successful[0]"),
    "guide-tokens-a-string": ("guidellm", guide(lambda d: req0(d).update(prompt_tokens="many")), "successful[0]"),
    "guide-tokens-null": ("guidellm", guide(lambda d: req0(d).update(output_tokens=None)), "successful[0]"),
    "guide-info-a-string": ("guidellm", guide(lambda d: d["benchmarks"][1]["requests"]["successful"][0].update(
        info="x", request_start_time=None)), "successful[0]"),
    "guide-timings-a-list": ("guidellm", guide(lambda d: d["benchmarks"][1]["requests"]["successful"][0].update(
        info={"timings": []}, request_start_time=None)), "successful[0]"),
    # a successful request with a null first_token_time did not complete: a failed request with a warning
    # (tests/test_fidelity_import_cut.py), not an error
    # OTel
    "otel-empty-file": ("otel", "", "no requests"),
    "otel-not-json": ("otel", "{resourceSpans", "not valid JSON"),
    "otel-resource-spans-null": ("otel", json.dumps({"resourceSpans": None}), "resourceSpans"),
    "otel-resource-spans-a-dict": ("otel", json.dumps({"resourceSpans": {"a": 1}}), "resourceSpans"),
    "otel-scope-spans-a-string": ("otel", json.dumps({"resourceSpans": [{"scopeSpans": "x"}]}), "scopeSpans"),
    "otel-spans-a-number": ("otel", json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": 3}]}]}), "spans"),
    "otel-span-a-string": ("otel", json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": ["x"]}]}]}), "spans"),
    "otel-attributes-a-dict": ("otel", otel(lambda d: span0(d).update(attributes={"a": 1})), "attributes"),
    "otel-attribute-a-string": ("otel", otel(lambda d: span0(d).update(attributes=["x"])), "attributes"),
    "otel-value-a-string": ("otel", otel(lambda d: attr(d, "gen_ai.latency.e2e").update(value="fast")),
                            "gen_ai.latency.e2e"),
    "otel-tokens-a-word": ("otel", otel(lambda d: attr(d, "gen_ai.usage.prompt_tokens").update(
        value={"intValue": "many"})), "gen_ai.usage.prompt_tokens"),
    "otel-e2e-a-word": ("otel", otel(lambda d: attr(d, "gen_ai.latency.e2e").update(
        value={"stringValue": "fast"})), "gen_ai.latency.e2e"),
    "otel-ttft-null": ("otel", otel(lambda d: attr(d, "gen_ai.latency.time_to_first_token").update(
        value={"doubleValue": None})), "gen_ai.latency.time_to_first_token"),
    "otel-status-a-string": ("otel", otel(lambda d: span0(d).update(status="ERROR")), "status"),
    "otel-resource-a-list": ("otel", otel(lambda d: d["resourceSpans"][0].update(resource=[])), "resource"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_is_a_one_line_error(tmp_path, capsys, case):
    fmt, text, mention = CASES[case]
    src = tmp_path / f"{case}.json"
    src.write_text(text)
    out = tmp_path / "run"
    code, stdout, stderr = run_main(["run", "import", "--format", fmt, src, "-o", out], capsys)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1, stderr
    assert lines[0].startswith(f"error: {src}") and mention in lines[0], lines[0]
    assert "Traceback" not in stderr and not out.exists()
