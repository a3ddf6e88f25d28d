"""Prefill/decode disaggregation: a request prefills on a prefill replica, which emits its first
token, then its KV moves over the link to a decode replica, where it decodes to the end
(DistServe, Splitwise; docs/cluster.md).

The engine calls ``after_step(replica, step, end_s)`` after every applied step (its first step listener):

- on a prefill replica, every request that has just emitted its first token (and is not finished)
  leaves the replica's running set and its policy (``on_leave``, as when a failure moves a running
  request away) but **keeps its KV there**, and asks for a decode replica (``_hand_off``);
- a decode replica has room for it when its free KV blocks cover the context plus the next token
  and its requests (running, waiting and landing) are fewer than ``max_num_seqs``; the decode pool's
  router chooses among those with room. The blocks are reserved there at once (a placeholder holds
  them) and the transfer starts: ``kv_bytes_per_token × context`` bytes over the link
  (replay/cluster/transfer.py);
- no decode replica has room: the request waits, first come first served, holding its prefill KV
  (back-pressure: the prefill replica's free KV shrinks); after every step of a decode replica the
  waiting handoffs are tried again;
- when the transfer lands, the prefill replica releases the KV, the request takes over its reserved
  blocks on the decode replica (``KVManager.adopt``) and joins its running set at once (as vLLM's
  decode instance takes a request whose KV it pulled): its next iteration there decodes, without a
  trip through the waiting queue, where a request holding KV could block admission behind a request
  waiting for blocks. The decode replica's policy is told ``on_arrival`` (its per-request state,
  e.g. a round-robin slot) then ``on_leave`` (out of its waiting order) and sees it from then on as
  one of its running requests.

The handoff changes no request's place itself: it returns intents (replay/core/intents.py: ``HandOff`` and
``Reject`` from ``after_step``, ``Wake`` and ``Land`` from the link's landings) that ``Engine.enact`` applies.

Autoscaled pools (replay/cluster/autoscale.py, ``scaled_by``): each pool's autoscaler tells the engine its active
replicas (a ``Serve`` intent), the engine owning who serves (``Engine.publish``; failures: ``Engine.fail``) and
tells the handoff the decode pool's (``_decode_serving``): arrivals go to the active prefill
replicas, handoffs to the active decode replicas with room (a decode replica that starts takes waiting handoffs at once); a draining decode
replica takes no new handoffs and stops when its running and landing requests are done; a draining
prefill replica takes no new arrivals and stops when the KV of the requests it handed off has landed
(``holding``, ``released``).

Layer-by-layer streaming (``stream_layers = L`` on the link): a request placed on a decode replica
at its first token has already sent, during its final prefill iteration of length ``d``, the KV of
its first ``L - 1`` layers as far as the link allowed: ``(L - 1) / L × min(B, share × d)`` of its
``B`` bytes, ``share`` being the link's bandwidth over the transfers in flight at the first token
plus the requests of that iteration (a pipeline: layer ``l`` moves while layer ``l + 1`` computes);
only the rest crosses the link after the first token. A request that waits for room streamed
nothing (no decode replica had blocks for it while it prefilled). The bytes streamed are not charged
to the link, so other transfers in flight during that iteration are not slowed (an approximation).

A request whose prompt + max output can never fit a decode replica is rejected at its handoff, with
the reason. Per-request results (``columns``): the decode replica, the handoff wait (first token to
transfer start) and the transfer time (start to landing).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from servelab.replay.core.batch import blocks_to_grow, no_aggregate
from servelab.replay.core.engine import DECODE, ENTRY, TIMER
from servelab.replay.core.intents import HandOff, Land, Reject, Serve, Wake
from servelab.replay.core.kv.manager import blocks_for
from servelab.replay.core.request import Request, Status
from servelab.replay.cluster.transfer import Link

if TYPE_CHECKING:
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.protocols import Router
    from servelab.replay.core.replica import Replica


class PoolWatcher(Protocol):
    """What the handoff tells the autoscaler of its prefill or decode pool (replay/cluster/autoscale.py
    implements it; the handoff does not import it: the autoscaler sits above the handoff)."""

    replicas: list[Replica]

    def released(self, replica: Replica, now: float) -> None:
        """KV ``replica`` held for a transfer is gone (landed, or lost at the other end)."""


class Disaggregation:
    def __init__(self, engine: Engine, prefill: list[Replica], decode: list[Replica], router: Router,
                 bytes_per_token: int, bandwidth_gbps: float, latency_s: float, stream_layers: int = 0,
                 context_bytes=None):
        self.engine = engine
        self.prefill = prefill
        self.decode = decode
        self.prefill_ids = {r.id for r in prefill}
        self.router = router
        self.bytes_per_token = bytes_per_token
        self.link = Link(bandwidth_gbps * 1e9, latency_s, lambda t, fn: engine.push(t, TIMER, fn), self._land)
        self.pending: deque[Request] = deque()  # handed off, waiting for a decode replica with room
        self.sending: dict[int, list[Request]] = {r.id: [] for r in prefill}  # KV held on a prefill replica
        self.landing: dict[int, dict[Request, Request]] = {r.id: {} for r in decode}  # req -> placeholder
        self.source: dict[Request, Replica] = {}
        # per request index: its results columns
        self.prefill_replica: dict[int, int] = {}
        self.decode_replica: dict[int, int] = {}
        self.handoff_s: dict[int, float] = {}
        self.transfer_start_s: dict[int, float] = {}
        self.transfer_end_s: dict[int, float] = {}
        self.max_pending = 0
        self._applied: Replica | None = None
        self.stream_layers = stream_layers
        self.bytes_streamed = 0.0
        self._overlap: dict[Request, float] = {}  # handed off at this instant: bytes the link could carry meanwhile
        self.decode_live = list(decode)  # the decode replicas taking handoffs (an autoscaler's active ones)
        # a hybrid model (replay/core/kv/kv_groups.py): bytes of a context of c tokens over its layer groups
        # (KVLayout.transfer_bytes), instead of bytes_per_token x c
        self.context_bytes = context_bytes
        self.prefill_scaler: PoolWatcher | None = None
        self.decode_scaler: PoolWatcher | None = None
        self.decode_ids = frozenset(r.id for r in decode)
        self._stopping: Replica | None = None  # a replica being taken down (``lose``): its last work hands off nothing
        self.cancelled = 0  # transfers whose KV was lost at either end
        self.kv_lost = 0  # requests whose KV held for, in or after a transfer was lost
        platform = engine.platform
        # replicas can be lost (failures, reclaimed instance types): the KV counters go to run.json
        self.can_lose = platform is not None and (platform.reclaims or bool(engine.config.fail))
        if platform is not None:
            platform.disagg = self
        for replica in prefill:
            no_aggregate(replica)  # nothing decodes there: every request leaves at its first token
        engine.step_listeners.append(self.after_step)  # (first: the pools' autoscalers come after it)
        engine.enact([Serve(ENTRY, tuple(prefill))], engine.now_s)  # arrivals are routed to the prefill pool only
        engine.add_pool(DECODE, decode, self._decode_serving)

    # -- the engine's hook ----------------------------------------------------------------------
    def after_step(self, replica: Replica, step, end_s: float) -> list | None:
        """Returns the intents of the requests handed off by a prefill replica's step (the engine enacts
        them before its next step listener): each leaves the replica (``HandOff``), or is rejected."""
        if replica is self._stopping:
            return None  # (its last iterations, applied as it goes down: nothing is handed off or placed)
        if replica.id in self.prefill_ids:
            running = Status.RUNNING
            # a request that has just emitted a token with nothing left to compute: its first token, or
            # the next one after recomputing prompt + generated tokens (it lost its KV: ``lose``)
            ready = [req for req, _ in step.batch.items
                     if req.status is running and req.num_generated_tokens and req.last_token_s == end_s
                     and req.num_computed_tokens + 1 == req.prompt_tokens + req.num_generated_tokens]
            if ready and self.stream_layers:  # what the link could carry during this, their final prefill iteration
                window = (end_s - step.start_s) * self.link.bytes_per_s / (len(self.link.active) + len(ready))
                self._overlap = dict.fromkeys(ready, window)
            out = []
            for req in ready:
                out += self._hand_off(replica, req, end_s)
            self._overlap.clear()
            return out
        if self.pending:
            self._applied = replica  # its step is applied: it promises no more blocks
            self._place_pending(end_s)
            self._applied = None
        return None

    # -- autoscaled pools -----------------------------------------------------------------------
    def scaled_by(self, scaler: PoolWatcher) -> None:
        """``scaler`` scales the prefill or the decode pool (whichever its replicas are)."""
        if scaler.replicas[0].id in self.prefill_ids:
            self.prefill_scaler = scaler
        else:
            self.decode_scaler = scaler

    def _decode_serving(self, live: list[Replica], grew: bool) -> None:
        """The decode replicas that take handoffs from now on (the engine's membership: the decode
        pool's autoscaler, failures)."""
        self.decode_live = live
        if grew:  # a decode replica started, came back or was taken back: handoffs may fit now
            self.place_pending(self.engine.now_s)

    def holding(self, replica: Replica) -> bool:
        """``replica`` holds KV of requests in transfer (from it, or to it)."""
        return bool(self.sending[replica.id] if replica.id in self.sending else self.landing[replica.id])

    def _hand_off(self, replica: Replica, req: Request, now: float) -> list:
        """``req`` leaves prefill replica ``replica`` (``HandOff``, enacted once its step's handoffs are all
        placed: placing reads only the decode pool) holding its KV there, and waits for a decode replica."""
        out: list = [HandOff(replica, req)]
        self.sending[replica.id].append(req)
        self.source[req] = replica
        self.handoff_s[req.index] = now
        self.prefill_replica[req.index] = replica.id
        if not any(d.kv.can_ever_fit(req) for d in self.decode):
            need = self.decode[0].kv.blocks_to_finish(req)
            out += self._release_source(req, now)
            out.append(Reject(req, f"needs {need} KV blocks for prompt + max output; a decode "
                                   f"replica has {max(d.kv.total for d in self.decode)}"))
            return out
        self.pending.append(req)
        self.max_pending = max(self.max_pending, len(self.pending))
        self._place_pending(now)
        return out

    # -- placing on a decode replica ------------------------------------------------------------
    def _room(self, req: Request) -> list[Replica]:
        out = []
        for d in self.decode_live:
            kv = d.kv
            need = self._landing_blocks(req, kv)
            seats = len(d.running) + len(d.waiting) + len(self.landing[d.id])
            if seats >= d.config.max_num_seqs or kv.free < need:
                continue
            step = d.inflight
            # a stretch in flight takes at most k / block_size + 2 blocks per request (the engine's own
            # bound when it plans one): count exactly only when that bound could matter
            if not d.busy or step is None or step.k == 1 \
                    or kv.free - step.decode_requests * (step.k // kv.block_size + 2) >= need \
                    or kv.free - self._promised(d) >= need:
                out.append(d)
        return out

    @staticmethod
    def _landing_blocks(req: Request, kv) -> int:
        """Blocks ``req`` holds on landing: its context and its next token (reservation: all of it; a
        hybrid layout: what its groups hold computing that token, a sliding group only its window)."""
        if kv.reserve:
            return kv.blocks_to_finish(req)
        if kv.layout is not None:
            return kv.layout.held(req.num_computed_tokens, 1)
        return blocks_for(req.num_computed_tokens + 1, kv.block_size)

    def _promised(self, replica: Replica) -> int:
        """Free blocks the decode stretch in flight on ``replica`` will still take when it completes
        (a stretch grows its requests' KV at its end; the engine planned it on those blocks being free)."""
        step = replica.inflight
        if not replica.busy or step is None or step.k == 1 or replica is self._applied:
            return 0
        if replica.kv.reserve:
            return 0
        return max(blocks_to_grow(replica, step.batch, step.k), 0)

    def _place_pending(self, now: float) -> None:
        """Start the transfers of waiting handoffs in their order while the head finds room."""
        pending = self.pending
        while pending:
            req = pending[0]
            room = self._room(req)
            if not room:
                return
            pending.popleft()
            target = self.router.route(req, room)
            kv = target.kv
            holder = Request(-1, now, 0, 0)  # holds the landing blocks until the KV is there
            kv.grow(holder, self._landing_blocks(req, kv))
            self.landing[target.id][req] = holder
            target.owe(req)  # its load from now: the decode router sees transfers under way
            self.decode_replica[req.index] = target.id
            self.transfer_start_s[req.index] = now
            if self.context_bytes is None:
                num_bytes = self.bytes_per_token * req.num_computed_tokens
            else:
                num_bytes = self.context_bytes(req.num_computed_tokens)
            if self._overlap and req in self._overlap:  # placed at its first token: its first L - 1 layers streamed
                layers = self.stream_layers
                streamed = (layers - 1) / layers * min(num_bytes, self._overlap[req])
                self.bytes_streamed += streamed
                num_bytes -= streamed
            self.link.start((req, target, holder), num_bytes, now)

    def _land(self, transfer, now: float) -> list:
        """The link's arrival of ``transfer``: returns the intents — the prefill replica's wake, if its
        freed KV lets it admit, and ``req`` landing on its decode replica (it joins the running set as if
        admitted now: it has its KV), which wakes it (a busy one stops its stretch at the next iteration
        boundary, an idle one decides after every other landing of this instant)."""
        req, target, holder = transfer.payload
        if self.landing[target.id].get(req) is not holder:
            return []  # cancelled during its latency: an end of it was lost (``lose``)
        del self.landing[target.id][req]
        out = self._release_source(req, now)
        target.kv.adopt(req, holder)
        self.transfer_end_s[req.index] = now
        out.append(Land(target, req))  # (which wakes ``target``)
        return out

    def _release_source(self, req: Request, now: float) -> list:
        """The prefill replica frees ``req``'s KV (its prompt blocks stay in its prefix cache); returns the
        intent to wake it when it is idle with requests waiting (for that room, perhaps)."""
        source = self.source.pop(req)
        self.sending[source.id].remove(req)
        source.kv.release(req)
        out = [Wake(source)] if not source.busy and source.waiting else []
        if self.prefill_scaler is not None:
            self.prefill_scaler.released(source, now)
        return out

    # -- a replica lost (failure, reclaimed instance) -------------------------------------------------
    def stop(self, replica: Replica) -> None:
        """``replica`` goes down (it already takes no arrivals or handoffs: the engine's membership):
        the iterations it finished before going down (applied now) hand off and place nothing;
        ``lose`` follows."""
        self._stopping = replica

    def lose(self, replica: Replica, now: float) -> list[Request]:
        """The KV ``replica`` held for transfers is gone: returns the requests that lose it, in order.

        - a prefill replica: the requests it handed off. One waiting for a decode replica leaves the
          queue; one in transfer has it cancelled (the link's other transfers share its bandwidth
          from now) and its landing blocks on the decode replica are freed;
        - a decode replica: the requests landing on it. Their transfers are cancelled and the prefill
          replica releases their KV.

        The caller (``Engine.evict``) applies the journal's rule to them with the replica's own
        requests and routes them all to the prefill pool again: they re-prefill and are handed off
        anew. Their handoff columns are cleared (they describe the last handoff)."""
        self._stopping = None
        lost: list[Request] = []
        if replica.id in self.sending:
            for req in self.sending[replica.id]:
                self.source.pop(req)
                replica.kv.release(req)
                self._withdraw(req, now)
                lost.append(req)
            self.sending[replica.id] = []
        else:
            landing, self.landing[replica.id] = self.landing[replica.id], {}
            for req, holder in landing.items():
                self._cancel(req, now)
                replica.kv.release(holder)
                self.engine.enact(self._release_source(req, now), now)
                lost.append(req)
        for req in lost:
            self._forget_handoff(req)
        self.kv_lost += len(lost)
        return lost

    def abandon(self, req: Request, now: float) -> bool:
        """``req``'s client gave up at ``now`` (replay/platform/abort.py): if it is handed off (waiting for a
        decode replica, or its KV crossing the link), it leaves the handoff queue or has its transfer
        cancelled, its landing blocks and its prefill replica's KV are freed, and True is returned (the
        caller ends it). False: it is not in a handoff (on a replica, or not yet prefilled)."""
        if req not in self.source:
            return False
        self._withdraw(req, now)
        self.engine.enact(self._release_source(req, now), now)
        self.place_pending(now)  # (the landing blocks freed may make room for the next handoff)
        return True

    def lost_running(self, replica: Replica, moved: list[Request]) -> None:
        """``moved``, the requests running or waiting on a lost decode replica, go back to the prefill
        pool: their handoff columns are cleared as for the ones that lost KV in transfer."""
        if replica.id in self.decode_ids:
            for req in moved:
                self._forget_handoff(req)

    def _withdraw(self, req: Request, now: float) -> None:
        """``req``, handed off, leaves the handoff: out of the queue of those waiting for a decode replica,
        or, in transfer, its transfer cancelled and its landing blocks on the decode replica freed."""
        target_id = self.decode_replica.get(req.index)
        holder = self.landing[target_id].pop(req, None) if target_id is not None else None
        if holder is None:
            self.pending.remove(req)
            return
        target = self.engine.replicas[target_id]
        self._cancel(req, now)
        target.kv.release(holder)
        target.forgive(req)
        if self.decode_scaler is not None:
            self.decode_scaler.released(target, now)

    def _cancel(self, req: Request, now: float) -> None:
        self.cancelled += 1
        self.link.cancel(lambda payload: payload[0] is req, now)

    def _forget_handoff(self, req: Request) -> None:
        i = req.index
        for column in (self.prefill_replica, self.decode_replica, self.handoff_s, self.transfer_start_s,
                       self.transfer_end_s):
            column.pop(i, None)

    def place_pending(self, now: float) -> None:
        """Decode replicas changed outside a step (one started or came back, a lost replica's landing
        blocks were freed): try the handoffs waiting."""
        if self.pending:
            self._place_pending(now)

    # -- end of the replay, results, checks -----------------------------------------------------
    def strand(self) -> None:
        """Requests still handed off when nothing is left to happen: counted, never lost."""
        self.engine.strand(self.pending, "waiting for a decode replica with room when the replay ended")

    def holders(self, replica: Replica) -> list[Request]:
        """Every request (or landing placeholder) holding GPU blocks on ``replica`` (the KV check); a replica
        of neither pool (an encode pool's) holds its running requests only."""
        held = list(replica.running)
        if replica.id in self.sending:
            held += self.sending[replica.id]
        elif replica.id in self.landing:
            held += list(self.landing[replica.id].values())
        return held

    def columns(self, n: int) -> dict[str, list]:
        return {
            "prefill_replica": [self.prefill_replica.get(i) for i in range(n)],
            "decode_replica": [self.decode_replica.get(i) for i in range(n)],
            "handoff_wait_s": [self.transfer_start_s[i] - self.handoff_s[i] if i in self.transfer_start_s else None
                               for i in range(n)],
            "transfer_s": [self.transfer_end_s[i] - self.transfer_start_s[i] if i in self.transfer_end_s else None
                           for i in range(n)],
        }

    def meta(self) -> dict:
        return {"transfers": len(self.transfer_start_s), "bytes_moved": self.link.bytes_moved,
                "link_busy_s": self.link.busy_s, "max_handoffs_waiting": self.max_pending,
                **({"bytes_streamed": self.bytes_streamed} if self.stream_layers else {}),
                **({"transfers_cancelled": self.cancelled, "requests_lost_kv": self.kv_lost} if self.can_lose else {})}


__all__ = ["Disaggregation"]
