"""`vtc` and `drr`: per-tenant fair sharing of a replica, work-conserving, with tenant weights.

Service is counted in weighted tokens: ``w_in`` per prompt token computed for the first time and
``w_out`` per output token (recomputation after a preemption is the scheduler's cost, not the
tenant's). A tenant alone gets the whole replica; when others become active they take their share
back at the next iteration boundary (admission order, or with ``preempt = true`` the whole batch).

- ``vtc`` (Virtual Token Counter, Sheng et al., OSDI 2024): each tenant has a counter of service
  received divided by its weight; the tenant with the smallest counter is served next. A tenant
  whose queue goes from empty to non-empty has its counter lifted to the smallest counter among the
  other active tenants (the last departed tenant's counter if none is active), so idle time banks
  no credit.
- ``drr`` (deficit round robin, Shreedhar & Varghese 1995): active tenants take turns in a ring; a
  turn adds ``quantum * weight`` tokens of credit and lasts while credit remains. Credit is spent
  only on service given under contention (requests waiting), and debt survives going idle.

``tiers = "priority,standard,flex"`` puts strict tier priority above fairness (each tier shares
fairly among its tenants; counters are per tenant); ``within`` orders one tenant's requests.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import (
    ClassQueues, NamedFloats, Names, Slot, check_named_floats, check_names, check_within, predicted_output,
    ranks_of, step_tokens, tier_ranker, within_key,
)
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request, Status


@dataclass(frozen=True, slots=True)
class FairParams:
    weights: NamedFloats = ()  # "a=2,b=1" or a table: share of each tenant (unlisted tenants weigh 1)
    w_in: float = 1.0  # service per prompt token
    w_out: float = 2.0  # service per output token (VTC's default: output costs twice an input token)
    preempt: bool = False  # re-decide the whole batch each iteration (preempting over-served tenants)
    preempt_margin: float = 4096.0  # service lead (tokens) a tenant needs over a running one to preempt it
    tiers: Names = ()  # strict tier priority above fairness ("priority,flex" or an array); empty: one class
    within: str = "fcfs"  # order of one tenant's requests: fcfs | sjf | srpt
    noise_sigma: float = 0.0
    quantum: float = 1.0  # drr only: credit per turn, tokens of service (times the tenant weight)

    def __post_init__(self) -> None:
        owner = "policy (fair)"
        check_named_floats(self.weights, owner, "weights")
        check_names(self.tiers, owner, "tiers")
        check_within(self.within, owner)
        if self.w_in < 0 or self.w_out < 0 or self.w_in + self.w_out == 0:
            raise ServelabError(f"{owner}: w_in and w_out must be >= 0 and not both 0")
        if self.quantum <= 0 or self.noise_sigma < 0 or self.preempt_margin < 0:
            raise ServelabError(f"{owner}: quantum must be > 0, noise_sigma and preempt_margin >= 0")


class _FairShare(PolicyBase):
    """Shared bookkeeping: per-(tier, tenant) waiting queues, live counts, service charging."""

    Params = FairParams

    def __init__(self, params: FairParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.weights = dict(params.weights)  # (typed and checked once, in the Params)
        self.rank_of = tier_ranker(ranks_of(params.tiers)) if params.tiers else (lambda t: 0)
        self.key = within_key(params.within)
        self.queues = ClassQueues()
        self.members: dict[tuple[int, str], int] = {}  # class -> its requests on this replica
        self.tenant_members: dict[str, int] = {}
        self.epoch = 0
        self.contended = False  # the last batch was chosen while requests waited

    # -- membership ---------------------------------------------------------------------------
    def on_arrival(self, req: Request, replica: Replica) -> None:
        self.epoch += 1
        rank = self.rank_of(req.tier)
        cls = (rank, req.tenant)
        slot = Slot(cls, rank, predicted_output(req, self.engine.seed, self.params.noise_sigma), self.epoch)
        # service already given elsewhere (a request re-routed after a fault) is not charged again here
        slot.charged_in = min(req.prompt_tokens, req.num_computed_tokens)
        slot.charged_out = req.num_generated_tokens
        req.policy_data = slot
        self.queues.push(req, cls, self.key(req, slot.predicted))
        n = self.members.get(cls, 0)
        self.members[cls] = n + 1
        if n == 0:
            self._class_active(cls)
        t = self.tenant_members.get(req.tenant, 0)
        self.tenant_members[req.tenant] = t + 1
        if t == 0:
            self._tenant_active(req.tenant)

    def _gone(self, req: Request) -> None:
        cls = req.policy_data.cls
        n = self.members[cls] - 1
        self.members[cls] = n
        if n == 0:
            self._class_idle(cls)
        t = self.tenant_members[req.tenant] - 1
        self.tenant_members[req.tenant] = t
        if t == 0:
            self._tenant_idle(req.tenant)
        req.policy_data = None

    def on_leave(self, req: Request, replica: Replica) -> None:
        """The engine took ``req`` off this replica without the policy deciding it (drop, fault)."""
        if isinstance(req.policy_data, Slot):
            self.queues.remove(req)
            self._gone(req)

    def on_requeue(self, req: Request, replica: Replica) -> None:
        slot = req.policy_data
        self.queues.push(req, slot.cls, self.key(req, slot.predicted))

    def _class_active(self, cls) -> None:
        pass

    def _class_idle(self, cls) -> None:
        pass

    def _tenant_active(self, tenant: str) -> None:
        pass

    def _tenant_idle(self, tenant: str) -> None:
        pass

    # -- service --------------------------------------------------------------------------------
    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    charges_per_class = True

    @property
    def reads_running(self) -> ReadsRunning | None:
        """Without preemption running requests are walked only by the builder, decodes first, and
        service is charged per class: the builder may keep decodes in bulk, counted per class."""
        return None if self.params.preempt else ReadsRunning(self._class_of, self._settled, self._may_bulk)

    def _class_of(self, req: Request):
        return req.policy_data.cls

    def _settled(self, req: Request) -> None:
        """Its tokens while decoding in bulk were charged to its class through ``batch.bulk_by_class``."""
        req.policy_data.charged_out = req.num_generated_tokens

    def _may_bulk(self, req: Request) -> bool:
        """Not while it makes again output tokens already charged. ``charged_out`` is a high-water
        mark: a request that started over (recompute without the journal) is charged only for tokens
        past it (``on_step``), which the per-class count of bulk decodes (every one, every iteration)
        cannot tell apart; it may decode in bulk once past the mark."""
        return req.num_generated_tokens >= req.policy_data.charged_out

    def on_finish(self, req: Request, replica: Replica) -> None:
        self._gone(req)

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        # Called every iteration for every item of the batch (hundreds once a queue builds up), so
        # the loop stays flat: counters in locals, one call per item that received service.
        w_in, w_out = self.params.w_in, self.params.w_out
        contended = self.contended
        charge = self._charge
        if batch.bulk_by_class:  # requests decoding in bulk: one output token per iteration each
            for cls, members in batch.bulk_by_class.items():
                charge(cls, cls[1], w_out * members * num_iterations, contended)
        for req, _ in batch.items:
            slot = req.policy_data
            prompt_done = req.num_computed_tokens
            if prompt_done > req.prompt_tokens:
                prompt_done = req.prompt_tokens
            d_in = prompt_done - slot.charged_in
            d_out = req.num_generated_tokens - slot.charged_out
            if d_in > 0 or d_out > 0:
                if d_in > 0:
                    slot.charged_in = prompt_done
                else:
                    d_in = 0
                if d_out > 0:
                    slot.charged_out = req.num_generated_tokens
                else:
                    d_out = 0
                charge(slot.cls, req.tenant, w_in * d_in + w_out * d_out, contended)

    def _charge(self, cls, tenant: str, service: float, contended: bool) -> None:
        raise NotImplementedError

    def _cost(self, req: Request, n: int) -> float:
        """Weighted service ``req`` receives if it computes ``n`` tokens next iteration."""
        slot = req.policy_data
        done = req.num_computed_tokens + n
        d_in = max(0, min(req.prompt_tokens, done) - slot.charged_in)
        emits = done >= req.num_tokens
        return self.params.w_in * d_in + (self.params.w_out if emits else 0.0)

    def victim_key(self, req: Request) -> tuple:
        slot = req.policy_data
        if not isinstance(slot, Slot):
            return (0, 0.0, req.admitted_seq)
        return (slot.rank, self._standing(slot.cls), req.admitted_seq)

    def _standing(self, cls) -> float:
        """How served a class is (larger: preempted first)."""
        raise NotImplementedError

    # -- the decision ---------------------------------------------------------------------------
    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        self._before_schedule(b)
        waiting = bool(replica.waiting)
        if waiting and replica.holding:  # async scheduling: only requests this decision knows of contend
            waiting = any(True for _ in b.seen(replica.waiting))
        self.contended = waiting
        budget = b.token_budget
        repeat = None
        if not waiting:
            b.schedule_running(replica.running, decodes_first=True)
        elif self.params.preempt:
            running_by_cls: dict = {}
            for req in replica.running:  # admission order
                running_by_cls.setdefault(req.policy_data.cls, []).append(req)
            picks = self._pick(running_by_cls, replica.config.max_num_seqs, budget, b.seen)
            b.keep_only(picks)
            for req in picks:
                if req.status is Status.RUNNING:
                    b.schedule_running((req,))
                elif b.seq_budget > 0 and b.token_budget > 0:
                    b.admit_waiting((req,), chunked=True)
            repeat = 1  # service changes the order every iteration
        else:
            b.schedule_running(replica.running, decodes_first=True)
            blocked = None
            if not b.preempted and b.seq_budget > 0 and b.token_budget > 0:
                blocked = self._admit(b)
            repeat = self._repeat(b, blocked)
        for req in b.summary.admit:
            self.queues.remove(req)
        return b.build(repeat=repeat)

    def _before_schedule(self, b) -> None:
        pass

    def _admit(self, b) -> Request | None:
        """Admit waiting requests in fairness order while the builder has room; returns the request
        that did not fit, if that is what stopped it."""
        queues = self.queues
        iters = {cls: b.seen(queues.in_order(cls)) for cls in queues.classes()}  # (not those not known yet)
        heads = {cls: next(it, None) for cls, it in iters.items()}
        for req in self._order(heads, iters, b.seq_budget, b.token_budget):
            if b.seq_budget <= 0 or b.token_budget <= 0:
                return None
            if not b.admit(req) and not b.skip_blocked:
                return req
        return None

    def _repeat(self, b, blocked: Request | None) -> int | None:
        """How many identical iterations may run before this policy must decide again (None: until
        the next event), with requests waiting and no preemption. A stretch charges its service at
        once, at its end, but every iteration of it moves the counters the order follows: each policy
        bounds it by when that order can change what is admitted (vtc, drr)."""
        raise NotImplementedError

    def _pick(self, running_by_cls: dict, slots: int, budget: int, seen=None) -> list[Request]:
        """Whole-batch choice: up to ``slots`` requests, each class's running ones before its waiting
        (those ``seen`` keeps: the builder's ``seen``, async scheduling's requests not known yet left out).

        Running requests of classes within ``preempt_margin`` of their share keep their slots
        (pinned): preempting for a small lead would thrash, each switch costing a recompute or a swap.
        """
        queues = self.queues
        pin = self._pinned(running_by_cls) if self.params.preempt_margin > 0 else set()
        # a request still (re)computing its prompt keeps its slot until its next token: progress
        # is guaranteed even with margin 0 (no preempt-recompute livelock)
        pinned = [req for cls, reqs in running_by_cls.items() for req in reqs if cls in pin or not req.is_decoding]
        slots -= len(pinned)
        iters: dict = {}
        for cls in set(queues.classes()) | set(running_by_cls):
            running = () if cls in pin else [r for r in running_by_cls.get(cls, ()) if r.is_decoding]
            waiting = queues.in_order(cls)
            iters[cls] = _chain(running, waiting if seen is None else seen(waiting))
        heads = {cls: next(it, None) for cls, it in iters.items()}
        return pinned + list(self._order(heads, iters, slots, budget))

    def _pinned(self, running_by_cls: dict) -> set:
        """Classes whose running requests keep their slots this iteration."""
        raise NotImplementedError

    def _order(self, heads: dict, iters: dict, slots: int, budget: int):
        raise NotImplementedError




def _chain(first, second):
    yield from first
    yield from second


@POLICIES.register("vtc")
class VirtualTokenCounter(_FairShare):

    def __init__(self, params: FairParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.counter: dict[str, float] = {}
        self.last_left = 0.0  # counter of the tenant that went idle last (lift when nobody is active)
        self.to_lift: list[str] = []

    def _tenant_active(self, tenant: str) -> None:
        self.counter.setdefault(tenant, 0.0)
        self.to_lift.append(tenant)  # lifted at the next decision, when counters are up to date

    def _tenant_idle(self, tenant: str) -> None:
        self.last_left = self.counter[tenant]

    def _before_schedule(self, b) -> None:
        if not self.to_lift:
            return
        lifting = set(self.to_lift)
        self.to_lift.clear()
        if b.replica.holding:  # async scheduling: a tenant this decision knows no request of yet is lifted when it does
            known = {req.tenant for req in b.seen(b.replica.waiting)}
            self.to_lift = [t for t in lifting if t not in known]
            lifting -= set(self.to_lift)
        others = [self.counter[t] for t, n in self.tenant_members.items()
                  if n > 0 and t not in lifting and t not in self.to_lift]
        floor = min(others) if others else self.last_left
        for tenant in sorted(lifting):
            if self.tenant_members.get(tenant, 0) > 0 and self.counter[tenant] < floor:
                self.counter[tenant] = floor

    def _charge(self, cls, tenant: str, service: float, contended: bool) -> None:
        self.counter[tenant] += service / self.weights.get(tenant, 1.0)

    def _repeat(self, b, blocked: Request | None) -> int | None:
        """Each iteration raises the counters of the tenants decoding in it (``w_out`` per token, over
        the tenant's weight), which reorders the heads of the waiting queues. The head that did not fit
        (``blocked``, first in order) is refused again, and the decision is this one, only until the
        head of a tenant whose counter rises slower overtakes it: that one may fit. Returns the
        iterations until the first such overtaking (None: none overtakes, or no head was refused).

        With ``head_of_line = "skip"`` every head the walk tried was refused; it tries as many as the
        batch has free slots, so when more wait, another order tries others: one iteration at a time."""
        if b.summary.prefill_reqs or b.preempted:
            return None  # not a decode stretch
        if b.skip_blocked:
            if b.seq_budget <= 0 or b.token_budget <= 0:
                return None
            replica = b.replica
            waiting = sum(1 for _ in b.seen(replica.waiting)) if replica.holding else len(replica.waiting)
            return 1 if waiting > b.seq_budget else None
        if blocked is None:
            return None
        rates = self._rates(b)
        if rates is None:
            return 1
        x = blocked.policy_data.cls
        cx, rx = self.counter[x[1]], rates.get(x[1], 0.0)
        first = (blocked.arrival_s, blocked.index)
        soonest = None
        queues = self.queues
        for cls in queues.classes():
            if cls[0] != x[0] or cls == x:  # (a tier above has no head seen, or it would be first)
                continue
            ry = rates.get(cls[1], 0.0)
            if ry >= rx:
                continue  # it never catches up
            head = next(iter(b.seen(queues.in_order(cls))), None)
            if head is None:
                continue
            ties = (head.arrival_s, head.index) < first  # at equal counters it goes first
            j = _catches_up(self.counter[cls[1]], ry, cx, rx, ties)
            if soonest is None or j < soonest:
                soonest = j
        return soonest

    def _rates(self, b) -> dict[str, float] | None:
        """How much each tenant's counter rises per iteration of ``b``'s batch (pure decode), or None
        when a request in it makes again tokens already charged (its tenant's counter rises only
        once past them: ``_may_bulk``)."""
        per: dict[str, int] = {}
        for req, _ in b.items:
            if req.num_generated_tokens < req.policy_data.charged_out:
                return None
            per[req.tenant] = per.get(req.tenant, 0) + 1
        if b.bulk_by_class:
            for cls, members in b.bulk_by_class.items():
                per[cls[1]] = per.get(cls[1], 0) + members
        w_out = self.params.w_out
        return {tenant: w_out * n / self.weight(tenant) for tenant, n in per.items()}

    def _standing(self, cls) -> float:
        return self.counter.get(cls[1], 0.0)

    def _pinned(self, running_by_cls: dict) -> set:
        """Running requests stay unless a waiting tenant of their tier is behind them by the margin."""
        lowest: dict[int, float] = {}
        for rank, tenant in self.queues.classes():
            c = self.counter[tenant]
            if c < lowest.get(rank, float("inf")):
                lowest[rank] = c
        margin = self.params.preempt_margin
        return {cls for cls in running_by_cls
                if self.counter[cls[1]] - lowest.get(cls[0], float("inf")) < margin}

    def _order(self, heads: dict, iters: dict, slots: int, budget: int):
        """Smallest (tier rank, counter + this batch's tentative service, head arrival) first."""
        extra: dict[str, float] = {}
        heap = []
        for cls, req in heads.items():
            if req is not None:
                heap.append((cls[0], self.counter[cls[1]], req.arrival_s, req.index, cls, req))
        heapq.heapify(heap)
        while heap and slots > 0:
            rank, _, _, _, cls, req = heapq.heappop(heap)
            yield req
            slots -= 1
            tenant = cls[1]
            extra[tenant] = extra.get(tenant, 0.0) + self._cost(req, step_tokens(req, budget)) / self.weight(tenant)
            nxt = next(iters[cls], None)
            if nxt is not None:
                heapq.heappush(heap, (rank, self.counter[tenant] + extra[tenant], nxt.arrival_s, nxt.index, cls, nxt))
            if self.params.tiers:  # the tenant's classes in other tiers carry its counter too
                heap = _rekey(heap, tenant, self.counter[tenant] + extra[tenant])


def _catches_up(cy: float, ry: float, cx: float, rx: float, ties: bool) -> int:
    """The first iteration j >= 1 after which a counter at ``cy`` rising ``ry`` per iteration is below
    one at ``cx`` (<= cy) rising ``rx`` (> ry), or equal to it when ``ties``."""

    def ahead(j: int) -> bool:
        y, z = cy + j * ry, cx + j * rx
        return y < z or (ties and y == z)

    j = max(1, math.ceil((cy - cx) / (rx - ry)))
    while j > 1 and ahead(j - 1):  # (the float division may be off by one either way)
        j -= 1
    while not ahead(j):
        j += 1
    return j


def _rekey(heap: list, tenant: str, value: float) -> list:
    """Refresh the counter of every heap entry of ``tenant`` (only tenants spread over several tiers)."""
    stale = [i for i, e in enumerate(heap) if e[4][1] == tenant and e[1] != value]
    if not stale:
        return heap
    heap = [(e[0], value, *e[2:]) if e[4][1] == tenant else e for e in heap]
    heapq.heapify(heap)
    return heap


@POLICIES.register("drr")
class DeficitRoundRobin(_FairShare):

    def __init__(self, params: FairParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.deficit: dict = {}
        self.rings: dict[int, deque] = {}  # tier rank -> active classes in turn order
        self.turn: dict[int, object] = {}  # tier rank -> class whose turn it is

    def _repeat(self, b, blocked: Request | None) -> int | None:
        """Turns pass with service, so a decision can change from one iteration to the next; but
        while the batch is pure decode and the head whose turn it is does not fit, the next decisions
        are this one again until that class has spent its credit on its running requests' tokens.
        ``blocked``: the head that did not fit (None: admission was not tried, so nothing changes
        until an event)."""
        if self.params.tiers or b.skip_blocked:
            return 1
        if blocked is None:
            return None if b.seq_budget <= 0 or b.token_budget <= 0 else 1
        cls = blocked.policy_data.cls
        members = sum(1 for req, _ in b.items if req.policy_data.cls == cls)
        if b.bulk_by_class:
            members += b.bulk_by_class.get(cls, 0)
        per_iteration = self.params.w_out * members
        if not per_iteration:
            return None  # its credit never runs out: the same head is tried at every decision
        return max(1, math.ceil(self.deficit[cls] / per_iteration))

    def _class_active(self, cls) -> None:
        self.deficit.setdefault(cls, 0.0)
        self.rings.setdefault(cls[0], deque()).append(cls)

    def _class_idle(self, cls) -> None:
        self.rings[cls[0]].remove(cls)
        if self.deficit[cls] > 0:
            self.deficit[cls] = 0.0  # unused credit is not banked; debt is kept

    def _charge(self, cls, tenant: str, service: float, contended: bool) -> None:
        if contended:
            self.deficit[cls] -= service

    def _standing(self, cls) -> float:
        return -self.deficit.get(cls, 0.0)

    def _pinned(self, running_by_cls: dict) -> set:
        """Running requests stay unless their class has overdrawn its credit by the margin."""
        margin = self.params.preempt_margin
        return {cls for cls in running_by_cls if self.deficit.get(cls, 0.0) > -margin}

    def _order(self, heads: dict, iters: dict, slots: int, budget: int):
        quantum = self.params.quantum
        used: dict = {}
        for rank in sorted({cls[0] for cls, req in heads.items() if req is not None}):
            ring = self.rings[rank]
            candidates = sum(1 for cls in ring if heads.get(cls) is not None)
            passes = 0  # turns passed since the last pick
            while slots > 0 and candidates:
                cls = ring[0]
                if self.turn.get(rank) != cls:  # a new turn begins: credit
                    self.turn[rank] = cls
                    self.deficit[cls] += quantum * self.weight(cls[1])
                req = heads.get(cls)
                if req is None or self.deficit[cls] - used.get(cls, 0.0) <= 0:
                    ring.rotate(-1)  # the turn ends; the next head's turn begins
                    self.turn[rank] = None
                    passes += 1
                    if passes >= 2 * len(ring):
                        self._skip_rounds(ring, heads, used)
                        passes = 0
                    continue
                passes = 0
                yield req
                slots -= 1
                used[cls] = used.get(cls, 0.0) + self._cost(req, step_tokens(req, budget))
                heads[cls] = nxt = next(iters[cls], None)
                if nxt is None:
                    candidates -= 1

    def _skip_rounds(self, ring: deque, heads: dict, used: dict) -> None:
        """Every class with a candidate is in debt: grant the rounds it would take at once."""
        quantum = self.params.quantum
        rounds = min(
            int((used.get(cls, 0.0) - self.deficit[cls]) // (quantum * self.weight(cls[1]))) + 1
            for cls in ring if heads.get(cls) is not None
        )
        if rounds > 1:
            for cls in ring:
                self.deficit[cls] += (rounds - 1) * quantum * self.weight(cls[1])


__all__ = ["FairParams", "VirtualTokenCounter", "DeficitRoundRobin"]
