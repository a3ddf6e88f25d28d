"""`tiers`: service tiers sharing one replica (Priority > Standard > Flex), strict priority with guards.

The waiting queue is served in tier order (``tiers = "priority,standard,flex"``, first = highest;
tiers not listed rank last), and inside a tier by ``within`` (fcfs, sjf or srpt with the srpt
predictor). Optional pieces, each a parameter:

- ``preempt``: a waiting request preempts running requests of strictly lower tiers (victim: the
  lowest tier, most recently admitted) when it lacks a slot or KV.
- ``best_effort`` tiers (default ``flex``) yield: they are not admitted while a request of another
  tier waits unadmitted, and their running requests are preempted for one even without ``preempt``.
- ``max_wait_s``: the starvation bound of best-effort tiers. A best-effort request that has waited
  that long since arrival is promoted just above the tier ``promote_above`` (default: the lowest
  tier that is not best-effort, so Priority stays first) and stops yielding; the policy asks to be
  woken (``Batch.wake_s``) at the next promotion time so the bound is exact.
- ``reserve = "flex=0.1"``: a minimum share of ``max_num_seqs`` and of the token budget for the
  tier: its waiting requests are admitted up to that share before any other tier's (work-conserving:
  a share the tier does not use is free for the others).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import (
    DEFAULT_TIERS, ClassQueues, NamedFloats, Names, Slot, check_named_floats, check_names, check_within,
    predicted_output, ranks_of, tier_ranker, within_key,
)
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request



@dataclass(frozen=True, slots=True)
class TiersParams:
    # the tiers, highest first ("priority,standard,flex" or an array; typed once: common/coerce.py Names)
    tiers: Names = tuple(DEFAULT_TIERS.split(","))
    within: str = "fcfs"  # order inside a tier: fcfs | sjf | srpt
    noise_sigma: float = 0.0  # length predictor noise for sjf/srpt (as in `srpt`)
    preempt: bool = False  # higher tiers preempt running lower tiers
    best_effort: Names = ("flex",)  # tiers that yield to the others
    max_wait_s: float = 0.0  # starvation bound of best-effort tiers (0: none)
    promote_above: str = ""  # tier a promoted best-effort request overtakes ("": the lowest other tier)
    reserve: NamedFloats = ()  # "tier=share,..." or a table: share of slots and tokens kept for a tier

    def __post_init__(self) -> None:
        owner = "policy 'tiers'"
        ranks = check_names(self.tiers, owner, "tiers")
        check_names(self.best_effort, owner, "best_effort")
        if self.promote_above and self.promote_above not in ranks:
            raise ServelabError(f"{owner}: promote_above '{self.promote_above}' is not one of the tiers "
                                f"'{','.join(self.tiers)}'")
        check_within(self.within, owner)
        if self.noise_sigma < 0 or self.max_wait_s < 0:
            raise ServelabError(f"{owner}: noise_sigma and max_wait_s must be >= 0")
        shares = check_named_floats(self.reserve, owner, "reserve", positive=False, upper=1.0)
        if sum(shares.values()) > 1.0:
            raise ServelabError(f"{owner}: reserve {shares} reserves more than the whole batch")


@POLICIES.register("tiers")
class Tiers(PolicyBase):
    Params = TiersParams
    # running requests are read through schedule_running(replica.running) (one tier running) or
    # b.running() (several: sorted by tier); victims are chosen by tier and admission order only

    def __init__(self, params: TiersParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        ranks = ranks_of(params.tiers)  # (typed and checked once, in the Params)
        self.rank_of = tier_ranker(ranks)
        self.best_effort = set(params.best_effort)
        above = params.promote_above or max((t for t in ranks if t not in self.best_effort),
                                            key=ranks.get, default="")
        self.promoted_rank = ranks.get(above, len(ranks)) - 0.5  # between that tier and the one above
        self.key = within_key(params.within)
        self.queues = ClassQueues()
        self.promotions: list[tuple[float, int, Request, Slot]] = []  # (promote_at_s, seq, req, slot)
        self.epoch = 0
        self.ranks_seen: set = set()  # every rank a request here has had (one: no per-decision scan)
        self.reserve = {t: (int(s * engine.max_num_seqs), int(s * engine.max_num_batched_tokens))
                        for t, s in params.reserve if s > 0}

    @property
    def reads_running(self) -> ReadsRunning:
        """The reserved shares count the builder's bulk decodes per tier (``batch.bulk_by_class``)."""
        return ReadsRunning(by_class=_tier) if self.reserve else ReadsRunning()

    # -- bookkeeping ----------------------------------------------------------------------------
    def on_arrival(self, req: Request, replica: Replica) -> None:
        self.epoch += 1
        rank = self.rank_of(req.tier)
        slot = Slot(rank, rank, predicted_output(req, self.engine.seed, self.params.noise_sigma), self.epoch)
        req.policy_data = slot
        self.ranks_seen.add(rank)
        if self.params.max_wait_s > 0 and req.tier in self.best_effort:
            promote_at = req.arrival_s + self.params.max_wait_s
            if promote_at <= replica.now_s:
                slot.rank = self.promoted_rank
                self.ranks_seen.add(self.promoted_rank)
            else:
                heapq.heappush(self.promotions, (promote_at, self.epoch, req, slot))
        self._enqueue(req)

    def on_leave(self, req: Request, replica: Replica) -> None:
        """The engine took ``req`` off this replica without the policy deciding it (drop, fault)."""
        if isinstance(req.policy_data, Slot):
            self.queues.remove(req)

    def on_requeue(self, req: Request, replica: Replica) -> None:
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        slot: Slot = req.policy_data
        self.queues.push(req, slot.rank, self.key(req, slot.predicted))

    def _promote(self, now: float) -> float | None:
        """Promote best-effort requests past their bound; returns the next promotion time."""
        heap = self.promotions
        while heap:
            at, _, req, slot = heap[0]
            if req.policy_data is not slot or req.status.is_terminal or req.replica != self.replica_id:
                heapq.heappop(heap)  # stale: left this replica or ended
                continue
            if at > now:
                return at
            heapq.heappop(heap)
            slot.rank = self.promoted_rank
            self.ranks_seen.add(self.promoted_rank)
            if slot.entry is not None:
                self._enqueue(req)
        return None

    def victim_key(self, req: Request) -> tuple:
        slot = req.policy_data
        return (slot.rank if isinstance(slot, Slot) else 0, req.admitted_seq)

    # -- the decision ---------------------------------------------------------------------------
    def schedule(self, replica: Replica) -> Batch:
        wake_s = self._promote(replica.now_s) if self.promotions else None
        b = self.builder(replica)
        queues = self.queues
        running = replica.running
        # victim_key order = (rank, admitted_seq); running is in admission order, so a stable sort
        # by rank alone gives it, and with one rank running (the usual case) no sort at all
        if len(self.ranks_seen) <= 1:  # the usual case: one tier, no promotion
            ranks = list(self.ranks_seen) if running else []
        else:
            ranks = sorted({slot.rank if isinstance(slot := req.policy_data, Slot) else 0 for req in running})
        if queues.live and replica.waiting:
            self._preempt_for_waiting(replica, b, ranks)
        tier_preempted = len(b.preempted)
        if len(ranks) > 1:
            running = sorted(b.running(), key=_rank)
        b.schedule_running(running)
        if len(b.preempted) == tier_preempted and replica.waiting:
            self._admit(replica, b)
        for req in b.summary.admit:
            queues.remove(req)
        return b.build(wake_s=wake_s)

    def _order(self):
        """Waiting requests in service order: classes by rank, then within-order."""
        for cls in self.queues.classes():
            for req in self.queues.in_order(cls):
                yield req

    def _preempt_for_waiting(self, replica: Replica, b, ranks: list) -> None:
        """Preempt lower-tier running requests (lowest first) for the top waiting requests that lack room."""
        if replica.running:
            b.preempt_to_admit(self._order(), self._may_preempt, _victims(replica.running, ranks))

    def _may_preempt(self, req: Request, victim: Request) -> bool:
        """A waiting request of a higher tier takes a running one's place if preemption is on, or if
        the running one is best effort; best-effort requests never preempt (they wait)."""
        rank = req.policy_data.rank
        if req.tier in self.best_effort and rank != self.promoted_rank:
            return False
        vrank = victim.policy_data.rank
        yields = victim.tier in self.best_effort and vrank != self.promoted_rank
        return vrank > rank and (self.params.preempt or yields)

    def _admit(self, replica: Replica, b) -> None:
        reserved = bool(self.reserve)
        if reserved:
            self._admit_reserved(b)
        higher_blocked = False
        for cls in self.queues.classes():
            for req in b.seen(self.queues.in_order(cls)):  # (async scheduling: not one not known yet)
                if b.seq_budget <= 0 or b.token_budget <= 0:
                    return
                if reserved and b.has(req):  # admitted above, from its tier's reserved share
                    continue
                best_effort = req.tier in self.best_effort and req.policy_data.rank != self.promoted_rank
                if higher_blocked and best_effort:
                    return  # best effort yields to any other tier still waiting
                if not b.admit(req):
                    higher_blocked |= not best_effort
                    if not b.skip_blocked:
                        return

    def _admit_reserved(self, b) -> None:
        """First claim: each tier with a reserved share admits its waiting requests up to that share."""
        used_slots: dict[str, int] = {}
        used_tokens: dict[str, int] = {}
        for req, n in b.items:
            used_slots[req.tier] = used_slots.get(req.tier, 0) + 1
            used_tokens[req.tier] = used_tokens.get(req.tier, 0) + n
        for tier, members in (b.bulk_by_class or {}).items():  # requests decoding in bulk: a token each
            used_slots[tier] = used_slots.get(tier, 0) + members
            used_tokens[tier] = used_tokens.get(tier, 0) + members
        for tier, (slots, tokens) in self.reserve.items():
            free_slots = slots - used_slots.get(tier, 0)
            free_tokens = tokens - used_tokens.get(tier, 0)
            cls = self.rank_of(tier)
            if free_slots <= 0 or free_tokens <= 0 or not self.queues.live.get(cls):
                continue
            for req in b.seen(self.queues.in_order(cls)):
                if free_slots <= 0 or free_tokens <= 0 or b.seq_budget <= 0 or b.token_budget <= 0:
                    break
                if req.tier != tier:
                    continue
                n = b.admit(req, chunk_cap=free_tokens)
                if not n:
                    break
                free_slots -= 1
                free_tokens -= n


def _tier(req: Request) -> str:
    return req.tier


def _rank(req: Request):
    """The tier rank part of ``Tiers.victim_key``."""
    slot = req.policy_data
    return slot.rank if isinstance(slot, Slot) else 0


def _victims(running: list[Request], ranks: list):
    """``running`` by ``Tiers.victim_key``, largest first, lazily: a decision usually needs one or
    two victims, not a sort of every running request. ``running`` is in admission order, so within
    a rank (``ranks``: those present, ascending) the newest comes first."""
    for rank in reversed(ranks):
        for req in reversed(running):
            if _rank(req) == rank:
                yield req


__all__ = ["Tiers", "TiersParams"]
