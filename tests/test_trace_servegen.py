"""ServeGen expansion: seeded determinism, rates matching the windows, length fields, bad inputs."""

from __future__ import annotations

import ast
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from helpers_traces import FIXTURES, assert_input_error, no_files_like, shared

from servelab.cli.main import cli
from servelab.common.errors import InputError, ServelabError
from servelab.traces.importers import import_trace
from servelab.traces.servegen import Window, client_arrivals

SG = FIXTURES / "servegen"


def expected_requests(folder: Path, start_s: float, duration_s: float) -> float:
    """Σ rate × overlap over every client's windows (computed straight from the CSVs)."""
    total = 0.0
    for path in folder.glob("chunk-*-trace.csv"):
        for row in csv.reader(path.open()):
            lo, hi = max(float(row[0]), start_s), min(float(row[0]) + 600, start_s + duration_s)
            if hi > lo:
                total += float(row[1]) * (hi - lo)
    return total


def test_deterministic_under_seed():
    a = import_trace("servegen", [SG / "deepseek-r1"], start_s=0, duration_s=86400, seed=5).table
    b = import_trace("servegen", [SG / "deepseek-r1"], start_s=0, duration_s=86400, seed=5).table
    c = import_trace("servegen", [SG / "deepseek-r1"], start_s=0, duration_s=86400, seed=6).table
    assert a.equals(b) and not a.equals(c)
    assert set(a.column("tenant").cast(pa.string()).to_pylist()) == {"chunk-3"}
    assert set(a.column("model").cast(pa.string()).to_pylist()) == {"deepseek-r1"}


def test_client_filter_does_not_change_other_clients():
    both = import_trace("servegen", [SG / "mm-image"], start_s=0, duration_s=86400, seed=1).table
    one = import_trace("servegen", [SG / "mm-image"], start_s=0, duration_s=86400, seed=1, clients=("chunk-9",)).table
    tenant = np.array(both.column("tenant").cast(pa.string()).to_pylist())
    mine = both.filter(pa.array(tenant == "chunk-9"))
    np.testing.assert_array_equal(mine.column("arrival_s").to_numpy(), one.column("arrival_s").to_numpy())
    np.testing.assert_array_equal(mine.column("prompt_tokens").to_numpy(), one.column("prompt_tokens").to_numpy())


def test_mm_image_prompt_is_text_plus_image_tokens():
    t = import_trace("servegen", [SG / "mm-image"], start_s=0, duration_s=86400, seed=2, clients=("chunk-9",)).table
    data = json.loads((SG / "mm-image" / "chunk-9-dataset.json").read_text())
    possible = set()
    for fields in data.values():
        text = ast.literal_eval(fields["text_tokens"])
        image = ast.literal_eval(fields["image_tokens"])
        possible |= {a + b for a in text for b in image}
    got = set(t.column("prompt_tokens").to_pylist())
    assert got and got <= possible
    assert min(t.column("output_tokens").to_pylist()) >= 1


def test_rate_matches_windows_on_fixture():
    folder = SG / "mm-image"
    t = import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=3).table
    expected = expected_requests(folder, 0, 86400)
    assert t.num_rows == pytest.approx(expected, rel=0.05)


def test_window_arrivals_respect_span_and_rate():
    w = [Window(0, 600, 2.0, 3.0, "gamma"), Window(600, 600, 0.0, 0.0, "gamma"), Window(1200, 600, 1.0, 0.5, "weibull")]
    counts = []
    for seed in range(40):
        t = client_arrivals(w, 300, 1500, np.random.default_rng(seed))
        assert np.all((t >= 300) & (t < 1500)) and np.all(np.diff(t) >= 0)
        assert not np.any((t >= 600) & (t < 1200))  # the rate-0 window stays empty
        counts.append(len(t))
    # expected 2 × 300 + 1 × 300 = 900 per run; 40 runs average within 3 %
    assert np.mean(counts) == pytest.approx(900, rel=0.03)


@pytest.mark.slow
def test_full_deepseek_rates_and_lengths():
    folder = shared("servegen/reason/deepseek-r1")
    t = import_trace("servegen", [folder], start_s=36000, duration_s=7200, seed=0).table
    assert t.num_rows == pytest.approx(expected_requests(folder, 36000, 7200), rel=0.05)
    out = t.column("output_tokens").to_numpy()
    assert 400 < np.median(out) < 4000


@pytest.mark.slow
def test_full_deepseek_day_total_and_mm_image():
    folder = shared("servegen/reason/deepseek-r1")
    t = import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=1).table
    assert t.num_rows == pytest.approx(expected_requests(folder, 0, 86400), rel=0.02)
    out = t.column("output_tokens").to_numpy()
    assert np.median(out) == pytest.approx(790, rel=0.1)
    mm = shared("servegen/multimodal/mm-image")
    m = import_trace("servegen", [mm], start_s=0, duration_s=86400, seed=1).table
    assert m.num_rows == pytest.approx(expected_requests(mm, 0, 86400), rel=0.03)


# ---- bad inputs


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "sg"
    shutil.copytree(SG / "mm-image", dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def test_bad_rate_row(tmp_path):
    folder = _copy(tmp_path)
    path = folder / "chunk-9-trace.csv"
    lines = path.read_text().splitlines()
    lines[4] = "2400,fast,1.0,Gamma,1,1"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as err:
        import_trace("servegen", [folder], duration_s=86400)
    assert_input_error(err, path, "not a number: 'fast'", "rate", 5)
    out = tmp_path / "o.arrow"
    result = CliRunner().invoke(cli, ["trace", "import", "--format", "servegen", str(folder), "--duration", "86400", "-o", str(out)])
    assert result.exit_code == 1 and "not a number: 'fast'" in str(result.exception)
    assert no_files_like(tmp_path, out.name)


def test_unknown_pattern(tmp_path):
    folder = _copy(tmp_path)
    path = folder / "chunk-26-trace.csv"
    lines = path.read_text().splitlines()
    lines[0] = "0,1.0,1.0,Pareto,1,1"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as err:
        import_trace("servegen", [folder], duration_s=86400)
    assert_input_error(err, path, "unknown pattern 'Pareto'", "pattern", 1)


def test_missing_dataset_and_bad_pmf(tmp_path):
    folder = _copy(tmp_path)
    (folder / "chunk-9-dataset.json").unlink()
    with pytest.raises(InputError, match="chunk-9-dataset.json: file not found"):
        import_trace("servegen", [folder], duration_s=86400)
    folder = _copy(tmp_path / "b")
    path = folder / "chunk-26-dataset.json"
    data = json.loads(path.read_text())
    first = next(iter(data))
    data[first]["output_tokens"] = "{1: 'x'"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as err:
        import_trace("servegen", [folder], duration_s=86400)
    assert_input_error(err, path, "not a {tokens: probability} mapping", f"{first}.output_tokens")


def test_window_past_data_end_and_unknown_client():
    with pytest.raises(ServelabError, match="runs past the data's end"):
        import_trace("servegen", [SG / "mm-image"], start_s=86000, duration_s=1000)
    with pytest.raises(ServelabError, match="unknown ServeGen client"):
        import_trace("servegen", [SG / "mm-image"], duration_s=600, clients=("chunk-999",))
