"""The server's Prometheus ``/metrics`` sampled during a run into a time series (metrics.parquet).

Parsed with ``prometheus_client``'s text parser (the reference implementation of the exposition
format). One row per sample per scrape: ``time_s`` (the run's clock), ``metric`` (the sample's name:
``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds_bucket``, ...), ``labels`` (JSON
object, keys sorted) and ``value``. Only families whose name starts with one of ``prefixes`` are kept
(vLLM's ``vllm:``, SGLang's ``sglang:``, TGI's ``tgi_``); an empty tuple keeps everything.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable

import aiohttp
import pyarrow as pa

METRICS_SCHEMA = pa.schema([("time_s", pa.float64()), ("metric", pa.string()), ("labels", pa.string()),
                            ("value", pa.float64())])  # fmt: skip
DEFAULT_PREFIXES = ("vllm:", "sglang:", "tgi_")


def parse_metrics(text: str, prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> list[tuple[str, str, float]]:
    """(sample name, labels JSON, value) for every sample of the kept families."""
    from prometheus_client.parser import text_string_to_metric_families

    rows = []
    for family in text_string_to_metric_families(text):
        if prefixes and not any(family.name.startswith(p) for p in prefixes):
            continue
        for sample in family.samples:
            rows.append((sample.name, json.dumps(dict(sample.labels), sort_keys=True), float(sample.value)))
    return rows


class MetricsSampler:
    """Scrapes ``url`` every ``interval_s`` until stopped; a failed scrape is counted, not fatal.

    The run scrapes once before its first request (the baseline: counters then are what the run
    started from; its ``time_s`` is slightly negative), every ``interval_s`` while it runs, and
    once after its last request ended. Scrapes are only fetched and kept (zlib-compressed, ~7 kB
    for vLLM's ~50 kB) while the run goes on, and parsed when ``table()`` is asked for: parsing one
    takes 7-40 ms of Python, which in the event loop delayed sends by as much (bench/RESULTS_live.md).
    """

    def __init__(self, http: aiohttp.ClientSession, url: str, interval_s: float, clock: Callable[[], float],
                 prefixes: tuple[str, ...] = DEFAULT_PREFIXES):  # fmt: skip
        self.http, self.url, self.interval_s, self.clock, self.prefixes = http, url, interval_s, clock, prefixes
        self.scraped: list[tuple[float, bytes]] = []  # (time on the clock, zlib-compressed exposition text)
        self.failures = 0
        self.last_error: str | None = None
        self.parsed: int | None = None  # scrapes that parsed, once table() ran

    async def scrape(self) -> bool:
        try:
            async with self.http.get(self.url, timeout=aiohttp.ClientTimeout(total=10.0),
                                     raise_for_status=True) as response:  # fmt: skip
                body = await response.read()
            t = self.clock()
        except (aiohttp.ClientError, TimeoutError) as err:
            self.failures += 1
            self.last_error = f"{type(err).__name__}: {err}"
            return False
        self.scraped.append((t, zlib.compress(body, 1)))
        return True

    async def run(self, stop: asyncio.Event, first_after: float = 0.0) -> None:
        wait = first_after
        while True:
            try:
                await asyncio.wait_for(stop.wait(), wait)
                return
            except TimeoutError:
                pass
            await self.scrape()
            wait = self.interval_s

    def table(self, origin: float = 0.0) -> pa.Table:
        """The samples, times made relative to ``origin`` (on the sampler's clock). A scrape that is
        not valid exposition text counts as failed (``meta()``) and adds no rows."""
        times, names, labels, values = [], [], [], []
        parsed = 0
        for t, packed in self.scraped:
            try:
                rows = parse_metrics(zlib.decompress(packed).decode("utf-8", "replace"), self.prefixes)
            except ValueError as err:
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"
                continue
            parsed += 1
            for name, label, value in rows:
                times.append(t - origin)
                names.append(name)
                labels.append(label)
                values.append(value)
        self.parsed = parsed
        return pa.table({"time_s": pa.array(times, pa.float64()), "metric": pa.array(names, pa.string()),
                         "labels": pa.array(labels, pa.string()), "value": pa.array(values, pa.float64())},
                        schema=METRICS_SCHEMA)  # fmt: skip

    def meta(self) -> dict:
        scrapes = len(self.scraped) if self.parsed is None else self.parsed
        return {"url": self.url, "interval_s": self.interval_s, "scrapes": scrapes,
                "failures": self.failures, "last_error": self.last_error}  # fmt: skip


def server_settings(metrics: pa.Table | None) -> dict:
    """Engine settings a server publishes in its metrics (vLLM's ``vllm:cache_config_info`` labels:
    ``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching``) in run.json ``config``'s names, so
    ``validate --real`` replays a live run with the server's KV cache. Empty when none is published."""
    if metrics is None or metrics.num_rows == 0:
        return {}
    import pyarrow.compute as pc

    info = metrics.filter(pc.equal(metrics.column("metric"), "vllm:cache_config_info"))
    if info.num_rows == 0:
        return {}
    labels = json.loads(info.column("labels")[info.num_rows - 1].as_py())
    out: dict = {}
    for name in ("block_size", "num_gpu_blocks"):
        try:
            out[name] = int(labels[name])
        except (KeyError, TypeError, ValueError):  # absent, or "None"
            pass
    if labels.get("enable_prefix_caching") in ("True", "False"):
        out["enable_prefix_caching"] = labels["enable_prefix_caching"] == "True"
    return out
