"""LoRA affinity: the replica where the request's adapter is already loaded (replay/core/lora.py)."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase, least_outstanding


@ROUTERS.register("lora-affinity")
class LoraAffinityRouter(RouterBase):
    """Send a request with a LoRA adapter to a replica holding that adapter in a GPU slot, else in its
    host cache (so it loads from host memory, not disk), else anywhere — among the replicas not much
    busier than the least busy one (outstanding tokens at most ``BALANCE`` times the least plus
    ``SLACK_TOKENS``, as prefix-affinity), so that a popular adapter does not pile all its requests on
    one replica. Ties: fewest outstanding tokens, then the lowest id. A request without an adapter,
    or a replay without LoRA, is routed as by ``least-outstanding``."""

    BALANCE = 1.5
    SLACK_TOKENS = 4096

    def route(self, req, replicas):
        adapter = req.lora_adapter
        if adapter is None:
            return least_outstanding(replicas)
        bound = min(r.outstanding_tokens for r in replicas) * self.BALANCE + self.SLACK_TOKENS

        def rank(r):
            slots = r.lora
            where = 2 if slots is None else 0 if adapter in slots.gpu else 1 if adapter in slots.cpu else 2
            return where, r.outstanding_tokens, r.id

        return min((r for r in replicas if r.outstanding_tokens <= bound), key=rank)
