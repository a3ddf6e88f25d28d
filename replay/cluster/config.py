"""A cluster description: pools of replicas, each with a role, runner, engine settings, policy,
router, replica count and price, and the links that carry KV from prefill pools to decode pools.

One TOML table (``[cluster]``) in a replay config (docs/cluster.md)::

    [[cluster.pools]]
    name = "prefill"
    role = "prefill"            # mixed | prefill | decode | encode
    replicas = 2
    gpu = "h100-80gb"           # runner, model, gpu, tp, policy, policy_params, router,
    price_per_gpu_hour = 2.5    # router_params and any engine key override the config's top level
    max_num_batched_tokens = 8192

    [[cluster.links]]
    from = "prefill"
    to = "decode"
    bandwidth_gbps = 50.0       # GB/s, shared by the transfers in flight on the link
    latency_s = 0.0005
    stream_layers = 32          # optional: KV streams layer by layer during the final prefill iteration

Validated without I/O, like `EngineConfig`; a pool's settings become a whole `ReplayConfig`
(``pool_config`` in replay/config.py) so that each pool is built exactly as a flat replay of that pool would be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

from servelab.common.coerce import coerce, type_name
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.replay.core.engine_config import EngineConfig, params_table
from servelab.replay.core.runner_spec import RunnerSpec, runner_spec

if TYPE_CHECKING:  # (loaded by the tables that set them, ``from_dict`` and ``_with_keys``: most replays have none)
    from servelab.replay.cluster.autoscale import AutoscaleConfig
    from servelab.replay.cluster.instances import InstanceType, PerfFloor

ROLES = ("mixed", "prefill", "decode", "encode")
NOT_ENTRY = ("decode", "encode")  # the roles that take no arrivals
# what a pool may set besides the engine keys (EngineConfig's fields)
POOL_TOP = ("name", "role", "replicas", "autoscale", "runner", "model", "gpu", "tp", "policy", "policy_params", "router",
            "router_params", "price_per_gpu_hour", "instances", "floor", "rebalance")
# engine keys that are the cluster's (its front door, horizon, seed), not a pool's
CLUSTER_WIDE = ("until_s", "seed", "quota", "retries", "retry_backoff_s", "retry_max_backoff_s", "retry_jitter",
                "retry_after", "queue_cap", "tier_order", "pause", "fail", "journal")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool of a cluster: its replicas, role and the engine settings it overrides."""

    name: str
    role: str = "mixed"
    replicas: int = 1
    price_per_gpu_hour: float | None = None  # dollars per GPU per hour (a replica is tp GPUs); None: unpriced
    # the pool's other keys over the config's top level, sorted, each typed at the edge (typed_setting)
    settings: tuple[tuple[str, Any], ...] = ()
    autoscale: AutoscaleConfig | None = None  # target tracking (replay/cluster/autoscale.py); replicas = the initial count
    # candidate instance types in order of preference, instead of one gpu (replay/cluster/instances.py)
    instances: tuple[InstanceType, ...] = ()
    floor: PerfFloor | None = None  # a reference step no instance type may be slower than
    rebalance: bool = False  # replace fallback replicas by a preferred type when it has room again (replay/cluster/fleet.py)

    def __post_init__(self) -> None:
        where = f"cluster pool '{self.name}'"
        if self.role not in ROLES:
            raise ServelabError(f"{where}: role must be one of {', '.join(ROLES)}; got '{self.role}'"
                                f"{did_you_mean(self.role, ROLES)}")
        if self.replicas < 1:
            raise ServelabError(f"{where}: replicas must be >= 1, got {self.replicas}")
        for key, value in self.settings:  # typed already (from_dict types them): a string "64" is not an int
            if key not in ENGINE_TYPES and key not in TOP_TYPES:
                raise ServelabError(f"{where}: unknown key '{key}'")
            if not is_typed(key, value):  # (a check of the type alone: nothing is coerced again)
                raise ServelabError(f"{where}.{key}: {value!r} is not a typed value "
                                    f"({type_name(_kind(key))[0].split('[')[0]}); "
                                    "ClusterConfig.from_dict types a TOML table's")
        if self.price_per_gpu_hour is not None and not (0 <= self.price_per_gpu_hour < math.inf):
            raise ServelabError(f"{where}: price_per_gpu_hour must be a finite number >= 0, got {self.price_per_gpu_hour}")
        if self.autoscale is not None:
            self.autoscale.check(where)
            if not self.autoscale.min <= self.replicas <= self.autoscale.max:
                raise ServelabError(f"{where}: replicas (the initial count) must be within autoscale min..max, "
                                    f"got {self.replicas} outside {self.autoscale.min}..{self.autoscale.max}")
        if self.instances:
            for key in ("gpu", "price_per_gpu_hour"):
                if key in dict(self.settings) or (key == "price_per_gpu_hour" and self.price_per_gpu_hour is not None):
                    raise ServelabError(f"{where}: '{key}' is set per instance type when the pool lists instances")
        elif self.floor is not None:
            raise ServelabError(f"{where}: floor (a reference step bound) needs instances to choose among")
        elif self.rebalance:
            raise ServelabError(f"{where}: rebalance (back to a preferred instance type) needs instances")

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "role": self.role, "replicas": self.replicas,
               **({} if self.price_per_gpu_hour is None else {"price_per_gpu_hour": self.price_per_gpu_hour}),
               **{k: str(v) if isinstance(v, RunnerSpec) else params_table(v) if is_params(v) else v
                  for k, v in self.settings}}
        if self.autoscale is not None:
            out["autoscale"] = self.autoscale.to_dict()
        if self.instances:
            out["instances"] = [t.to_dict() for t in self.instances]
        if self.floor is not None:
            out["floor"] = self.floor.to_dict()
        if self.rebalance:
            out["rebalance"] = True
        return out


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """The KV link from a prefill pool to a decode pool."""

    source: str  # a prefill pool
    target: str  # a decode pool
    bandwidth_gbps: float = 50.0  # GB/s, shared equally by the transfers in flight
    latency_s: float = 0.0  # added to every transfer
    stream_layers: int = 0  # L > 0: the KV of the first L - 1 layers streams during the final prefill iteration

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth_gbps < math.inf):
            raise ServelabError(f"cluster link {self.source}->{self.target}: bandwidth_gbps must be > 0, "
                                f"got {self.bandwidth_gbps}")
        if not (0 <= self.latency_s < math.inf):
            raise ServelabError(f"cluster link {self.source}->{self.target}: latency_s must be >= 0, got {self.latency_s}")
        if self.stream_layers < 0:
            raise ServelabError(f"cluster link {self.source}->{self.target}: stream_layers (the model's layer count; "
                                f"0: off) must be >= 0, got {self.stream_layers}")

    def to_dict(self) -> dict[str, Any]:
        out = {"from": self.source, "to": self.target, "bandwidth_gbps": self.bandwidth_gbps,
               "latency_s": self.latency_s}
        if self.stream_layers:
            out["stream_layers"] = self.stream_layers
        return out


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A cluster's pools and the links between them."""

    pools: tuple[PoolConfig, ...]
    links: tuple[LinkConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.pools:
            raise ServelabError("cluster: needs at least one pool ([[cluster.pools]])")
        names = [p.name for p in self.pools]
        for name in names:
            if names.count(name) > 1:
                raise ServelabError(f"cluster: pool name '{name}' is used twice")
        roles = {p.name: p.role for p in self.pools}
        entry = [p for p in self.pools if p.role not in NOT_ENTRY]
        decode = [p for p in self.pools if p.role == "decode"]
        self._check_encode(entry, roles)
        if len(entry) != 1:
            raise ServelabError(f"cluster: exactly one pool takes arrivals (role mixed or prefill); got "
                                f"{len(entry)} ({', '.join(p.name for p in entry) or 'none'})")
        if entry[0].role == "prefill" and len(decode) != 1:
            raise ServelabError(f"cluster: prefill pool '{entry[0].name}' needs exactly one decode pool, got {len(decode)}")
        if entry[0].role == "mixed" and decode:
            raise ServelabError(f"cluster: decode pool '{decode[0].name}' needs a prefill pool, not a mixed one")
        for pool in self.pools:
            if pool.autoscale is not None and pool.autoscale.signal == "handoffs_waiting" and pool.role != "decode":
                raise ServelabError(f"cluster pool '{pool.name}': autoscale signal 'handoffs_waiting' is a decode "
                                    f"pool's (requests waiting for a decode replica); this pool is {pool.role}")
        for link in self.links:
            if roles.get(link.source) == "encode":
                continue  # (checked by _check_encode)
            for end, want in ((link.source, "prefill"), (link.target, "decode")):
                if end not in roles:
                    raise ServelabError(f"cluster link {link.source}->{link.target}: no pool '{end}'"
                                        f"{did_you_mean(end, roles)}")
                if roles[end] != want:
                    raise ServelabError(f"cluster link {link.source}->{link.target}: '{end}' must be a {want} pool, "
                                        f"it is {roles[end]}")
        if decode and not any(l.source == entry[0].name and l.target == decode[0].name for l in self.links):
            raise ServelabError(f"cluster: no link from prefill pool '{entry[0].name}' to decode pool "
                                f"'{decode[0].name}' ([[cluster.links]] with from, to, bandwidth_gbps)")

    def _check_encode(self, entry: list[PoolConfig], roles: dict[str, str]) -> None:
        """At most one encode pool, fixed-size, linked to the arrivals' pool (replay/cluster/encode_pool.py)."""
        encode = [p for p in self.pools if p.role == "encode"]
        if not encode:
            return
        if len(encode) > 1:
            raise ServelabError(f"cluster: at most one encode pool; got {len(encode)} ({', '.join(p.name for p in encode)})")
        pool = encode[0]
        if pool.autoscale is not None or pool.instances:
            raise ServelabError(f"cluster pool '{pool.name}': an encode pool has a fixed replica count and one GPU type "
                                "(no autoscale, no instances)")
        for link in self.links:
            if link.source == pool.name and (len(entry) != 1 or link.target != entry[0].name):
                raise ServelabError(f"cluster link {link.source}->{link.target}: an encode pool's link goes to the "
                                    f"arrivals' pool{' ' + repr(entry[0].name) if len(entry) == 1 else ''}")
            if link.target == pool.name:
                raise ServelabError(f"cluster link {link.source}->{link.target}: nothing flows into an encode pool")
        if len(entry) == 1 and not any(l.source == pool.name for l in self.links):
            raise ServelabError(f"cluster: no link from encode pool '{pool.name}' to '{entry[0].name}' "
                                "([[cluster.links]] with from, to, bandwidth_gbps: the embeddings cross it)")

    @property
    def entry(self) -> PoolConfig:
        """The pool arrivals are routed to (the mixed or prefill pool)."""
        return next(p for p in self.pools if p.role not in NOT_ENTRY)

    @property
    def encode(self) -> PoolConfig | None:
        return next((p for p in self.pools if p.role == "encode"), None)

    def encode_link(self) -> LinkConfig:
        return next(l for l in self.links if l.source == self.encode.name)

    @property
    def decode(self) -> PoolConfig | None:
        return next((p for p in self.pools if p.role == "decode"), None)

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None

    def link(self) -> LinkConfig:
        entry, decode = self.entry.name, self.decode.name
        return next(l for l in self.links if l.source == entry and l.target == decode)

    def with_pool_keys(self, values: Mapping[tuple[str, str], Any], source: str = "options") -> ClusterConfig:
        """This cluster with pool keys set, ``{(pool, key): raw value}`` (``replicas``, ``price_per_gpu_hour``,
        ``rebalance``, ``autoscale.<key>``, ``instances.<gpu>.price_per_gpu_hour`` or any override a pool
        takes), each value typed here alone (the
        edge) and put over the pool with ``dataclasses.replace``; the pools' other values are kept as they
        are typed: what a search's trial does to its base's pools. A pool whose ``policy`` is set without
        its ``policy_params`` drops its own (another policy's), as in a TOML file."""
        by_name = {p.name: p for p in self.pools}
        given: dict[str, dict[str, Any]] = {}
        for (name, key), value in values.items():
            if name not in by_name:
                raise ServelabError(f"{source}: no cluster pool '{name}'{did_you_mean(name, by_name)}")
            given.setdefault(name, {})[key.replace("-", "_")] = value
        return replace(self, pools=tuple(_with_keys(p, given[p.name], source) if p.name in given else p
                                         for p in self.pools))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pools": [p.to_dict() for p in self.pools]}
        if self.links:
            out["links"] = [l.to_dict() for l in self.links]
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> ClusterConfig:
        where = f"{source}: cluster"
        if not isinstance(data, dict):
            raise ServelabError(f"{where} must be a table")
        unknown = set(data) - {"pools", "links"}
        if unknown:
            raise ServelabError(f"{where}: unknown key '{min(unknown)}' (known: links, pools)")
        raw_pools = data.get("pools")
        if not isinstance(raw_pools, list) or not raw_pools:
            raise ServelabError(f"{where}.pools must be a non-empty array of tables ([[cluster.pools]])")
        from servelab.replay.cluster.autoscale import AutoscaleConfig
        from servelab.replay.cluster.instances import PerfFloor, parse_instances

        engine_keys = {f.name for f in fields(EngineConfig)} - {"replicas", "router"}
        pools = []
        for i, raw in enumerate(raw_pools):
            at = f"{where}.pools[{i}]"
            if not isinstance(raw, dict):
                raise ServelabError(f"{at} must be a table")
            raw = {k.replace("-", "_"): v for k, v in raw.items()}
            if "name" not in raw:
                raise ServelabError(f"{at}: missing 'name'")
            settings = []
            for key, value in raw.items():
                if key in ("name", "role", "replicas", "price_per_gpu_hour", "autoscale", "instances", "floor",
                           "rebalance"):
                    continue
                if key in CLUSTER_WIDE:
                    raise ServelabError(f"{at}: '{key}' is the cluster's, not a pool's: set it at the top level")
                if key not in engine_keys and key not in POOL_TOP:
                    known = sorted((engine_keys - set(CLUSTER_WIDE)) | set(POOL_TOP))
                    raise ServelabError(f"{at}: unknown key '{key}'{did_you_mean(key, known)}")
                settings.append((key, typed_setting(key, value, f"{at}.{key}")))
            pools.append(PoolConfig(
                name=str(raw["name"]), role=str(raw.get("role", "mixed")),
                replicas=coerce(raw.get("replicas", 1), "int", f"{at}.replicas"),
                price_per_gpu_hour=None if raw.get("price_per_gpu_hour") is None
                else coerce(raw["price_per_gpu_hour"], "float", f"{at}.price_per_gpu_hour"),
                settings=tuple(sorted(settings)),
                autoscale=None if "autoscale" not in raw else (
                    raw["autoscale"] if isinstance(raw["autoscale"], AutoscaleConfig)
                    else AutoscaleConfig.from_dict(raw["autoscale"], at)),
                instances=() if "instances" not in raw else parse_instances(raw["instances"], f"{at}.instances"),
                floor=None if "floor" not in raw else PerfFloor.from_dict(raw["floor"], f"{at}.floor"),
                rebalance=coerce(raw.get("rebalance", False), "bool", f"{at}.rebalance")))
        links = []
        for i, raw in enumerate(data.get("links", [])):
            at = f"{where}.links[{i}]"
            if not isinstance(raw, dict):
                raise ServelabError(f"{at} must be a table")
            raw = {k.replace("-", "_"): v for k, v in raw.items()}
            unknown = set(raw) - {"from", "to", "bandwidth_gbps", "latency_s", "stream_layers"}
            if unknown:
                raise ServelabError(f"{at}: unknown key '{min(unknown)}' "
                                    "(known: bandwidth_gbps, from, latency_s, stream_layers, to)")
            for key in ("from", "to"):
                if key not in raw:
                    raise ServelabError(f"{at}: missing '{key}'")
            links.append(LinkConfig(str(raw["from"]), str(raw["to"]),
                                    coerce(raw.get("bandwidth_gbps", 50.0), "float", f"{at}.bandwidth_gbps"),
                                    coerce(raw.get("latency_s", 0.0), "float", f"{at}.latency_s"),
                                    coerce(raw.get("stream_layers", 0), "int", f"{at}.stream_layers")))
        return cls(tuple(pools), tuple(links))


# a pool's own keys beyond the engine's, and their types
TOP_TYPES = {"runner": "RunnerSpec", "model": "str", "gpu": "str", "tp": "int", "policy": "str", "router": "str",
             "policy_params": "table", "router_params": "table"}


def typed_setting(key: str, value: Any, where: str) -> Any:
    """One pool override -> its typed value, at the edge (the TOML file, a search spec): an engine key
    takes `EngineConfig`'s field type (a list field becomes a tuple of strings), a top key its own. What
    comes out is used as it is: ``pool_config`` replaces fields with it and coerces nothing."""
    if key in TOP_TYPES:
        kind = TOP_TYPES[key]
        if kind == "RunnerSpec":  # a spec string parsed into the runner's typed Params, here only
            return runner_spec(value, where)
        if kind == "table":
            if is_params(value):  # typed already (``ReplayConfig`` types a pool's tables against its policy, router)
                return value
            if not isinstance(value, dict):
                raise ServelabError(f"{where} must be a table")
            return dict(value)
        return coerce(value, kind, where)
    annotation = ENGINE_TYPES[key]
    if annotation.startswith("tuple"):
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ServelabError(f"{where}: expected a string or an array of strings, got {value!r}")
        return tuple(value)
    return coerce(value, annotation, where)


def _with_keys(pool: PoolConfig, given: dict[str, Any], source: str) -> PoolConfig:
    """``pool`` with the raw values ``given`` typed and put over it (``ClusterConfig.with_pool_keys``)."""
    from servelab.replay.cluster.autoscale import AutoscaleConfig

    at = f"{source}: cluster pool '{pool.name}'"
    own = {"replicas": "int", "price_per_gpu_hour": "float", "rebalance": "bool"}
    scale_types = {f.name: f.type for f in fields(AutoscaleConfig)}
    changed: dict[str, Any] = {}
    settings = dict(pool.settings)
    scale: dict[str, Any] = {}
    for key, value in given.items():
        if key in own:
            changed[key] = coerce(value, own[key], f"{at}.{key}")
        elif key.startswith("autoscale."):
            name = key[len("autoscale."):]
            if pool.autoscale is None or name not in scale_types:
                raise ServelabError(f"{at}: no '{key}'" + (" (the pool has no autoscale)" if pool.autoscale is None
                                                           else did_you_mean(name, scale_types)))
            scale[name] = coerce(value, scale_types[name], f"{at}.{key}")
        elif key.startswith("instances.") and key.endswith(".price_per_gpu_hour"):  # one instance type's price
            gpu = key[len("instances."):-len(".price_per_gpu_hour")]
            kinds = changed.get("instances", pool.instances)
            if gpu not in {t.gpu for t in kinds}:
                raise ServelabError(f"{at}: no instance type '{gpu}'{did_you_mean(gpu, [t.gpu for t in kinds])}")
            price = coerce(value, "float", f"{at}.{key}")
            if not 0 <= price < math.inf:
                raise ServelabError(f"{at}.{key}: must be a finite number >= 0, got {price}")
            changed["instances"] = tuple(replace(t, price_per_gpu_hour=price) if t.gpu == gpu else t for t in kinds)
        elif key in CLUSTER_WIDE:
            raise ServelabError(f"{at}: '{key}' is the cluster's, not a pool's: set it at the top level")
        elif key in ENGINE_TYPES and key != "replicas" or key in TOP_TYPES:
            settings[key] = typed_setting(key, value, f"{at}.{key}")
        else:
            known = sorted({*own, *(set(ENGINE_TYPES) - set(CLUSTER_WIDE) - {"replicas"}), *TOP_TYPES})
            raise ServelabError(f"{at}: unknown key '{key}'{did_you_mean(key, known)}")
    if "policy" in given and "policy_params" not in given:
        settings.pop("policy_params", None)
    if scale:
        changed["autoscale"] = replace(pool.autoscale, **scale)
    return replace(pool, settings=tuple(sorted(settings.items())), **changed)


def is_typed(key: str, value: Any) -> bool:
    """Is ``value`` already what ``typed_setting(key, ...)`` makes (so a frozen pool holds it as it is)?"""
    kind = _kind(key)
    if kind == "RunnerSpec":
        return isinstance(value, RunnerSpec)
    if kind == "table":
        return is_params(value) or isinstance(value, dict)
    base, optional = type_name(kind)
    if value is None:
        return optional
    if base.startswith("tuple"):
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if base == "int":
        return type(value) is int
    if base == "float":
        return type(value) in (int, float) and math.isfinite(value)
    return type(value) is {"str": str, "bool": bool}.get(base, type(value))


def _kind(key: str) -> str:
    return TOP_TYPES[key] if key in TOP_TYPES else ENGINE_TYPES[key]


def is_params(value: Any) -> bool:
    """Is ``value`` a typed parameters object (a dataclass instance), not a table?"""
    return is_dataclass(value) and not isinstance(value, type)


def split_settings(settings: tuple[tuple[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pool's typed settings -> (engine fields, top-level fields) to ``dataclasses.replace`` with."""
    engine = {k: v for k, v in settings if k in ENGINE_TYPES}
    return engine, {k: v for k, v in settings if k not in ENGINE_TYPES}


ENGINE_TYPES = {f.name: f.type for f in fields(EngineConfig)}

__all__ = ["ClusterConfig", "LinkConfig", "PoolConfig", "is_params", "split_settings", "typed_setting"]
