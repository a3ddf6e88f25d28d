"""`static`: request-level batching (FasterTransformer): no request joins a batch in flight.

When the replica is idle a batch of up to ``max_num_seqs`` waiting requests is formed (whole
prompts); it runs iteration by iteration until every member has finished, then the next forms.
"""

from __future__ import annotations

from servelab.policies.base import POLICIES, PolicyBase
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica


@POLICIES.register("static")
class Static(PolicyBase):
    uses_token_budget = False

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        if replica.running:
            b.schedule_running(replica.running)
        else:
            b.admit_waiting(replica.waiting, chunked=False)
        return b.build()
