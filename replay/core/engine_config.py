"""The engine's frozen configuration: limits, KV, preemption, routing, horizon and the platform's
settings, validated without I/O (docs/cli.md lists every key). `ReplayConfig` (replay/config.py) wraps it
with the policy, runner and cluster choices.

It is the flat view of the typed parts in replay/core/config_parts.py (batching, KV, preemption, ...) that
the hot loop reads as plain attributes: building one builds and checks every part once.

The same keys are accepted on the command line (``--max-num-seqs 64``) and in a TOML config file
(``max_num_seqs = 64``). ``dataclasses.replace`` makes variants (what a search does).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from servelab.common.coerce import coerce, plain
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.common.tiers import DEFAULT_TIERS
from servelab.replay.core.config_parts import (INT32_MAX, MAX_REPLICAS, PART_OF, PARTS, EngineParts, _positive,
                                          check_parts, part_of)
from servelab.replay.core.kv.tiers import TierSpec
from servelab.replay.core.specs import (Failure, PauseRule, Quota, parse_failures, parse_kv_tiers, parse_pause,
                                        parse_quotas, parse_tier_order)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings, flat: the view the hot loop reads of the parts (replay/core/config_parts.py)."""

    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int | None = None  # per replica; None = derived from the runner's model and GPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use (weights + KV)
    max_num_seqs: int = 256  # requests in one iteration
    max_num_batched_tokens: int = 2048  # tokens computed in one iteration (chunked-prefill budget)
    # vLLM's --max-model-len: a request whose prompt + max output exceeds it is rejected (vLLM answers
    # 400); None = the runner's model's context (max_position_embeddings), no limit when it knows none
    max_model_len: int | None = None
    kv_allocation: str = "on-demand"  # on-demand (vLLM) | reserve (prompt + max_output at admission)
    # vLLM v1 prefix caching (replay/core/kv/prefix_cache.py): with on-demand allocation and a cost-model
    # runner; reservation and runners that execute batches (block tables) run without it
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "global"  # global | tenant: a tenant's requests hit only its own cached blocks
    # offload tiers below GPU memory, top first (replay/core/kv/tiers.py): "dram:capacity_gb=64", "ssd:capacity_gb=1000",
    # "remote:capacity_gb=10000" (shared by the replicas); each NAME:capacity_gb=..[,read_gbps=..,write_gbps=..,
    # latency_ms=..,shared=0|1]. Blocks need their size: the runner's model or kv_bytes_per_token.
    kv_tiers: tuple[str, ...] = ()
    kv_tier_write: str = "back"  # back: blocks reach the first tier when the GPU evicts them; through: when computed
    kv_load_overlap_layers: int = 0  # 0: a lower-tier load runs before the prefill; N: layer by layer over N layers, under it
    purge_tenants: tuple[str, ...] = ()  # tenants whose cached blocks are dropped from every tier when their requests end
    preemption: str = "recompute"  # recompute | swap
    swap_space_gb: float = 4.0  # host pool for swapped KV, per replica
    swap_bandwidth_gbps: float = 25.0  # host<->GPU copy bandwidth, GB/s
    kv_bytes_per_token: int | None = None  # for runners that don't know their model (swap timing)
    head_of_line: str = "strict"  # strict: stop at the first waiting request that does not fit; skip
    # vLLM's async scheduling (on by default since vLLM 0.14): the scheduler picks step N+1 while step N runs,
    # so a request that arrives during step N is first scheduled in step N+2 (docs/engine.md)
    async_scheduling: bool = False
    replicas: int = 1
    router: str = "round-robin"  # a router name (routers/; looked up by servelab.api, not here)
    until_s: float | None = None  # horizon; None = replay until drained
    seed: int = 0
    # -- platform (docs/platform.md): all off by default --------------------------------------
    quota: tuple[str, ...] = ()  # "tenant=NAME:rpm=..,tpm=..,concurrency=.." / "tier=NAME:..." (NAME may be *)
    retries: int = 0  # client retries of a throttled request
    retry_backoff_s: float = 1.0  # first backoff; doubles per retry
    retry_max_backoff_s: float = 60.0
    retry_jitter: float = 0.0  # share of each backoff drawn away at random (seeded)
    retry_after: bool = False  # clients retry exactly when the quota will have refilled
    queue_cap: int | None = None  # most requests waiting across replicas; the lowest tier is shed
    tier_order: str = DEFAULT_TIERS  # tiers highest first, for queue-cap shedding
    pause: str | None = None  # "tier=flex,waiting=32[,resume=8]" or "tier=flex,kv=0.9[,resume=0.7]"
    fail: tuple[str, ...] = ()  # "replica=R,at=T[,for=D]": replica failures
    journal: bool = True  # interrupted requests keep their generated tokens (else they start over)
    # a client timeout for every request without its own (trace column timeout_s): replay/platform/abort.py
    client_timeout_s: float | None = None
    # what must arrive before it: the last token ("finish") or only the first ("first_token": an HTTP read timeout)
    client_timeout_until: str = "finish"
    # -- speculative decoding (docs/runners.md "Speculative decoding"): off while spec_method is None ----
    spec_method: str | None = None  # draft_model | eagle | eagle3 | mtp | ngram (vLLM's speculative_config method)
    spec_k: int = 3  # proposed tokens per decode and step (vLLM's num_speculative_tokens)
    # each draft's acceptance rate (given the earlier ones were accepted) where the trace has no
    # spec_acceptance: a rate ("0.7"), or per request "uniform:LO,HI" / "beta:ALPHA,BETA" (seeded)
    spec_acceptance: str = "0.7"
    spec_draft_model: str | None = None  # draft_model: the draft's preset or config.json (default llama-3.2-1b)
    speculative_config: str | None = None  # vLLM's --speculative-config JSON: sets the three spec_ fields above
    # -- multi-LoRA (replay/core/lora.py): off while max_loras = 0 -----------------------------------
    max_loras: int = 0  # adapter slots per replica = most distinct adapters in one batch (vLLM --max-loras)
    max_cpu_loras: int | None = None  # adapters cached in host memory (vLLM --max-cpu-loras; None: max_loras)
    lora_rank: int = 16  # rank of every adapter not named in lora_ranks
    lora_ranks: tuple[str, ...] = ()  # "NAME=RANK": an adapter's own rank
    lora_host_gbps: float = 25.0  # host -> GPU copy of an adapter cached in host memory, GB/s
    lora_disk_gbps: float = 2.0  # disk -> host read of an adapter not cached, GB/s
    # -- multimodal (replay/core/encoder.py): off while no encoder is named ---------------------------
    vision_encoder: str | None = None  # encoder preset for images and video (runners/encoders.py), e.g. qwen2.5-vl-vit
    audio_encoder: str | None = None  # encoder preset for audio, e.g. whisper-large-v3-encoder
    encoder_cache_tokens: int | None = None  # embeddings the encoder cache holds, tokens (None: max_num_batched_tokens)
    # KV retention across a session's tool waits (replay/core/kv/retention.py): lru (today's release) | keep | offload
    kv_retention: str = "lru"
    kv_retention_ttl_s: float | None = None  # keep: a pinned context is released after this many seconds

    def __post_init__(self) -> None:
        check_parts(self)  # each part validates its own fields (replay/core/config_parts.py)

    def parts(self) -> EngineParts:
        """This config as its typed parts (batching, kv, preemption, cluster, platform, client, speculative,
        lora, multimodal, retention): for code that takes one part, not for the hot loop."""
        return EngineParts(**{name: part_of(self, name) for name in PARTS})

    @classmethod
    def from_parts(cls, parts: EngineParts) -> EngineConfig:
        return cls(**{name: getattr(getattr(parts, PART_OF[name]), name) for name in PART_OF})

    # -- the spec strings' typed values, parsed once when the first config with them was made (its parts
    # call the same parsers: replay/core/specs.py); consumers read these, never the strings --------------
    @property
    def quotas(self) -> tuple[Quota, ...]:
        return parse_quotas(self.quota)

    @property
    def failures(self) -> tuple[Failure, ...]:
        return parse_failures(self.fail)

    @property
    def pause_rule(self) -> PauseRule | None:
        return parse_pause(self.pause)

    @property
    def tier_ranks(self) -> Mapping[str, int]:
        return parse_tier_order(self.tier_order)

    @property
    def tier_specs(self) -> tuple[TierSpec, ...]:
        return parse_kv_tiers(self.kv_tiers)

    @property
    def has_front_door(self) -> bool:
        """Quotas or a queue cap are configured: arrivals go through `replay.platform.admission`."""
        return bool(self.quota) or self.queue_cap is not None


def make_params(cls: type, raw: dict[str, Any], owner: str) -> Any:
    """Build a frozen params dataclass from string/TOML values; unknown keys are errors."""
    return cls(**typed_fields(cls, raw, owner))


def typed_fields(cls: type, raw: dict[str, Any], owner: str) -> dict[str, Any]:
    """String/TOML values -> the params dataclass ``cls``'s field types, each key alone (``make_params``
    builds ``cls`` from them; ``replace`` puts them over typed parameters); unknown keys are errors."""
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        key_norm = key.replace("-", "_")
        if key_norm not in known:
            names = ", ".join(sorted(known)) or "none"
            raise ServelabError(f"{owner}: unknown parameter '{key}'{did_you_mean(key_norm, known)} (parameters: {names})")
        values[key_norm] = coerce(value, known[key_norm].type, f"{owner}: {key}")
    return values


def params_table(params: Any) -> dict[str, Any]:
    """A typed params dataclass -> the plain table of the fields that differ from their defaults (what a
    TOML file writes, ``NamedFloats`` as a table and ``Names`` as an array: common/coerce.py ``plain``):
    ``make_params(type(p), params_table(p), ...) == p``."""
    return {f.name: plain(getattr(params, f.name)) for f in fields(params) if getattr(params, f.name) != f.default}


__all__ = ["INT32_MAX", "MAX_REPLICAS", "EngineConfig", "EngineParts", "make_params", "params_table",
           "typed_fields"]
