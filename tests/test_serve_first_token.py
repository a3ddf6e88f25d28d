"""What stands between a request's receipt and its first token's write in `servelab serve` (serve/app.py,
serve/sim.py): the prompt is counted off the event loop while the engine waits at the receipt, the
stream's headers go out before the first token, and a request the engine rejects on arrival is still a 400."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
from helpers_serve import serving, train_tokenizer

from servelab.replay.config import ReplayConfig
from servelab.serve.prompts import PromptCounter
from servelab.serve.sim import Simulation

RUNNER = "linear:base=0.02,prefill_token=0.0002,decode_seq=0.0004"


def test_prompts_are_counted_off_the_event_loop(tmp_path, free_port, monkeypatch):
    """A 500-token prompt costs a tokenizer ~1 ms: on the loop, every token due meanwhile waits for it."""
    threads = {"count": set(), "loop": set()}
    count, submit = PromptCounter.count, Simulation.submit

    def counted(self, text):
        threads["count"].add(threading.get_ident())
        return count(self, text)

    def submitted(self, *args):
        threads["loop"].add(threading.get_ident())
        return submit(self, *args)

    monkeypatch.setattr(PromptCounter, "count", counted)
    monkeypatch.setattr(Simulation, "submit", submitted)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    body = {"prompt": "the quick brown fox " * 50, "max_tokens": 2, "stream": True}

    async def go(url):
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()

    with serving(free_port, time_scale=20.0, tokenizer=tokenizer) as url:
        asyncio.run(go(url))
    assert len(threads["loop"]) == 1 and threads["count"] and not threads["count"] & threads["loop"]


def test_the_engine_waits_at_the_receipt_while_a_prompt_is_counted():
    """A request held (being counted) for 0.1 s of wall clock joins the engine at its receipt: nothing after
    the receipt is processed meanwhile (a step ended then would start the next one without it), and the
    tokens of the request already running go on once it is in."""
    sim = Simulation(ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 2048}, source="test"), 10.0)
    heard: list[tuple[float, float]] = []  # (wall time heard, simulated token time)
    sim.listeners.append(lambda req, times, ended: heard.extend((time.monotonic(), t) for t in times))

    async def go():
        await sim.start()
        running, queue = sim.submit(200, 400, sim.now_s())
        await asyncio.sleep(0.05)
        received_s = sim.now_s()
        with sim.holding(received_s):
            held_at = time.monotonic()
            await asyncio.sleep(0.1)  # 1 s simulated: ~40 decode steps of the running request
            assert sim.engine.now_s <= received_s
            late, _ = sim.submit(300, 4, received_s)
        while not (await queue.get())[1]:
            pass
        await sim.stop()
        return running, late, held_at, received_s

    running, late, held_at, received_s = asyncio.run(go())
    assert late.arrival_s == received_s
    assert not [t for wall, t in heard if held_at < wall < held_at + 0.1 and t > late.arrival_s]
    assert late.status.name == "FINISHED" and running.status.name == "FINISHED"


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
