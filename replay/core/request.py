"""The one request object every layer shares: trace fields plus progress counters.

Progress follows vLLM v1: a request has ``num_tokens`` known tokens (prompt + generated) and
``num_computed_tokens`` of them already in KV. An iteration computes ``n`` more; when computed
catches up with known, the iteration emits a new output token. Prefill, chunked prefill, decode
and recompute after preemption are all that one mechanism.
"""

from __future__ import annotations

import math
from enum import IntEnum


class Status(IntEnum):
    """Ordered: everything from FINISHED on is terminal."""

    PENDING = 0  # not arrived yet (closed-loop turns wait for their predecessor)
    WAITING = 1  # queued on a replica, holding no KV (new, or preempted)
    RUNNING = 2  # admitted: holds KV, scheduled iteration by iteration
    FINISHED = 3
    REJECTED = 4  # can never be served (e.g. larger than all KV)
    UNFINISHED = 5  # still in flight when the horizon ended the replay
    THROTTLED = 6  # refused by a quota and never retried successfully
    DROPPED = 7  # shed by an admission policy (e.g. deadline can no longer be met)
    ABORTED = 8  # its client gave up (a client timeout: replay/platform/abort.py)
    SKIPPED = 9  # never sent: a request it depends on did not finish (replay/core/depends.py)

    @property
    def is_terminal(self) -> bool:
        return self >= Status.FINISHED


class Request:
    """A trace row in flight. Times are simulated seconds; None until they happen."""

    __slots__ = (
        "request_id", "index", "arrival_s", "prompt_tokens", "output_tokens", "max_output_tokens",
        "tenant", "tier", "session_id", "think_s", "ttft_slo_s", "tpot_slo_s", "prefix_hashes",
        "status", "reason", "replica", "num_computed_tokens", "num_generated_tokens", "kv_blocks",
        "swapped", "num_preemptions", "first_scheduled_s", "first_token_s", "finish_s",
        "last_token_s", "max_itl_s", "admitted_seq", "block_table", "policy_data", "aggregate_mark",
        "cached_keys", "num_cached_tokens", "kv_load_s", "tier_tokens",
        "lora_adapter", "mm", "queued_s",
    )

    def __init__(
        self,
        request_id: int,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        max_output_tokens: int | None = None,
        tenant: str = "default",
        tier: str = "standard",
        session_id: int | None = None,
        think_s: float | None = None,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        prefix_hashes: list[int] | None = None,
        index: int = 0,
    ):
        self.request_id = request_id
        self.index = index  # row in the trace; results keep trace order
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.max_output_tokens = output_tokens if max_output_tokens is None else max_output_tokens
        self.tenant = tenant
        self.tier = tier
        self.session_id = session_id
        self.think_s = think_s
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.prefix_hashes = prefix_hashes
        self.status = Status.PENDING
        self.reason: str | None = None
        self.replica: int | None = None
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.kv_blocks = 0  # GPU KV blocks held now
        self.swapped = False  # KV lives in the host swap pool
        self.num_preemptions = 0
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.last_token_s: float | None = None
        self.max_itl_s: float | None = None
        self.admitted_seq = 0  # engine-wide admission order (victim choice: most recent first)
        self.block_table: list[int] | None = None  # real block ids, only for runners that need them
        self.policy_data = None  # a policy's private per-request state (e.g. a predicted length)
        self.aggregate_mark: int | None = None  # kept in aggregate by its replica's batch builder since that iteration (replay/core/batch.py)
        self.cached_keys = None  # the prefix-cache Chain of hashed blocks it holds (replay/core/kv/prefix_cache.py)
        self.num_cached_tokens = 0  # tokens its admissions reused from the prefix cache (GPU and lower tiers)
        self.kv_load_s = 0.0  # seconds its admissions spent loading KV from lower tiers (replay/core/kv/tiers.py)
        self.tier_tokens: list[int] | None = None  # of num_cached_tokens, those each lower tier served
        self.lora_adapter: str | None = None  # the LoRA adapter it runs with (trace column lora_adapter)
        self.mm = None  # its images, video and audio (replay/core/encoder.py MultiModal), None for text only
        # async scheduling (EngineConfig.async_scheduling): when it last joined a replica's waiting queue, which
        # may be after arrival_s (a client's retry, an encode pool, a failed replica's requests routed again)
        self.queued_s = -math.inf

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt plus every generated token."""
        return self.prompt_tokens + self.num_generated_tokens

    @property
    def is_decoding(self) -> bool:
        """True when the next iteration computes exactly one token and emits the next one."""
        return self.num_generated_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id}, {self.status.name}, prompt={self.prompt_tokens}, "
            f"out={self.num_generated_tokens}/{self.output_tokens}, computed={self.num_computed_tokens})"
        )
