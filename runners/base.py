"""The runner seam: a runner turns one iteration's batch into a duration (by a model, or by running it).

The engine hands a runner a `StepPlan` per iteration. Cost models price its `StepShape` (counts
only); a real runner (torch) executes its items against the KV blocks the engine assigned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from servelab.common.registry import Registry

if TYPE_CHECKING:
    from servelab.replay.request import Request


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
    items: tuple[StepItem, ...] = ()


@runtime_checkable
class Runner(Protocol):
    """Prices (or executes) iterations.

    ``decode_affine(n)`` returns ``(a, b)`` such that a pure-decode iteration of ``n`` requests
    reading ``C`` KV tokens in total takes exactly ``a + b * C`` seconds, or None when the
    runner cannot promise that (a real GPU): the engine then never advances several identical
    decode iterations at once.
    """

    name: str

    def step_time(self, plan: StepPlan) -> float: ...

    def decode_affine(self, num_seqs: int) -> tuple[float, float] | None: ...

    def describe(self) -> dict: ...


# Factories take the parsed "name:key=value,..." parameters (strings) and return a Runner.
RUNNERS: Registry = Registry("runner")


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


def make_runner(spec: str, **context) -> Runner:
    """Build a runner from a spec string; ``context`` carries model/gpu/tp defaults from the CLI."""
    import servelab.runners.linear  # noqa: F401  (registers)

    for optional in ("servelab.runners.roofline", "servelab.runners.fitted", "servelab.runners.torch_runner"):
        try:
            __import__(optional)
        except ModuleNotFoundError as err:
            if err.name != optional:
                raise
    name, params = parse_spec(spec)
    return RUNNERS.get(name)(params, **context)
