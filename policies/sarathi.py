"""`sarathi` (= vLLM v1's default scheduler, the engine default): decode-first chunked prefill.

Decodes go first (every running request whose next token is a decode), then the running requests
still prefilling get their next chunk, then waiting requests fill the remaining token budget with
prefill chunks; prefill and decode share iterations (Sarathi-Serve, OSDI 2024, Algorithm 1).
Waiting requests are not admitted in an iteration that had to preempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica


@dataclass(frozen=True, slots=True)
class SarathiParams:
    """sarathi's settings (``[policy_params]``)."""

    long_prefill_threshold: int = 0  # cap on one request's chunk per iteration (0: only the budget caps it)

    def __post_init__(self) -> None:
        if self.long_prefill_threshold < 0:
            raise ServelabError(f"policy 'sarathi': long_prefill_threshold must be >= 0 (0: no cap), "
                                f"got {self.long_prefill_threshold}")  # fmt: skip


@POLICIES.register("sarathi")
class Sarathi(PolicyBase):
    Params = SarathiParams
    reads_running = ReadsRunning()

    def schedule(self, replica: Replica) -> Batch:
        cap = self.params.long_prefill_threshold or None
        b = self.builder(replica)
        b.schedule_running(replica.running, cap, decodes_first=True)
        if replica.waiting and not b.preempted:
            b.admit_waiting(replica.waiting, chunked=True, chunk_cap=cap)
        return b.build()


POLICIES.alias("vllm-v1", "sarathi")  # the name a vLLM user looks for: vLLM v1's default scheduler is this one
