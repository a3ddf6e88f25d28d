"""Replicas per pool and cumulative cost over a cluster run's time, from run.json (docs/cluster.md).

A fixed pool holds its replicas the whole run; an autoscaled pool follows its ``autoscale.timeline``
(rows ``[t_s, active, starting, draining, ...]``: replicas held = active + starting + draining). The
dollars accumulate over the window the `cost` view charges, first arrival to last finish, at
``held x tp x price_per_gpu_hour / 3600`` per second, so the curve ends at the view's dollars.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.common.errors import ServelabError


@dataclass(frozen=True, slots=True)
class PoolSeries:
    name: str
    role: str
    gpu: str | None
    tp: int
    price_per_gpu_hour: float | None  # None: unpriced
    times: tuple[float, ...]  # step starts: the counts hold from each time to the next
    held: tuple[int, ...]  # replicas paid for (active + starting + draining)
    active: tuple[int, ...]  # replicas serving
    autoscaled: bool


def pool_series(meta: dict, where: str = "run") -> list[PoolSeries]:
    """Every pool's replica steps; a run without a ``cluster`` section is an error naming ``where``."""
    pools = (meta.get("cluster") or {}).get("pools")
    if not pools:
        raise ServelabError(f"{where}: run.json has no cluster pools (a replay with a [cluster] config records them); "
                            "the replicas-and-cost chart needs them")
    out = []
    for p in pools:
        tp = int(p.get("tp") or 1)
        price = None if p.get("price_per_gpu_hour") is None else float(p["price_per_gpu_hour"])
        timeline = (p.get("autoscale") or {}).get("timeline")
        if timeline:
            times = tuple(float(row[0]) for row in timeline)
            held = tuple(int(row[1]) + int(row[2]) + int(row[3]) for row in timeline)
            active = tuple(int(row[1]) for row in timeline)
        else:
            n = len(p.get("replicas") or ()) or int(p.get("initial_replicas") or 1)
            times, held, active = (0.0,), (n,), (n,)
        out.append(PoolSeries(str(p.get("name")), str(p.get("role") or "mixed"), p.get("gpu"), tp, price, times,
                              held, active, bool(timeline)))  # fmt: skip
    return out


def held_at(series: PoolSeries, t: float) -> int:
    """Replicas held at time ``t`` (the last step at or before it; the first before the first step)."""
    value = series.held[0]
    for ts, h in zip(series.times, series.held):
        if ts > t:
            break
        value = h
    return value


def cumulative(series: PoolSeries, start_s: float, stop_s: float, at: list[float], per_gpu_hour: float) -> list[float]:
    """Integral over [start_s, min(t, stop_s)] of held x tp x per_gpu_hour / 3600, for each t of ``at``
    (``per_gpu_hour`` = the price for dollars, 1 for GPU-hours)."""
    inf = float("inf")
    starts = [-inf, *series.times[1:]]  # the first step also covers any time before it
    ends = [*series.times[1:], inf]
    out = []
    for t in at:
        hi_t = min(t, stop_s)
        total = 0.0
        for lo, hi, h in zip(starts, ends, series.held):
            lo, hi = max(lo, start_s), min(hi, hi_t)
            if hi > lo:
                total += h * (hi - lo)
        out.append(total * series.tp * per_gpu_hour / 3600.0)
    return out


__all__ = ["PoolSeries", "cumulative", "held_at", "pool_series"]
