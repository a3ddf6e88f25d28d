"""Cost of a fixed cluster (the ``cost`` view, scoring/views.py), checked by hand."""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay, write_run
from servelab.scoring.db import connect
from servelab.scoring.report import report_text
from servelab.scoring.slo import SloTable


def fixed_cluster_run(tmp_path):
    config = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 100, "kv_bytes_per_token": 1000,
        "cluster": {"pools": [{"name": "p", "role": "prefill", "replicas": 1, "tp": 2, "gpu": "h100-80gb",
                               "price_per_gpu_hour": 3.0},
                              {"name": "d", "role": "decode", "replicas": 2, "gpu": "a100-80gb",
                               "price_per_gpu_hour": 1.5, "router": "least-outstanding"}],
                    "links": [{"from": "p", "to": "d", "bandwidth_gbps": 8e-6}]}})
    # both prompts prefill in [0, 1]; 8,000 B each share 8,000 B/s: both land at 3 on replicas 1 and 2;
    # decode [3, 4], [4, 5]: both finish at 5 (TTFT 1 s, TPOT (5 - 1) / 2 = 2 s)
    run_dir = write_run(replay(make_trace([0, 0], [8, 8], [3, 3]), config), tmp_path / "fixed")
    return run_dir


def test_cost_per_pool_and_per_token_by_hand(tmp_path):
    run_dir = fixed_cluster_run(tmp_path)
    con = connect([str(run_dir)], SloTable.parse_cli(["ttft=2,tpot=3"]))
    rows = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT scope, name, gpus, gpu_s, dollars, output_tokens, dollars_per_million_output_tokens, "
        "dollars_per_request, goodput_requests_per_dollar, goodput_rps_per_gpu FROM cost").fetchall()}
    # first arrival 0 to last finish 5: 5 s. Prefill: 1 replica x TP 2 = 2 GPUs -> 10 GPU-s at $3/h;
    # decode: 2 x 1 = 2 GPUs -> 10 GPU-s at $1.5/h.
    p_dollars, d_dollars = 10 / 3600 * 3.0, 10 / 3600 * 1.5
    total = p_dollars + d_dollars  # $0.0125
    assert rows[("pool", "p")][:3] == (2, pytest.approx(10.0), pytest.approx(p_dollars))
    assert rows[("pool", "d")][:3] == (2, pytest.approx(10.0), pytest.approx(d_dollars))
    assert rows[("gpu", "h100-80gb")][2] == pytest.approx(p_dollars)
    gpus, gpu_s, dollars, tokens, per_m, per_req, per_dollar, per_gpu = rows[("overall", None)]
    assert (gpus, gpu_s, dollars, tokens) == (4, pytest.approx(20.0), pytest.approx(total), 6)
    assert per_m == pytest.approx(total / 6 * 1e6)  # $2,083.33 per million output tokens
    assert per_req == pytest.approx(total / 2)
    assert per_dollar == pytest.approx(2 / total)  # both meet TTFT <= 2 and TPOT <= 3: 160 per $
    assert per_gpu == pytest.approx(2 / 5 / 4)
    text = report_text(str(run_dir), slo=("ttft=2,tpot=3",), width=200)
    assert "p (prefill) 2 GPU" in text and "cost: $0.01" in text and "per million output tokens" in text


def test_a_flat_run_has_gpu_time_but_no_price(tmp_path):
    from servelab.api import EngineConfig

    run_dir = write_run(replay(make_trace([0], [8], [3]), ReplayConfig(
        engine=EngineConfig(replicas=2, num_gpu_blocks=100), runner="linear:base=1", tp=2)), tmp_path / "flat")
    con = connect([str(run_dir)])
    gpus, gpu_s, dollars = con.execute("SELECT gpus, gpu_s, dollars FROM cost WHERE scope = 'overall'").fetchone()
    assert (gpus, gpu_s, dollars) == (4, pytest.approx(4 * 3.0), None)  # 2 replicas x TP 2 over [0, 3]


def _unpriced_run(tmp_path, prefill_price):
    import json

    pool = {"name": "p", "role": "prefill", "replicas": 1, "tp": 2, "gpu": "h100-80gb"}
    if prefill_price is not None:
        pool["price_per_gpu_hour"] = prefill_price
    config = ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 100, "kv_bytes_per_token": 1000,
        "cluster": {"pools": [pool, {"name": "d", "role": "decode", "replicas": 2, "gpu": "a100-80gb"}],
                    "links": [{"from": "p", "to": "d", "bandwidth_gbps": 8e-6}]}})
    run_dir = write_run(replay(make_trace([0, 0], [8, 8], [3, 3]), config), tmp_path / f"unpriced_{prefill_price}")
    recorded = {p["name"]: p["price_per_gpu_hour"] for p in json.loads((run_dir / "run.json").read_text())["cluster"]["pools"]}
    return run_dir, recorded


@pytest.mark.parametrize("prefill_price", [3.0, None])
def test_a_pool_without_a_price_leaves_dollars_null_not_zero(tmp_path, prefill_price):
    """The decode pool has no price: run.json records null (not 0.0), so its dollars, the overall dollars and
    the cost per token are NULL (they were $0 and the prefill pool's cost alone), and the report gives GPU-hours
    and no dollar total; a priced pool keeps its own dollars."""
    run_dir, recorded = _unpriced_run(tmp_path, prefill_price)
    assert recorded == {"p": prefill_price, "d": None}
    con = connect([str(run_dir)], SloTable.parse_cli(["ttft=2,tpot=3"]))
    rows = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT scope, name, gpu_s, dollars, dollars_per_million_output_tokens FROM cost").fetchall()}
    assert rows[("pool", "d")] == (pytest.approx(10.0), None, None)
    assert rows[("overall", None)] == (pytest.approx(20.0), None, None)
    assert rows[("gpu", "a100-80gb")][1] is None
    p_dollars = None if prefill_price is None else pytest.approx(10 / 3600 * 3.0)
    assert rows[("pool", "p")][1] == p_dollars
    assert con.execute("SELECT price_per_gpu_hour FROM pools WHERE pool = 'd'").fetchone() == (None,)
    text = report_text(str(run_dir), slo=("ttft=2,tpot=3",), width=200)
    assert "d (decode) 2 GPU, 0.003 GPU-h" in text and "cost:" not in text and "$0.00" not in text, text


def test_an_explicit_price_of_zero_is_a_price(tmp_path):
    run_dir, recorded = _unpriced_run(tmp_path, 0.0)
    assert recorded == {"p": 0.0, "d": None}
    config = ReplayConfig.from_dict({"cluster": {"pools": [{"name": "a", "role": "prefill", "price_per_gpu_hour": 0},
                                                           {"name": "b", "role": "decode"}],
                                                 "links": [{"from": "a", "to": "b", "bandwidth_gbps": 1}]}})
    assert [p.get("price_per_gpu_hour") for p in config.to_dict()["cluster"]["pools"]] == [0.0, None]
    assert ReplayConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()  # (TOML has no null: omitted)


def test_compare_shows_cost_rows_for_priced_runs(tmp_path):
    from servelab.scoring.compare import run_metrics

    run_dir = fixed_cluster_run(tmp_path)
    con = connect([str(run_dir)])
    rows = {r["metric"]: r["value"] for r in run_metrics(con).to_pylist()}
    assert rows["gpus"] == 4 and rows["dollars"] == pytest.approx(0.0125)
    assert rows["gpu_hours"] == pytest.approx(20 / 3600)
    assert rows["dollars_per_million_output_tokens"] == pytest.approx(0.0125 / 6 * 1e6)
