"""`vllm-v0`: vLLM's original scheduler: prefill-first, prefill and decode never mixed.

If any waiting request can be admitted, the iteration prefills whole prompts (up to the token
budget) and running requests wait; otherwise every running request decodes. A prompt larger
than the budget runs alone in its own iteration rather than never.
"""

from __future__ import annotations

from servelab.policies.base import POLICIES, PolicyBase
from servelab.replay.batch import Batch
from servelab.replay.replica import Replica


@POLICIES.register("vllm-v0")
class VllmV0(PolicyBase):

    def schedule(self, replica: Replica) -> Batch:
        if replica.waiting:
            b = self.builder(replica, seq_budget=replica.config.max_num_seqs - len(replica.running))
            b.admit_waiting(replica.waiting, chunked=False)
            if b.items:
                return b.build()
        b = self.builder(replica)
        b.schedule_running(replica.running)
        return b.build()
