"""Named model and GPU presets (frozen dataclasses in tables) that cost models and runners share.

Model shapes are copied from each model's Hugging Face ``config.json``; GPU figures from the vendor
datasheets (dense, i.e. without structured sparsity). ``memory_mib`` is what ``nvidia-smi`` reports
as total memory, which is what vLLM's ``gpu_memory_utilization`` multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class DecoderShape:
    """Sizes derived from a Llama-family decoder's shape fields (``num_layers``, ``hidden_size``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``ffn_size``, ``vocab_size``, ``tied_embeddings``),
    shared by the cost models' presets and the torch model's arguments."""

    __slots__ = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _count_params(self, mlp_matrices: int, qkv_bias: bool) -> int:
        h = self.hidden_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h  # attention
        per_layer += mlp_matrices * h * self.ffn_size + 2 * h  # MLP + two norms
        if qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + final norm


@dataclass(frozen=True, slots=True)
class ModelPreset(DecoderShape):
    name: str
    hf_id: str  # where the shape comes from
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int  # intermediate size of the (gated) MLP
    vocab_size: int
    dtype: str = "bfloat16"
    gated_mlp: bool = True  # SwiGLU: up and gate projections, so 3 weight matrices
    tied_embeddings: bool = False
    # Mixture of experts (0 = dense): every MLP is num_experts experts of ffn_size, experts_per_token
    # of them run per token (a router picks them); shared_ffn_size is an always-on shared expert.
    num_experts: int = 0
    experts_per_token: int = 0
    shared_ffn_size: int = 0
    # Longest prompt + output the model takes (config.json's max_position_embeddings: vLLM's default
    # max_model_len, beyond which it answers 400); None: not known
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model preset {self.name}: unknown dtype {self.dtype}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model preset {self.name}: heads must be a multiple of KV heads")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model preset {self.name}: experts_per_token must be in 1..num_experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts a batch of ``tokens`` routes to (uniform routing): E (1 - (1 - k/E)^T);
        1 for a dense model."""
        if not self.num_experts:
            return 1.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** max(tokens, 0))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_params(self) -> int:
        matrices = 3 if self.gated_mlp else 2
        dense = self._count_params(matrices, qkv_bias=False)
        if not self.num_experts:
            return dense
        h = self.hidden_size
        experts = self.num_experts * matrices * h * self.ffn_size + matrices * h * self.shared_ffn_size
        router = h * self.num_experts
        return dense + self.num_layers * (experts + router - matrices * h * self.ffn_size)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, over the whole model (all TP shards together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuPreset:
    name: str
    description: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    memory_mib: int  # total device memory as nvidia-smi reports it
    interconnect_bytes_per_s: float  # per direction, per GPU (NVLink, or PCIe when there is none)
    interconnect: str
    calibration: str  # which profiled GPU's efficiencies it uses (see runners/roofline_calibration.json)
    calibrated: bool = False  # True: its own operator profiles were fitted; False: datasheet + borrowed efficiencies
    # How many of these GPUs can run vLLM's custom (peer-to-peer) all-reduce together: 8 on an
    # NVLink/NVSwitch node (fully connected), 2 over an NVLink bridge, 0 where there is no NVLink
    # (PCIe parts: NCCL only; runners/all_reduce.py).
    p2p_ranks: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024


def _models(*presets: ModelPreset) -> dict[str, ModelPreset]:
    return {p.name: p for p in presets}


MODELS: dict[str, ModelPreset] = _models(
    ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 4096, 32, 8, 128, 14336, 128256,
                max_position_embeddings=131072),
    ModelPreset("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8192, 64, 8, 128, 28672, 128256,
                max_position_embeddings=131072),
    ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 28, 3584, 28, 4, 128, 18944, 152064,
                max_position_embeddings=32768),
    ModelPreset("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 64, 5120, 40, 8, 128, 27648, 152064,
                max_position_embeddings=32768),
    ModelPreset("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", 80, 8192, 64, 8, 128, 29568, 152064,
                max_position_embeddings=32768),
    ModelPreset("llama-2-7b", "meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 128, 11008, 32000,
                max_position_embeddings=4096),
    ModelPreset("llama-2-70b", "meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 128, 28672, 32000,
                max_position_embeddings=4096),
    ModelPreset("codellama-34b", "codellama/CodeLlama-34b-Instruct-hf", 48, 8192, 64, 8, 128, 22016, 32000,
                max_position_embeddings=16384),
    ModelPreset("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", 32, 4096, 32, 8, 128, 14336, 32768,
                max_position_embeddings=32768),
    # Small enough for a CPU torch runner in tests; float32 because CPUs lack fast bf16 matmuls.
    ModelPreset("tiny", "servelab/tiny (random weights)", 2, 64, 4, 2, 16, 128, 512, dtype="float32"),
)

GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100-80gb", "NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 81920, 300e9, "NVLink 3", "a100", True, p2p_ranks=8),
        GpuPreset("a100-40gb", "NVIDIA A100-SXM4-40GB", 312e12, 1.555e12, 40960, 300e9, "NVLink 3", "a100", p2p_ranks=8),
        GpuPreset("h100-80gb", "NVIDIA H100-SXM5-80GB", 989e12, 3.35e12, 81559, 450e9, "NVLink 4", "h100", True, p2p_ranks=8),
        GpuPreset("h100-pcie", "NVIDIA H100 PCIe 80GB", 756e12, 2.0e12, 81559, 64e9, "PCIe 5.0 x16", "h100"),
        GpuPreset("h200", "NVIDIA H200-SXM-141GB", 989e12, 4.8e12, 143771, 450e9, "NVLink 4", "h100", p2p_ranks=8),
        GpuPreset("b200", "NVIDIA B200 (HGX, 180GB)", 2250e12, 8.0e12, 183359, 900e9, "NVLink 5", "h100", p2p_ranks=8),
        GpuPreset("l40s", "NVIDIA L40S (48GB)", 362e12, 0.864e12, 46068, 32e9, "PCIe 4.0 x16", "a40"),
        GpuPreset("a40", "NVIDIA A40 (48GB)", 149.7e12, 0.696e12, 46068, 56.25e9, "NVLink bridge", "a40", True, p2p_ranks=2),
        # GeForce/workstation parts: bf16 tensor rate with fp32 accumulate (what vLLM's kernels use)
        GpuPreset("rtx-4090", "NVIDIA GeForce RTX 4090 (24GB)", 165.2e12, 1.008e12, 24564, 32e9, "PCIe 4.0 x16",
                  "rtx4090"),  # A40 efficiencies scaled on one real vLLM run (runners/real_calibration.json)
        GpuPreset("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell (96GB)", 503.8e12, 1.792e12, 97887, 64e9,
                  "PCIe 5.0 x16", "a40"),
        GpuPreset("mi300x", "AMD Instinct MI300X (192GB)", 1307.4e12, 5.3e12, 196592, 64e9,
                  "Infinity Fabric (64 GB/s per peer link)", "h100"),
    )
}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ServelabError(f"unknown model preset '{name}'{did_you_mean(name, MODELS)} (known: {', '.join(MODELS)})") from None


def model_from_hf_config(path: str) -> ModelPreset:
    """A model preset from a Hugging Face ``config.json`` (Llama-family dense, GQA/MQA, and MoE:
    Mixtral ``num_local_experts``, Qwen2/3-MoE ``num_experts`` + ``moe_intermediate_size``)."""
    import json
    from pathlib import Path

    from servelab.common.errors import InputError

    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(p, f"cannot read a config.json ({getattr(err, 'msg', None) or err})") from None
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the decoder here
        cfg = {**cfg, **cfg["text_config"]}

    def need(key: str, *alternatives: str) -> int:
        for k in (key, *alternatives):
            if cfg.get(k) is not None:
                return int(cfg[k])
        raise InputError(p, "field missing", column=key)

    hidden, heads = need("hidden_size", "n_embd", "d_model"), need("num_attention_heads", "n_head")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    ffn = need("moe_intermediate_size") if experts and cfg.get("moe_intermediate_size") else need("intermediate_size")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    try:
        return ModelPreset(
            name=str(cfg.get("_name_or_path") or p.parent.name or p.stem),
            hf_id=str(cfg.get("_name_or_path") or p),
            num_layers=need("num_hidden_layers", "n_layer"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),  # absent: multi-head attention
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn_size=ffn,
            vocab_size=need("vocab_size"),
            dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            shared_ffn_size=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            max_position_embeddings=int(cfg["max_position_embeddings"]) if cfg.get("max_position_embeddings") else None,
        )
    except ValueError as err:
        raise InputError(p, str(err)) from None


def resolve_model(name: str) -> ModelPreset:
    """A preset name or Hugging Face id (``find_model``), or a path to a ``config.json``."""
    import os

    if name.endswith(".json") or os.path.isfile(name):
        return model_from_hf_config(name)
    return find_model(name)


def find_model(name: str) -> ModelPreset:
    """A preset by its name, or by the Hugging Face id it was copied from (``org/Model``, a local path
    ending in it, with or without an ``-Instruct``/``-hf`` suffix: same shapes)."""
    if name.lower() in MODELS:
        return MODELS[name.lower()]

    def base(hf_id: str) -> str:
        tail = "/".join(hf_id.strip("/").split("/")[-2:]).lower()
        for suffix in ("-instruct", "-hf", "-chat"):
            tail = tail.removesuffix(suffix)
        return tail.removesuffix("-instruct")

    wanted = base(name)
    for preset in MODELS.values():
        if base(preset.hf_id) == wanted:
            return preset
    return get_model(name)  # the usual unknown-preset error


def get_gpu(name: str) -> GpuPreset:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ServelabError(f"unknown GPU preset '{name}'{did_you_mean(name, GPUS)} (known: {', '.join(GPUS)})") from None
