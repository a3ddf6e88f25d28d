"""`servelab recommend TRACE --slo ... --gpu NAME=PRICE`: the cheapest GPU type, count, topology and settings meeting an SLO, in one command.

    servelab recommend trace.arrow --slo ttft=1,tpot=0.05 --gpu h100-80gb=2.49 --gpu a100-80gb=1.29

The search is `servelab search`'s (search/recommend.py generates one spec per topology); this
module reads the options, shows a progress bar and prints the answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from servelab.common.errors import ServelabError


def _ints(text: str, option: str) -> tuple[int, ...]:
    """``1,2,4`` or ``1-4`` (or both: ``1-3,8``)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ServelabError(f"{option} expects integers like 1,2,4 or 1-4, got '{text}'") from None
    return tuple(sorted(set(out)))


def _value(text: str) -> Any:
    """A --vary choice as TOML would read it: integer, number, true/false, else a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _offers(gpu: tuple[str, ...], available: tuple[str, ...]):
    from servelab.cli.key_values import parse_key_values
    from servelab.search.recommend import GpuOffer

    prices = parse_key_values(gpu, "--gpu")
    counts = parse_key_values(available, "--available")
    for name in counts:
        if name not in prices:
            raise ServelabError(f"--available {name}: not among the --gpu types ({', '.join(prices)})")
    offers = []
    for name, price in prices.items():
        try:
            value = float(price)
        except ValueError:
            value = -1.0
        if not (value > 0 and value < float("inf")):
            raise ServelabError(f"--gpu {name}={price}: the price must be a positive $ per GPU-hour")
        n = counts.get(name)
        if n is not None:
            if not n.isdigit():
                raise ServelabError(f"--available {name}={n}: needs a whole number of GPUs")
            n = int(n)
        offers.append(GpuOffer(name, value, n))
    return tuple(offers)


def _base(config_file: str | None) -> tuple[tuple[str, Any], ...]:
    """Replay keys of a --config file for every trial (its [slo] is ignored: --slo is the target)."""
    if not config_file:
        return ()
    import tomllib

    from servelab.common.errors import InputError
    from servelab.common.textfile import read_text
    from servelab.replay.config import ReplayConfig

    try:
        data = tomllib.loads(read_text(config_file))
    except FileNotFoundError:
        raise InputError(config_file, "file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(config_file, f"invalid TOML: {err}") from None
    data.pop("slo", None)
    for key in ("cluster", "gpu", "tp", "replicas"):
        if key in data:
            raise InputError(config_file, "recommend chooses the GPUs, TP, replicas and topology itself: leave "
                                          f"'{key}' out (--gpu, --tp, --replicas, --topology)", column=key)  # fmt: skip
    ReplayConfig.from_dict(dict(data), source=config_file)  # bad keys fail here, named
    return tuple(sorted(data.items()))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}" if v >= 0.01 else f"{v * 1000:.1f}"


def _table(title: str, rows, target: float):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name, justify in (("#", "right"), ("topology", "left"), ("GPUs", "left"), ("settings", "left"),
                          ("$/1M tok", "right"), ("$/h", "right"), ("attain", "right"),
                          ("TTFT p50/p95/p99 ms", "right"), ("TPOT p50/p95/p99 ms", "right"),
                          ("E2E p50/p95/p99 s", "right"), ("note", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    for i, c in enumerate(rows, 1):
        lat = c.latency

        def three(m: str, scale_ms: bool = True) -> str:
            vals = [lat.get(f"{m}_p{q}") for q in (50, 95, 99)]
            if scale_ms:
                return "/".join(_ms(v) for v in vals)
            return "/".join("-" if v is None else f"{v:.2f}" for v in vals)

        note = c.within or ("" if c.meets_slo else f"below {target:.0%}")
        table.add_row(str(i), c.topology, f"{c.total_gpus}: {c.pools}", c.settings or "-", f"{c.cost_per_million:.4g}",
                      f"{c.per_hour:.4g}", f"{c.attainment:.1%}", three("ttft"), three("tpot"), three("e2e", False), note)
    return table


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--slo", multiple=True, metavar="SPEC", help="The SLO, as `servelab replay --slo`: ttft=1,tpot=0.05.")
@click.option("--gpu", multiple=True, metavar="NAME=PRICE",
              help="A GPU type to consider and its $ per GPU-hour, e.g. h100-80gb=2.49. Repeatable.")
@click.option("--available", multiple=True, metavar="NAME=N", help="At most N GPUs of this type can be had. Repeatable.")
@click.option("--budget", type=float, help="At most this many $ per hour for all GPUs of a configuration.")
@click.option("--target", type=float, default=0.9, show_default=True,
              help="Share of requests that must meet every SLO (DistServe's attainment).")
@click.option("--runner", help="Runner for every configuration (default: the --config file's, else roofline).")
@click.option("--model", help="Model preset (roofline).")
@click.option("--tp", "tp_text", default="1,2", show_default=True, help="Tensor-parallel sizes to try.")
@click.option("--replicas", "replicas_text", default="1-4", show_default=True,
              help="Replica counts to try (per pool: prefill and decode alike).")
@click.option("--topology", "topology_text", default="colocated,disagg", show_default=True,
              help="colocated (one pool) and/or disagg (prefill + decode pools).")
@click.option("--link-gbps", type=float, default=50.0, show_default=True,
              help="Bandwidth of the prefill -> decode KV link (GB/s), disagg.")
@click.option("--vary", multiple=True, metavar="KEY=V1,V2",
              help="An engine setting to search in every pool, e.g. max_num_seqs=64,256. Repeatable.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML of replay settings every configuration starts from (no [cluster]).")
@click.option("--grid-limit", type=int, default=64, show_default=True,
              help="A topology with at most this many configurations is tried in full; a larger one is sampled.")
@click.option("--n-trials", type=int, default=64, show_default=True, help="Trials per sampled topology.")
@click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Local worker processes.")
@click.option("--storage", help="Database URL (postgresql://...) to share the studies with other machines.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("-o", "--out", "study_dir", type=click.Path(file_okay=False), default="studies/recommend",
              show_default=True, help="Folder of the studies (run the same command again to resume).")
@click.option("--config-out", type=click.Path(dir_okay=False),
              help="Where to write the recommended config (default: STUDY_DIR/recommended.toml).")
@click.option("--top", type=int, default=5, show_default=True, help="Configurations to list.")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar.")
def recommend(trace, slo, gpu, available, budget, target, runner, model, tp_text, replicas_text, topology_text, link_gbps,
              vary, config_file, grid_limit, n_trials, jobs, storage, seed, study_dir, config_out, top, progress) -> None:
    """The cheapest configurations (GPU type, TP, replicas, colocated or prefill/decode pools, settings)
    that meet the SLO on TRACE, their latency and $ per million output tokens; writes the best as a
    config for `servelab replay --config` and the Pareto front as pareto.png (docs/search.md)."""
    from rich.console import Console

    from servelab.cli.key_values import parse_key_values
    from servelab.cli.replay_cmd import parse_slo
    from servelab.common.errors import require_file
    from servelab.search import recommend as rec
    from servelab.traces.io import read_trace

    require_file(trace, "trace")
    read_trace(trace)  # an unreadable trace fails before anything is written
    for name, value in (("--grid-limit", grid_limit), ("--n-trials", n_trials), ("--jobs", jobs), ("--top", top)):
        if value < 1:
            raise ServelabError(f"{name} must be >= 1, got {value}")
    if not link_gbps > 0:
        raise ServelabError(f"--link-gbps must be > 0, got {link_gbps:g}")
    if budget is not None and not budget > 0:
        raise ServelabError(f"--budget must be a positive $ per hour, got {budget:g}")
    varied = tuple((k, tuple(_value(v) for v in vals.split(","))) for k, vals in parse_key_values(vary, "--vary").items())
    base = _base(config_file)
    base_dict = dict(base)
    setup = rec.RecommendSetup(
        trace=Path(trace).resolve(), slo=parse_slo(slo), offers=_offers(gpu, available), target=target,
        runner=runner or base_dict.pop("runner", "roofline"), model=model or base_dict.pop("model", None),
        tps=_ints(tp_text, "--tp"), replicas=_ints(replicas_text, "--replicas"),
        topologies=tuple(t.strip() for t in topology_text.split(",") if t.strip()), vary=varied,
        base=tuple(sorted((k, v) for k, v in base_dict.items() if k not in ("runner", "model"))),
        budget_per_hour=budget, link_gbps=link_gbps, grid_limit=grid_limit, n_trials=n_trials, seed=seed, workers=jobs, storage=storage,
    )  # fmt: skip
    rec.check_setup(setup)
    study_dir = Path(study_dir)
    plans = rec.plan(setup, study_dir)
    err = Console(stderr=True)
    for p in plans:
        how = "all of them (grid)" if p.exhaustive else f"{p.trials} sampled (TPE)"
        err.print(f"{p.topology}: {p.configurations} configuration{'s' if p.configurations != 1 else ''}, trying {how}")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]recommend"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, disable=not progress)  # fmt: skip
    task = bar.add_task("", total=sum(p.trials for p in plans))
    try:
        with bar:
            rec.run(setup, study_dir, progress=lambda done, total: bar.update(task, completed=done, total=total))
    except KeyboardInterrupt:
        click.echo(f"stopped; finished trials are kept in {study_dir} (run the same command to continue)", err=True)
        raise SystemExit(130)
    cands = rec.candidates(setup, plans)
    out = Console(width=200)
    front_png = rec.plot_front(cands, target, study_dir / "pareto.png")
    best = rec.ranked(cands)
    if not best:
        near = [rec.with_latency(c, setup.slo) for c in rec.closest(cands)]
        if near:
            out.print(_table("closest configurations (none meets the SLO):", near, target))
        why = (f"no configuration meets the SLO ({setup.slo.describe()}) for {target:.0%} of requests"
               if not any(c.meets_slo for c in cands) else
               "the configurations that meet the SLO are over --available or --budget")  # fmt: skip
        best_seen = f"; the closest reaches {near[0].attainment:.1%}" if near else ""
        wrote = "the studies and pareto.png are" if front_png is not None else "the studies are"
        raise ServelabError(f"{why}{best_seen} ({len(cands)} tried; no config written; {wrote} in {study_dir})")
    rows = [rec.with_latency(c, setup.slo) for c in best[:top]]
    sampled = [p.topology for p in plans if not p.exhaustive]
    out.print(_table(f"cheapest configurations meeting {setup.slo.describe()} for {target:.0%} of requests "
                     f"({len(best)} of {len(cands)} tried do):", rows, target))  # fmt: skip
    exhaustive = not sampled
    if sampled:
        err.print(f"note: {', '.join(sampled)} sampled, not enumerated: a cheaper configuration may be among those not "
                  "tried (raise --grid-limit to try them all)")  # fmt: skip
    path = rec.write_config(best[0], setup, Path(config_out) if config_out else study_dir / "recommended.toml",
                            exhaustive)  # fmt: skip
    if front_png is not None:
        click.echo(f"wrote {front_png}", err=True)
    click.echo(f"wrote {path}: servelab replay {trace} --config {path}", err=True)


__all__ = ["recommend"]
