"""A weighted score over queue depth, KV use and cached prefix; the lowest score wins."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.routers.base import ROUTERS, RouterBase


@dataclass(frozen=True, slots=True)
class WeightedParams:
    queue: float = 1.0  # weight of waiting requests / max_num_seqs
    kv: float = 1.0  # weight of KV blocks used / total
    prefix: float = 1.0  # weight of the share of the prompt its prefix cache holds (subtracted)

    def __post_init__(self) -> None:
        for name in ("queue", "kv", "prefix"):
            if getattr(self, name) < 0:
                raise ServelabError(f"router 'weighted': {name} must be >= 0, got {getattr(self, name)}")


@ROUTERS.register("weighted")
class WeightedRouter(RouterBase):
    """score = queue · waiting / max_num_seqs + kv · used / total − prefix · cached / prompt.

    Each term is a share (0..1 for an unsaturated queue), so the weights say how much one signal
    counts against another: with ``prefix = 1`` a replica holding the whole prompt beats one with
    a full KV cache and an empty queue. Ties go to the fewest outstanding tokens, then the lowest id.
    With ``prefix = 0`` the prefix cache is not asked (it costs a lookup per replica)."""

    Params = WeightedParams

    reads_kv = True

    def route(self, req, replicas):
        p = self.params

        def score(r):
            s = p.queue * len(r.waiting) / r.config.max_num_seqs + p.kv * r.kv.used / r.kv.total
            if p.prefix and req.prompt_tokens:
                s -= p.prefix * r.kv.cached_tokens(req) / req.prompt_tokens
            return (s, r.outstanding_tokens, r.id)

        return min(replicas, key=score)
