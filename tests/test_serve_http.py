"""`servelab serve` over HTTP: OpenAI shapes (streaming and not), usage, vLLM's errors, /metrics, many streams."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from helpers_serve import serving
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving(port, time_scale=20.0) as base:
        yield base


def call(coro):
    return asyncio.run(coro)


async def post(url: str, path: str, body: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        text = await r.text()
        return r.status, text


async def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: ")
            data = line[6:]
            chunks.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return chunks


def test_completions_stream_usage_last(url):
    chunks = call(stream(url, "/v1/completions", {"model": "sim", "prompt": "x" * 40, "max_tokens": 5, "stream": True,
                                                   "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 5,
                                                         "total_tokens": 15}
    texts = chunks[:-2]
    assert len(texts) == 5 and all(c["object"] == "text_completion" for c in texts)
    assert [c["choices"][0]["finish_reason"] for c in texts] == [None] * 4 + ["length"]


def test_chat_stream_role_then_tokens_no_usage_unless_asked(url):
    chunks = call(stream(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                       "max_tokens": 3, "stream": True}))
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 3 and all("usage" not in c for c in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"


def test_non_streaming_has_usage(url):
    status, text = call(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "abcdefgh"}],
                                                           "max_completion_tokens": 4}))
    body = json.loads(text)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    status, text = call(post(url, "/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2}))
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 7  # token ids count as given


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    # what vLLM refuses too: an empty prompt, a negative token id, min_tokens above max_tokens
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2, 3], "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "min_tokens": 3},
     400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": -1}, 400, "min_tokens"),
])
def test_errors_have_vllms_shape(url, path, body, status, param):
    got, text = call(post(url, path, body))
    error = json.loads(text)["error"]
    assert got == status and error["code"] == status and error["param"] == param and error["message"]


def test_not_json_is_400(url):
    async def go():
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", data=b"{nope") as r:
            return r.status, await r.json()
    status, body = call(go())
    assert status == 400 and "not JSON" in body["error"]["message"]


def test_models_says_how_prompts_are_counted_and_health(url):
    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as r:
                models = await r.json()
            async with http.get(url + "/health") as r:
                return models, r.status
    models, health = call(go())
    card = models["data"][0]
    assert health == 200 and card["id"] == "sim"
    assert card["servelab"]["prompt_tokens"].startswith("approximate") and card["servelab"]["time_scale"] == 20.0


def test_metrics_parse_with_vllm_names_and_count_tokens(url):
    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as r:
                before = await r.text()
            for _ in range(3):
                async with http.post(url + "/v1/completions", json={"prompt": "y" * 80, "max_tokens": 6}) as r:
                    assert r.status == 200
            async with http.get(url + "/metrics") as r:
                return before, await r.text()

    def samples(text):
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0) + s.value
        return out
    before, after = map(samples, call(go()))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum"):
        assert name in after, name
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 18
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 60
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 3
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 15
    assert after["vllm:num_requests_running"] == 0


def test_500_concurrent_streams(free_port):
    """500 streams open at once, all answered in full: a step of 0.2 s of wall clock (2 s simulated at x10) keeps
    every stream open until the last one is sent (checked: the last send comes before the first end), and
    /metrics shows all 500 in the engine at once, at most max_num_seqs (256) running, the rest waiting."""
    from servelab.replay.config import ReplayConfig

    config = ReplayConfig.from_dict({"runner": "linear:base=2.0,decode_seq=0.0002", "num_gpu_blocks": 8192},
                                    source="test")  # fmt: skip

    async def one(http, url, i, sent, ended):
        body = {"prompt": "z" * (40 + i), "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        sent.append(time.monotonic())
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            lines = [line async for line in r.content if line.strip()]
        ended.append(time.monotonic())
        usage = json.loads(lines[-2][6:])["usage"]
        return len(lines) - 2, usage["completion_tokens"], lines[-1].strip()

    async def go(url):
        sent, ended, seen = [], [], []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def scrape():  # (running, waiting) every 20 ms
                while True:
                    async with http.get(url + "/metrics") as r:
                        m = {s.name: s.value for f in text_string_to_metric_families(await r.text()) for s in f.samples}
                    seen.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
                    await asyncio.sleep(0.02)
            scraper = asyncio.create_task(scrape())
            got = await asyncio.gather(*(one(http, url, i, sent, ended) for i in range(500)))
            scraper.cancel()
            async with http.get(url + "/metrics") as r:
                after = {s.name: s.value for f in text_string_to_metric_families(await r.text()) for s in f.samples}
        return got, max(sent) < min(ended), seen, after

    with serving(free_port, config, time_scale=10.0) as url:
        got, overlapped, seen, after = call(go(url))
    assert got == [(4, 4, b"data: [DONE]")] * 500
    assert overlapped, "the streams were not all open at once"
    assert max(r + w for r, w in seen) == 500 and max(r for r, _ in seen) <= 256  # all 500 in the engine at once
    assert after["vllm:request_success_total"] == 500 and after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] == 2000


def test_a_client_that_goes_away_aborts_its_request(url):
    def samples(text):
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as r:
                before = samples(await r.text())
            body = {"prompt": "w" * 400, "max_tokens": 20000, "stream": True}  # minutes of decoding
            async with http.post(url + "/v1/completions", json=body) as r:
                lines = 0
                async for line in r.content:
                    lines += bool(line.strip())
                    if lines == 3:
                        break
                r.close()  # hang up mid-stream
            for _ in range(100):
                await asyncio.sleep(0.02)
                async with http.get(url + "/metrics") as r:
                    after = samples(await r.text())
                if after["vllm:num_requests_running"] == 0:
                    break
            return before, after
    before, after = call(go())
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]
