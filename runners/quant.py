"""Quantisation formats: bytes per weight, the tensor-core format a GEMM runs in, and KV cache dtypes.

A format is named as vLLM's ``--quantization`` or a checkpoint's ``quantization_config`` names it.
Bytes per weight include the scales each format stores (per group of weights); a GEMM runs in the
format's compute type where the GPU has tensor cores for it (``GpuPreset.fp8`` / ``fp4``), else
vLLM dequantises in the kernel (Marlin and the like) and the GEMM runs at the bf16 rate on fewer
bytes. docs/runners.md "Quantisation" has the sources.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How a model's weights are stored and computed with (bf16, fp8, int8, int4, fp4)."""

    name: str
    bytes_per_weight: float  # the quantised value and its share of the format's scales (and zeros)
    compute: str  # bf16 (weight-only: dequantised in the kernel), fp8, int8 or fp4 (activations quantised too)


WEIGHT_FORMATS = {
    # FP8 e4m3 W8A8, per-tensor/channel scales or DeepSeek's 128 x 128 blocks (one float32 per block)
    "fp8": WeightFormat("fp8", 1 + 4 / (128 * 128), "fp8"),
    "int8": WeightFormat("int8", 1.0, "int8"),  # W8A8 int8 (compressed-tensors), per-channel scales
    "int8-weight-only": WeightFormat("int8-weight-only", 1 + 2 / 128, "bf16"),  # 8-bit GPTQ/AWQ, group 128
    # 4-bit GPTQ / AWQ, group 128: an fp16 scale and a 4-bit zero point per 128 weights
    "awq": WeightFormat("awq", 0.5 + 2.5 / 128, "bf16"),
    "gptq": WeightFormat("gptq", 0.5 + 2.5 / 128, "bf16"),
    "int4": WeightFormat("int4", 0.5 + 2.5 / 128, "bf16"),
    "nvfp4": WeightFormat("nvfp4", 0.5 + 1 / 16, "fp4"),  # e2m1, an fp8 scale per 16 weights
    "mxfp4": WeightFormat("mxfp4", 0.5 + 1 / 32, "fp4"),  # e2m1, an e8m0 scale per 32 weights
}
# vLLM's names of the same formats
ALIASES = {"fp8_e4m3": "fp8", "w8a8_fp8": "fp8", "w8a8": "int8", "w4a16": "int4", "awq_marlin": "awq",
           "gptq_marlin": "gptq", "modelopt_fp4": "nvfp4"}
KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2}


def weight_format(name: str) -> WeightFormat:
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return WEIGHT_FORMATS[key]
    except KeyError:
        known = ", ".join([*WEIGHT_FORMATS, *ALIASES])
        raise ValueError(f"unknown quantization '{name}' (known: {known})") from None


# Low-precision GEMMs reach a smaller share of their peak than bf16 ones: on an H200, cuBLASLt FP8
# (torch._scaled_mm) ran Llama-3.1-8B's MLP GEMMs at 1.61-1.90x the bf16 throughput where compute
# bound (T = 1,024-8,192; median 1.73 of the datasheet's 2x; bench/RESULTS_runners.md "Quantisation").
LOW_PRECISION_ACHIEVED = 1.73 / 2


def compute_speedup(fmt: WeightFormat, fp8: bool, fp4: bool) -> float:
    """How much faster than bf16 the GEMM's tensor cores run the format on a GPU with (or without)
    FP8 and FP4 tensor cores: the dense peak ratio (FP8 and INT8 twice bf16, FP4 four times) times
    the share of it that FP8 kernels were measured to reach (INT8 and FP4 assumed alike)."""
    if fmt.compute == "fp8":
        return 2.0 * LOW_PRECISION_ACHIEVED if fp8 else 1.0
    if fmt.compute == "int8":
        return 2.0 * LOW_PRECISION_ACHIEVED  # every preset has INT8 tensor cores at twice its bf16 rate
    if fmt.compute == "fp4":
        return 4.0 * LOW_PRECISION_ACHIEVED if fp4 else 1.0
    return 1.0


def from_hf_quantization_config(qc: dict) -> str:
    """The format of a checkpoint's ``quantization_config`` (raises ValueError naming what it cannot read)."""
    method = str(qc.get("quant_method") or "").lower()
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method in ("awq", "gptq"):
        bits = int(qc.get("bits") or qc.get("w_bit") or 4)
        if bits == 8:
            return "int8-weight-only"
        if bits != 4:
            raise ValueError(f"quantization_config: {method} with {bits} bits is not modelled (4 or 8)")
        return method
    if method == "mxfp4":
        return "mxfp4"
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or "").upper()
        if algo in ("FP8", "NVFP4"):
            return algo.lower()
        raise ValueError(f"quantization_config: modelopt quant_algo '{algo}' is not modelled (FP8, NVFP4)")
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w, a = group.get("weights") or {}, group.get("input_activations")
            bits, kind = int(w.get("num_bits") or 16), str(w.get("type") or "int")
            if bits == 8 and kind == "float":
                return "fp8"
            if bits == 8:
                return "int8" if a else "int8-weight-only"
            if bits == 4 and kind == "float":
                return "nvfp4"
            if bits == 4:
                return "int4"
        raise ValueError("quantization_config: compressed-tensors without a weight group of 4 or 8 bits")
    raise ValueError(f"quantization_config: quant_method '{method}' is not modelled "
                     f"(fp8, awq, gptq, mxfp4, modelopt, compressed-tensors)")


def kv_cache_bytes(name: str, model_dtype_bytes: int) -> int:
    try:
        value = KV_CACHE_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype '{name}' (known: {', '.join(KV_CACHE_DTYPES)})") from None
    return model_dtype_bytes if value is None else value
