"""Round-robin: replicas in turn, by arrival order."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase


@ROUTERS.register("round-robin")
class RoundRobinRouter(RouterBase):
    reads_progress = False  # (replicas in turn: nothing a stretch updates)

    def __init__(self, params=None, seed: int = 0):
        super().__init__(params, seed)
        self._next = 0

    def route(self, req, replicas):
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica
