"""The engine's frozen configuration: limits, KV, preemption, routing, horizon and the platform's
settings, validated without I/O (docs/cli.md lists every key). `ReplayConfig` (replay/config.py)
wraps it with the policy, runner and cluster choices.

The same keys are accepted on the command line (``--max-num-seqs 64``) and in a TOML config file
(``max_num_seqs = 64``). ``dataclasses.replace`` makes variants (what a search does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from servelab.common.coerce import coerce
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.common.tiers import DEFAULT_TIERS, parse_tiers
from servelab.replay.spec_config import Acceptance, canonical_method, parse_speculative_config
from servelab.replay.specs import Failure, PauseRule, Quota, check_failures
from servelab.replay.tiers import parse_tiers as parse_kv_tiers


# Most replicas in one pool: a replica costs ~3 KB and a policy instance when built, so 100,000 take
# ~300 MB; a hundred million would end in a MemoryError rather than a result.
MAX_REPLICAS = 100_000
INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int | None = None  # per replica; None = derived from the runner's model and GPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use (weights + KV)
    max_num_seqs: int = 256  # requests in one iteration
    max_num_batched_tokens: int = 2048  # tokens computed in one iteration (chunked-prefill budget)
    # vLLM's --max-model-len: a request whose prompt + max output exceeds it is rejected (vLLM answers
    # 400); None = the runner's model's context (max_position_embeddings), no limit when it knows none
    max_model_len: int | None = None
    kv_allocation: str = "on-demand"  # on-demand (vLLM) | reserve (prompt + max_output at admission)
    # vLLM v1 prefix caching (replay/prefix_cache.py): with on-demand allocation and a cost-model
    # runner; reservation and runners that execute batches (block tables) run without it
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "global"  # global | tenant: a tenant's requests hit only its own cached blocks
    # offload tiers below GPU memory, top first (replay/tiers.py): "dram:capacity_gb=64", "ssd:capacity_gb=1000",
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
    # a client timeout for every request without its own (trace column timeout_s): replay/abort.py
    client_timeout_s: float | None = None
    # -- speculative decoding (docs/runners.md "Speculative decoding"): off while spec_method is None ----
    spec_method: str | None = None  # draft_model | eagle | eagle3 | mtp | ngram (vLLM's speculative_config method)
    spec_k: int = 3  # proposed tokens per decode and step (vLLM's num_speculative_tokens)
    # each draft's acceptance rate (given the earlier ones were accepted) where the trace has no
    # spec_acceptance: a rate ("0.7"), or per request "uniform:LO,HI" / "beta:ALPHA,BETA" (seeded)
    spec_acceptance: str = "0.7"
    spec_draft_model: str | None = None  # draft_model: the draft's preset or config.json (default llama-3.2-1b)
    speculative_config: str | None = None  # vLLM's --speculative-config JSON: sets the three spec_ fields above

    def __post_init__(self) -> None:
        _positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "replicas")
        if self.replicas > MAX_REPLICAS:
            raise ServelabError(f"replicas = {self.replicas:,} is more than servelab models in one pool "
                                f"(at most {MAX_REPLICAS:,}: each replica is an engine of its own, ~3 KB built)")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ServelabError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ServelabError(f"max_model_len must be >= 1, got {self.max_model_len}")
        # counts written to int32 columns (steps.kv_blocks_total, ...): a larger one would wrap negative
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "queue_cap"):
            value = getattr(self, name)
            if value is not None and value > INT32_MAX:
                raise ServelabError(f"{name} = {value:,} is too large (at most {INT32_MAX:,})")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ServelabError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ServelabError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _choice(self, "kv_allocation", ("on-demand", "reserve"))
        _choice(self, "preemption", ("recompute", "swap"))
        _choice(self, "head_of_line", ("strict", "skip"))
        _choice(self, "prefix_cache_scope", ("global", "tenant"))
        _choice(self, "kv_tier_write", ("back", "through"))
        if self.kv_load_overlap_layers < 0:
            raise ServelabError(f"kv_load_overlap_layers must be >= 0, got {self.kv_load_overlap_layers}")
        _as_tuple(self, "kv_tiers", "purge_tenants")
        parse_kv_tiers(self.kv_tiers)
        if self.swap_space_gb < 0 or self.swap_bandwidth_gbps <= 0:
            raise ServelabError("swap_space_gb must be >= 0 and swap_bandwidth_gbps > 0")
        if self.until_s is not None and not (0 <= self.until_s < math.inf):
            raise ServelabError(f"until_s must be a finite number of seconds >= 0, got {self.until_s}")
        self._check_platform()
        self._check_speculative()

    def _check_speculative(self) -> None:
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

    def _check_platform(self) -> None:
        parse_tiers(self.tier_order, "tier_order")
        _as_tuple(self, "quota", "fail")
        for spec in self.quota:
            Quota.parse(spec)
        check_failures(tuple(Failure.parse(spec) for spec in self.fail), None)  # (ids: ReplayConfig's check)
        if self.pause is not None:
            PauseRule.parse(self.pause)
        if self.retries < 0 or self.retry_backoff_s < 0 or self.retry_max_backoff_s < 0:
            raise ServelabError("retries, retry_backoff_s and retry_max_backoff_s must be >= 0")
        if not 0 <= self.retry_jitter <= 1:
            raise ServelabError(f"retry_jitter must be in [0, 1], got {self.retry_jitter}")
        if self.client_timeout_s is not None and not (0 < self.client_timeout_s < math.inf):
            raise ServelabError(f"client_timeout_s must be a finite number of seconds > 0, got {self.client_timeout_s}")
        if self.queue_cap is not None and self.queue_cap < 1:
            raise ServelabError(f"queue_cap must be >= 1, got {self.queue_cap}")

    @property
    def has_front_door(self) -> bool:
        """Quotas or a queue cap are configured: arrivals go through `replay.admission`."""
        return bool(self.quota) or self.queue_cap is not None


def make_params(cls: type, raw: dict[str, Any], owner: str) -> Any:
    """Build a frozen params dataclass from string/TOML values; unknown keys are errors."""
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        key_norm = key.replace("-", "_")
        if key_norm not in known:
            names = ", ".join(sorted(known)) or "none"
            raise ServelabError(f"{owner}: unknown parameter '{key}'{did_you_mean(key_norm, known)} (parameters: {names})")
        values[key_norm] = coerce(value, known[key_norm].type, f"{owner}: {key}")
    return cls(**values)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ServelabError(f"{name} must be >= 1, got {getattr(obj, name)}")


def _as_tuple(config, *names: str) -> None:
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


__all__ = ["INT32_MAX", "MAX_REPLICAS", "EngineConfig", "make_params"]
