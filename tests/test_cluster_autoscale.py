"""Autoscaling (replay/cluster/autoscale.py) against a hand-computed replica timeline.

One replica at first, every step 1 s (``linear:base=1``), one request per replica at a time
(``max_num_seqs = 1``): a request of 10 output tokens holds a replica for 10 s. Target tracking
on the queue depth, target 2 per replica, every 1 s, cooldown 5 s, start-up 3 s, 1..3 replicas.
"""

from __future__ import annotations

import pytest

from conftest import make_trace
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError


def autoscaled(**autoscale):
    scale = dict(dict(min=1, max=3, signal="queue_depth", target=2, interval_s=1, cooldown_s=5, startup_s=3),
                 **autoscale)
    return ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 100, "max_num_seqs": 1, "router": "least-outstanding",
        "cluster": {"pools": [{"name": "web", "replicas": 1, "price_per_gpu_hour": 3.6, "autoscale": scale}]}})


# Eight requests at 0.5 all go to replica 0 (the only one): R0 [0.5, 10.5], R1 [10.5, 20.5], ...,
# R7 [70.5, 80.5]; its queue is 7 until 10.5, then 6, 5 (from 20.5), 4 (30.5), 3 (40.5), 2 (50.5).
# A (t=5) and B (t=6), 40 tokens each, go to the new idle replicas 1 and 2: [5, 45] and [6, 46].
TRACE = make_trace([0.5] * 8 + [5, 6], [1] * 10, [10] * 8 + [40, 40])


def test_replica_timeline_under_a_step_in_load_matches_the_hand_computed_one(tmp_path):
    result = replay(TRACE, autoscaled())
    pool = result.meta["cluster"]["pools"][0]
    # t=1: queue 7 -> ceil(7/2) = 4, capped at 3: two replicas start, serving from 1 + 3 = 4.
    # t=31: queue 4 -> 2 < 3 active (cooldown since 1 passed): replica 2 drains; busy with B to 46.
    # t=51: queue 2 -> 1: replica 1 drains; idle since A ended at 45, it stops at once.
    assert pool["autoscale"]["timeline"] == [
        [0.0, 1, 0, 0], [1.0, 1, 2, 0], [4.0, 3, 0, 0], [31.0, 2, 0, 1], [46.0, 2, 0, 0], [51.0, 1, 0, 0]]
    rows = result.requests.to_pylist()
    assert [r["replica"] for r in rows] == [0] * 8 + [1, 2]
    assert [r["finish_s"] for r in rows] == [10.5 + 10 * k for k in range(8)] + [45.0, 46.0]
    assert {r["status"] for r in rows} == {"finished"}  # draining dropped nothing
    # replicas held over first arrival 0.5 .. last finish 80.5:
    # 1 x 0.5 + 3 x 30 (1..31) + 3 x 15 (31..46, one draining) + 2 x 5 + 1 x 29.5 = 175 replica-seconds
    assert pool["replica_seconds"] == pytest.approx(175.0)
    from servelab.api import write_run
    from servelab.scoring.db import connect

    con = connect([str(write_run(result, tmp_path / "run"))])
    gpu_s, dollars, mean_gpus = con.execute(
        "SELECT gpu_s, dollars, mean_gpus FROM cost WHERE scope = 'overall'").fetchone()
    assert gpu_s == pytest.approx(175.0) and dollars == pytest.approx(175.0 / 3600 * 3.6)
    assert mean_gpus == pytest.approx(175.0 / 80.0)


def test_cooldown_and_startup_delay_shape_the_timeline():
    # start-up 0: the two new replicas serve from t=1 (one row: the changes of one instant)
    timeline = replay(TRACE, autoscaled(cooldown_s=0, startup_s=0)).meta["cluster"]["pools"][0]["autoscale"]["timeline"]
    assert timeline == [[0.0, 1, 0, 0], [1.0, 3, 0, 0], [31.0, 2, 0, 1], [46.0, 2, 0, 0], [51.0, 1, 0, 0]]
    # cooldown 40 after the action at t=1: the first scale-in may come at t=41 (queue 3 -> 2 replicas:
    # replica 2 drains until B ends at 46), the next at t=81, the first tick after R7 ends at 80.5
    timeline = replay(TRACE, autoscaled(cooldown_s=40)).meta["cluster"]["pools"][0]["autoscale"]["timeline"]
    assert timeline == [[0.0, 1, 0, 0], [1.0, 1, 2, 0], [4.0, 3, 0, 0], [41.0, 2, 0, 1], [46.0, 2, 0, 0],
                        [81.0, 1, 0, 0]]


def test_bad_autoscale_settings_are_one_line_errors():
    with pytest.raises(ServelabError, match="min <= max"):
        autoscaled(min=3, max=2)
    with pytest.raises(ServelabError, match="signal must be one of.*did you mean 'queue_depth'"):
        autoscaled(signal="queue_dept")
    with pytest.raises(ServelabError, match="initial count"):
        autoscaled(min=2)
    with pytest.raises(ServelabError, match="unknown key 'cooldown'"):
        autoscaled(cooldown=3)


def test_an_autoscaler_pinned_at_n_replays_like_n_fixed_replicas():
    from helpers_engine import synthetic

    trace = synthetic(n=400, rate=40.0)
    runner = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005"
    fixed = replay(trace, ReplayConfig.from_dict({"runner": runner, "num_gpu_blocks": 500, "replicas": 3,
                                                  "router": "least-outstanding"}))
    pinned = replay(trace, ReplayConfig.from_dict({
        "runner": runner, "num_gpu_blocks": 500, "router": "least-outstanding",
        "cluster": {"pools": [{"name": "a", "replicas": 3, "autoscale": {"min": 3, "max": 3, "interval_s": 0.25}}]}}))
    assert fixed.requests.equals(pinned.requests) and fixed.steps.equals(pinned.steps)


def test_goodput_per_gpu_has_one_definition_in_every_view(tmp_path):
    """Issue #26 item 8: the report printed goodput per GPU twice, from the goodput view (per GPU
    provisioned) and the cost view (per GPU held on average): 3 and 2.19 GPUs here. One name, one
    definition (per GPU provisioned, as DistServe's per-GPU goodput and the search objective);
    the time-averaged figure has its own name."""
    from servelab.api import write_run
    from servelab.scoring.db import connect

    con = connect([str(write_run(replay(TRACE, autoscaled()), tmp_path / "run"))])
    goodput_view, num_gpus = con.execute(
        "SELECT goodput_rps_per_gpu, num_gpus FROM goodput WHERE scope = 'overall'").fetchone()
    cost_view, per_mean_gpu, mean_gpus, met = con.execute(
        "SELECT goodput_rps_per_gpu, goodput_rps_per_mean_gpu, mean_gpus, met_all FROM cost WHERE scope = 'overall'"
    ).fetchone()
    assert num_gpus == 3 and mean_gpus == pytest.approx(175.0 / 80.0)
    assert cost_view == goodput_view == pytest.approx(met / 80.0 / 3)
    assert per_mean_gpu == pytest.approx(met / 80.0 / mean_gpus)
