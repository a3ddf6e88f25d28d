"""How much the live client costs: CPU per streamed chunk, and open-loop send lag at several rates.

    python bench/bench_live.py

Both against the scripted fallback server of the tests (tests/helpers_live_server.py). For the CPU
per chunk it runs in the same process (the figure includes its writes: an upper bound for the
client); for the send lag it runs in a process of its own, as a real server would. Results:
bench/RESULTS_live.md.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers_live_server import FallbackServer, Reply, chunk
from servelab.live.client import Record, Target, send
from servelab.live.load import LoadConfig, schedule


async def cpu_per_chunk(n: int = 20_000) -> float:
    pieces = [(0, chunk("ab")) for _ in range(n)] + [(0, b"data: [DONE]\n\n")]
    async with FallbackServer({"x": Reply(pieces=pieces)}) as server, aiohttp.ClientSession() as http:
        c0 = time.process_time()
        rec = await send(http, Target(server.url, "m"), Record(0, 0), "x", n)
        assert rec.status == "finished" and len(rec.token_times) == n
        return (time.process_time() - c0) / n


def _serve(tokens: int, urls) -> None:
    """The scripted server in a process of its own: each answer ``tokens`` chunks 5 ms apart."""
    pieces = [(0.005, chunk("ab")) for _ in range(tokens)] + [(0, b"data: [DONE]\n\n")]

    async def run() -> None:
        async with FallbackServer({"x": Reply(pieces=pieces)}) as server:
            urls.put(server.url)
            await asyncio.Event().wait()

    asyncio.run(run())


async def send_lag(rate: float, n: int, tokens: int) -> np.ndarray:
    """Open loop at ``rate`` req/s against the scripted server in another process."""
    import multiprocessing

    urls = multiprocessing.Queue()
    proc = multiprocessing.Process(target=_serve, args=(tokens, urls), daemon=True)
    proc.start()
    try:
        return await _open_loop(urls.get(timeout=30), rate, n, tokens)
    finally:
        proc.terminate()
        proc.join()


async def _open_loop(url: str, rate: float, n: int, tokens: int) -> np.ndarray:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        target = Target(url, "m")
        records = await send_at_rate(lambda record, clock: send(http, target, record, "x", tokens, clock), rate, n)
        assert all(r.status == "finished" for r in records)
        return np.array([r.send_s - r.scheduled_s for r in records])


async def send_at_rate(send_one, rate: float, n: int) -> list[Record]:
    """``n`` requests at a constant ``rate``, each ``send_one(record, clock)`` started on schedule."""
    times = schedule(LoadConfig(shape="constant", rate=rate), np.zeros(n))
    records = [Record(i, i) for i in range(n)]
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async with asyncio.TaskGroup() as group:
        for i, at in enumerate(times):
            records[i].scheduled_s = float(at)
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            group.create_task(send_one(records[i], clock))
    return records


async def main() -> None:
    per_chunk = await cpu_per_chunk()
    print(f"CPU per streamed chunk (client + scripted server): {per_chunk * 1e6:.1f} us "
          f"(~{1 / per_chunk:,.0f} chunks/s on one core)")
    for rate, n in ((20, 200), (100, 500), (200, 1000), (500, 2500)):
        lags = await send_lag(rate, n, tokens=50)
        print(f"open loop {rate} req/s x {n} requests of 50 chunks: send lag p50 {np.percentile(lags, 50) * 1e3:.2f} ms, "
              f"p99 {np.percentile(lags, 99) * 1e3:.2f} ms, max {lags.max() * 1e3:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
