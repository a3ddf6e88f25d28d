"""Whether a run's policy knew its true output lengths: one line for a report, a search summary, best.toml.

Apart from scoring/report.py (DuckDB, rich: ~0.2 s of CPU to import) so that `servelab search`, which
prints the line under its summary, does not load them for it.
"""

from __future__ import annotations


LENGTH_RANKED = ("sjf", "srpt")  # policies (or a `within` order) that rank requests by output length


def output_length_knowledge(policy: str | None, params: dict | None) -> str | None:
    """How the policy knows output lengths: "oracle" (the true ones: ``noise_sigma = 0``), "predicted"
    (lognormal noise), or None when it does not rank by length at all."""
    params = params or {}
    if policy not in LENGTH_RANKED and params.get("within") not in LENGTH_RANKED:
        return None
    try:
        sigma = float(params.get("noise_sigma") or 0.0)
    except (TypeError, ValueError):
        sigma = 0.0
    return "predicted" if sigma > 0 else "oracle"


def output_length_note(policy: str | None, params: dict | None) -> str | None:
    """One line saying that a length-ranking policy is an oracle (or how noisy its predictor is)."""
    knowledge = output_length_knowledge(policy, params)
    if knowledge is None:
        return None
    if knowledge == "predicted":
        return f"output lengths predicted (lognormal noise_sigma = {float(params['noise_sigma']):g})"
    return ("oracle: ranks by every request's true output length (noise_sigma = 0), which no real server "
            "knows; set noise_sigma > 0 for a predictor")


__all__ = ["LENGTH_RANKED", "output_length_knowledge", "output_length_note"]
