"""The policies' side of the seam: a base class with the Policy protocol's defaults, and lookup by name.

The protocol itself is the engine's (``servelab.replay.core.protocols.Policy``). A policy sees one
replica's state at an iteration boundary and returns an immutable `Batch`; it never calls the
runner and never mutates the replica (the engine applies the decision). A new policy is one file in
this package: a class with ``Params`` (a frozen dataclass, typed once when the config is made) registered
with ``@POLICIES.register`` (the registry sits with the Protocols: replay/core/plugins.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from servelab.replay.core.batch import UNLIMITED, Batch, BatchBuilder, ReadsRunning
from servelab.replay.core.engine_config import EngineConfig
from servelab.replay.core.plugins import POLICIES, params_for
from servelab.replay.core.protocols import Policy
from servelab.replay.core.replica import Replica
from servelab.replay.core.request import Request
from servelab.replay.core.speculative import SpecBatchBuilder


@dataclass(frozen=True, slots=True)
class NoParams:
    """A policy without settings."""


class PolicyBase:
    """The Policy protocol's defaults (replay/core/protocols.py): FCFS victims (most recently admitted
    first), no rejection, no shedding, no bookkeeping in the hooks. ``name`` is set by the registry."""

    name: ClassVar[str] = "?"
    Params: ClassVar[type] = NoParams
    uses_token_budget: ClassVar[bool] = True  # False: max_num_batched_tokens does not apply (orca, static)
    # ReadsRunning(): the policy reads running requests only through its builder (batch.ReadsRunning),
    # which may then keep decoding requests in aggregate (they decode as ``Batch.bulk``); None: it
    # reads them itself
    reads_running: ClassVar[ReadsRunning | None] = None
    # True: the policy keeps per-class service state that does not follow a request from one replica
    # to another (vtc, drr), so prefill/decode pools refuse it
    charges_per_class: ClassVar[bool] = False
    sheds: ClassVar[bool] = False  # True: the engine calls ``shed`` before each decision

    def __init__(self, params: Any, engine: EngineConfig, replica_id: int = 0):
        self.params = params
        self.engine = engine
        self.replica_id = replica_id

    def schedule(self, replica: Replica) -> Batch:
        raise NotImplementedError

    def on_arrival(self, req: Request, replica: Replica) -> None:
        """``req`` joined ``replica``'s waiting queue."""

    def on_step(self, batch: Batch, num_iterations: int) -> None:
        """``batch`` ran ``num_iterations`` iterations; its requests' counters are up to date."""

    def on_finish(self, req: Request, replica: Replica) -> None:
        """``req`` finished on ``replica`` (after ``on_step`` of its last step)."""

    def on_leave(self, req: Request, replica: Replica) -> None:
        """``req`` left ``replica`` without this policy's decision (dropped, paused, replica failure)."""

    def on_requeue(self, req: Request, replica: Replica) -> None:
        """``req`` was preempted back into ``replica``'s waiting queue (its counters already updated)."""

    def reject_reason(self, req: Request) -> str | None:
        return None

    def victim_key(self, req: Request) -> Any:
        return req.admitted_seq

    def shed(self, replica: Replica) -> list[tuple[Request, str]]:
        return []

    def builder(self, replica: Replica, token_budget: int | None = None, seq_budget: int | None = None) -> BatchBuilder:
        if token_budget is None and not self.uses_token_budget:
            token_budget = UNLIMITED
        if replica.config.spec_method is not None:  # decodes take their drafts too (replay/core/speculative.py)
            return SpecBatchBuilder(replica, self.victim_key, token_budget, seq_budget)
        return BatchBuilder(replica, self.victim_key, token_budget, seq_budget)


def policy_class(name: str) -> type[PolicyBase]:
    return POLICIES.get(name)


def make_policy(name: str, params: Any, engine: EngineConfig, replica_id: int = 0) -> PolicyBase:
    """Policy ``name`` for replica ``replica_id``, with ``params`` its typed ``Params`` (None: the defaults).
    Nothing is parsed here: a config's parameters were typed once, when it was made (``ReplayConfig``)."""
    cls = policy_class(name)
    return cls(params_for(cls, params), engine, replica_id)


def policy_names() -> list[str]:
    return POLICIES.names()


__all__ = ["POLICIES", "NoParams", "Policy", "PolicyBase", "ReadsRunning", "make_policy", "policy_class",
           "policy_names"]
