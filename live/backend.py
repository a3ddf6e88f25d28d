"""Where a live run's requests go and how: the ``Backend`` a run drives (live/bench.py).

A run builds the same request bodies (``Target.payload``: OpenAI-style completions or chat, streamed)
and keeps the same records whatever carries them. A backend answers five questions:

- ``open(target, concurrency)``: an async context manager that checks the endpoint can be used
  (raising RuntimeError with a one-line reason when it cannot) and holds the connections;
- ``probe_extensions(target)``: does the server take vLLM's ``ignore_eos`` + ``min_tokens``?
- ``tokenizer(target)``: the server's own tokenizer, or None and why it has none (one line);
- ``metrics_sampler(target, interval_s, clock)``: a Prometheus sampler, or None;
- ``send(target, record, prompt, max_tokens, clock)``: one streamed request filling ``record``
  (never raises but CancelledError, after recording it), as live/client.py's ``send``.

``describe()`` adds the backend's own fields to run.json ``endpoint``. ``HttpBackend`` is an
OpenAI-compatible HTTP server (aiohttp); live/sagemaker.py is Amazon SageMaker runtime streaming.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import aiohttp
from servelab.live.client import Record, Target, send
from servelab.live.prometheus import MetricsSampler
from servelab.live.prompts import Tokenizer
from servelab.live.tokenize import server_tokenizer


class Backend(Protocol):
    def describe(self) -> dict: ...

    def open(self, target: Target, concurrency: int) -> AbstractAsyncContextManager[None]: ...

    async def probe_extensions(self, target: Target) -> tuple[bool, str | None]: ...

    async def tokenizer(self, target: Target) -> tuple[Tokenizer | None, str | None]: ...

    def metrics_sampler(self, target: Target, interval_s: float,
                        clock: Callable[[], float]) -> MetricsSampler | None: ...  # fmt: skip

    async def send(self, target: Target, record: Record, prompt: str | list[int], max_tokens: int,
                   clock: Callable[[], float]) -> Record: ...  # fmt: skip


KEEPALIVE_S = 4.0  # under uvicorn's default 5 s keep-alive timeout


class HttpBackend:
    """An OpenAI-compatible server over HTTP: one aiohttp session without a connection limit of its
    own (the load's cap is the cap), ``/v1/models`` as the reachability check, ``/tokenize``, ``/metrics``."""

    def __init__(self) -> None:
        self.http: aiohttp.ClientSession | None = None
        self.server_time_scale: float | None = None  # simulated s per wall s: `servelab serve --time-scale`

    def describe(self) -> dict:
        # a simulated server's clock: the client's times are wall seconds, its /metrics simulated ones
        return {} if self.server_time_scale is None else {"server_time_scale": self.server_time_scale}

    @asynccontextmanager
    async def open(self, target: Target, concurrency: int) -> AsyncIterator[None]:
        # every call here waits as long as a request may (--timeout), no fixed time of its own
        try:  # any HTTP answer will do: a server that is not there fails the command, not every request
            async with aiohttp.ClientSession() as once, \
                    once.get(f"{target.root}/v1/models", headers=target.headers(),
                             timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:  # fmt: skip
                # a connection of its own: some servers drop a kept-alive one after an error
                self.server_time_scale = _time_scale(await response.read(), target.model)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise RuntimeError(f"{target.root}: cannot reach the server ({type(err).__name__}: {err})") from None
        # No cap of its own (--max-in-flight is the cap). Idle connections are closed after
        # KEEPALIVE_S, before the server closes them: uvicorn (vLLM, SGLang, `transformers serve`)
        # closes a connection idle for 5 s, and one reused at that moment drops the request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=target.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            self.http = http
            try:
                yield
            finally:
                self.http = None

    async def probe_extensions(self, target: Target) -> tuple[bool, str | None]:
        """Does the server take ignore_eos + min_tokens? One 2-token request says."""
        body = dict(target.payload(" a", 2), stream=False, ignore_eos=True, min_tokens=2)
        body.pop("stream_options", None)
        try:
            async with self.http.post(target.url, json=body, headers=target.headers(),
                                      timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as response:  # fmt: skip
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as err:
            return False, f"probe failed: {type(err).__name__}: {err}"
        if status == 200:
            return True, None
        return False, f"HTTP {status}: {text[:200]}"

    async def tokenizer(self, target: Target) -> tuple[Tokenizer | None, str | None]:
        return await server_tokenizer(self.http, target)

    def metrics_sampler(self, target: Target, interval_s: float, clock: Callable[[], float]) -> MetricsSampler:
        return MetricsSampler(self.http, f"{target.root}/metrics", interval_s, clock)

    async def send(self, target: Target, record: Record, prompt: str | list[int], max_tokens: int,
                   clock: Callable[[], float]) -> Record:  # fmt: skip
        return await send(self.http, target, record, prompt, max_tokens, clock)


def _time_scale(body: bytes, model: str) -> float | None:
    """The time scale `servelab serve` publishes in its model card (``servelab.time_scale``), else None."""
    try:
        cards = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return None
    if not isinstance(cards, list):
        return None
    cards = [c for c in cards if isinstance(c, dict)]
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else None)
    meta = card.get("servelab") if card else None
    scale = meta.get("time_scale") if isinstance(meta, dict) else None
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 else None
