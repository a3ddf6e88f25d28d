"""Tables a person reads never cut a name or a number (issue 16 item 16), and show units without
scientific notation or duplicate rows (item 17): presets, report, compare, query, at 100 columns and piped."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from helpers_scoring import req, step, write_run
from rich.table import Table

from servelab.cli.main import cli
from servelab.common.tables import table_text
from servelab.runners.presets import GPUS, MODELS
from servelab.scoring.output import format_number, render_table

LONG_TENANT = "standard-enterprise-customer-with-a-long-name"
SCIENTIFIC = re.compile(r"\d[eE][+-]?\d")


def invoke(args, columns):
    """Run the CLI the way a pipe does (CliRunner output is no terminal); ``columns`` None unsets COLUMNS."""
    result = CliRunner().invoke(cli, args, env={"COLUMNS": None if columns is None else str(columns)})
    assert result.exit_code == 0, result.output
    return result.stdout  # (what the pipe gets; notes go to stderr)


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def folded_names(text: str, start: str) -> list[str]:
    """First-column cells starting with ``start``, their folded pieces (lines of one word below) joined."""
    lines, names = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith(start):
            name = line.split()[0]
            for below in lines[i + 1:]:
                if len(below.split()) != 1 or below.startswith(" "):
                    break
                name += below.strip()
            names.append(name)
    return names


@pytest.mark.parametrize("columns", [100, 80, None])
def test_presets_never_cut_a_name(columns):
    out = invoke(["presets"], columns)
    assert "…" not in out
    words = set(out.split())
    for name in [*MODELS, *GPUS]:
        assert name in words, name  # whole, on one line: what --model / --gpu take
    if columns == 100:
        assert widest(out) <= columns


@pytest.fixture
def tenant_runs(tmp_path):
    rows = [req(i, arrival=i * 0.1, first_token=i * 0.1 + 0.05, finish=i * 0.1 + 1.0, output=10, prompt=100,
                tenant=LONG_TENANT if i % 2 else "acme") for i in range(1, 101)]  # fmt: skip
    a = write_run(tmp_path / "a", rows, [step(0.0, 1.0, batch=2, kv_used=10)])
    slower = [dict(r, first_token_s=r["first_token_s"] + 1e-7, ttft_s=r["ttft_s"] + 1e-7) for r in rows]
    b = write_run(tmp_path / "b", slower, [step(0.0, 1.0, batch=2, kv_used=10)])
    return a, b


@pytest.mark.parametrize("columns", [100, 80, None])
def test_report_keeps_long_tenant_names_and_numbers_whole(tenant_runs, columns):
    out = invoke(["report", str(tenant_runs[0]), "--slo", "ttft=1"], columns)
    assert "…" not in out
    if columns == 80:  # too narrow for the name beside the numbers: it folds over lines, whole
        assert folded_names(out, "tenant=st") == [f"tenant={LONG_TENANT}"] * 2
    else:
        assert f"tenant={LONG_TENANT}" in out.split()
    assert out.count("100.0%") >= 4  # overall, tier, two tenants: joint attainment, each whole
    assert "goodput" in out and "req/s" in out
    if columns:
        assert widest(out) <= columns


def test_report_in_narrow_width_folds_a_long_name_rather_than_cut_it(tenant_runs):
    out = invoke(["report", str(tenant_runs[0]), "--width", "50"], None)
    assert "…" not in out
    names = folded_names(out, "tenant=st")  # a folded name reads back whole
    assert names and set(names) == {f"tenant={LONG_TENANT}"}


def test_table_text_fits_by_wrapping_headers_and_never_elides():
    t = Table()
    t.add_column("a rather long header", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    t.add_row("llama-3.1-70b", "100.0%")
    out = table_text(t, 20)  # too narrow: printed wider, nothing cut
    assert "llama-3.1-70b" in out and "100.0%" in out and "…" not in out
    assert widest(table_text(t, None)) == widest(table_text(t, 1000))  # no limit: one line per row
    assert "[x]" in table_text(_one_cell("[x] [bold]y[/bold]"), None)  # cells are text, not markup


def _one_cell(text: str) -> Table:
    t = Table()
    t.add_column("c")
    t.add_row(text)
    return t


def test_compare_units_in_names_no_scientific_notation_no_duplicates(tenant_runs):
    a, b = tenant_runs
    rows = json.loads(invoke(["compare", str(a), str(b), "--slo", "ttft=1", "--format", "json"], None))
    names = [r["metric"] for r in rows]
    assert len(names) == len(set(names))  # 'attainment' no longer twice
    by = {r["metric"]: r for r in rows}
    assert by["attainment_pct"]["a"] == 100.0  # percent, like the report
    assert by["ttft_p50_ms"]["a"] == pytest.approx(50.0)  # milliseconds, like the report
    assert by["ttft_p50_ms"]["delta b"] == pytest.approx(1e-4)  # 1e-7 s
    assert {"duration_s", "goodput_rps", "queue_p99_ms", "mean_kv_util_pct"} <= set(names)
    assert not any(n in names for n in ("attainment", "ttft_p50", "ttft_mean", "queue_p99"))
    for columns in (100, None):
        out = invoke(["compare", str(a), str(b), "--slo", "ttft=1"], columns)
        assert not SCIENTIFIC.search(out), out
        assert "…" not in out and "0.0001" in out and "delta_pct b" in out


def test_compare_lists_attainment_per_tier_only_with_several_tiers(tmp_path):
    rows = [req(1, first_token=0.5, finish=1.0, tier="priority"), req(2, first_token=0.5, finish=1.0)]
    a, b = write_run(tmp_path / "a", rows), write_run(tmp_path / "b", rows)
    out = invoke(["compare", str(a), str(b)], None)
    assert "attainment_pct tier=priority" in out and "attainment_pct tier=standard" in out  # shown, not eaten as markup


def test_query_table_prints_plain_numbers(tenant_runs):
    sql = "SELECT 10123456.0::DOUBLE AS big, 0.0000529241::DOUBLE AS small, 1e20::DOUBLE AS huge, 0.5::DOUBLE AS half"
    out = invoke(["query", str(tenant_runs[0]), sql], None)
    assert "10123456" in out and "0.0000529241" in out and "0.5" in out
    assert "1.0123e+07" not in out and "5.29241e-05" not in out


@pytest.mark.parametrize("value,text", [
    (10123456.0, "10123456"), (5.29241e-05, "0.0000529241"), (0.5, "0.5"), (100.0, "100"), (-0.25, "-0.25"),
    (0.0, "0"), (1.0 / 3, "0.333333"), (123456.789, "123457"), (1e20, "1e+20"), (1e-9, "1e-09"),
    (float("nan"), "nan"), (float("inf"), "inf"),
])  # fmt: skip
def test_format_number(value, text):
    assert format_number(value) == text


def test_render_table_piped_keeps_rows_on_one_line():
    import pyarrow as pa

    table = pa.table({f"column_{i}": [123456.0 + i] for i in range(15)})
    piped = render_table(table, width=None)
    assert len(piped.strip().splitlines()) == 3  # header, rule, row
    narrow = render_table(table, width=60)
    assert "…" not in narrow and all(str(123456 + i) in narrow.split() for i in range(15))


def test_replay_report_fits_100_columns_without_cutting(tmp_path):
    """The report `replay` and `demo` print after a replay goes through the same fitted tables."""
    from conftest import make_trace

    from servelab.traces.io import write_trace

    trace = write_trace(make_trace([i * 0.1 for i in range(30)], [50] * 30, [10] * 30), tmp_path / "t.arrow", source="t")
    result = CliRunner().invoke(cli, ["replay", str(trace), "-o", str(tmp_path / "r"), "--runner",
                                      "linear:base=0.01,decode_seq=0.001", "--num-gpu-blocks", "200",
                                      "--slo", "ttft=2,tpot=0.1"], env={"COLUMNS": "100"})  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout  # the report (the "replaying ..." lines go to stderr)
    assert out.startswith("run r") and "…" not in out and "done" in out and "req/s" in out
    assert widest(out) <= 100
