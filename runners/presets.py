"""Named model and GPU presets (frozen dataclasses in tables) that cost models and runners share.

Model shapes are copied from each model's Hugging Face ``config.json``; GPU figures from the vendor
datasheets (dense, i.e. without structured sparsity). ``memory_mib`` is what ``nvidia-smi`` reports
as total memory, which is what vLLM's ``gpu_memory_utilization`` multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    """A model's shape: what the cost model prices and the KV cache sizes."""

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
    # Quantisation (runners/quant.py): the linear layers' weight format ("": the model dtype) and the
    # KV cache dtype, as vLLM's --quantization and --kv-cache-dtype name them.
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    # Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent of kv_lora_rank plus
    # the rotary key part per token and layer, shared by all heads (and copied on every TP rank).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries projected directly
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # The first dense_layers layers have a dense MLP of dense_ffn_size (DeepSeek's first_k_dense_replace).
    dense_layers: int = 0
    dense_ffn_size: int = 0
    # Longest prompt + output the model takes (config.json's max_position_embeddings: vLLM's default
    # max_model_len, beyond which it answers 400); None: not known
    max_position_embeddings: int | None = None
    # Hybrid attention (replay/core/kv/kv_groups.py): sliding_layers of the layers attend to the last
    # sliding_window tokens only (Gemma 2/3, gpt-oss, Mistral); state_layers are linear-attention or
    # state-space layers (Qwen3-Next, Jamba, Nemotron-H) with no KV but a fixed state of state_bytes
    # per sequence each (whole model, split over TP); the other layers attend to every token.
    sliding_window: int = 0
    sliding_layers: int = 0
    state_layers: int = 0
    state_bytes: int = 0
    # Nemotron-H (hybrid_override_pattern): mlp_only_layers of the layers are an MLP alone (no KV, no
    # state); the others are then a mixer alone (attention, or a state layer priced as attention), no MLP.
    mlp_only_layers: int = 0

    def __post_init__(self) -> None:
        from servelab.runners.quant import kv_cache_bytes, weight_format

        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model preset {self.name}: unknown dtype {self.dtype}")
        if self.quantization:
            weight_format(self.quantization)
        kv_cache_bytes(self.kv_cache_dtype, DTYPE_BYTES[self.dtype])
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model preset {self.name}: heads must be a multiple of KV heads")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model preset {self.name}: experts_per_token must be in 1..num_experts")
        if (self.sliding_layers + self.state_layers + self.mlp_only_layers > self.num_layers
                or min(self.sliding_layers, self.state_layers, self.mlp_only_layers) < 0):
            raise ValueError(f"model preset {self.name}: sliding_layers + state_layers + mlp_only_layers must be "
                             "in 0..num_layers")
        if self.sliding_layers and self.sliding_window < 1:
            raise ValueError(f"model preset {self.name}: sliding_layers need a sliding_window >= 1")
        if self.state_layers and self.state_bytes < 1:
            raise ValueError(f"model preset {self.name}: state_layers need their state_bytes per sequence")

    @property
    def is_hybrid(self) -> bool:
        """Not every layer attends to every token: KV is kept per layer group (replay/core/kv/kv_groups.py)."""
        return bool(self.sliding_layers or self.state_layers)

    @property
    def attention_layers(self) -> int:
        """Layers that keep KV (full or sliding-window attention)."""
        return self.num_layers - self.state_layers - self.mlp_only_layers

    def kv_shards(self, tp: int) -> int:
        """Ranks of a ``tp``-way group that hold different KV: each of them 1/kv_shards of the KV heads.
        With more ranks than KV heads vLLM copies each head onto tp / num_kv_heads ranks (Qwen3-235B's 4
        at TP 8); MLA's latent is not split by heads, so every rank holds all of it."""
        return 1 if self.is_mla else min(tp, self.num_kv_heads)

    def check_tp(self, tp: int) -> None:
        """vLLM's rule: tp divides the query heads, and the KV heads divide among (or are copied over) the ranks."""
        if tp < 1 or self.num_heads % tp or (self.num_kv_heads % tp and tp % self.num_kv_heads):
            raise ValueError(f"tp={tp} must divide the {self.name} query heads ({self.num_heads}) and divide or "
                             f"be a multiple of its KV heads ({self.num_kv_heads})")

    def layer_kinds(self, tp: int):
        """The model's layers by kind with their bytes on one of ``tp`` GPUs (replay/core/kv/kv_groups.py)."""
        from servelab.replay.core.kv.kv_groups import LayerKinds

        token = self.kv_bytes_per_token_layer // self.kv_shards(tp)
        return LayerKinds(full=self.attention_layers - self.sliding_layers, sliding=self.sliding_layers,
                          state=self.state_layers, window=self.sliding_window, token_bytes=token,
                          state_bytes=-(-self.state_bytes // tp))

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
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def mla_projection_params(self) -> tuple[int, int, int]:
        """Per layer: the latent down-projections (replicated on every TP rank), the up-projections
        to every head (split over TP), and the output projection (split over TP)."""
        h, heads = self.hidden_size, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        down = h * (self.kv_lora_rank + self.qk_rope_head_dim) + (h * self.q_lora_rank if self.q_lora_rank else 0)
        up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        up += self.q_lora_rank * heads * qk if self.q_lora_rank else h * heads * qk
        return down, up, heads * self.v_head_dim * h

    @property
    def _non_linear_params(self) -> int:
        """Parameters outside the linear layers (embeddings, norms, router), kept in the model dtype."""
        h = self.hidden_size
        moe_layers = self.num_layers - self.dense_layers if self.num_experts else 0
        per_layer_norms = (h if self.mlp_only_layers else 2 * h) + (self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0)
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return embeddings + h + self.num_layers * per_layer_norms + moe_layers * h * self.num_experts

    @property
    def num_params(self) -> int:
        matrices = 3 if self.gated_mlp else 2
        if self.mlp_only_layers:  # Nemotron-H: mixers (attention-shaped) and MLPs in layers apart, one norm each
            h = self.hidden_size
            mixers = self.num_layers - self.mlp_only_layers
            attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
            return (mixers * attention + self.mlp_only_layers * matrices * h * self.ffn_size + self.num_layers * h
                    + self.vocab_size * h * (1 if self.tied_embeddings else 2) + h)
        if self.is_mla or self.dense_layers:
            h = self.hidden_size
            if self.is_mla:
                attention = sum(self.mla_projection_params())
            else:
                attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
            sparse = self.num_layers - self.dense_layers
            mlp = self.dense_layers * matrices * h * self.dense_ffn_size
            if self.num_experts:
                mlp += sparse * matrices * h * (self.num_experts * self.ffn_size + self.shared_ffn_size)
            else:
                mlp += sparse * matrices * h * self.ffn_size
            return self.num_layers * attention + mlp + self._non_linear_params
        dense = self._count_params(matrices, qkv_bias=False)
        if not self.num_experts:
            return dense
        h = self.hidden_size
        experts = self.num_experts * matrices * h * self.ffn_size + matrices * h * self.shared_ffn_size
        router = h * self.num_experts
        return dense + self.num_layers * (experts + router - matrices * h * self.ffn_size)

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes per weight of the linear layers: the quantisation format's (with its scales), else the dtype's."""
        if not self.quantization:
            return self.dtype_bytes
        from servelab.runners.quant import weight_format

        return weight_format(self.quantization).bytes_per_weight

    @property
    def weight_bytes(self) -> int:
        if not self.quantization:
            return self.num_params * self.dtype_bytes
        other = self._non_linear_params
        return int((self.num_params - other) * self.linear_weight_bytes + other * self.dtype_bytes)

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts (0 for a dense model): what expert parallelism shards."""
        matrices = 3 if self.gated_mlp else 2
        layers = self.num_layers - self.dense_layers
        return layers * self.num_experts * matrices * self.hidden_size * self.ffn_size

    @property
    def expert_weight_bytes(self) -> float:
        return self.expert_params * self.linear_weight_bytes

    @property
    def kv_dtype_bytes(self) -> int:
        from servelab.runners.quant import kv_cache_bytes

        return kv_cache_bytes(self.kv_cache_dtype, self.dtype_bytes)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV bytes of one token in one layer, whole model: K and V of every KV head, or MLA's latent."""
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, over the whole model (all TP shards together); a
        hybrid model's state layers keep none."""
        if self.state_layers:
            return self.attention_layers * self.kv_bytes_per_token_layer
        if self.is_mla or self.kv_cache_dtype != "auto":
            return self.num_layers * self.kv_bytes_per_token_layer
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuPreset:
    """A GPU's peak compute, memory, bandwidths and interconnect."""

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
    # What the GPUs talk over (runners/all_reduce.py LINKS): nvlink (NVLink/NVSwitch, or a direct
    # fabric), pcie (PCIe with peer-to-peer access), pcie-host (PCIe without it: through host memory).
    link: str = "nvlink"
    fp8: bool = False  # FP8 tensor cores (Hopper, Ada, Blackwell, CDNA3) at twice the bf16 rate
    fp4: bool = False  # FP4 tensor cores (Blackwell) at four times the bf16 rate

    def __post_init__(self) -> None:
        from servelab.runners.all_reduce import LINKS

        if self.link not in LINKS:
            raise ValueError(f"GPU preset {self.name}: unknown link '{self.link}' (known: {', '.join(LINKS)})")

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
    # A draft model for speculative decoding (runners/speculative.py) beside the Llama 3.1 targets
    # (same tokenizer); its config.json ties the input and output embeddings.
    ModelPreset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", 16, 2048, 32, 8, 64, 8192, 128256,
                tied_embeddings=True, max_position_embeddings=131072),
    # Small enough for a CPU torch runner in tests; float32 because CPUs lack fast bf16 matmuls.
    ModelPreset("tiny", "servelab/tiny (random weights)", 2, 64, 4, 2, 16, 128, 512, dtype="float32"),
    # Today's MoE, latent-attention and hybrid-attention models: every value below is the config.json
    # field of the Hugging Face repository named (MODEL_SOURCES), read as model_from_hf_config reads it.
    # DeepSeek-V3: MLA (kv_lora_rank 512 + qk_rope_head_dim 64), 256 routed + 1 shared expert of 2048,
    # the first 3 layers dense (18432), FP8 weights in 128 x 128 blocks.
    ModelPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 7168, 128, 128, 192, 2048, 129280,
                num_experts=256, experts_per_token=8, shared_ffn_size=2048, quantization="fp8", kv_lora_rank=512,
                q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, dense_layers=3,
                dense_ffn_size=18432, max_position_embeddings=163840),
    # Qwen3-Next-80B-A3B: full_attention_interval 4, so 12 full-attention layers and 36 Gated DeltaNet
    # layers (16 key heads x 128, 32 value heads x 128, conv kernel 4): (2*16*128 + 32*128) * 3 * 2
    # + 32*128*128 * 2 = 1,097,728 state bytes per sequence and layer; 512 experts of 512, 10 routed.
    ModelPreset("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", 48, 2048, 16, 2, 256, 512, 151936,
                num_experts=512, experts_per_token=10, shared_ffn_size=512, max_position_embeddings=262144,
                state_layers=36, state_bytes=1_097_728),
    # Gemma-3-27B (text_config): sliding_window 1024 with sliding_window_pattern 6: layers 6, 12, ...,
    # 60 attend to everything (10), the other 52 to the last 1024 tokens; tied embeddings.
    ModelPreset("gemma-3-27b", "google/gemma-3-27b-it", 62, 5376, 32, 16, 128, 21504, 262208, tied_embeddings=True,
                max_position_embeddings=131072, sliding_window=1024, sliding_layers=52),
    # gpt-oss-120b: layer_types alternate sliding (window 128) and full attention over 36 layers;
    # 128 experts of 2880, 4 routed; MXFP4 expert weights (quantization_config quant_method mxfp4).
    ModelPreset("gpt-oss-120b", "openai/gpt-oss-120b", 36, 2880, 64, 8, 64, 2880, 201088, num_experts=128,
                experts_per_token=4, quantization="mxfp4", max_position_embeddings=131072, sliding_window=128,
                sliding_layers=18),
    # Nemotron-H-8B: hybrid_override_pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" over 52
    # layers: 24 Mamba-2, 4 attention (32 heads, 8 KV heads of 128), 24 MLP-only (squared ReLU, 21504);
    # Mamba-2: 128 heads x 64, state 128, 8 groups, conv kernel 4: (8192 + 2 x 8 x 128) x 3 x 2
    # + 128 x 64 x 128 x 2 = 2,158,592 state bytes per sequence and layer.
    ModelPreset("nemotron-h-8b", "nvidia/Nemotron-H-8B-Base-8K", 52, 4096, 32, 8, 128, 21504, 131072, gated_mlp=False,
                max_position_embeddings=8192, state_layers=24, state_bytes=2_158_592, mlp_only_layers=24),
    # Qwen3-32B (dense, q_size 8192 over hidden 5120) and Qwen3-30B-A3B (128 experts of 768, 8 routed, no
    # shared expert), the models of LLMServingSim's RTX PRO 6000 runs (bench/real_runs/README.md)
    ModelPreset("qwen3-32b", "Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, max_position_embeddings=40960),
    ModelPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B-Instruct-2507", 48, 2048, 32, 4, 128, 768, 151936,
                num_experts=128, experts_per_token=8, max_position_embeddings=262144),
    # Qwen3-VL-8B's language model (text_config; its vision encoder is priced apart, as an encoder stage)
    ModelPreset("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", 36, 4096, 32, 8, 128, 12288, 151936,
                max_position_embeddings=262144),
    # Models often served with vLLM, so that a real run recording one of them replays without its
    # config.json (each value is the config.json field of the repository named; MODEL_SOURCES)
    ModelPreset("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", 32, 4096, 32, 8, 128, 14336, 128256,
                max_position_embeddings=8192),
    ModelPreset("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", 28, 3072, 24, 8, 128, 8192, 128256,
                tied_embeddings=True, max_position_embeddings=131072),
    ModelPreset("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", 80, 8192, 64, 8, 128, 28672, 128256,
                max_position_embeddings=131072),
    ModelPreset("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", 36, 2048, 16, 2, 128, 11008, 151936,
                tied_embeddings=True, max_position_embeddings=32768),
    ModelPreset("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", 48, 5120, 40, 8, 128, 13824, 152064,
                max_position_embeddings=32768),
    ModelPreset("qwen3-0.6b", "Qwen/Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, tied_embeddings=True,
                max_position_embeddings=40960),
    ModelPreset("qwen3-1.7b", "Qwen/Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936, tied_embeddings=True,
                max_position_embeddings=40960),
    ModelPreset("qwen3-4b", "Qwen/Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 151936, tied_embeddings=True,
                max_position_embeddings=40960),
    ModelPreset("qwen3-8b", "Qwen/Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, max_position_embeddings=40960),
    ModelPreset("qwen3-14b", "Qwen/Qwen3-14B", 40, 5120, 40, 8, 128, 17408, 151936, max_position_embeddings=40960),
    # Qwen3-235B-A22B: 128 experts of 1536, 8 routed, no shared expert (head_dim 128 over hidden 4096)
    ModelPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 1536, 151936, num_experts=128,
                experts_per_token=8, max_position_embeddings=40960),
    # Mixtral-8x7B: 8 experts of 14336 (num_local_experts), 2 routed
    ModelPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", 32, 4096, 32, 8, 128, 14336, 32000,
                num_experts=8, experts_per_token=2, max_position_embeddings=32768),
    # gpt-oss-20b: gpt-oss-120b's layer (sliding window 128 on every other layer) over 24 layers, 32 experts
    ModelPreset("gpt-oss-20b", "openai/gpt-oss-20b", 24, 2880, 64, 8, 64, 2880, 201088, num_experts=32,
                experts_per_token=4, quantization="mxfp4", max_position_embeddings=131072, sliding_window=128,
                sliding_layers=12),
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a preset's shape was copied from, and whether the roofline was checked on real runs of it."""

    config_url: str
    calibrated: bool = False  # True: real runs of this model fitted or validated its pricing (docs/fidelity.md)


# The presets added for the 2026 models and the often-served ones: none of them has been run on a
# real GPU here yet (the Qwen3 models of bench/real_runs were replayed, not fitted).
MODEL_SOURCES: dict[str, ModelSource] = {
    name: ModelSource(f"https://huggingface.co/{MODELS[name].hf_id}/blob/main/config.json")
    for name in ("deepseek-v3", "qwen3-next-80b-a3b", "gemma-3-27b", "gpt-oss-120b", "qwen3-vl-8b", "nemotron-h-8b",
                 "qwen3-32b", "qwen3-30b-a3b", "llama-3-8b", "llama-3.2-3b", "llama-3.3-70b", "qwen2.5-3b",
                 "qwen2.5-14b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-235b-a22b",
                 "mixtral-8x7b", "gpt-oss-20b")
}

GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100-80gb", "NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 81920, 300e9, "NVLink 3", "a100", True, p2p_ranks=8),
        GpuPreset("a100-40gb", "NVIDIA A100-SXM4-40GB", 312e12, 1.555e12, 40960, 300e9, "NVLink 3", "a100", p2p_ranks=8),
        GpuPreset("h100-80gb", "NVIDIA H100-SXM5-80GB", 989e12, 3.35e12, 81559, 450e9, "NVLink 4", "h100", True, p2p_ranks=8,
                  fp8=True),
        GpuPreset("h100-pcie", "NVIDIA H100 PCIe 80GB", 756e12, 2.0e12, 81559, 64e9, "PCIe 5.0 x16", "h100", link="pcie",
                  fp8=True),
        GpuPreset("h200", "NVIDIA H200-SXM-141GB", 989e12, 4.8e12, 143771, 450e9, "NVLink 4", "h100", p2p_ranks=8,
                  fp8=True),
        # Hopper parts with other memory: the H100's efficiencies, datasheet figures. H100 NVL: a PCIe card
        # (94 GB HBM3, 3.9 TB/s, 835 TFLOPS bf16 dense at 400 W) in pairs joined by an NVLink bridge
        # (600 GB/s both ways); GH200 480GB: the Grace Hopper superchip's H100 with 96 GB HBM3 at 4.0 TB/s,
        # its NVLink 4 (900 GB/s both ways) joining superchips in an NVL2 pair or an NVL32 rack
        GpuPreset("h100-nvl", "NVIDIA H100 NVL (94GB)", 835e12, 3.9e12, 95830, 300e9, "NVLink bridge", "h100",
                  p2p_ranks=2, fp8=True),
        GpuPreset("gh200", "NVIDIA GH200 480GB (96GB HBM3)", 989e12, 4.0e12, 97871, 450e9, "NVLink 4", "h100",
                  p2p_ranks=2, fp8=True),
        GpuPreset("b200", "NVIDIA B200 (HGX, 180GB)", 2250e12, 8.0e12, 183359, 900e9, "NVLink 5", "h100", p2p_ranks=8,
                  fp8=True, fp4=True),
        GpuPreset("l40s", "NVIDIA L40S (48GB)", 362e12, 0.864e12, 46068, 32e9, "PCIe 4.0 x16", "a40", link="pcie",
                  fp8=True),
        GpuPreset("a40", "NVIDIA A40 (48GB)", 149.7e12, 0.696e12, 46068, 56.25e9, "NVLink bridge", "a40", True, p2p_ranks=2),
        # GeForce/workstation parts: bf16 tensor rate with fp32 accumulate (what vLLM's kernels use)
        GpuPreset("rtx-4090", "NVIDIA GeForce RTX 4090 (24GB)", 165.2e12, 1.008e12, 24564, 32e9, "PCIe 4.0 x16",
                  # no P2P on GeForce; A40 efficiencies scaled on one real vLLM run (runners/real_calibration.json)
                  "rtx4090", link="pcie-host", fp8=True),
        # peer-to-peer over PCIe works on some RTX PRO 6000 builds, not on others: the real TP2 and DP2 + EP
        # vLLM runs on two of them (bench/real_runs, llmservingsim-*) move their bytes as through host
        # memory (roofline:link=pcie where nvidia-smi topo -p2p r shows OK)
        GpuPreset("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell (96GB)", 503.8e12, 1.792e12, 97887, 64e9,
                  "PCIe 5.0 x16", "a40", link="pcie-host", fp8=True, fp4=True),
        # Cloud and workstation cards often used for serving, from NVIDIA's datasheets (dense bf16 with fp32
        # accumulate); efficiencies borrowed from the A40 profile (GDDR parts), none of them checked on a run
        GpuPreset("l4", "NVIDIA L4 (24GB)", 121e12, 0.300e12, 23034, 32e9, "PCIe 4.0 x16", "a40", link="pcie",
                  fp8=True),
        GpuPreset("a10", "NVIDIA A10 (24GB)", 125e12, 0.600e12, 23028, 32e9, "PCIe 4.0 x16", "a40", link="pcie"),
        GpuPreset("rtx-a6000", "NVIDIA RTX A6000 (48GB)", 154.8e12, 0.768e12, 49140, 32e9, "PCIe 4.0 x16", "a40",
                  link="pcie"),
        GpuPreset("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation (48GB)", 364.2e12, 0.960e12, 49140, 32e9,
                  "PCIe 4.0 x16", "a40", link="pcie", fp8=True),
        GpuPreset("mi300x", "AMD Instinct MI300X (192GB)", 1307.4e12, 5.3e12, 196592, 64e9,
                  "Infinity Fabric (64 GB/s per peer link)", "h100", fp8=True),
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
    extra: dict = {}
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        extra.update(kv_lora_rank=need("kv_lora_rank"), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                     qk_rope_head_dim=need("qk_rope_head_dim"), qk_nope_head_dim=need("qk_nope_head_dim"),
                     v_head_dim=need("v_head_dim"))
    if experts and cfg.get("first_k_dense_replace"):
        extra.update(dense_layers=int(cfg["first_k_dense_replace"]), dense_ffn_size=need("intermediate_size"))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if experts and not shared and cfg.get("n_shared_experts"):  # DeepSeek: shared experts of the routed size
        shared = int(cfg["n_shared_experts"]) * ffn
    if isinstance(cfg.get("quantization_config"), dict):
        from servelab.runners.quant import from_hf_quantization_config

        try:
            extra["quantization"] = from_hf_quantization_config(cfg["quantization_config"])
        except ValueError as err:
            raise InputError(p, str(err), column="quantization_config") from None
    from servelab.runners.hybrid_config import HybridConfigError, hybrid_fields

    layers = need("num_hidden_layers", "n_layer")
    try:
        extra.update(hybrid_fields(cfg, layers, DTYPE_BYTES.get(dtype, 2)))
    except HybridConfigError as err:
        raise InputError(p, str(err), column=err.field) from None
    head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads
    if extra.get("kv_lora_rank"):
        head_dim = extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]  # what a query head attends with
    try:
        return ModelPreset(
            name=str(cfg.get("_name_or_path") or p.parent.name or p.stem),
            hf_id=str(cfg.get("_name_or_path") or p),
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),  # absent: multi-head attention
            head_dim=int(head_dim),
            ffn_size=ffn,
            vocab_size=need("vocab_size"),
            dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            max_position_embeddings=int(cfg["max_position_embeddings"]) if cfg.get("max_position_embeddings") else None,
            shared_ffn_size=shared if experts else 0,
            **extra,
        )
    except ValueError as err:
        raise InputError(p, str(err)) from None


def resolve_model(name: str) -> ModelPreset:
    """A preset name or Hugging Face id (``find_model``), or a path to a ``config.json``."""
    import os

    if name.endswith(".json") or os.path.isfile(name):
        return model_from_hf_config(name)
    return find_model(name)


# A quantised checkpoint's id ends in its format (Qwen/Qwen3-8B-FP8, ...-AWQ, ...-GPTQ-Int4, RedHatAI's
# ...-FP8-dynamic and -quantized.w4a16, nvidia's ...-FP4): the base model's shapes in that format
# (runners/quant.py), longest suffixes first
QUANTIZED_SUFFIXES = (("-fp8-dynamic", "fp8"), ("-awq-int4", "awq"), ("-gptq-int4", "gptq"),
                      ("-gptq-int8", "int8-weight-only"), ("-quantized.w4a16", "int4"), ("-quantized.w8a8", "int8"),
                      ("-quantized.w8a16", "int8-weight-only"), ("-fp8", "fp8"), ("-awq", "awq"), ("-gptq", "gptq"),
                      ("-nvfp4", "nvfp4"), ("-fp4", "nvfp4"))


def find_model(name: str) -> ModelPreset:
    """A preset by its name, or by the Hugging Face id it was copied from (``org/Model``, a local path
    ending in it or in ``Model`` alone, with or without ``-Instruct``, an ``-hf``/``-Base`` suffix: same
    shapes); a quantised checkpoint of one (``QUANTIZED_SUFFIXES``) is that preset in its format."""
    try:
        return _find_model(name)
    except ServelabError:
        stem = name.strip().rstrip("/")
        for suffix, fmt in QUANTIZED_SUFFIXES:
            if stem.lower().endswith(suffix):
                try:
                    preset = _find_model(stem[: -len(suffix)])
                except ServelabError:
                    break
                if preset.quantization:  # (a checkpoint quantised already: not the base model's shapes)
                    break
                return replace(preset, name=f"{preset.name}-{fmt}", hf_id=name, quantization=fmt)
        raise


def _find_model(name: str) -> ModelPreset:
    if name.lower() in MODELS:
        return MODELS[name.lower()]

    def base(hf_id: str) -> str:
        tail = "/".join(hf_id.strip("/").split("/")[-2:]).lower()
        for suffix in ("-hf", "-chat", "-base"):
            tail = tail.removesuffix(suffix)
        tail = tail.replace("-instruct", "")  # also mid-name: Mixtral-8x7B-Instruct-v0.1
        return tail.replace("/meta-llama-", "/llama-")  # Meta-Llama-3.1-8B, the older id of Llama-3.1-8B

    wanted = base(name)
    for preset in MODELS.values():
        if base(preset.hf_id) == wanted:
            return preset
    # a local folder named as the repository (/models/Qwen3-8B): the name alone, where one preset has it
    named = [p for p in MODELS.values() if base(p.hf_id).split("/")[-1] == wanted.split("/")[-1]]
    if len(named) == 1:
        return named[0]
    return get_model(name)  # the usual unknown-preset error


def get_gpu(name: str) -> GpuPreset:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ServelabError(f"unknown GPU preset '{name}'{did_you_mean(name, GPUS)} (known: {', '.join(GPUS)})") from None
