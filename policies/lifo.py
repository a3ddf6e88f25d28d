"""`lifo`: last come, first served — the worked example of docs/engine.md "Adding a policy".

Running requests go as in `sarathi` (every decode, then the prefill chunks of those still
prefilling); then the waiting queue is admitted newest first. A request preempted back into the
queue sits at its front (the engine's rule), so it is admitted after every newer arrival. LIFO
minimises nothing in particular; it is here because it is the smallest policy that differs from
FCFS, and the golden test shows the difference by hand.
"""

from __future__ import annotations

from servelab.policies.base import POLICIES, PolicyBase, ReadsRunning
from servelab.replay.core.batch import Batch
from servelab.replay.core.replica import Replica


@POLICIES.register("lifo")
class LastComeFirstServed(PolicyBase):
    reads_running = ReadsRunning()  # running requests are read only through schedule_running(replica.running, ...)

    def schedule(self, replica: Replica) -> Batch:
        b = self.builder(replica)
        b.schedule_running(replica.running, decodes_first=True)
        if not b.preempted:
            b.admit_waiting(reversed(replica.waiting), chunked=True)
        return b.build()
