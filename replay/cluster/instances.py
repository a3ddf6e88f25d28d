"""Instance types of a heterogeneous pool, their availability over time, and the performance floor
(docs/cluster.md "Heterogeneous and capacity-aware pools").

A pool may list candidate instance types in order of preference instead of one ``gpu``::

    [[cluster.pools]]
    name = "web"
    replicas = 6
    instances = [
        {gpu = "h100-80gb", price_per_gpu_hour = 2.5, available = [[0, 8], [1800, 4]]},
        {gpu = "a100-80gb", price_per_gpu_hour = 1.6},   # no `available`: as many as the pool wants
    ]
    floor = {decode_batch = 32, context_tokens = 2048, max_step_s = 0.03}

``available`` is a count (always that many) or ``[t_s, count]`` pairs, times strictly increasing:
from ``t_s`` on the pool may hold ``count`` replicas of the type (none before the first pair).
Parsed and validated here without I/O; whether the model fits a type and whether the type meets
the floor needs its runner and is decided when the pool is built (``servelab.api``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from servelab.common.coerce import coerce
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.replay.core.runner_spec import RunnerSpec, runner_spec

INSTANCE_KEYS = ("gpu", "price_per_gpu_hour", "available", "runner", "num_gpu_blocks")
FLOOR_KEYS = ("max_step_s", "decode_batch", "context_tokens", "prefill_tokens")


@dataclass(frozen=True, slots=True)
class InstanceType:
    gpu: str
    price_per_gpu_hour: float | None = None  # dollars per GPU per hour (a replica is the pool's tp GPUs); None: unpriced
    available: tuple[tuple[float, int], ...] | None = None  # (from t_s, count) steps; None: unlimited
    runner: RunnerSpec | None = None  # this type's runner (e.g. a profile measured on it), typed; None: the pool's
    num_gpu_blocks: int | None = None  # KV blocks per replica of this type; None: the pool's, else the runner's

    def count_at(self, t_s: float) -> int:
        """Replicas of this type the pool may hold at ``t_s`` (a large number when unlimited)."""
        if self.available is None:
            return 1 << 30
        i = bisect.bisect_right(self.available, (t_s, math.inf))
        return self.available[i - 1][1] if i else 0

    def most(self, cap: int) -> int:
        """The most replicas of this type the pool may ever hold, at most ``cap``."""
        if self.available is None:
            return cap
        return min(cap, max(n for _, n in self.available))

    def change_times(self) -> list[float]:
        return [t for t, _ in self.available or ()]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu}
        if self.price_per_gpu_hour is not None:
            out["price_per_gpu_hour"] = self.price_per_gpu_hour
        if self.available is not None:
            out["available"] = [[t, n] for t, n in self.available]
        if self.runner is not None:
            out["runner"] = str(self.runner)
        if self.num_gpu_blocks is not None:
            out["num_gpu_blocks"] = self.num_gpu_blocks
        return out

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> InstanceType:
        if isinstance(raw, InstanceType):
            return raw
        raw = _table(raw, where, INSTANCE_KEYS, "{gpu = \"h100-80gb\", price_per_gpu_hour = 2.5}")
        if "gpu" not in raw:
            raise ServelabError(f"{where}: missing 'gpu'")
        price = raw.get("price_per_gpu_hour")
        if price is not None:
            price = coerce(price, "float", f"{where}.price_per_gpu_hour")
        if price is not None and price < 0:
            raise ServelabError(f"{where}.price_per_gpu_hour: must be >= 0, got {price}")
        blocks = None
        if raw.get("num_gpu_blocks") is not None:
            blocks = coerce(raw["num_gpu_blocks"], "int", f"{where}.num_gpu_blocks")
            if blocks < 1:
                raise ServelabError(f"{where}.num_gpu_blocks: must be >= 1, got {blocks}")
        return cls(gpu=coerce(raw["gpu"], "str", f"{where}.gpu"), price_per_gpu_hour=price,
                   available=_availability(raw.get("available"), f"{where}.available"),
                   runner=None if raw.get("runner") is None else runner_spec(raw["runner"], f"{where}.runner"),
                   num_gpu_blocks=blocks)


def _availability(raw: Any, where: str) -> tuple[tuple[float, int], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)):
        count = coerce(raw, "int", where)
        if count < 0:
            raise ServelabError(f"{where}: a count must be >= 0, got {count}")
        return ((0.0, count),)
    if not raw:
        raise ServelabError(f"{where}: give a count or [t_s, count] pairs, e.g. [[0, 8], [1800, 4]]")
    steps: list[tuple[float, int]] = []
    for i, pair in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ServelabError(f"{at}: must be a pair [t_s, count], got {pair!r}")
        t = coerce(pair[0], "float", f"{at} (t_s)")
        n = coerce(pair[1], "int", f"{at} (count)")
        if t < 0 or n < 0:
            raise ServelabError(f"{at}: t_s and count must be >= 0, got [{t:g}, {n}]")
        if steps and t <= steps[-1][0]:
            raise ServelabError(f"{at}: times must increase, got {t:g} after {steps[-1][0]:g}")
        steps.append((t, n))
    return tuple(steps)


@dataclass(frozen=True, slots=True)
class PerfFloor:
    """A reference step no instance type of the pool may be slower than: ``decode_batch`` requests
    decoding at ``context_tokens`` each, plus one prompt of ``prefill_tokens`` (0: none)."""

    max_step_s: float
    decode_batch: int = 1
    context_tokens: int = 1
    prefill_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"max_step_s": self.max_step_s, "decode_batch": self.decode_batch,
                "context_tokens": self.context_tokens, "prefill_tokens": self.prefill_tokens}

    def shape(self):
        """The reference step as the runner prices it (a `StepShape`, as docs/runners.md counts)."""
        from servelab.replay.core.protocols import StepShape

        p = self.prefill_tokens
        return StepShape(p, 1 if p else 0, p, p * (p + 1) // 2, self.decode_batch,
                         self.decode_batch * self.context_tokens)

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> PerfFloor:
        if isinstance(raw, PerfFloor):
            return raw
        raw = _table(raw, where, FLOOR_KEYS, "{decode_batch = 32, context_tokens = 2048, max_step_s = 0.03}")
        if "max_step_s" not in raw:
            raise ServelabError(f"{where}: missing 'max_step_s' (the bound on the reference step, in seconds)")
        values = {k: coerce(raw[k], "float" if k == "max_step_s" else "int", f"{where}.{k}") for k in raw}
        if not values["max_step_s"] > 0:
            raise ServelabError(f"{where}.max_step_s: must be > 0, got {values['max_step_s']}")
        for key in ("decode_batch", "context_tokens", "prefill_tokens"):
            if values.get(key, 0) < 0:
                raise ServelabError(f"{where}.{key}: must be >= 0, got {values[key]}")
        if values.get("decode_batch", 1) == 0 and values.get("prefill_tokens", 0) == 0:
            raise ServelabError(f"{where}: the reference step is empty (decode_batch = 0 and no prefill_tokens)")
        return cls(**values)


def _table(raw: Any, where: str, known: tuple[str, ...], example: str) -> dict[str, Any]:
    """``raw`` as a table of known keys (``-`` read as ``_``), or a one-line error naming ``where``."""
    if not isinstance(raw, dict):
        raise ServelabError(f"{where} must be a table, e.g. {example}")
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    for key in raw:
        if key not in known:
            raise ServelabError(f"{where}: unknown key '{key}'{did_you_mean(key, known)}")
    return raw


def parse_instances(raw: Any, where: str) -> tuple[InstanceType, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ServelabError(f"{where}: must be a non-empty array of tables, e.g. "
                            "[{gpu = \"h100-80gb\", price_per_gpu_hour = 2.5}, {gpu = \"a100-80gb\"}]")
    types = tuple(InstanceType.from_dict(item, f"{where}[{i}]") for i, item in enumerate(raw))
    seen = set()
    for i, t in enumerate(types):
        if t.gpu in seen:
            raise ServelabError(f"{where}[{i}].gpu: '{t.gpu}' is listed twice (one entry per instance type)")
        seen.add(t.gpu)
    return types


__all__ = ["InstanceType", "PerfFloor", "parse_instances"]
