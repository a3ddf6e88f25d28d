"""Sticky sessions: a session's requests stay on the replica its first request joined."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase, least_outstanding


@ROUTERS.register("session")
class SessionRouter(RouterBase):
    """Sticky sessions: a session's requests join the replica its first request joined while that
    replica is live (else, and for requests without a session, the fewest outstanding tokens)."""

    def __init__(self, params=None, seed: int = 0):
        super().__init__(params, seed)
        self.home: dict = {}

    def route(self, req, replicas):
        session = req.session_id
        if session is not None:
            home = self.home.get(session)
            if home is not None and home in replicas:
                return home
        replica = least_outstanding(replicas)
        if session is not None:
            self.home[session] = replica
        return replica
