"""An encode pool: the third disaggregated role (encode -> prefill -> decode), as in EPD serving.

A request with images, video or audio (``Request.mm``) arriving at a cluster with an ``encode`` pool
is encoded there before it reaches the arrivals' pool: it goes to the encode replica that can start
it soonest (ties: the lowest id), which encodes one request at a time in arrival order (its encoder
stage and cache: replay/core/encoder.py), then its embeddings (``embedding_bytes_per_token`` x its
multimodal tokens) cross the encode -> prefill link (``latency_s`` + bytes / bandwidth; transfers do
not share the link), and it is routed as a text request whose encoder work is done: the prefill (or
mixed) replica does not encode it again. A text-only request goes straight to the arrivals' pool.

Per-request results (``columns``): the encode replica, the wait for it (arrival to start), the
encoder's seconds and the embeddings' transfer seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from servelab.replay.core.engine import TIMER
from servelab.replay.core.intents import Route

if TYPE_CHECKING:
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica
    from servelab.replay.core.request import Request

ENCODE = "encode"  # the engine's name for the pool
ENCODE_SCHEMA = pa.schema([("encode_replica", pa.int32()), ("encode_wait_s", pa.float64()),
                           ("encode_s", pa.float64()), ("embedding_transfer_s", pa.float64())])


class EncodePool:
    def __init__(self, engine: "Engine", replicas: list["Replica"], embedding_bytes_per_token: int,
                 bandwidth_gbps: float, latency_s: float):
        self.engine = engine
        self.replicas = replicas
        self.free_at = {r.id: 0.0 for r in replicas}  # when each encode replica finishes its queue
        self.bytes_per_token = embedding_bytes_per_token
        self.bytes_per_s = bandwidth_gbps * 1e9
        self.latency_s = latency_s
        self.rows: dict[int, tuple[int, float, float, float]] = {}  # request index -> its result columns
        self.busy_s = {r.id: 0.0 for r in replicas}
        engine.add_pool(ENCODE, replicas, lambda live, grew: None)  # (its replicas take no arrivals)
        engine.encode = self

    def arrive(self, req: "Request", now: float) -> None:
        """``req`` (with multimodal inputs) arrived: encode it, then route it when its embeddings land."""
        replica = min(self.replicas, key=lambda r: (max(self.free_at[r.id], now), r.id))
        start = max(self.free_at[replica.id], now)
        encode_s = replica.encoder.admit(req)
        mm = req.mm
        tokens = mm.image_tokens + mm.video_tokens + mm.audio_tokens
        transfer_s = self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s
        self.free_at[replica.id] = start + encode_s
        self.busy_s[replica.id] += encode_s
        self.rows[req.index] = (replica.id, start - now, encode_s, transfer_s)
        req.mm = None  # its embeddings travel with it: the prefill replica has nothing left to encode
        self.engine.push(start + encode_s + transfer_s, TIMER, lambda t: [Route((req,))])  # (the engine routes it then)

    def columns(self, n: int) -> dict[str, list]:
        cols: dict[str, list] = {f.name: [None] * n for f in ENCODE_SCHEMA}
        for index, row in self.rows.items():
            for f, value in zip(ENCODE_SCHEMA, row):
                cols[f.name][index] = value
        return cols

    def meta(self) -> dict:
        waits = [row[1] for row in self.rows.values()]
        return {"requests": len(self.rows), "busy_s": {str(k): v for k, v in self.busy_s.items()},
                "mean_wait_s": sum(waits) / len(waits) if waits else 0.0}


__all__ = ["ENCODE", "ENCODE_SCHEMA", "EncodePool"]
