"""`roofline`: price an iteration per operator group as max(compute, memory) at calibrated efficiencies.

Each operator group of one transformer layer (QKV/O projections, MLP up/act/down, norms, RoPE,
residual add, attention) costs ``latency + max(flops / (peak x eff_compute), bytes / (bw x
eff_memory))`` on one tensor-parallel shard; the step adds the embedding, the LM head for every
sequence in the batch, two all-reduces per layer under TP (vLLM's custom one-/two-shot kernels or the
NCCL ring by message size, runners/all_reduce.py), and the engine's host overhead (a named,
versioned profile). The efficiencies and latencies come from ``roofline_calibration.json`` (fitted
to public vidur profiles by ``servelab.runners.calibration``) and ``real_calibration.json`` (host
profiles and GPU scales fitted on real vLLM runs, docs/fidelity.md), so nothing here is a guessed
constant.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from servelab.common.errors import ServelabError
from servelab.runners.all_reduce import LINKS, CustomAllReduce, all_reduce_time_s, nccl_time_s, send_time_s
from servelab.runners.base import RUNNERS, RunnerBase, StepPlan, StepShape, picker
from servelab.runners.presets import GpuPreset, ModelPreset, get_gpu, resolve_model

CALIBRATION_FILE = "roofline_calibration.json"
REAL_CALIBRATION_FILE = "real_calibration.json"  # host profiles and GPU scales fitted on real vLLM runs

# vLLM's profile run sizes activations for a full token budget and reserves logits for a full
# batch before handing the rest of gpu_memory_utilization to the KV cache.
ACTIVATION_TOKENS = 8192
LOGIT_SEQS = 256
NON_TORCH_BYTES = 1 << 30  # CUDA context, cuBLAS workspaces, CUDA graphs, NCCL buffers


@dataclass(frozen=True, slots=True)
class OpWork:
    """Work of one operator call on one TP shard for ``T`` tokens: flops = f*T, bytes = w + b*T."""

    flops_per_token: float
    fixed_bytes: float  # weights, read once per call whatever the batch
    bytes_per_token: float  # activations in and out
    calls: float = 1  # calls per layer (Nemotron-H's mean layer: the share of layers that have the op)


# The linear and elementwise operator groups of one layer, named as in vidur's mlp.csv.
LAYER_OPS = ("qkv_proj", "o_proj", "mlp_up", "mlp_act", "mlp_down", "norm", "rope", "add")
VIDUR_OP_COLUMNS = {
    "qkv_proj": ("attn_pre_proj",),
    "o_proj": ("attn_post_proj",),
    "mlp_up": ("mlp_up_proj",),
    "mlp_act": ("mlp_act",),
    "mlp_down": ("mlp_down_proj",),
    "norm": ("input_layernorm", "post_attention_layernorm"),
    "rope": ("attn_rope",),
    "add": ("add",),
    "emb": ("emb",),
}


LINEAR_OPS = ("qkv_proj", "o_proj", "mlp_up", "mlp_down")  # the GEMMs a quantisation format applies to


def layer_ops(model: ModelPreset, tp: int) -> dict[str, OpWork]:
    """Per-shard work of each operator group of one layer (column-parallel in, row-parallel out).
    Weights are read at the linear layers' bytes per weight (a quantisation format's, else the dtype's)."""
    h, d, wb = model.hidden_size, model.dtype_bytes, model.linear_weight_bytes
    # K and V heads per rank (copied when tp > KV heads); MLA's qkv is set below, its rope keeps the heads' split
    kv = model.kv_size / (tp if model.is_mla else model.kv_shards(tp))
    qkv = model.q_size / tp + 2 * kv
    q = o_in = model.q_size / tp
    if model.is_mla:  # latent down-projections on every rank, up-projections and output split over TP
        down, up_proj, out = model.mla_projection_params()
        qkv, o_in = (down + up_proj / tp) / h, out / h / tp
    up = (2 if model.gated_mlp else 1) * model.ffn_size / tp
    f = model.ffn_size / tp
    if model.is_moe:
        # Per token, k experts' worth of MLP work (tensor-parallel experts: each shard holds 1/tp of
        # every expert). fixed_bytes is ONE expert's weights: the step reads those of every expert its
        # tokens route to (RooflineRunner multiplies by ModelPreset.experts_touched).
        k = model.experts_per_token
        return {
            "qkv_proj": OpWork(2 * h * qkv, h * qkv * wb, (h + qkv) * d),
            "o_proj": OpWork(2 * o_in * h, o_in * h * wb, (o_in + h) * d),
            "mlp_up": OpWork(2 * h * up * k, h * up * wb, (h + up * k) * d),
            "mlp_act": OpWork(0.0, 0.0, (up + f) * k * d),
            "mlp_down": OpWork(2 * f * h * k, f * h * wb, (f * k + h) * d),
            "norm": OpWork(0.0, h * d, 2 * h * d, calls=2),
            "rope": OpWork(0.0, 0.0, 2 * (q + kv) * d),
            "add": OpWork(0.0, 0.0, 3 * h * d),
        }
    if model.mlp_only_layers:  # Nemotron-H: the mean layer, a mixer in (n - m) of n layers, an MLP in m
        mlp = model.mlp_only_layers / model.num_layers
        mixer = 1.0 - mlp
        return {
            "qkv_proj": OpWork(2 * h * qkv, h * qkv * wb, (h + qkv) * d, calls=mixer),
            "o_proj": OpWork(2 * o_in * h, o_in * h * wb, (o_in + h) * d, calls=mixer),
            "mlp_up": OpWork(2 * h * up, h * up * wb, (h + up) * d, calls=mlp),
            "mlp_act": OpWork(0.0, 0.0, (up + f) * d, calls=mlp),
            "mlp_down": OpWork(2 * f * h, f * h * wb, (f + h) * d, calls=mlp),
            "norm": OpWork(0.0, h * d, 2 * h * d, calls=1),
            "rope": OpWork(0.0, 0.0, 2 * (q + kv) * d, calls=mixer),
            "add": OpWork(0.0, 0.0, 3 * h * d),
        }
    return {
        "qkv_proj": OpWork(2 * h * qkv, h * qkv * wb, (h + qkv) * d),
        "o_proj": OpWork(2 * o_in * h, o_in * h * wb, (o_in + h) * d),
        "mlp_up": OpWork(2 * h * up, h * up * wb, (h + up) * d),
        "mlp_act": OpWork(0.0, 0.0, (up + f) * d),
        "mlp_down": OpWork(2 * f * h, f * h * wb, (f + h) * d),
        # vLLM fuses the residual add into the two RMSNorms; vidur times them apart (one add).
        "norm": OpWork(0.0, h * d, 2 * h * d, calls=2),
        "rope": OpWork(0.0, 0.0, 2 * (q + kv) * d),
        "add": OpWork(0.0, 0.0, 3 * h * d),
    }


def embedding_op(model: ModelPreset) -> OpWork:
    return OpWork(0.0, 0.0, 2 * model.hidden_size * model.dtype_bytes)  # gather a row, write it


def lm_head_op(model: ModelPreset, tp: int) -> OpWork:
    """Per sequence that gets logits; the vocabulary is split across shards."""
    h, v, d = model.hidden_size, model.vocab_size / tp, model.dtype_bytes
    return OpWork(2 * h * v, h * v * d, h * d + 4 * v)  # float32 logits


@dataclass(frozen=True, slots=True)
class OpCalibration:
    """One operator's fitted efficiencies and per-call latency on one GPU."""

    eff_compute: float
    eff_memory: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class GpuCalibration:
    """Everything fitted for one profiled GPU (see roofline_calibration.json for provenance)."""

    ops: dict[str, OpCalibration]
    prefill_attention: OpCalibration
    decode_attention_latency_s: float
    decode_attention_per_seq_s: float
    decode_attention_eff_memory: float
    all_reduce_latency_s: float
    all_reduce_eff: float
    cpu_base_s: float
    cpu_per_seq_s: float
    cpu_per_extra_worker_s: float

    @classmethod
    def from_json(cls, raw: dict) -> GpuCalibration:
        ops = {name: OpCalibration(**vals) for name, vals in raw["ops"].items()}
        dec, ar, cpu = raw["decode_attention"], raw["all_reduce"], raw["cpu_overhead"]
        return cls(
            ops=ops,
            prefill_attention=OpCalibration(**raw["prefill_attention"]),
            decode_attention_latency_s=dec["latency_s"],
            decode_attention_per_seq_s=dec["per_seq_s"],
            decode_attention_eff_memory=dec["eff_memory"],
            all_reduce_latency_s=ar["latency_s"],
            all_reduce_eff=ar["eff"],
            cpu_base_s=cpu["base_s"],
            cpu_per_seq_s=cpu["per_seq_s"],
            cpu_per_extra_worker_s=cpu["per_extra_worker_s"],
        )


def load_calibration_file() -> dict:
    return json.loads((Path(__file__).parent / CALIBRATION_FILE).read_text())


def load_real_calibration_file() -> dict:
    return json.loads((Path(__file__).parent / REAL_CALIBRATION_FILE).read_text())


def load_calibration(key: str) -> GpuCalibration:
    """A profiled GPU's fit, or a GPU derived from one by real-run scales (real_calibration.json
    ``derived_gpus``: efficiencies times ``memory_scale`` / ``compute_scale``, capped at 1)."""
    data = load_calibration_file()
    derived = load_real_calibration_file().get("derived_gpus", {})
    if key in derived:
        d = derived[key]
        base = load_calibration(d["from"])
        ms, cs = float(d["memory_scale"]), float(d["compute_scale"])

        def scaled(op: OpCalibration) -> OpCalibration:
            return OpCalibration(min(1.0, op.eff_compute * cs) if op.eff_compute < 1.0 else 1.0,
                                 min(1.0, op.eff_memory * ms), op.latency_s)

        return replace(base, ops={n: scaled(op) for n, op in base.ops.items()},
                       prefill_attention=scaled(base.prefill_attention),
                       decode_attention_eff_memory=min(1.0, base.decode_attention_eff_memory * ms))
    try:
        return GpuCalibration.from_json(data["gpus"][key])
    except KeyError:
        known = ", ".join([*data["gpus"], *derived])
        raise ServelabError(f"{CALIBRATION_FILE} has no calibration '{key}' (has: {known})") from None


@dataclass(frozen=True, slots=True)
class HostProfile:
    """How one engine version spends time outside the GPU kernels' own work (named, versioned, in
    real_calibration.json ``host_profiles``): CPU overhead per step, and how much of each kernel's
    fitted launch latency remains (CUDA-graph replay hides most of it for small batches)."""

    name: str
    cpu_base_s: float
    cpu_per_seq_s: float
    cpu_per_extra_worker_s: float
    launch_scale: float  # multiplies every fitted per-call latency, for steps of <= graph_max_tokens tokens
    graph_max_tokens: int  # the largest batch CUDA graphs are captured for (0: no graphs)
    compute_scale: float  # multiplies GEMM compute efficiencies (capped at 1): newer kernels
    # under async scheduling, the share of the CPU time per step still on a step's critical path (the rest
    # runs while the GPU works); 1.0: none hidden (a profile that does not say)
    async_host_share: float = 1.0


def load_host_profile(name: str) -> HostProfile | None:
    """None for the GPU calibration's own CPU fit (profile ``vidur-2023``)."""
    profiles = load_real_calibration_file().get("host_profiles", {})
    if name == "vidur-2023":
        return None
    try:
        raw = profiles[name]
    except KeyError:
        raise ServelabError(f"runner 'roofline': unknown host profile '{name}' "
                            f"(known: vidur-2023, {', '.join(profiles)})") from None
    return HostProfile(name=name, **{k: raw[k] for k in HostProfile.__slots__ if k != "name" and k in raw})


def apply_host_profile(cal: GpuCalibration, profile: HostProfile | None) -> GpuCalibration:
    """The calibration with the profile's CPU overhead and compute efficiency (launch latencies are
    scaled per step in the runner, since CUDA graphs only cover small batches)."""
    if profile is None:
        return cal
    ops = {name: replace(op, eff_compute=min(1.0, op.eff_compute * profile.compute_scale)) if op.eff_compute < 1.0
           else op for name, op in cal.ops.items()}
    return replace(cal, ops=ops, cpu_base_s=profile.cpu_base_s, cpu_per_seq_s=profile.cpu_per_seq_s,
                   cpu_per_extra_worker_s=profile.cpu_per_extra_worker_s)


def op_time_s(work: OpWork, cal: OpCalibration, gpu: GpuPreset, tokens: float) -> float:
    """Roofline time of ``work.calls`` calls on ``tokens`` tokens (0 when there are none)."""
    if tokens <= 0:
        return 0.0
    compute = work.flops_per_token * tokens / (gpu.peak_flops * cal.eff_compute)
    memory = (work.fixed_bytes + work.bytes_per_token * tokens) / (gpu.hbm_bytes_per_s * cal.eff_memory)
    return work.calls * (cal.latency_s + max(compute, memory))


def activation_reserve_bytes(model: ModelPreset, tp: int, activation_tokens: int = ACTIVATION_TOKENS,
                             logit_seqs: int = LOGIT_SEQS, non_torch_bytes: int = NON_TORCH_BYTES) -> int:
    """Per GPU: peak MLP activations of the profiling run (a full ``max_num_batched_tokens`` batch),
    logits for ``max_num_seqs`` sequences, non-torch memory (CUDA context, workspaces, graphs)."""
    up = (2 if model.gated_mlp else 1) * model.ffn_size // tp
    act = activation_tokens * (up + model.ffn_size // tp + 2 * model.hidden_size) * model.dtype_bytes
    logits = logit_seqs * (model.vocab_size // tp) * 4
    return act + logits + non_torch_bytes


def weight_bytes_per_gpu(model: ModelPreset, tp: int, dp: int = 1, pp: int = 1) -> float:
    """Weights one GPU holds: 1/tp of every layer, of 1/pp of the layers; with data parallelism an MoE
    model's routed experts are spread over all dp x tp GPUs (expert parallel, or vLLM's flattened
    expert TP), while attention and the other dense weights are copied into every DP rank. K and V
    projections copied over ranks (more ranks than KV heads) count once per copy."""
    copied, shards = 0.0, model.kv_shards(tp)
    if shards < tp and not model.is_mla:  # each rank holds 1/shards of them, not 1/tp
        kv_proj = model.attention_layers * 2 * model.hidden_size * model.kv_size * model.linear_weight_bytes
        copied = kv_proj * (1 / shards - 1 / tp)
    if dp == 1 and pp == 1:
        return model.weight_bytes / tp + copied
    experts = model.expert_weight_bytes
    return ((model.weight_bytes - experts) / tp + experts / (tp * dp) + copied) / pp


def kv_capacity_tokens(model: ModelPreset, gpu: GpuPreset, tp: int, gpu_memory_utilization: float = 0.9,
                       activation_tokens: int = ACTIVATION_TOKENS, logit_seqs: int = LOGIT_SEQS,
                       non_torch_bytes: int = NON_TORCH_BYTES, dp: int = 1, pp: int = 1) -> int:
    """KV tokens one engine of ``tp`` x ``pp`` GPUs holds (one DP rank; every stage of a pipeline
    together): what vLLM's memory profiling leaves for the cache."""
    per_gpu = kv_memory_bytes(model, gpu, tp, gpu_memory_utilization, activation_tokens, logit_seqs, non_torch_bytes,
                              dp, pp)
    shards = model.kv_shards(tp)  # MLA's latent, or KV heads copied over ranks: fewer distinct shards than GPUs
    if pp == 1:
        return int(per_gpu * shards // model.kv_bytes_per_token)
    return int(per_gpu * shards * pp // model.kv_bytes_per_token)


def kv_memory_bytes(model: ModelPreset, gpu: GpuPreset, tp: int, gpu_memory_utilization: float = 0.9,
                    activation_tokens: int = ACTIVATION_TOKENS, logit_seqs: int = LOGIT_SEQS,
                    non_torch_bytes: int = NON_TORCH_BYTES, dp: int = 1, pp: int = 1) -> float:
    """Bytes one GPU has for the KV cache beside the weights and the profiling run's reserve."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ServelabError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    weights = weight_bytes_per_gpu(model, tp, dp, pp)
    per_gpu = (gpu.memory_bytes * gpu_memory_utilization - weights
               - activation_reserve_bytes(model, tp, activation_tokens, logit_seqs, non_torch_bytes))
    if per_gpu <= 0:
        layout = f"{tp} x {gpu.name}" if dp == 1 and pp == 1 else f"tp {tp} x dp {dp} x pp {pp} {gpu.name}"
        raise ServelabError(
            f"{model.name} does not fit on {layout} at gpu_memory_utilization="
            f"{gpu_memory_utilization}: weights alone need {weights / 2**30:.1f} GiB per GPU"
        )
    return per_gpu


HYBRID_FIELDS = ("sliding_window", "sliding_layers", "state_layers", "state_bytes", "mlp_only_layers")


def preset_dict(model: ModelPreset) -> dict:
    """The preset's fields for run.json; a model without hybrid attention leaves those fields out
    (so its description is what it was before they existed)."""
    out = asdict(model)
    if not model.is_hybrid:
        for key in HYBRID_FIELDS:
            del out[key]
    return out


# vLLM's LoRA-wrapped layers in a decoder layer: merged QKV, O, merged gate/up, down; each runs a shrink
# (x @ A, to the rank) and an expand (@ B, back out) kernel over the batch (punica's SGMV / vLLM's Triton ops).
LORA_LAYERS = 4


def lora_params_per_rank(model: ModelPreset) -> int:
    """An adapter's parameters per unit of rank: ``in + out`` of every linear layer it targets (q, k, v,
    o, gate, up, down), over all layers. A mixture-of-experts model's adapters cover attention only."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h)
    if not model.is_moe:
        per_layer += (2 if model.gated_mlp else 1) * (h + model.ffn_size) + (model.ffn_size + h)
    return model.num_layers * per_layer


class _Rates(NamedTuple):
    """Constants of the attention terms, computed once per runner."""

    kv_bytes_per_token: float  # per layer and shard
    prefill_flops_per_s: float  # prefill attention: achieved FLOP/s ...
    prefill_bytes_per_s: float  # ... and bytes/s
    decode_s_per_kv_token: float  # whole model: the slope b of decode_affine


@dataclass(frozen=True)
class RooflineRunner(RunnerBase):
    """The roofline cost model: each step priced from the model's operators on the GPU."""

    model: ModelPreset
    gpu: GpuPreset
    tp: int
    calibration: GpuCalibration
    cpu_overhead_scale: float = 1.0  # 0 prices the GPU alone
    name: str = "roofline"
    host_profile: HostProfile | None = None  # None: the calibration's own (vidur 2023) CPU overhead, no graphs
    activation_tokens: int = ACTIVATION_TOKENS  # vLLM's profiling batch: max_num_batched_tokens
    logit_seqs: int = LOGIT_SEQS  # max_num_seqs
    non_torch_bytes: int = NON_TORCH_BYTES
    custom_all_reduce: CustomAllReduce | None = None  # None: every all-reduce is the NCCL ring (vLLM before 0.2.7)
    ep: int = 1  # MoE: experts split across this many GPUs, tp x dp (1: every expert tensor-parallel)
    dp: int = 1  # data-parallel ranks: engines of tp x pp GPUs each (docs/runners.md "Parallelism")
    pp: int = 1  # pipeline stages
    # vLLM's async scheduling: the host's work for a step (scheduling, inputs) runs while the GPU runs the one
    # before; the host profile's async_host_share of it stays on the step's path (docs/runners.md "Host profiles")
    host_overlap: bool = False
    # Per-op constants folded once so that step_time is a few dozen float operations.
    _ops: tuple = field(init=False, repr=False)
    _head: tuple = field(init=False, repr=False)
    _graph_ops: tuple = field(init=False, repr=False)  # the same with the host profile's launch latencies
    _expert: tuple = field(init=False, repr=False)  # per layer op: priced per expert routed to (MoE)
    _shared: tuple = field(init=False, repr=False)  # a shared expert's MLP ops (MoE with one)
    _graph_head: tuple = field(init=False, repr=False)
    _rates: _Rates = field(init=False, repr=False)
    # The terms that depend on one count only (tokens, sequences, decodes), memoised per instance:
    # step_time is then a few lookups plus the prefill attention.
    _by_tokens: Any = field(init=False, repr=False, compare=False, hash=False)
    _by_seqs: Any = field(init=False, repr=False, compare=False, hash=False)
    _by_decodes: Any = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        m, g, tp = self.model, self.gpu, self.tp
        try:
            m.check_tp(tp)
        except ValueError as err:
            raise ServelabError(f"runner 'roofline': {err}") from None
        if self.dp < 1 or not 1 <= self.pp <= m.num_layers:
            raise ServelabError(f"runner 'roofline': dp={self.dp} must be >= 1 and pp={self.pp} in 1..{m.num_layers} "
                                f"(the {m.name} layers)")
        if self.ep != 1 and not (m.is_moe and self.ep == tp * self.dp and m.num_experts % self.ep == 0):
            raise ServelabError(
                f"runner 'roofline': ep={self.ep} needs a mixture-of-experts model, ep equal to tp x dp "
                f"({tp} x {self.dp}) and dividing its {m.num_experts} experts ({m.name})"
            )
        missing = set(LAYER_OPS + ("emb",)) - set(self.calibration.ops)
        if missing:
            raise ServelabError(f"{CALIBRATION_FILE}: calibration '{g.calibration}' lacks ops {sorted(missing)}")
        speedup = self._gemm_speedup
        object.__setattr__(self, "_ops", tuple(
            self._fold(w, self.calibration.ops[n], speedup=speedup if n in LINEAR_OPS else 1.0)
            for n, w in layer_ops(m, tp).items()))
        object.__setattr__(
            self,
            "_head",
            (
                self._fold(embedding_op(m), self.calibration.ops["emb"]),
                self._fold(layer_ops(m, tp)["norm"], self.calibration.ops["norm"], calls=1),  # final norm
                self._fold(lm_head_op(m, tp), self.calibration.ops["mlp_up"]),  # a wide GEMM like mlp_up
            ),
        )
        expert_ops = {"mlp_up", "mlp_down"} if m.is_moe else set()
        object.__setattr__(self, "_expert", tuple(n in expert_ops for n in layer_ops(m, tp)))
        shared = ()
        if m.shared_ffn_size:
            sm = replace(m, ffn_size=m.shared_ffn_size, num_experts=0, experts_per_token=0, shared_ffn_size=0)
            shared = tuple(self._fold(layer_ops(sm, tp)[n], self.calibration.ops[n],
                                      speedup=speedup if n in LINEAR_OPS else 1.0)
                           for n in ("mlp_up", "mlp_act", "mlp_down"))
        object.__setattr__(self, "_shared", shared)
        scale = self.host_profile.launch_scale if self.host_profile is not None else 1.0
        object.__setattr__(self, "_graph_ops", tuple((c, lat * scale, *rest) for c, lat, *rest in self._ops))
        object.__setattr__(self, "_graph_head", tuple((c, lat * scale, *rest) for c, lat, *rest in self._head))
        pa = self.calibration.prefill_attention
        object.__setattr__(self, "_rates", _Rates(self._kv_bytes_per_token_layer_shard, g.peak_flops * pa.eff_compute,
                                                  g.hbm_bytes_per_s * pa.eff_memory, self._decode_s_per_kv_token))
        for name, fn in (("_by_tokens", self._token_terms), ("_by_seqs", self._seq_terms),
                         ("_by_decodes", self._decode_attention_fixed_s)):
            object.__setattr__(self, name, lru_cache(maxsize=1 << 16)(fn))

    def __reduce__(self):  # pickle the inputs; the folded constants and memos are rebuilt
        return (type(self), (self.model, self.gpu, self.tp, self.calibration, self.cpu_overhead_scale, self.name,
                             self.host_profile, self.activation_tokens, self.logit_seqs, self.non_torch_bytes,
                             self.custom_all_reduce, self.ep, self.dp, self.pp, self.host_overlap))

    @property
    def _gemm_speedup(self) -> float:
        """How much faster than bf16 the linear layers' tensor cores run the model's weight format."""
        if not self.model.quantization:
            return 1.0
        from servelab.runners.quant import compute_speedup, weight_format

        return compute_speedup(weight_format(self.model.quantization), self.gpu.fp8, self.gpu.fp4)

    def _fold(self, work: OpWork, cal: OpCalibration, calls: int | None = None,
              speedup: float = 1.0) -> tuple[float, ...]:
        bw = self.gpu.hbm_bytes_per_s * cal.eff_memory
        peak = self.gpu.peak_flops if speedup == 1.0 else self.gpu.peak_flops * speedup
        return (
            float(work.calls if calls is None else calls),
            cal.latency_s,
            work.flops_per_token / (peak * cal.eff_compute),
            work.fixed_bytes / bw,
            work.bytes_per_token / bw,
        )

    @staticmethod
    def _op(folded: tuple[float, ...], tokens: int) -> float:
        calls, lat, compute, fixed, per_token = folded
        return calls * (lat + max(compute * tokens, fixed + per_token * tokens))

    def _token_terms(self, tokens: int) -> tuple[float, float, float, float, float]:
        """One layer's linear ops, embedding + final norm, and one layer's communication: two
        all-reduces, or with expert parallelism one all-reduce plus an all-to-all dispatch and combine;
        then the embedding and the final norm apart (pipeline stages hold one each)."""
        graphed = self.host_profile is not None and tokens <= self.host_profile.graph_max_tokens
        return self._token_parts(tokens, tokens, graphed)

    def _token_parts(self, tokens: float, expert_tokens: float,
                     graphed: bool) -> tuple[float, float, float, float, float]:
        """``_token_terms`` with the experts (their ops and their dispatch) seeing ``expert_tokens`` per
        DP rank, and the CUDA-graph choice given (a DP group's ranks in lockstep: replay/core/lockstep.py)."""
        op = self._op
        ops, head = (self._graph_ops, self._graph_head) if graphed else (self._ops, self._head)
        emb, final_norm, _ = head
        if self.model.is_moe:
            # Under DP every rank's experts see the tokens of all dp ranks (``expert_tokens`` each), and
            # hold 1/dp of the experts this rank's folded weights assume.
            touched = self.model.experts_touched(expert_tokens * self.dp) / self.dp
            layer = 0.0
            for (c, lat, comp, fixed, per), expert in zip(ops, self._expert):
                n = expert_tokens if expert else tokens
                layer += c * (lat + max(comp * n, fixed * (touched if expert else 1.0) + per * n))
            layer += sum(op(f, tokens) for f in self._shared)
        else:
            layer = sum(op(f, tokens) for f in ops)
        if self.ep > 1:
            comm = self.all_reduce_s(tokens) + 2 * self.all_to_all_s(expert_tokens)
        elif self.dp > 1 and self.model.is_moe:
            comm = self.all_reduce_s(tokens) + self.dp_expert_all_reduce_s(expert_tokens)
        else:
            comm = 2 * self.all_reduce_s(tokens)
        emb_s, norm_s = op(emb, tokens), op(final_norm, tokens)
        return (layer, emb_s + norm_s, comm, emb_s, norm_s)

    def _seq_terms(self, seqs: int) -> tuple[float, float]:
        """The LM head (logits at the last position of every sequence) and the CPU overhead."""
        return self._op(self._head[2], seqs), self.cpu_overhead_s(seqs)

    # --- per-shard attention work per layer -------------------------------------------------
    @property
    def _kv_bytes_per_token_layer_shard(self) -> float:
        m = self.model  # (MLA's latent is read whole on every rank)
        return m.kv_bytes_per_token_layer / m.kv_shards(self.tp)

    @property
    def _layers_priced(self) -> int:
        """Layers a step pays for: all of them, or under PP every stage at the largest stage's count."""
        if self.pp == 1:
            return self.model.num_layers
        return self.pp * math.ceil(self.model.num_layers / self.pp)

    @property
    def _decode_s_per_kv_token(self) -> float:
        """Seconds per KV token a decode reads, whole model: the slope ``b`` of decode_affine."""
        bw = self.gpu.hbm_bytes_per_s * self.calibration.decode_attention_eff_memory
        return self._layers_priced * self._kv_bytes_per_token_layer_shard / bw

    def _decode_attention_fixed_s(self, num_seqs: int) -> float:
        """Per layer, the part of decode attention that does not depend on the KV read."""
        if num_seqs <= 0:
            return 0.0
        c = self.calibration
        qo_bytes = 2 * self.model.q_size / self.tp * self.model.dtype_bytes
        bw = self.gpu.hbm_bytes_per_s * c.decode_attention_eff_memory
        return c.decode_attention_latency_s + c.decode_attention_per_seq_s * num_seqs + num_seqs * qo_bytes / bw

    def decode_attention_s(self, num_seqs: int, context_tokens: int) -> float:
        """Per layer. Memory-bound by construction: linear in the KV tokens read (docs/runners.md)."""
        if num_seqs <= 0:
            return 0.0
        return self._decode_attention_fixed_s(num_seqs) + context_tokens * self._decode_s_per_kv_token / self._layers_priced

    def prefill_attention_s(self, shape: StepShape) -> float:
        if shape.prefill_tokens <= 0:
            return 0.0
        cal, m = self.calibration.prefill_attention, self.model
        rates = self._rates
        flops = 4.0 * shape.prefill_attention_pairs * m.head_dim * m.num_heads / self.tp
        nbytes = (
            shape.prefill_context_tokens * rates.kv_bytes_per_token
            + shape.prefill_tokens * 2 * m.q_size / self.tp * m.dtype_bytes
        )
        compute = flops / rates.prefill_flops_per_s
        memory = nbytes / rates.prefill_bytes_per_s
        return cal.latency_s + max(compute, memory)

    def all_reduce_s(self, tokens: int) -> float:
        """All-reduce of the hidden states by the implementation vLLM picks for the message size
        (runners/all_reduce.py): custom one-shot or two-shot over NVLink, else the NCCL ring."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        c = self.calibration
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
        return all_reduce_time_s(nbytes, self.tp, self.gpu.interconnect_bytes_per_s, c.all_reduce_latency_s,
                                 c.all_reduce_eff, self.gpu.p2p_ranks, self.custom_all_reduce, self.gpu.link)

    def all_to_all_bytes(self, tokens: int) -> float:
        """Bytes one GPU moves in the dispatch (or the combine) of a layer under expert parallelism, as
        vLLM's default all2all backend (``allgather_reducescatter``) moves them: the dispatch all-gathers
        the hidden states of every GPU's 1/tp of its DP rank's ``tokens`` over the ep GPUs (each token
        once to every other GPU, whichever of them hold its k experts), the combine reduce-scatters the
        experts' outputs back: (ep - 1) x tokens/tp hidden states per GPU. (DeepEP and pplx, opt-in,
        send a token only to the GPUs of its experts: not modelled.)"""
        m = self.model
        return (self.ep - 1) * tokens / self.tp * m.hidden_size * m.dtype_bytes

    def all_to_all_s(self, tokens: int) -> float:
        """Expert parallelism: the dispatch (or the combine) of a layer, ``all_to_all_bytes`` in a ring
        of ep - 1 steps over the GPU's link, with the NCCL fit's latency and efficiency and the link's
        terms (runners/all_reduce.py)."""
        if self.ep <= 1 or tokens <= 0:
            return 0.0
        c = self.calibration
        return nccl_time_s(self.all_to_all_bytes(tokens), self.ep - 1, self.gpu.interconnect_bytes_per_s,
                           c.all_reduce_latency_s, c.all_reduce_eff, self.gpu.link)

    def dp_expert_all_reduce_s(self, tokens: int) -> float:
        """MoE under DP without expert parallelism: vLLM gathers every DP rank's tokens and runs the
        experts tensor-parallel over all dp x tp GPUs, then reduce-scatters the results; an all-gather
        plus a reduce-scatter move one ring all-reduce's bytes of the dp ranks' tokens."""
        ranks = self.dp * self.tp
        nbytes = tokens * self.dp * self.model.hidden_size * self.model.dtype_bytes
        c = self.calibration
        return nccl_time_s(2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1), self.gpu.interconnect_bytes_per_s,
                           c.all_reduce_latency_s, c.all_reduce_eff, self.gpu.link)

    def stage_send_bytes(self, tokens: int) -> float:
        """Bytes each GPU of a pipeline stage sends to the next: vLLM passes the hidden states and the
        residual (2 x tokens x hidden), split over the stage's tp ranks (the receivers all-gather)."""
        return 2 * tokens * self.model.hidden_size * self.model.dtype_bytes / self.tp

    def stage_send_s(self, tokens: int) -> float:
        """Pipeline parallelism: activations from one stage to the next (send, then the receiving
        stage's all-gather of the tp pieces)."""
        if self.pp <= 1 or tokens <= 0:
            return 0.0
        c, g = self.calibration, self.gpu
        nbytes = self.stage_send_bytes(tokens)
        t = send_time_s(nbytes, g.interconnect_bytes_per_s, c.all_reduce_latency_s, c.all_reduce_eff, g.link)
        if self.tp > 1:
            t += nccl_time_s((self.tp - 1) * nbytes, self.tp - 1, g.interconnect_bytes_per_s, c.all_reduce_latency_s,
                             c.all_reduce_eff, g.link)
        return t

    def cpu_overhead_s(self, num_seqs: int) -> float:
        c = self.calibration
        return self.cpu_overhead_scale * (
            c.cpu_base_s + c.cpu_per_seq_s * num_seqs + c.cpu_per_extra_worker_s * (self.tp * self.pp - 1)
        )

    # --- the Runner protocol ----------------------------------------------------------------
    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        tokens = s.prefill_tokens + s.decode_seqs
        if tokens <= 0:
            return 0.0
        seqs = s.prefill_seqs + s.decode_seqs
        layer, head, all_reduce, emb, final_norm = self._by_tokens(tokens)
        layer += self.prefill_attention_s(s) + all_reduce
        layer += self._by_decodes(s.decode_seqs)
        # vLLM computes logits at the last scheduled position of every sequence, partial prefills too.
        lm_head, cpu = self._by_seqs(seqs)
        if self.pp > 1:
            # A batch passes every stage in turn, each priced as the largest (ceil(L/pp) layers plus the
            # heavier of the first stage's embedding and the last's norm + LM head; a smaller stage's
            # slack is the bubble), with the activations sent between stages.
            stage = math.ceil(self.model.num_layers / self.pp) * layer + max(emb, final_norm + lm_head)
            fixed = self.pp * stage + (self.pp - 1) * self.stage_send_s(tokens)
        else:
            once = head + lm_head
            fixed = self.model.num_layers * layer + once
        if not self.host_overlap:
            fixed += cpu
        else:  # async scheduling: only a share of the host's work on the step's path, the host itself at least
            fixed = max(fixed + self.host_profile.async_host_share * cpu, cpu)
        # The KV read of decodes is added last, so a pure-decode step is decode_affine's a + b*C bit for bit
        # (under host_overlap the max is the GPU's side for any real model, whose weights alone outlast the host).
        return fixed + self._rates.decode_s_per_kv_token * s.decode_context_tokens

    @property
    def dp_lockstep(self) -> bool:
        """Whether this replica's DP ranks step together (vLLM with an MoE model and dp > 1: the experts'
        collectives join every rank in every forward pass, an idle rank runs a dummy batch, and each rank
        pads its tokens to the most any rank has: replay/core/lockstep.py). Pipeline stages are not
        locked (their virtual engines keep their own steps)."""
        return self.dp > 1 and self.model.is_moe and self.pp == 1

    @property
    def dp_capture_tokens(self) -> int:
        """The largest step vLLM runs as a CUDA graph: its default capture sizes stop at
        min(2 x max_num_seqs, 512, max_num_batched_tokens), within the host profile's own bound (0: the
        profile captures none)."""
        if self.host_profile is None:
            return 0
        return min(self.host_profile.graph_max_tokens, 2 * self.logit_seqs, self.activation_tokens)

    def dp_lockstep_s(self, tokens: int, group_tokens: tuple[int, ...]) -> float:
        """Seconds to add to a step of ``tokens`` tokens priced alone (``step_time``) when its DP group's
        ranks carry ``group_tokens`` in this step (this rank's among them), as vLLM runs them:

        - every rank's step fits a CUDA graph (``dp_capture_tokens``): each rank pads its batch to the
          most tokens any rank has, which go through every layer's linear ops, experts and collectives,
          and the embedding and final norm (not attention, the LM head or the CPU's work);
        - else every rank runs eager (the ranks agree on the least graph mode), unpadded: its own tokens
          through its dense ops, and the experts and their dispatch see every rank's tokens (their mean
          per rank).
        The ranks then wait for the slowest (replay/core/lockstep.py takes the max)."""
        most = max(group_tokens)
        alone = self._by_tokens(tokens)
        layers = self.model.num_layers
        if most <= self.dp_capture_tokens:
            if most <= tokens:
                return 0.0
            padded = self._by_tokens(most)
            return layers * (padded[0] + padded[2] - alone[0] - alone[2]) + padded[1] - alone[1]
        mean = sum(group_tokens) / len(group_tokens)
        locked = self._token_parts(tokens, mean, False)
        return layers * (locked[0] + locked[2] - alone[0] - alone[2]) + locked[1] - alone[1]

    @property
    def lora_params_per_rank(self) -> int:
        return lora_params_per_rank(self.model)

    @property
    def lora_dtype_bytes(self) -> int:
        return self.model.dtype_bytes

    def lora_step_s(self, rank_tokens: int, ranks: list[int]) -> float:
        """The LoRA kernels of one iteration: for ``rank_tokens`` = sum of tokens x rank over the items
        with an adapter, 2 x rank_tokens x params_per_rank / tp FLOPs (shrink and expand), reading
        each distinct adapter's weights (``ranks``) once and the rank-wide intermediate twice, at the
        GEMM calibration's efficiencies, plus a shrink and an expand launch per LoRA layer."""
        if rank_tokens <= 0:
            return 0.0
        m, cal = self.model, self.calibration.ops["mlp_up"]
        per_rank = lora_params_per_rank(m) / self.tp
        flops = 2.0 * rank_tokens * per_rank
        weights = sum(ranks) * per_rank * m.dtype_bytes
        buffers = 2.0 * rank_tokens * LORA_LAYERS * m.num_layers * m.dtype_bytes
        compute = flops / (self.gpu.peak_flops * cal.eff_compute)
        memory = (weights + buffers) / (self.gpu.hbm_bytes_per_s * cal.eff_memory)
        launch = cal.latency_s * (self.host_profile.launch_scale if self.host_profile is not None else 1.0)
        return 2 * LORA_LAYERS * m.num_layers * launch + max(compute, memory)

    def decode_affine(self, num_seqs: int) -> tuple[float, float]:
        if num_seqs <= 0:
            return 0.0, 0.0
        return self.step_time(StepPlan(StepShape(decode_seqs=num_seqs))), self._decode_s_per_kv_token

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        return kv_capacity_tokens(self.model, self.gpu, self.tp, gpu_memory_utilization, self.activation_tokens,
                                  self.logit_seqs, self.non_torch_bytes, self.dp, self.pp)

    def describe(self) -> dict:
        return {
            "runner": self.name,
            "model": preset_dict(self.model),
            "gpu": asdict(self.gpu),
            "tp": self.tp,
            "cpu_overhead_scale": self.cpu_overhead_scale,
            "host_profile": asdict(self.host_profile) if self.host_profile is not None else None,
            "activation_tokens": self.activation_tokens,
            "logit_seqs": self.logit_seqs,
            "non_torch_bytes": self.non_torch_bytes,
            "ep": self.ep,
            "dp": self.dp,
            "pp": self.pp,
            **({"host_overlap": True} if self.host_overlap else {}),  # (left out when off: run.json as before)
            "custom_all_reduce": asdict(self.custom_all_reduce) if self.custom_all_reduce is not None else None,
            "calibration_key": self.gpu.calibration,
            "calibration": asdict(self.calibration),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens_at_0.9": self.kv_capacity_tokens(0.9) if self._fits() else None,
        }

    @classmethod
    def from_describe(cls, d: dict) -> RooflineRunner:
        """Rebuild the exact runner a run used (run.json keeps ``describe()``), even if presets or the
        packaged calibration have changed since."""
        if cls is RooflineRunner and "kv_layout" in d:  # a hybrid-attention model's runner
            return _variant("hybrid").from_describe(d)
        cal = dict(d["calibration"])
        cal["ops"] = {name: OpCalibration(**v) for name, v in cal["ops"].items()}
        cal["prefill_attention"] = OpCalibration(**cal["prefill_attention"])
        host = d.get("host_profile")
        custom = d.get("custom_all_reduce")
        return cls(ModelPreset(**d["model"]), GpuPreset(**d["gpu"]), int(d["tp"]), GpuCalibration(**cal),
                   cpu_overhead_scale=float(d["cpu_overhead_scale"]),
                   host_profile=HostProfile(**host) if host else None,
                   activation_tokens=int(d.get("activation_tokens", ACTIVATION_TOKENS)),
                   logit_seqs=int(d.get("logit_seqs", LOGIT_SEQS)),
                   non_torch_bytes=int(d.get("non_torch_bytes", NON_TORCH_BYTES)),
                   custom_all_reduce=CustomAllReduce(**custom) if custom else None,
                   ep=int(d.get("ep", 1)), dp=int(d.get("dp", 1)), pp=int(d.get("pp", 1)),
                   host_overlap=bool(d.get("host_overlap", False)))

    def _fits(self) -> bool:
        try:
            self.kv_capacity_tokens(0.9)
        except ServelabError:
            return False
        return True


DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100-80gb"
ALL_REDUCE_CHOICES = ("auto", "nccl")
DEFAULT_HOST = "vllm-v1-cudagraph"


def load_custom_all_reduce() -> CustomAllReduce:
    raw = load_real_calibration_file()["custom_all_reduce"]
    return CustomAllReduce(**{k: raw[k] for k in CustomAllReduce.__slots__})


# Runner classes for models the plain roofline does not price alone, each a subclass in its own file
# imported by name when a model needs it: hybrid attention.
VARIANT_MODULES = {"hybrid": "servelab.runners.hybrid"}


def _variant(name: str) -> type:
    import importlib

    return importlib.import_module(VARIANT_MODULES[name]).RUNNER_CLASS


@RUNNERS.register("roofline")
@dataclass(frozen=True, slots=True)
class RooflineParams:
    """``roofline:model=llama-3.1-8b,gpu=h100-80gb,tp=1``. A field left None takes the replay's value (the
    command line's or config's ``--model``, ``--gpu``, ``--tp``, ...), else the default: spec values win.
    Model, GPU and host names are looked up (a model may be a config.json) when the runner is built."""

    model: str | None = None  # a preset or a Hugging Face config.json (default llama-3.1-8b)
    gpu: str | None = None  # a GPU preset (default h100-80gb)
    tp: int | None = None
    cpu_overhead: float = 1.0  # x the host profile's CPU time per step
    host: str = DEFAULT_HOST  # a host profile (real_calibration.json), or vidur-2023
    calibration: str | None = None  # another GPU's fitted efficiencies (e.g. to compare calibrations)
    all_reduce: str | None = None  # auto | nccl (default: auto under a host profile, else nccl)
    ep: int | None = None  # MoE expert parallelism (default: tp x dp with --enable-expert-parallel, else none)
    dp: int | None = None
    pp: int | None = None
    quantization: str | None = None  # vLLM's --quantization ("none", "auto": the model dtype)
    kv_cache_dtype: str | None = None
    link: str | None = None  # what the GPUs talk over, over the GPU preset's: nvlink | pcie | pcie-host

    def __post_init__(self) -> None:
        if self.cpu_overhead < 0:
            raise ServelabError(f"cpu_overhead must be >= 0, got {self.cpu_overhead}")
        if self.link is not None and self.link not in LINKS:
            raise ServelabError(f"link must be one of {', '.join(LINKS)}, got '{self.link}'")
        if self.all_reduce is not None and self.all_reduce not in ALL_REDUCE_CHOICES:
            raise ServelabError(f"all_reduce must be one of {', '.join(ALL_REDUCE_CHOICES)}, got '{self.all_reduce}'")

    def build(self, **context) -> RooflineRunner:
        return make_roofline(self, context)


def make_roofline(params: RooflineParams, context: dict) -> RooflineRunner:
    """The runner ``params`` describe, with ``context`` (the replay's model, GPU, TP, engine limits) for
    what they leave out."""
    pick = picker(params, context)

    model = resolve_model(str(pick("model", DEFAULT_MODEL)))
    hybrid = model.is_hybrid  # (a quantisation option below keeps the layer kinds)
    # vLLM's --quantization / --kv-cache-dtype over the checkpoint's own (runners/quant.py)
    quant = {key: str(pick(key, "")) for key in ("quantization", "kv_cache_dtype") if pick(key, None) is not None}
    if quant.get("quantization", "").lower() in ("none", "auto"):
        quant["quantization"] = ""
    if quant:
        try:
            model = replace(model, **quant)
        except ValueError as err:
            raise ServelabError(f"runner 'roofline': {err}") from None
    gpu = get_gpu(str(pick("gpu", DEFAULT_GPU)))
    if params.link is not None and params.link != gpu.link:  # the machine's own link (peer-to-peer or not)
        gpu = replace(gpu, link=params.link, p2p_ranks=gpu.p2p_ranks if params.link == "nvlink" else 0)
    tp = pick("tp", 1)
    scale = params.cpu_overhead
    profile = load_host_profile(params.host)
    if params.calibration is not None:
        gpu = replace(gpu, calibration=params.calibration)
    calibration = apply_host_profile(load_calibration(gpu.calibration), profile)
    # auto: vLLM's choice by message size (custom kernels exist since vLLM 0.2.7, so not under the
    # 2023 profile, whose all-reduce fit is NCCL's); nccl: the ring at every size.
    all_reduce = params.all_reduce or ("auto" if profile is not None else "nccl")
    kv: dict[str, Any] = {"custom_all_reduce": load_custom_all_reduce() if all_reduce == "auto" else None}
    if profile is not None:  # vLLM V1 sizes the profiling run by the engine's own limits
        for key, name in (("activation_tokens", "max_num_batched_tokens"), ("logit_seqs", "max_num_seqs")):
            if context.get(name) is not None:
                kv[key] = int(context[name])
        kv["non_torch_bytes"] = int(load_real_calibration_file()["host_profiles"][profile.name]["non_torch_bytes"])
    dp = pick("dp", 1)
    pp = pick("pp", 1)
    if dp != 1:
        kv["dp"] = dp
    if pp != 1:
        kv["pp"] = pp
    if context.get("async_scheduling") and profile is not None:  # (the 2023 profile's engine had no async)
        kv["host_overlap"] = True
    if params.ep is not None:
        kv["ep"] = params.ep
    elif context.get("enable_expert_parallel") and model.is_moe and tp * dp > 1:
        kv["ep"] = tp * dp  # vLLM --enable-expert-parallel: experts over every GPU of the DP x TP group
    if hybrid:  # sliding-window or state layers: KV and attention per layer group
        if context.get("block_size") is not None:
            kv["block_size"] = int(context["block_size"])
        return _variant("hybrid")(model, gpu, tp, calibration, cpu_overhead_scale=scale, host_profile=profile, **kv)
    return RooflineRunner(model, gpu, tp, calibration, cpu_overhead_scale=scale, host_profile=profile, **kv)
