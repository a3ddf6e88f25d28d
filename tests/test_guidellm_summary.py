"""guidellm_summary: GuideLLM 0.8's statistics (token-weighted ITL and TPOT, nearest-rank percentiles)
beside ours, on hand-computed runs, and against a direct port of GuideLLM's percentile rule."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_scoring import req, write_run
from servelab.scoring.db import query


def _summary(run) -> dict:
    return {r["metric"]: r for r in query([run], "SELECT * FROM guidellm_summary").to_pylist()}


def test_itl_is_token_weighted_and_nearest_rank(tmp_path):
    # ITL per request (c - f) / (n - 1): 0.1 (weight 10), 0.5 (weight 1), 0.1 (weight 2)
    run = write_run(tmp_path / "r", [req(0, arrival=0.0, first_token=0.1, finish=1.1, output=11),
                                     req(1, arrival=0.1, first_token=0.2, finish=0.7, output=2),
                                     req(2, arrival=0.2, first_token=0.4, finish=0.6, output=3)])
    s = _summary(run)["itl_s"]
    # merged: 0.1 (weight 12), 0.5 (weight 1): shares 12/13 = 0.923 and 1
    assert (s["requests"], s["weight"]) == (3, 13.0)
    assert s["p50"] == pytest.approx(0.1) and s["p90"] == pytest.approx(0.1)
    assert s["p95"] == pytest.approx(0.5) and s["p99"] == pytest.approx(0.5)
    assert s["mean"] == pytest.approx((0.1 * 12 + 0.5) / 13)
    # ours (vLLM's): per request, unweighted, linear: p90 of 0.1, 0.1, 0.5 is 0.42
    ours = query([run], "SELECT quantile_cont(tpot_s, 0.9) AS p90 FROM request_metrics").to_pylist()[0]["p90"]
    assert ours == pytest.approx(0.42)
    # GuideLLM's TPOT includes TTFT: (c - a) / n, weighted by n
    tpot = _summary(run)["tpot_s"]
    values = {1.1 / 11: 11, 0.6 / 2: 2, 0.4 / 3: 3}
    assert tpot["mean"] == pytest.approx(sum(v * w for v, w in values.items()) / 16)
    assert tpot["p50"] == pytest.approx(0.1)  # share 11/16 = 0.69 >= 0.5 at the smallest value


def _guidellm_percentile(values, weights, p):
    """GuideLLM's rule (schemas/statistics.py: Percentiles.from_pdf): sort, merge equal values, normalise
    the weights, first value whose cumulative probability reaches p."""
    order = np.argsort(values)
    uniq, inv = np.unique(np.asarray(values)[order], return_inverse=True)
    w = np.zeros_like(uniq)
    np.add.at(w, inv, np.asarray(weights, dtype=float)[order])
    keep = w > 0
    uniq, w = uniq[keep], w[keep]
    cdf = np.cumsum(w / w.sum())
    return uniq[np.searchsorted(cdf, p, side="left")]


def test_matches_guidellms_rule_on_a_random_run(tmp_path):
    rng = np.random.default_rng(7)
    rows = []
    for i in range(200):
        a = i * 0.05
        n = int(rng.integers(1, 60))
        f = a + float(rng.uniform(0.01, 0.3))
        rows.append(req(i, arrival=a, first_token=f, finish=f + (n - 1) * float(rng.uniform(0.005, 0.03)), output=n))
    run = write_run(tmp_path / "r", rows)
    s = _summary(run)
    multi = [r for r in rows if r["output_tokens"] > 1]
    itl = [(r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1) for r in multi]
    for p, key in ((0.5, "p50"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99")):
        assert s["itl_s"][key] == pytest.approx(_guidellm_percentile(itl, [r["output_tokens"] - 1 for r in multi], p),
                                                rel=1e-12)
        tpot = [(r["finish_s"] - r["arrival_s"]) / r["output_tokens"] for r in rows]
        assert s["tpot_s"][key] == pytest.approx(_guidellm_percentile(tpot, [r["output_tokens"] for r in rows], p),
                                                 rel=1e-12)
        ttft = [r["ttft_s"] for r in rows]
        assert s["ttft_s"][key] == pytest.approx(_guidellm_percentile(ttft, [1] * len(rows), p), rel=1e-12)
