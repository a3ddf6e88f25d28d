"""`roofline` for a hybrid-attention model: KV capacity and attention priced per layer group.

A model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral) or state layers (Qwen3-Next's
Gated DeltaNet, Jamba's Mamba) is priced as the roofline prices any model, except:

- capacity: the KV pool is laid out in layer groups as vLLM's hybrid KV cache manager lays it out
  (replay/core/kv/kv_groups.py); ``kv_capacity_tokens`` is the pool's blocks times ``block_size``, and the
  KV manager counts a request's blocks over its groups (``kv_layout``);
- attention: full-attention layers read every token of a sequence's KV; sliding-window layers read
  at most the last ``window`` of them (a decode at context t reads min(t, window); a prefill chunk of
  c tokens on p computed reads min(p + c, window - 1 + c) and computes sum_i min(p + i, window)
  query x key pairs); state layers read and write their fixed state once per sequence and step and
  compute about 4 FLOPs per state value per token (decay-and-add update, then the read-out);
- a request's context is read from the step's items (``prices_items``), so the engine takes no
  closed-form decode stretches for these models (``decode_affine`` is None): it prices every
  iteration. The linear layers are priced as the preset's attention and MLP shapes for every layer
  (a state layer's own projections are not modelled apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from servelab.common.errors import ServelabError
from servelab.replay.core.kv.kv_groups import KVLayout
from servelab.runners.base import StepPlan, StepShape
from servelab.runners.roofline import RooflineRunner, kv_memory_bytes


def window_terms(start: int, n: int, window: int) -> tuple[int, int]:
    """(KV tokens read, query x key pairs) of a sliding-window layer computing ``n`` tokens on top of
    ``start``: each query i (1..n) attends to min(start + i, window) keys."""
    first = start - window + 1
    read = start + n - (first if first > 0 else 0)
    inside = min(max(window - start, 0), n)  # queries whose window still reaches token 0
    pairs = inside * start + inside * (inside + 1) // 2 + (n - inside) * window
    return read, pairs


@dataclass(frozen=True)
class HybridRoofline(RooflineRunner):
    # the engine's tokens per KV block (vLLM --block-size); 0: vLLM's own pick, 16 or, with state
    # layers, the smallest multiple of 16 whose page holds a state
    block_size: int = 0
    prices_items: ClassVar[bool] = True
    kv_layout: KVLayout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pp != 1:
            raise ServelabError(f"runner 'roofline': pp={self.pp} with a hybrid-attention model ({self.model.name}) is "
                                "not modelled (its layer groups per pipeline stage)")
        RooflineRunner.__post_init__(self)
        kinds = self.model.layer_kinds(self.tp)
        if not self.block_size:
            object.__setattr__(self, "block_size", max(16, KVLayout.min_block_size(kinds) if kinds.state else 16))
        try:
            layout = KVLayout(kinds, self.block_size, self.activation_tokens)
        except ValueError as err:
            raise ServelabError(f"runner 'roofline': {self.model.name}: {err}") from None
        object.__setattr__(self, "kv_layout", layout)

    def __reduce__(self):
        return (_rebuild, (RooflineRunner.__reduce__(self)[1], self.block_size))

    # --- capacity ------------------------------------------------------------------------------
    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        per_gpu = kv_memory_bytes(self.model, self.gpu, self.tp, gpu_memory_utilization, self.activation_tokens,
                                  self.logit_seqs, self.non_torch_bytes, self.dp, self.pp)
        return self.kv_layout.pool_blocks(per_gpu) * self.block_size

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one pool block over the whole engine (what a swap moves): a page in each of the
        group size's layers on every GPU (MLA's latent is copied on every GPU, counted once)."""
        return self.kv_layout.block_bytes * (1 if self.model.is_mla else self.tp)

    # --- pricing -------------------------------------------------------------------------------
    def decode_affine(self, num_seqs: int):
        return None  # a sliding window's reads are not linear in the batch's total context

    def _windowed(self, plan: StepPlan) -> tuple[int, int, float]:
        """(prefill KV read, prefill pairs, decode KV read) of one sliding-window layer."""
        w, s = self.kv_layout.kinds.window, plan.shape
        if plan.items:
            p_read = p_pairs = d_read = 0
            for item in plan.items:
                req, start, n = item.request, item.start, item.num_tokens
                g = req.num_generated_tokens
                if n == 1 and g and start == req.prompt_tokens + g - 1:  # a decode (BatchSummary.account's rule)
                    d_read += start + 1 if start < w else w
                else:
                    read, pairs = window_terms(start, n, w)
                    p_read += read
                    p_pairs += pairs
            return p_read, p_pairs, d_read
        # counts only: every sequence at the batch's mean chunk and context
        p_read = p_pairs = 0
        if s.prefill_seqs:
            chunk = s.prefill_tokens // s.prefill_seqs
            start = max(s.prefill_context_tokens // s.prefill_seqs - chunk, 0)
            read, pairs = window_terms(start, chunk, w)
            p_read, p_pairs = read * s.prefill_seqs, pairs * s.prefill_seqs
        d_read = min(s.decode_context_tokens, s.decode_seqs * w)
        return p_read, p_pairs, d_read

    def state_s(self, shape: StepShape) -> float:
        """One state layer: every sequence's state read and written once; its update's FLOPs."""
        seqs = shape.prefill_seqs + shape.decode_seqs
        if seqs <= 0:
            return 0.0
        c, g, m = self.calibration, self.gpu, self.model
        state = self.kv_layout.kinds.state_bytes
        moved = 2 * state * seqs / (g.hbm_bytes_per_s * c.decode_attention_eff_memory)
        flops = 4 * state / m.dtype_bytes * (shape.prefill_tokens + shape.decode_seqs)
        compute = flops / self._rates.prefill_flops_per_s
        return c.decode_attention_latency_s + c.decode_attention_per_seq_s * seqs + max(moved, compute)

    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        tokens = s.prefill_tokens + s.decode_seqs
        if tokens <= 0:
            return 0.0
        kinds = self.kv_layout.kinds
        layer, head, all_reduce, _, _ = self._by_tokens(tokens)
        lm_head, cpu = self._by_seqs(s.prefill_seqs + s.decode_seqs)
        if self.model.mlp_only_layers:  # Nemotron-H: one row-parallel output (one all-reduce) per layer, not two
            all_reduce /= 2
        t = self.model.num_layers * (layer + all_reduce) + head + lm_head
        if not self.host_overlap:
            t += cpu  # (here, where it always was: the same sum, term by term)
        attention = kinds.full + kinds.sliding
        if kinds.full:
            t += kinds.full * self.prefill_attention_s(s)
        read_w = 0.0
        if kinds.sliding:
            p_read, p_pairs, read_w = self._windowed(plan)
            windowed = s._replace(prefill_context_tokens=p_read, prefill_attention_pairs=p_pairs)
            t += kinds.sliding * self.prefill_attention_s(windowed)
        t += attention * self._by_decodes(s.decode_seqs)
        t += self._rates.decode_s_per_kv_token / self.model.num_layers * (
            kinds.full * s.decode_context_tokens + kinds.sliding * read_w)
        if kinds.state:
            t += kinds.state * self.state_s(s)
        if self.host_overlap:  # async scheduling: a share of the host's work on the path (RooflineRunner.step_time)
            return max(t + self.host_profile.async_host_share * cpu, cpu)
        return t

    def describe(self) -> dict:
        out = RooflineRunner.describe(self)
        out["block_size"] = self.block_size
        out["kv_layout"] = self.kv_layout.describe()
        return out

    @classmethod
    def from_describe(cls, d: dict) -> HybridRoofline:
        base = RooflineRunner.from_describe({k: v for k, v in d.items() if k != "kv_layout"})
        return _rebuild(RooflineRunner.__reduce__(base)[1], int(d.get("block_size", 16)))


def _rebuild(args: tuple, block_size: int) -> HybridRoofline:
    (model, gpu, tp, calibration, cpu, name, host, act, logits, non_torch, custom, ep, dp, pp, overlap) = args
    return HybridRoofline(model, gpu, tp, calibration, cpu, name, host, act, logits, non_torch, custom, ep, dp, pp,
                          overlap, block_size=block_size)


RUNNER_CLASS = HybridRoofline  # what roofline's factory builds for a hybrid model (roofline.VARIANT_MODULES)

__all__ = ["RUNNER_CLASS", "HybridRoofline", "window_terms"]
