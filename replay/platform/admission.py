"""The platform's front door: quotas (token buckets), concurrency caps, client retries, a queue cap, pausing.

Everything here runs before a request reaches a replica (pausing: before a replica schedules) and
is built only when configured, so a plain replay pays nothing for it. Quotas follow Bedrock's
on-demand model: a tenant's requests-per-minute and tokens-per-minute buckets are shared by all of
its tiers; a tier may have a pool of its own that all its tenants share. A request takes one
request and ``prompt + max_output`` tokens from every bucket that applies (all or none); when it
ends the output it did not generate is given back. Over quota it is throttled: the client retries
after a backoff (or exactly when the bucket will have refilled, ``retry_after``) until its retries
run out. Its latency keeps counting from the original arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from servelab.common.tiers import tier_ranker
from servelab.replay.core.journal import Ledger
from servelab.replay.core.request import Request
from servelab.replay.core.specs import PauseRule, Quota

class TokenBucket:
    """Holds up to one minute of its rate; starts full; refills continuously."""

    __slots__ = ("capacity", "rate_per_s", "level", "time_s")

    def __init__(self, per_minute: float):
        self.capacity = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = per_minute
        self.time_s = 0.0

    def refill(self, now: float) -> None:
        if now > self.time_s:
            self.level = min(self.capacity, self.level + (now - self.time_s) * self.rate_per_s)
            self.time_s = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0 now; inf if it never fits)."""
        if amount > self.capacity:
            return math.inf
        self.refill(now)
        short = amount - self.level
        return 0.0 if short <= 1e-9 else short / self.rate_per_s

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True, slots=True)
class Throttle:
    """Why a request was refused at the door and when its client may try again (None: never)."""

    reason: str
    retry_in_s: float | None  # the bucket's own refill time, for retry_after clients
    final: bool = False  # it can never pass (larger than the bucket): no retry helps


class Admission:
    """Quotas and concurrency caps at arrival, retry timing, the global queue cap."""

    def __init__(self, quotas: tuple[Quota, ...], *, retries: int = 0, retry_backoff_s: float = 1.0,
                 retry_max_backoff_s: float = 60.0, retry_jitter: float = 0.0, retry_after: bool = False,
                 queue_cap: int | None = None, tier_ranks: Mapping[str, int] | None = None, seed: int = 0):
        self.tenant_quota = {q.name: q for q in quotas if q.scope == "tenant"}
        self.tier_quota = {q.name: q for q in quotas if q.scope == "tier"}
        self.buckets: dict[tuple[str, str], TokenBucket] = {}
        self.inflight: dict[str, int] = {}
        self.holding: set[int] = set()  # request indexes counted in `inflight`
        self.passed: set[int] = set()  # request indexes that took from the buckets and have not ended
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_max_backoff_s = retry_max_backoff_s
        self.retry_jitter = retry_jitter
        self.retry_after = retry_after
        self.queue_cap = queue_cap
        self.rank = tier_ranker(tier_ranks or {})  # tiers not listed rank lowest
        self.seed = seed
        self.num_throttles = 0

    # -- quotas ---------------------------------------------------------------------------------
    def _quotas(self, req: Request) -> list[tuple[str, Quota]]:
        out = []
        q = self.tenant_quota.get(req.tenant) or self.tenant_quota.get("*")
        if q is not None:
            out.append((f"tenant:{req.tenant}", q))
        q = self.tier_quota.get(req.tier) or self.tier_quota.get("*")
        if q is not None:
            out.append((f"tier:{req.tier}", q))
        return out

    def _bucket(self, owner: str, kind: str, per_minute: float, now: float) -> TokenBucket:
        key = (owner, kind)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = TokenBucket(per_minute)
            bucket.time_s = now
        return bucket

    @staticmethod
    def tokens(req: Request) -> int:
        return req.prompt_tokens + req.max_output_tokens

    def check(self, req: Request, now: float) -> Throttle | None:
        """Take ``req``'s share of every bucket and a concurrency slot, or say why not (taking nothing)."""
        quotas = self._quotas(req)
        if not quotas:
            return None
        tokens = self.tokens(req)
        takes: list[tuple[TokenBucket, float]] = []
        wait = 0.0
        reason = None
        for owner, q in quotas:
            if q.concurrency is not None and self.inflight.get(owner, 0) >= q.concurrency:
                reason = reason or f"{owner} has {q.concurrency} requests in flight (concurrency quota)"
                wait = math.nan  # no refill time to wait for: the client backs off
            for kind, per_minute, amount in (("rpm", q.rpm, 1), ("tpm", q.tpm, tokens)):
                if per_minute is None:
                    continue
                bucket = self._bucket(owner, kind, per_minute, now)
                need = bucket.wait_s(amount, now)
                if need > 0:
                    if math.isinf(need):
                        self.num_throttles += 1
                        return Throttle(f"{owner}: {amount} exceeds the whole {kind} quota of {per_minute:g}/min",
                                        None, final=True)
                    reason = reason or f"{owner} over its {kind} quota of {per_minute:g}/min"
                    if not math.isnan(wait):
                        wait = max(wait, need)
                takes.append((bucket, amount))
        if reason is not None:
            self.num_throttles += 1
            return Throttle(reason, None if math.isnan(wait) else wait)
        for bucket, amount in takes:
            bucket.take(amount)
        self.passed.add(req.index)
        for owner, q in quotas:
            if q.concurrency is not None:
                self.inflight[owner] = self.inflight.get(owner, 0) + 1
                self.holding.add(req.index)
        return None

    def on_end(self, req: Request, now: float) -> None:
        """``req`` left the system: free its concurrency slot, give back output it never generated."""
        if req.index not in self.passed:
            return  # refused at the door: it took nothing
        self.passed.discard(req.index)
        quotas = self._quotas(req)
        unused = req.max_output_tokens - req.num_generated_tokens
        for owner, q in quotas:
            if q.concurrency is not None and req.index in self.holding:
                self.inflight[owner] -= 1
            if q.tpm is not None and unused > 0:
                self._bucket(owner, "tpm", q.tpm, now).give_back(unused, now)
        self.holding.discard(req.index)

    def retry_at(self, req: Request, attempt: int, throttle: Throttle, now: float) -> float | None:
        """When the client sends attempt ``attempt + 1`` (None: it has given up)."""
        if attempt >= self.retries or throttle.final:
            return None
        if self.retry_after and throttle.retry_in_s is not None:
            return now + throttle.retry_in_s
        backoff = min(self.retry_max_backoff_s, self.retry_backoff_s * 2.0 ** attempt)
        if self.retry_jitter > 0:
            import numpy as np  # here: replay.config imports this module, and a config needs no numpy

            rng = np.random.default_rng([self.seed, req.request_id & 0xFFFFFFFF, attempt, 0xBAC0])
            backoff *= 1.0 - self.retry_jitter * rng.random()
        return now + backoff

    # -- queue cap ------------------------------------------------------------------------------
    def shed_victim(self, req: Request, replicas) -> Request | None:
        """With the waiting queues full, the request to drop: the lowest tier, most recent arrival.

        Returns ``req`` itself when nothing waiting ranks below it; None when there is room.
        """
        if self.queue_cap is None:
            return None
        if sum(len(r.waiting) for r in replicas) < self.queue_cap:
            return None
        worst, worst_key = req, (self.rank(req.tier), req.arrival_s, req.index)
        for replica in replicas:
            for other in replica.waiting:
                key = (self.rank(other.tier), other.arrival_s, other.index)
                if key > worst_key:
                    worst, worst_key = other, key
        return worst


__all__ = ["Admission", "Ledger", "PauseRule", "Quota", "Throttle", "TokenBucket"]
