"""Tier names in priority order: one parser for the engine's ``tier_order`` and the policies' ``tiers``."""

from __future__ import annotations

from typing import Callable

from servelab.common.errors import ServelabError

DEFAULT_TIERS = "priority,standard,flex"


def parse_tiers(spec: str, owner: str) -> dict[str, int]:
    """``"priority,standard,flex"`` -> {name: rank}, rank 0 first. Empty -> no tiers (every rank 0)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(names)) != len(names):
        raise ServelabError(f"{owner}: tiers '{spec}' names a tier twice")
    return {name: rank for rank, name in enumerate(names)}


def tier_ranker(ranks: dict[str, int]) -> Callable[[str], int]:
    """Rank of a tier name; tiers not listed rank below every listed one (served last)."""
    lowest = len(ranks)
    return lambda tier: ranks.get(tier, lowest)


__all__ = ["DEFAULT_TIERS", "parse_tiers", "tier_ranker"]
