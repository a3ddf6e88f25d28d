"""Speculative decoding's cost: the proposer's forwards plus the target verifying ``1 + k`` tokens per decode.

`SpeculativeRunner` wraps any pricing runner (the *target*). A step's shape counts, besides the
usual prefill and decode terms, ``spec_tokens``: the drafts its decodes verify (replay/core/speculative.py
decides them). The step then costs

- **verification**: the target prices each decode as a chunk of ``1 + d`` tokens on top of its KV
  (vLLM verifies drafts with the prefill attention path), i.e. the decodes move into the prefill
  terms of the shape: ``n + D`` tokens, context ``C + D``, causal pairs
  ``(1 + d)(C - n) + n (1 + d)(2 + d) / 2`` with ``d = D / n`` (``n`` decodes reading ``C`` KV tokens,
  ``D`` drafts in all);
- **proposing** the next drafts, by method:

  - ``draft_model``: a smaller model (``spec_draft_model``, default ``llama-3.2-1b``) runs over the
    step's tokens once (prefill chunks too, in every step: it keeps its own KV), then ``d - 1`` more
    single-token decode forwards, each priced by a roofline of that model on the target's GPU;
  - ``eagle`` / ``eagle3`` / ``mtp``: a head of one decoder layer of the target's shape (with the
    target's embedding and LM head, shared) does the same ``d`` forwards;
  - ``ngram``: prompt lookup on the CPU, priced 0.

  The proposer's forwards add no CPU overhead of their own (the target's step already counts the
  step's scheduling and launch overhead).

Memory: the proposer's weights (a draft model's, or one layer for a head) leave less room for KV,
and its layers keep KV for every token too, so ``kv_bytes_per_token`` grows by the proposer's and
the capacity shrinks accordingly. ``decode_affine`` is None: with speculation every step is priced
alone (each decode advances by a drawn number of tokens).
"""

from __future__ import annotations

import math
from dataclasses import replace

from servelab.common.errors import ServelabError
from servelab.runners.base import RunnerBase, StepPlan, StepShape

DEFAULT_DRAFT_MODEL = "llama-3.2-1b"


class SpeculativeRunner(RunnerBase):
    """The target runner's prices with speculation: ``method``, ``k`` drafts per decode, ``proposer``
    (a runner pricing the proposer's forwards, None for n-gram). Anything else (``model``, ``gpu``,
    ...) is the target's."""

    __slots__ = ("target", "method", "k", "proposer", "extra_weight_bytes_per_gpu", "extra_kv_bytes_per_token",
                 "name")

    def __init__(self, target, method: str, k: int, proposer=None, extra_weight_bytes_per_gpu: float = 0.0,
                 extra_kv_bytes_per_token: int = 0):
        if target.needs_block_tables:
            raise ServelabError(f"speculative decoding is priced around a cost model; runner '{target.name}' executes "
                                "batches (use roofline, linear or fitted)")
        self.target = target
        self.method = method
        self.k = k
        self.proposer = proposer
        self.extra_weight_bytes_per_gpu = extra_weight_bytes_per_gpu
        self.extra_kv_bytes_per_token = extra_kv_bytes_per_token
        self.name = f"{target.name}+{method}"

    def __getattr__(self, name: str):  # the target's model, gpu, ... (not called for the slots above)
        if name.startswith("__") or name == "target":
            raise AttributeError(name)
        return getattr(self.target, name)

    def __reduce__(self):
        return (type(self), (self.target, self.method, self.k, self.proposer, self.extra_weight_bytes_per_gpu,
                             self.extra_kv_bytes_per_token))

    # -- pricing ------------------------------------------------------------------------------------
    @staticmethod
    def verification_shape(s: StepShape) -> StepShape:
        """The shape the target prices: every decode as a chunk of its token plus its drafts."""
        n, drafts = s.decode_seqs, s.spec_tokens
        if not n:
            return s._replace(spec_tokens=0)
        per = 1.0 + drafts / n  # tokens each decode verifies (all but a budget-trimmed one have 1 + k)
        ctx = s.decode_context_tokens  # sum over decodes of (KV before + 1)
        pairs = per * (ctx - n) + n * per * (per + 1.0) / 2.0
        return StepShape(s.prefill_tokens + n + drafts, s.prefill_seqs + n, s.prefill_context_tokens + ctx + drafts,
                         s.prefill_attention_pairs + round(pairs), 0, 0, 0)

    def proposer_s(self, s: StepShape) -> float:
        """Seconds the proposer takes after the step (0: n-gram): one forward over the step's tokens
        (prefill chunks too: the draft builds its own KV, a head reads the target's hidden states),
        then one single-token forward per further draft of the decodes."""
        if self.proposer is None:
            return 0.0
        first = self.proposer.step_time(StepPlan(s._replace(spec_tokens=0)))
        n = s.decode_seqs
        forwards = -(-s.spec_tokens // n) if n else 0
        if forwards <= 1:
            return first
        a, b = self.proposer.decode_affine(n)
        ctx = s.decode_context_tokens
        return first + sum(a + b * (ctx + i * n) for i in range(1, forwards))

    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        verify = self.target.step_time(StepPlan(self.verification_shape(s), plan.items) if s.spec_tokens else plan)
        return verify + self.proposer_s(s)

    def decode_affine(self, num_seqs: int) -> None:
        return None

    # -- memory -------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int | None:
        own = self.target.kv_bytes_per_token
        return None if own is None else own + self.extra_kv_bytes_per_token

    @property
    def kv_capacity_tokens(self):
        if self.target.kv_capacity_tokens is None:
            return None
        return self._kv_capacity_tokens

    def _kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """The target's KV bytes less the proposer's weights, over the bytes per token of both."""
        tokens = self.target.kv_capacity_tokens(gpu_memory_utilization)
        own = self.target.kv_bytes_per_token
        if own is None or not (self.extra_kv_bytes_per_token or self.extra_weight_bytes_per_gpu):
            return tokens
        tp = getattr(self.target, "tp", 1) * getattr(self.target, "pp", 1)
        left = tokens * own - self.extra_weight_bytes_per_gpu * tp
        if left <= 0:
            raise ServelabError(f"no room for KV cache: the {self.method} proposer's weights "
                                f"({self.extra_weight_bytes_per_gpu / 2**30:.2f} GiB per GPU) take all of it")
        return int(left // (own + self.extra_kv_bytes_per_token))

    def describe(self) -> dict:
        out = dict(self.target.describe())
        out["speculative"] = {
            "method": self.method, "num_speculative_tokens": self.k,
            "proposer": self.proposer.describe() if self.proposer is not None else None,
            "extra_weight_bytes_per_gpu": self.extra_weight_bytes_per_gpu,
            "extra_kv_bytes_per_token": self.extra_kv_bytes_per_token,
        }
        return out

    def make_allocator(self, replica_id: int, num_blocks: int):
        return None


def _one_layer_bytes(model) -> float:
    """Weight bytes of one decoder layer of ``model`` (the head's: embedding and LM head are shared)."""
    return replace(model, num_layers=2).weight_bytes - replace(model, num_layers=1).weight_bytes


def speculative_runner(target, engine) -> SpeculativeRunner:
    """Wrap ``target`` for the speculation ``engine`` (an EngineConfig with ``spec_method`` set)."""
    method, k = engine.spec_method, engine.spec_k
    if isinstance(target, SpeculativeRunner):
        return target
    if method == "ngram":
        return SpeculativeRunner(target, method, k)
    from servelab.runners.roofline import RooflineRunner

    if not isinstance(target, RooflineRunner):
        raise ServelabError(f"spec_method '{method}' is priced from the target's model and GPU: use the roofline "
                            f"runner (runner '{target.name}' knows neither), or spec_method ngram")
    model, tp = target.model, target.tp
    if method == "draft_model":
        from servelab.runners.presets import resolve_model

        draft = resolve_model(engine.spec_draft_model or DEFAULT_DRAFT_MODEL)
        draft_tp = tp if draft.num_heads % tp == 0 and draft.num_kv_heads % tp == 0 else 1
        proposer = replace(target, model=draft, tp=draft_tp, dp=1, pp=1, ep=1, cpu_overhead_scale=0.0)
        return SpeculativeRunner(target, method, k, proposer, draft.weight_bytes / draft_tp, draft.kv_bytes_per_token)
    head = replace(model, name=f"{model.name} ({method} head)", num_layers=1, dense_layers=0)
    proposer = replace(target, model=head, pp=1, cpu_overhead_scale=0.0)
    return SpeculativeRunner(target, method, k, proposer, _one_layer_bytes(model) / tp, head.kv_bytes_per_token)


__all__ = ["DEFAULT_DRAFT_MODEL", "SpeculativeRunner", "speculative_runner"]
