"""`round-robin`: time slicing when demand exceeds ``max_num_seqs``.

Each admitted request runs until it has produced ``quantum`` tokens in its turn (a turn that only
prefills does not count, so recompute preemption cannot livelock); then, if others wait for a slot, it is
preempted (the engine's preemption mode: swap keeps its KV, recompute redoes it) and rejoins the
back of the queue, behind requests that arrived up to that moment. Queue order is kept as a
per-request ticket, so the engine's own front-of-queue placement of preempted requests is
overridden.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase
from servelab.policies.ordering import KeyedWaiting
from servelab.replay.batch import Batch
from servelab.replay.replica import Replica
from servelab.replay.request import Request, Status


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    quantum: int = 1  # iterations per turn

    def __post_init__(self) -> None:
        if self.quantum < 1:
            raise ServelabError(f"policy 'round-robin': quantum must be >= 1, got {self.quantum}")


class _Slot:
    __slots__ = ("ticket", "turn_start")

    def __init__(self, ticket: int):
        self.ticket = ticket
        self.turn_start = 0  # tokens it had generated when its current turn began


@POLICIES.register("round-robin")
class RoundRobin(KeyedWaiting, PolicyBase):
    Params = RoundRobinParams

    def __init__(self, params, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self._tickets = 0

    def _ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def on_arrival(self, req: Request, replica: Replica) -> None:
        req.policy_data = _Slot(self._ticket())
        super().on_arrival(req, replica)

    def waiting_key(self, req: Request) -> int:
        return req.policy_data.ticket  # a preempted request: a new ticket if its turn ended, else its old one

    def _used(self, req: Request) -> int:
        return req.num_generated_tokens - req.policy_data.turn_start

    def schedule(self, replica: Replica) -> Batch:
        quantum = self.params.quantum
        b = self.builder(replica)
        short = len(replica.waiting) - (replica.config.max_num_seqs - len(replica.running))
        if short > 0:
            expired = [r for r in replica.running if self._used(r) >= quantum]
            expired.sort(key=lambda r: r.policy_data.ticket)
            for req in expired[:short]:
                b.preempt(req)
                req.policy_data.ticket = self._ticket()  # back of the queue
        b.schedule_running(replica.running)
        if not b.preempted or short > 0:
            b.admit_waiting(self.waiting_in_order(replica), chunked=True)
        self.forget_admitted(b)
        for req, _ in b.items:
            if req.status is Status.WAITING or self._used(req) >= quantum:
                req.policy_data.turn_start = req.num_generated_tokens  # a new turn begins
        repeat = None
        if replica.waiting or b.preempted:
            left = [quantum - self._used(r) for r, _ in b.items]
            repeat = max(1, min(left)) if left else None
        return b.build(repeat=repeat)
