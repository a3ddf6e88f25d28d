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


def test_first_tokens_go_out_before_the_running_requests_tokens_of_the_same_step():
    """The engine reports a step's tokens in batch order, running requests first; the server hands a
    new request's first token out before them (all are due at the same instant; serve/sim.py)."""
    from servelab.serve.sim import Simulation

    config = ReplayConfig.from_dict({"runner": "linear:base=0.02,prefill_token=0.0002,decode_seq=0.0004",
                                     "num_gpu_blocks": 2048}, source="test")
    sim = Simulation(config, 20.0)
    heard: list[tuple[float, int, bool]] = []  # (token time, request, first token of it), in hand-out order
    seen: set[int] = set()

    def watched(rid, queue):  # the order tokens reach the requests' queues (what wakes their handlers)
        put = queue.put_nowait

        def put_nowait(item):
            for t in item[0]:
                heard.append((t, rid, rid not in seen))
                seen.add(rid)
            put(item)

        queue.put_nowait = put_nowait
        return queue

    def submit(prompt, output):
        req, queue = sim.submit(prompt, output, sim.now_s())
        return watched(req.request_id, queue)

    async def go():
        await sim.start()
        queues = [submit(100, 200) for _ in range(3)]  # running, decoding
        await asyncio.sleep(0.05)
        queues += [submit(50, 4) for _ in range(2)]  # new: their first tokens come in a later step
        for queue in queues:
            while not (await queue.get())[1]:
                pass
        await sim.stop()

    asyncio.run(go())
    together = {}
    for t, rid, first in heard:
        together.setdefault(t, []).append(first)
    mixed = [firsts for firsts in together.values() if any(firsts) and not all(firsts)]
    assert mixed, "no step made a first token and a running request's token together"
    assert all(firsts == sorted(firsts, reverse=True) for firsts in mixed)  # first tokens, then the others
