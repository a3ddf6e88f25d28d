"""Speculative decoding's options: vLLM's ``--speculative-config`` JSON, the method names, and the
acceptance rates a workload draws (``spec_acceptance``). Checked by EngineConfig without I/O; used by
replay/core/speculative.py."""

from __future__ import annotations

import json
import math
import random

from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean

# vLLM's --speculative-config methods ("deepseek_mtp" and the other model-specific MTP names: "mtp")
METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram")
METHOD_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "mimo_mtp": "mtp", "ernie_mtp": "mtp",
                  "glm4_moe_mtp": "mtp", "longcat_flash_mtp": "mtp", "draft": "draft_model", "[ngram]": "ngram"}
CONFIG_KEYS = ("method", "num_speculative_tokens", "model")


def parse_speculative_config(text: str) -> dict:
    """vLLM's ``--speculative-config`` JSON (``{"method": "eagle", "num_speculative_tokens": 4, "model":
    ...}``) as the EngineConfig fields it sets: ``spec_method``, ``spec_k``, ``spec_draft_model``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ServelabError(f"speculative_config: not JSON ({err.msg} at character {err.pos}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ServelabError(f"speculative_config: a JSON object is needed, got {text!r}")
    unknown = sorted(set(raw) - set(CONFIG_KEYS))
    if unknown:
        raise ServelabError(f"speculative_config: unknown key '{unknown[0]}' (keys: {', '.join(CONFIG_KEYS)})")
    out = {}
    model = raw.get("model")
    method = raw.get("method")
    if method is None:  # vLLM: a model and no method means a draft model; "[ngram]" as the model, n-gram
        if model is None:
            raise ServelabError("speculative_config: needs 'method' (one of " + ", ".join(METHODS) + ") or 'model'")
        method = "ngram" if model == "[ngram]" else "draft_model"
    out["spec_method"] = method
    if "num_speculative_tokens" not in raw:
        raise ServelabError("speculative_config: needs 'num_speculative_tokens'")
    k = raw["num_speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool):
        raise ServelabError(f"speculative_config: num_speculative_tokens must be an integer, got {k!r}")
    out["spec_k"] = k
    if model is not None and model != "[ngram]":
        out["spec_draft_model"] = str(model)
    return out


def canonical_method(method: str) -> str:
    """``method`` as one of METHODS (vLLM's model-specific MTP names are all ``mtp``), or an error."""
    name = METHOD_ALIASES.get(method, method)
    if name not in METHODS:
        raise ServelabError(f"spec_method must be one of {', '.join(METHODS)}; got '{method}'"
                            f"{did_you_mean(method, METHODS)}")
    return name


class Acceptance:
    """Per-request acceptance rates of a workload: ``"0.8"`` (every request), ``"uniform:LO,HI"`` or
    ``"beta:ALPHA,BETA"`` (each request draws its own from its generator)."""

    __slots__ = ("spec", "kind", "args")

    def __init__(self, spec: str):
        self.spec = spec
        kind, colon, rest = str(spec).partition(":")
        try:
            if not colon:
                self.kind, self.args = "fixed", (float(kind),)
            else:
                self.kind, self.args = kind.strip(), tuple(float(v) for v in rest.split(","))
        except ValueError:
            raise ServelabError(f"spec_acceptance: '{spec}' is not a rate in [0, 1], uniform:LO,HI or "
                                "beta:ALPHA,BETA") from None
        if self.kind == "fixed":
            check_rate(self.args[0], "spec_acceptance")
        elif self.kind == "uniform":
            if len(self.args) != 2 or not 0 <= self.args[0] <= self.args[1] <= 1:
                raise ServelabError(f"spec_acceptance: uniform:LO,HI needs 0 <= LO <= HI <= 1, got '{spec}'")
        elif self.kind == "beta":
            if len(self.args) != 2 or not all(0 < v < math.inf for v in self.args):
                raise ServelabError(f"spec_acceptance: beta:ALPHA,BETA needs two numbers > 0, got '{spec}'")
        else:
            raise ServelabError(f"spec_acceptance: unknown distribution '{self.kind}' (a rate, uniform:LO,HI, "
                                "beta:ALPHA,BETA)")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.args[0]
        if self.kind == "uniform":
            return rng.uniform(*self.args)
        return rng.betavariate(*self.args)


def check_rate(value: float, where: str) -> None:
    if not 0.0 <= value <= 1.0:  # (nan fails)
        raise ServelabError(f"{where} must be an acceptance rate in [0, 1], got {value}")


__all__ = ["METHODS", "Acceptance", "canonical_method", "check_rate", "parse_speculative_config"]
