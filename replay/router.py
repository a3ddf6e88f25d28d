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


@ROUTERS.register("prefix-affinity")
class PrefixAffinityRouter:
    """Join the replica whose prefix cache holds the longest prefix of the request (asked through
    its KV manager), so multi-turn sessions and shared system prompts find their KV — among the
    replicas not much busier than the least busy one (outstanding tokens at most ``BALANCE`` times
    the least plus ``SLACK_TOKENS``), so that a popular prefix does not pile all its requests on one
    replica. Ties go to the replica holding more of it in GPU memory rather than in a lower tier
    (a shared store serves every replica alike), then, and a request nobody has cached, to the
    fewest outstanding tokens, then the lowest id. Without prefix caching it is ``least-outstanding``."""

    BALANCE = 1.5
    SLACK_TOKENS = 4096

    def route(self, req: Request, replicas: list[Replica]) -> Replica:
        bound = min(r.outstanding_tokens for r in replicas) * self.BALANCE + self.SLACK_TOKENS

        def rank(r: Replica):
            tokens, in_gpu = r.kv.affinity(req)
            return -tokens, -in_gpu, r.outstanding_tokens, r.id

        return min((r for r in replicas if r.outstanding_tokens <= bound), key=rank)


@ROUTERS.register("session")
class SessionRouter:
    """Sticky sessions: a session's requests join the replica its first request joined while that
    replica is live (else, and for requests without a session, the fewest outstanding tokens)."""

    def __init__(self) -> None:
        self.home: dict[int, Replica] = {}

    def route(self, req: Request, replicas: list[Replica]) -> Replica:
        session = req.session_id
        if session is not None:
            home = self.home.get(session)
            if home is not None and home in replicas:
                return home
        replica = min(replicas, key=lambda r: r.outstanding_tokens)
        if session is not None:
            self.home[session] = replica
        return replica
