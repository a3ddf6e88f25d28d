"""Seeded token-length distributions (fixed, uniform, lognormal) and their one-string spec form."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servelab.common.errors import ServelabError

KINDS = ("fixed", "uniform", "lognormal")
MAX_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution; samples are integers >= 1.

    fixed: ``a`` tokens. uniform: integers in [a, b]. lognormal: median ``a``, log-space sigma ``b``,
    rounded to the nearest integer and floored at 1, capped at ``cap`` when given (a context limit).
    """

    kind: str = "fixed"
    a: float = 128
    b: float = 0.0
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ServelabError(f"unknown length distribution '{self.kind}' (known: {', '.join(KINDS)})")
        if self.kind == "fixed" and not (self.a >= 1 and float(self.a).is_integer()):
            raise ServelabError(f"fixed length must be an integer >= 1 (got {self.a})")
        if self.kind == "uniform" and not (1 <= self.a <= self.b):
            raise ServelabError(f"uniform lengths need 1 <= low <= high (got {self.a}, {self.b})")
        if self.kind == "lognormal" and not (self.a >= 1 and self.b >= 0):
            raise ServelabError(f"lognormal lengths need median >= 1 and sigma >= 0 (got {self.a}, {self.b})")
        if self.cap is not None and self.cap < 1:
            raise ServelabError(f"length cap must be >= 1 (got {self.cap})")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, int(self.a), dtype=np.int64)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b), n, endpoint=True)
        else:
            out = np.rint(rng.lognormal(math.log(self.a), self.b, n))
        out = np.clip(out, 1, self.cap if self.cap is not None else MAX_TOKENS)
        return out.astype(np.int32)

    @property
    def mean(self) -> float:
        """Mean before rounding and capping (documentation and sanity checks)."""
        if self.kind == "fixed":
            return float(self.a)
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b * self.b / 2)


def parse_length(spec: str | int | LengthDist) -> LengthDist:
    """``128`` / ``fixed:128``, ``uniform:16:512``, ``lognormal:600:1.0`` (median, sigma), optional ``:cap=N``."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, (int, np.integer)):
        return LengthDist("fixed", int(spec))
    parts = [p.strip() for p in str(spec).split(":")]
    cap = None
    if parts and parts[-1].startswith("cap="):
        cap = _number(parts.pop()[4:], spec)
    kind, args = ("fixed", parts) if len(parts) == 1 else (parts[0], parts[1:])
    args = [_number(p, spec) for p in args]  # (its message names the spec already)
    try:
        if kind == "fixed" and len(args) == 1:
            return LengthDist("fixed", args[0], cap=cap)
        if kind in ("uniform", "lognormal") and len(args) == 2:
            return LengthDist(kind, args[0], args[1], cap=cap)
    except ServelabError as err:
        raise ServelabError(f"bad length spec '{spec}': {err}") from None
    raise ServelabError(
        f"bad length spec '{spec}' (use N, fixed:N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA, optional :cap=N)"
    )


def _number(text: str, spec: object) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ServelabError(f"bad length spec '{spec}': '{text}' is not a number") from None
    if value.is_integer():
        return int(value)
    return value
