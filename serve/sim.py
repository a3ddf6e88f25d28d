"""The simulated engine behind the server: a cluster built from a replay config, run online on a wall clock.

Simulated seconds = wall seconds since start x ``time_scale``. A request is submitted at its receive
time on that clock, so the engine schedules it from when it came in, whatever the HTTP path costs
later; the server only releases the tokens the engine reports (replay/platform/online.py).

The clock is one timer of the event loop set for the engine's next event: when it fires, the
engine is advanced to now in that callback and every token due by then is handed to its request's
queue at once; a submit or an abort sets it again. Each release time is computed from the one origin
``t0`` on the monotonic clock (no sleep per token, so no drift accumulates); no task switch stands
between the timer and the release (a task woken by a timeout costs the loop two or three more turns,
each running every other ready handler first); and the timer's rounding is not left to add up to
a millisecond to every release (``TIMER_RESOLUTION_S``).

Tokens due at the same instant go out first tokens first. The loop writes one stream at a time (a
loopback send costs ~0.1 ms on this project's VM), and the engine reports a step's tokens in batch
order, running requests before new ones: a new request's first token waited behind every running
request's next one (4 on average, 12 at most at ×10 in bench/RESULTS_serve.md, session 18). All are
due at the same simulated time, so the order is the server's to choose: a first token's delay is
all of a TTFT's error, while a stream's TPOT counts only its first and last token (a decode token
sent after a first token's ~0.1 ms send moves it by that over all its gaps).
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
import time

from servelab.assembly import build_cluster
from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig
from servelab.replay.core.engine import Engine
from servelab.replay.platform.online import Online
from servelab.replay.platform.hooks import Platform
from servelab.replay.core.request import Request

# epoll and poll wait whole milliseconds, rounded up: a timer set for t fires in [t, t + 1 ms) (asyncio's
# selector loop), 0.5 ms late on average. So the clock's timer is set half of that early, and the
# last part of a wait shorter than it is spent yielding to the loop (``call_soon``) until the event's
# time: nothing is processed before its time (a step ended early would start the next one without a
# request that comes in meanwhile), and nothing waits a rounded-up millisecond after it.
TIMER_RESOLUTION_S = 1e-3 if selectors.DefaultSelector.__name__ in ("EpollSelector", "PollSelector",
                                                                      "DevpollSelector") else 0.0


class Simulation:
    """One engine online; ``start`` its clock (a timer) in the server's event loop."""

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
        self.t0 = time.monotonic()  # the event loop's clock (asyncio's loop.time())
        self.queues: dict[int, asyncio.Queue] = {}
        self.ids = itertools.count()
        self.listeners: list = []  # called with (req, token_times_s, ended) as the engine reports them
        self._released: list[tuple[Request, list[float], bool]] = []  # by the engine call now running
        self._streaming: set[int] = set()  # requests whose first token went out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None  # the simulated time the timer is set for

    def now_s(self) -> float:
        """The simulated time now."""
        return (time.monotonic() - self.t0) * self.time_scale

    def wall_of(self, sim_s: float) -> float:
        """time.monotonic() (the loop's time) at which simulated ``sim_s`` comes."""
        return self.t0 + sim_s / self.time_scale

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.t0 = time.monotonic()
        self._arm()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
        self._loop = None

    def submit(self, prompt_tokens: int, max_tokens: int, received_s: float) -> tuple[Request, asyncio.Queue]:
        """A request received at simulated ``received_s``; its queue gets (token times, ended) as the engine makes them."""
        rid = next(self.ids)
        req = Request(rid, received_s, prompt_tokens, max_tokens, index=rid)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[id(req)] = queue
        self.online.submit(req, received_s)
        self._arm()
        return req, queue

    def abort(self, req: Request) -> None:
        """``req``'s client went away now: the engine lets it go (its KV freed)."""
        self.queues.pop(id(req), None)
        self._streaming.discard(id(req))
        self.online.abort(req, self.now_s())
        self._hand_out()
        self._arm()

    def _sink(self, req: Request, times: list[float], ended: bool) -> None:
        self._released.append((req, times, ended))
        for listener in self.listeners:
            listener(req, times, ended)

    def _hand_out(self) -> None:
        """What the engine call just made goes to the requests' queues, first tokens first, each kind
        in the engine's order (see the module's docstring)."""
        released, self._released = self._released, []
        streaming = self._streaming
        released.sort(key=lambda r: id(r[0]) in streaming)  # stable: False (a first token) first
        for req, times, ended in released:
            key = id(req)
            queue = self.queues.get(key)
            if ended:
                self.queues.pop(key, None)
                streaming.discard(key)
            elif times:
                streaming.add(key)
            if queue is not None:
                queue.put_nowait((times, ended))

    def _tick(self) -> None:
        """The timer fired: process every event due by now (its tokens go out), then set it again."""
        self._timer = self._timer_at = None
        self.online.advance(self.now_s())
        self._hand_out()
        self._arm()

    def _arm(self) -> None:
        """Set the timer for the engine's next event (a past one: the loop's next turn); none when idle."""
        if self._loop is None:
            return
        nxt = self.online.next_event_s()
        if nxt == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        if nxt is None:
            self._timer = self._timer_at = None
            return
        delay = self.wall_of(nxt) - time.monotonic()
        if delay < TIMER_RESOLUTION_S or delay <= 0:  # due, or nearly: look again on the loop's next turn
            self._timer = self._loop.call_soon(self._tick)
        else:  # (call_later: on the loop's own clock)
            self._timer = self._loop.call_later(delay - TIMER_RESOLUTION_S / 2, self._tick)
        self._timer_at = nxt


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
    if engine.until_s is not None or config.engine.until_s is not None:  # a server runs until it is stopped
        unsupported.append("until_s (--until)")
    if engine.kv_retention != "lru":
        unsupported.append(f"kv_retention {engine.kv_retention}")
    if cluster.spec.encode is not None:
        unsupported.append("an encode pool")
    if unsupported:
        raise ServelabError(f"servelab serve does not simulate {', '.join(unsupported)} yet (docs/serve.md)")
