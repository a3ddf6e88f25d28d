"""Seeded arrival processes: renewal gaps (Poisson, gamma, Weibull, constant) under a rate profile.

Time-varying rates use time rescaling: a unit-rate renewal process is drawn in "operational time"
and mapped through the inverse of the cumulative rate Λ(t) = ∫ rate. That keeps the gap CV of the
chosen process while the mean rate follows the profile, and works for every gap distribution
(thinning would only be exact for Poisson).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from servelab.common.errors import ServelabError

PROCESSES = ("poisson", "gamma", "weibull", "constant")
PROFILES = ("flat", "piecewise", "diurnal", "onoff")


def gammaln(x: float) -> float:
    """scipy's log-gamma, imported on first use: only Weibull arrivals need scipy (~40 MB and ~0.3 s
    to import), so a trace of the other processes is generated without it."""
    from scipy.special import gammaln as scipy_gammaln

    return scipy_gammaln(x)


@lru_cache(maxsize=256)
def weibull_shape_for_cv(cv: float) -> float:
    """Weibull shape k whose coefficient of variation is ``cv`` (CV² = Γ(1+2/k)/Γ(1+1/k)² − 1)."""
    from scipy.optimize import brentq

    def excess(k: float) -> float:
        return math.exp(gammaln(1 + 2 / k) - 2 * gammaln(1 + 1 / k)) - 1 - cv * cv

    return float(brentq(excess, 0.02, 500.0, xtol=1e-12))


def unit_gaps(process: str, cv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` i.i.d. inter-arrival gaps with mean 1 and the given CV (Poisson: CV 1, constant: 0)."""
    if process == "poisson":
        return rng.exponential(1.0, n)
    if process == "constant":
        return np.ones(n)
    if cv <= 0:
        raise ServelabError(f"{process} arrivals need --cv > 0 (got {cv})")
    if process == "gamma":
        shape = 1.0 / (cv * cv)
        return rng.gamma(shape, 1.0 / shape, n)
    if process == "weibull":
        k = weibull_shape_for_cv(cv)
        return rng.weibull(k, n) / math.exp(gammaln(1 + 1 / k))
    raise ServelabError(f"unknown arrival process '{process}' (known: {', '.join(PROCESSES)})")


def stationary_first_gap(process: str, cv: float, rng: np.random.Generator) -> float:
    """Forward recurrence time of a stationary unit-mean renewal process (no start-up bias).

    It is U·L with L drawn length-biased; for gamma(a) L is gamma(a+1), for Weibull(k) (L/λ)^k is
    gamma(1+1/k).
    """
    u = rng.random()
    if process == "poisson":
        return float(rng.exponential(1.0))
    if process == "constant":
        return u
    if process == "gamma":
        shape = 1.0 / (cv * cv)
        return u * float(rng.gamma(shape + 1, 1.0 / shape))
    k = weibull_shape_for_cv(cv)
    scale = 1.0 / math.exp(gammaln(1 + 1 / k))
    return u * scale * float(rng.gamma(1 + 1 / k, 1.0)) ** (1 / k)


@dataclass(frozen=True)
class ArrivalConfig:
    """How requests (or session starts) arrive.

    ``rate_per_s`` is the mean rate for the flat, diurnal and on-off profiles; ``schedule`` gives
    (start_s, rate_per_s) steps for the piecewise profile, the last rate holding afterwards.
    """

    process: str = "poisson"
    rate_per_s: float = 1.0
    cv: float = 1.0
    profile: str = "flat"
    schedule: tuple[tuple[float, float], ...] = ()
    diurnal_amplitude: float = 0.5  # rate(t) = rate·(1 + A·sin(2πt/period)), 0 <= A <= 1
    diurnal_period_s: float = 86400.0
    burst_on_s: float = 10.0  # on-off: all requests fall in the on part of each on+off cycle
    burst_off_s: float = 50.0

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ServelabError(f"unknown arrival process '{self.process}' (known: {', '.join(PROCESSES)})")
        if self.profile not in PROFILES:
            raise ServelabError(f"unknown rate profile '{self.profile}' (known: {', '.join(PROFILES)})")
        if self.process in ("gamma", "weibull") and not self.cv > 0:
            raise ServelabError(f"{self.process} arrivals need cv > 0 (got {self.cv})")
        if self.profile == "piecewise":
            if not self.schedule:
                raise ServelabError("a piecewise rate profile needs a schedule of (start_s, rate) steps")
            starts = [s for s, _ in self.schedule]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
                raise ServelabError("rate schedule must start at 0 s and increase")
            if any(r < 0 for _, r in self.schedule) or not any(r > 0 for _, r in self.schedule):
                raise ServelabError("rate schedule rates must be >= 0 and not all 0")
        elif not self.rate_per_s > 0:
            raise ServelabError(f"arrival rate must be > 0 (got {self.rate_per_s})")
        if self.profile == "diurnal" and not (0 <= self.diurnal_amplitude <= 1 and self.diurnal_period_s > 0):
            raise ServelabError("diurnal profile needs 0 <= amplitude <= 1 and period > 0")
        if self.profile == "onoff" and not (self.burst_on_s > 0 and self.burst_off_s >= 0):
            raise ServelabError("on-off profile needs on > 0 s and off >= 0 s")

    def cumulative_rate(self, t_s: np.ndarray) -> np.ndarray:
        """Λ(t): expected number of arrivals in [0, t]."""
        t = np.asarray(t_s, dtype=np.float64)
        if self.profile == "flat":
            return self.rate_per_s * t
        if self.profile == "piecewise":
            starts = np.array([s for s, _ in self.schedule])
            rates = np.array([r for _, r in self.schedule])
            lam_at = np.concatenate([[0.0], np.cumsum(np.diff(starts) * rates[:-1])])
            i = np.searchsorted(starts, t, side="right") - 1
            return lam_at[i] + rates[i] * (t - starts[i])
        if self.profile == "diurnal":
            w = 2 * math.pi / self.diurnal_period_s
            return self.rate_per_s * (t + self.diurnal_amplitude * (1 - np.cos(w * t)) / w)
        cycle = self.burst_on_s + self.burst_off_s
        on_rate = self.rate_per_s * cycle / self.burst_on_s
        k, r = np.divmod(t, cycle)
        return on_rate * (k * self.burst_on_s + np.minimum(r, self.burst_on_s))

    def invert(self, lam: np.ndarray) -> np.ndarray:
        """t with Λ(t) = lam (the earliest such t where Λ is flat)."""
        lam = np.asarray(lam, dtype=np.float64)
        if self.profile == "flat":
            return lam / self.rate_per_s
        if self.profile == "onoff":
            on_rate = self.rate_per_s * (self.burst_on_s + self.burst_off_s) / self.burst_on_s
            k, r = np.divmod(lam / on_rate, self.burst_on_s)
            return k * (self.burst_on_s + self.burst_off_s) + r
        if self.profile == "piecewise":
            starts = np.array([s for s, _ in self.schedule], dtype=np.float64)
            lam_at = self.cumulative_rate(starts)
            last_rate = self.schedule[-1][1]
            excess = float(lam.max(initial=0.0)) - lam_at[-1]
            if last_rate == 0 and excess > 0:
                raise ServelabError(
                    f"the rate schedule ends at rate 0 after about {lam_at[-1]:.0f} arrivals; "
                    "ask for fewer requests, a duration, or a last rate > 0"
                )
            t_end = starts[-1] + (max(0.0, excess) / last_rate if last_rate > 0 else 0.0) + 1.0
            grid_t = np.append(starts, t_end)
            grid_l = self.cumulative_rate(grid_t)
            # Λ is piecewise linear, so interpolating over its breakpoints is exact. A rate-0 step
            # repeats a Λ value; np.interp's binary search then picks the later breakpoint, so
            # arrivals skip the gap instead of landing inside it.
            return np.interp(lam, grid_l, grid_t)
        # Diurnal: Λ is smooth and increasing; invert on a fine grid (period / 4096 steps).
        lam_max = float(lam.max(initial=0.0))
        t_max = lam_max / self.rate_per_s + self.diurnal_period_s
        grid_t = np.linspace(0.0, t_max, int(math.ceil(t_max / self.diurnal_period_s * 4096)) + 2)
        return np.interp(lam, self.cumulative_rate(grid_t), grid_t)


# Most requests one generated trace may hold: each costs ~40 bytes in the trace and more while it is
# generated, so a billion already needs tens of GB; far beyond it, numpy fails with a MemoryError.
MAX_REQUESTS = 1_000_000_000


def arrival_times(
    config: ArrivalConfig, rng: np.random.Generator, n: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Sorted arrival times: exactly ``n`` of them starting at 0, or all of a stationary process that fall
    in [0, ``duration_s``] (their expected number is Λ(duration_s); the first is after 0)."""
    if (n is None) == (duration_s is None):
        raise ServelabError("give exactly one of n and duration_s")
    if n is not None:
        if n < 1:
            raise ServelabError(f"need at least one request (got n={n})")
        if n > MAX_REQUESTS:
            raise ServelabError(f"{n:,} requests is more than one trace holds here (at most {MAX_REQUESTS:,})")
        gaps = unit_gaps(config.process, config.cv, n - 1, rng)
        op = np.concatenate([[0.0], np.cumsum(gaps)])
    else:
        if not duration_s > 0:
            raise ServelabError(f"duration must be > 0 s (got {duration_s})")
        lam_end = float(config.cumulative_rate(np.array([duration_s]))[0])
        if not lam_end <= MAX_REQUESTS:  # (a NaN too) the arrays below would not fit in memory
            raise ServelabError(f"{duration_s:g} s at these rates is about {lam_end:.3g} requests, more than one "
                                f"trace holds here (at most {MAX_REQUESTS:,}); shorten the duration or lower the rate")
        # A stationary process seen through the window [0, duration_s]: its first arrival is a forward
        # recurrence time, not 0, so the expected count is Λ(duration_s) (rate × duration_s), not one more.
        first = stationary_first_gap(config.process, config.cv, rng)
        chunks, total = [np.array([first])], first
        while total <= lam_end:
            m = max(1024, int(lam_end - total) + 64)
            c = total + np.cumsum(unit_gaps(config.process, config.cv, m, rng))
            chunks.append(c)
            total = float(c[-1])
        op = np.concatenate(chunks)
        op = op[op <= lam_end]
    times = config.invert(op)
    if n is None:
        times = times[times <= duration_s]
    return np.maximum.accumulate(times)  # guard float round-off in the inversion
