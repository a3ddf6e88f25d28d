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

Cost under overload grows with events, not with the queue or the batch: waiting tasks sit in one
heap kept across decisions (an entry is re-keyed when its task's service or first request changes,
stale ones are dropped when they surface), and a decision pops only the tasks it reaches. Decoding
requests of single-call tasks (no ``session_id``) may be kept in the builder's aggregate
(``reads_running``): their output tokens are charged when they leave it (``_settled``), which is
exact because nothing reads such a task's service while its only request runs (it is not waiting,
and a victim is never chosen while the aggregate decodes), and because with whole-number weights the
sum does not depend on how it is grouped. With fractional weights every request is walked.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import WaitingQueue
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request


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
        # waiting tasks: (service, first request's arrival, its row, version, task); an entry is live
        # while its version is the task's (``version``); kept across decisions (``_rekey``)
        self.heap: list = []
        self.version: dict = {}  # waiting task -> the version of its live heap entry
        self.versions = 0
        self.popped: list = []  # the live entries a decision popped (``order``), pushed back after it

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
        queue = self.waiting.get(data.task)
        if queue is None:
            self.waiting[data.task] = [req]
            self._rekey(data.task)
        else:
            queue.append(req)
        self.by_age.push(req, (now, req.index))

    def _rekey(self, task) -> None:
        """``task``'s key changed (it began waiting, its service or its first waiting request
        changed): push its new entry; the old one, if any, is dead. A heap grown past twice the live
        entries is rebuilt, so dead ones cost O(1) each over the replay."""
        reqs = self.waiting.get(task)
        if reqs is None:
            self.version.pop(task, None)
            return
        self.versions += 1
        self.version[task] = self.versions
        heap = self.heap
        heapq.heappush(heap, (self.attained[task], reqs[0].arrival_s, reqs[0].index, self.versions, task))
        if len(heap) > 2 * len(self.version) + 64:
            version = self.version
            self.heap = [entry for entry in heap if version.get(entry[4]) == entry[3]]
            heapq.heapify(self.heap)

    def _dequeue(self, req: Request) -> None:
        data = req.policy_data
        if not isinstance(data, _Charge):  # (held back before it reached this policy: a paused tier)
            return
        queue = self.waiting.get(data.task)
        if queue is not None and req in queue:
            first = queue[0] is req
            queue.remove(req)
            if not queue:
                del self.waiting[data.task]
            if first:
                self._rekey(data.task)
        self.by_age.remove(req)

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        w_in, w_out = self.params.w_in, self.params.w_out
        attained, waiting = self.attained, self.waiting
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
                if data.task in waiting:  # (a task with calls both running and waiting)
                    self._rekey(data.task)

    @property
    def reads_running(self) -> ReadsRunning | None:
        """Running requests are read only by the builder's decode-first walk, and a single-call task's
        decoding request may be kept in aggregate, its tokens charged when it leaves (module docstring).
        Only with whole-number weights: then charging in one sum gives the same float as step by step."""
        p = self.params
        exact = float(p.w_in).is_integer() and float(p.w_out).is_integer()
        return ReadsRunning(None, self._settled, _single_call) if exact else None

    def _settled(self, req: Request) -> None:
        """``req`` left the aggregate: the output tokens it made there are its task's service."""
        data = req.policy_data
        d_out = req.num_generated_tokens - data.charged_out
        if d_out > 0:
            data.charged_out = req.num_generated_tokens
            self.attained[data.task] += self.params.w_out * d_out
            if data.task in self.waiting:
                self._rekey(data.task)

    def victim_key(self, req: Request) -> tuple:
        data = req.policy_data
        return (self.attained.get(data.task, 0.0) if isinstance(data, _Charge) else 0.0, req.admitted_seq)

    # -- the decision ---------------------------------------------------------------------------
    def order(self, now: float):
        """Waiting requests in admission order: starved ones (waited ``max_wait_s``) oldest first,
        then task by task, least attained service first (ties: the task's first queued request's
        arrival, then its trace row), each task's requests in the order they joined the queue. Lazy: a
        decision that admits k requests pops about k tasks from the kept heap (``self.popped``, pushed
        back by ``schedule``)."""
        starved: set = set()
        bound = self.params.max_wait_s
        if bound > 0:
            for req in self.by_age.in_order():
                if req.policy_data.queued_s + bound > now:
                    break
                starved.add(req)
                yield req
        heap, version, popped = self.heap, self.version, self.popped
        while heap:
            entry = heapq.heappop(heap)
            task = entry[4]
            if version.get(task) != entry[3]:
                continue  # dead: the task was re-keyed or stopped waiting
            popped.append(entry)
            for req in tuple(self.waiting[task]):
                if req not in starved:
                    yield req

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        b.schedule_running(replica.running, decodes_first=True)
        if not b.preempted and replica.waiting:
            self.popped = []
            b.admit_waiting(self.order(replica.now_s), chunked=True)
            for entry in self.popped:  # the live entries this decision reached go back
                heapq.heappush(self.heap, entry)
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


def _single_call(req: Request) -> bool:
    """May ``req`` decode in the builder's aggregate? Only a request that is its task's only call."""
    return req.session_id is None


__all__ = ["LasParams", "LeastAttainedService", "task_of"]
