"""The SageMaker backend (live/sagemaker.py) offline: boto3's real client and botocore's real
event-stream parser against the local SageMaker runtime of tests/helpers_sagemaker_server.py, with
scripted streams (FALLBACK: split lines, JSON lines, ModelStreamError, error answers, drops, slow
answers) that a real server does not produce on demand. The same protocol with a real vLLM server
behind it: tests/test_live_sagemaker_vllm.py. Nothing leaves loopback: fake credentials, endpoint_url."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main, write_small_trace
from helpers_live_client import send_or_cancel
from helpers_sagemaker_server import (
    SageMakerShim,
    Scripted,
    awkward_split,
    payload_part,
    sse,
    stream_error,
)
from servelab.common.errors import ServelabError
from servelab.live.client import Record, Target
from servelab.live.sagemaker import PayloadReader, SageMakerBackend, SageMakerEndpoint
from servelab.live.sse import Event

pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'servelab[sagemaker]')")

ENDPOINT = "test-endpoint"
USAGE = b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"


def jsonl(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    return json.dumps({"id": "x", "choices": choices} | ({"usage": usage} if usage else {})).encode() + b"\n"


THREE = sse("a") + sse("é") + sse("c", "length") + USAGE + DONE  # 3 tokens, usage, [DONE]
JSONL = jsonl("a") + jsonl("b", "length") + jsonl(None, usage={"prompt_tokens": 5, "completion_tokens": 2})

SCENARIOS = {
    # every byte its own PayloadPart: "é" (2 bytes in UTF-8) is split too
    "bytewise": Scripted([(0, THREE[k:k + 1]) for k in range(len(THREE))]),
    # the whole stream, five lines, in one PayloadPart
    "one-part": Scripted([(0, THREE)]),
    # two event-stream messages in one HTTP chunk
    "two-messages": Scripted([(0, ("raw", payload_part(sse("a")) + payload_part(sse("b", "stop"))))]),
    # LMI-style JSON lines, each line cut in three, no [DONE]
    "jsonlines": Scripted([(0, p) for line in JSONL.splitlines(keepends=True) for p in awkward_split(line)],
                          content_type="application/jsonlines"),
    # JSON lines under a content type that says nothing: the first line tells
    "jsonlines-sniffed": Scripted([(0, JSONL[:7]), (0, JSONL[7:])], content_type="application/json"),
    "model-stream-error": Scripted([(0, sse("a")), (0, sse("b")),
                                    (0, ("raw", stream_error("ModelStreamError", "Model stream broken", "StreamBroken")))]),
    "internal-failure": Scripted([(0, sse("a")), (0, ("raw", stream_error("InternalStreamFailure", "try again")))]),
    "model-error": Scripted(status=424, error_type="ModelError", error_body={
        "Message": "Received client error (400) from primary with message \"max_tokens is too large\"",
        "OriginalStatusCode": 400, "OriginalMessage": "max_tokens is too large"}),
    "throttled": Scripted(status=429, error_type="ThrottlingException", error_body={"Message": "Rate exceeded"}),
    "error-in-stream": Scripted([(0, sse("a")), (0, b'data: {"error": {"message": "engine died", "code": 500}}\n\n')]),
    "drop": Scripted([(0, sse("a")), (0, "drop")]),
    "slow": Scripted([(0, sse("a")), (2.0, sse("b")), (0, DONE)]),
    "empty": Scripted([(0, DONE)]),
    "chat": Scripted([(0, b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'),
                      (0, sse("x", chat=True)), (0, sse("y", "stop", chat=True)), (0, DONE)]),
}


@pytest.fixture
def aws_env(monkeypatch):
    """Fake credentials and a region from the environment only (no ~/.aws, no instance metadata)."""
    for name in ("AWS_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent/config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
           "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def shim():
    with SageMakerShim(ENDPOINT, scenarios=SCENARIOS, echo=True) as server:
        yield server


def _send(shim, prompt: str, api: str = "completions", timeout_s: float = 10.0, cancel_after: float | None = None,
          stream_format: str = "auto", model: str = "", **endpoint):  # fmt: skip
    backend = SageMakerBackend(SageMakerEndpoint(endpoint.pop("name", ENDPOINT), endpoint_url=shim.url,
                                                 stream_format=stream_format, **endpoint))  # fmt: skip
    target = Target(f"sagemaker://{ENDPOINT}", model, api=api, timeout_s=timeout_s, ignore_eos=True)

    async def main():
        async with backend.open(target, 4):
            record = Record(0, 42)
            await send_or_cancel(backend.send(target, record, prompt, 8, time.perf_counter), cancel_after)
            return record

    return asyncio.run(main())


# --- PayloadPart bytes -> events, at every split -------------------------------------------------

SSE_STREAM = ": ping\r\n\r\ndata: {\"t\": \"é\"}\r\n\r\nevent: error\ndata: {\"m\": 1}\n\ndata: [DONE]\n\n".encode()
SSE_EVENTS = [Event('{"t": "é"}'), Event('{"m": 1}', "error"), Event("[DONE]")]
JSONL_STREAM = b'{"a": 1}\n\n{"b": "\xc3\xa9"}\r\n{"c": 3}'  # a blank line, CRLF, no line end at the end
JSONL_EVENTS = [Event('{"a": 1}'), Event('{"b": "é"}'), Event('{"c": 3}')]


def _events(data: bytes, cuts: tuple[int, ...], fmt: str, content_type: str | None) -> list[Event]:
    reader = PayloadReader(fmt, content_type)
    bounds = [0, *cuts, len(data)]
    out = []
    for a, b in itertools.pairwise(bounds):
        out += reader.feed(data[a:b])
    return out + reader.close()


@pytest.mark.parametrize("data, fmt, content_type, expected", [
    (SSE_STREAM, "sse", None, SSE_EVENTS),
    (SSE_STREAM, "auto", "text/event-stream; charset=utf-8", SSE_EVENTS),
    (SSE_STREAM, "auto", None, SSE_EVENTS),  # sniffed: ": ping" is not JSON
    (JSONL_STREAM, "jsonlines", None, JSONL_EVENTS),
    (JSONL_STREAM, "auto", "application/jsonlines", JSONL_EVENTS),
    (JSONL_STREAM, "auto", "application/x-ndjson", JSONL_EVENTS),
    (b"\n\n" + JSONL_STREAM, "auto", "application/json", JSONL_EVENTS),  # sniffed after blank lines
])
def test_payload_reader_at_every_pair_of_cuts(data, fmt, content_type, expected):
    for i in range(len(data) + 1):
        for j in range(i, len(data) + 1):
            assert _events(data, (i, j), fmt, content_type) == expected, (i, j)


def test_payload_reader_forced_format_reads_the_other_format_as_it_is():
    # JSON lines read as SSE: no "data:" field, so no events; SSE read as JSON lines: lines that are not JSON
    assert _events(JSONL_STREAM, (), "sse", "application/jsonlines") == []
    assert _events(b"data: {}\n\n", (), "jsonlines", None) == [Event("data: {}")]


# --- one request through boto3 -------------------------------------------------------------------

def test_bytewise_parts_give_the_tokens_usage_and_the_request_sent(aws_env, shim):
    rec = _send(shim, "bytewise")
    assert rec.status == "finished" and rec.reason is None and rec.saw_done and rec.finish_reason == "length"
    assert len(rec.token_times) == 3 and rec.usage_completion_tokens == 3 and rec.usage_prompt_tokens == 7
    assert rec.send_s <= rec.first_token_s <= rec.token_times[1] <= rec.finish_s <= rec.end_s
    check, call = shim.received[0], shim.received[1]  # the opening 2-token request, then this one
    assert check["body"]["prompt"] == " a" and check["body"]["max_tokens"] == 2 and "ignore_eos" not in check["body"]
    assert call["method"] == "POST" and call["path"] == f"/endpoints/{ENDPOINT}/invocations-response-stream"
    assert call["headers"]["content-type"] == "application/json"
    assert "/us-east-1/sagemaker/aws4_request" in call["headers"]["authorization"]  # SigV4 for SageMaker, the region
    assert call["body"] == {"prompt": "bytewise", "max_tokens": 8, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}  # no "model": none given
    assert "x-amzn-sagemaker-inference-component" not in call["headers"]


def test_model_and_inference_component_are_sent_when_given(aws_env, shim):
    rec = _send(shim, "one-part", model="tiny", inference_component="ic-1")
    assert rec.status == "finished" and len(rec.token_times) == 3
    assert len(set(rec.token_times)) == 1  # one part: every token arrived at once
    assert shim.received[1]["body"]["model"] == "tiny"
    assert shim.received[1]["headers"]["x-amzn-sagemaker-inference-component"] == "ic-1"


@pytest.mark.parametrize("prompt, tokens, usage, saw_done", [
    ("two-messages", 2, None, False),
    ("jsonlines", 2, 2, False),
    ("jsonlines-sniffed", 2, 2, False),
])
def test_streams_finish_with_their_tokens(aws_env, shim, prompt, tokens, usage, saw_done):
    rec = _send(shim, prompt)
    assert rec.status == "finished" and len(rec.token_times) == tokens
    assert rec.usage_completion_tokens == usage and rec.saw_done is saw_done


@pytest.mark.parametrize("prompt, tokens, reason", [
    ("model-stream-error", 2, "ModelStreamError: Model stream broken"),
    ("internal-failure", 1, "InternalStreamFailure: try again"),
    ("model-error", 0, ("ModelError (HTTP 424): Received client error (400) from primary with message "
                        "\"max_tokens is too large\"")),
    ("throttled", 0, "ThrottlingException (HTTP 429): Rate exceeded"),
    ("error-in-stream", 1, "error in stream: engine died"),
    ("empty", 0, "the stream ended without any generated text"),
])
def test_errors_are_failed_with_their_text(aws_env, shim, prompt, tokens, reason):
    rec = _send(shim, prompt)
    assert (rec.status, rec.reason) == ("failed", reason)
    assert len(rec.token_times) == tokens and rec.finish_s is None and rec.end_s >= rec.send_s
    assert [r["body"]["prompt"] for r in shim.received] == [" a", prompt]  # one attempt: boto3 retries nothing


def test_forced_jsonlines_on_an_sse_stream_fails_with_the_line(aws_env, shim):
    with pytest.raises(RuntimeError, match="did not answer a 2-token request .stream event is not JSON: 'data: "):
        _send(shim, "one-part", stream_format="jsonlines", region="eu-west-1")
    assert "/eu-west-1/sagemaker/aws4_request" in shim.received[0]["headers"]["authorization"]


def test_dropped_connection_is_failed_and_keeps_the_token(aws_env, shim):
    rec = _send(shim, "drop")
    assert rec.status == "failed" and rec.reason and len(rec.token_times) == 1


def _request_threads() -> int:
    return sum(t.name.startswith("servelab-sagemaker-") for t in threading.enumerate())


def test_timeout_and_cancel_end_the_request_and_its_thread(aws_env, shim):
    rec = _send(shim, "slow", timeout_s=0.3)
    assert rec.status == "timeout" and rec.reason == "no complete response within 0.3 s"
    assert 0.3 <= rec.end_s - rec.send_s < 1.5 and len(rec.token_times) == 1
    deadline = time.monotonic() + 1.0  # the server's next part comes 2 s after the first: the socket was shut
    while _request_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _request_threads() == 0
    rec = _send(shim, "slow", cancel_after=0.3)
    assert rec.status == "cancelled" and rec.end_s is not None and len(rec.token_times) == 1
    assert rec.reason == "stopped by the run (interrupt or duration limit)"


def test_chat_role_chunk_is_not_a_token(aws_env, shim):
    rec = _send(shim, "chat", api="chat")
    assert rec.status == "finished" and len(rec.token_times) == 2 and rec.finish_reason == "stop"
    assert shim.received[1]["body"]["messages"] == [{"role": "user", "content": "chat"}]


def test_unknown_endpoint_fails_the_opening_request(aws_env, shim):
    with pytest.raises(RuntimeError, match=r"^sagemaker://nope: the endpoint did not answer a 2-token request "
                                           r"\(ValidationError \(HTTP 400\): Endpoint nope of account "
                                           r"123456789012 not found.\)$"):  # fmt: skip
        _send(shim, "one-part", name="nope")


def test_client_configuration(aws_env):
    """No retries, the pool sized to the requests in flight, botocore's read timeout past ours, and
    the region's public endpoint when no --endpoint-url is given (nothing is sent here)."""
    backend = SageMakerBackend(SageMakerEndpoint(ENDPOINT, region="us-west-2"))
    client = backend._make_client(Target(f"sagemaker://{ENDPOINT}", "", timeout_s=30.0), 64)
    assert client.meta.endpoint_url == "https://runtime.sagemaker.us-west-2.amazonaws.com"
    assert client.meta.region_name == "us-west-2" and client.meta.service_model.signing_name == "sagemaker"
    config = client.meta.config
    assert config.retries["total_max_attempts"] == 1 and config.max_pool_connections == 64
    assert config.read_timeout == 35.0 and config.connect_timeout == 30.0


def test_duration_limit_cancels_the_requests_in_flight(aws_env):
    """run_live through the backend: 4 requests sent in the first 0.3 s, each 10 chunks 0.2 s apart,
    a 0.6 s duration: all four in flight at the limit, cancelled with the tokens they had, and
    their threads gone soon after (their sockets shut), long before the answers would have ended."""
    from conftest import make_trace
    from servelab.live.bench import run_live
    from servelab.live.load import LoadConfig

    trace = make_trace([0.0, 0.1, 0.2, 0.3], [20] * 4, [10] * 4)
    with SageMakerShim(ENDPOINT, echo=True, echo_gap_s=0.2) as server:
        backend = SageMakerBackend(SageMakerEndpoint(ENDPOINT, endpoint_url=server.url))
        target = Target(f"sagemaker://{ENDPOINT}", "", ignore_eos=True)
        t0 = time.monotonic()
        run = asyncio.run(run_live(trace, target, LoadConfig(duration_s=0.6), backend=backend))
        deadline = time.monotonic() + 1.0
        while _request_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _request_threads() == 0 and time.monotonic() - t0 < 5.0  # the answers would take 2 s more
    assert [r.status for r in run.records] == ["cancelled"] * 4 and run.meta["stopped_by"] == "duration"
    assert {r.reason for r in run.records} == {"in flight when the duration limit was reached"}
    for rec, sent_at in zip(run.records, (0.0, 0.1, 0.2, 0.3)):
        # chunks come 0.2 s apart after the send: 1 to 3 of the 10 before the limit, none after it
        assert 1 <= len(rec.token_times) <= 3 and rec.token_times[-1] <= rec.end_s
        assert 0.6 <= rec.end_s < 1.0 and abs(rec.send_s - sent_at) < 0.05
    assert run.meta["endpoint"]["backend"] == "sagemaker"


# --- the command ---------------------------------------------------------------------------------

def test_bench_sagemaker_runs_the_trace(tmp_path, capsys, aws_env):
    """12 requests, 3 closed-loop users, 2 warm-up requests, against the scripted (echo) endpoint:
    every request in requests.parquet with the streamed counts, the token log, run.json's endpoint."""
    trace = write_small_trace(tmp_path, n=12)  # 50 prompt tokens (49 words + 1), 10 output tokens each
    with SageMakerShim(ENDPOINT, echo=True) as server:
        code, stdout, err = run_main(["bench", f"sagemaker://{ENDPOINT}", trace, "-o", tmp_path / "run",
                                      "--endpoint-url", server.url, "--shape", "closed", "--users", "3",
                                      "--warmup", "2", "--token-log", "--tokenizer", "approximate"], capsys)  # fmt: skip
    assert code == 0, err
    assert f"sending 12 requests to sagemaker://{ENDPOINT} (model the endpoint's own, shape closed)" in err
    req = pq.read_table(tmp_path / "run" / "requests.parquet").to_pydict()
    assert req["request_id"] == list(range(12)) and set(req["status"]) == {"finished"}
    assert req["output_tokens"] == [10] * 12 and req["prompt_tokens"] == [50] * 12 and all(req["saw_done"])
    tokens = pq.read_table(tmp_path / "run" / "tokens.parquet").to_pydict()
    assert len(tokens["request_id"]) == 120
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["endpoint"]["backend"] == "sagemaker" and meta["endpoint"]["endpoint_name"] == ENDPOINT
    assert meta["endpoint"]["region"] == "us-east-1" and meta["endpoint"]["url"] == f"sagemaker://{ENDPOINT}"
    assert meta["endpoint"]["extensions_probe"] is None and meta["metrics"] is None
    assert meta["counts"] == {"finished": 12, "not_sent": 0} and meta["warmup"]["finished"] == 2
    assert meta["client"]["peak_in_flight"] <= 3 and server.peak_in_flight <= 3
    assert not (tmp_path / "run" / "metrics.parquet").exists()
    # the opening request, the extensions probe, 2 warm-up requests, the 12
    bodies = [r["body"] for r in server.received]
    assert len(bodies) == 16 and bodies[1]["ignore_eos"] is True and bodies[1]["min_tokens"] == 2
    assert all(b["ignore_eos"] and b["min_tokens"] == 10 for b in bodies[4:])
    assert "requests 12: 12 finished" in " ".join(stdout.split())


@pytest.mark.parametrize("args, message", [
    (["sagemaker://bad_name"], "error: sagemaker://bad_name: not a SageMaker endpoint name"),
    (["http://127.0.0.1:9", "--region", "us-east-1"], "Invalid value for --region: goes with a sagemaker:// URL"),
    (["http://127.0.0.1:9", "--stream-format", "sse"], "Invalid value for --stream-format: goes with a sagemaker://"),
    ([f"sagemaker://{ENDPOINT}", "--metrics"], "Invalid value for --metrics: a SageMaker endpoint has no /metrics"),
    ([f"sagemaker://{ENDPOINT}", "--api-key", "k"], "Invalid value for --api-key: goes with an http(s):// URL"),
    ([f"sagemaker://{ENDPOINT}", "--tokenizer", "server"], ("Invalid value for --tokenizer: a SageMaker endpoint "
                                                            "has no /tokenize")),
    ([f"sagemaker://{ENDPOINT}", "--endpoint-url", "127.0.0.1:9"], "Invalid value for --endpoint-url: must start"),
    (["ftp://x"], "must start with http:// or https:// (or sagemaker:// for a SageMaker endpoint)"),
])
def test_bench_sagemaker_argument_errors(tmp_path, capsys, aws_env, args, message):
    code, _, err = run_main(["bench", args[0], write_small_trace(tmp_path), "-o", tmp_path / "o", "--model", "m",
                             *args[1:]], capsys)  # fmt: skip
    assert code in (1, 2) and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("unset, message", [
    ("AWS_DEFAULT_REGION", (f"error: sagemaker://{ENDPOINT}: no AWS region: give --region, or set AWS_REGION or "
                            "AWS_DEFAULT_REGION")),
    ("AWS_ACCESS_KEY_ID", f"error: sagemaker://{ENDPOINT}: no AWS credentials found"),
    (None, (f"error: sagemaker://{ENDPOINT}: the endpoint did not answer a 2-token request (EndpointConnectionError: "
            "Could not connect to the endpoint URL")),
])
def test_bench_sagemaker_unusable_endpoint_fails_the_command(tmp_path, capsys, aws_env, monkeypatch, unset, message,
                                                            free_port):
    if unset:
        monkeypatch.delenv(unset)
    code, _, err = run_main(["bench", f"sagemaker://{ENDPOINT}", write_small_trace(tmp_path), "-o", tmp_path / "o",
                             "--endpoint-url", f"http://127.0.0.1:{free_port}"], capsys)  # fmt: skip
    assert code == 1 and err.splitlines()[-1].startswith(message), err
    assert not (tmp_path / "o").exists()


def test_missing_boto3_names_the_extra(tmp_path, capsys, monkeypatch):
    from servelab.live.sagemaker import require_boto3

    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(ServelabError, match=r"^the SageMaker backend needs boto3: pip install 'servelab\[sagemaker\]'$"):
        require_boto3()
    code, _, err = run_main(["bench", f"sagemaker://{ENDPOINT}", write_small_trace(tmp_path), "-o", tmp_path / "o"],
                            capsys)  # fmt: skip
    assert code == 1 and err.strip() == "error: the SageMaker backend needs boto3: pip install 'servelab[sagemaker]'"
