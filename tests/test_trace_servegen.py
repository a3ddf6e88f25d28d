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


# ---- missing datasets (issue 16, item 12)


def _without_chunk9_dataset(tmp_path: Path) -> Path:
    folder = _copy(tmp_path)
    (folder / "chunk-9-dataset.json").unlink()
    return folder


def test_skip_missing_leaves_out_clients_without_a_dataset(tmp_path):
    full = import_trace("servegen", [SG / "mm-image"], start_s=0, duration_s=86400, seed=4).table
    tenant = np.array(full.column("tenant").cast(pa.string()).to_pylist())
    folder = _without_chunk9_dataset(tmp_path)
    with pytest.raises(InputError, match="--skip-missing"):
        import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=4)
    r = import_trace("servegen", [folder], start_s=0, duration_s=86400, seed=4, skip_missing=True)
    assert set(r.table.column("tenant").cast(pa.string()).to_pylist()) == {"chunk-26"}
    kept = full.filter(pa.array(tenant == "chunk-26"))
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):  # the other client is untouched
        np.testing.assert_array_equal(r.table.column(name).to_numpy(), kept.column(name).to_numpy())
    n9 = int((tenant == "chunk-9").sum())
    assert n9 > 0 and r.dropped == {"requests of clients without a dataset (--skip-missing)": n9}
    (warning,) = r.warnings
    assert "chunk-9" in warning and f"{n9:,} of {full.num_rows:,} requests" in warning
    assert f"({n9 / full.num_rows:.1%} of the traffic)" in warning


def test_skip_missing_on_the_command_line(tmp_path, capsys):
    from servelab.cli.main import main

    folder = _without_chunk9_dataset(tmp_path)
    out = tmp_path / "o.arrow"
    argv = ["trace", "import", "--format", "servegen", str(folder), "--duration", "86400", "-o", str(out)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "chunk-9-dataset.json: file not found" in err and "--skip-missing" in err
    assert no_files_like(tmp_path, out.name)
    main([*argv, "--skip-missing"])
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: skipped 1 of 2 clients") and "% of the traffic) dropped" in captured.err
    assert "requests of clients without a dataset" in captured.out and out.is_file()
    with pytest.raises(SystemExit):
        main(["trace", "import", "--format", "azure", str(FIXTURES / "azure_conv_2023_head300.csv"),
              "--skip-missing", "-o", str(tmp_path / "a.arrow")])  # fmt: skip
    assert "--skip-missing does not apply to --format azure" in capsys.readouterr().err


def test_skip_missing_with_every_dataset_missing(tmp_path):
    folder = _without_chunk9_dataset(tmp_path)
    (folder / "chunk-26-dataset.json").unlink()
    with pytest.raises(ServelabError, match="lacks its chunk-N-dataset.json"):
        import_trace("servegen", [folder], start_s=0, duration_s=86400, skip_missing=True)
