"""The platform's settings as `EngineConfig` carries them (``--quota``, ``--pause``, ``--fail``), parsed
into frozen values without I/O: the config validates them, the platform (replay/platform/hooks.py,
replay/platform/admission.py) acts on them.

The engine's spec strings (these three, ``tier_order`` and ``kv_tiers``) are parsed once, by the
functions at the end (each remembers the values it parsed, keyed by the strings): the first
`EngineConfig` made with a spec parses it, and every consumer reads the typed value from its config
(``EngineConfig.quotas``, ``.failures``, ``.pause_rule``, ``.tier_ranks``, ``.tier_specs``), however
many configs (a cluster's pools, a search's variants) carry the same strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping

from servelab.common.errors import ServelabError
from servelab.common.fields import parse_fields
from servelab.common.tiers import parse_tiers
from servelab.replay.core.kv.tiers import TierSpec
from servelab.replay.core.kv.tiers import parse_tiers as parse_tier_stack

QUOTA_FIELDS = ("rpm", "tpm", "concurrency")


@dataclass(frozen=True, slots=True)
class Quota:
    """One line of ``--quota``: limits for a tenant or a tier (``*``: each one separately)."""

    scope: str  # tenant | tier
    name: str  # a name, or * for "every tenant/tier, each its own bucket"
    rpm: float | None = None  # requests per minute
    tpm: float | None = None  # prompt + max-output tokens per minute
    concurrency: int | None = None  # requests in flight (tenant scope only)

    @classmethod
    def parse(cls, spec: str) -> "Quota":
        """``tenant=acme:rpm=60,tpm=40000``, ``tenant=*:concurrency=8``, ``tier=flex:tpm=1e5``."""
        where = f"quota '{spec}'"
        head, colon, body = spec.partition(":")
        scope, eq, name = head.partition("=")
        scope, name = scope.strip(), name.strip()
        if not colon or not eq or scope not in ("tenant", "tier") or not name:
            raise ServelabError(f"{where}: expected tenant=NAME:FIELD=VALUE,... or tier=NAME:... (NAME may be *)")
        values: dict = {}
        for key, raw in parse_fields(body, QUOTA_FIELDS, where).items():
            try:
                value = float(raw)
            except ValueError:
                raise ServelabError(f"{where}: '{key}' needs a number, got '{raw}'") from None
            if not math.isfinite(value) or value <= 0:
                raise ServelabError(f"{where}: '{key}' must be > 0, got {raw}")
            values[key] = int(value) if key == "concurrency" else value
        if not values:
            raise ServelabError(f"{where}: no limits (fields: {', '.join(QUOTA_FIELDS)})")
        if scope == "tier" and "concurrency" in values:
            raise ServelabError(f"{where}: concurrency is a tenant limit")
        return cls(scope, name, **values)


@dataclass(frozen=True, slots=True)
class PauseRule:
    """``tier=flex,waiting=32,resume=8`` or ``tier=flex,kv=0.9,resume=0.7``: pause a tier on a replica
    when the other tiers' waiting requests (or the KV share in use) exceed the first number, resume
    when they fall to ``resume`` (default: half of it)."""

    tier: str
    metric: str  # waiting | kv
    above: float
    resume: float

    @classmethod
    def parse(cls, spec: str) -> "PauseRule":
        where = f"pause '{spec}'"
        values = parse_fields(spec, ("tier", "waiting", "kv", "resume"), where)
        if "tier" not in values or ("waiting" in values) == ("kv" in values):
            raise ServelabError(f"{where}: give tier= and exactly one of waiting= or kv=")
        metric = "waiting" if "waiting" in values else "kv"
        try:
            above = float(values[metric])
            resume = float(values["resume"]) if "resume" in values else above / 2
        except ValueError:
            raise ServelabError(f"{where}: thresholds must be numbers") from None
        if metric == "kv" and not 0 < above <= 1:
            raise ServelabError(f"{where}: kv must be a share in (0, 1], got {above:g}")
        if above <= 0 or resume < 0 or resume > above:
            raise ServelabError(f"{where}: need 0 <= resume <= threshold and threshold > 0")
        return cls(values["tier"], metric, above, resume)

    def load(self, replica, others_waiting: int) -> float:
        return others_waiting if self.metric == "waiting" else replica.kv.used / replica.kv.total


@dataclass(frozen=True, slots=True)
class Failure:
    """A replica down at ``at_s``, for ``for_s`` seconds or for good."""

    replica: int
    at_s: float
    for_s: float | None = None  # None: down for good

    @classmethod
    def parse(cls, spec: str) -> "Failure":
        """``replica=R,at=T[,for=D]``."""
        where = f"fail '{spec}'"
        values = parse_fields(spec, ("replica", "at", "for"), where)
        if "replica" not in values or "at" not in values:
            raise ServelabError(f"{where}: needs replica= and at=, e.g. replica=0,at=30,for=10")
        try:
            replica = int(values["replica"])
            at_s = float(values["at"])
            for_s = float(values["for"]) if "for" in values else None
        except ValueError:
            raise ServelabError(f"{where}: replica must be an integer and at/for numbers of seconds") from None
        if replica < 0 or not math.isfinite(at_s) or at_s < 0:
            raise ServelabError(f"{where}: replica must be >= 0 and at >= 0")
        if for_s is not None and not (math.isfinite(for_s) and for_s > 0):
            raise ServelabError(f"{where}: for must be > 0 seconds")
        return cls(replica, at_s, for_s)


def check_failures(failures: tuple[Failure, ...], replicas: int | None) -> None:
    """Failures name existing replicas and do not overlap on one replica (``replicas`` None: the
    count is not known yet, as in a cluster config, whose pools number their replicas on)."""
    by_replica: dict[int, list[Failure]] = {}
    for f in failures:
        if replicas is not None and f.replica >= replicas:
            raise ServelabError(f"fail replica={f.replica}: there are only {replicas} replica(s) (ids 0..{replicas - 1})")
        by_replica.setdefault(f.replica, []).append(f)
    for rid, items in by_replica.items():
        items.sort(key=lambda f: f.at_s)
        for a, b in zip(items, items[1:]):
            if a.for_s is None or a.at_s + a.for_s > b.at_s:
                raise ServelabError(f"fail replica={rid}: the failure at {b.at_s:g} s starts while it is still down")


# -- the engine's spec strings, typed once (``EngineConfig``'s parts call these; its properties read them) --
# Keyed by the (hashable) strings and bounded: a search's variants rarely differ in them. A bad spec is
# not remembered: it raises each time, with the same message.

@lru_cache(maxsize=1024)
def parse_quotas(specs: tuple[str, ...]) -> tuple[Quota, ...]:
    return tuple(Quota.parse(spec) for spec in specs)


@lru_cache(maxsize=1024)
def parse_failures(specs: tuple[str, ...]) -> tuple[Failure, ...]:
    """Parsed and checked for overlaps; replica ids are checked against a count where it is known."""
    failures = tuple(Failure.parse(spec) for spec in specs)
    check_failures(failures, None)
    return failures


@lru_cache(maxsize=1024)
def parse_pause(spec: str | None) -> PauseRule | None:
    return PauseRule.parse(spec) if spec else None


@lru_cache(maxsize=1024)
def parse_tier_order(spec: str) -> Mapping[str, int]:
    """``tier_order`` -> {tier: rank}, read-only (one mapping is shared by every config that names it)."""
    return MappingProxyType(parse_tiers(spec, "tier_order"))


@lru_cache(maxsize=1024)
def parse_kv_tiers(specs: tuple[str, ...]) -> tuple[TierSpec, ...]:
    return parse_tier_stack(specs)


SPEC_PARSERS = (parse_quotas, parse_failures, parse_pause, parse_tier_order, parse_kv_tiers)


def clear_caches() -> None:
    """Forget every spec parsed (for tests that count parses)."""
    for parse in SPEC_PARSERS:
        parse.cache_clear()


__all__ = ["QUOTA_FIELDS", "SPEC_PARSERS", "Failure", "PauseRule", "Quota", "check_failures", "clear_caches",
           "parse_failures", "parse_kv_tiers", "parse_pause", "parse_quotas", "parse_tier_order"]
