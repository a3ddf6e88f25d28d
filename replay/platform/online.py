"""Online mode: an engine fed requests one by one while it runs, advanced to a clock, reporting tokens as made.

The offline ``Engine.run`` knows every arrival up front; a server (servelab/serve) does not. Here the
engine is driven by three verbs: ``submit`` a request at a simulated time (its receive time on the
server's clock), ``advance`` the engine to a simulated time, and ``next_event_s`` (when the engine has
something to do next, so the clock can sleep until then). Each output token is reported to the
request's sink at the simulated time its iteration ended; a request's end is reported once.

Steps are priced one iteration at a time (no decode stretches, no decode cohort kept in aggregate):
a stretch's tokens are known only at its end, and a server releases each token at its own time. The
runner prices a lone pure-decode iteration as the first of a stretch, so the times are the offline
replay's. None of this touches the offline loop: an engine is switched to online mode by ``Online``.
"""

from __future__ import annotations

from collections.abc import Callable

from servelab.replay.platform.abort import Aborts
from servelab.replay.core.batch import no_aggregate
from servelab.replay.core.engine import Engine
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request
from servelab.replay.core.step import Step

# sink(req, token_times_s, ended): new tokens (simulated end times of their iterations), and whether
# the request reached a terminal state (its status and reason tell how)
Sink = Callable[[Request, list[float], bool], None]


class Online:
    """``engine`` (built with no trace requests) driven online; ``sink`` hears every token and every end.
    ``disagg``: the engine's prefill/decode handoff (replay/cluster/disagg.py), when it has one."""

    def __init__(self, engine: Engine, sink: Sink, disagg=None):
        if engine.arrivals:
            raise ValueError("an online engine takes its requests by submit, not from a trace")
        self.engine = engine
        self.sink = sink
        self.sent: dict[int, int] = {}  # id(request) -> tokens reported so far
        self.live: dict[int, Request] = {}  # id(request) -> request not ended yet
        engine.needs_items = True  # every iteration priced and applied alone (see the module's docstring)
        for replica in engine.replicas:
            no_aggregate(replica)
        engine.step_listeners.append(self._stepped)
        engine.aborts = Aborts(engine, {}, disagg, engine.encode)  # no timeouts: clients that go away (``abort``)
        ended = engine.ended

        def ended_online(req: Request, now: float) -> None:  # (an instance attribute: the class's stays)
            ended(req, now)
            self._ended(req, now)

        engine.ended = ended_online

    @property
    def now_s(self) -> float:
        """The simulated time of the last event processed."""
        return self.engine.now_s

    def submit(self, req: Request, at_s: float) -> float:
        """``req`` arrives at simulated ``at_s`` (not before the last event processed); returns its arrival."""
        at_s = max(at_s, self.engine.now_s)
        key = id(req)
        self.sent[key] = 0
        self.live[key] = req
        self.engine.send_at(req, at_s)
        return at_s

    def abort(self, req: Request, at_s: float, reason: str = "client disconnected") -> None:
        """``req``'s client went away at simulated ``at_s`` (not before the last event processed): it ends
        ``aborted`` and gives back its KV, as a client timeout does (replay/platform/abort.py). Nothing if it ended."""
        if not req.status.is_terminal:
            now = max(at_s, self.engine.now_s)
            self.engine.enact(self.engine.aborts.fire(req, now, reason), now)

    def advance(self, until_s: float) -> None:
        """Process every event at or before simulated ``until_s``."""
        self.engine.advance(until_s)

    def next_event_s(self) -> float | None:
        """When the engine next has an event to process, or None when idle."""
        heap = self.engine.heap
        return heap[0][0] if heap else None

    def running(self) -> tuple[int, int]:
        """(requests running, requests waiting) over the replicas."""
        return (sum(len(r.running) for r in self.engine.replicas),
                sum(len(r.waiting) for r in self.engine.replicas))

    def _stepped(self, replica: Replica, step: Step, end_s: float) -> None:
        sent, sink = self.sent, self.sink
        for req, _n in step.batch.items:
            key = id(req)
            before = sent.get(key)
            if before is None:
                continue
            made = req.num_generated_tokens
            if made > before:  # (a recompute after preemption starts over below ``before``: nothing new yet)
                sent[key] = made
                sink(req, [end_s] * (made - before), False)

    def _ended(self, req: Request, now: float) -> None:
        key = id(req)
        if self.live.pop(key, None) is None:
            return
        before = self.sent.pop(key)
        made = req.num_generated_tokens
        self.sink(req, [now] * max(0, made - before), True)
