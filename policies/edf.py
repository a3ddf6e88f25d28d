"""`edf`: earliest deadline first against latency SLOs, optionally dropping hopeless requests.

Every request's next token has a deadline: its first token is due at ``arrival_s + TTFT SLO``;
once streaming, token ``g + 1`` is due at ``first_token_s + g * TPOT SLO`` (the pace that keeps its
TPOT within the SLO), so the least-slack decode goes first. SLOs come from the trace columns
``ttft_slo_s`` / ``tpot_slo_s``, else per-tier defaults (``tier_ttft = "priority=0.5,flex=30"``),
else the global ``ttft_slo_s`` / ``tpot_slo_s`` parameters; a request without any has no deadline
and is served after those with one, first come first served.

With ``drop = true`` a waiting request whose first-token deadline has passed can no longer meet
it and is dropped (status ``dropped``, the reason recorded), so it stops taking capacity from
requests that still can; the policy asks to be woken at the earliest waiting deadline so the drop
happens at that iteration boundary. With ``preempt = true`` a waiting request preempts running
requests with later deadlines when it lacks a slot or KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import takewhile

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import ClassQueues, NamedFloats, Slot, check_named_floats
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request


@dataclass(frozen=True, slots=True)
class EdfParams:
    ttft_slo_s: float = 0.0  # default TTFT SLO (0: none)
    tpot_slo_s: float = 0.0  # default TPOT SLO (0: none)
    tier_ttft: NamedFloats = ()  # "tier=seconds,..." or a table: per-tier TTFT SLOs
    tier_tpot: NamedFloats = ()
    drop: bool = False  # drop waiting requests that can no longer meet their TTFT deadline
    preempt: bool = False  # earlier deadlines preempt running requests with later ones

    def __post_init__(self) -> None:
        owner = "policy 'edf'"
        if self.ttft_slo_s < 0 or self.tpot_slo_s < 0:
            raise ServelabError(f"{owner}: ttft_slo_s and tpot_slo_s must be >= 0")
        check_named_floats(self.tier_ttft, owner, "tier_ttft")
        check_named_floats(self.tier_tpot, owner, "tier_tpot")


@POLICIES.register("edf")
class EarliestDeadlineFirst(PolicyBase):
    Params = EdfParams

    def __init__(self, params: EdfParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.tier_ttft = dict(params.tier_ttft)  # (typed and checked once, in the Params)
        self.tier_tpot = dict(params.tier_tpot)
        self.queues = ClassQueues()
        self.epoch = 0
        self.sheds = params.drop  # the engine asks `shed` before each decision
        # some request here has had an SLO (a global one applies to all): without, every deadline is inf
        self.timed = bool(params.ttft_slo_s or params.tpot_slo_s)

    @property
    def reads_running(self) -> ReadsRunning | None:
        """Untimed, running requests are walked in admission order and read only by the builder; once a
        request brings an SLO the policy sorts them by deadline and says so (``running(for_good=True)``)."""
        return None if self.timed else ReadsRunning()

    def _ttft(self, req: Request) -> float | None:
        if req.ttft_slo_s is not None:
            return req.ttft_slo_s
        return self.tier_ttft.get(req.tier) or self.params.ttft_slo_s or None

    def _tpot(self, req: Request) -> float | None:
        if req.tpot_slo_s is not None:
            return req.tpot_slo_s
        return self.tier_tpot.get(req.tier) or self.params.tpot_slo_s or None

    def deadline(self, req: Request) -> float:
        """When ``req``'s next token is due (inf: no SLO applies)."""
        if req.first_token_s is None:
            ttft = self._ttft(req)
            return req.arrival_s + ttft if ttft is not None else math.inf
        tpot = self._tpot(req)
        return req.first_token_s + tpot * req.num_generated_tokens if tpot is not None else math.inf

    def _key(self, req: Request) -> tuple:
        return (self.deadline(req), req.arrival_s, req.index)

    # -- bookkeeping ----------------------------------------------------------------------------
    def on_arrival(self, req: Request, replica: Replica) -> None:
        self.epoch += 1
        if not self.timed:
            self.timed = self._ttft(req) is not None or self._tpot(req) is not None
        req.policy_data = Slot(0, 0, float(req.output_tokens), self.epoch)
        self.queues.push(req, 0, self._key(req))

    def on_requeue(self, req: Request, replica: Replica) -> None:
        self.queues.push(req, 0, self._key(req))

    def on_leave(self, req: Request, replica: Replica) -> None:
        if isinstance(req.policy_data, Slot):
            self.queues.remove(req)

    def victim_key(self, req: Request) -> tuple:
        return (self.deadline(req), req.admitted_seq)

    def shed(self, replica: Replica) -> list[tuple[Request, str]]:
        """Waiting requests whose first-token deadline has passed: the engine drops them."""
        now = replica.now_s
        late = []
        for req in self.queues.in_order(0):
            due = req.policy_data.entry[0][0]
            if due > now:
                break
            if req.first_token_s is None:
                late.append((req, due))
        out = []
        for req, due in late:
            self.queues.remove(req)
            out.append((req, f"TTFT deadline {due:.6g} s passed at {now:.6g} s before it was scheduled"))
        return out

    # -- the decision ---------------------------------------------------------------------------
    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        queues = self.queues
        # Without any SLO every deadline is inf and victim_key order is admission order, which is
        # running's own: no deadline to compute, no sort, and no earlier deadline to preempt for.
        timed = self.timed
        running = b.running(for_good=True) if timed else replica.running
        if timed and self.params.preempt and replica.waiting and running:
            self._preempt_for_waiting(replica, b)
        forced = len(b.preempted)
        if timed and len(running) > 1:
            running = sorted(running, key=self.victim_key)
        b.schedule_running(running)
        if len(b.preempted) == forced and replica.waiting:
            b.admit_waiting(queues.in_order(0), chunked=True)
        for req in b.summary.admit:
            queues.remove(req)
        wake_s = None
        if self.sheds:
            wake_s = self._next_deadline(replica.now_s)
        repeat = 1 if self.params.preempt and replica.waiting else None
        return b.build(repeat=repeat, wake_s=wake_s)

    def _next_deadline(self, now: float) -> float | None:
        """The earliest first-token deadline still ahead among waiting requests."""
        for req in self.queues.in_order(0):
            due = req.policy_data.entry[0][0]
            if not math.isfinite(due):
                return None
            if req.first_token_s is None and due > now:
                return due
        return None

    def _preempt_for_waiting(self, replica: Replica, b) -> None:
        """Waiting requests with a deadline, earliest first, preempt running ones with later deadlines."""
        with_deadline = takewhile(lambda req: math.isfinite(req.policy_data.entry[0][0]), self.queues.in_order(0))
        b.preempt_to_admit(with_deadline, lambda req, victim: self.deadline(victim) > req.policy_data.entry[0][0])


__all__ = ["EarliestDeadlineFirst", "EdfParams"]
