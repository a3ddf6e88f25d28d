"""Parse a search spec (TOML) into frozen dataclasses: trace, base config, SLOs, space, objectives, sampler, storage.

Every rule names the file and the key that broke it (``InputError(path, rule, column="space.max_num_seqs")``).
Relative paths (the trace) are read relative to the spec file's folder, so a spec travels with its trace.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from servelab.common.coerce import base_type, is_a
from servelab.common.errors import InputError, ServelabError
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.scoring.slo import SloTable
from servelab.common.textfile import read_text

# Objectives a trial can report, with the direction Optuna optimises them in.
LATENCY_METRICS = ("ttft", "tpot", "e2e", "queue")
LATENCY_STATS = ("p50", "p90", "p99", "mean")
OBJECTIVES: dict[str, str] = {
    "attainment": "maximize",  # share of requests meeting every SLO at the trace's rate
    "goodput": "maximize",  # highest arrival rate (req/s) whose attainment meets the target
    "goodput_per_gpu": "maximize",  # goodput / (replicas x tp)
    "cost": "minimize",  # GPUs, or $/hour with gpu_prices, subject to attainment >= target
    # $ per million output tokens at the trace's rate (the cost view), subject to attainment >= target
    "cost_per_million_tokens": "minimize",
    "throughput": "maximize",  # completed requests per second at the trace's rate
    **{f"{m}_{s}": "minimize" for m in LATENCY_METRICS for s in LATENCY_STATS},  # seconds at the trace's rate
}
SAMPLERS = ("tpe", "random", "grid", "cmaes", "nsga2", "gp")
PRUNERS = ("none", "median", "hyperband")
DEFAULT_CHECKPOINTS = (0.25, 0.5)
TOP_KEYS = (
    "trace", "objective", "n_trials", "seed", "timeout_s", "timeout", "target", "slo", "space", "replay", "runner", "model",
    "gpu", "tp", "goodput", "cost", "sampler", "pruner", "storage", "study_name", "workers", "cluster", "gpu_budget",
)  # fmt: skip
# ReplayConfig keys that are not engine fields; all may be searched.
TOP_CONFIG_KEYS = ("policy", "runner", "model", "gpu", "tp")
# Objectives subject to attainment >= target (an Optuna constraint: a trial below it is infeasible).
CONSTRAINED = ("cost", "cost_per_million_tokens")
# A cluster pool's searchable keys besides the engine keys (`space.pools.NAME.KEY`), with their types;
# `autoscale.KEY` takes the autoscale table's keys (replay/cluster/autoscale.py).
POOL_KEYS = {"replicas": "int", "gpu": "str", "tp": "int", "router": "str", "runner": "str", "model": "str",
             "policy": "str"}
AUTOSCALE_KEYS = {"min": "int", "max": "int", "signal": "str", "target": "float", "interval_s": "float",
                  "cooldown_s": "float", "startup_s": "float"}
FILL = "fill"  # `replicas = "fill"`: the pool takes the GPUs gpu_budget leaves


@dataclass(frozen=True, slots=True)
class TraceSpec:
    path: Path
    window_s: tuple[float, float | None] | None = None  # keep requests arriving in [start, end), re-based to 0
    head: int | None = None  # keep the first n requests
    rate_scale: float | None = None  # multiply the arrival rate by this
    rate_rps: float | None = None  # or scale to this offered rate

    @property
    def transformed(self) -> bool:
        return any(v is not None for v in (self.window_s, self.head, self.rate_scale, self.rate_rps))


@dataclass(frozen=True, slots=True)
class Param:
    """One searched dimension. ``name`` is the Optuna parameter name; ``policy`` makes it conditional."""

    name: str
    key: str  # ReplayConfig key ("max_num_seqs", "policy", "tp"), the policy parameter's name, or a pool's key
    is_policy_param: bool = False
    policy: str | None = None  # sampled only when this policy is the trial's policy
    kind: str = "choice"  # int | float | choice
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple = ()
    pool: str | None = None  # a cluster pool's key ("replicas", "autoscale.target") of this pool

    def grid_values(self) -> tuple:
        if self.kind == "choice":
            return self.choices
        if self.step is None and self.kind == "float":
            raise ServelabError(f"sampler 'grid' needs choices or a step for '{self.name}'")
        step = self.step or 1
        n = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        values = [self.low + i * step for i in range(n)]
        return tuple(int(v) for v in values) if self.kind == "int" else tuple(values)


@dataclass(frozen=True, slots=True)
class GoodputSpec:
    tolerance: float = 0.02  # bisection stops when hi/lo - 1 <= tolerance (as `servelab sweep --tolerance`)
    min_rate: float | None = None
    max_rate: float | None = None


@dataclass(frozen=True, slots=True)
class SearchSpec:
    path: Path
    trace: TraceSpec
    base: ReplayConfig
    slo: SloTable
    target: float
    space: tuple[Param, ...]
    objectives: tuple[str, ...]
    goodput: GoodputSpec = GoodputSpec()
    gpu_prices: tuple[tuple[str, float], ...] = ()  # $ per GPU-hour, by GPU preset name
    sampler: str = "tpe"
    sampler_options: tuple[tuple[str, Any], ...] = ()
    pruner: str = "none"
    pruner_options: tuple[tuple[str, Any], ...] = ()
    checkpoints: tuple[float, ...] = ()
    seed: int = 0
    n_trials: int = 50
    timeout_s: float | None = None
    storage: str | None = None  # None: a journal file inside the study directory
    study_name: str = "servelab"
    workers: int | None = None  # local worker processes; None ("auto"): one per free core (search/batch.py)
    gpu_budget: int | None = None  # GPUs of all pools together: more is infeasible
    fill_pool: str | None = None  # the pool whose replicas take what gpu_budget leaves

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(OBJECTIVES[o] for o in self.objectives)

    def identity(self) -> dict[str, Any]:
        """What defines the study: changing any of it makes a different study (n_trials, workers, timeout do not)."""
        return {
            "trace": {"path": str(self.trace.path), "window_s": self.trace.window_s, "head": self.trace.head,
                      "rate_scale": self.trace.rate_scale, "rate_rps": self.trace.rate_rps},
            "base": self.base.to_dict(),
            "slo": self.slo.describe(),
            "target": self.target,
            # (a flat parameter's dict stays as it was before pools could be searched: old studies resume)
            "space": [{k: v for k, v in asdict(p).items() if k != "pool" or v is not None} for p in self.space],
            "objectives": list(self.objectives),
            "goodput": asdict(self.goodput),
            "gpu_prices": [list(p) for p in self.gpu_prices],
            "sampler": [self.sampler, [list(o) for o in self.sampler_options]],
            "pruner": [self.pruner, [list(o) for o in self.pruner_options], list(self.checkpoints)],
            "seed": self.seed,
            **({"gpu_budget": self.gpu_budget, "fill_pool": self.fill_pool} if self.gpu_budget is not None else {}),
        }  # fmt: skip

    def identity_hash(self) -> str:
        text = json.dumps(comparable_identity(self.identity()), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def comparable_identity(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity a resume must match: without the trace's path, which depends on the working
    directory the spec was named from (the trace's content is checked by its SHA-256 instead), and
    without a cluster pool's price of 0.0, which a study recorded for an unpriced pool before an
    unpriced pool's price was left out (None)."""
    out = json.loads(json.dumps(dict(identity), default=str))
    if isinstance(out.get("trace"), dict):
        out["trace"].pop("path", None)
    pools = ((out.get("base") or {}).get("cluster") or {}).get("pools") or []
    for pool in pools:
        for table in (pool, *pool.get("instances", ())):
            if table.get("price_per_gpu_hour") == 0.0:
                del table["price_per_gpu_hour"]
    return out


def load_spec(path: str | Path) -> SearchSpec:
    path = Path(path)
    try:
        data = tomllib.loads(read_text(path))  # a binary file: a one-line InputError
    except FileNotFoundError:
        raise InputError(path, "no such spec file") from None
    except IsADirectoryError:
        raise InputError(path, "is a directory, not a spec file") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(path, f"invalid TOML: {err}") from None
    return parse_spec(data, path)


def parse_spec(data: Mapping[str, Any], path: Path) -> SearchSpec:
    p = _Parser(path)
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise p.error(unknown[0], f"unknown key (known: {', '.join(sorted(TOP_KEYS))})")
    if "trace" not in data:
        raise p.error("trace", "required (a trace file, or a table with path = ...)")
    if "space" not in data:
        raise p.error("space", "required: at least one parameter to search")
    trace = p.trace(data["trace"])
    base = p.base_config(data)
    slo_data = dict(p.table(data.get("slo", {}), "slo"))
    target = slo_data.pop("target", None)
    if target is not None and "target" in data:
        raise p.error("slo.target", "given twice (also as top-level 'target')")
    target = p.number(data.get("target", target if target is not None else 0.9), "target")
    if not 0 < target <= 1:
        raise p.error("target", f"attainment target must be in (0, 1], got {target:g}")
    slo = SloTable.from_toml({"slo": slo_data}, str(path)) if slo_data else SloTable()
    objectives = p.objectives(data.get("objective", "attainment"))
    policies = p.policies_in_play(base, data["space"])
    space = p.space(data["space"], base, policies)
    p.check_names(data, base, space)  # a misspelt GPU, model, router...: refused here, not as infeasible trials
    fill_pool = p.fill_pool(data["space"])
    gpu_budget = p.gpu_budget(data.get("gpu_budget"), base, fill_pool)
    goodput = p.goodput(data.get("goodput", {}))
    gpu_prices = p.cost(data.get("cost", {}), objectives, base, space)
    sampler, sampler_options = p.named_table(data.get("sampler", "tpe"), "sampler", SAMPLERS)
    pruner, pruner_options = p.named_table(data.get("pruner", "none"), "pruner", PRUNERS)
    checkpoints: tuple[float, ...] = ()
    opts = dict(pruner_options)
    if "checkpoints" in opts:
        raw = opts.pop("checkpoints")
        if pruner == "none":
            raise p.error("pruner.checkpoints", "checkpoints need a pruner (median or hyperband)")
        if not isinstance(raw, list) or not raw or not all(_is_number(x) and 0 < x < 1 for x in raw):
            raise p.error("pruner.checkpoints", "must be a list of fractions of the trace span in (0, 1)")
        checkpoints = tuple(sorted({float(x) for x in raw}))
    elif pruner != "none":
        checkpoints = DEFAULT_CHECKPOINTS
    if pruner != "none" and objectives != ("attainment",):
        raise p.error("pruner", "pruning reports attainment at checkpoints, so it needs objective = \"attainment\"")
    if sampler == "grid":
        for param in space:
            if param.kind == "float" and param.step is None:
                raise p.error(f"space.{param.name}", "sampler 'grid' needs choices or a step for a float range")
    if sampler == "cmaes" and len(objectives) > 1:
        raise p.error("sampler", "cmaes optimises a single objective; use tpe or nsga2 for several")
    n_trials = p.integer(data.get("n_trials", 50), "n_trials", minimum=1)
    seed = p.integer(data.get("seed", 0), "seed", minimum=0)
    workers = data.get("workers", "auto")
    if workers != "auto" and not _is_number(workers):
        raise p.error("workers", f'needs an integer or "auto", got {workers!r}')
    workers = None if workers == "auto" else p.integer(workers, "workers", minimum=1)
    if "timeout" in data and "timeout_s" in data:
        raise p.error("timeout", "given twice (also as timeout_s)")
    timeout_key = "timeout" if "timeout" in data else "timeout_s"
    timeout = data.get(timeout_key)
    if timeout is not None:
        timeout = p.number(timeout, timeout_key)
        if timeout <= 0:
            raise p.error(timeout_key, "must be > 0 seconds")
    storage = data.get("storage")
    if storage is not None:
        storage = p.string(storage, "storage")
        if not storage.startswith(("postgresql", "mysql", "sqlite:")):
            raise p.error("storage", "must be a database URL (postgresql://user@host/db, sqlite:///file.db); "
                                     "leave it out for a journal file inside the study directory")  # fmt: skip
    study_name = p.string(data.get("study_name", path.stem), "study_name")
    return SearchSpec(
        path=path, trace=trace, base=base, slo=slo, target=target, space=space, objectives=objectives,
        goodput=goodput, gpu_prices=gpu_prices, sampler=sampler, sampler_options=tuple(sorted(sampler_options.items())),
        pruner=pruner, pruner_options=tuple(sorted(opts.items())), checkpoints=checkpoints, seed=seed,
        n_trials=n_trials, timeout_s=timeout, storage=storage, study_name=study_name, workers=workers,
        gpu_budget=gpu_budget, fill_pool=fill_pool,
    )  # fmt: skip


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class _Parser:
    path: Path
    _engine_types: dict[str, str] = field(default_factory=lambda: {f.name: base_type(f.type) for f in fields(EngineConfig)})

    def error(self, key: str, rule: str) -> InputError:
        return InputError(self.path, rule, column=key)

    def table(self, value: Any, key: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(key, "must be a table")
        return value

    def number(self, value: Any, key: str) -> float:
        if not _is_number(value):
            raise self.error(key, f"needs a number, got {value!r}")
        return float(value)

    def integer(self, value: Any, key: str, minimum: int | None = None) -> int:
        if not _is_number(value) or float(value) != int(value):
            raise self.error(key, f"needs an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return int(value)

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(key, f"needs a non-empty string, got {value!r}")
        return value

    def trace(self, value: Any) -> TraceSpec:
        raw = {"path": value} if isinstance(value, str) else dict(self.table(value, "trace"))
        known = ("path", "window_s", "head", "rate_scale", "rate_rps")
        for key in raw:
            if key not in known:
                raise self.error(f"trace.{key}", f"unknown key (known: {', '.join(known)})")
        if "path" not in raw:
            raise self.error("trace.path", "required")
        path = Path(self.string(raw["path"], "trace.path")).expanduser()
        if not path.is_absolute():
            path = self.path.parent / path
        window = raw.get("window_s")
        if window is not None:
            if not isinstance(window, list) or len(window) != 2 or not _is_number(window[0]) or not (
                window[1] is None or _is_number(window[1]) or window[1] == "end"
            ):
                raise self.error("trace.window_s", "must be [start_s, end_s] (end_s may be \"end\")")
            end = None if window[1] in (None, "end") else float(window[1])
            if window[0] < 0 or (end is not None and end <= window[0]):
                raise self.error("trace.window_s", "needs 0 <= start_s < end_s")
            window = (float(window[0]), end)
        head = raw.get("head")
        if head is not None:
            head = self.integer(head, "trace.head", minimum=1)
        scale = raw.get("rate_scale")
        rate = raw.get("rate_rps")
        if scale is not None and rate is not None:
            raise self.error("trace.rate_rps", "give rate_scale or rate_rps, not both")
        for key, val in (("rate_scale", scale), ("rate_rps", rate)):
            if val is not None and not (_is_number(val) and val > 0):
                raise self.error(f"trace.{key}", f"must be a positive number, got {val!r}")
        return TraceSpec(path, window, head, None if scale is None else float(scale), None if rate is None else float(rate))

    def base_config(self, data: Mapping[str, Any]) -> ReplayConfig:
        raw = dict(self.table(data.get("replay", {}), "replay"))
        for key in ("runner", "model", "gpu", "tp", "cluster"):
            if key in data:
                if key in raw:
                    raise self.error(key, f"given twice (top level and replay.{key})")
                raw[key] = data[key]
        try:
            config = ReplayConfig.from_dict(raw, source=f"{self.path}, [replay]")  # (its policy and router parameters too)
        except InputError:
            raise
        except ServelabError as err:
            raise InputError(self.path, str(err).replace(f"{self.path}, ", ""), column="replay") from None
        return config

    def objectives(self, value: Any) -> tuple[str, ...]:
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names:
            raise self.error("objective", "must be a name or a list of names")
        out = []
        for name in names:
            if name not in OBJECTIVES:
                raise self.error("objective", f"unknown objective {name!r} (known: {', '.join(OBJECTIVES)})")
            if name in out:
                raise self.error("objective", f"{name!r} given twice")
            out.append(name)
        return tuple(out)

    def policies_in_play(self, base: ReplayConfig, space: Any) -> tuple[str, ...]:
        from servelab.policies.base import policy_names

        space = self.table(space, "space")
        if "policy" not in space:
            return (base.policy,)
        choices = space["policy"]
        if isinstance(choices, Mapping):
            choices = choices.get("choices")
        if not isinstance(choices, list) or not choices:
            raise self.error("space.policy", "must be a list of policy names")
        for name in choices:
            self.check_name("policy", name, "space.policy")
        return tuple(choices)

    def check_name(self, key: str, value: Any, where: str) -> None:
        """Refuse a value of a named key (NAMED_KEYS) that names nothing, as a trial's replay would refuse it."""
        resolve = _name_resolver(key)
        if resolve is None or not isinstance(value, str):
            return
        try:
            resolve(value)
        except ServelabError as err:
            raise self.error(where, str(err)) from None

    def check_names(self, data: Mapping[str, Any], base: ReplayConfig, space: tuple[Param, ...]) -> None:
        """Every named choice of the spec names something: the base's GPU, model, runner, policy and router
        (its pools' and instance types' too) and each choice of such a key in the space."""
        replay = data.get("replay") if isinstance(data.get("replay"), Mapping) else {}
        for key in NAMED_KEYS:
            if key != "runner":  # (typed, and so refused, by the config already)
                where = key if key in data else f"replay.{key}" if key in replay else "replay"
                self.check_name(key, _named_value(base, key), where)
        if base.cluster is not None:
            for i, pool in enumerate(base.cluster.pools):
                for key, value in pool.settings:
                    self.check_name(key, value, f"cluster.pools[{i}].{key}")
                for j, kind in enumerate(pool.instances):
                    self.check_name("gpu", kind.gpu, f"cluster.pools[{i}].instances[{j}].gpu")
        for param in space:
            if param.kind == "choice" and not param.is_policy_param and param.pool is None:  # (pools': below)
                for value in param.choices:
                    self.check_name(param.key, value, f"space.{param.name}")

    def space(self, value: Any, base: ReplayConfig, policies: tuple[str, ...]) -> tuple[Param, ...]:
        space = self.table(value, "space")
        params: list[Param] = []
        for key, spec in space.items():
            if key == "pools" or key.startswith("pools."):
                params += self._pool_params(key, spec, base)
                continue
            if key == "policy_params" or key.startswith("policy_params."):
                entries = {key[len("policy_params."):]: spec} if key != "policy_params" else self.table(spec, "space.policy_params")
                params += self._policy_params(entries, policies)
                continue
            params.append(self._engine_param(key, spec, base))
        if not params:
            raise self.error("space", "no parameters to search")
        self.check_pool_values(tuple(params), base)
        names = [p.name for p in params]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise self.error(f"space.{dup}", "given twice")
        return tuple(params)

    def _engine_param(self, key: str, spec: Any, base: ReplayConfig) -> Param:
        where = f"space.{key}"
        if key in self._engine_types:
            base_type = self._engine_types[key]
        elif key in TOP_CONFIG_KEYS:
            base_type = "int" if key == "tp" else "str"
        else:
            known = sorted([*self._engine_types, *TOP_CONFIG_KEYS, "policy_params.<name>"])
            raise self.error(where, f"unknown parameter (known: {', '.join(known)}, pools.<pool>.<key>)")
        if base.cluster is not None and key == "replicas":
            raise self.error(where, f"the base config has a [cluster]: search a pool's replicas "
                                    f"(\"pools.{base.cluster.entry.name}.replicas\" = ...)")  # fmt: skip
        param = self._param(key, key, spec, base_type, where)
        self._check_values(param, where)
        return param

    def _policy_params(self, entries: Mapping[str, Any], policies: tuple[str, ...]) -> list[Param]:
        from servelab.policies.base import policy_class, policy_names

        out = []
        for name, spec in entries.items():
            # A table of parameter specs under a policy's name: parameters of that policy only.
            if "." in name or (name in policy_names() and isinstance(spec, Mapping) and not _is_param_table(spec)):
                policy, _, rest = name.partition(".")
                block = {rest: spec} if rest else self.table(spec, f"space.policy_params.{policy}")
                if policy not in policy_names():
                    raise self.error(f"space.policy_params.{name}", f"unknown policy {policy!r}")
                if policy not in policies:
                    raise self.error(f"space.policy_params.{policy}",
                                     f"policy {policy!r} is neither the base policy nor among space.policy")  # fmt: skip
                types = {f.name: base_type(f.type) for f in fields(policy_class(policy).Params)}
                for pkey, pspec in block.items():
                    where = f"space.policy_params.{policy}.{pkey}"
                    if pkey not in types:
                        raise self.error(where, f"policy {policy!r} has no such parameter "
                                                f"(parameters: {', '.join(sorted(types)) or 'none'})")  # fmt: skip
                    out.append(self._param(f"policy_params.{policy}.{pkey}", pkey, pspec, types[pkey], where,
                                           policy=policy, is_policy_param=True))  # fmt: skip
                continue
            where = f"space.policy_params.{name}"
            owners = {p: base_type(f.type) for p in policies for f in fields(policy_class(p).Params) if f.name == name}
            if not owners:
                raise self.error(where, f"no policy in play ({', '.join(policies)}) has this parameter")
            if len(set(owners.values())) > 1:
                raise self.error(where, f"policies disagree on its type ({owners})")
            out.append(self._param(f"policy_params.{name}", name, spec, next(iter(owners.values())), where,
                                   is_policy_param=True))  # fmt: skip
        return out

    def _param(self, name: str, key: str, spec: Any, base_type: str, where: str, policy: str | None = None,
               is_policy_param: bool = False) -> Param:  # fmt: skip
        common = {"name": name, "key": key, "policy": policy, "is_policy_param": is_policy_param}
        if isinstance(spec, Mapping) and "choices" in spec:
            extra = sorted(set(spec) - {"choices"})
            if extra:
                raise self.error(where, f"unknown key '{extra[0]}' beside choices")
            spec = spec["choices"]
        if isinstance(spec, list):
            if not spec:
                raise self.error(where, "choices must not be empty")
            if any(isinstance(v, (list, dict)) for v in spec):
                raise self.error(where, "choices must be plain values (numbers, strings, booleans)")
            if len(set(map(repr, spec))) != len(spec):
                raise self.error(where, "choices repeat")
            for v in spec:
                _coerce_checked(self, v, base_type, where)
            return Param(kind="choice", choices=tuple(spec), **common)
        if not isinstance(spec, Mapping):
            raise self.error(where, "must be a range table {low = .., high = ..} or a list of choices "
                                    "(a fixed value belongs in [replay])")  # fmt: skip
        extra = sorted(set(spec) - {"low", "high", "log", "step"})
        if extra:
            raise self.error(where, f"unknown key '{extra[0]}' (a range takes low, high, log, step)")
        if "low" not in spec or "high" not in spec:
            raise self.error(where, "a range needs low and high")
        if base_type not in ("int", "float"):
            raise self.error(where, f"a {base_type} parameter needs a list of choices, not a range")
        low, high = self.number(spec["low"], f"{where}.low"), self.number(spec["high"], f"{where}.high")
        if base_type == "int" and (low != int(low) or high != int(high)):
            raise self.error(where, "an integer parameter needs integer low and high")
        if not low < high:
            raise self.error(where, f"low ({low:g}) must be below high ({high:g})")
        log = spec.get("log", False)
        if not isinstance(log, bool):
            raise self.error(f"{where}.log", "must be true or false")
        step = spec.get("step")
        if step is not None:
            step = self.number(step, f"{where}.step")
            if step <= 0 or (base_type == "int" and step != int(step)):
                raise self.error(f"{where}.step", "must be a positive number (an integer for integer parameters)")
            if log:
                raise self.error(where, "log and step cannot be combined")
        if log and low <= 0:
            raise self.error(where, "a log range needs low > 0")
        if base_type == "int":
            low, high = int(low), int(high)
            step = int(step) if step is not None else None
        return Param(kind=base_type, low=low, high=high, log=log, step=step, **common)

    def _check_values(self, param: Param, where: str) -> None:
        """Endpoints and choices must make a valid config on their own (e.g. max_num_seqs >= 1)."""
        if param.key == "policy":
            return
        values = param.choices if param.kind == "choice" else (param.low, param.high)
        for v in values:
            if param.key in self._engine_types:
                try:
                    EngineConfig(**{param.key: _coerce_checked(self, v, self._engine_types[param.key], where)})
                except ServelabError as err:
                    raise self.error(where, f"value {v!r}: {err}") from None
            elif param.key == "tp" and v < 1:
                raise self.error(where, f"tp must be >= 1, got {v}")

    # -- cluster pools ---------------------------------------------------------------------------

    def _pool_leaves(self, key: str, spec: Any) -> list[tuple[str, Any]]:
        """``pools.a.b = spec`` and ``[space.pools.a] b = spec`` alike -> [("pools.a.b", spec)]."""
        if isinstance(spec, Mapping) and not _is_param_table(spec):
            if not spec:
                raise self.error(f"space.{key}", "empty table: no parameters to search")
            return [leaf for sub, value in spec.items() for leaf in self._pool_leaves(f"{key}.{sub}", value)]
        return [(key, spec)]

    def _pool_of(self, path: str, base: ReplayConfig) -> tuple[Any, str]:
        """(the base cluster's pool, the key within it) that ``pools.NAME.KEY`` names."""
        where = f"space.{path}"
        if base.cluster is None:
            raise self.error(where, "the base config has no [cluster] to search over (add [[cluster.pools]] to the "
                                    "spec, or [[replay.cluster.pools]])")  # fmt: skip
        rest = path[len("pools."):]
        names = [p.name for p in base.cluster.pools]
        matches = [n for n in names if rest.startswith(n + ".")]
        if not matches:
            from servelab.common.registry import did_you_mean

            head = rest.split(".")[0]
            raise self.error(where, f"no pool '{head}' in the base cluster{did_you_mean(head, names)} "
                                    f"(pools: {', '.join(names)})")  # fmt: skip
        name = max(matches, key=len)
        return next(p for p in base.cluster.pools if p.name == name), rest[len(name) + 1:]

    def _pool_key_type(self, pool, key: str, where: str) -> str:
        from servelab.replay.cluster.config import CLUSTER_WIDE

        if key.startswith("autoscale."):
            sub = key[len("autoscale."):]
            if sub not in AUTOSCALE_KEYS:
                raise self.error(where, f"unknown autoscale key '{sub}' (known: {', '.join(AUTOSCALE_KEYS)})")
            if pool.autoscale is None:
                raise self.error(where, f"pool '{pool.name}' has no autoscale table in the base cluster "
                                        "([cluster.pools.autoscale] with min, max, ...)")  # fmt: skip
            return AUTOSCALE_KEYS[sub]
        if key in POOL_KEYS:
            return POOL_KEYS[key]
        if key in self._engine_types and key not in CLUSTER_WIDE:
            return self._engine_types[key]
        known = sorted({*POOL_KEYS, *(k for k in self._engine_types if k not in CLUSTER_WIDE)}) + \
            [f"autoscale.{k}" for k in AUTOSCALE_KEYS]
        raise self.error(where, f"not a searchable pool key (known: {', '.join(known)})")

    def _pool_params(self, key: str, spec: Any, base: ReplayConfig) -> list[Param]:
        out = []
        for path, leaf in self._pool_leaves(key, spec):
            where = f"space.{path}"
            pool, pkey = self._pool_of(path, base)
            kind = self._pool_key_type(pool, pkey, where)
            if leaf == FILL:
                if pkey != "replicas":
                    raise self.error(where, f'"{FILL}" is for a pool\'s replicas only')
                continue  # fill_pool() records it
            param = self._param(f"pools.{pool.name}.{pkey}", pkey, leaf, kind, where)
            out.append(Param(**{**asdict(param), "pool": pool.name}))
        return out

    def check_pool_values(self, space: tuple[Param, ...], base: ReplayConfig) -> None:
        """Each endpoint or choice of a pool key must give a valid cluster with some value of the pool's
        other searched keys (``replicas = 2`` needs ``autoscale.min <= 2`` in some trial)."""
        import itertools

        from servelab.replay.config import pool_config

        def values(p: Param) -> tuple:
            return p.choices if p.kind == "choice" else (p.low, p.high)

        for param in (p for p in space if p.pool is not None):
            where = f"space.{param.name}"
            others = [p for p in space if p.pool == param.pool and p is not param]
            for v in values(param):
                self._check_pool_name(param, v, where)  # (a name first: the config would refuse it too, less plainly)
                error = None
                # alone first (the base's values for the rest): only a value that fails alone is tried
                # with the others' values, and blamed when none helps
                combos = itertools.chain([()], itertools.islice(itertools.product(*(values(o) for o in others)), 256))
                for combo in combos:
                    try:
                        settings = {(o.pool, o.key): w for o, w in zip(others, combo)}
                        config = pool_key_config(base, {**settings, (param.pool, param.key): v}, source=where)
                        for pool in config.cluster.pools:
                            pool_config(config, pool)
                        error = None
                        break
                    except ServelabError as err:
                        error = error or err
                if error is not None:
                    raise self.error(where, f"value {v!r}: {str(error).replace(f'{where}: ', '')}")

    def _check_pool_name(self, param: Param, v: Any, where: str) -> None:
        self.check_name(param.key, v, where)

    def fill_pool(self, space: Mapping[str, Any]) -> str | None:
        fills = [path for key, spec in space.items() if key == "pools" or key.startswith("pools.")
                 for path, leaf in self._pool_leaves(key, spec) if leaf == FILL]  # fmt: skip
        if len(fills) > 1:
            raise self.error(f"space.{fills[1]}", f'only one pool\'s replicas may be "{FILL}" (also {fills[0]})')
        if not fills:
            return None
        return fills[0][len("pools."):-len(".replicas")]

    def gpu_budget(self, value: Any, base: ReplayConfig, fill_pool: str | None) -> int | None:
        if value is None:
            if fill_pool is not None:
                raise self.error(f"space.pools.{fill_pool}.replicas", f'"{FILL}" needs gpu_budget = N (GPUs in all pools)')
            return None
        budget = self.integer(value, "gpu_budget", minimum=1)
        if base.cluster is None:
            raise self.error("gpu_budget", "applies to a [cluster] base config (GPUs of all pools together)")
        if fill_pool is not None:
            pool = next(p for p in base.cluster.pools if p.name == fill_pool)
            if pool.autoscale is not None:
                raise self.error(f"space.pools.{fill_pool}.replicas", f'an autoscaled pool cannot "{FILL}" the budget')
        return budget

    def goodput(self, value: Any) -> GoodputSpec:
        raw = self.table(value, "goodput")
        known = ("tolerance", "min_rate", "max_rate")
        for key in raw:
            if key not in known:
                raise self.error(f"goodput.{key}", f"unknown key (known: {', '.join(known)})")
        tol = self.number(raw.get("tolerance", 0.02), "goodput.tolerance")
        if not 1e-4 <= tol < 1:
            raise self.error("goodput.tolerance", f"must be in [0.0001, 1), got {tol:g}")
        lo = raw.get("min_rate")
        hi = raw.get("max_rate")
        for key, v in (("min_rate", lo), ("max_rate", hi)):
            if v is not None and not (_is_number(v) and v > 0):
                raise self.error(f"goodput.{key}", f"must be a positive rate in req/s, got {v!r}")
        if lo is not None and hi is not None and lo >= hi:
            raise self.error("goodput.min_rate", "must be below goodput.max_rate")
        return GoodputSpec(tol, None if lo is None else float(lo), None if hi is None else float(hi))

    def cost(self, value: Any, objectives, base: ReplayConfig, space) -> tuple[tuple[str, float], ...]:
        raw = self.table(value, "cost")
        for key in raw:
            if key != "gpu_prices":
                raise self.error(f"cost.{key}", "unknown key (known: gpu_prices)")
        prices = self.table(raw.get("gpu_prices", {}), "cost.gpu_prices")
        out = []
        for gpu, price in prices.items():
            if not (_is_number(price) and price > 0):
                raise self.error(f"cost.gpu_prices.{gpu}", f"must be a positive $/GPU-hour, got {price!r}")
            out.append((gpu, float(price)))
        if out and "cost" in objectives and base.cluster is None:
            gpus = {base.gpu} | {v for p in space if p.key == "gpu" for v in p.choices}
            missing = sorted(g for g in gpus if g not in prices)
            if missing:
                raise self.error("cost.gpu_prices", f"no price for GPU {missing[0]!r}")
        priced = bool(out) or (base.cluster is not None and any(
            p.price_per_gpu_hour is not None or any(t.price_per_gpu_hour is not None for t in p.instances)
            for p in base.cluster.pools))
        if "cost_per_million_tokens" in objectives or (base.cluster is not None and "cost" in objectives and priced):
            self._check_prices(dict(out), base, space)  # (`cost` without any price counts GPUs)
        return tuple(sorted(out))

    def _check_prices(self, prices: dict[str, float], base: ReplayConfig, space: tuple[Param, ...]) -> None:
        """Every GPU a trial can put in a pool needs a price: the pool's own, else [cost] gpu_prices."""
        if base.cluster is None:
            gpus = {base.gpu} | {v for p in space if p.key == "gpu" and p.pool is None for v in p.choices}
            missing = sorted(g for g in gpus if g not in prices)
            if missing:
                raise self.error("cost.gpu_prices", f"no price for GPU {missing[0]!r} ($ per GPU-hour: the objective "
                                                    "needs one)")  # fmt: skip
            return
        top_gpus = {base.gpu} | {v for p in space if p.key == "gpu" and p.pool is None for v in p.choices}
        for i, pool in enumerate(base.cluster.pools):
            if pool.instances:  # priced per instance type (replay/cluster/instances.py), else by [cost] gpu_prices
                for j, kind in enumerate(pool.instances):
                    if kind.price_per_gpu_hour is None and kind.gpu not in prices:
                        raise self.error(f"cluster.pools[{i}].instances[{j}].price_per_gpu_hour",
                                         f"no price for instance type {kind.gpu!r} of pool '{pool.name}' (give it "
                                         "a price_per_gpu_hour or [cost] gpu_prices)")  # fmt: skip
                continue
            own = dict(pool.settings).get("gpu")
            searched = {v for p in space if p.pool == pool.name and p.key == "gpu" for v in p.choices}
            gpus = searched or ({own} if own is not None else top_gpus)
            if pool.price_per_gpu_hour is not None:
                if searched:
                    raise self.error(f"cluster.pools[{i}].price_per_gpu_hour",
                                     f"pool '{pool.name}' has a fixed price while its gpu is searched: give the "
                                     "prices per GPU in [cost] gpu_prices instead")  # fmt: skip
                continue
            missing = sorted(g for g in gpus if g not in prices)
            if missing:
                raise self.error("cost.gpu_prices", f"no price for GPU {missing[0]!r} of pool '{pool.name}' (give "
                                                    "the pool a price_per_gpu_hour or [cost] gpu_prices)")  # fmt: skip

    def named_table(self, value: Any, key: str, known: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
        if isinstance(value, str):
            name, options = value, {}
        else:
            options = dict(self.table(value, key))
            name = options.pop("name", None)
            if name is None:
                raise self.error(f"{key}.name", "required")
        if name not in known:
            raise self.error(key, f"unknown {key} {name!r} (known: {', '.join(known)})")
        return name, options


def pool_key_config(base: ReplayConfig, values: Mapping[tuple[str, str], Any], source: str = "trial",
                    gpu_prices: Mapping[str, float] | None = None) -> ReplayConfig:
    """``base`` with pool keys set: ``{(pool, "replicas"): 2, (pool, "autoscale.target"): 4.0}``; pools
    without a price of their own get ``gpu_prices[their GPU]`` when given."""
    data = base.to_dict()
    cluster = data["cluster"]
    by_name = {p["name"]: p for p in cluster["pools"]}
    for (pool, key), value in values.items():
        target = by_name[pool]
        if key.startswith("autoscale."):
            target["autoscale"] = dict(target["autoscale"], **{key[len("autoscale."):]: value})
        else:
            target[key] = value
        if key == "policy" and "policy_params" not in target:
            target.pop("policy_params", None)
    if gpu_prices:
        for p in cluster["pools"]:
            for kind in p.get("instances", ()):  # a pool of instance types is priced per type
                if kind.get("price_per_gpu_hour") is None and kind["gpu"] in gpu_prices:
                    kind["price_per_gpu_hour"] = gpu_prices[kind["gpu"]]
            if p.get("instances"):
                continue
            gpu = p.get("gpu", data["gpu"])
            if p.get("price_per_gpu_hour") is None and gpu in gpu_prices:
                p["price_per_gpu_hour"] = gpu_prices[gpu]
    return ReplayConfig.from_dict(data, source=source)


# keys whose values are names of something servelab knows (a preset, a registered class), with how to
# resolve one; a name nothing answers to is refused before any trial runs (`_Parser.check_names`)
NAMED_KEYS = ("gpu", "model", "runner", "policy", "router")


def _name_resolver(key: str):
    if key == "gpu":
        from servelab.runners.presets import get_gpu

        return get_gpu
    if key == "model":
        from servelab.runners.presets import resolve_model

        return resolve_model
    if key == "runner":
        from servelab.replay.core.runner_spec import runner_spec

        return runner_spec
    if key == "policy":
        from servelab.policies.base import policy_class

        return policy_class
    if key == "router":
        from servelab.routers.base import router_class

        return router_class
    return None


def _named_value(config: ReplayConfig, key: str) -> Any:
    return config.engine.router if key == "router" else getattr(config, key)


def _is_param_table(spec: Mapping[str, Any]) -> bool:
    return "low" in spec or "high" in spec or "choices" in spec


def _coerce_checked(parser: _Parser, value: Any, base_type: str, where: str) -> Any:
    """A TOML value of the spec must already be of its parameter's type."""
    if not is_a(value, base_type):
        raise parser.error(where, f"value {value!r} is not a {base_type}")
    return int(value) if base_type == "int" else value


__all__ = ["CONSTRAINED", "FILL", "OBJECTIVES", "Param", "pool_key_config", "SearchSpec", "TraceSpec", "GoodputSpec", "load_spec", "parse_spec"]
