"""The engine's configuration in typed, frozen parts (docs/engine.md "Configuration"): batching, KV,
preemption, the platform's front door, the client's retries and timeout, the cluster's replica count
and horizon, and the features (speculative decoding, multi-LoRA, multimodal encoders, KV retention).

Each part validates its own fields when built. `EngineConfig` (replay/core/engine_config.py) is the flat
view the hot loop reads (``cfg.max_num_seqs``, plain slots: no property in between); building one
builds its parts, so a config is checked once, where it is made: a TOML file, the command line or the
API (``ReplayConfig.from_dict`` adds the file's name to the message). ``EngineConfig.parts()`` gives
the parts, ``EngineConfig.from_parts`` the view of parts. Every engine field is in exactly one part
(tests/test_config_parts.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.common.tiers import DEFAULT_TIERS
from servelab.replay.core.lora import parse_ranks
from servelab.replay.core.kv.retention import check_retention
from servelab.replay.core.spec_config import Acceptance, canonical_method, parse_speculative_config
from servelab.replay.core.specs import parse_failures, parse_kv_tiers, parse_pause, parse_quotas, parse_tier_order

# Most replicas in one pool: a replica costs ~3 KB and a policy instance when built, so 100,000 take
# ~300 MB; a hundred million would end in a MemoryError rather than a result.
MAX_REPLICAS = 100_000
INT32_MAX = 2**31 - 1


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ServelabError(f"{name} must be >= 1, got {getattr(obj, name)}")


def _int32(obj: Any, *names: str) -> None:
    """Counts written to int32 columns (steps.kv_blocks_total, ...): a larger one would wrap negative."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value > INT32_MAX:
            raise ServelabError(f"{name} = {value:,} is too large (at most {INT32_MAX:,})")


def _as_tuple(config: Any, *names: str) -> None:
    """A TOML array or one CLI string -> a tuple of strings, for each field of ``names``."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, str):
            object.__setattr__(config, name, (value,))
        elif not isinstance(value, tuple):
            object.__setattr__(config, name, tuple(str(v) for v in value))


def _choice(obj: Any, name: str, options: tuple[str, ...]) -> None:
    if getattr(obj, name) not in options:
        got = getattr(obj, name)
        raise ServelabError(f"{name} must be one of {', '.join(options)}; got '{got}'{did_you_mean(got, options)}")


@dataclass(frozen=True, slots=True)
class BatchingPart:
    """What one iteration may hold and how it is picked: block size, sequences, tokens, context
    length, head-of-line blocking, async scheduling."""

    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # requests in one iteration
    max_num_batched_tokens: int = 2048  # tokens computed in one iteration (chunked-prefill budget)
    max_model_len: int | None = None  # vLLM's --max-model-len; None = the runner's model's context
    head_of_line: str = "strict"  # strict: stop at the first waiting request that does not fit; skip
    async_scheduling: bool = False  # vLLM >= 0.14's default: step N+1 is picked while step N runs

    def __post_init__(self) -> None:
        _positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ServelabError(f"max_model_len must be >= 1, got {self.max_model_len}")
        _int32(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        _choice(self, "head_of_line", ("strict", "skip"))


@dataclass(frozen=True, slots=True)
class KVPart:
    """The KV cache: its size, allocation, prefix caching and tiers below the GPU."""

    num_gpu_blocks: int | None = None  # per replica; None = derived from the runner's model and GPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use (weights + KV)
    kv_allocation: str = "on-demand"  # on-demand (vLLM) | reserve
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "global"  # global | tenant
    kv_tiers: tuple[str, ...] = ()  # offload tiers below GPU memory, top first (replay/core/kv/tiers.py)
    kv_tier_write: str = "back"  # back | through
    kv_load_overlap_layers: int = 0
    purge_tenants: tuple[str, ...] = ()
    kv_bytes_per_token: int | None = None  # for runners that don't know their model (swap timing)

    def __post_init__(self) -> None:
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ServelabError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        _int32(self, "num_gpu_blocks")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ServelabError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ServelabError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _choice(self, "kv_allocation", ("on-demand", "reserve"))
        _choice(self, "prefix_cache_scope", ("global", "tenant"))
        _choice(self, "kv_tier_write", ("back", "through"))
        if self.kv_load_overlap_layers < 0:
            raise ServelabError(f"kv_load_overlap_layers must be >= 0, got {self.kv_load_overlap_layers}")
        _as_tuple(self, "kv_tiers", "purge_tenants")
        parse_kv_tiers(self.kv_tiers)


@dataclass(frozen=True, slots=True)
class PreemptionPart:
    """What a preempted request's KV does: recomputed or swapped to host memory."""

    preemption: str = "recompute"  # recompute | swap
    swap_space_gb: float = 4.0  # host pool for swapped KV, per replica
    swap_bandwidth_gbps: float = 25.0  # host<->GPU copy bandwidth, GB/s

    def __post_init__(self) -> None:
        _choice(self, "preemption", ("recompute", "swap"))
        if self.swap_space_gb < 0 or self.swap_bandwidth_gbps <= 0:
            raise ServelabError("swap_space_gb must be >= 0 and swap_bandwidth_gbps > 0")


@dataclass(frozen=True, slots=True)
class ClusterPart:
    """Replica count, router, horizon and seed."""

    replicas: int = 1
    router: str = "round-robin"  # a router name (routers/; looked up by servelab.api, not here)
    until_s: float | None = None  # horizon; None = replay until drained
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "replicas")
        if self.replicas > MAX_REPLICAS:
            raise ServelabError(f"replicas = {self.replicas:,} is more than servelab models in one pool "
                                f"(at most {MAX_REPLICAS:,}: each replica is an engine of its own, ~3 KB built)")
        if self.until_s is not None and not (0 <= self.until_s < math.inf):
            raise ServelabError(f"until_s must be a finite number of seconds >= 0, got {self.until_s}")


@dataclass(frozen=True, slots=True)
class PlatformPart:
    """The platform's front door: quotas, queue cap, pause rules, failures, journal."""

    quota: tuple[str, ...] = ()  # "tenant=NAME:rpm=..,tpm=..,concurrency=.." / "tier=NAME:..."
    queue_cap: int | None = None  # most requests waiting across replicas; the lowest tier is shed
    tier_order: str = DEFAULT_TIERS  # tiers highest first, for queue-cap shedding
    pause: str | None = None  # "tier=flex,waiting=32[,resume=8]" or "tier=flex,kv=0.9[,resume=0.7]"
    fail: tuple[str, ...] = ()  # "replica=R,at=T[,for=D]": replica failures
    journal: bool = True  # interrupted requests keep their generated tokens (else they start over)

    def __post_init__(self) -> None:
        _int32(self, "queue_cap")
        # typed once here, for every config with the same strings (replay/core/specs.py)
        parse_tier_order(self.tier_order)
        _as_tuple(self, "quota", "fail")
        parse_quotas(self.quota)
        parse_failures(self.fail)  # (replica ids: ReplayConfig's check, or the cluster's once built)
        parse_pause(self.pause)
        if self.queue_cap is not None and self.queue_cap < 1:
            raise ServelabError(f"queue_cap must be >= 1, got {self.queue_cap}")


TIMEOUT_UNTIL = ("finish", "first_token")  # what a client timeout waits for (replay/platform/abort.py)


@dataclass(frozen=True, slots=True)
class ClientPart:
    """The client's retries of throttled requests and its timeout."""

    retries: int = 0  # client retries of a throttled request
    retry_backoff_s: float = 1.0  # first backoff; doubles per retry
    retry_max_backoff_s: float = 60.0
    retry_jitter: float = 0.0  # share of each backoff drawn away at random (seeded)
    retry_after: bool = False  # clients retry exactly when the quota will have refilled
    client_timeout_s: float | None = None  # a timeout for every request without its own (replay/platform/abort.py)
    # what must arrive before the timeout: the last token ("finish", a total deadline) or only the first
    # ("first_token", an HTTP read timeout: a client that has a byte keeps reading)
    client_timeout_until: str = "finish"

    def __post_init__(self) -> None:
        if self.retries < 0 or self.retry_backoff_s < 0 or self.retry_max_backoff_s < 0:
            raise ServelabError("retries, retry_backoff_s and retry_max_backoff_s must be >= 0")
        if not 0 <= self.retry_jitter <= 1:
            raise ServelabError(f"retry_jitter must be in [0, 1], got {self.retry_jitter}")
        if self.client_timeout_s is not None and not (0 < self.client_timeout_s < math.inf):
            raise ServelabError(f"client_timeout_s must be a finite number of seconds > 0, got {self.client_timeout_s}")
        if self.client_timeout_until not in TIMEOUT_UNTIL:
            raise ServelabError(f"client_timeout_until must be one of {', '.join(TIMEOUT_UNTIL)}, "
                                f"got {self.client_timeout_until!r}")


@dataclass(frozen=True, slots=True)
class SpeculativePart:
    """Speculative decoding: method, proposed tokens, acceptance, draft model."""

    spec_method: str | None = None  # draft_model | eagle | eagle3 | mtp | ngram; None: off
    spec_k: int = 3  # proposed tokens per decode and step
    spec_acceptance: str = "0.7"  # a rate, or per request "uniform:LO,HI" / "beta:ALPHA,BETA"
    spec_draft_model: str | None = None
    speculative_config: str | None = None  # vLLM's --speculative-config JSON: sets the three spec_ fields above

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # sets the spec_ fields; one given apart must agree
            defaults = {f.name: f.default for f in fields(self)}
            for name, value in parse_speculative_config(self.speculative_config).items():
                given = getattr(self, name)
                if name == "spec_method":
                    value = canonical_method(value)
                    given = canonical_method(given) if given is not None else None
                if given != defaults[name] and given != value:
                    raise ServelabError(f"{name} = {given!r} disagrees with speculative_config's {value!r}: give one")
                object.__setattr__(self, name, value)
        if not isinstance(self.spec_acceptance, str):  # (a number from a TOML file)
            object.__setattr__(self, "spec_acceptance", str(self.spec_acceptance))
        if self.spec_method is None:
            return
        object.__setattr__(self, "spec_method", canonical_method(self.spec_method))
        if not 1 <= self.spec_k <= 64:
            raise ServelabError(f"spec_k (num_speculative_tokens) must be in 1..64, got {self.spec_k}")
        Acceptance(self.spec_acceptance)
        if self.spec_draft_model is not None and self.spec_method != "draft_model":
            raise ServelabError(f"spec_draft_model is for spec_method draft_model, not '{self.spec_method}'")


@dataclass(frozen=True, slots=True)
class LoRAPart:
    """Multi-LoRA: adapter slots on the GPU and in host memory, ranks, load bandwidths."""

    max_loras: int = 0  # adapter slots per replica (vLLM --max-loras); 0: off
    max_cpu_loras: int | None = None  # adapters cached in host memory (None: max_loras)
    lora_rank: int = 16  # rank of every adapter not named in lora_ranks
    lora_ranks: tuple[str, ...] = ()  # "NAME=RANK": an adapter's own rank
    lora_host_gbps: float = 25.0
    lora_disk_gbps: float = 2.0

    def __post_init__(self) -> None:
        _as_tuple(self, "lora_ranks")
        if self.max_loras < 0 or self.lora_rank < 1:
            raise ServelabError(f"max_loras must be >= 0 and lora_rank >= 1, got {self.max_loras} and {self.lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ServelabError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}), as vLLM's")
        if not (self.lora_host_gbps > 0 and self.lora_disk_gbps > 0):
            raise ServelabError("lora_host_gbps and lora_disk_gbps must be > 0")
        parse_ranks(self.lora_ranks)


@dataclass(frozen=True, slots=True)
class MultimodalPart:
    """Multimodal encoders and the encoder cache."""

    vision_encoder: str | None = None  # encoder preset for images and video (runners/encoders.py)
    audio_encoder: str | None = None  # encoder preset for audio
    encoder_cache_tokens: int | None = None  # embeddings the encoder cache holds (None: max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.encoder_cache_tokens is not None and self.encoder_cache_tokens < 0:
            raise ServelabError(f"encoder_cache_tokens must be >= 0, got {self.encoder_cache_tokens}")


@dataclass(frozen=True, slots=True)
class RetentionPart:
    """KV retention across a session's tool waits."""

    kv_retention: str = "lru"  # KV across a session's tool waits: lru | keep | offload (replay/core/kv/retention.py)
    kv_retention_ttl_s: float | None = None  # keep: a pinned context is released after this many seconds

    def __post_init__(self) -> None:
        check_retention(self.kv_retention, self.kv_retention_ttl_s)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The engine's configuration as its typed parts (``EngineConfig.parts()``)."""
    batching: BatchingPart = BatchingPart()
    kv: KVPart = KVPart()
    preemption: PreemptionPart = PreemptionPart()
    cluster: ClusterPart = ClusterPart()
    platform: PlatformPart = PlatformPart()
    client: ClientPart = ClientPart()
    speculative: SpeculativePart = SpeculativePart()
    lora: LoRAPart = LoRAPart()
    multimodal: MultimodalPart = MultimodalPart()
    retention: RetentionPart = RetentionPart()


# part name -> (its class, its field names), in validation order
PARTS: dict[str, tuple[type, tuple[str, ...]]] = {
    f.name: (type(f.default), tuple(g.name for g in fields(type(f.default)))) for f in fields(EngineParts)}
# engine field -> its part's name
PART_OF: dict[str, str] = {name: part for part, (_, names) in PARTS.items() for name in names}


def check_parts(config: Any) -> None:
    """Build every part from ``config``'s flat fields (each validates its own) and write the parts'
    normalised values back (a TOML array -> a tuple, a method alias -> its canonical name)."""
    for cls, names in PARTS.values():
        part = cls(**{name: getattr(config, name) for name in names})
        for name in names:
            object.__setattr__(config, name, getattr(part, name))


def part_of(config: Any, name: str) -> Any:
    cls, names = PARTS[name]
    return cls(**{n: getattr(config, n) for n in names})


__all__ = ["INT32_MAX", "MAX_REPLICAS", "PARTS", "PART_OF", "BatchingPart", "ClientPart", "ClusterPart", "EngineParts",
           "KVPart", "LoRAPart", "MultimodalPart", "PlatformPart", "PreemptionPart", "RetentionPart", "SpeculativePart",
           "check_parts", "part_of"]
