"""How much the SageMaker backend costs: CPU per streamed chunk, and open-loop send lag at several rates.

    python bench/bench_live_sagemaker.py

The SageMaker counterpart of bench/bench_live.py: boto3 (one thread per request) against the local
SageMaker runtime of the tests (tests/helpers_sagemaker_server.py) with scripted answers, each chunk
one PayloadPart. For the CPU per chunk the server runs in the same process (the figure includes its
writes: an upper bound for the client); for the send lag and TTFT in a process of its own, and the
HTTP client (aiohttp) against bench/bench_live.py's scripted server is measured the same way at each
rate, for comparison. Fake credentials, loopback only. Results: bench/RESULTS_live.md.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_live import _serve as _serve_http
from bench_live import send_at_rate
from helpers_sagemaker_server import SageMakerShim, Scripted, sse
from servelab.live.client import Record, Target, send
from servelab.live.sagemaker import SageMakerBackend, SageMakerEndpoint

os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                  AWS_CONFIG_FILE="/nonexistent/config", AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials",
                  AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
TARGET = Target("sagemaker://bench", "", timeout_s=60.0)


def _scenario(tokens: int, gap_s: float) -> dict[str, Scripted]:
    return {"x": Scripted([(gap_s, sse("ab")) for _ in range(tokens)] + [(0, b"data: [DONE]\n\n")])}


async def cpu_per_chunk(n: int = 5_000) -> float:
    with SageMakerShim("bench", scenarios=_scenario(n, 0.0), echo=True) as shim:
        backend = SageMakerBackend(SageMakerEndpoint("bench", endpoint_url=shim.url))
        async with backend.open(TARGET, 1):
            c0 = time.process_time()
            rec = await backend.send(TARGET, Record(0, 0), "x", n, time.perf_counter)
            assert rec.status == "finished" and len(rec.token_times) == n, rec.reason
            return (time.process_time() - c0) / n


async def cpu_per_request(n: int = 300) -> float:
    """One-chunk answers one after the other: botocore's request building, signing and HTTP call."""
    with SageMakerShim("bench", scenarios=_scenario(1, 0.0), echo=True) as shim:
        backend = SageMakerBackend(SageMakerEndpoint("bench", endpoint_url=shim.url))
        async with backend.open(TARGET, 1):
            c0 = time.process_time()
            for i in range(n):
                rec = await backend.send(TARGET, Record(i, i), "x", 1, time.perf_counter)
                assert rec.status == "finished", rec.reason
            return (time.process_time() - c0) / n


def _serve(tokens: int, urls) -> None:
    with SageMakerShim("bench", scenarios=_scenario(tokens, 0.005), echo=True) as shim:
        urls.put(shim.url)
        time.sleep(3600)


async def send_lag(rate: float, n: int, tokens: int, backend: str) -> np.ndarray:
    """(send lag, TTFT) per request, open loop at ``rate`` against a server in another process."""
    import multiprocessing

    urls = multiprocessing.Queue()
    serve = _serve if backend == "sagemaker" else _serve_http
    proc = multiprocessing.Process(target=serve, args=(tokens, urls), daemon=True)
    proc.start()
    try:
        url = urls.get(timeout=30)
        if backend == "sagemaker":
            sagemaker = SageMakerBackend(SageMakerEndpoint("bench", endpoint_url=url))
            async with sagemaker.open(TARGET, n):
                return await _open_loop(lambda rec, clock: sagemaker.send(TARGET, rec, "x", tokens, clock), rate, n,
                                        tokens)  # fmt: skip
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            target = Target(url, "m")
            return await _open_loop(lambda rec, clock: send(http, target, rec, "x", tokens, clock), rate, n, tokens)
    finally:
        proc.terminate()
        proc.join()


async def _open_loop(send_one, rate: float, n: int, tokens: int) -> np.ndarray:
    records = await send_at_rate(send_one, rate, n)
    assert all(r.status == "finished" and len(r.token_times) == tokens for r in records)
    return np.array([[r.send_s - r.scheduled_s, r.first_token_s - r.send_s] for r in records])


async def main() -> None:
    per_chunk = await cpu_per_chunk()
    print(f"CPU per streamed chunk (boto3 client + local SageMaker runtime): {per_chunk * 1e6:.1f} us "
          f"(~{1 / per_chunk:,.0f} chunks/s on one core)")
    per_request = await cpu_per_request()
    print(f"CPU per request of one chunk (boto3 client + local SageMaker runtime): {per_request * 1e3:.2f} ms")
    for rate, n in ((20, 200), (50, 500), (100, 1000)):
        for backend in ("sagemaker", "http"):
            lags, ttft = (await send_lag(rate, n, 50, backend)).T
            print(f"{backend:9} open loop {rate} req/s x {n} requests of 50 chunks: send lag p50 "
                  f"{np.percentile(lags, 50) * 1e3:.2f} ms, p99 {np.percentile(lags, 99) * 1e3:.2f} ms, max "
                  f"{lags.max() * 1e3:.2f} ms; TTFT (the server waits 5 ms) p50 {np.percentile(ttft, 50) * 1e3:.1f} ms, "
                  f"p99 {np.percentile(ttft, 99) * 1e3:.1f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
