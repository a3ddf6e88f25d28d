"""The streaming client's tolerance, against the FALLBACK scripted server (tests/helpers_live_server.py):
comment lines, a stream without [DONE], usage in the last chunk or absent, errors inside the stream,
HTTP errors, a dropped connection, a timeout and a cancellation. Against vLLM: tests/test_live_vllm.py."""

import asyncio
import json

import aiohttp
import pytest
from helpers_live_client import send_or_cancel
from helpers_live_server import FallbackServer, Reply, chunk
from servelab.live.client import Record, Target, send

USAGE = b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}\n\n'

SCENARIOS = {
    # comment lines, no [DONE], no usage: 3 text chunks; an empty-text chunk is not a token
    "no-done": Reply(pieces=[(0, b": keep-alive\n\n"), (0, chunk("a")), (0.01, chunk("")), (0.01, chunk("b")),
                             (0.01, chunk("c", "length"))]),
    # usage in the last chunk (4 chunks but the server says 5 tokens: its count wins), then [DONE]
    "usage": Reply(pieces=[(0, chunk("a")), (0, chunk("b")), (0, chunk("c")), (0, chunk("d", "length")),
                           (0, USAGE), (0, b"data: [DONE]\n\n")]),
    # an error object inside the stream after one token
    "error": Reply(pieces=[(0, chunk("a")), (0, b'data: {"error": {"message": "engine died", "code": 500}}\n\n')]),
    "error-event": Reply(pieces=[(0, chunk("a")), (0, b"event: error\ndata: {\"message\": \"overloaded\"}\n\n")]),
    "http-400": Reply(status=400, content_type="application/json",
                      pieces=[(0, json.dumps({"error": {"message": "ignore_eos is not supported"}}).encode())]),
    "drop": Reply(pieces=[(0, chunk("a")), (0, chunk("b"))], drop=True),
    "slow": Reply(pieces=[(0, chunk("a")), (2.0, chunk("b"))]),
    "not-json": Reply(pieces=[(0, b"data: hello\n\n")]),
    "empty": Reply(pieces=[(0, b"data: [DONE]\n\n")]),
    # chat: the first chunk carries only the role (no token)
    "chat": Reply(pieces=[(0, b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'),
                          (0, chunk("x", chat=True)), (0, chunk("y", "stop", chat=True)), (0, b"data: [DONE]\n\n")]),
    # the connection closed before any answer: once (sent again, finished), or every time (failed after one resend)
    "hangup-once": Reply(hangup=1, pieces=[(0, chunk("a")), (0, chunk("b", "length")), (0, b"data: [DONE]\n\n")]),
    "hangup-always": Reply(hangup=99, pieces=[(0, chunk("a", "length"))]),
    # one 20 MB line (a broken or hostile server), in 64 KiB pieces
    "huge-line": Reply(pieces=[(0, chunk("a"))] + [(0, b"data: " + b"x" * (1 << 16))] * 320 + [(0, b"\n\n")]),
    # not an event stream: a non-streamed JSON completion, an HTML error page
    "not-streamed": Reply(content_type="application/json",
                          pieces=[(0, json.dumps({"id": "x", "choices": [{"index": 0, "text": "hello"}]}).encode())]),
    "html": Reply(content_type="text/html", pieces=[(0, b"<html><body>502 Bad Gateway</body></html>")]),
    # two tokens in one piece of the body (one write), then a third in its own
    "together": Reply(pieces=[(0, chunk("a") + chunk("b")), (0.01, chunk("c", "length")), (0, b"data: [DONE]\n\n")]),
    # \r\n line ends throughout
    "crlf": Reply(pieces=[(0, chunk("a").replace(b"\n", b"\r\n")), (0, b"data: [DONE]\r\n\r\n")]),
}


def _run(prompt: str, api: str = "completions", timeout_s: float = 10.0, cancel_after: float | None = None,
         clock=None):
    async def main():
        async with FallbackServer(SCENARIOS) as server, aiohttp.ClientSession() as http:
            target = Target(server.url + "/v1", "m", api=api, timeout_s=timeout_s, ignore_eos=True)
            record = Record(0, 42)
            sent = send(http, target, record, prompt, 8) if clock is None else send(http, target, record, prompt, 8, clock)
            await send_or_cancel(sent, cancel_after)
            return record, server.received

    return asyncio.run(main())


def test_comments_no_done_no_usage():
    rec, received = _run("no-done")
    assert rec.status == "finished" and rec.reason is None
    assert len(rec.token_times) == 3 and rec.output_tokens == 3 and rec.usage_completion_tokens is None
    assert not rec.saw_done and rec.finish_reason == "length"
    assert rec.send_s <= rec.first_token_s <= rec.finish_s <= rec.end_s
    assert rec.finish_s - rec.first_token_s >= 0.015  # two 10 ms pauses before the last two chunks
    body = received[0]
    assert body["stream"] is True and body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["prompt"] == "no-done"


def test_usage_in_last_chunk_gives_the_count():
    rec, _ = _run("usage")
    assert rec.status == "finished" and rec.saw_done
    assert len(rec.token_times) == 4 and rec.output_tokens == 5 and rec.usage_prompt_tokens == 7


def test_a_piece_of_the_body_is_timed_when_it_arrives_before_it_is_parsed():
    """As vLLM's `bench serve` times each chunk it reads: tokens that came in one piece share its arrival
    time (parsing the first does not make the second later), and the next piece has its own."""
    ticks = iter(range(1000))
    rec, _ = _run("together", clock=lambda: float(next(ticks)))
    assert rec.status == "finished" and len(rec.token_times) == 3
    first, second, third = rec.token_times
    assert first == second < third


@pytest.mark.parametrize("prompt, status, text", [
    ("error", "failed", "error in stream: engine died"),
    ("error-event", "failed", "error in stream: overloaded"),
    ("http-400", "failed", "HTTP 400: ignore_eos is not supported"),
    ("not-json", "failed", "stream event is not JSON: 'hello'"),
    ("empty", "failed", "the stream ended without any generated text"),
])
def test_errors_are_failed_with_their_text(prompt, status, text):
    rec, _ = _run(prompt)
    assert (rec.status, rec.reason) == (status, text)
    assert rec.finish_s is None and rec.end_s is not None


def test_dropped_connection_is_failed_and_keeps_the_tokens_seen():
    rec, _ = _run("drop")
    assert rec.status == "failed" and rec.reason
    assert len(rec.token_times) == 2


def test_timeout_and_cancel():
    rec, _ = _run("slow", timeout_s=0.3)
    assert rec.status == "timeout" and rec.reason == "no complete response within 0.3 s"
    assert 0.3 <= rec.end_s - rec.send_s < 1.5 and len(rec.token_times) == 1
    rec, _ = _run("slow", cancel_after=0.3)
    assert rec.status == "cancelled" and rec.end_s is not None and len(rec.token_times) == 1


def test_chat_role_chunk_is_not_a_token_and_crlf_lines():
    rec, received = _run("chat", api="chat")
    assert rec.status == "finished" and len(rec.token_times) == 2 and rec.finish_reason == "stop"
    assert received[0]["messages"] == [{"role": "user", "content": "chat"}]
    rec, _ = _run("crlf")
    assert rec.status == "finished" and len(rec.token_times) == 1 and rec.saw_done


def test_connection_dropped_before_any_answer_is_sent_once_more():
    rec, received = _run("hangup-once")
    assert rec.status == "finished" and rec.resent and rec.reason is None
    assert len(rec.token_times) == 2 and [b["prompt"] for b in received] == ["hangup-once"] * 2  # the second answered
    rec, received = _run("hangup-always")  # one resend, not a loop
    assert rec.status == "failed" and rec.resent and "ServerDisconnectedError" in rec.reason
    assert rec.token_times == [] and len(received) == 2


def test_kept_alive_connection_closed_at_reuse_loses_nothing():
    """The keep-alive race: a connection the server closes as the client reuses it for the next request."""
    async def main():
        async with FallbackServer(SCENARIOS) as server, aiohttp.ClientSession() as http:
            target = Target(server.url, "m", timeout_s=10.0)
            first, second = Record(0, 1), Record(1, 2)
            await send(http, target, first, "usage", 8)  # opens the connection, kept alive
            await send(http, target, second, "hangup-once", 8)  # reuses it: the server closes it unanswered
            return first, second, server.hung_up, server.connections

    first, second, hung_up, connections = asyncio.run(main())
    assert first.status == second.status == "finished" and not first.resent and second.resent
    assert hung_up == {"hangup-once": 1}
    assert connections == 2  # the second request went out on the first's connection, its resend on a new one


def test_a_refused_connection_is_not_sent_again():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with aiohttp.ClientSession() as http:
            rec = Record(0, 1)
            await send(http, Target(f"http://127.0.0.1:{port}", "m", timeout_s=5.0), rec, "x", 4)
            return rec

    rec = asyncio.run(main())
    assert rec.status == "failed" and not rec.resent and "ClientConnectorError" in rec.reason


@pytest.mark.parametrize("prompt, text", [
    ("not-streamed", "the answer is not an event stream (application/json): '{\"id\": \"x\", \"choices\""),
    ("html", "the answer is not an event stream (text/html): '<html><body>502 Bad Gateway</body></html>'"),
])
def test_an_answer_that_is_not_an_event_stream_says_what_came(prompt, text):
    rec, _ = _run(prompt)
    assert rec.status == "failed" and rec.reason.startswith(text), rec.reason


def test_a_huge_stream_line_fails_that_request_only():
    """A 20 MB line fails its request at the line cap (4 Mi characters) without stalling another."""
    import time

    async def main():
        async with FallbackServer(SCENARIOS) as server, aiohttp.ClientSession() as http:
            target = Target(server.url, "m", timeout_s=30.0)
            huge, other = Record(0, 1), Record(1, 2)
            t0 = time.perf_counter()
            await asyncio.gather(send(http, target, huge, "huge-line", 8), send(http, target, other, "usage", 8))
            return huge, other, time.perf_counter() - t0

    huge, other, wall_s = asyncio.run(main())
    assert huge.status == "failed" and "a stream line longer than 4,194,304 characters" in huge.reason
    assert len(huge.token_times) == 1 and other.status == "finished"
    assert wall_s < 5.0


def test_line_splitter_is_linear_and_capped():
    from servelab.live.sse import LineSplitter, LineTooLong

    splitter = LineSplitter(max_chars=100)
    assert splitter.feed(b"ab") == [] and splitter.feed(b"c\r") == [] and splitter.feed(b"\nd\re") == ["abc", "d"]
    assert splitter.feed(b"f\r") == [] and splitter.feed(b"g") == ["ef"] and splitter.close() == ["g"]
    with pytest.raises(LineTooLong):
        for _ in range(11):
            splitter.feed(b"x" * 10)
