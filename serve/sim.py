"""The simulated engine behind the server: a cluster built from a replay config, run online on a wall clock.

Simulated seconds = wall seconds since start x ``time_scale``. A request is submitted at its receive
time on that clock, so the engine schedules it from when it came in, whatever the HTTP path costs
later; the clock task advances the engine to each next event's time and the server only releases
the tokens the engine reports (replay/online.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time

from servelab.assembly import build_cluster
from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig
from servelab.replay.engine import Engine
from servelab.replay.online import Online
from servelab.replay.platform import Platform
from servelab.replay.request import Request


class Simulation:
    """One engine online; ``start`` its clock task in the server's event loop."""

    def __init__(self, config: ReplayConfig, time_scale: float = 1.0):
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        cluster = build_cluster(config)
        entry = cluster.pools[0]
        _check_online(config, cluster)
        self.config = config
        self.replicas = cluster.replicas
        self.engine = Engine([], cluster.replicas, entry.router, entry.runner, entry.config.engine)
        self.disagg = cluster.disaggregate(self.engine)  # a PD cluster config: prefill pool, then decode
        self.online = Online(self.engine, self._sink, self.disagg)
        self.time_scale = time_scale
        self.max_model_len = entry.config.engine.max_model_len
        self.t0 = time.perf_counter()
        self.queues: dict[int, asyncio.Queue] = {}
        self.ids = itertools.count()
        self.listeners: list = []  # called with (req, token_times_s, ended) after the request's queue
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def now_s(self) -> float:
        """The simulated time now."""
        return (time.perf_counter() - self.t0) * self.time_scale

    def wall_of(self, sim_s: float) -> float:
        """perf_counter() at which simulated ``sim_s`` comes."""
        return self.t0 + sim_s / self.time_scale

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self.t0 = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._clock())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def submit(self, prompt_tokens: int, max_tokens: int, received_s: float) -> tuple[Request, asyncio.Queue]:
        """A request received at simulated ``received_s``; its queue gets (token times, ended) as the engine makes them."""
        rid = next(self.ids)
        req = Request(rid, received_s, prompt_tokens, max_tokens, index=rid)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[id(req)] = queue
        self.online.submit(req, received_s)
        self._wake.set()
        return req, queue

    def abort(self, req: Request) -> None:
        """``req``'s client went away now: the engine lets it go (its KV freed)."""
        self.queues.pop(id(req), None)
        self.online.abort(req, self.now_s())
        self._wake.set()

    def _sink(self, req: Request, times: list[float], ended: bool) -> None:
        queue = self.queues.get(id(req))
        if ended:
            self.queues.pop(id(req), None)
        if queue is not None:
            queue.put_nowait((times, ended))
        for listener in self.listeners:
            listener(req, times, ended)

    async def _clock(self) -> None:
        online, wake = self.online, self._wake
        while True:
            online.advance(self.now_s())
            nxt = online.next_event_s()
            wake.clear()
            timeout = None if nxt is None else max(0.0, self.wall_of(nxt) - time.perf_counter())
            if timeout == 0.0:
                await asyncio.sleep(0)  # let the handlers run between busy stretches
                continue
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except TimeoutError:
                pass


def _check_online(config: ReplayConfig, cluster) -> None:
    """Refuse, naming it, a setting the online engine does not apply yet (rather than ignore it)."""
    engine = cluster.pools[0].config.engine
    unsupported = []
    if Platform.wanted(engine, cluster.replicas) or any(p.spec.instances for p in cluster.pools):
        unsupported.append("platform features (quota, pause, fail, shedding policies, instance types)")
    if any(p.spec.autoscale is not None for p in cluster.pools):
        unsupported.append("autoscaling")
    if engine.client_timeout_s is not None:
        unsupported.append("client_timeout_s")
    if engine.kv_retention != "lru":
        unsupported.append(f"kv_retention {engine.kv_retention}")
    if cluster.spec.encode is not None:
        unsupported.append("an encode pool")
    if unsupported:
        raise ServelabError(f"servelab serve does not simulate {', '.join(unsupported)} yet (docs/serve.md)")
