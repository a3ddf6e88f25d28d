"""`sjf` and `srpt`: shortest (remaining) output first, with oracle or noisy predicted lengths.

Real schedulers don't know the future: with ``noise_sigma > 0`` the predicted output length is
the true one times ``exp(N(0, sigma))``, drawn once per request from the engine seed and the
request id (deterministic). ``sjf`` ranks by predicted total output, ``srpt`` by predicted
remaining output. With ``preempt = true`` the ranking is re-applied at every iteration boundary:
a waiting request that outranks a running one takes its place when ``max_num_seqs`` is full.
Prefill uses the chunked-prefill token budget; without preemption running requests go as in
`sarathi` (decodes first, then their prefill chunks) and the ranking orders the waiting queue.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import chain, islice


from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.policies.ordering import KeyedWaiting, predicted_output
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request, Status


@dataclass(frozen=True, slots=True)
class LengthParams:
    preempt: bool = False
    noise_sigma: float = 0.0  # lognormal sigma of the length predictor; 0 = oracle

    def __post_init__(self) -> None:
        if self.noise_sigma < 0:
            raise ServelabError(f"policy (sjf/srpt): noise_sigma must be >= 0 (0: oracle lengths), got {self.noise_sigma}")


class _LengthAware(KeyedWaiting, PolicyBase):
    remaining: bool = False

    @property
    def reads_running(self) -> ReadsRunning | None:  # without preemption, running requests are read only by the builder
        return None if self.params.preempt else ReadsRunning()

    def on_arrival(self, req: Request, replica: Replica) -> None:
        if req.policy_data is None:
            req.policy_data = predicted_output(req, self.engine.seed, self.params.noise_sigma)
        super().on_arrival(req, replica)

    def rank(self, req: Request) -> tuple:
        predicted = req.policy_data
        if self.remaining:
            predicted = max(predicted - req.num_generated_tokens, 0.0)
        return (predicted, req.index)

    def victim_key(self, req: Request) -> tuple:
        return self.rank(req)

    waiting_key = rank  # fixed while waiting: generated tokens only change while running

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        if not self.params.preempt:
            b.schedule_running(replica.running, decodes_first=True)
            if not b.preempted:
                b.admit_waiting(self.waiting_in_order(replica), chunked=True)
        else:
            self._reschedule_all(replica, b)
        self.forget_admitted(b)
        return b.build()

    def _reschedule_all(self, replica: Replica, b) -> None:
        """Re-rank running and waiting together: the best ``max_num_seqs`` run, the rest are preempted."""
        rank = self.rank
        # (rank, request) pairs merge without a key function; ranks are unique (they end in req.index)
        running = sorted([(rank(req), req) for req in replica.running])
        waiting = ((rank(req), req) for req in b.seen(self.waiting_in_order(replica)))  # (known ones only)
        ordered = heapq.merge(running, waiting)  # lazily: only as far as the budgets reach
        best = [req for _, req in islice(ordered, replica.config.max_num_seqs)]
        b.keep_only(best)
        # Past `best` only waiting requests remain to try (every other running one was preempted).
        # Consecutive running requests go to the builder as one walk, which stops where this loop
        # would: at a spent budget.
        run: list[Request] = []
        for req in chain(best, (req for _, req in ordered)):
            if req.status is Status.RUNNING:
                run.append(req)
                continue
            if run:
                b.schedule_running(run)
                run = []
            if b.seq_budget <= 0 or b.token_budget <= 0:
                return
            if not b.has(req):
                b.admit(req)
        if run:
            b.schedule_running(run)


@POLICIES.register("sjf")
class ShortestJobFirst(_LengthAware):
    Params = LengthParams
    remaining = False


@POLICIES.register("srpt")
class ShortestRemainingFirst(_LengthAware):
    Params = LengthParams
    remaining = True
