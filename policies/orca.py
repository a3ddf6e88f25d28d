"""`orca`: iteration-level scheduling (Orca, OSDI 2022) without chunking.

Every running request advances each iteration and new requests join with their whole prompt in
the same iteration as the running decodes; only ``max_num_seqs`` and KV limit the batch
(``max_num_batched_tokens`` does not apply: Orca has no token budget).
"""

from __future__ import annotations

from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica


@POLICIES.register("orca")
class Orca(PolicyBase):
    uses_token_budget = False
    reads_running = ReadsRunning()

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        b.schedule_running(replica.running, decodes_first=True)
        if not b.preempted:
            b.admit_waiting(replica.waiting, chunked=False)
        return b.build()
