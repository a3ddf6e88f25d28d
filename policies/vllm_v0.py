"""`vllm-v0`: vLLM's original scheduler: prefill-first, prefill and decode never mixed.

If any waiting request can be admitted, the iteration prefills whole prompts (up to the token
budget) and running requests wait; otherwise every running request decodes. A prompt larger
than the budget runs alone in its own iteration rather than never.

Running requests are read only through ``schedule_running(replica.running)`` (a decode iteration
walks them in admission order; a prefill iteration does not read them), so the builder may keep the
decoding ones in aggregate (``reads_running``): under overload a decode iteration then costs O(1),
not O(running requests). Every running request is a decode when it runs (prompts are computed
whole), so the aggregate's members lead the walk and it is taken whole. A request whose last token
came from a prefill iteration joins the aggregate only after its next token (``_may_bulk``): the
aggregate's members sat that iteration out, so its next inter-token gap is shorter than theirs.
"""

from __future__ import annotations

from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request


@POLICIES.register("vllm-v0")
class VllmV0(PolicyBase):

    def __init__(self, params, engine, replica_id: int = 0):
        super().__init__(params, engine, replica_id)
        self.prefilling = False  # is the batch last decided a prefill iteration?

    @property
    def reads_running(self) -> ReadsRunning:
        return ReadsRunning(may_bulk=self._may_bulk)

    def _may_bulk(self, req: Request) -> bool:
        """Not right after a prefill iteration (the aggregate did not run in it)."""
        return not self.prefilling

    def schedule(self, replica: Replica) -> Batch:
        if replica.waiting:
            b = self.builder(replica, seq_budget=replica.config.max_num_seqs - len(replica.running))
            b.admit_waiting(replica.waiting, chunked=False)
            if b.items:
                self.prefilling = True
                # never repeated: the next decision decodes every running request (a readmission onto a
                # fully cached prompt computes one token, which alone would look like a decode to repeat)
                return b.build(repeat=1)
        self.prefilling = False
        b = self.builder(replica)
        b.schedule_running(replica.running)
        return b.build()
