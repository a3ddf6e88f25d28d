"""Turn a trial's suggestions into a ReplayConfig: sample the space (policy first, then its parameters), merge into the base."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig
from servelab.search.spec import Param, pool_key_config


def _suggest_one(trial, p: Param) -> Any:
    if p.kind == "choice":
        return trial.suggest_categorical(p.name, list(p.choices))
    if p.kind == "int":
        return trial.suggest_int(p.name, p.low, p.high, step=p.step or 1, log=p.log)
    return trial.suggest_float(p.name, p.low, p.high, step=p.step, log=p.log)


def suggest(trial, space: tuple[Param, ...], base: ReplayConfig) -> dict[str, Any]:
    """Ask ``trial`` for every parameter that exists for it; returns {optuna name: value}.

    The policy is drawn first, so a policy's own parameters are asked for only in trials that use
    that policy (Optuna's define-by-run conditional space).
    """
    from servelab.policies.base import policy_class

    values: dict[str, Any] = {}
    policy = base.policy
    for p in space:
        if p.key == "policy" and not p.is_policy_param and p.pool is None:
            policy = values[p.name] = _suggest_one(trial, p)
    own = {f.name for f in fields(policy_class(policy).Params)}
    for p in space:
        if p.name in values:
            continue
        if p.is_policy_param and ((p.policy is not None and p.policy != policy) or p.key not in own):
            continue
        values[p.name] = _suggest_one(trial, p)
    return values


def config_for(base: ReplayConfig, space: tuple[Param, ...], values: dict[str, Any], source: str = "trial",
               gpu_budget: int | None = None, fill_pool: str | None = None,
               gpu_prices: Mapping[str, float] | None = None) -> ReplayConfig:
    """The base config with the trial's values applied (policy parameters of another policy are dropped).

    Cluster pool keys go into their pools; ``fill_pool`` takes the GPUs ``gpu_budget`` leaves, and a
    cluster over the budget (or a budget that does not divide) raises ServelabError: an infeasible trial.
    ``gpu_prices`` prices the pools that have no price of their own, so the run records its dollars.
    """
    from servelab.policies.base import policy_class
    from servelab.replay.core.engine_config import params_table

    by_name = {p.name: p for p in space}
    pooled = {(by_name[n].pool, by_name[n].key): v for n, v in values.items() if by_name[n].pool is not None}
    if pooled or gpu_budget is not None or (gpu_prices and base.cluster is not None):
        base = _with_pools(base, pooled, source, gpu_budget, fill_pool, gpu_prices)
    # Only the trial's values are typed and put over the base's typed fields (``with_options``: a
    # ``dataclasses.replace``); the base is not written out as a table and parsed again per trial.
    data: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for name, value in values.items():
        p = by_name[name]
        if p.is_policy_param:
            params[p.key] = value
        elif p.pool is None:
            data[p.key] = value
    policy = data.get("policy", base.policy)
    if policy != base.policy:  # the base's parameters that the trial's policy also has, under the trial's own
        own = {f.name for f in fields(policy_class(policy).Params)}
        params = {**{k: v for k, v in params_table(base.policy_params).items() if k in own}, **params}
    if data.get("router", base.engine.router) != base.engine.router and params_table(base.router_params):
        data["router_params"] = params_table(base.router_params)  # typed against the trial's router, as a file's
    if params:
        data["policy_params"] = params
    return base.with_options(data, source=source)


def _pool_gpus(config: ReplayConfig) -> dict[str, tuple[int, int]]:
    """Pool name -> (replicas, tp); an autoscaled pool at its most replicas."""
    out = {}
    for pool in config.cluster.pools:
        tp = dict(pool.settings).get("tp", config.tp)
        out[pool.name] = (pool.replicas if pool.autoscale is None else pool.autoscale.max, int(tp))
    return out


def _with_pools(base: ReplayConfig, pooled: dict, source: str, gpu_budget: int | None, fill_pool: str | None,
                gpu_prices: Mapping[str, float] | None) -> ReplayConfig:
    config = pool_key_config(base, pooled, source=source, gpu_prices=gpu_prices)
    if gpu_budget is None:
        return config
    gpus = _pool_gpus(config)
    if fill_pool is not None:
        others = sum(r * tp for name, (r, tp) in gpus.items() if name != fill_pool)
        left, tp = gpu_budget - others, gpus[fill_pool][1]
        if left < tp or left % tp:
            raise ServelabError(f"gpu_budget {gpu_budget}: the other pools take {others} GPUs, leaving {left}, "
                                f"not a positive multiple of pool '{fill_pool}''s tp {tp}")
        config = pool_key_config(config, {(fill_pool, "replicas"): left // tp}, source=source)
        return config
    total = sum(r * tp for r, tp in gpus.values())
    if total > gpu_budget:
        raise ServelabError(f"the pools take {total} GPUs, over gpu_budget {gpu_budget}")
    return config


__all__ = ["suggest", "config_for"]
