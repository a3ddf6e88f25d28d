"""Frozen configuration of a whole replay: the engine's (`EngineConfig`, replay/core/engine_config.py), the
policy, runner and cluster choices, and each cluster pool's own flat config. Validated without I/O.

The same keys are accepted on the command line (``--max-num-seqs 64``) and in a TOML config file
(``max_num_seqs = 64``); see docs/cli.md. Raw values are typed once, at the edge (``from_dict``,
``Options.parse``); a variant puts typed values over a typed config (``dataclasses.replace``) or raw
ones typed alone (``with_options``, ``with_pool_keys``), and never types the config's own again.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelab.common.coerce import coerce
from servelab.common.errors import ServelabError
from servelab.common.registry import ClassRegistry, did_you_mean
from servelab.replay.cluster.config import ClusterConfig, PoolConfig, is_params, split_settings
from servelab.replay.core.engine_config import (INT32_MAX, MAX_REPLICAS, EngineConfig, _positive, make_params,
                                                params_table, typed_fields)
from servelab.replay.core.plugins import POLICIES, ROUTERS
from servelab.replay.core.runner_spec import RunnerSpec, runner_spec
from servelab.common.textfile import read_text

if TYPE_CHECKING:
    from servelab.replay.cluster.instances import InstanceType

@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Everything one replay needs besides the trace: engine, policy, router, runner, cluster."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = "sarathi"
    # the policy's typed ``Params`` (policies/); a table (mapping) given is typed against them once, when the
    # config is made, and None is their defaults. ``to_dict`` writes the fields set apart from the defaults.
    policy_params: Any = None
    # a runner spec, typed (`RunnerSpec`: the runner's name and typed ``Params``) once, when the config is
    # made: a string given ("roofline", "linear:base=0.01,...", "fitted:model.json") is parsed then, and
    # ``str(runner)`` is that string again (``to_dict``, run.json)
    runner: RunnerSpec | str = "roofline"
    model: str = "llama-3.1-8b"  # defaults handed to runners that take a model preset
    gpu: str = "h100-80gb"
    tp: int = 1
    # Parallelism beyond TP, as vLLM names it (docs/runners.md "Parallelism"): each of dp data-parallel
    # ranks is an engine of tp x pp GPUs; pp pipeline stages; MoE experts over all dp x tp GPUs.
    dp: int = 1
    pp: int = 1
    enable_expert_parallel: bool = False
    # Quantisation as vLLM's --quantization / --kv-cache-dtype ("" / auto: the checkpoint's own; "none": the
    # model dtype whatever the checkpoint says; runners/quant.py)
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    router_params: Any = None  # the router's (engine.router's) typed ``Params`` (routers/), as policy_params
    cluster: ClusterConfig | None = None  # pools and links (replay/cluster/config.py); None: one pool of engine.replicas
    # each cluster pool's flat config, in the order of cluster.pools: made (and so checked) once, with this
    # config; ``pool_config`` hands them out, so that building the pools makes no config again
    _pools: tuple["ReplayConfig", ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive(self, "dp", "pp")
        # the edge for the parameters (a TOML table, options, a dict from Python): typed here, once; a
        # variant (``replace``) keeps them typed and passes them through
        object.__setattr__(self, "policy_params", typed_params(POLICIES, self.policy, self.policy_params))
        object.__setattr__(self, "router_params", typed_params(ROUTERS, self.engine.router, self.router_params))
        object.__setattr__(self, "runner", runner_spec(self.runner))
        for key in _SPEC_SETS:  # the runner's own settings win (``roofline:model=...``): record what it runs
            value = getattr(self.runner.params, key, None)
            if value is not None and value != getattr(self, key):
                object.__setattr__(self, key, value)
        if self.cluster is not None and (self.dp != 1 or self.pp != 1):
            raise ServelabError("dp and pp apply to a replay without a [cluster] (pools set tp only)")
        if self.cluster is not None and self.engine.replicas != 1:
            raise ServelabError(f"replicas = {self.engine.replicas} with a [cluster]: each pool sets its own "
                                "replicas ([[cluster.pools]] replicas = N)")
        if self.cluster is None and self.engine.fail:  # (a cluster's replica ids are checked once its pools are built)
            from servelab.replay.core.specs import check_failures

            check_failures(self.engine.failures, self.engine.replicas)
        if self.cluster is not None:  # each pool's overrides with the top level: checked here, once, not when built
            pools = tuple(typed_pool(self, pool) for pool in self.cluster.pools)
            if any(new is not old for new, old in zip(pools, self.cluster.pools)):
                object.__setattr__(self, "cluster", replace(self.cluster, pools=pools))
            object.__setattr__(self, "_pools", tuple(_pool_config(self, pool) for pool in self.cluster.pools))

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one replica (one vLLM server): tp x pp x dp."""
        return self.tp * self.pp * self.dp

    @property
    def engines_per_replica(self) -> int:
        """Schedulers the engine model runs per replica: one per DP rank, and per pipeline stage one
        virtual engine with 1/pp of the KV blocks (docs/runners.md "Parallelism")."""
        return self.dp * self.pp

    def to_dict(self) -> dict[str, Any]:
        """Flat, TOML-writable form; ``from_dict(to_dict())`` round-trips."""
        out: dict[str, Any] = {"policy": self.policy, "runner": str(self.runner), "model": self.model,
                               "gpu": self.gpu, "tp": self.tp}
        for key, default in RUNNER_DEFAULTS.items():  # only when set: runs without them keep their form
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        for f in fields(EngineConfig):
            value = getattr(self.engine, f.name)
            if isinstance(value, tuple):
                if value:
                    out[f.name] = list(value)
            elif value is not None:
                out[f.name] = value
        for key in ("policy_params", "router_params"):  # the fields set apart from the defaults
            table = params_table(getattr(self, key))
            if table:
                out[key] = table
        if self.cluster is not None:
            out["cluster"] = self.cluster.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "ReplayConfig":
        engine_values, top = typed_keys(data, source)
        with _named(source):  # each part checks its fields (replay/core/config_parts.py); the message names the file
            return cls(engine=EngineConfig(**engine_values), **top)

    def with_options(self, data: "dict[str, Any] | Options", source: str = "options") -> "ReplayConfig":
        """This config with ``data`` put over its fields with ``dataclasses.replace``: raw values keyed as in
        ``from_dict`` (the command line's options over a config file), typed here, or `Options` typed
        already (once, to go over many configs). Only ``data`` is typed, this config's own values are kept as
        they are. ``policy_params`` and ``router_params`` in ``data`` go over this config's key by key; a
        policy (router) other than this config's starts from its defaults."""
        options = data if isinstance(data, Options) else Options.parse(data, source)
        top = dict(options.top)
        with _named(options.source):
            engine = replace(self.engine, **options.engine) if options.engine else self.engine
            for key, registry, name, was in (("policy_params", POLICIES, top.get("policy", self.policy), self.policy),
                                             ("router_params", ROUTERS, engine.router, self.engine.router)):
                params = getattr(self, key) if name == was else None  # (another one's are not its)
                if key in options.params:  # the options' keys alone, over the config's typed ones
                    cls = registry.get(name).Params
                    params = replace(params if params is not None else cls(), **options.typed(key, name))
                    top[key] = params
                top.setdefault(key, params)
            return replace(self, engine=engine, **top)

    def with_pool_keys(self, values: Mapping[tuple[str, str], Any], source: str = "options") -> "ReplayConfig":
        """This config with its cluster's pool keys set, ``{(pool, key): raw value}``, each typed alone
        (``ClusterConfig.with_pool_keys``); nothing else is typed again."""
        if self.cluster is None:
            raise ServelabError(f"{source}: pool keys need a [cluster]")
        cluster = self.cluster.with_pool_keys(values, source)
        with _named(source):  # (a pool's parameter table is typed against its policy by the new config)
            return replace(self, cluster=cluster)

    @classmethod
    def from_toml(cls, path: str | Path) -> "ReplayConfig":
        return cls.from_dict(read_table(path), source=str(path))


def read_table(path: str | Path) -> dict[str, Any]:
    """A config file's table, raw (its values typed by ``ReplayConfig.from_dict`` or ``Options.parse``)."""
    import tomllib  # only with --config: a replay without one starts without it

    path = Path(path)
    try:
        data = tomllib.loads(read_text(path))  # a folder or a binary file: a one-line InputError
    except FileNotFoundError:
        raise ServelabError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as err:
        raise ServelabError(f"{path}: invalid TOML: {err}") from None
    data.pop("slo", None)  # SLO tables belong to scoring; a config file may carry them
    return data


@dataclass(frozen=True, slots=True)
class Options:
    """Raw settings (a config file's table, command-line options) typed once, to go over configs made
    elsewhere (a measured run's, in ``validate --real``; each trial's, in a search) with
    ``ReplayConfig.with_options``: however many configs they go over, they are typed here only.

    ``engine`` and ``top``: typed `EngineConfig` and `ReplayConfig` fields. ``params``: the raw
    ``policy_params`` and ``router_params`` tables, typed by ``typed`` once per policy (router) they go
    with: at once when the options name it, else against the first config's own."""

    engine: Mapping[str, Any] = field(default_factory=dict)
    top: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source: str = "options"
    _typed: dict = field(default_factory=dict, repr=False, compare=False)  # (key, name) -> typed values

    @classmethod
    def parse(cls, data: Mapping[str, Any], source: str = "options") -> "Options":
        engine, top = typed_keys(dict(data), source)
        params = {key: top.pop(key) for key in ("policy_params", "router_params") if isinstance(top.get(key), dict)}
        options = cls(engine, top, params, source)  # (typed Params given whole go over as they are, in top)
        with _named(source):
            for key, name in (("policy_params", top.get("policy")), ("router_params", engine.get("router"))):
                if key in params and name is not None:
                    options.typed(key, name)  # named here: typed now, so that a bad key fails before any replay
        return options

    def typed(self, key: str, name: str) -> dict[str, Any]:
        """The ``key`` table (``policy_params``, ``router_params``) typed against the policy or router
        ``name``'s ``Params``: its fields, typed the first time they are asked for with that name."""
        if (key, name) not in self._typed:
            registry = POLICIES if key == "policy_params" else ROUTERS
            self._typed[key, name] = typed_fields(registry.get(name).Params, self.params[key],
                                                  f"{registry.kind} '{name}'")
        return self._typed[key, name]

    def keys(self) -> set[str]:
        """The keys these options set (as ``from_dict`` names them)."""
        return {*self.engine, *self.top, *self.params}

    def get(self, key: str, default: Any = None) -> Any:
        """A typed value these options set (a parameter table: its values), else ``default``."""
        for part in (self.engine, self.top):
            if key in part:
                return part[key]
        return self.params.get(key, default)


COMMAND_LINE = "options"  # from_dict's source for the command line's options (cli/replay_cmd.py)


def typed_keys(data: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flat table's values typed, at the edge: (`EngineConfig` fields, `ReplayConfig` fields). The
    parameter tables stay tables here: the config types them against its policy and router."""
    engine_keys = {f.name: f for f in fields(EngineConfig)}
    engine_values: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in data.items():
        key_norm = key.replace("-", "_")
        if key_norm in engine_keys:
            engine_values[key_norm] = coerce(value, engine_keys[key_norm].type, f"{source}: {key}")
        elif key_norm in ("policy", "model", "gpu"):
            top[key_norm] = str(value)
        elif key_norm == "runner":  # typed here, once: options going over many configs carry it typed
            with _named(source):
                top["runner"] = runner_spec(value)
        elif key_norm == "tp":
            top["tp"] = coerce(value, "int", f"{source}: tp")
        elif key_norm in RUNNER_KEYS:  # dp, pp, quantization, and vLLM's names (a measured run's settings)
            name = RUNNER_KEYS[key_norm]
            top[name] = coerce(value, RUNNER_TYPES[name], f"{source}: {key}")
        elif key_norm in ("policy_params", "router_params"):
            if not isinstance(value, dict) and not is_params(value):
                raise ServelabError(f"{source}: {key_norm} must be a table")
            top[key_norm] = dict(value) if isinstance(value, dict) else value
        elif key_norm == "cluster":
            top["cluster"] = value if isinstance(value, ClusterConfig) else ClusterConfig.from_dict(value, source)
        else:
            known = sorted([*engine_keys, "cluster", "policy", "policy_params", "router_params", "runner",
                            "model", "gpu", "tp", *RUNNER_KEYS])
            raise ServelabError(f"{source}: unknown key '{key}'{did_you_mean(key_norm, known)} "
                                f"(known: {', '.join(known)})")
    return engine_values, top


@contextmanager
def _named(source: str):
    """A config check's error, with the file's name in front (the command line's: as it is, since the
    message names the field, which is the option: --preemption)."""
    try:
        yield
    except ServelabError as exc:
        if source == COMMAND_LINE:
            raise
        raise ServelabError(f"{source}: {exc}") from None
# What a runner spec may set over the replay's own (``roofline:model=qwen3-8b,gpu=l40s,tp=2``): the config
# takes the spec's, so run.json, the report's header and the GPU-hour cost name what the runner ran.
_SPEC_SETS = ("model", "gpu", "tp")
# Runner settings beyond model/gpu/tp (parallelism, quantisation), written by to_dict only when set.
RUNNER_DEFAULTS = {"dp": 1, "pp": 1, "enable_expert_parallel": False, "quantization": "", "kv_cache_dtype": "auto"}
RUNNER_TYPES = {"dp": "int", "pp": "int", "enable_expert_parallel": "bool", "quantization": "str",
                "kv_cache_dtype": "str"}
RUNNER_KEYS = {**{k: k for k in RUNNER_DEFAULTS}, "data_parallel_size": "dp", "pipeline_parallel_size": "pp"}


def typed_params(registry: ClassRegistry, name: str, value: Any) -> Any:
    """``value`` as the typed ``Params`` of the policy or router ``name`` of ``registry``: a table (mapping)
    is typed (``make_params``; errors name the policy or router and the key), None is the defaults, and
    typed ones are passed through. Another plug-in's ``Params`` left at their defaults (``replace`` of
    the policy alone) are the new one's defaults, as an empty table would be; set ones are an error."""
    cls = registry.get(name).Params
    if type(value) is cls:
        return value
    if value is None:
        return cls()
    owner = f"{registry.kind} '{name}'"
    if isinstance(value, Mapping):
        return make_params(cls, value, owner)
    if is_params(value) and value == type(value)():
        return cls()
    raise ServelabError(f"{owner}: {registry.kind}_params {value!r} are not its parameters ({cls.__name__})")


def typed_pool(base: ReplayConfig, pool: PoolConfig) -> PoolConfig:
    """``pool`` with its ``policy_params`` and ``router_params`` typed against its policy and router (its
    own or the top level's); the pool itself when they are typed already, or not set."""
    settings = dict(pool.settings)
    names = {"policy_params": (POLICIES, settings.get("policy", base.policy)),
             "router_params": (ROUTERS, settings.get("router", base.engine.router))}
    try:
        typed = {key: typed_params(registry, name, settings[key])
                 for key, (registry, name) in names.items() if key in settings}
    except ServelabError as exc:
        raise ServelabError(f"cluster pool '{pool.name}': {exc}") from None
    if all(typed[key] is settings[key] for key in typed):
        return pool
    return replace(pool, settings=tuple(sorted({**settings, **typed}.items())))


def pool_config(base: ReplayConfig, pool: PoolConfig) -> ReplayConfig:
    """The flat `ReplayConfig` of one pool: the config's top level under the pool's own keys, with
    the pool's replica count (and no cluster). One of ``base``'s own pools gets the config made with
    ``base`` (once); another pool (a search's variant of one) is made here."""
    if base.cluster is not None:
        for own, made in zip(base.cluster.pools, base._pools):
            if own is pool:
                return made
    return _pool_config(base, pool)


def _pool_config(base: ReplayConfig, pool: PoolConfig) -> ReplayConfig:
    """``pool_config``, made: the pool's settings were typed at the edge (``ClusterConfig.from_dict``,
    ``typed_pool``): fields are replaced, nothing is parsed or coerced again. ``fail`` is the cluster's
    (replica ids count across pools): the engine gets it from the top level."""
    engine_keys, top = split_settings(pool.settings)
    replicas = pool.replicas if pool.autoscale is None else pool.autoscale.max  # all built, some off
    if "policy" in top and "policy_params" not in top:
        top["policy_params"] = None  # another policy: the top level's parameters are not its (its defaults)
    try:
        return replace(base, engine=replace(base.engine, **engine_keys, fail=(), replicas=replicas),
                       cluster=None, **top)
    except ServelabError as exc:  # a value valid alone may not be with the top level's (max_cpu_loras < max_loras)
        raise ServelabError(f"cluster pool '{pool.name}': {exc}") from None


def instance_config(pool_cfg: ReplayConfig, ty: InstanceType, replicas: int) -> ReplayConfig:
    """A pool's config on one of its instance types: the type's GPU, replica count and, where it sets
    them, runner and KV blocks (all typed when the pool was parsed)."""
    engine = replace(pool_cfg.engine, replicas=replicas) if ty.num_gpu_blocks is None else \
        replace(pool_cfg.engine, replicas=replicas, num_gpu_blocks=ty.num_gpu_blocks)
    try:
        return replace(pool_cfg, engine=engine, gpu=ty.gpu, **({} if ty.runner is None else {"runner": ty.runner}))
    except ServelabError as exc:
        raise ServelabError(f"instance '{ty.gpu}': {exc}") from None


def one_pool(base: ReplayConfig) -> ClusterConfig:
    """Today's flat ``--replicas N --router R``: one mixed pool (what a config without [cluster] is)."""
    return ClusterConfig((PoolConfig("default", "mixed", base.engine.replicas),))


__all__ = ["INT32_MAX", "MAX_REPLICAS", "EngineConfig", "Options", "ReplayConfig", "instance_config", "make_params",
           "one_pool", "pool_config", "read_table", "typed_params", "typed_pool"]
