"""What stands between a request's receipt and its first token's write in `servelab serve` (serve/app.py):
the stream's headers go out when the request is in the engine, before the first token, and a request
the engine rejects on arrival is still a 400."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from helpers_serve import serving

from servelab.replay.config import ReplayConfig


def test_stream_headers_come_before_the_first_token(free_port):
    """The headers are written when the request is in the engine, as vLLM's server does: the first
    token's write is its chunk alone, and the client has read the headers by then."""
    config = ReplayConfig.from_dict({"runner": "linear:base=0.5,prefill_token=0,decode_seq=0", "num_gpu_blocks": 2048}, source="test")
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}

    async def go(url):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as r:
                headers_at = time.monotonic()
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                await r.content.readline()
                return time.monotonic() - headers_at

    with serving(free_port, config, time_scale=1.0) as url:
        gap_s = asyncio.run(go(url))
    assert gap_s > 0.25  # the first token comes 0.5 s after the receipt; the headers did not wait for it


def test_a_stream_the_engine_rejects_on_arrival_is_a_400(free_port):
    config = ReplayConfig.from_dict({"num_gpu_blocks": 8}, source="test")  # 128 tokens of KV
    body = {"prompt": "w" * 4000, "max_tokens": 4, "stream": True}  # ~1000 tokens

    async def go(url):
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    with serving(free_port, config) as url:
        status, answer = asyncio.run(go(url))
    assert status == 400 and "request not served" in answer["error"]["message"]
    assert "KV blocks" in answer["error"]["message"]
