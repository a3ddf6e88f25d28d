"""An iteration, or a stretch of identical decode iterations, in flight on a replica."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class Step:
    """An iteration (or a stretch of identical decode iterations) in flight on a replica."""

    batch: "Batch"  # (replay/core/batch.py; not imported: the batch builder sits above the step)
    start_s: float
    end_s: float
    k: int  # iterations in the stretch (1 for an ordinary step)
    prefill_tokens: int
    prefill_requests: int
    decode_requests: int
    waiting: int
    kv_used: int
    # decode-stretch pricing: iteration i takes a + b * (ctx0 + i * n) seconds
    a: float = 0.0
    b: float = 0.0
    ctx0: int = 0

    def elapsed(self, j: int) -> float:
        """Seconds taken by the first ``j`` iterations of the stretch."""
        if self.k == 1:
            return self.end_s - self.start_s if j else 0.0
        n = self.decode_requests
        return j * self.a + self.b * (j * self.ctx0 + n * j * (j - 1) / 2)

    def gap_bounds(self, j: int) -> tuple[float, float]:
        """For the first ``j`` iterations of a stretch: when the first ends, and how long the j-th
        takes (the longest, as iterations read ever more KV). A request in all of them has its
        longest inter-token gap either before the first end (since its previous token) or the j-th."""
        return (self.start_s + self.a + self.b * self.ctx0,
                self.a + self.b * (self.ctx0 + (j - 1) * self.decode_requests))

    def iterations_done_by(self, t: float) -> int:
        """Iterations completed at or before time ``t`` (0..k)."""
        if t >= self.end_s:
            return self.k
        j = self._first_boundary_at_or_after(t)
        return j if self.start_s + self.elapsed(j) <= t else j - 1

    def _first_boundary_at_or_after(self, t: float) -> int:
        """Smallest j >= 1 whose boundary start + elapsed(j) is >= t (at most k)."""
        delta = t - self.start_s
        if self.k == 1 or delta <= 0:
            return 1
        n, a, b = self.decode_requests, self.a, self.b
        qa, qb = b * n / 2, a + b * self.ctx0 - b * n / 2
        if qa > 0:
            j = math.ceil((-qb + math.sqrt(qb * qb + 4 * qa * delta)) / (2 * qa))
        else:
            j = math.ceil(delta / qb) if qb > 0 else 1
        j = min(max(j, 1), self.k)
        while j > 1 and self.elapsed(j - 1) >= delta:
            j -= 1
        while j < self.k and self.elapsed(j) < delta:
            j += 1
        return j
