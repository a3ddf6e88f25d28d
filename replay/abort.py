"""Client timeouts: a request its client abandons ends ``aborted`` and gives back its KV (docs/engine.md).

A request with a timeout gets one timed event (the engine's ``TIMER`` kind) at ``arrival_s +
timeout``; nothing else in the replay looks at timeouts, so a replay without any pays nothing. At
equal times the engine's step completions come before timers, so a last token produced exactly at
the deadline still counts (the client read it), and the policy's next decision comes after them, so
it sees the freed blocks.

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
With replica failures, an aborted request still inside the iteration its replica was running when
the replica went down loses its KV with the replica and is not moved (``Platform.evict``): it ended
once, at its deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.common.errors import ServelabError
from servelab.replay.batch import in_batch
from servelab.replay.engine import TIMER
from servelab.replay.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.engine import Engine
    from servelab.replay.replica import Replica



class Aborts:
    """Arms a deadline per request that has a timeout and carries out the abort when it comes."""

    def __init__(self, engine: "Engine", timeouts: dict[int, float], disagg=None):
        self.engine = engine
        self.disagg = disagg  # prefill/decode pools (replay/disagg.py), when any: handoffs are abandoned there
        self.timeouts = timeouts  # request index -> seconds after its arrival the client waits at most
        self.aborted_at: dict[int, float] = {}  # request index -> its client's deadline, once aborted
        self.count = 0

    def arm_all(self, requests: list[Request]) -> None:
        """Deadlines of the requests whose arrival is known now (a closed-loop turn's: when it is set)."""
        for req in requests:
            if req.arrival_s is not None and req.index in self.timeouts:
                self.arm(req)

    def arm(self, req: Request) -> None:
        timeout = self.timeouts.get(req.index)
        if timeout is not None:
            self.engine.push(req.arrival_s + timeout, TIMER, lambda now, req=req: self.fire(req, now))

    # -- the deadline -------------------------------------------------------------------------
    def fire(self, req: Request, now: float, reason: str | None = None) -> None:
        """The client gives up on ``req`` at ``now`` (``reason``: why, when not its timeout; a server's
        client that disconnected: replay/online.py)."""
        status = req.status
        if status.is_terminal:
            return
        engine = self.engine
        replica = engine.replicas[req.replica] if req.replica is not None else None
        # handed off (KV held for a transfer, off its prefill replica's running set): freed there
        handed_off = self.disagg is not None and self.disagg.abandon(req, now)
        in_flight = not handed_off and status is Status.RUNNING and self._in_flight(replica, req)
        if handed_off:
            replica = None
        elif status is Status.RUNNING and not in_flight:
            self._leave_running(replica, req, now)
        elif status is Status.WAITING:
            self._leave_waiting(replica, req)
        elif status is Status.PENDING:  # not routed yet: a throttled client's retry, or no live replica
            platform = engine.platform
            if platform is not None and req in platform.orphans:
                platform.orphans.remove(req)
        engine.ledger.refused_s[req.index] = now
        self.aborted_at[req.index] = now
        self.count += 1
        engine.end(req, Status.ABORTED, reason or f"client timeout after {self.timeouts[req.index]:g} s", now)
        if in_flight:  # it leaves at the first iteration boundary at or after now
            engine._cut_stretch(replica, now)
            end_s = replica.inflight.end_s
            engine.push(end_s, TIMER, lambda t, req=req, replica=replica: self.release(replica, req, t))
        elif replica is not None and not replica.busy and (replica.waiting or replica.running):
            engine._request_schedule(replica, now)  # blocks were freed: waiting requests may fit now

    @staticmethod
    def _in_flight(replica: "Replica", req: Request) -> bool:
        """Is ``req`` part of the iteration ``replica`` is running now?"""
        step = replica.inflight
        if not replica.busy or step is None:
            return False
        return in_batch(step.batch, req)

    # -- leaving the engine -------------------------------------------------------------------
    def release(self, replica: "Replica", req: Request, now: float, finished: bool = False) -> None:
        """An aborted request that was inside an iteration leaves at its end (``finished``: that
        iteration gave it its last token; ``Engine._finish`` calls this instead of finishing it and the
        engine tells the policy, as for any request done in a step). Nothing more if it already left (its
        replica went down meanwhile: ``Platform.evict``)."""
        here = req in replica.running
        if here:
            self._leave_running(replica, req, now, tell_policy=not finished)
        if req.first_token_s is not None and req.first_token_s > self.aborted_at[req.index]:
            req.first_token_s = None  # produced after its client left: no TTFT was seen
        if not here:
            return
        if not finished and not replica.busy and (replica.waiting or replica.running):
            self.engine._request_schedule(replica, now)

    def _leave_running(self, replica: "Replica", req: Request, now: float, tell_policy: bool = True) -> None:
        """``req`` is running on ``replica`` outside the iteration under way: it leaves the running set
        and its blocks are freed (the path of a finishing request, ``Engine._finish``)."""
        self.engine.let_go(replica, req)
        if tell_policy:
            replica.policy.on_finish(req, replica)

    def _leave_waiting(self, replica: "Replica", req: Request) -> None:
        """``req`` waits on ``replica`` (queued, or held while its tier is paused): it is taken off,
        as a platform drop does (``Platform.drop``), holding no GPU block."""
        platform = self.engine.platform
        held = platform.paused.get(replica.id) if platform is not None else None
        if held is not None and req in held:
            held.remove(req)
            platform.pause_start.pop(req.index, None)
            replica.forgive(req)
            return
        if platform is not None:
            platform.take_off(replica, req)
            return
        self.engine.take_off(replica, req)
        replica.forgive(req)
        if req.swapped:
            replica.kv.drop_host(req)
        replica.kv.forget(req)

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


def check_supported(config, reclaims: bool, disaggregated: bool) -> None:
    """Timeouts combine with replica failures and prefill/decode pools (the module's docstring says
    how); with reclaimed instances (replay/fleet.py) they are not checked yet, so refused."""
    if reclaims:
        raise ServelabError("client timeouts (timeout_s, client_timeout_s) cannot be combined with instance "
                            "reclaims yet")


__all__ = ["Aborts", "check_supported", "client_timeouts"]
