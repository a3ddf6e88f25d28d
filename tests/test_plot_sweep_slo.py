"""`plot` draws attainment vs rate only for runs at two or more rates, naming each point by its run, and a
sweep's runs are scored with the SLO the sweep used when no --slo is given (issue 16 item 18)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner
from helpers_cli import invoke
from helpers_scoring import req, step, write_run

from servelab.cli.main import cli
from servelab.scoring import plots
from servelab.scoring.slo import SloTable
from servelab.scoring.sweep import sweep_slo
from servelab.traces.io import write_trace

SWEEP = ["--runner", "linear:base=0.01", "--max-num-seqs", "1", "--num-gpu-blocks", "100"]


def _run(path, gap):
    rows = [req(i, arrival=i * gap, first_token=i * gap + 0.1, finish=i * gap + 0.5, output=5) for i in range(10)]
    return write_run(path, rows, [step(0.0, 1.0)])


def test_runs_at_one_rate_get_no_attainment_vs_rate_plot(tmp_path):
    a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 1.0)
    out = invoke("plot", a, b, "-o", tmp_path / "plots")
    assert "attainment_vs_rate.png" not in out
    assert not (tmp_path / "plots" / "attainment_vs_rate.png").exists()


def test_runs_at_two_rates_are_plotted_with_their_names(tmp_path, monkeypatch):
    a, b = _run(tmp_path / "slow", 1.0), _run(tmp_path / "fast", 0.25)
    names = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", lambda self, text, *a, **k: (names.append(text), original(self, text, *a, **k))[1])
    out = invoke("plot", a, b, "-o", tmp_path / "plots")
    assert "attainment_vs_rate.png" in out
    assert sorted(names) == ["fast", "slow"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweep")
    n = 40
    trace = pa.table({
        "request_id": pa.array(range(n), pa.int64()),
        "arrival_s": pa.array([float(i) for i in range(n)]),
        "prompt_tokens": pa.array([16] * n, pa.int32()),
        "output_tokens": pa.array([10] * n, pa.int32()),
    })  # fmt: skip
    path = write_trace(trace, base / "queue.parquet", "test")
    out = base / "sw"
    invoke("sweep", path, "--rates", "5,20", "--slo", "ttft=0.03", *SWEEP, "-o", out)
    return out


def test_sweep_stores_its_slo(sweep_dir):
    data = json.loads((sweep_dir / "sweep.json").read_text())
    assert data["slo"] == {"ttft_s": 0.03}
    assert sweep_slo([sweep_dir]) == SloTable.parse_cli(["ttft=0.03"])
    assert sweep_slo([sweep_dir / "rate_5", sweep_dir / "rate_20"]) == SloTable.parse_cli(["ttft=0.03"])


def test_plot_and_report_of_a_sweep_use_its_slo(sweep_dir, tmp_path, monkeypatch):
    stored = {round(p["rate_rps"]): p["attainment"] for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]}
    assert stored[20] < 1.0  # the SLO matters at the high rate
    seen = {}
    real = plots.write_plots

    def spy(con, out_dir):
        seen.update({round(r): a for r, a in con.execute("SELECT offered_rate_rps, attainment FROM attainment_vs_rate").fetchall()})
        return real(con, out_dir)

    monkeypatch.setattr(plots, "write_plots", spy)
    result = CliRunner().invoke(cli, ["plot", str(sweep_dir), "-o", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert seen == pytest.approx(stored)  # not 1.0 beside the sweep's goodput
    assert "scoring with the sweep's SLO (global: ttft_s=0.03)" in result.output
    assert (tmp_path / "plots" / "attainment_vs_rate.png").exists()
    assert "SLO: global: ttft_s=0.03" in invoke("report", sweep_dir / "rate_20")
    assert "SLO: global: ttft_s=1" in invoke("report", sweep_dir / "rate_20", "--slo", "ttft=1")  # flags win


def test_runs_not_from_one_sweep_use_no_stored_slo(sweep_dir, tmp_path):
    other = _run(tmp_path / "other", 1.0)
    assert sweep_slo([sweep_dir / "rate_5", other]) is None
    legacy = tmp_path / "legacy"
    _run(legacy / "rate_1", 1.0)
    (legacy / "sweep.json").write_text(json.dumps({"points": []}))  # written before the SLO was stored
    assert sweep_slo([legacy]) is None


def test_slo_table_to_dict_round_trips():
    table = SloTable.parse_cli(["ttft=0.5,tpot=0.05", "tier=priority:ttft=0.2", "tenant=acme:e2e=10"])
    assert SloTable.from_toml(table.to_dict()) == table
    assert SloTable().to_dict() == {}


def test_a_sweeps_target_and_goodput_rate_lines_stay_beside_another_run(tmp_path, monkeypatch):
    sweep = tmp_path / "sw"
    _run(sweep / "rate_1", 1.0), _run(sweep / "rate_4", 0.25)
    (sweep / "sweep.json").write_text(json.dumps({"points": [], "target": 0.9, "goodput_rate_rps": 2.5}))
    other = _run(tmp_path / "single" / "run", 0.5)
    lines = []
    import matplotlib.axes

    for name in ("axhline", "axvline"):
        original = getattr(matplotlib.axes.Axes, name)
        monkeypatch.setattr(matplotlib.axes.Axes, name,
                            lambda self, *a, _o=original, **k: (lines.append(k.get("label")), _o(self, *a, **k))[1])
    invoke("plot", sweep, other, "-o", tmp_path / "plots")
    assert "target 0.9" in lines
    assert "goodput rate of sw 2.5 req/s" in lines
