"""Routers: which live replica an arriving request joins (the Router protocol, replay/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.common.registry import Registry

if TYPE_CHECKING:
    from servelab.replay.replica import Replica
    from servelab.replay.request import Request

ROUTERS: Registry = Registry("router")


@ROUTERS.register("round-robin")
class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, replicas: list[Replica]) -> Replica:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica


@ROUTERS.register("least-outstanding")
class LeastOutstandingRouter:
    """Join the replica with the fewest prompt + output tokens still to produce (ties: lowest id)."""

    def route(self, req: Request, replicas: list[Replica]) -> Replica:
        return min(replicas, key=lambda r: r.outstanding_tokens)
