"""Speculative decoding in the replay: how many proposed tokens a step verifies and how many survive.

vLLM v1's semantics, which the replay follows: a decoding request that has ``k`` proposed (draft)
tokens is scheduled for ``1 + k`` tokens in one step (its last sampled token plus the drafts), so
the drafts count against ``max_num_batched_tokens`` and get KV slots like any scheduled token; when
the budget is short, the drafts are trimmed to what is left (vLLM's scheduler does the same, and
trims them to ``max_model_len``; it does not trim them to the request's ``max_tokens``). The
target model verifies all ``1 + k`` positions in that step; the first ``A`` drafts agree with it
and it emits them plus one token of its own, so the request advances by ``A + 1`` tokens (the KV
slots of the rejected drafts stay with the request and are written again by its next step).

``A`` is drawn per request and step: each draft is accepted with the request's acceptance rate
``a`` when all before it were, so ``P(A >= i) = a**i`` and the mean tokens per step is
``(1 - a**(k+1)) / (1 - a)``. The rate comes from the trace (column ``spec_acceptance``) or from the
engine's ``spec_acceptance`` (a number, or a distribution drawn once per request); every draw uses
the request's own generator, seeded by the replay seed and the request id, so a request's
acceptances do not depend on what it was batched with.

Pieces: `SpecBatchBuilder` (the policies' builder when speculation is on: it gives each decode its
drafts), `SpecDecode` (the engine's state: rates, per-request counters, applying verified steps).
A decode stretch and the decode cohort (replay/core/cohort.py) advance every decode by exactly one token
per iteration, so with speculation the engine prices and applies every step one by one.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Iterable, Sequence

from servelab.common.errors import ServelabError
from servelab.replay.core.batch import BatchBuilder, BatchSummary
from servelab.replay.core.progress import apply_iteration
from servelab.replay.core.protocols import StepShape
from servelab.replay.core.request import Request, Status
from servelab.replay.core.spec_config import METHODS, Acceptance, canonical_method, parse_speculative_config

if TYPE_CHECKING:
    from servelab.replay.core.logs import TokenLog


def accepted_length(u: float, rate: float, k: int) -> int:
    """Drafts accepted out of ``k`` for a uniform draw ``u`` in (0, 1]: each is accepted with
    probability ``rate`` once all before it were, so ``P(A >= i) = rate**i`` (inverse transform of the
    geometric distribution, cut at ``k``)."""
    if k <= 0 or rate <= 0.0:
        return 0
    if rate >= 1.0:
        return k
    a = int(math.log(u) / math.log(rate))
    return a if a < k else k


def expected_tokens_per_step(rate: float, k: int) -> float:
    """Mean tokens a decode emits per step with ``k`` drafts: ``sum(rate**i, i = 0..k)``."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


# -- the builder -----------------------------------------------------------------------------------------
class SpecSummary(BatchSummary):
    """A batch's counts plus its drafts: ``drafts`` maps each decode given drafts to their number,
    ``spec_tokens`` is their sum (the step's verified tokens beyond one per decode)."""

    __slots__ = ("drafts", "spec_tokens")

    def __init__(self) -> None:
        super().__init__()
        self.drafts: dict[Request, int] = {}
        self.spec_tokens = 0


def _is_decode(req: Request, n: int) -> bool:
    g = req.num_generated_tokens
    return n == 1 and g > 0 and req.num_computed_tokens == req.prompt_tokens + g - 1


class SpecBatchBuilder(BatchBuilder):
    """`BatchBuilder` when speculation is on: a decode takes ``1 + drafts`` tokens of the budget and KV
    slots for them; ``drafts`` is ``spec_k``, trimmed to the budget left and to ``max_model_len``
    (``_drafts``, as vLLM's scheduler). Prefill chunks are unchanged. When the drafts' KV does not fit
    and there is nobody left to preempt but the request itself, it decodes without drafts this step
    (rather than never: a request that fits the cache alone keeps fitting)."""

    __slots__ = ("spec_k", "context")

    def __init__(self, replica, victim_key, token_budget: int | None = None, seq_budget: int | None = None):
        super().__init__(replica, victim_key, token_budget, seq_budget)
        self.spec_k = replica.config.spec_k
        context = replica.config.max_model_len
        self.context = context if context is not None else 1 << 62
        self.summary = SpecSummary()

    def _drafts(self, req: Request) -> int:
        """``spec_k``, trimmed to the token budget left and so that ``1 + drafts`` new positions stay
        below ``max_model_len`` (vLLM: ``num_new_tokens <= max_model_len - 1 - num_computed_tokens``)."""
        d = self.spec_k
        left = self.token_budget - 1
        room = self.context - 2 - req.num_computed_tokens
        if left < d:
            d = left
        if room < d:
            d = room
        return d if d > 0 else 0

    def add(self, req: Request, n: int, need: int | None = None, hit=None, target: int = 0) -> None:
        if hit is not None or not _is_decode(req, n):
            super().add(req, n, need, hit, target)
            return
        d = self._drafts(req)
        with_drafts = self.kv.blocks_needed(req, 1 + d)
        if need is None or with_drafts <= self.free_blocks:
            need = with_drafts
        else:  # the caller made room for one token only (a swapped-in decode): no drafts this step
            d = 0
        self._add_decode(req, d, need)

    def add_running(self, req: Request, n: int) -> bool:
        if not _is_decode(req, n):
            return super().add_running(req, n)
        d = self._drafts(req)
        need = self.kv.blocks_needed(req, 1 + d)
        while need > self.free_blocks:  # vLLM preempts for the drafts' slots too
            victim = self.pick_victim()
            if victim is None or victim is req:
                one = self.kv.blocks_needed(req, 1)
                if d and one <= self.free_blocks:  # nobody else to preempt: this step without drafts
                    d, need = 0, one
                    break
                self.preempt(req)
                return False
            self.preempt(victim)
        self._add_decode(req, d, need)
        return True

    def _add_decode(self, req: Request, d: int, need: int) -> None:
        self.free_blocks -= need
        self.token_budget -= 1 + d
        self.seq_budget -= 1
        self.items.append((req, 1))
        summary = self.summary
        summary.account(req, 1, need)
        if d:
            summary.drafts[req] = d
            summary.spec_tokens += d

    def _walk(self, order: Iterable[Request], chunk_cap: int | None, prefills: list[Request] | None) -> None:
        # The common case inlined (a decode whose KV fits: what ``add_running(req, 1)`` does, without
        # its calls); preemption and prefill chunks take the general path. ``_walk_each`` is the same
        # walk through the general path only (the tests compare the two).
        chosen, items, summary = self.chosen, self.items, self.summary
        drafts, grow, admit = summary.drafts, summary.grow, summary.admit
        blocks_needed, k, context = self.kv.blocks_needed, self.spec_k, self.context
        waiting = Status.WAITING
        for req in order:
            if req in chosen:
                continue
            tokens = self.token_budget
            if tokens <= 0 or self.seq_budget <= 0:
                break
            c = req.num_computed_tokens
            g = req.num_generated_tokens
            n = req.prompt_tokens + g - c
            if n == 1 and g:
                d = k  # (_drafts, inlined)
                if tokens - 1 < d:
                    d = tokens - 1
                if context - 2 - c < d:
                    d = context - 2 - c
                if d < 0:
                    d = 0
                need = blocks_needed(req, 1 + d)  # (the KV manager's rule, whatever its layout)
                if need > self.free_blocks:
                    self.add_running(req, 1)
                    continue
                if need > 0:
                    self.free_blocks -= need
                    grow.append((req, req.kv_blocks + need))
                self.token_budget = tokens - 1 - d
                self.seq_budget -= 1
                items.append((req, 1))  # `chosen` picks it up lazily: `order` has no repeats
                summary.decode_reqs += 1
                summary.decode_ctx += c + 1
                if req.output_tokens - g < summary.min_decode_left:
                    summary.min_decode_left = req.output_tokens - g
                if req.status is waiting:
                    admit.append(req)
                if d:
                    drafts[req] = d
                    summary.spec_tokens += d
                continue
            if prefills is not None:
                prefills.append(req)
                continue
            if chunk_cap is not None and n > chunk_cap:
                n = chunk_cap
            if n > tokens:
                n = tokens
            self.add_running(req, n)

    def _walk_each(self, order: Iterable[Request], chunk_cap: int | None, prefills: list[Request] | None) -> None:
        """``_walk`` through ``add_running`` for every request (the reference the tests hold it to)."""
        for req in order:
            if req in self.chosen:
                continue
            if self.token_budget <= 0 or self.seq_budget <= 0:
                break
            n = req.prompt_tokens + req.num_generated_tokens - req.num_computed_tokens
            if _is_decode(req, n):
                self.add_running(req, 1)
                continue
            if prefills is not None:
                prefills.append(req)
                continue
            if chunk_cap is not None and n > chunk_cap:
                n = chunk_cap
            if n > self.token_budget:
                n = self.token_budget
            self.add_running(req, n)


# -- the engine's state -----------------------------------------------------------------------------------
class SpecDecode:
    """Acceptance rates and spec-decode counters per request (by ``Request.index``), and applying a
    verified step. Counters follow vLLM's spec-decode metrics: ``num_drafts`` (steps that verified
    drafts), ``num_draft_tokens``, ``num_accepted_tokens``."""

    def __init__(self, config, requests: Sequence[Request]):
        self.k = config.spec_k
        self.seed = config.seed
        self.acceptance = Acceptance(config.spec_acceptance)
        size = max((r.index for r in requests), default=-1) + 1
        self.rates: list[float | None] = [None] * size  # the trace's, where it has one
        self.rngs: list[random.Random | None] = [None] * size
        self.rate: list[float] = [0.0] * size
        self.num_drafts = [0] * size
        self.num_draft_tokens = [0] * size
        self.num_accepted_tokens = [0] * size

    def set_trace_rates(self, column: list) -> None:
        """The trace's ``spec_acceptance`` column (by row; None: the workload's distribution)."""
        for i, value in enumerate(column):
            if value is not None:
                if not 0.0 <= value <= 1.0:
                    raise ServelabError(f"trace column spec_acceptance, row {i + 1}: an acceptance rate must be "
                                        f"in [0, 1], got {value}")
                self.rates[i] = float(value)

    def _generator(self, req: Request) -> random.Random:
        rng = self.rngs[req.index]
        if rng is None:
            # a str seed is hashed with SHA-512: the same stream on every run and platform
            rng = self.rngs[req.index] = random.Random(f"servelab-spec:{self.seed}:{req.request_id}")
            rate = self.rates[req.index]
            self.rate[req.index] = self.acceptance.draw(rng) if rate is None else rate
        return rng

    def shape(self, shape: StepShape, summary) -> StepShape:
        """The step's shape with its verified drafts (``StepShape.spec_tokens``) for the runner."""
        spec = getattr(summary, "spec_tokens", 0)
        return shape._replace(spec_tokens=spec) if spec else shape

    def apply(self, items: Sequence, summary, end_s: float, tokens: "TokenLog | None", register=None
              ) -> tuple[int, list]:
        """One iteration of ``items`` ended at ``end_s`` (as ``progress.apply_iteration``), then each
        decode with drafts advances by the drafts it got accepted. Returns the tokens produced and
        the requests finished, in batch order."""
        produced, finished = apply_iteration(items, end_s, tokens, register)
        drafts = getattr(summary, "drafts", None)
        if not drafts:
            return produced, finished
        more = False
        for req, d in drafts.items():
            rng = self._generator(req)
            i = req.index
            accepted = accepted_length(1.0 - rng.random(), self.rate[i], d)
            self.num_drafts[i] += 1
            self.num_draft_tokens[i] += d
            self.num_accepted_tokens[i] += accepted
            g = req.num_generated_tokens
            extra = min(accepted, req.output_tokens - g)  # (the trace's length ends the request)
            if extra <= 0:
                continue
            if tokens is not None:
                for t in range(extra):
                    tokens.single(req.request_id, g + 1 + t, end_s)
            req.num_computed_tokens += extra
            req.num_generated_tokens = g + extra
            produced += extra
            if g + extra >= req.output_tokens:
                more = True
        if more:
            done = set(finished)
            finished = [req for req, _ in items if req in done or req.num_generated_tokens >= req.output_tokens
                        and req in drafts]
        return produced, finished

    def columns(self, n: int) -> dict[str, list]:
        """Per request (trace order): the rate used and vLLM's spec-decode counters, with the
        acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts);
        null for a request that never verified drafts."""
        drafts, tokens, accepted = self.num_drafts[:n], self.num_draft_tokens[:n], self.num_accepted_tokens[:n]
        return {
            "spec_acceptance": [self.rate[i] if self.rngs[i] is not None else self.rates[i] for i in range(n)],
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": tokens,
            "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": [accepted[i] / tokens[i] if tokens[i] else None for i in range(n)],
            "spec_mean_acceptance_length": [1 + accepted[i] / drafts[i] if drafts[i] else None for i in range(n)],
        }

    def meta(self) -> dict:
        drafts, tokens, accepted = sum(self.num_drafts), sum(self.num_draft_tokens), sum(self.num_accepted_tokens)
        return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / tokens if tokens else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


__all__ = ["METHODS", "Acceptance", "SpecBatchBuilder", "SpecDecode", "SpecSummary", "accepted_length",
           "canonical_method", "expected_tokens_per_step", "parse_speculative_config"]
