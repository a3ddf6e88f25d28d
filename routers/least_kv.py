"""Least KV use: the replica with the smallest share of its KV blocks in use."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase


@ROUTERS.register("least-kv")
class LeastKVRouter(RouterBase):
    """Join the replica whose KV cache is least used (``used / total`` blocks: replicas of different
    sizes compare fairly); ties go to the fewest outstanding tokens, then the lowest id. KV use lags
    load (a queued request holds no blocks yet), so under bursts it balances worse than
    ``least-outstanding``; it is the signal that matters when memory, not compute, is short."""

    reads_kv = True

    def route(self, req, replicas):
        return min(replicas, key=lambda r: (r.kv.used / r.kv.total, r.outstanding_tokens, r.id))
