"""`linear`: an iteration costs a weighted sum of named batch counts (settable from the CLI).

``--runner linear:base=1,prefill_token=0.25,decode_seq=0.125`` is the teaching formula
step = 1 + prefill_tokens/4 + decodes/8, in whatever time unit the weights are (seconds here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from servelab.common.errors import ServelabError
from servelab.runners.base import RUNNERS, RunnerBase, StepPlan


@dataclass(frozen=True, slots=True)
class LinearRunner(RunnerBase):
    base: float = 0.0  # per iteration
    prefill_token: float = 0.0  # per prompt (or recomputed) token computed
    decode_seq: float = 0.0  # per decoding request
    decode_context_token: float = 0.0  # per KV token read by decodes
    prefill_attention: float = 0.0  # per causal prompt-token x context-token pair
    seq: float = 0.0  # per request in the batch
    name: str = "linear"

    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        return (
            self.base
            + self.prefill_token * s.prefill_tokens
            + self.decode_seq * s.decode_seqs
            + self.decode_context_token * s.decode_context_tokens
            + self.prefill_attention * s.prefill_attention_pairs
            + self.seq * (s.prefill_seqs + s.decode_seqs)
        )

    def decode_affine(self, num_seqs: int) -> tuple[float, float]:
        return (self.base + (self.decode_seq + self.seq) * num_seqs, self.decode_context_token)

    def describe(self) -> dict:
        return asdict(self)


TERMS = ("base", "prefill_token", "decode_seq", "decode_context_token", "prefill_attention", "seq")


@RUNNERS.register("linear")
@dataclass(frozen=True, slots=True)
class LinearParams:
    """``linear:base=0.01,prefill_token=0.0001``: the weights (None: not given, 0); at least one, each >= 0."""

    base: float | None = None
    prefill_token: float | None = None
    decode_seq: float | None = None
    decode_context_token: float | None = None
    prefill_attention: float | None = None
    seq: float | None = None

    def __post_init__(self) -> None:
        given = {key: getattr(self, key) for key in TERMS if getattr(self, key) is not None}
        if not given:
            raise ServelabError("needs at least one term, e.g. linear:base=0.01,prefill_token=0.0001")
        for key, value in given.items():
            if value < 0:
                raise ServelabError(f"term '{key}' must be >= 0, got {value}")

    def build(self, **_context) -> LinearRunner:
        return LinearRunner(**{key: getattr(self, key) for key in TERMS if getattr(self, key) is not None})
