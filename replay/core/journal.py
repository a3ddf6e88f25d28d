"""What an interrupted request keeps (the journal) and the per-request counters the requests table
reports beside a request's own (the ledger): core engine state, since preemption by recompute and a
lost replica follow the same rule (docs/platform.md "Failures and the journal").

With the journal (the default) a request that loses its KV keeps its generated tokens and resumes by
recomputing prompt + generated tokens; without it the generated tokens are lost and produced again
from scratch, and its first token is the one of the new attempt.
"""

from __future__ import annotations

from servelab.replay.core.request import Request


class Ledger:
    """Per-request platform counters the requests table reports (kept off `Request`, sparse)."""

    __slots__ = ("retries", "paused_s", "resumes", "tokens_lost", "refused_s", "recomputed")

    def __init__(self) -> None:
        self.retries: dict[int, int] = {}  # request index -> client retries after throttling
        self.paused_s: dict[int, float] = {}  # time held while its tier was paused
        self.resumes: dict[int, int] = {}  # times resumed from the journal after an interruption
        self.tokens_lost: dict[int, int] = {}  # generated tokens thrown away (restarts without journal)
        self.refused_s: dict[int, float] = {}  # when it was throttled for good or dropped
        self.recomputed: dict[int, int] = {}  # KV tokens recomputed after losing KV (journal resumes)

    @staticmethod
    def add(table: dict, index: int, amount) -> None:
        table[index] = table.get(index, 0) + amount


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


__all__ = ["Journal", "Ledger"]
