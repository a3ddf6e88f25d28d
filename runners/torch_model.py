"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) that runs one mixed batch per call.

One ``forward`` computes every new token of an iteration — prefill chunks on top of their cached
context and single decode tokens alike — against the paged KV cache (``runners/paged_kv.py``).
``forward_dense`` is the plain, cache-free causal forward of one sequence, kept as the reference
the paged path must reproduce. Weights are seeded random (same timing as trained ones) or loaded
from local safetensors with Hugging Face Llama names.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from servelab.common.errors import InputError, ServelabError
from servelab.runners.paged_kv import PagedKVCache, StepLayout
from servelab.runners.presets import DecoderShape

# Llama 3.1's frequency-dependent RoPE stretch: (factor, low_freq_factor, high_freq_factor, original context)
LLAMA3_ROPE_SCALING = (8.0, 1.0, 4.0, 8192)


@dataclass(frozen=True, slots=True)
class ModelArgs(DecoderShape):
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on the q, k, v projections
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size"):
            if getattr(self, key) < 1:
                raise ServelabError(f"model '{self.name}': {key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ServelabError(f"model '{self.name}': num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ServelabError(f"model '{self.name}': head_dim must be even (RoPE rotates pairs)")

    @property
    def num_params(self) -> int:
        return self._count_params(3, self.qkv_bias)  # SwiGLU: gate, up and down

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """A shape from the shared preset table (``runners/presets.py``) plus its RoPE/norm details."""
        from servelab.runners.presets import get_model

        preset = get_model(name)
        extra = ARCH_EXTRAS.get(preset.name, {})
        return cls(
            name=preset.name, num_layers=preset.num_layers, hidden_size=preset.hidden_size,
            num_heads=preset.num_heads, num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim,
            ffn_size=preset.ffn_size, vocab_size=preset.vocab_size, tied_embeddings=preset.tied_embeddings, **extra,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "hf") -> "ModelArgs":
        """From a Hugging Face ``config.json`` of a Llama/Qwen2/Mistral model."""
        heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            rope_scaling = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        elif scaling:
            raise ServelabError(f"model '{name}': RoPE scaling {scaling} is not supported (only llama3)")
        else:
            rope_scaling = None
        return cls(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"], rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=rope_scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), qkv_bias=cfg.get("model_type") == "qwen2",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


# What the shared shape table leaves out (values from each model's config.json).
ARCH_EXTRAS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING),
    "llama-3.1-70b": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING),
    "qwen2.5-7b": dict(rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen2.5-32b": dict(rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen2.5-72b": dict(rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    "mistral-7b": dict(rope_theta=1e6),
}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling is not None:  # Llama 3.1: slow down low frequencies, keep high ones, blend between
        factor, low, high, original = args.rope_scaling
        wavelen = 2 * math.pi / inv
        smooth = ((original / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > original / low, inv / factor, torch.where(wavelen < original / high, inv, blended))
    return inv.float()


def _flash_op():
    return torch.ops.aten._flash_attention_forward


@functools.cache
def _flash_args() -> frozenset[str]:
    try:
        return frozenset(a.name for a in _flash_op().default._schema.arguments)
    except (AttributeError, RuntimeError):
        return frozenset()


def varlen_api() -> str | None:
    """What this torch's FlashAttention varlen op takes: "paged" (block tables), "packed" (packed keys
    only), or None. The op underneath ``torch.nn.attention.varlen`` is used directly, so the
    wrapper's changing keywords do not matter; its schema says whether it takes block tables."""
    args = _flash_args()
    if not {"cum_seq_q", "cum_seq_k", "is_causal"} <= args:
        return None
    return "paged" if {"block_table", "seqused_k"} <= args else "packed"


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, block_table=None):
    """FlashAttention over packed variable-length queries (CUDA only), causal aligned to each key end.

    ``block_table`` given: ``k``/``v`` are the block pools; else packed keys ``[sum ctx, kv_heads, D]``.
    Grouped KV heads are native to FlashAttention. Tests hand the model a CPU reference with the same
    semantics instead (``Transformer.varlen_kernel``).
    """
    kw: dict[str, Any] = {}
    if block_table is not None:
        if varlen_api() != "paged":
            raise ServelabError(f"attention=paged needs FlashAttention with block tables (torch {torch.__version__} has none)")
        kw = {"seqused_k": (cu_k[1:] - cu_k[:-1]).int(), "block_table": block_table}
    return _flash_op()(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kw)[0]


def _varlen_math(q, k, v, cu_q, cu_k, block_table=None):
    # The semantics varlen_attention promises, one sequence at a time (for probe_varlen only).
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[-2]
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if block_table is not None:
            keys, values = (t[block_table[b].long()].flatten(0, 1)[: k1 - k0] for t in (k, v))
        else:
            keys, values = k[k0:k1], v[k0:k1]
        allowed = torch.arange(k1 - k0, device=q.device)[None, :] <= torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1).float(), keys.transpose(0, 1).float(),
                                           values.transpose(0, 1).float(), attn_mask=allowed)
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


def probe_varlen(args: ModelArgs, dtype: torch.dtype, device: str) -> dict[str, str | None]:
    """Try FlashAttention varlen on this device with this model's head layout: ``{"packed": err, "paged": err}``
    (None = works and matches the reference, including causal alignment of a chunk after cached keys)."""
    result: dict[str, str | None] = {"packed": "torch has no varlen_attn", "paged": "varlen_attn takes no block tables"}
    api = varlen_api()
    if api is None:
        return result
    gen = torch.Generator(device=device).manual_seed(0)
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)  # a 3-token chunk after 4 cached keys; a decode
    cu_k = torch.tensor([0, 7, 12], dtype=torch.int32, device=device)
    # q as the forward passes it: the head slice of a wider rotated q|k tensor (not contiguous)
    q = torch.randn(4, h + kvh, d, generator=gen, device=device).to(dtype)[:, :h]
    k, v = (torch.randn(12, kvh, d, generator=gen, device=device).to(dtype) for _ in range(2))

    def check(name: str, fn, expected) -> None:
        try:
            got = fn()
            err = (got.float() - expected.float()).abs().max().item()
            result[name] = None if err < 2e-2 else f"differs from the reference by {err:.3g} (causal alignment?)"
        except Exception as exc:  # any failure means: do not use this path
            result[name] = f"{type(exc).__name__}: {exc}"

    check("packed", lambda: varlen_attention(q, k, v, cu_q, cu_k, 3, 7), _varlen_math(q, k, v, cu_q, cu_k))
    if api == "paged":
        pool_k, pool_v = (torch.zeros(3, 256, kvh, d, dtype=dtype, device=device) for _ in range(2))
        table = torch.tensor([[2], [0]], dtype=torch.int32, device=device)  # non-trivial block ids
        pool_k[2, :7], pool_v[2, :7], pool_k[0, :5], pool_v[0, :5] = k[:7], v[:7], k[7:], v[7:]
        check("paged", lambda: varlen_attention(q, pool_k, pool_v, cu_q, cu_k, 3, 7, table),
              _varlen_math(q, pool_k, pool_v, cu_q, cu_k, table))
    return result


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D] (Hugging Face's rotate-half layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.wqkv = nn.Linear(h, args.q_size + 2 * args.kv_size, bias=args.qkv_bias)  # q, k, v fused: one GEMM
        self.wo = nn.Linear(args.q_size, h, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(h))
        self.w13 = nn.Linear(h, 2 * args.ffn_size, bias=False)  # gate and up fused
        self.w2 = nn.Linear(args.ffn_size, h, bias=False)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tied_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._rope_cache: tuple[torch.Tensor, ...] | None = None
        self._rope_retired: list[tuple[torch.Tensor, ...]] = []  # captured CUDA graphs may still read old tables
        self.varlen_kernel = varlen_attention  # replaceable: the CPU tests run the GPU paths through a reference

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, args: ModelArgs, *, device: str, dtype: torch.dtype, seed: int, weights: str | None = None):
        """Allocate directly on ``device`` (no throwaway init), then fill seeded random or loaded weights."""
        with torch.device("meta"):
            model = cls(args).to(dtype)
        model = model.to_empty(device=device)
        if weights is None:
            model.init_random(seed)
        else:
            model.load_hf(weights)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        # Generated on the model's device so an 8B model initialises in seconds; fan-in scaling keeps
        # activations finite through every layer (values never change the timing, NaNs could).
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 1.0 if name.startswith("embed") else p.shape[-1] ** -0.5
                p.normal_(0.0, std, generator=gen)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face Llama names (the inverse of ``load_hf``)."""
        a = self.args
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = layer.wqkv.weight.split([a.q_size, a.kv_size, a.kv_size])
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.wo.weight,
                        p + "input_layernorm.weight": layer.attn_norm,
                        p + "post_attention_layernorm.weight": layer.ffn_norm})
            if layer.wqkv.bias is not None:
                qb, kb, vb = layer.wqkv.bias.split([a.q_size, a.kv_size, a.kv_size])
                out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                            p + "self_attn.v_proj.bias": vb})
            gate, up = layer.w13.weight.split([a.ffn_size, a.ffn_size])
            out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": layer.w2.weight})
        return out  # views sharing the parameters' storage (clone before saving them)

    @torch.no_grad()
    def load_hf(self, path: str | Path) -> None:
        """Copy weights from ``path`` (a .safetensors file or a folder of shards) into this model."""
        from safetensors import safe_open

        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise InputError(path, "no .safetensors weights found")
        targets = self.hf_state()  # row-slices of our fused parameters: copying into them fills the model
        if self.lm_head is None:
            targets.pop("lm_head.weight", None)
        seen: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key not in targets:
                        if key == "lm_head.weight" and self.lm_head is None:
                            continue  # tied: the embedding is the head
                        if key.endswith("rotary_emb.inv_freq"):
                            continue
                        raise InputError(file, f"unexpected tensor for model '{self.args.name}'", column=key)
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(targets[key].shape):
                        raise InputError(file, f"shape {tuple(tensor.shape)} != expected {tuple(targets[key].shape)}",
                                         column=key)
                    targets[key].copy_(tensor)
                    seen.add(key)
        missing = sorted(set(targets) - seen)
        if missing:
            raise InputError(files[0] if len(files) == 1 else path, f"missing {len(missing)} tensors", column=missing[0])

    # ---- forward ------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and sign-folded sin rows ``[T, 1, D]`` (model dtype) for ``positions``.

        Tables grow by doubling, so a step only gathers rows. ``sin_folded = cat(-sin_half, sin_half)``
        turns rotate-half into a roll: ``rotate_half(x) * sin == roll(x, D/2) * sin_folded``.
        """
        device, dtype = self.embed.weight.device, self.embed.weight.dtype
        if self._rope_cache is None or self._rope_cache[0].shape[0] <= max_position:
            size = 4096
            while size <= max_position:
                size *= 2
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), rope_inv_freq(self.args))
            emb = torch.cat((freqs, freqs), dim=-1)
            folded = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
            if self._rope_cache is not None:
                self._rope_retired.append(self._rope_cache)
            self._rope_cache = tuple(t.to(device, dtype) for t in (emb.cos(), emb.sin(), folded))
        return tuple(t[positions].unsqueeze(1) for t in self._rope_cache)

    def _project_qkv(self, layer: Block, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, kvH, D]`` with RoPE applied to q and k in one pass (3 kernels)."""
        a = self.args
        h = F.rms_norm(x, (a.hidden_size,), layer.attn_norm, a.norm_eps)
        qkv = layer.wqkv(h).view(x.shape[0], a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        qk = qkv[:, : a.num_heads + a.num_kv_heads]
        cos, _sin, folded = rope
        rotated = (qk * cos).addcmul_(qk.roll(a.head_dim // 2, dims=-1), folded)
        return rotated[:, : a.num_heads], rotated[:, a.num_heads :], qkv[:, a.num_heads + a.num_kv_heads :]

    def _finish_layer(self, layer: Block, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        a = self.args
        x = x + layer.wo(attn)
        h = F.rms_norm(x, (a.hidden_size,), layer.ffn_norm, a.norm_eps)
        gate, up = layer.w13(h).chunk(2, dim=-1)
        return x + layer.w2(F.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(hidden, (self.args.hidden_size,), self.norm, self.args.norm_eps)
        return F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)

    @torch.no_grad()
    def forward(self, step: StepLayout, kv: PagedKVCache) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's new tokens; their K/V land in ``kv`` first."""
        rope = self._rope(step.positions, step.max_k)
        x = self.embed(step.token_ids)
        groups = self.args.num_heads // self.args.num_kv_heads
        masks = _sdpa_masks(step, kv.block_size, groups) if step.kind == "sdpa" else None
        key_slots = _packed_key_slots(step, kv.block_size) if step.kind == "gather" else None
        for i, layer in enumerate(self.layers):
            q, k, v = self._project_qkv(layer, x, rope)
            kv.write(i, step.slots, k, v)
            if step.kind == "sdpa":
                attn = self._attend_sdpa(i, q, step, kv, masks)
            elif step.kind == "paged":
                attn = self.varlen_kernel(q, kv.k[i], kv.v[i], step.cu_q, step.cu_k, step.max_q, step.max_k,
                                        step.block_table)
            else:  # gather: every item's keys copied end to end, one packed varlen batch
                keys = kv.k[i].view(-1, *k.shape[1:])[key_slots]
                values = kv.v[i].view(-1, *v.shape[1:])[key_slots]
                attn = self.varlen_kernel(q, keys, values, step.cu_q, step.cu_k, step.max_q, step.max_k)
            x = self._finish_layer(layer, x, attn.reshape(x.shape[0], -1))
        return x

    def _attend_sdpa(self, layer_idx: int, q: torch.Tensor, step: StepLayout, kv: PagedKVCache, masks) -> torch.Tensor:
        # GQA without copying K/V per query head: the G query heads of a KV head become G query rows.
        a = self.args
        g = a.num_heads // a.num_kv_heads
        out = torch.empty_like(q).view(q.shape[0], -1)
        if step.dec_rows is not None:
            keys, values = kv.gather(layer_idx, step.dec_table)  # [Bd, L, kvH, D]
            qd = q[step.dec_rows].view(-1, a.num_kv_heads, g, a.head_dim)
            o = F.scaled_dot_product_attention(qd, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=masks[0])
            out[step.dec_rows] = o.reshape(qd.shape[0], -1)
        if step.pf_gather is not None:
            bp, qp = step.pf_qpos.shape
            keys, values = kv.gather(layer_idx, step.pf_table)
            qp_ = q[step.pf_gather].view(bp, qp, a.num_kv_heads, g, a.head_dim).permute(0, 2, 3, 1, 4)
            o = F.scaled_dot_product_attention(qp_.reshape(bp, a.num_kv_heads, g * qp, a.head_dim),
                                               keys.transpose(1, 2), values.transpose(1, 2), attn_mask=masks[1])
            o = o.view(bp, a.num_kv_heads, g, qp, a.head_dim).permute(0, 3, 1, 2, 4).reshape(bp * qp, -1)
            out[step.pf_dst] = o[step.pf_src]
        return out

    @torch.no_grad()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference: logits ``[L, vocab]`` of one whole sequence, written the plain Hugging Face way —
        no cache, separate projections, rotate-half RoPE, causal SDPA over repeated K/V heads."""
        a = self.args
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        cos, sin, _ = self._rope(positions, int(token_ids.shape[0]))
        x = self.embed(token_ids)
        for layer in self.layers:
            h = F.rms_norm(x, (a.hidden_size,), layer.attn_norm, a.norm_eps)
            q, k, v = layer.wqkv(h).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = apply_rope(q.view(-1, a.num_heads, a.head_dim), cos, sin)
            k = apply_rope(k.view(-1, a.num_kv_heads, a.head_dim), cos, sin)
            v = v.view(-1, a.num_kv_heads, a.head_dim)
            g = a.num_heads // a.num_kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = self._finish_layer(layer, x, o.transpose(0, 1).reshape(x.shape[0], -1))
        return self.logits(x)


def _sdpa_masks(step: StepLayout, block_size: int, groups: int):
    # Built once per step, shared by every layer: boolean "may attend" masks over gathered keys.
    dec_mask = pf_mask = None
    if step.dec_rows is not None:
        keys = torch.arange(step.dec_table.shape[1] * block_size, device=step.dec_ctx.device)
        dec_mask = (keys[None, :] < step.dec_ctx[:, None])[:, None, None, :]  # [Bd, 1, 1, L]
    if step.pf_gather is not None:
        bp, qp = step.pf_qpos.shape
        keys = torch.arange(step.pf_table.shape[1] * block_size, device=step.pf_qpos.device)
        causal = keys[None, None, :] <= step.pf_qpos[:, :, None]  # [Bp, Qp, L]
        # query rows are ordered (group, position) to match the GQA folding in _attend_sdpa
        pf_mask = causal[:, None, None].expand(bp, 1, groups, qp, keys.shape[0]).reshape(bp, 1, groups * qp, -1)
    return dec_mask, pf_mask


def _packed_key_slots(step: StepLayout, block_size: int) -> torch.Tensor:
    # Slot of every key of every item, items end to end: computed on the device once per step, so
    # the host ships only block tables however long the contexts are.
    device = step.cu_k.device
    lens = (step.cu_k[1:] - step.cu_k[:-1]).long()
    item = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=step.total_k)
    local = torch.arange(step.total_k, device=device) - step.cu_k[:-1].long()[item]
    return step.block_table.long()[item, local // block_size] * block_size + local % block_size


def load_hf_config(path: str | Path) -> dict | None:
    """The ``config.json`` beside local weights, if there is one."""
    path = Path(path)
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as err:
        raise InputError(cfg, f"not valid JSON ({err.msg})", row=err.lineno) from None
