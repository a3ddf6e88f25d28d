"""Least outstanding work: the fewest prompt + output tokens still to produce (ties: lowest id)."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase, least_outstanding


@ROUTERS.register("least-outstanding")
class LeastOutstandingRouter(RouterBase):
    def route(self, req, replicas):
        return least_outstanding(replicas)
