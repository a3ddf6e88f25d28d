"""Request progress: the one place that moves a request's counters forward after iterations ran.

An iteration computes ``n`` tokens of a request (a prefill chunk, a recompute chunk or one decode
token); when its computed tokens catch up with its known tokens (prompt + generated) it emits the
next output token. Three shapes of applied work, one update (``emit``):

- ``apply_iteration``: one iteration of any batch (``emit`` inlined: its hottest loop);
- ``apply_stretch``: ``j`` identical pure-decode iterations (each item computed and emitted ``j``
  tokens; its KV grows to cover them, all items' growth in one ``KVManager.grow_all``; ``emit``
  inlined too);
- the decode cohort (replay/core/cohort.py) applies ``j`` iterations to all its members at once and
  writes each member's counters back through ``emit`` when it materialises.

These functions change only progress counters (and, in a stretch, the KV blocks that cover them,
through the KV manager); what happens to a request that finished is the engine's business, so they
return the finished requests in batch order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from servelab.replay.core.kv.manager import KVManager
    from servelab.replay.core.logs import TokenLog
    from servelab.replay.core.request import Request
    from servelab.replay.core.step import Step


def emit(req: "Request", count: int, end_s: float, gap: float | None) -> None:
    """``req`` emitted ``count`` more output tokens, the last at ``end_s``; ``gap`` is the longest
    time between two consecutive tokens among them (None for a first token: there is no gap)."""
    req.num_generated_tokens += count
    req.last_token_s = end_s
    if gap is not None and (req.max_itl_s is None or gap > req.max_itl_s):
        req.max_itl_s = gap


def apply_iteration(items: Sequence, end_s: float, tokens: "TokenLog | None", register=None) -> tuple[int, list]:
    """One iteration of ``items`` (``(request, n)`` pairs) ended at ``end_s``.

    Returns the tokens it produced (a first token also produces its prompt: what a request still
    owes, see ``Replica.outstanding_tokens``) and the requests it finished. ``register(req)``: the
    prefix cache learns the prompt blocks each request has now computed.
    """
    produced = 0
    finished = []
    for req, n in items:
        c = req.num_computed_tokens = req.num_computed_tokens + n
        if register is not None:
            register(req)
        if c != req.prompt_tokens + req.num_generated_tokens:
            continue  # a prefill chunk that did not reach the end of the prompt
        if tokens is not None:
            tokens.single(req.request_id, req.num_generated_tokens + 1, end_s)
        if req.last_token_s is None:  # the prompt is done: first token
            req.first_token_s = end_s
            produced += req.prompt_tokens + 1
        else:
            produced += 1
            gap = end_s - req.last_token_s
            if req.max_itl_s is None or gap > req.max_itl_s:
                req.max_itl_s = gap
        # emit(req, 1, end_s, gap), inlined: this loop visits every item of every iteration of the
        # policies that walk their requests one by one (hundreds per iteration under load)
        req.last_token_s = end_s
        g = req.num_generated_tokens = req.num_generated_tokens + 1
        if g >= req.output_tokens:
            finished.append(req)
    return produced, finished


def apply_stretch(items: Sequence, step: "Step", j: int, end_s: float, kv: "KVManager",
                  tokens: "TokenLog | None") -> list:
    """The first ``j`` iterations of a decode stretch ended, the last at ``end_s``: every item is
    past its first token and produced ``j`` tokens. Returns the requests it finished."""
    # A request's longest gap among them is the first (since its previous token) or the last.
    first_end, last_gap = step.gap_bounds(j)
    bs = kv.block_size
    if tokens is not None:
        for req, _ in items:
            tokens.stretch(req.request_id, req.num_generated_tokens + 1, j, step)
    finished = []
    grown = []  # (request, blocks it holds now) for those whose tokens reached new blocks
    for req, _ in items:
        c = req.num_computed_tokens = req.num_computed_tokens + j
        target = -(-c // bs)
        if target > req.kv_blocks:
            grown.append((req, target))
        gap = first_end - req.last_token_s
        if last_gap > gap:
            gap = last_gap
        # emit(req, j, end_s, gap), inlined as in apply_iteration: once per item of every stretch
        req.last_token_s = end_s
        if req.max_itl_s is None or gap > req.max_itl_s:
            req.max_itl_s = gap
        g = req.num_generated_tokens = req.num_generated_tokens + j
        if g >= req.output_tokens:
            finished.append(req)
    if grown:
        kv.grow_all(grown)
    return finished


__all__ = ["apply_iteration", "apply_stretch", "emit"]
