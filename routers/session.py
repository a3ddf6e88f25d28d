"""Sticky sessions: a session's requests stay on the replica its first request joined."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.routers.base import ROUTERS, RouterBase, least_outstanding


@dataclass(frozen=True, slots=True)
class SessionParams:
    # The home replica is overloaded when its outstanding tokens exceed balance x the least loaded
    # replica's + slack_tokens (the bound prefix-affinity uses); 0 turns the fallback off.
    balance: float = 1.5
    slack_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.balance < 0 or self.slack_tokens < 0:
            raise ServelabError("router 'session': balance and slack_tokens must be >= 0")


@ROUTERS.register("session")
class SessionRouter(RouterBase):
    """Sticky sessions: a session's requests join the replica its first request joined while that
    replica is live and not overloaded (outstanding tokens at most ``balance`` times the least loaded
    replica's plus ``slack_tokens``); otherwise, and for requests without a session, the fewest
    outstanding tokens, which becomes the session's home from then on."""

    Params = SessionParams

    def __init__(self, params=None, seed: int = 0):
        super().__init__(params, seed)
        self.home: dict = {}

    def route(self, req, replicas):
        session = req.session_id
        least = least_outstanding(replicas)
        if session is not None:
            home = self.home.get(session)
            if home is not None and home in replicas and not self._overloaded(home, least):
                return home
            self.home[session] = least
        return least

    def _overloaded(self, home, least) -> bool:
        balance = self.params.balance
        return balance > 0 and home.outstanding_tokens > least.outstanding_tokens * balance + self.params.slack_tokens
