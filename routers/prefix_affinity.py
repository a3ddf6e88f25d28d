"""Prefix affinity: the replica whose prefix cache holds the longest prefix of the request."""

from __future__ import annotations

from servelab.routers.base import ROUTERS, RouterBase


@ROUTERS.register("prefix-affinity")
class PrefixAffinityRouter(RouterBase):
    """Join the replica whose prefix cache holds the longest prefix of the request (asked through
    its KV manager), so multi-turn sessions and shared system prompts find their KV — among the
    replicas not much busier than the least busy one (outstanding tokens at most ``BALANCE`` times
    the least plus ``SLACK_TOKENS``), so that a popular prefix does not pile all its requests on one
    replica. Ties go to the replica holding more of it in GPU memory rather than in a lower tier
    (a shared store serves every replica alike), then, and a request nobody has cached, to the
    fewest outstanding tokens, then the lowest id. Without prefix caching it is ``least-outstanding``."""

    BALANCE = 1.5
    SLACK_TOKENS = 4096

    def route(self, req, replicas):
        bound = min(r.outstanding_tokens for r in replicas) * self.BALANCE + self.SLACK_TOKENS

        def rank(r):
            tokens, in_gpu = r.kv.affinity(req)
            return -tokens, -in_gpu, r.outstanding_tokens, r.id

        return min((r for r in replicas if r.outstanding_tokens <= bound), key=rank)
