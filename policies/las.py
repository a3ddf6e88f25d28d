"""`las`: least attained service per task (program-level scheduling, as in Autellix's PLAS).

An agent's task is many LLM calls (a session, ``session_id``); what decides a waiting call's turn is
not the call but the task it belongs to: the task that has received the least service so far goes
first, so short tasks finish before long ones without knowing any length in advance (the
"least attained service" rule of Kleinrock, applied per program). A request without a session is a
task of its own.

Service is counted in weighted tokens, as ``vtc`` counts it per tenant: ``w_in`` per prompt token
computed for the first time (tokens served from the prefix cache are not service, recomputation
after a preemption is the scheduler's cost) and ``w_out`` per output token. A task's counter lives
on the policy instance of the replica that served it (each replica decides alone); with task
affinity routing (router ``session``) that is the task's whole service. Counters are kept for the
whole replay: a task's next call, after a tool wait, is ranked by what the task received before.

Starvation is bounded: a request that has waited ``max_wait_s`` seconds since it joined the queue
(its arrival, or its preemption back into it) goes before every request that has not, oldest first
(Autellix promotes such calls to its highest queue). ``max_wait_s = 0`` turns the bound off.

Non-preemptive: running requests go as in ``sarathi`` (decodes first, then prefill chunks); the
waiting queue is admitted in (starved first, least attained task, arrival) order. KV pressure
preempts the running request of the most served task first (most recently admitted on a tie).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase
from servelab.policies.ordering import WaitingQueue
from servelab.replay.batch import Batch
from servelab.replay.replica import Replica
from servelab.replay.request import Request


@dataclass(frozen=True, slots=True)
class LasParams:
    w_in: float = 1.0  # service per prompt token computed (not served from cache)
    w_out: float = 1.0  # service per output token
    max_wait_s: float = 0.0  # starvation bound: a request waiting this long goes first; 0 = off

    def __post_init__(self) -> None:
        owner = "policy 'las'"
        if not (self.w_in >= 0 and self.w_out >= 0 and self.w_in + self.w_out > 0):
            raise ServelabError(f"{owner}: w_in and w_out must be >= 0 and not both 0 (got {self.w_in}, {self.w_out})")
        if not 0 <= self.max_wait_s < math.inf:
            raise ServelabError(f"{owner}: max_wait_s must be a finite number of seconds >= 0 (0: no bound), "
                                f"got {self.max_wait_s}")


def task_of(req: Request):
    """The task a request belongs to: its session, else itself."""
    return req.session_id if req.session_id is not None else ("request", req.request_id)


class _Charge:
    """Per-request state (``req.policy_data``): its task, the tokens already counted as service, and
    when it joined the waiting queue."""

    __slots__ = ("task", "charged_in", "charged_out", "queued_s")

    def __init__(self, task, charged_in: int, charged_out: int, queued_s: float):
        self.task = task
        self.charged_in = charged_in
        self.charged_out = charged_out
        self.queued_s = queued_s


@POLICIES.register("las")
class LeastAttainedService(PolicyBase):
    Params = LasParams

    def __init__(self, params: LasParams, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.attained: dict = {}  # task -> weighted tokens of service received on this replica
        self.waiting: dict = {}  # task -> its waiting requests, arrival order
        self.by_age = WaitingQueue()  # every waiting request by queue-join time (the starvation bound)

    # -- bookkeeping ----------------------------------------------------------------------------
    def on_arrival(self, req: Request, replica: Replica) -> None:
        task = task_of(req)
        self.attained.setdefault(task, 0.0)
        # service given elsewhere (a request moved after a fault) is not charged here again; what
        # the prefix cache serves at admission is not service (``_admitted`` moves the mark up)
        req.policy_data = _Charge(task, min(req.prompt_tokens, req.num_computed_tokens), req.num_generated_tokens,
                                  req.arrival_s)
        self._enqueue(req, req.arrival_s)  # (replica.now_s is its last decision's time while it is busy)

    def on_requeue(self, req: Request, replica: Replica) -> None:
        self._enqueue(req, replica.now_s)

    def on_leave(self, req: Request, replica: Replica) -> None:
        self._dequeue(req)

    def _enqueue(self, req: Request, now: float) -> None:
        data = req.policy_data
        data.queued_s = now
        self.waiting.setdefault(data.task, []).append(req)
        self.by_age.push(req, (now, req.index))

    def _dequeue(self, req: Request) -> None:
        data = req.policy_data
        if not isinstance(data, _Charge):  # (held back before it reached this policy: a paused tier)
            return
        queue = self.waiting.get(data.task)
        if queue is not None and req in queue:
            queue.remove(req)
            if not queue:
                del self.waiting[data.task]
        self.by_age.remove(req)

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        w_in, w_out = self.params.w_in, self.params.w_out
        attained = self.attained
        for req, _ in batch.items:
            data = req.policy_data
            done = req.num_computed_tokens
            if done > req.prompt_tokens:
                done = req.prompt_tokens
            d_in = done - data.charged_in
            d_out = req.num_generated_tokens - data.charged_out
            if d_in > 0 or d_out > 0:
                service = 0.0
                if d_in > 0:
                    data.charged_in = done
                    service += w_in * d_in
                if d_out > 0:
                    data.charged_out = req.num_generated_tokens
                    service += w_out * d_out
                attained[data.task] += service

    def victim_key(self, req: Request) -> tuple:
        data = req.policy_data
        return (self.attained.get(data.task, 0.0) if isinstance(data, _Charge) else 0.0, req.admitted_seq)

    # -- the decision ---------------------------------------------------------------------------
    def order(self, now: float):
        """Waiting requests in admission order: starved ones (waited ``max_wait_s``) oldest first,
        then task by task, least attained service first (ties: the task's first queued request's
        arrival, then its trace row), each task's requests in the order they joined the queue. Lazy: a decision that admits k requests
        pays for about k, plus one heap entry per waiting task."""
        starved: set = set()
        bound = self.params.max_wait_s
        if bound > 0:
            for req in self.by_age.in_order():
                if req.policy_data.queued_s + bound > now:
                    break
                starved.add(req)
                yield req
        heap = [(self.attained[task], reqs[0].arrival_s, reqs[0].index, task)
                for task, reqs in self.waiting.items()]
        heapq.heapify(heap)
        while heap:
            _, _, _, task = heapq.heappop(heap)
            for req in tuple(self.waiting.get(task, ())):
                if req not in starved:
                    yield req

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        b.schedule_running(replica.running, decodes_first=True)
        if not b.preempted and replica.waiting:
            b.admit_waiting(self.order(replica.now_s), chunked=True)
        for req in b.summary.admit:
            self._dequeue(req)
            self._admitted(req, b)
        return b.build()

    def _admitted(self, req: Request, b) -> None:
        """Tokens a cached prefix gives ``req`` at admission are not service to its task."""
        hits = b.summary.hits
        hit = hits.get(req) if hits else None
        if hit is not None:
            data = req.policy_data
            data.charged_in = max(data.charged_in, min(req.prompt_tokens, hit.tokens))


__all__ = ["LasParams", "LeastAttainedService", "task_of"]
