"""`fitted`: a cost model learned from a profile by non-negative least squares on roofline-shaped counts.

step_s = c0 + c1 prefill_tokens + c2 prefill_seqs + c3 prefill_context_tokens
       + c4 prefill_attention_pairs + c5 decode_seqs + c6 decode_context_tokens,

with one coefficient set per bucket of batch tokens (``prefill_tokens + decode_seqs``) when
buckets are given: a roofline is piecewise linear in the batch size (memory-bound below the
ridge, compute-bound above), so a few buckets follow its knee. Coefficients are non-negative, so
every count costs time. A pure decode batch of n requests lands in the bucket of n whatever its
context, which makes ``decode_affine`` exact.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa

from servelab.common.atomic import atomic_path
from servelab.common.errors import InputError, ServelabError
from servelab.runners.base import RUNNERS, RunnerBase, StepPlan
from servelab.runners.profiling import FEATURES, read_profile
from servelab.common.textfile import read_text

MODEL_FORMAT = 1
TERMS = ("intercept", *FEATURES)


@dataclass(frozen=True, slots=True)
class FittedModel:
    """Coefficient sets (seconds per count) for batches of up to ``bucket_edges[i]`` tokens."""

    bucket_edges: tuple[int, ...]  # upper bounds (inclusive) of all buckets but the last
    coefficients: tuple[tuple[float, ...], ...]  # one per bucket, ordered as TERMS
    metadata: dict = field(default_factory=dict)  # model, gpu, tp, kv_bytes_per_token, fit metrics

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(self.bucket_edges) + 1:
            raise ValueError("one coefficient set per bucket")
        if any(len(c) != len(TERMS) for c in self.coefficients):
            raise ValueError(f"each coefficient set has {len(TERMS)} terms")
        if list(self.bucket_edges) != sorted(set(self.bucket_edges)):
            raise ValueError("bucket edges must increase")

    def bucket(self, tokens: int) -> int:
        return bisect.bisect_left(self.bucket_edges, tokens)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Vectorised step time for rows of FEATURES."""
        tokens = x[:, 0] + x[:, 4]
        idx = np.searchsorted(np.asarray(self.bucket_edges), tokens, side="left")
        coef = np.asarray(self.coefficients)[idx]
        return coef[:, 0] + np.einsum("ij,ij->i", coef[:, 1:], x)

    def to_json(self) -> dict:
        return {
            "format": MODEL_FORMAT,
            "kind": "servelab-fitted-runner",
            "terms": list(TERMS),
            "bucket_edges_tokens": list(self.bucket_edges),
            "coefficients_s": [dict(zip(TERMS, c)) for c in self.coefficients],
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, raw: dict, path: str | Path = "model.json") -> "FittedModel":
        if not isinstance(raw, dict) or raw.get("kind") != "servelab-fitted-runner":
            raise InputError(path, "not a servelab fitted model (kind != servelab-fitted-runner)")
        if raw.get("format") != MODEL_FORMAT:
            raise InputError(path, f"unsupported format {raw.get('format')} (this servelab reads {MODEL_FORMAT})")
        coefs = []
        for i, entry in enumerate(raw.get("coefficients_s", [])):
            try:
                values = tuple(float(entry[t]) for t in TERMS)
            except (KeyError, TypeError, ValueError):
                raise InputError(path, f"needs numbers for {', '.join(TERMS)}", column="coefficients_s", row=i) from None
            if any(not np.isfinite(v) or v < 0 for v in values):
                raise InputError(path, "coefficients must be finite and >= 0", column="coefficients_s", row=i)
            coefs.append(values)
        edges = tuple(int(e) for e in raw.get("bucket_edges_tokens", []))
        try:
            return cls(edges, tuple(coefs), dict(raw.get("metadata", {})))
        except ValueError as err:
            raise InputError(path, str(err)) from None


def feature_matrix(table: pa.Table) -> np.ndarray:
    return np.column_stack([table.column(f).to_numpy(zero_copy_only=False).astype(np.float64) for f in FEATURES])


def median_per_shape(table: pa.Table) -> pa.Table:
    """One row per distinct shape (in order of first appearance) with the median of its repeats.

    Timings of a real device have outliers (a preempted CPU thread, a clock change) that a median
    ignores and least squares would not. numpy only: the GPU image has no polars.
    """
    x = feature_matrix(table)
    y = table.column("step_s").to_numpy(zero_copy_only=False).astype(np.float64)
    _, first, inverse = np.unique(x, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.lexsort((y, inverse))  # by group, then by time within it
    counts = np.bincount(inverse)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sorted_y = y[order]
    lo, hi = starts + (counts - 1) // 2, starts + counts // 2
    medians = (sorted_y[lo] + sorted_y[hi]) / 2
    keep = np.argsort(first, kind="stable")  # groups in order of first appearance
    columns = {f: pa.array(x[first[keep], i]) for i, f in enumerate(FEATURES)}
    return pa.table({**columns, "step_s": pa.array(medians[keep])})


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """NNLS on relative error: rows scaled by 1/y, so a 1 ms step weighs as much as a 1 s one."""
    from scipy.optimize import nnls  # only fitting needs scipy; make_runner imports this module

    design = np.column_stack([np.ones(len(y)), x]) / y[:, None]
    scale = np.abs(design).max(axis=0)  # counts span 1..1e8: normalise columns for conditioning
    scale[scale == 0] = 1.0
    coef, _ = nnls(design / scale, np.ones(len(y)), maxiter=50 * design.shape[1])
    return coef / scale


def fit_model(
    table: pa.Table,
    *,
    buckets: tuple[int, ...] = (),
    test_fraction: float = 0.2,
    seed: int = 0,
    source: str = "profile",
    meta: dict | None = None,
) -> FittedModel:
    """Fit per-bucket NNLS on a seeded train split; score MAPE and R^2 on the held-out rows."""
    if not 0 <= test_fraction < 1:
        raise ServelabError(f"test fraction must be in [0, 1), got {test_fraction}")
    rows_read = table.num_rows
    table = median_per_shape(table)
    x = feature_matrix(table)
    y = table.column("step_s").to_numpy(zero_copy_only=False).astype(np.float64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    tokens = x[:, 0] + x[:, 4]
    # Edges at or above the largest profiled batch would only open empty buckets: drop them, so
    # the top bucket extrapolates from the largest batches measured.
    edges = tuple(e for e in sorted(set(int(b) for b in buckets)) if e < tokens.max())
    bucket_of = np.searchsorted(np.asarray(edges, dtype=float), tokens, side="left")
    coefs = []
    for b in range(len(edges) + 1):
        rows = train[bucket_of[train] == b]
        if len(rows) < len(TERMS):
            lo = 1 if b == 0 else edges[b - 1] + 1
            hi = edges[b] if b < len(edges) else "inf"
            raise InputError(source, f"bucket of {lo}..{hi} batch tokens has {len(rows)} training rows; "
                             f"needs at least {len(TERMS)} (use fewer buckets)")
        coefs.append(tuple(float(c) for c in _nnls_relative(x[rows], y[rows])))
    model = FittedModel(edges, tuple(coefs))
    metrics = {"rows_read": rows_read, "rows": int(len(y)), "train_rows": int(len(train)), "test_rows": int(n_test), "seed": seed,
               "test_fraction": test_fraction, "train": score(model.predict(x[train]), y[train])}
    if n_test:
        metrics["test"] = score(model.predict(x[test]), y[test])
    info = {k: v for k, v in (meta or {}).items() if k in ("runner", "model", "gpu", "tp", "kv_bytes_per_token")}
    described = (meta or {}).get("describe") or {}
    memory = {k: described[k] for k in ("activation_tokens", "logit_seqs", "non_torch_bytes") if k in described}
    if memory:  # how the profiled runner sized its KV cache, so that the fitted one sizes it the same
        info["kv_memory"] = memory
    return FittedModel(edges, tuple(coefs), {**info, "source": str(source), "fit": metrics})


def score(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    ape = np.abs(pred / y - 1) * 100
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {
        "mape_pct": float(ape.mean()),
        "median_ape_pct": float(np.median(ape)),
        "p90_ape_pct": float(np.quantile(ape, 0.9)),
        "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None,
    }


def fit_profile(profile: str | Path, output: str | Path, **kwargs) -> FittedModel:
    """Read and validate ``profile``, fit, write ``output`` atomically (nothing on failure)."""
    table, meta = read_profile(profile)
    model = fit_model(table, source=str(profile), meta=meta, **kwargs)
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(model.to_json(), indent=2, allow_nan=False) + "\n")
    return model


class FittedRunner(RunnerBase):
    """A FittedModel behind the Runner protocol; KV size from the profile's model/GPU presets."""

    name = "fitted"

    def __init__(self, model: FittedModel, path: str = ""):
        self.model = model
        self.path = path
        self._edges = list(model.bucket_edges)
        self._coefs = model.coefficients
        meta = model.metadata
        self.kv_bytes_per_token: int | None = meta.get("kv_bytes_per_token")
        self._presets = _presets(meta)
        if self._presets is not None and self.kv_bytes_per_token is None:
            self.kv_bytes_per_token = self._presets[0].kv_bytes_per_token
        # None (the protocol's "no model/GPU known"): the engine then asks for num_gpu_blocks.
        self.kv_capacity_tokens = self._capacity if self._presets and self._presets[1] is not None else None

    def _capacity(self, gpu_memory_utilization: float = 0.9) -> int:
        from servelab.runners.roofline import kv_capacity_tokens

        model, gpu, tp = self._presets
        return kv_capacity_tokens(model, gpu, tp, gpu_memory_utilization, **self.model.metadata.get("kv_memory", {}))

    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        c = self._coefs[bisect.bisect_left(self._edges, s.prefill_tokens + s.decode_seqs)]
        # Summed in TERMS order so that decode_affine reproduces pure-decode steps bit for bit.
        return (
            c[0]
            + c[1] * s.prefill_tokens
            + c[2] * s.prefill_seqs
            + c[3] * s.prefill_context_tokens
            + c[4] * s.prefill_attention_pairs
            + c[5] * s.decode_seqs
            + c[6] * s.decode_context_tokens
        )

    def decode_affine(self, num_seqs: int) -> tuple[float, float]:
        c = self._coefs[bisect.bisect_left(self._edges, num_seqs)]
        return c[0] + c[5] * num_seqs, c[6]

    def describe(self) -> dict:
        return {"runner": self.name, "path": self.path, **self.model.to_json()}


def _presets(meta: dict):
    from servelab.runners.presets import GPUS, MODELS

    model = MODELS.get(str(meta.get("model", "")).lower())
    if model is None:
        return None
    gpu = GPUS.get(str(meta.get("gpu", "")).lower())
    return model, gpu, int(meta.get("tp", 1) or 1)


def load_model(path: str | Path) -> FittedModel:
    path = Path(path)
    try:
        raw = json.loads(read_text(path))  # a binary file: a one-line InputError
    except FileNotFoundError:
        raise InputError(path, "fitted model file not found") from None
    except json.JSONDecodeError as err:
        raise InputError(path, f"invalid JSON ({err})") from None
    return FittedModel.from_json(raw, path)


@RUNNERS.register("fitted")
@dataclass(frozen=True, slots=True)
class FittedParams:
    """``fitted:model.json`` (or ``fitted:path=model.json``): the model file, read when the runner is built."""

    positional: ClassVar[str] = "path"  # the spec's value without a key
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.path is None:
            raise ServelabError("needs a model file: --runner fitted:model.json")

    def build(self, **_context) -> FittedRunner:
        return FittedRunner(load_model(self.path), str(self.path))
