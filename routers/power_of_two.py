"""Power of two choices: two replicas drawn at random, the less loaded one joined."""

from __future__ import annotations

import random

from servelab.routers.base import ROUTERS, RouterBase


@ROUTERS.register("power-of-two")
class PowerOfTwoRouter(RouterBase):
    """Draw two distinct replicas (seeded by the replay's ``seed``: reruns are identical) and join
    the one with fewer outstanding tokens (ties: the lower id). Mitzenmacher's result: nearly the
    balance of ``least-outstanding`` while reading only two replicas' load. One replica: that one."""

    def __init__(self, params=None, seed: int = 0):
        super().__init__(params, seed)
        self.rng = random.Random(seed)

    def route(self, req, replicas):
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(range(len(replicas)), 2)
        return min(replicas[a], replicas[b], key=lambda r: (r.outstanding_tokens, r.id))
