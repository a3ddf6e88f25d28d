"""Turn a trial's suggestions into a ReplayConfig: sample the space (policy first, then its parameters), merge into the base."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from servelab.replay.config import ReplayConfig
from servelab.search.spec import Param


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
        if p.key == "policy" and not p.is_policy_param:
            policy = values[p.name] = _suggest_one(trial, p)
    own = {f.name for f in fields(policy_class(policy).Params)}
    for p in space:
        if p.name in values:
            continue
        if p.is_policy_param and ((p.policy is not None and p.policy != policy) or p.key not in own):
            continue
        values[p.name] = _suggest_one(trial, p)
    return values


def config_for(base: ReplayConfig, space: tuple[Param, ...], values: dict[str, Any], source: str = "trial") -> ReplayConfig:
    """The base config with the trial's values applied (policy parameters of another policy are dropped)."""
    from servelab.policies.base import policy_class

    by_name = {p.name: p for p in space}
    data = base.to_dict()
    params: dict[str, Any] = dict(data.pop("policy_params", {}))
    for name, value in values.items():
        p = by_name[name]
        if not p.is_policy_param:
            data[p.key] = value
    if data["policy"] != base.policy:
        own = {f.name for f in fields(policy_class(data["policy"]).Params)}
        params = {k: v for k, v in params.items() if k in own}
    for name, value in values.items():
        p = by_name[name]
        if p.is_policy_param:
            params[p.key] = value
    if params:
        data["policy_params"] = params
    return ReplayConfig.from_dict(data, source=source)


__all__ = ["suggest", "config_for"]
