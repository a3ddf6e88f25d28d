"""Recommend a serving configuration for a workload and an SLO: generate search specs over GPU types, TP, replicas and topologies, run them, rank the results.

`servelab recommend TRACE --slo ... --gpu h100-80gb=2.49 ...` answers "which instance type, how many,
with which settings, at what latency and cost per million tokens". It writes no search of its own:
each topology (one colocated pool, or a prefill pool and a decode pool) is an ordinary search spec
(``search/spec.py``) built here as TOML data, parsed by ``parse_spec`` (so every rule of the spec
applies), saved as ``STUDY_DIR/<topology>/spec.toml`` and run by ``search.study.run_study`` with
the objectives ``cost_per_million_tokens`` (subject to attainment >= target) and ``attainment``.

Grid or sample: a topology's space of at most ``grid_limit`` configurations is enumerated in full
with Optuna's GridSampler, so the cheapest configuration meeting the SLO in that space is found for
certain; a larger space is sampled with TPE for ``n_trials`` trials, and the answer says it was
sampled (a cheaper configuration may exist among those not tried).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.common.errors import InputError, ServelabError
from servelab.scoring.slo import SloTable

TOPOLOGIES = ("colocated", "disagg")
OBJECTIVES = ("cost_per_million_tokens", "attainment")
# pools of each topology, with their role
POOLS = {"colocated": (("serve", "mixed"),), "disagg": (("prefill", "prefill"), ("decode", "decode"))}
PERCENTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True, slots=True)
class GpuOffer:
    """A GPU type the recommendation may use: its price and how many GPUs of it can be had (None: any)."""

    gpu: str
    price_per_gpu_hour: float
    available_gpus: int | None = None


@dataclass(frozen=True, slots=True)
class RecommendSetup:
    """Everything a recommendation depends on; ``identity()`` names its studies (same setup: resumed)."""

    trace: Path
    slo: SloTable
    offers: tuple[GpuOffer, ...]
    target: float = 0.9
    runner: str = "roofline"
    model: str | None = None
    tps: tuple[int, ...] = (1, 2)
    replicas: tuple[int, ...] = (1, 2, 3, 4)
    topologies: tuple[str, ...] = TOPOLOGIES
    vary: tuple[tuple[str, tuple], ...] = ()  # engine settings searched in every pool: (key, choices)
    base: tuple[tuple[str, Any], ...] = ()  # other replay keys (a --config file's), for every trial
    budget_per_hour: float | None = None  # $ per hour of all GPUs of a configuration
    link_gbps: float = 50.0  # prefill -> decode KV link, GB/s
    link_latency_s: float = 0.0005
    grid_limit: int = 64  # a topology with at most this many configurations is enumerated in full
    n_trials: int = 64  # trials per sampled topology
    seed: int = 0
    workers: int = 1
    storage: str | None = None

    def identity(self) -> dict[str, Any]:
        """What defines the studies (n_trials, workers and storage may change between runs)."""
        return {"trace": str(self.trace), "slo": self.slo.to_dict(), "target": self.target, "runner": self.runner,
                "model": self.model, "tps": list(self.tps), "replicas": list(self.replicas),
                "offers": [[o.gpu, o.price_per_gpu_hour, o.available_gpus] for o in self.offers],
                "vary": [[k, list(v)] for k, v in self.vary], "base": [[k, v] for k, v in self.base],
                "link": [self.link_gbps, self.link_latency_s], "grid_limit": self.grid_limit, "seed": self.seed}  # fmt: skip

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True, default=str).encode()).hexdigest()[:10]

    @property
    def prices(self) -> dict[str, float]:
        return {o.gpu: o.price_per_gpu_hour for o in self.offers}

    @property
    def available(self) -> dict[str, int]:
        return {o.gpu: o.available_gpus for o in self.offers if o.available_gpus is not None}


# -- checks before anything runs ------------------------------------------------------------------


def check_setup(setup: RecommendSetup) -> None:
    """Refuse, in one line, what no search can answer: unknown GPUs, model, runner or topologies, no SLO, an impossible budget."""
    from servelab.replay.core.runner_spec import runner_spec
    from servelab.runners.presets import get_gpu, resolve_model

    if not setup.offers:
        raise ServelabError("recommend needs at least one GPU type with its price: --gpu h100-80gb=2.49")
    for offer in setup.offers:
        try:
            get_gpu(offer.gpu)
        except ServelabError as err:  # unknown GPU preset '...'; did you mean ...
            raise ServelabError(f"--gpu {offer.gpu}: {err}") from None
    # (the generated specs would refuse them too, but as a generated file's column rather than the option)
    for option, value, resolve in (("--model", setup.model, resolve_model), ("--runner", setup.runner, runner_spec)):
        try:
            if value is not None:
                resolve(value)
        except ServelabError as err:
            raise ServelabError(f"{option} {value}: {err}") from None
    if setup.slo is None or setup.slo.is_empty:
        raise ServelabError("recommend needs an SLO: --slo ttft=1,tpot=0.05 (the format of `servelab replay --slo`)")
    for name in setup.topologies:
        if name not in TOPOLOGIES:
            raise ServelabError(f"--topology: unknown topology {name!r} (known: {', '.join(TOPOLOGIES)})")
    if not 0 < setup.target <= 1:
        raise ServelabError(f"--target must be in (0, 1], got {setup.target:g}")
    for key, values in (("--tp", setup.tps), ("--replicas", setup.replicas)):
        if not values or any(v < 1 for v in values):
            raise ServelabError(f"{key} needs positive integers, got {', '.join(map(str, values)) or 'none'}")
    cheapest = min(cheapest_per_hour(setup, t) for t in setup.topologies)
    if math.isinf(cheapest[0]):
        raise ServelabError("no configuration fits the GPUs --available allows: the smallest needs "
                            f"{min(setup.tps) * min(setup.replicas)} GPU(s) of one type per pool")  # fmt: skip
    if setup.budget_per_hour is not None and cheapest[0] > setup.budget_per_hour:
        raise ServelabError(f"--budget ${setup.budget_per_hour:g}/h is below every configuration searched: the "
                            f"cheapest, {cheapest[1]}, costs ${cheapest[0]:.4g}/h")  # fmt: skip


def cheapest_per_hour(setup: RecommendSetup, topology: str) -> tuple[float, str]:
    """($/h, description) of the topology's least expensive configuration the availability allows
    (each pool at the fewest replicas and the smallest TP, on any GPU type with room for it)."""
    import itertools

    best = (math.inf, "")
    tp, replicas = min(setup.tps), min(setup.replicas)
    pools = POOLS[topology]
    for types in itertools.product(setup.offers, repeat=len(pools)):
        used: dict[str, int] = {}
        for offer in types:
            used[offer.gpu] = used.get(offer.gpu, 0) + tp * replicas
        if any(o.available_gpus is not None and used[o.gpu] > o.available_gpus for o in types):
            continue
        per_hour = sum(tp * replicas * o.price_per_gpu_hour for o in types)
        text = " + ".join(f"{replicas}x {o.gpu} TP{tp} ({pool})" for o, (pool, _) in zip(types, pools))
        best = min(best, (per_hour, text))
    return best


# -- the generated specs ------------------------------------------------------------------------


def spec_data(setup: RecommendSetup, topology: str, sampler: str, n_trials: int) -> dict[str, Any]:
    """The search spec of one topology, as the TOML data `servelab search` reads."""
    pools = []
    for name, role in POOLS[topology]:
        pools.append({"name": name, "role": role, "replicas": min(setup.replicas), "tp": min(setup.tps),
                      "gpu": setup.offers[0].gpu})  # fmt: skip
    cluster: dict[str, Any] = {"pools": pools}
    if topology == "disagg":
        cluster["links"] = [{"from": "prefill", "to": "decode", "bandwidth_gbps": setup.link_gbps,
                             "latency_s": setup.link_latency_s}]  # fmt: skip
    replay = dict(setup.base)
    replay["runner"] = setup.runner
    if setup.model is not None:
        replay["model"] = setup.model
    replay["cluster"] = cluster
    space: dict[str, Any] = {}
    for name, _role in POOLS[topology]:
        space[f"pools.{name}.gpu"] = [o.gpu for o in setup.offers]
        space[f"pools.{name}.tp"] = list(setup.tps)
        space[f"pools.{name}.replicas"] = list(setup.replicas)
    for key, values in setup.vary:
        space[key] = list(values)
    data: dict[str, Any] = {
        "trace": str(setup.trace), "objective": list(OBJECTIVES), "target": setup.target,
        "slo": setup.slo.to_dict(), "replay": replay, "space": space,
        "cost": {"gpu_prices": setup.prices}, "sampler": sampler, "n_trials": n_trials, "seed": setup.seed,
        "workers": setup.workers, "study_name": f"recommend-{topology}-{setup.digest()}",
    }  # fmt: skip
    if setup.available and all(o.available_gpus is not None for o in setup.offers):
        # every type is limited: a configuration over them all together is refused before its replay
        data["gpu_budget"] = sum(setup.available.values())
    if setup.storage is not None:
        data["storage"] = setup.storage
    return data


def grid_configurations(setup: RecommendSetup, topology: str) -> int:
    n = (len(setup.offers) * len(setup.tps) * len(setup.replicas)) ** len(POOLS[topology])
    for _key, values in setup.vary:
        n *= len(values)
    return n


@dataclass(frozen=True, slots=True)
class TopologyPlan:
    topology: str
    spec: Any  # SearchSpec
    spec_path: Path
    data: dict[str, Any]
    configurations: int  # in the space
    exhaustive: bool  # enumerated in full (GridSampler) or sampled (TPE)

    @property
    def trials(self) -> int:
        return self.configurations if self.exhaustive else min(self.spec.n_trials, self.configurations)


def plan(setup: RecommendSetup, study_dir: Path) -> list[TopologyPlan]:
    """One spec per topology, parsed (and so checked) by the search's own parser; nothing is written."""
    from servelab.search.spec import parse_spec

    out = []
    for topology in setup.topologies:
        size = grid_configurations(setup, topology)
        exhaustive = size <= setup.grid_limit
        sampler = "grid" if exhaustive else "tpe"
        data = spec_data(setup, topology, sampler, size if exhaustive else setup.n_trials)
        path = Path(study_dir) / topology / "spec.toml"
        try:
            spec = parse_spec(data, path)
        except InputError as err:  # a --vary value or a --config key: name the option, not the generated file
            key = (err.column or "").removeprefix("space.")
            where = f"--vary {key}" if key in dict(setup.vary) else f"recommend ({topology}), {err.column or 'spec'}"
            raise ServelabError(f"{where}: {err.rule}") from None
        out.append(TopologyPlan(topology, spec, path, data, size, exhaustive))
    return out


def write_spec(p: TopologyPlan) -> None:
    """STUDY_DIR/<topology>/spec.toml: the spec as run (`servelab search worker` on it joins the study)."""
    import tomli_w

    from servelab.common.atomic import atomic_path

    p.spec_path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# generated by `servelab recommend` ({p.topology}, {p.configurations} configurations, "
              f"{'enumerated in full' if p.exhaustive else 'sampled'})\n")  # fmt: skip
    text = header + tomli_w.dumps(p.data)
    if p.spec_path.is_file() and p.spec_path.read_text() == text:
        return
    with atomic_path(p.spec_path) as tmp:
        tmp.write_text(text)


def run(setup: RecommendSetup, study_dir: Path, progress=None) -> list[TopologyPlan]:
    """Run (or resume) every topology's study; ``progress(done, total)`` after each trial."""
    from servelab.search.study import check_study_dir, counts, run_study
    from servelab.search.trials import write_trials

    study_dir = Path(study_dir)
    plans = plan(setup, study_dir)
    for p in plans:  # a folder holding another study is refused before anything is written
        check_study_dir(p.spec, p.spec_path.parent, setup.storage)
    if setup.storage is not None:  # so is a database that cannot be opened (before spec.toml is written)
        from servelab.search.storage import rdb_storage

        rdb_storage(setup.storage)
    total = sum(p.trials for p in plans)
    done_before = 0
    for p in plans:
        write_spec(p)
        offset = done_before

        def report(study, offset=offset, limit=p.trials) -> None:
            if progress is not None:
                progress(offset + min(counts(study)["finished"], limit), total)

        try:
            run_study(p.spec, p.spec_path.parent, progress=report, storage_url=setup.storage)
        finally:
            from servelab.search.study import open_study

            try:
                write_trials(open_study(p.spec, p.spec_path.parent, storage_url=setup.storage), p.spec_path.parent)
            except ServelabError:
                pass
        done_before += p.trials
    return plans


# -- reading the answer back ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One evaluated configuration."""

    topology: str
    trial: int
    run_dir: Path
    config: dict[str, Any]  # ReplayConfig.to_dict()
    cost_per_million: float
    attainment: float
    gpus: dict[str, int]  # GPUs by type
    per_hour: float  # $ per hour of all its GPUs
    meets_slo: bool
    within: str | None  # why it may not be used (over --available or --budget), None when it may
    pools: str  # "2x h100-80gb TP1" / "prefill 1x ... + decode 2x ..."
    settings: str  # searched engine settings
    latency: dict[str, float | None] = field(default_factory=dict)  # ttft_p50, ttft_p95, ...

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus.values())

    @property
    def usable(self) -> bool:
        return self.meets_slo and self.within is None


def _pools_of(config: dict[str, Any]) -> list[tuple[str, str, int, int, float]]:
    """(name, gpu, replicas, tp, price) of each pool of a trial's config."""
    out = []
    for pool in config["cluster"]["pools"]:
        out.append((pool["name"], pool.get("gpu", config["gpu"]), int(pool.get("replicas", 1)),
                    int(pool.get("tp", config["tp"])), float(pool.get("price_per_gpu_hour") or 0.0)))  # fmt: skip
    return out


def candidates(setup: RecommendSetup, plans: list[TopologyPlan]) -> list[Candidate]:
    """Every complete trial of every topology, with its GPUs, $/h and whether it may be recommended."""
    from optuna.trial import TrialState

    from servelab.search.study import open_study

    out = []
    seen: set[str] = set()
    for p in plans:
        study = open_study(p.spec, p.spec_path.parent, storage_url=setup.storage)
        for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
            config = t.user_attrs.get("config")
            if not config or t.values is None:
                continue
            key = json.dumps(config, sort_keys=True)
            if key in seen:  # a sampler may propose a configuration again: the replay is deterministic, list it once
                continue
            seen.add(key)
            cost, attainment = t.values
            gpus: dict[str, int] = {}
            per_hour = 0.0
            parts = []
            for name, gpu, replicas, tp, price in _pools_of(config):
                gpus[gpu] = gpus.get(gpu, 0) + replicas * tp
                per_hour += replicas * tp * price
                parts.append(f"{replicas}x {gpu} TP{tp}" if p.topology == "colocated" else f"{name} {replicas}x {gpu} TP{tp}")
            within = None
            over = [g for g, n in gpus.items() if g in setup.available and n > setup.available[g]]
            if over:
                within = f"needs {gpus[over[0]]} {over[0]}, {setup.available[over[0]]} available"
            elif setup.budget_per_hour is not None and per_hour > setup.budget_per_hour + 1e-9:
                within = f"${per_hour:.4g}/h over the ${setup.budget_per_hour:g}/h budget"
            settings = ", ".join(f"{k}={config.get(k)}" for k, _ in setup.vary)
            run_dir = p.spec_path.parent / (t.user_attrs.get("trial_dir") or f"trials/{t.number:04d}")
            out.append(Candidate(p.topology, t.number, run_dir, config, float(cost), float(attainment), gpus, per_hour,
                                 attainment >= setup.target - 1e-12, within, " + ".join(parts), settings))  # fmt: skip
    return out


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """Usable configurations, cheapest per million output tokens first (ties: fewer GPUs, lower $/h)."""
    usable = [c for c in cands if c.usable]
    return sorted(usable, key=lambda c: (c.cost_per_million, c.total_gpus, c.per_hour, c.topology, c.trial))


def closest(cands: list[Candidate], n: int = 3) -> list[Candidate]:
    """When nothing meets the SLO: the configurations that came nearest (highest attainment, then cheapest)."""
    allowed = [c for c in cands if c.within is None] or cands
    return sorted(allowed, key=lambda c: (-c.attainment, c.cost_per_million, c.total_gpus, c.topology, c.trial))[:n]


def pareto_front(cands: list[Candidate]) -> list[Candidate]:
    """Configurations no other beats on both cost per million tokens (lower) and attainment (higher)."""
    front = []
    best_attainment = -math.inf
    for c in sorted(cands, key=lambda c: (c.cost_per_million, -c.attainment, c.topology, c.trial)):
        if c.attainment > best_attainment:
            front.append(c)
            best_attainment = c.attainment
    return front


def with_latency(c: Candidate, slo: SloTable) -> Candidate:
    """P50/P95/P99 of TTFT, TPOT and E2E over finished requests (the `request_metrics` view: vLLM bench's definitions)."""
    from dataclasses import replace

    from servelab.scoring.db import query

    if not (c.run_dir / "requests.parquet").is_file():  # a trial another machine ran (a shared database study)
        return c
    qs = ", ".join(str(q) for q in PERCENTILES)
    sql = ", ".join(f"quantile_cont({m}_s, [{qs}]) FILTER (WHERE finished) AS {m}" for m in ("ttft", "tpot", "e2e"))
    row = query([str(c.run_dir)], f"SELECT {sql} FROM request_metrics", slo).to_pylist()[0]
    latency = {}
    for m in ("ttft", "tpot", "e2e"):
        values = row[m] or [None] * len(PERCENTILES)
        for q, v in zip(PERCENTILES, values):
            latency[f"{m}_p{round(q * 100)}"] = v
    return replace(c, latency=latency)


def write_config(c: Candidate, setup: RecommendSetup, out: Path, exhaustive: bool) -> Path:
    """The recommended configuration, in `servelab replay --config` form, with the SLO it was scored against."""
    import tomli_w

    from servelab.common.atomic import atomic_path
    from servelab.replay.config import ReplayConfig

    config = ReplayConfig.from_dict(dict(c.config), source=f"trial {c.trial}").to_dict()
    lines = [f"recommended by `servelab recommend` for {setup.trace}: {c.topology}, {c.pools}"
             + (f", {c.settings}" if c.settings else ""),
             f"${c.cost_per_million:.4g} per million output tokens, attainment {c.attainment:.2%} "
             f"(target {setup.target:.0%}), {c.total_gpus} GPU(s), ${c.per_hour:.4g}/h",
             f"{'every configuration of the space was tried' if exhaustive else 'the space was sampled'}; "
             f"study {c.run_dir.parent.parent}, trial {c.trial}",
             f"use it with: servelab replay {setup.trace} --config {Path(out).name}"]  # fmt: skip
    header = "".join(f"# {line}\n" for line in lines)
    with atomic_path(Path(out)) as tmp:
        tmp.write_text(header + tomli_w.dumps({**config, "slo": setup.slo.to_dict()}))
    return Path(out)


def plot_front(cands: list[Candidate], target: float, out: Path) -> Path | None:
    """pareto.png: every configuration's cost per million tokens against its attainment, the front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servelab.common.atomic import atomic_path

    if not cands:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for topology, marker in zip(TOPOLOGIES, ("o", "s")):
        mine = [c for c in cands if c.topology == topology]
        if mine:
            ax.scatter([c.cost_per_million for c in mine], [c.attainment for c in mine], marker=marker, alpha=0.6,
                       label=topology)  # fmt: skip
    front = pareto_front(cands)
    ax.plot([c.cost_per_million for c in front], [c.attainment for c in front], "k--", lw=1, label="Pareto front")
    ax.axhline(target, color="tab:red", lw=1, label=f"target {target:.0%}")
    best = ranked(cands)
    if best:
        ax.scatter([best[0].cost_per_million], [best[0].attainment], s=160, facecolors="none", edgecolors="tab:red",
                   label="recommended")  # fmt: skip
    ax.set_xlabel("$ per million output tokens")
    ax.set_ylabel("SLO attainment")
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(Path(out)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(out)


__all__ = ["GpuOffer", "RecommendSetup", "Candidate", "TopologyPlan", "check_setup", "plan", "run", "candidates",
           "ranked", "closest", "pareto_front", "with_latency", "write_config", "plot_front", "spec_data"]
