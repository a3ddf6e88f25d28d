"""vLLM's own balancing over its DP ranks: the rank with the lowest 4 x waiting + running requests.

vLLM's API server (``DPLBAsyncMPClient.get_core_engine_for_request``) scores each data-parallel rank
``waiting * 4 + running`` from the counts the DP coordinator publishes (every 100 ms while they
change) and sends the request to the lowest (ties: the first rank); until the next snapshot it adds
each request it sent to its rank's waiting count. For a replica's DP ranks (``--dp``), the default of
``validate --real`` on a run with ``data_parallel_size`` > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.routers.base import ROUTERS, RouterBase


@dataclass(frozen=True, slots=True)
class Params:
    stats_interval_s: float = 0.1  # how often the DP coordinator publishes the ranks' counts

    def __post_init__(self) -> None:
        if not (self.stats_interval_s >= 0 and math.isfinite(self.stats_interval_s)):
            raise ServelabError(f"router 'vllm-dp': stats_interval_s must be a finite number >= 0, "
                                f"got {self.stats_interval_s!r}")


@ROUTERS.register("vllm-dp")
class VllmDpRouter(RouterBase):
    Params = Params
    reads_progress = False  # (waiting and running counts: no stretch changes them before its end)

    def __init__(self, params=None, seed: int = 0):
        super().__init__(params, seed)
        self._counts: dict[int, list[int]] = {}  # replica id -> [waiting, running] as published (+ own sends)
        self._next_s = -math.inf  # when the coordinator publishes next

    def route(self, req, replicas):
        now = req.arrival_s
        counts = self._counts
        if now >= self._next_s:  # a new snapshot of every rank's counts
            counts.clear()
            self._next_s = now + self.params.stats_interval_s
        best, best_score = replicas[0], math.inf
        for r in replicas:
            c = counts.get(r.id)
            if c is None:
                c = counts[r.id] = [len(r.waiting), len(r.running)]
            score = 4 * c[0] + c[1]
            if score < best_score:
                best, best_score = r, score
        counts[best.id][0] += 1
        return best
