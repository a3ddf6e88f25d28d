"""The replicas-and-cost chart of a cluster run (scoring/cluster_timeline.py, scoring/plots.py, `servelab plot --cluster`)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import make_trace
from helpers_cli import run_main
from servelab.api import EngineConfig, ReplayConfig, replay, write_run
from servelab.cli.main import cli
from servelab.common.errors import ServelabError
from servelab.scoring.cluster_timeline import cumulative, held_at, pool_series
from test_cluster_autoscale import TRACE, autoscaled
from test_cluster_cost import fixed_cluster_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plot(*args):
    return CliRunner().invoke(cli, ["plot", *map(str, args)])


def test_fixed_cluster_series_and_dollars_by_hand(tmp_path):
    import json

    run_dir = fixed_cluster_run(tmp_path)
    meta = json.loads((run_dir / "run.json").read_text())
    p, d = pool_series(meta)
    assert (p.name, p.tp, p.held, p.price_per_gpu_hour, d.name, d.tp, d.held) == ("p", 2, (1,), 3.0, "d", 1, (2,))
    # charged over first arrival 0 .. last finish 5: prefill 2 GPUs x 5 s at $3/h, decode 2 x 5 s at $1.5/h
    at = [0.0, 2.5, 5.0, 9.0]
    assert cumulative(p, 0.0, 5.0, at, 3.0) == pytest.approx([0, 5 / 3600 * 3, 10 / 3600 * 3, 10 / 3600 * 3])
    assert cumulative(d, 0.0, 5.0, at, 1.5) == pytest.approx([0, 5 / 3600 * 1.5, 10 / 3600 * 1.5, 10 / 3600 * 1.5])
    result = plot(run_dir, "-o", tmp_path / "png", "--cluster")
    assert result.exit_code == 0, result.output
    png = (tmp_path / "png" / "cluster_fixed.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["cluster_fixed.png"]


def test_autoscaled_pool_follows_its_timeline(tmp_path):
    run_dir = write_run(replay(TRACE, autoscaled()), tmp_path / "auto")
    import json

    (web,) = pool_series(json.loads((run_dir / "run.json").read_text()))
    # the hand-computed timeline of test_cluster_autoscale: held = active + starting + draining
    assert web.times == (0.0, 1.0, 4.0, 31.0, 46.0, 51.0)
    assert web.held == (1, 3, 3, 3, 2, 1) and web.active == (1, 1, 3, 2, 2, 1)
    assert [held_at(web, t) for t in (0.2, 1.0, 3.9, 45.0, 50.0, 90.0)] == [1, 3, 3, 3, 2, 1]
    # over [0.5, 80.5]: 1 x 0.5 + 3 x 45 + 2 x 5 + 1 x 29.5 = 175 replica-seconds at $3.6/h; to t=31: 0.5 + 90
    assert cumulative(web, 0.5, 80.5, [31.0, 100.0], 3.6) == pytest.approx([90.5 / 1000, 175 / 1000])
    # the plain `plot` adds the cluster chart next to the others
    result = plot(run_dir, "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "all" / "cluster_auto.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "all" / "timeline_auto.png").is_file()


def test_a_run_without_cluster_pools_is_a_clear_error(tmp_path, capsys):
    flat = write_run(replay(make_trace([0], [8], [3]), ReplayConfig(
        engine=EngineConfig(num_gpu_blocks=100), runner="linear:base=1")), tmp_path / "flat")
    with pytest.raises(ServelabError, match="run.json has no cluster pools"):
        pool_series({"config": {}}, "somewhere")
    code, _, err = run_main(["plot", str(flat), "-o", str(tmp_path / "png"), "--cluster"], capsys)
    assert code == 1
    assert err.startswith(f"error: {flat}: run.json has no cluster pools") and err.count("\n") == 1
    assert not (tmp_path / "png").exists()  # nothing written
    # without --cluster a flat run just has no cluster chart
    result = plot(flat, "-o", tmp_path / "plain")
    assert result.exit_code == 0 and not list((tmp_path / "plain").glob("cluster_*"))
