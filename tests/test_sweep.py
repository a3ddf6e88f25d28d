"""Sweep: on a deterministic single-server queue the goodput rate it finds brackets the closed-form crossing.

Queue: n requests arriving every T seconds; each runs alone (max_num_seqs=1) for `out` iterations of
`base` seconds (linear runner, base cost only), so service time S = out * base. With T < S request i
waits i * (S - T), and its TTFT is base + i * (S - T). With TTFT SLO `slo`, attainment is
min(n, floor((slo - base) / (S - T)) + 1) / n, and the target share a is first missed above the rate
r* = 1 / (S - (slo - base) / (ceil(a n) - 1)).
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest

from servelab.cli.main import main
from servelab.replay import ReplayConfig
from servelab.replay.config import EngineConfig
from servelab.scoring.slo import SloTable
from servelab.scoring.sweep import goodput_rate, run_sweep
from servelab.traces.io import write_trace

N, BASE, OUT, SLO_TTFT, TARGET = 50, 0.01, 10, 0.03, 0.9
S = OUT * BASE


def closed_form_attainment(rate: float) -> float:
    gap = S - 1.0 / rate
    if gap <= 0:
        return 1.0
    return min(N, math.floor((SLO_TTFT - BASE) / gap) + 1) / N


R_STAR = 1.0 / (S - (SLO_TTFT - BASE) / (math.ceil(TARGET * N) - 1))  # ~10.046 req/s


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "queue.parquet"
    table = pa.table({
        "request_id": pa.array(range(N), pa.int64()),
        "arrival_s": pa.array([float(i) for i in range(N)]),  # 1 req/s as written
        "prompt_tokens": pa.array([16] * N, pa.int32()),
        "output_tokens": pa.array([OUT] * N, pa.int32()),
    })  # fmt: skip
    return write_trace(table, path, "test")


CONFIG = ReplayConfig(
    engine=EngineConfig(num_gpu_blocks=100, max_num_seqs=1), policy="sarathi", runner=f"linear:base={BASE}"
)
SLO = SloTable.parse_cli([f"ttft={SLO_TTFT}"])


def test_goodput_rate_helper():
    assert goodput_rate([(1, 1.0), (4, 0.5), (2, 0.95), (8, 0.99)], 0.9) == (2, 4)  # a pass above a miss is ignored
    assert goodput_rate([(1, 0.95), (2, 0.92)], 0.9) == (2, None)
    assert goodput_rate([(1, 0.5)], 0.9) == (None, 1)


def test_grid_attainment_matches_closed_form(trace_path, tmp_path):
    rates = [5.0, 10.02, 10.2, 20.0]
    res = run_sweep(trace_path, CONFIG, tmp_path / "grid", slo=SLO, rates=rates)
    assert [p.rate_rps for p in res.points] == rates
    assert [p.attainment for p in res.points] == pytest.approx([closed_form_attainment(r) for r in rates])
    assert [p.attainment for p in res.points] == pytest.approx([1.0, 1.0, 11 / 50, 1 / 50])  # 10.2: floor(0.02 / 0.00196) + 1 = 11
    assert res.native_rate_rps == pytest.approx(1.0)
    assert sorted(p.name for p in (tmp_path / "grid").iterdir()) == [
        "rate_10.02", "rate_10.2", "rate_20", "rate_5", "sweep.json"]  # fmt: skip
    assert res.goodput_rate_rps is None


@pytest.fixture(scope="module")
def serial_search(trace_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "search"
    return out, run_sweep(trace_path, CONFIG, out, slo=SLO, target=TARGET, tolerance=0.01)


def test_search_brackets_the_true_crossing(serial_search):
    out, res = serial_search
    lo, hi = res.bracket_rps
    assert lo <= R_STAR <= hi
    assert hi / lo - 1 <= 0.01
    assert res.goodput_rate_rps == lo
    by_rate = {p.rate_rps: p.attainment for p in res.points}
    assert by_rate[lo] >= TARGET > by_rate[hi]
    for rate, att in by_rate.items():  # every replayed point agrees with the formula
        assert att == pytest.approx(closed_form_attainment(rate)), rate
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["goodput_rate_rps"] == lo and saved["bracket_rps"] == [lo, hi]
    assert saved["goodput_rate_per_gpu"] == lo


def test_parallel_search_finds_the_same_bracket(trace_path, tmp_path, serial_search):
    serial_dir, serial = serial_search
    res = run_sweep(trace_path, CONFIG, tmp_path / "par", slo=SLO, target=TARGET, tolerance=0.01, jobs=3)
    assert res.bracket_rps == serial.bracket_rps
    serial_rates = {p.rate_rps for p in serial.points}
    assert serial_rates <= {p.rate_rps for p in res.points}  # a superset, replayed in fewer rounds
    same = {p.rate_rps: p for p in res.points if p.rate_rps in serial_rates}
    assert [same[p.rate_rps] for p in serial.points] == list(serial.points)
    for p in serial.points:  # byte-identical run outputs from the worker processes
        a = (serial_dir / p.run_dir / "requests.parquet").read_bytes()
        assert a == (tmp_path / "par" / p.run_dir / "requests.parquet").read_bytes()


def test_grid_then_search(trace_path, tmp_path):
    res = run_sweep(trace_path, CONFIG, tmp_path / "g", slo=SLO, rates=[6.0, 16.0], target=TARGET, tolerance=0.01)
    lo, hi = res.bracket_rps
    assert lo <= R_STAR <= hi and hi / lo - 1 <= 0.01
    assert res.points[0].rate_rps == 6.0 and res.points[-1].rate_rps == 16.0


def test_parallel_workers_give_identical_results(trace_path, tmp_path):
    serial = run_sweep(trace_path, CONFIG, tmp_path / "s", slo=SLO, rates=[7.0, 12.0])
    parallel = run_sweep(trace_path, CONFIG, tmp_path / "p", slo=SLO, rates=[7.0, 12.0], jobs=2)
    assert serial.points == parallel.points
    assert (tmp_path / "s" / "sweep.json").read_bytes() == (tmp_path / "p" / "sweep.json").read_bytes()
    for name in ("rate_7", "rate_12"):
        assert (tmp_path / "s" / name / "requests.parquet").read_bytes() == (tmp_path / "p" / name / "requests.parquet").read_bytes()


def test_target_never_met_and_always_met(trace_path, tmp_path):
    res = run_sweep(trace_path, CONFIG, tmp_path / "hi", slo=SLO, target=0.9, max_rate=4.0)
    assert res.bracket_rps == (4.0, None) and res.goodput_rate_rps == 4.0
    assert "every rate tried" in res.notes[0]
    tight = SloTable.parse_cli(["ttft=0.005"])  # below one iteration: nobody can meet it
    res = run_sweep(trace_path, CONFIG, tmp_path / "lo", slo=tight, target=0.9, min_rate=0.5)
    assert res.goodput_rate_rps is None and "below 0.9" in res.notes[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "sweep needs --rates, --rate-scales or --goodput-target"),
        ({"target": 1.5}, "--goodput-target must be in (0, 1]"),
        ({"target": 0.9, "tolerance": 0.0}, "--tolerance must be in"),
        ({"rates": [1.0, -2.0]}, "--rates must all be positive numbers"),
        ({"rates": [1.0], "jobs": 0}, "--jobs must be >= 1"),
        ({"target": 0.9, "slo": None}, "--goodput-target needs an SLO"),
    ],
)
def test_bad_options_write_nothing(trace_path, tmp_path, kwargs, message):
    from servelab.common.errors import ServelabError

    kwargs = {"slo": SLO, **kwargs}
    with pytest.raises(ServelabError) as err:
        run_sweep(trace_path, CONFIG, tmp_path / "out", **kwargs)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_sweep_cli_and_plot(trace_path, tmp_path, capsys):
    out = tmp_path / "cli"
    main(["sweep", str(trace_path), "--rates", "5,20", "--scales", "10.2", "--slo", f"ttft={SLO_TTFT}",
          "--runner", f"linear:base={BASE}", "--max-num-seqs", "1", "--num-gpu-blocks", "100", "-o", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "trace rate 1 req/s; 3 replays" in text and "rate_10.2" in text
    main(["query", str(out), "--format", "csv", "--slo", f"ttft={SLO_TTFT}",
          "SELECT round(offered_rate_rps, 6) AS r, attainment FROM attainment_vs_rate"])  # fmt: skip
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows == ["5,1", "10.2,0.22", "20,0.02"]
    main(["plot", str(out), "-o", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "attainment_vs_rate.png").exists()


def test_sweep_reads_slo_from_replay_config(trace_path, tmp_path, capsys):
    cfg = tmp_path / "replay.toml"
    cfg.write_text(f'runner = "linear:base={BASE}"\nmax_num_seqs = 1\nnum_gpu_blocks = 100\n[slo]\nttft_s = {SLO_TTFT}\n')
    out = tmp_path / "cfg"
    main(["sweep", str(trace_path), "--rates", "10.2", "--config", str(cfg), "-o", str(out)])
    assert json.loads((out / "sweep.json").read_text())["points"][0]["attainment"] == pytest.approx(11 / 50)
    capsys.readouterr()
    main(["sweep", str(trace_path), "--rates", "10.2", "--config", str(cfg), "--slo", "ttft=1", "-o", str(out),
          "--force"])  # replacing a sweep directory needs --force
    assert json.loads((out / "sweep.json").read_text())["points"][0]["attainment"] == 1.0  # the flag wins
