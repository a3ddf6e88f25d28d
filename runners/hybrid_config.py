"""Read which layers of a Hugging Face ``config.json`` attend how: sliding-window, full, linear-attention or state-space.

The fields vLLM and transformers read, by family:

- ``layer_types`` (Gemma 3, gpt-oss, Qwen3-Next, Qwen3.5): one name per layer, ``sliding_attention``,
  ``full_attention``, ``linear_attention`` (Gated DeltaNet) or ``mamba``;
- ``sliding_window_pattern`` (older Gemma 3 configs): every pattern-th layer is full, the others slide;
- ``model_type`` gemma2: even layers slide, odd ones are full;
- ``full_attention_interval`` (Qwen3-Next without ``layer_types``): every interval-th layer is full
  attention, the others linear attention;
- ``hybrid_override_pattern`` (Nemotron-H): one letter per layer, ``M`` Mamba-2, ``*`` attention,
  ``-`` MLP only (no KV, no state: a layer holds a mixer or an MLP, never both);
- ``attn_layer_period`` / ``attn_layer_offset`` (Jamba): layer i attends when i % period == offset,
  the others are Mamba layers;
- ``sliding_window`` alone (Mistral style): every layer slides, unless ``use_sliding_window`` is false
  (Qwen2) or the window is no shorter than ``max_position_embeddings`` (then it never slides).

A state layer's bytes per sequence: Gated DeltaNet keeps a convolution state of ``(2 x key heads x
key dim + value heads x value dim) x (kernel - 1)`` values and a recurrent state of ``value heads x
key dim x value dim`` (in ``mamba_ssm_dtype`` when the config names one, else the model dtype, as
vLLM's ``mamba_ssm_cache_dtype=auto``); a Mamba (Jamba) layer ``d_inner x (d_conv - 1)`` plus
``d_inner x d_state`` with ``d_inner = mamba_expand x hidden_size``; a Mamba-2 (Nemotron-H) layer
``(heads x head dim + 2 x groups x d_state) x (conv kernel - 1)`` plus ``heads x head dim x d_state``
(vLLM ``mamba2_state_shape``).
"""

from __future__ import annotations

SLIDING = ("sliding_attention", "sliding", "local_attention", "local")
FULL = ("full_attention", "attention", "global_attention", "global")
STATE = ("linear_attention", "mamba", "mamba2")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class HybridConfigError(ValueError):
    """A config field that cannot be read; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _kinds(cfg: dict, layers: int) -> tuple[int, int] | None:
    """(sliding layers, state layers), or None when every layer attends to every token."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise HybridConfigError("layer_types", f"has {len(types)} entries for {layers} layers (num_hidden_layers)")
        unknown = sorted({str(t) for t in types} - set(SLIDING + FULL + STATE))
        if unknown:
            raise HybridConfigError("layer_types", f"unknown layer type '{unknown[0]}' (known: "
                                                   f"{', '.join(SLIDING[:1] + FULL[:1] + STATE)})")
        return sum(t in SLIDING for t in types), sum(t in STATE for t in types)
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:
        mamba, _, _ = _pattern(str(pattern), layers)
        return 0, mamba
    window = cfg.get("sliding_window")
    pattern = cfg.get("sliding_window_pattern")
    if window and pattern:
        pattern = int(pattern)
        if pattern < 1:
            raise HybridConfigError("sliding_window_pattern", f"must be >= 1, got {pattern}")
        return sum(1 for i in range(layers) if (i + 1) % pattern), 0
    if window and cfg.get("model_type") == "gemma2":
        return sum(1 for i in range(layers) if i % 2 == 0), 0
    interval = cfg.get("full_attention_interval")
    if interval:
        return 0, sum(1 for i in range(layers) if (i + 1) % int(interval))
    period = cfg.get("attn_layer_period")
    if period:
        offset = int(cfg.get("attn_layer_offset") or 0)
        return 0, sum(1 for i in range(layers) if i % int(period) != offset)
    longest = cfg.get("max_position_embeddings")
    if window and cfg.get("use_sliding_window", True) is not False and not (longest and int(window) >= int(longest)):
        return layers, 0
    return None


def _pattern(pattern: str, layers: int) -> tuple[int, int, int]:
    """Nemotron-H's ``hybrid_override_pattern``: (Mamba-2 'M', attention '*', MLP-only '-') layers."""
    if len(pattern) != layers:
        raise HybridConfigError("hybrid_override_pattern", f"has {len(pattern)} layers for {layers} (num_hidden_layers)")
    unknown = sorted(set(pattern) - set("M*-"))
    if unknown:
        raise HybridConfigError("hybrid_override_pattern", f"layer '{unknown[0]}' is not modelled (known: M Mamba-2, "
                                                           "* attention, - MLP; E mixture-of-experts is not)")
    return pattern.count("M"), pattern.count("*"), pattern.count("-")


def _state_bytes(cfg: dict, dtype_bytes: int) -> int:
    """One state layer's state per sequence, whole model."""
    ssm_bytes = DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype") or ""), dtype_bytes)
    if cfg.get("linear_num_value_heads"):  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
        try:
            nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
            nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
            kernel = int(cfg["linear_conv_kernel_dim"])
        except KeyError as err:
            raise HybridConfigError(str(err.args[0]), "field missing (linear-attention state)") from None
        return (2 * nk * dk + nv * dv) * (kernel - 1) * dtype_bytes + nv * dk * dv * ssm_bytes
    if cfg.get("mamba_num_heads"):  # Mamba-2 (Nemotron-H), as vLLM's mamba2_state_shape
        try:
            heads, head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
            d_state = int(cfg["ssm_state_size"])
        except KeyError as err:
            raise HybridConfigError(str(err.args[0]), "field missing (Mamba-2 state)") from None
        groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1)
        kernel = int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4)
        d_inner = heads * head_dim
        return (d_inner + 2 * groups * d_state) * (kernel - 1) * dtype_bytes + heads * head_dim * d_state * ssm_bytes
    if cfg.get("mamba_d_state"):  # Mamba (Jamba)
        d_inner = int(cfg.get("mamba_expand") or 2) * int(cfg["hidden_size"])
        return d_inner * (int(cfg.get("mamba_d_conv") or 4) - 1) * dtype_bytes + d_inner * int(cfg["mamba_d_state"]) * ssm_bytes
    raise HybridConfigError("layer_types", "state layers without a known state shape (linear_num_value_heads, "
                                           "mamba_d_state)")


def hybrid_fields(cfg: dict, layers: int, dtype_bytes: int) -> dict:
    """The ModelPreset fields of a config's hybrid attention ({} for a model without any)."""
    kinds = _kinds(cfg, layers)
    if kinds is None:
        return {}
    sliding, state = kinds
    fields: dict = {}
    if sliding:
        window = cfg.get("sliding_window")
        if not window:
            raise HybridConfigError("sliding_window", "field missing (the config has sliding-window layers)")
        fields.update(sliding_window=int(window), sliding_layers=sliding)
    if state:
        fields.update(state_layers=state, state_bytes=_state_bytes(cfg, dtype_bytes))
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:  # Nemotron-H: a layer is a mixer (Mamba-2 or attention) or an MLP, never both
        _, _, mlp_only = _pattern(str(pattern), layers)
        fields["mlp_only_layers"] = mlp_only
        if str(cfg.get("mlp_hidden_act") or "") == "relu2":  # squared ReLU: up and down, no gate
            fields["gated_mlp"] = False
    return fields


__all__ = ["HybridConfigError", "hybrid_fields"]
