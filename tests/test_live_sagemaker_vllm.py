"""The SageMaker backend against a real model server: boto3 -> the local SageMaker runtime of
tests/helpers_sagemaker_server.py -> the real vLLM server of SERVELAB_TEST_ENDPOINT (its own
SageMaker route, ``/invocations``), whose real SSE stream comes back re-cut into PayloadParts at
awkward byte boundaries and read by botocore's real event-stream parser. Expected values come from
the trace and from the server's own Prometheus counters, not from the client.

Without SERVELAB_TEST_ENDPOINT these tests skip (with SERVELAB_TEST_REQUIRE_ENDPOINT=1, as in CI, they
fail instead). Only loopback addresses; fake AWS credentials; every load is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_sagemaker_server import SageMakerShim
from helpers_vllm_endpoint import vllm_endpoint
from prometheus_client.parser import text_string_to_metric_families
from servelab.traces.io import read_trace, write_trace
from servelab.traces.synth import synth_trace

ENDPOINT, pytestmark = vllm_endpoint()
MODEL_DIR = os.environ.get("SERVELAB_TEST_VLLM_MODEL")  # the tiny model: its tokenizer.json gives exact prompts
pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'servelab[sagemaker]')")

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent/config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
           "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
NAME = "tiny-endpoint"


def bench(shim: SageMakerShim, trace: Path, out: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | AWS_ENV
    cmd = [sys.executable, "-m", "servelab", "bench", f"sagemaker://{NAME}", trace, "-o", out, "--endpoint-url",
           shim.url, "--token-log", "--no-report", *args]  # fmt: skip
    return subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=300, env=env, check=False)


def counters() -> dict[str, float]:
    """The server's request and token counters (summed over labels)."""
    with urllib.request.urlopen(f"{ENDPOINT}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:request_success_total", "vllm:generation_tokens_total",
                               "vllm:prompt_tokens_total"):  # fmt: skip
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def tokenizer_args() -> list[str]:
    path = Path(MODEL_DIR or "") / "tokenizer.json"
    return ["--tokenizer", str(path)] if MODEL_DIR and path.is_file() else ["--tokenizer", "approximate"]


def check_requests(run: Path, trace_path: Path, exact_prompts: bool) -> dict:
    trace = read_trace(trace_path).to_pydict()
    req = pq.read_table(run / "requests.parquet").to_pydict()
    assert req["request_id"] == trace["request_id"] and set(req["status"]) == {"finished"}, req["reason"]
    assert req["output_tokens"] == req["generated_tokens"] == trace["output_tokens"]  # ignore_eos, the server's usage
    assert all(req["usage_reported"])
    if exact_prompts:
        assert req["prompt_tokens"] == trace["prompt_tokens"]
    tokens = pq.read_table(run / "tokens.parquet").to_pydict()
    by_request: dict[int, list[float]] = {}
    for rid, t in zip(tokens["request_id"], tokens["time_s"]):
        by_request.setdefault(rid, []).append(t)
    for rid, send, first, finish, end, generated in zip(req["request_id"], req["arrival_s"], req["first_token_s"],
                                                        req["finish_s"], req["end_s"], req["generated_tokens"]):  # fmt: skip
        times = by_request[rid]
        assert 1 <= len(times) <= generated  # a chunk may carry two tokens when vLLM's output loop falls behind
        assert times == sorted(times) and times[0] == first and times[-1] == finish
        assert send < first <= finish <= end
    return req


@pytest.fixture(scope="module")
def trace40(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sagemaker") / "t40.arrow"
    write_trace(synth_trace(n=40, rate=10.0, prompt="uniform:16:200", output="uniform:4:24", seed=7), path,
                source="test")  # fmt: skip
    return path


def test_sse_stream_through_sagemaker_parts(trace40, tmp_path):
    """40 requests at the trace's times; vLLM's SSE cut after each read's first byte and in its middle."""
    before = counters()
    with SageMakerShim(NAME, upstream=ENDPOINT) as shim:
        proc = bench(shim, trace40, tmp_path / "run", *tokenizer_args())
    assert proc.returncode == 0, proc.stderr
    after = counters()
    req = check_requests(tmp_path / "run", trace40, exact_prompts=MODEL_DIR is not None)
    assert all(req["saw_done"])
    trace = read_trace(trace40).to_pydict()
    # the server's own counters: the 40, the opening request and the extensions probe (2 tokens each)
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 42
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        sum(trace["output_tokens"]) + 4
    if MODEL_DIR:
        prompt_delta = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        assert prompt_delta - 2 * server_prompt_tokens(" a") == sum(trace["prompt_tokens"])
    assert len(shim.received) == 42 and all(r["path"] == f"/endpoints/{NAME}/invocations-response-stream"
                                            for r in shim.received)  # fmt: skip
    assert shim.parts > 2 * shim.upstream_pieces  # the stream really was cut
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["endpoint"]["backend"] == "sagemaker" and meta["endpoint"]["extensions_probe"] is None
    assert meta["counts"] == {"finished": 40, "not_sent": 0}


def server_prompt_tokens(text: str) -> int:
    """The server's count of a completions prompt (its /tokenize)."""
    body = json.dumps({"model": "tiny", "prompt": text}).encode()
    request = urllib.request.Request(f"{ENDPOINT}/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(json.loads(response.read())["count"])


def test_jsonlines_split_across_parts_closed_loop(trace40, tmp_path):
    """LMI-style JSON lines (vLLM's stream rewritten), 5 bytes of every read held over to the next part
    (a part holds one line's end and the next line's start), 4 closed-loop users."""
    with SageMakerShim(NAME, upstream=ENDPOINT, jsonlines=True, carry=5) as shim:
        proc = bench(shim, trace40, tmp_path / "run", "--shape", "closed", "--users", "4", "--num-requests", "20",
                     *tokenizer_args())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first20 = tmp_path / "t20.arrow"
    write_trace(read_trace(trace40).slice(0, 20), first20, source="test")
    req = check_requests(tmp_path / "run", first20, exact_prompts=MODEL_DIR is not None)
    assert not any(req["saw_done"])  # JSON lines have no [DONE]
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["client"]["peak_in_flight"] <= 4 and shim.peak_in_flight <= 4


def test_chat_and_a_model_error(tmp_path):
    """Chat bodies through /invocations; a prompt longer than the server's 2048-token context is
    refused by vLLM (HTTP 400), which SageMaker reports as a ModelError: that request fails, not the run."""
    trace = tmp_path / "t.arrow"
    write_trace(synth_trace(n=4, rate=20.0, prompt="uniform:20:40", output="uniform:5:9", seed=3), trace,
                source="test")  # fmt: skip
    with SageMakerShim(NAME, upstream=ENDPOINT) as shim:
        proc = bench(shim, trace, tmp_path / "chat", "--api", "chat")
        assert proc.returncode == 0, proc.stderr
        assert all("messages" in r["body"] for r in shim.received)
        check_requests(tmp_path / "chat", trace, exact_prompts=False)

        long = tmp_path / "long.arrow"
        table = read_trace(trace)
        lengths = pa.array([30, 2100, 30, 30], type=table.schema.field("prompt_tokens").type)
        table = table.set_column(table.column_names.index("prompt_tokens"), "prompt_tokens", lengths)
        write_trace(table, long, source="test")
        proc = bench(shim, long, tmp_path / "long", "--tokenizer", "approximate")
    assert proc.returncode == 0, proc.stderr
    req = pq.read_table(tmp_path / "long" / "requests.parquet").to_pydict()
    assert req["status"] == ["finished", "failed", "finished", "finished"]
    assert req["reason"][1].startswith("ModelError (HTTP 424): Received client error (400) from primary")
    assert "2048" in req["reason"][1]  # vLLM's own message names its context length
