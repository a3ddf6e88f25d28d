"""`round-robin`: time slicing when demand exceeds ``max_num_seqs``.

Each admitted request runs for ``quantum`` iterations; then, if others wait for a slot, it is
preempted (the engine's preemption mode: swap keeps its KV, recompute redoes it) and rejoins the
back of the queue, behind requests that arrived up to that moment. Queue order is kept as a
per-request ticket, so the engine's own front-of-queue placement of preempted requests is
overridden.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase
from servelab.replay.batch import Batch
from servelab.replay.replica import Replica
from servelab.replay.request import Request


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    quantum: int = 1  # iterations per turn

    def __post_init__(self) -> None:
        if self.quantum < 1:
            raise ServelabError(f"policy 'round-robin': quantum must be >= 1, got {self.quantum}")


class _Slot:
    __slots__ = ("ticket", "used")

    def __init__(self, ticket: int):
        self.ticket = ticket
        self.used = 0  # iterations run in the current turn


@POLICIES.register("round-robin")
class RoundRobin(PolicyBase):
    name = "round-robin"
    Params = RoundRobinParams

    def __init__(self, params, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self._tickets = 0

    def _ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def on_arrival(self, req: Request, replica: Replica) -> None:
        req.policy_data = _Slot(self._ticket())

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        for req, _ in batch.items:
            req.policy_data.used += num_iterations

    def schedule(self, replica: Replica) -> Batch:
        quantum = self.params.quantum
        b = self.builder(replica)
        queue = sorted(replica.waiting, key=lambda r: r.policy_data.ticket)
        short = len(queue) - (replica.config.max_num_seqs - len(replica.running))
        if short > 0:
            expired = [r for r in replica.running if r.policy_data.used >= quantum]
            expired.sort(key=lambda r: r.policy_data.ticket)
            for req in expired[:short]:
                b.preempt(req)
                req.policy_data.ticket = self._ticket()  # back of the queue
                req.policy_data.used = 0
        b.schedule_running(replica.running)
        if not b.preempted or short > 0:
            b.admit_waiting(queue, chunked=True)
        for req, _ in b.items:
            if req.policy_data.used >= quantum:
                req.policy_data.used = 0  # nobody was waiting: a fresh turn
        repeat = None
        if replica.waiting or b.preempted:
            left = [quantum - r.policy_data.used for r, _ in b.items]
            repeat = max(1, min(left)) if left else None
        return b.build(repeat=repeat)
