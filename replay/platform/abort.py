"""Client timeouts: a request its client abandons ends ``aborted`` and gives back its KV (docs/engine.md).

A request with a timeout gets one timed event (the engine's ``TIMER`` kind) at ``arrival_s +
timeout``; nothing else in the replay looks at timeouts, so a replay without any pays nothing. At
equal times the engine's step completions come before timers, so a last token produced exactly at
the deadline still counts (the client read it), and the policy's next decision comes after them, so
it sees the freed blocks.

With ``client_timeout_until = "first_token"`` the deadline is an HTTP read timeout's (GuideLLM's,
httpx's): a request whose first token came by ``t`` is not abandoned (the client has a byte and keeps
reading); one still without it is, as below.

What the client sees happens at the deadline ``t``: status ``aborted``, ``refused_s = t``, the quota
slot and the session's next turn released (``Engine.ended``). What the engine holds goes at ``t``
too, except for a request inside the iteration under way at ``t``: an iteration cannot drop one of
its sequences half-way (vLLM's engine core, too, handles a client's abort between two steps), so a
decode stretch is cut at the first iteration boundary at or after ``t`` and the request leaves the
running set, freeing its blocks, at that boundary. Tokens it produced after ``t`` count in
``generated_tokens`` (the engine did the work) but not as a first token the client saw.

With prefill/decode pools, a request handed off (its KV held on its prefill replica, waiting for a
decode replica or crossing the link) is abandoned there (``Disaggregation.abandon``): the transfer is
cancelled, the landing blocks on the decode replica and the prefill replica's KV are freed at ``t``.
With an encode pool, a request still in the encode stage (queued on an encode replica, being encoded,
or its embeddings crossing the link) leaves it (``EncodePool.abandon``) and is never routed: a queued
one leaves its encode replica's queue, so the requests behind it start earlier; one being encoded is
finished by the encoder (an encode is not dropped half-way) but its embeddings are not sent; a transfer
under way is cancelled. One whose embeddings have landed is on the arrivals' pool and times out there
as above. With replica failures and with reclaimed instances (replay/cluster/fleet.py: a reclaimed replica stops
as a failed one does), an aborted request still inside the iteration its replica was running when the
replica went down loses its KV with the replica and is not moved (``Engine.evict``): it ended once, at
its deadline. A request moved to another replica keeps its deadline there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.replay.core.batch import in_batch
from servelab.replay.core.engine import TIMER
from servelab.replay.core.intents import Decide, LeaveAtBoundary, LetGo, Refuse, TakeOff
from servelab.replay.core.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica



class Aborts:
    """Arms a deadline per request that has a timeout and, when it comes, returns what the abort takes as
    intents (replay/core/intents.py) the engine applies: the request taken off its queue or let go, refused
    (``aborted``), and its replica's stretch cut or its policy asked to decide again."""

    def __init__(self, engine: "Engine", timeouts: dict[int, float], disagg=None, encode=None):
        self.engine = engine
        self.disagg = disagg  # prefill/decode pools (replay/cluster/disagg.py), when any: handoffs are abandoned there
        self.encode = encode  # an encode pool (replay/cluster/encode_pool.py), when any: requests in it leave it
        self.timeouts = timeouts  # request index -> seconds after its arrival the client waits at most
        self.aborted_at: dict[int, float] = {}  # request index -> its client's deadline, once aborted
        self.count = 0
        # an HTTP read timeout (client_timeout_until = first_token): a client with its first byte keeps reading
        self.until_first_token = engine.config.client_timeout_until == "first_token"

    def arm_all(self, requests: list[Request]) -> None:
        """Deadlines of the requests whose arrival is known now (a closed-loop turn's: when it is set)."""
        for req in requests:
            if req.arrival_s is not None and req.index in self.timeouts:
                self.arm(req)

    def arm(self, req: Request) -> None:
        timeout = self.timeouts.get(req.index)
        if timeout is not None:  # (a timed event: the engine applies what ``fire`` returns)
            self.engine.push(req.arrival_s + timeout, TIMER, lambda now, req=req: self.fire(req, now))

    # -- the deadline -------------------------------------------------------------------------
    def fire(self, req: Request, now: float, reason: str | None = None) -> list:
        """The client gives up on ``req`` at ``now`` (``reason``: why, when not its timeout; a server's
        client that disconnected: replay/platform/online.py): the intents that carry it out, in order."""
        status = req.status
        if status.is_terminal or reason is None and self.until_first_token and req.first_token_s is not None:
            return []
        engine = self.engine
        replica = engine.replicas[req.replica] if req.replica is not None else None
        # handed off (KV held for a transfer, off its prefill replica's running set): freed there
        handed_off = self.disagg is not None and self.disagg.abandon(req, now)
        in_flight = not handed_off and status is Status.RUNNING and self._in_flight(replica, req)
        intents = []
        if handed_off:
            replica = None
        elif status is Status.RUNNING and not in_flight:  # it leaves the running set, its blocks freed
            intents.append(LetGo(replica, req, True))
        elif status is Status.WAITING:  # queued, or held while its tier is paused: taken off, as a drop is
            platform = engine.platform
            intents.append(platform.give_up(replica, req) if platform is not None else TakeOff(replica, req))
        elif status is Status.PENDING:  # not routed: in the encode pool, a throttled client's retry, or no live replica
            if (self.encode is None or not self.encode.abandon(req, now)) and engine.platform is not None:
                engine.platform.forget_orphan(req)
        self.aborted_at[req.index] = now
        self.count += 1
        intents.append(Refuse(req, Status.ABORTED, reason or f"client timeout after {self.timeouts[req.index]:g} s"))
        if in_flight:  # it leaves at the first iteration boundary at or after now
            intents.append(LeaveAtBoundary(replica, req))
        elif replica is not None:  # blocks were freed: waiting requests may fit now
            intents.append(Decide(replica))
        return intents

    @staticmethod
    def _in_flight(replica: "Replica", req: Request) -> bool:
        """Is ``req`` part of the iteration ``replica`` is running now?"""
        step = replica.inflight
        if not replica.busy or step is None:
            return False
        return in_batch(step.batch, req)

    # -- leaving the engine -------------------------------------------------------------------
    def release(self, replica: "Replica", req: Request, now: float, finished: bool = False) -> list:
        """An aborted request that was inside an iteration leaves at its end (``finished``: that
        iteration gave it its last token; ``Engine._finish`` asks this instead of finishing it and the
        engine tells the policy, as for any request done in a step): the intents. Nothing more if it
        already left (its replica went down meanwhile: ``Engine.evict``)."""
        # a first token produced after its client left: no TTFT was seen (cleared once it has let go: what
        # it owed its replica counts its prompt until it made a first token)
        unseen = req.first_token_s is not None and req.first_token_s > self.aborted_at[req.index]
        if req not in replica.running:
            if unseen:
                req.first_token_s = None
            return []
        if finished:
            return [LetGo(replica, req, False, unseen)]
        return [LetGo(replica, req, True, unseen), Decide(replica)]

    def meta(self) -> dict:
        return {"aborted": self.count}


def client_timeouts(trace, default_s: float | None) -> dict[int, float]:
    """Request index (row) -> its client timeout: the trace's ``timeout_s`` where set, else ``default_s``
    (``client_timeout_s``); empty when no request has one."""
    column = trace.column("timeout_s").to_pylist() if "timeout_s" in trace.column_names else None
    if column is None:
        return dict.fromkeys(range(trace.num_rows), default_s) if default_s is not None else {}
    if default_s is not None:
        return {i: default_s if t is None else t for i, t in enumerate(column)}
    return {i: t for i, t in enumerate(column) if t is not None}


__all__ = ["Aborts", "client_timeouts"]
