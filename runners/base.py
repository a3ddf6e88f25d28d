"""The runner seam: a runner turns one iteration's batch into a duration (by a model, or by running it).

The engine hands a runner a `StepPlan` per iteration. Cost models price its `StepShape` (counts
only); a real runner (torch) executes its items against the KV blocks the engine assigned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from servelab.replay.core.plugins import RUNNERS
from servelab.replay.core.protocols import BlockAllocator, Runner, StepItem, StepPlan, StepShape
from servelab.replay.core.runner_spec import RunnerSpec, runner_spec


class RunnerBase:
    """The Runner protocol's defaults for a cost model: no model known (so no KV capacity or size),
    no block tables. A runner that knows its model overrides ``kv_capacity_tokens`` (a method) and
    ``kv_bytes_per_token``; one that executes batches sets ``needs_block_tables`` and ``make_allocator``."""

    __slots__ = ()
    needs_block_tables: ClassVar[bool] = False
    kv_bytes_per_token: ClassVar[int | None] = None
    kv_capacity_tokens: ClassVar = None

    def make_allocator(self, replica_id: int, num_blocks: int) -> BlockAllocator | None:
        return None

    # Multi-LoRA (replay/core/lora.py): a runner that knows its model gives an adapter's parameters per unit
    # of rank (its size) and may price the adapters' kernels; one that does not cannot serve LoRA.
    lora_params_per_rank: ClassVar[int | None] = None
    lora_dtype_bytes: ClassVar[int] = 2

    def lora_step_s(self, rank_tokens: int, ranks: list[int]) -> float:
        """Seconds the LoRA shrink/expand kernels add to an iteration (0: not priced by this runner)."""
        return 0.0


# A runner is one file in this package registering its typed ``Params`` (a frozen dataclass whose
# ``build(**context)`` makes the runner) with ``@RUNNERS.register("name")``; a spec string is typed into
# them once, at the edge (replay/core/runner_spec.py: ``RunnerSpec``). A replay imports only the runner
# module it names (the others bring numpy, pyarrow or torch's layout code): common/registry.py. The
# registry sits with the Protocols (replay/core/plugins.py), so that a replay's config types a spec.


def picker(params: Any, context: dict) -> Callable[[str, Any], Any]:
    """``pick(key, default)``: the typed spec's value for ``key`` (a ``Params`` field, None when the spec
    leaves it out), else the replay's (``context``: the command line's or config's model/GPU/TP..., when
    not None), else ``default``: spec values win over the context."""

    def pick(key: str, default: Any) -> Any:
        value = getattr(params, key)
        if value is None:
            value = context.get(key)
        return value if value is not None else default

    return pick


def make_runner(spec: "RunnerSpec | str", **context) -> Runner:
    """Build the runner ``spec`` names: a `RunnerSpec` typed at the edge (a config's ``runner``), or a
    string, typed here once (``servelab profile --runner SPEC``, Python callers).
    ``context`` carries the model/GPU/TP... defaults for the fields the spec leaves out."""
    return runner_spec(spec).params.build(**context)


__all__ = ["RUNNERS", "BlockAllocator", "Runner", "RunnerBase", "RunnerSpec", "StepItem", "StepPlan", "StepShape",
           "make_runner", "picker", "runner_spec"]
