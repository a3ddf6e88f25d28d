"""Multimodal encoders (a vision ViT, an audio encoder) priced by the roofline on the replica's GPU.

A multimodal request's images, video frames and audio become prompt tokens of the language model
only after an encoder turns them into embeddings (vLLM runs it in the step that schedules the
request's prefill, before the language model's forward). An encoder here is a stack of transformer
layers over *patches*: ``patches_per_token`` input patches for each LLM token it emits (Qwen2.5-VL
merges 2 x 2 patches into one token: 4), followed by a projector (merger) into the LLM's hidden
size. A tiled encoder (``tile_tokens`` > 0: SigLIP, InternViT) cuts an image into tiles of that
many output tokens, each encoded as its own sequence; one of dynamic resolution (``tile_tokens`` 0:
Qwen2.5-VL) sees each image whole, with attention inside windows of ``window_patches`` patches in
all but ``full_attention_layers`` layers. Shapes come from each model's public config.json.

Cost of encoding ``T`` output tokens in sequences of ``P`` patches (``N = T x patches_per_token``
patches): per layer ``2 N (4 h^2 + m h f)`` FLOPs for the projections and MLP (m = 3 gated, 2
not) plus ``4 N w h`` for attention (w = P in full-attention layers, min(P, window) else); the
projector ``2 T x merger_params_per_token``; weights read once per call, activations in and out per
layer. Priced as ``launches x latency + max(FLOPs / (peak x eff_c), bytes / (bw x eff_m))`` at the
roofline's GEMM (``mlp_up``) calibration of the replica's GPU (docs/runners.md "Multimodal encoders").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean


@dataclass(frozen=True, slots=True)
class EncoderPreset:
    name: str
    hf_id: str  # where the shape comes from
    modality: str  # image (also video frames) | audio
    num_layers: int
    hidden_size: int
    ffn_size: int
    gated_mlp: bool
    patches_per_token: int  # encoder positions per LLM token emitted (after merging / pooling)
    tile_tokens: int = 0  # LLM tokens per tile (0: the whole image is one sequence)
    window_patches: int = 0  # window attention's span in patches (0: full attention in every layer)
    full_attention_layers: int = 0  # with windows: layers that still attend over the whole sequence
    merger_params_per_token: int = 0  # projector parameters applied per emitted token (its FLOPs / 2)
    dtype_bytes: int = 2

    @property
    def num_params(self) -> int:
        h, f = self.hidden_size, self.ffn_size
        return self.num_layers * (4 * h * h + (3 if self.gated_mlp else 2) * h * f) + self.merger_params_per_token


# Qwen2.5-VL-7B-Instruct's vision tower (vision_config): depth 32, hidden 1280, intermediate 3420 (SwiGLU),
# spatial_merge_size 2 (4 patches per token), window_size 112 px = 8 x 8 patches, fullatt_block_indexes
# [7, 15, 23, 31]; the merger: an MLP 5120 -> 5120 -> 3584 (out_hidden_size).
# Gemma-3's SigLIP-So400m tower (vision_config): 27 layers, hidden 1152, intermediate 4304 (GELU), 896 px
# images of 14 px patches (4,096) pooled to mm_tokens_per_image 256 (16 patches per token), a tile per
# pan-and-scan crop; the projector: 1152 -> 5376 (Gemma-3-27B).
# Whisper-large-v3's encoder (Qwen2-Audio's audio tower): 32 layers, d_model 1280, ffn 5120 (GELU), 1,500
# positions per 30 s pooled by 2 to 750 tokens; projector 1280 -> 4096.
ENCODERS: dict[str, EncoderPreset] = {p.name: p for p in (
    EncoderPreset("qwen2.5-vl-vit", "Qwen/Qwen2.5-VL-7B-Instruct", "image", 32, 1280, 3420, True, 4,
                  window_patches=64, full_attention_layers=4,
                  merger_params_per_token=5120 * 5120 + 5120 * 3584),
    EncoderPreset("siglip-so400m", "google/gemma-3-27b-it", "image", 27, 1152, 4304, False, 16, tile_tokens=256,
                  merger_params_per_token=1152 * 5376),
    EncoderPreset("whisper-large-v3-encoder", "Qwen/Qwen2-Audio-7B-Instruct", "audio", 32, 1280, 5120, False, 2,
                  tile_tokens=750, merger_params_per_token=1280 * 4096),
)}


def get_encoder(name: str, modality: str | None = None) -> EncoderPreset:
    if name not in ENCODERS:
        raise ServelabError(f"unknown encoder '{name}'{did_you_mean(name, ENCODERS)} (known: {', '.join(ENCODERS)})")
    preset = ENCODERS[name]
    if modality is not None and preset.modality != modality:
        raise ServelabError(f"encoder '{name}' is an {preset.modality} encoder, not an {modality} one")
    return preset


def encode_flops_bytes(preset: EncoderPreset, tokens: int) -> tuple[float, float, int]:
    """(FLOPs, bytes, kernel launches) to encode one item of ``tokens`` LLM tokens."""
    h, f, d = preset.hidden_size, preset.ffn_size, preset.dtype_bytes
    if preset.tile_tokens:
        tiles = math.ceil(tokens / preset.tile_tokens)
        seq = preset.tile_tokens * preset.patches_per_token  # patches per tile (a partial tile is padded)
        patches = tiles * seq
    else:
        patches = seq = tokens * preset.patches_per_token
    linear = 2.0 * patches * (4 * h * h + (3 if preset.gated_mlp else 2) * h * f)
    full = preset.num_layers if not preset.window_patches else preset.full_attention_layers
    window = min(seq, preset.window_patches) if preset.window_patches else seq
    attention = 4.0 * patches * h * (full * seq + (preset.num_layers - full) * window)
    flops = preset.num_layers * linear + attention + 2.0 * tokens * preset.merger_params_per_token
    activations = preset.num_layers * patches * (8 * h + 2 * f) * d  # each layer's inputs and outputs
    launches = 8 * preset.num_layers + 2  # ~8 kernels a layer (norms, QKV, attention, O, MLP), the projector
    return flops, preset.num_params * d + activations, launches


class EncoderPricer:
    """Seconds to encode one item on a replica's GPU, at its roofline calibration (``price(kind, tokens)``)."""

    __slots__ = ("encoders", "peak_flops", "hbm", "cal", "launch_latency_s")

    def __init__(self, runner, vision: str | None, audio: str | None):
        gpu, cal = getattr(runner, "gpu", None), getattr(runner, "calibration", None)
        if gpu is None or cal is None or not hasattr(gpu, "peak_flops"):
            raise ServelabError(f"a multimodal encoder is priced on the replica's GPU: runner '{runner.name}' knows "
                                "none (use the roofline runner)")
        self.encoders = {}
        if vision is not None:
            self.encoders["image"] = self.encoders["video"] = get_encoder(vision, "image")
        if audio is not None:
            self.encoders["audio"] = get_encoder(audio, "audio")
        self.peak_flops, self.hbm, self.cal = gpu.peak_flops, gpu.hbm_bytes_per_s, cal.ops["mlp_up"]
        profile = getattr(runner, "host_profile", None)
        self.launch_latency_s = self.cal.latency_s * (profile.launch_scale if profile is not None else 1.0)

    def __call__(self, kind: str, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        flops, nbytes, launches = encode_flops_bytes(self.encoders[kind], tokens)
        return launches * self.launch_latency_s + max(flops / (self.peak_flops * self.cal.eff_compute),
                                                      nbytes / (self.hbm * self.cal.eff_memory))


__all__ = ["ENCODERS", "EncoderPreset", "EncoderPricer", "encode_flops_bytes", "get_encoder"]
