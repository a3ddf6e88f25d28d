"""Replica failures and the journal: what an interrupted request keeps, and the failure schedule.

A failure takes a replica down at ``at_s`` (for ``for_s`` seconds, or for good): the iteration in
flight is lost, every request on it loses its KV (GPU and host swap alike) and is routed again to a
live replica. With the journal (the default) a request keeps its generated tokens and resumes by
recomputing prompt + generated tokens; without it the generated tokens are lost and produced again
from scratch, and its first token is the one of the new attempt. The same rule applies to requests
preempted by recomputation, so ``journal = false`` also models engines that restart preempted work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.common.fields import parse_fields
from servelab.replay.admission import Ledger
from servelab.replay.request import Request


@dataclass(frozen=True, slots=True)
class Failure:
    replica: int
    at_s: float
    for_s: float | None = None  # None: down for good

    @classmethod
    def parse(cls, spec: str) -> "Failure":
        """``replica=R,at=T[,for=D]``."""
        where = f"fail '{spec}'"
        values = parse_fields(spec, ("replica", "at", "for"), where)
        if "replica" not in values or "at" not in values:
            raise ServelabError(f"{where}: needs replica= and at=, e.g. replica=0,at=30,for=10")
        try:
            replica = int(values["replica"])
            at_s = float(values["at"])
            for_s = float(values["for"]) if "for" in values else None
        except ValueError:
            raise ServelabError(f"{where}: replica must be an integer and at/for numbers of seconds") from None
        if replica < 0 or not math.isfinite(at_s) or at_s < 0:
            raise ServelabError(f"{where}: replica must be >= 0 and at >= 0")
        if for_s is not None and not (math.isfinite(for_s) and for_s > 0):
            raise ServelabError(f"{where}: for must be > 0 seconds")
        return cls(replica, at_s, for_s)


def check_failures(failures: tuple[Failure, ...], replicas: int | None) -> None:
    """Failures name existing replicas and do not overlap on one replica (``replicas`` None: the
    count is not known yet, as in a cluster config, whose pools number their replicas on)."""
    by_replica: dict[int, list[Failure]] = {}
    for f in failures:
        if replicas is not None and f.replica >= replicas:
            raise ServelabError(f"fail replica={f.replica}: there are only {replicas} replica(s) (ids 0..{replicas - 1})")
        by_replica.setdefault(f.replica, []).append(f)
    for rid, items in by_replica.items():
        items.sort(key=lambda f: f.at_s)
        for a, b in zip(items, items[1:]):
            if a.for_s is None or a.at_s + a.for_s > b.at_s:
                raise ServelabError(f"fail replica={rid}: the failure at {b.at_s:g} s starts while it is still down")


class Journal:
    """Applies the journal rule to requests that lost their KV, and counts what was lost."""

    __slots__ = ("enabled", "ledger", "tokens_lost", "tokens_recomputed", "requests_interrupted")

    def __init__(self, enabled: bool, ledger: Ledger):
        self.enabled = enabled
        self.ledger = ledger
        self.tokens_lost = 0  # generated tokens thrown away (must be generated again)
        self.tokens_recomputed = 0  # KV tokens that must be computed again
        self.requests_interrupted = 0

    def interrupt(self, req: Request) -> None:
        """``req`` lost its KV: keep its generated tokens (journal) or start it over."""
        if req.num_computed_tokens == 0 and req.num_generated_tokens == 0:
            return  # nothing was done yet: nothing to lose
        self.requests_interrupted += 1
        if self.enabled:
            self.tokens_recomputed += req.num_computed_tokens
            Ledger.add(self.ledger.recomputed, req.index, req.num_computed_tokens)
            if req.num_generated_tokens:
                Ledger.add(self.ledger.resumes, req.index, 1)
            req.num_computed_tokens = 0
            return
        lost = req.num_generated_tokens
        prompt_done = min(req.num_computed_tokens, req.prompt_tokens)
        self.tokens_lost += lost
        self.tokens_recomputed += prompt_done
        Ledger.add(self.ledger.tokens_lost, req.index, lost)
        Ledger.add(self.ledger.recomputed, req.index, prompt_done)
        req.num_computed_tokens = 0
        req.num_generated_tokens = 0
        req.first_token_s = None
        req.last_token_s = None


__all__ = ["Failure", "Journal", "check_failures"]
