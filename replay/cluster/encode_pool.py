"""An encode pool: the third disaggregated role (encode -> prefill -> decode), as in EPD serving.

A request with images, video or audio (``Request.mm``) arriving at a cluster with an ``encode`` pool
is encoded there before it reaches the arrivals' pool: it goes to the encode replica that can start
it soonest (ties: the lowest id), which encodes one request at a time in arrival order (its encoder
stage and cache: replay/core/encoder.py), then its embeddings (``embedding_bytes_per_token`` x its
multimodal tokens) cross the encode -> prefill link (``latency_s`` + bytes / bandwidth; transfers do
not share the link), and it is routed as a text request whose encoder work is done: the prefill (or
mixed) replica does not encode it again. A text-only request goes straight to the arrivals' pool.

A replica's queue is first in, first out, so each request is priced when it queues, against the cache
as the requests ahead of it will leave it: the same cache hits and seconds as pricing it when its
encoding starts, and its start, end and landing are known then (one timed event: the landing).

A client that gives up while its request is in this stage (replay/platform/abort.py asks ``abandon``)
has it leave here; it is never routed. Where it was decides what else changes:

- queued (its encoding not started): it leaves its replica's queue and leaves no trace there: the
  encoder's cache and counters go back to what they were before it was priced, and the requests queued
  behind it are priced again and start earlier (by its encoder seconds, unless one of them now misses
  an image it would have cached, or arrived after the replica would have been free);
- being encoded: an encode is not dropped half-way (as an engine iteration is not), so the replica
  finishes it (its seconds count in the replica's busy time, what it cached stays) and sends nothing;
- its embeddings crossing the link: the transfer is cancelled (transfers do not share the link, so
  no other one changes). Embeddings landing at the very instant of the deadline count as cancelled
  when the deadline is handled first (a trace request's deadline is scheduled before its landing).

A queued request stays on the replica it queued on: requests queued elsewhere are not moved to one
that frees up earlier.

Per-request results (``columns``): the encode replica, the wait for it (arrival to start), the
encoder's seconds and the embeddings' transfer seconds; each is null for what never happened to an
abandoned request (a request abandoned in the queue keeps only its replica; one abandoned while being
encoded or in transfer keeps its encode columns, its transfer is null).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from servelab.replay.core.engine import TIMER
from servelab.replay.core.intents import Route

if TYPE_CHECKING:
    from servelab.replay.core.encoder import MultiModal
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica
    from servelab.replay.core.request import Request

ENCODE = "encode"  # the engine's name for the pool
ENCODE_SCHEMA = pa.schema([("encode_replica", pa.int32()), ("encode_wait_s", pa.float64()),
                           ("encode_s", pa.float64()), ("embedding_transfer_s", pa.float64())])
ABANDONED = ("queued", "encoding", "in_transfer")  # where a request was when its client gave up


class Job:
    """One request's way through the encode pool: queued on ``replica`` at ``arrival_s``, encoded over
    [``start_s``, ``start_s + encode_s``], its embeddings landing ``transfer_s`` later (``land_s``).
    ``before``: the replica encoder's ``state()`` before this request was priced (kept only when clients
    may give up: what taking it off the queue restores); ``gen`` tells its current landing event."""

    __slots__ = ("req", "mm", "replica", "arrival_s", "start_s", "encode_s", "transfer_s", "land_s", "before", "gen")

    def __init__(self, req: "Request", mm: "MultiModal", replica: "Replica", arrival_s: float, transfer_s: float):
        self.req, self.mm, self.replica, self.arrival_s, self.transfer_s = req, mm, replica, arrival_s, transfer_s
        self.start_s = self.encode_s = self.land_s = 0.0
        self.before = None
        self.gen = 0


class EncodePool:
    def __init__(self, engine: "Engine", replicas: list["Replica"], embedding_bytes_per_token: int,
                 bandwidth_gbps: float, latency_s: float):
        self.engine = engine
        self.replicas = replicas
        self.free_at = {r.id: 0.0 for r in replicas}  # when each encode replica finishes its queue
        self.bytes_per_token = embedding_bytes_per_token
        self.bytes_per_s = bandwidth_gbps * 1e9
        self.latency_s = latency_s
        self.rows: dict[int, tuple] = {}  # request index -> its result columns
        self.staged: dict[Request, Job] = {}  # requests in this stage (queued, encoding, in transfer) -> their job
        self.queued: dict[int, list[Job]] = {r.id: [] for r in replicas}  # per replica, its jobs maybe not started
        self.abandoned = dict.fromkeys(ABANDONED, 0)
        engine.add_pool(ENCODE, replicas, lambda live, grew: None)  # (its replicas take no arrivals)
        engine.encode = self

    def arrive(self, req: "Request", now: float) -> None:
        """``req`` (with multimodal inputs) arrived: encode it, then route it when its embeddings land."""
        replica = min(self.replicas, key=lambda r: (max(self.free_at[r.id], now), r.id))
        mm = req.mm
        tokens = mm.image_tokens + mm.video_tokens + mm.audio_tokens
        job = Job(req, mm, replica, now, self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s)
        queue = self.queued[replica.id]
        started = 0
        while started < len(queue) and queue[started].start_s <= now:
            started += 1
        del queue[:started]  # (an encoding that started can no longer leave the queue)
        encoder = replica.encoder
        if self.engine.aborts is not None:  # its client may give up while it is queued: keep what to restore
            job.before = encoder.state()
        self._schedule(job, max(self.free_at[replica.id], now), encoder.encode(mm))
        self.free_at[replica.id] = job.start_s + job.encode_s
        queue.append(job)
        self.staged[req] = job
        req.mm = None  # its embeddings travel with it: the prefill replica has nothing left to encode

    def _schedule(self, job: Job, start_s: float, encode_s: float) -> None:
        """``job`` starts encoding at ``start_s`` for ``encode_s``: its result row and its landing event."""
        job.start_s, job.encode_s = start_s, encode_s
        job.land_s = start_s + encode_s + job.transfer_s
        job.gen += 1
        self.rows[job.req.index] = (job.replica.id, start_s - job.arrival_s, encode_s, job.transfer_s)
        self.engine.push(job.land_s, TIMER, lambda t, job=job, gen=job.gen: self._land(job, gen))

    def _land(self, job: Job, gen: int) -> list:
        """``job``'s embeddings landed: it is routed (the engine routes it), unless it was abandoned or
        rescheduled (a later landing event is its own)."""
        req = job.req
        if job.gen != gen or self.staged.get(req) is not job or req.status.is_terminal:
            return []
        del self.staged[req]
        return [Route((req,))]

    # -- a client giving up -------------------------------------------------------------------
    def abandon(self, req: "Request", now: float) -> bool:
        """``req``'s client gave up at ``now`` (replay/platform/abort.py): if it is in this stage (queued,
        being encoded, or its embeddings in transfer), it leaves it, is never routed, and True is returned
        (the caller ends it). False: it is not here (routed already, or never came)."""
        job = self.staged.pop(req, None)
        if job is None:
            return False
        rid = job.replica.id
        if now < job.start_s:
            self._take_off_queue(job)
            self.rows[req.index] = (rid, None, None, None)
            where = "queued"
        else:  # the encoder finishes what it started; nothing is sent, or the transfer is cancelled
            self.rows[req.index] = (rid, job.start_s - job.arrival_s, job.encode_s, None)
            where = "encoding" if now < job.start_s + job.encode_s else "in_transfer"
        job.gen += 1  # (its landing event routes nothing)
        self.abandoned[where] += 1
        return True

    def _take_off_queue(self, job: Job) -> None:
        """``job``, not started, leaves its replica's queue: the encoder forgets it was priced, and the jobs
        behind it are priced again and rescheduled from the start ``job`` had (the end of the one ahead)."""
        replica = job.replica
        queue = self.queued[replica.id]
        i = queue.index(job)
        del queue[i]
        encoder = replica.encoder
        encoder.restore(job.before)
        free = job.start_s  # (its replica was busy until then with the requests ahead of it)
        for later in queue[i:]:
            later.before = encoder.state()
            self._schedule(later, max(free, later.arrival_s), encoder.encode(later.mm))
            free = later.start_s + later.encode_s
        self.free_at[replica.id] = free

    # -- results -------------------------------------------------------------------------------
    def columns(self, n: int) -> dict[str, list]:
        cols: dict[str, list] = {f.name: [None] * n for f in ENCODE_SCHEMA}
        for index, row in self.rows.items():
            for f, value in zip(ENCODE_SCHEMA, row):
                cols[f.name][index] = value
        return cols

    def meta(self) -> dict:
        """The requests encoded (an abandoned one whose encoding started counts: the encoder did the work),
        each replica's busy seconds, their mean wait; with client timeouts, where requests were abandoned."""
        busy = {r.id: 0.0 for r in self.replicas}
        waits = []
        for rid, wait, encode_s, _ in self.rows.values():
            if encode_s is not None:
                busy[rid] += encode_s
                waits.append(wait)
        out = {"requests": len(waits), "busy_s": {str(k): v for k, v in busy.items()},
               "mean_wait_s": sum(waits) / len(waits) if waits else 0.0}
        if self.engine.aborts is not None:
            out["abandoned"] = dict(self.abandoned)
        return out


__all__ = ["ABANDONED", "ENCODE", "ENCODE_SCHEMA", "EncodePool", "Job"]
