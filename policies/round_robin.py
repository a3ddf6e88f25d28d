"""`round-robin`: time slicing when demand exceeds ``max_num_seqs``.

Each admitted request runs until it has produced ``quantum`` tokens in its turn (a turn that only
prefills does not count, so a recompute that keeps its tokens cannot livelock); then, if others
wait for a slot, it is preempted (the engine's preemption mode: swap keeps its KV, recompute redoes
it) and rejoins the back of the queue, behind requests that arrived up to that moment; if nobody waits, a new turn
begins. A turn ends by preemption only if the request keeps its output tokens: with the journal
off (``journal = false``: a recomputed request starts over) it must be swapped out, or it begins a
new turn instead. Otherwise a request longer than ``quantum`` would lose its tokens at the end of
every turn and never finish while others wait (a livelock: the replay would never end). Queue
order is kept as a per-request ticket, so the engine's own front-of-queue placement of preempted
requests is overridden. Within an iteration, running requests are scheduled as in
`sarathi` (decodes first, then prefill chunks, then admissions).

Turns end in O(turns), not O(running requests) per decision: a request produces at most one token
per iteration, so a turn that began at replica iteration ``i`` with ``u`` tokens used cannot end
before iteration ``i + quantum - u``. Turns wait in a heap keyed by that bound and are checked only
when it comes up. The policy reads progress through ``BatchBuilder.generated`` and preempts before
``schedule_running``, so the builder may keep the decoding requests in aggregate (``reads_running``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import KeyedWaiting
from servelab.replay.core.batch import Batch, BatchBuilder
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    # Output tokens per turn. Each turn that ends while others wait is a preemption (a recompute of
    # the context, or a swap out and in), so a small quantum is costly for the served system and for
    # the replay alike: see docs/engine.md ("round-robin's quantum").
    quantum: int = 256

    def __post_init__(self) -> None:
        if self.quantum < 1:
            raise ServelabError(f"policy 'round-robin': quantum must be >= 1, got {self.quantum}")


class _Slot:
    __slots__ = ("ticket", "turn_start", "turn")

    def __init__(self, ticket: int):
        self.ticket = ticket  # its place in the waiting queue
        self.turn_start = 0  # tokens it had generated when its current turn began
        self.turn = 0  # its current turn's heap entry (older entries are dead)


@POLICIES.register("round-robin")
class RoundRobin(KeyedWaiting, PolicyBase):
    Params = RoundRobinParams
    reads_running = ReadsRunning()

    def __init__(self, params, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self._tickets = 0
        self._iterations = 0  # iterations this replica has run
        self._turns: list[tuple[int, int, _Slot, Request]] = []  # (earliest iteration it can end, turn, slot, req)
        self._turn_seq = 0

    def _ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def on_arrival(self, req: Request, replica: Replica) -> None:
        req.policy_data = _Slot(self._ticket())
        super().on_arrival(req, replica)

    def waiting_key(self, req: Request) -> int:
        return req.policy_data.ticket  # a preempted request: a new ticket if its turn ended, else its old one

    def on_requeue(self, req: Request, replica: Replica) -> None:
        req.policy_data.turn = 0  # its turn is over (its heap entry is dead)
        super().on_requeue(req, replica)

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        self._iterations += num_iterations

    def _begin_turn(self, req: Request, generated: int) -> None:
        slot = req.policy_data
        slot.turn_start = generated
        self._turn_seq += 1
        slot.turn = self._turn_seq
        heapq.heappush(self._turns, (self._iterations + self.params.quantum, self._turn_seq, slot, req))

    def _ended_turns(self, b: BatchBuilder) -> list[Request]:
        """Running requests whose turn has ended (used >= quantum), in ticket order."""
        turns, now, quantum = self._turns, self._iterations, self.params.quantum
        ended = []
        while turns and turns[0][0] <= now:
            entry = heapq.heappop(turns)
            if not _current(entry):
                continue
            req = entry[3]
            used = b.generated(req) - req.policy_data.turn_start
            if used >= quantum:
                ended.append(req)
            else:  # it skipped iterations: not before this
                heapq.heappush(turns, (now + quantum - used, *entry[1:]))
        ended.sort(key=lambda r: r.policy_data.ticket)
        return ended

    def _yielding(self, ended: list[Request], short: int, b: BatchBuilder) -> tuple[list[Request], list[Request]]:
        """Splits the ended turns: the first ``short`` (in ticket order) that may yield their slot
        without losing their output, and the rest (they begin a new turn)."""
        yielding: list[Request] = []
        staying: list[Request] = []
        swapped = 0  # blocks the yielding requests will swap out (the host pool they share)
        for req in ended:
            if len(yielding) >= short:
                staying.append(req)
            elif self.engine.journal:  # a recompute resumes from its generated tokens
                yielding.append(req)
            elif b.kv.can_swap(blocks := b.kv_blocks(req), swapped):
                yielding.append(req)
                swapped += blocks
            else:  # a recompute would start it over: yielding at each turn's end, it could never finish
                staying.append(req)
        return yielding, staying

    def _next_turn_end(self) -> int | None:
        """The earliest iteration at which a running request's turn can end."""
        turns = self._turns
        while turns and not _current(turns[0]):
            heapq.heappop(turns)
        return turns[0][0] if turns else None

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        # (async scheduling: a request this decision does not know of yet takes no turn from a running one)
        waiting = len(replica.waiting) if not replica.holding else sum(1 for _ in b.seen(replica.waiting))
        short = waiting - (replica.config.max_num_seqs - len(replica.running))
        yielding, staying = self._yielding(self._ended_turns(b), short, b)
        for req in yielding:
            b.preempt(req)
            req.policy_data.ticket = self._ticket()  # back of the queue
        for req in staying:
            self._begin_turn(req, b.generated(req))  # nobody waits for its slot (or it cannot yield): a new turn
        b.schedule_running(replica.running, decodes_first=True)
        if not b.preempted or short > 0:
            b.admit_waiting(self.waiting_in_order(replica), chunked=True)
        for req in b.summary.admit:
            self._begin_turn(req, req.num_generated_tokens)
        self.forget_admitted(b)
        repeat = None
        if replica.waiting or b.preempted:  # run no further than the first turn that may end
            end = self._next_turn_end()
            if end is not None:
                repeat = max(1, end - self._iterations)
        return b.build(repeat=repeat)


def _current(entry: tuple[int, int, _Slot, Request]) -> bool:
    """Is this heap entry the current turn of a request running here (or just admitted)? A request
    that was preempted, finished, or left for another replica (which gave it a slot of its own) has
    none."""
    _, turn, slot, req = entry
    return slot.turn == turn and req.policy_data is slot and not req.status.is_terminal
