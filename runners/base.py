"""The runner seam: a runner turns one iteration's batch into a duration (by a model, or by running it).

The engine hands a runner a `StepPlan` per iteration. Cost models price its `StepShape` (counts
only); a real runner (torch) executes its items against the KV blocks the engine assigned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from servelab.common.registry import Registry
from servelab.replay.core.protocols import BlockAllocator, Runner, StepItem, StepPlan, StepShape


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


# Factories take the parsed "name:key=value,..." parameters (strings) and return a Runner. A runner is
# one file in this package registering its factory with ``@RUNNERS.register("name")``; a replay imports
# only the one it names (the others bring numpy, pyarrow or torch's layout code): common/registry.py.
RUNNERS: Registry = Registry("runner", package="servelab.runners")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"linear:base=1,prefill_token=0.25"`` into ``("linear", {"base": "1", ...})``.

    A value without ``=`` after the name is kept under the key ``""`` (``fitted:model.json``).
    """
    from servelab.common.errors import ServelabError

    name, _, rest = spec.partition(":")
    params: dict[str, str] = {}
    if rest:
        for part in rest.split(","):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq:
                if "" in params:
                    raise ServelabError(f"runner spec '{spec}': more than one positional value")
                params[""] = key
            else:
                params[key.strip()] = value.strip()
    return name.strip(), params


def spec_picker(runner: str, params: dict[str, str], known: tuple[str, ...], context: dict) -> Callable[[str, Any], Any]:
    """Refuse a runner spec's parameters outside ``known`` (naming the first, sorted, and the known
    ones), then return ``pick(key, default)``: the spec's value for ``key``, else the CLI context's
    (when not None), else ``default`` (spec values win over the context)."""
    from servelab.common.errors import ServelabError

    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ServelabError(f"runner '{runner}': unknown parameter '{unknown[0]}' (parameters: {', '.join(known)})")

    def pick(key: str, default: Any) -> Any:
        if key in params:
            return params[key]
        value = context.get(key)
        return value if value is not None else default

    return pick


def make_runner(spec: str, **context) -> Runner:
    """Build a runner from a spec string; ``context`` carries model/gpu/tp defaults from the CLI."""
    name, params = parse_spec(spec)
    return RUNNERS.get(name)(params, **context)


__all__ = ["RUNNERS", "BlockAllocator", "Runner", "RunnerBase", "StepItem", "StepPlan", "StepShape",
           "make_runner", "parse_spec", "spec_picker"]
