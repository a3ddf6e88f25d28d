"""What the engine calls: the Policy, Runner and Router protocols, and the step types a runner gets.

The engine owns these contracts; policies (``servelab.policies``) and runners (``servelab.runners``)
implement them and import them from here, never the other way round: nothing in ``replay/`` imports a
concrete policy or runner. Every member the engine reads is declared here, so an implementation
that satisfies the protocol needs no ``getattr`` probing (``PolicyBase`` and ``RunnerBase`` give the
defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from servelab.replay.core.batch import Batch, ReadsRunning
    from servelab.replay.core.replica import Replica
    from servelab.replay.core.request import Request


# -- what a runner is handed, once per priced iteration ------------------------------------------
class StepShape(NamedTuple):  # a tuple: built once per priced iteration, so cheap to make
    """Counts that determine the cost of one iteration.

    For prefill chunk i computing ``c_i`` new tokens on top of ``p_i`` tokens already in KV:
    ``prefill_tokens = sum c_i``; ``prefill_context_tokens = sum (p_i + c_i)`` (KV tokens the
    chunk's attention reads); ``prefill_attention_pairs = sum (c_i * p_i + c_i * (c_i + 1) / 2)``
    (causal query x key pairs). A decode reads all ``t_j`` tokens of its KV and computes one:
    ``decode_context_tokens = sum t_j``.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_context_tokens: int = 0
    prefill_attention_pairs: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    # speculative decoding (replay/core/speculative.py): draft tokens the decodes verify besides their one
    # token each (0 without it; a cost model that knows no speculation ignores it)
    spec_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True, slots=True)
class StepItem:
    """One request's share of an iteration: compute tokens [start, start + num_tokens)."""

    request: "Request"
    start: int
    num_tokens: int


class StepPlan(NamedTuple):
    shape: StepShape
    items: tuple[StepItem, ...] = ()  # only for runners with ``needs_block_tables``


# -- the runner ---------------------------------------------------------------------------------------
class BlockAllocator(Protocol):
    """Hands out real KV block ids (for runners that execute the batch against a paged cache)."""

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: Sequence[int]) -> None: ...


@runtime_checkable
class Runner(Protocol):
    """Prices (or executes) iterations.

    ``decode_affine(n)`` returns ``(a, b)`` such that a pure-decode iteration of ``n`` requests
    reading ``C`` KV tokens in total takes exactly ``a + b * C`` seconds, or None when the runner
    cannot promise that (a real GPU): the engine then never advances several identical decode
    iterations at once.

    ``kv_capacity_tokens(gpu_memory_utilization)`` is the KV cache size in tokens per replica; it is
    None (the attribute itself) when the runner knows no model or GPU, and the user must give
    ``num_gpu_blocks``. ``kv_bytes_per_token`` (None when unknown) times swaps. A runner with
    ``needs_block_tables`` gets the batch's items with real block ids from ``make_allocator``.
    """

    name: str
    needs_block_tables: bool
    kv_bytes_per_token: int | None
    kv_capacity_tokens: Callable[[float], int] | None

    def step_time(self, plan: StepPlan) -> float: ...

    def decode_affine(self, num_seqs: int) -> tuple[float, float] | None: ...

    def describe(self) -> dict: ...

    def make_allocator(self, replica_id: int, num_blocks: int) -> BlockAllocator | None: ...

    # multi-LoRA (replay/core/lora.py): an adapter's parameters per unit of rank (None: the runner knows no
    # model, so it cannot serve LoRA), their bytes each, and the seconds the adapters' kernels add to an
    # iteration given sum(tokens x rank) over its items with an adapter and its distinct adapters' ranks
    lora_params_per_rank: int | None
    lora_dtype_bytes: int

    def lora_step_s(self, rank_tokens: int, ranks: list[int]) -> float: ...


# -- the policy ---------------------------------------------------------------------------------------
class Policy(Protocol):
    """Chooses each iteration's batch for one replica; ``servelab.policies.base.PolicyBase`` gives defaults.

    The engine calls ``schedule`` at every iteration boundary and the ``on_*`` hooks when requests
    join or leave the replica's waiting queue; a policy never mutates requests or the replica (the
    engine applies its decision). ``reads_running``: the policy's promise to read running requests
    only through its ``BatchBuilder`` (``batch.ReadsRunning``), or None.
    ``sheds``: the engine calls ``shed`` before each decision and drops what it returns.
    """

    name: str
    params: Any  # the policy's frozen parameters (written to run.json)
    uses_token_budget: bool  # False: max_num_batched_tokens does not apply (orca, static)
    reads_running: "ReadsRunning | None"
    sheds: bool

    def schedule(self, replica: "Replica") -> "Batch": ...

    def on_arrival(self, req: "Request", replica: "Replica") -> None:
        """``req`` joined ``replica``'s waiting queue."""

    def on_requeue(self, req: "Request", replica: "Replica") -> None:
        """A running request was preempted back into the waiting queue (its counters already updated)."""

    def on_leave(self, req: "Request", replica: "Replica") -> None:
        """``req`` left the replica without the policy's decision (dropped, paused, replica failure)."""

    def on_step(self, batch: "Batch", num_iterations: int) -> None:
        """``batch`` ran ``num_iterations`` identical iterations; its requests' counters are updated.
        ``batch.bulk`` more running requests decoded too (one token per iteration each), counted per
        ``reads_running.by_class`` in ``batch.bulk_by_class``."""

    def on_finish(self, req: "Request", replica: "Replica") -> None:
        """``req`` finished (called after ``on_step`` of the step that finished it)."""

    def reject_reason(self, req: "Request") -> str | None:
        """Why ``req`` can never be served under this policy, or None."""

    def victim_key(self, req: "Request") -> Any:
        """Preemption order: the running request with the largest key is preempted first."""

    def shed(self, replica: "Replica") -> list[tuple["Request", str]]:
        """Waiting requests to drop before the next decision, each with its reason (only if ``sheds``)."""


# -- the router -----------------------------------------------------------------------------------
class Router(Protocol):
    """Which live replica an arriving request joins. ``reads_progress``, ``reads_kv``: whether ``route`` reads
    a replica's outstanding tokens, its KV use (``kv.used``), which a decode stretch in flight updates only at
    its end: the engine then shows them as one iteration at a time has them (``engine.route_at``)."""

    reads_progress: bool
    reads_kv: bool

    def route(self, req: "Request", replicas: list["Replica"]) -> "Replica": ...


__all__ = ["BlockAllocator", "Policy", "Router", "Runner", "StepItem", "StepPlan", "StepShape"]
