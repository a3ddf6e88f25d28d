"""`servelab trace ...` through click's CliRunner: import, synth, transform, merge, info, validate."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
from click.testing import CliRunner
from helpers_traces import FIXTURES, good_table, no_files_like, shared, write_raw_arrow

from servelab.cli.main import cli, main
from servelab.common.errors import InputError, ServelabError
from servelab.traces.io import read_trace, trace_metadata, trace_sha256


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok(*args: str):
    result = run(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_import_azure_prints_summary(tmp_path):
    out = tmp_path / "a.arrow"
    r = ok("trace", "import", "--format", "azure", FIXTURES / "azure_conv_2023_head300.csv", "-o", out)
    assert "300 requests from 300 rows" in r.output and "span" in r.output
    assert read_trace(out).num_rows == 300
    assert trace_metadata(read_trace(out))["source"] == "azure"


def test_import_every_format(tmp_path):
    cases = [
        ("vidur", [FIXTURES / "vidur_splitwise_conv_head300.csv"], [], 300),
        ("mooncake", [FIXTURES / "mooncake_synthetic_head200.jsonl"], ["--block-tokens", "512"], 200),
        ("burstgpt", [FIXTURES / "burstgpt_head54.csv"], ["--log-type-as", "tier"], 51),
        ("lengths", [FIXTURES / "sharegpt_lengths_head300.csv"], ["--rate", "2", "--arrival", "gamma", "--cv", "3", "--seed", "1"], 300),
        ("servegen", [FIXTURES / "servegen" / "mm-image"], ["--start", "0", "--duration", "7200", "--seed", "1"], None),
    ]
    for fmt, srcs, opts, rows in cases:
        out = tmp_path / f"{fmt}.parquet"
        r = ok("trace", "import", "--format", fmt, *srcs, "-o", out, *opts)
        assert "requests" in r.output
        n = read_trace(out).num_rows
        assert n == rows if rows is not None else n > 0
    assert "dropped: 3 failed" in run("trace", "import", "--format", "burstgpt", FIXTURES / "burstgpt_head54.csv",
                                      "-o", tmp_path / "b.arrow").output


def test_import_bad_row_fails_cleanly(tmp_path, capsys):
    src = tmp_path / "bad.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,44\n2023-11-16 18:15:47.0,x,1\n")
    out = tmp_path / "out.arrow"
    r = run("trace", "import", "--format", "azure", src, "-o", out)
    assert r.exit_code == 1 and isinstance(r.exception, InputError)
    assert str(r.exception) == f"{src}, column 'ContextTokens', row 2: not an integer: 'x'"
    assert no_files_like(tmp_path, "out.arrow")
    # the real entry point prints one line and exits 1
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "import", "--format", "azure", str(src), "-o", str(out)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: {src}, column 'ContextTokens', row 2: not an integer: 'x'"
    assert no_files_like(tmp_path, "out.arrow")


def test_import_rejects_options_of_other_formats(tmp_path):
    r = run("trace", "import", "--format", "azure", FIXTURES / "azure_2024_form.csv", "--seed", "3", "-o", tmp_path / "a.arrow")
    assert r.exit_code == 1 and "--seed does not apply to --format azure" in str(r.exception)
    assert no_files_like(tmp_path, "a.arrow")


def test_synth_is_deterministic_and_matches_options(tmp_path):
    args = ["trace", "synth", "-n", "2000", "--rate", "4", "--arrival", "gamma", "--cv", "2", "--prompt",
            "lognormal:400:1", "--output-len", "uniform:5:50", "--tenants", "3", "--tenant-zipf", "1.2",
            "--tiers", "priority=0.1,standard=0.9", "--turns", "2", "--think-s", "3", "--prefix-block-tokens", "16",
            "--seed", "7"]
    ok(*args, "-o", tmp_path / "a.arrow")
    ok(*args, "-o", tmp_path / "b.arrow")
    assert trace_sha256(tmp_path / "a.arrow") == trace_sha256(tmp_path / "b.arrow")
    t = read_trace(tmp_path / "a.arrow")
    assert t.num_rows == 2000 and {"session_id", "think_s", "prefix_hashes"} <= set(t.column_names)
    assert set(t.column("tier").cast(pa.string()).to_pylist()) == {"priority", "standard"}
    ok("trace", "synth", "--duration-s", "60", "--profile", "piecewise", "--schedule", "0:5,30:0",
       "-o", tmp_path / "c.arrow")
    assert read_trace(tmp_path / "c.arrow").column("arrival_s").to_numpy().max() < 30


def test_synth_bad_option_leaves_nothing(tmp_path):
    r = run("trace", "synth", "-n", "10", "--prompt", "lognormal:x:1", "-o", tmp_path / "s.arrow")
    assert r.exit_code == 1 and isinstance(r.exception, ServelabError) and "bad length spec" in str(r.exception)
    r = run("trace", "synth", "-n", "10", "--profile", "piecewise", "--schedule", "0-5", "-o", tmp_path / "s.arrow")
    assert r.exit_code == 1 and "bad --schedule" in str(r.exception)
    assert no_files_like(tmp_path, "s.arrow")


def test_transform_and_merge(tmp_path):
    src = tmp_path / "s.arrow"
    ok("trace", "synth", "-n", "1000", "--rate", "10", "--tenants", "a=1,b=1", "-o", src)
    out = tmp_path / "t.arrow"
    r = ok("trace", "transform", src, "-o", out, "--window", "10:60", "--scale-rate", "2", "--tier-by-tenant",
           "a=priority", "--tier-default", "flex")
    t = read_trace(out)
    assert "window 10:60" in r.output and t.column("arrival_s").to_numpy().max() < 25
    assert set(t.column("tier").cast(pa.string()).to_pylist()) == {"priority", "flex"}
    assert "rate x2" in trace_metadata(t)["source"]
    ok("trace", "transform", src, "-o", tmp_path / "h.arrow", "--head", "10", "--sample", "0.5", "--seed", "3")
    assert read_trace(tmp_path / "h.arrow").num_rows == 5
    r = run("trace", "transform", src, "-o", tmp_path / "x.arrow")
    assert r.exit_code == 1 and "nothing to do" in str(r.exception)
    merged = tmp_path / "m.parquet"
    ok("trace", "merge", src, out, "-o", merged)
    tenants = set(read_trace(merged).column("tenant").cast(pa.string()).to_pylist())
    assert tenants == {"s/a", "s/b", "t/a", "t/b"}


@pytest.mark.parametrize(
    "make,rule",
    [
        (lambda t: t.set_column(1, "arrival_s", pa.array([0.0, 2.0, 1.0, 3.0, 4.0])), "arrivals not sorted"),
        (lambda t: t.set_column(1, "arrival_s", pa.array([0.0, math.nan, 1.0, 3.0, 4.0])), "not a finite number"),
        (lambda t: t.set_column(0, "request_id", pa.array([0, 0, 1, 2, 3], pa.int64())), "duplicate request_id"),
    ],
)
def test_bad_trace_input_to_transform_info_validate(tmp_path, make, rule):
    bad = write_raw_arrow(make(good_table()), tmp_path / "bad.arrow")
    for args in (["transform", bad, "-o", tmp_path / "o.arrow", "--head", "2"], ["info", bad], ["validate", bad],
                 ["merge", bad, "-o", tmp_path / "o.arrow"]):
        r = run("trace", *args)
        assert r.exit_code == 1 and isinstance(r.exception, InputError) and rule in str(r.exception)
        assert str(bad) in str(r.exception)
    assert no_files_like(tmp_path, "o.arrow")


def test_info_table_and_json(tmp_path):
    src = tmp_path / "s.arrow"
    ok("trace", "synth", "-n", "500", "--rate", "5", "--turns", "2", "--think-s", "1", "-o", src)
    r = ok("trace", "info", src)
    assert "inter-arrival CV" in r.output and "sessions" in r.output
    data = json.loads(ok("trace", "info", src, "--json").output)
    assert data["rows"] == 500 and data["sessions"] > 100
    assert "ok (500 requests)" in ok("trace", "validate", src).output


def test_full_shared_azure_import_via_cli(tmp_path):
    src = shared("azure_llm_2023/AzureLLMInferenceTrace_conv.csv")
    r = ok("trace", "import", "--format", "azure", src, "-o", tmp_path / "az.arrow")
    assert "19366 requests" in r.output


@pytest.mark.parametrize("sharing", [["--shared-prefix-tokens", "256"], ["--prompt-pool", "5"]])
def test_import_prefix_block_tokens_zero_is_a_one_line_error(tmp_path, sharing):
    r = run("trace", "import", "--format", "azure", FIXTURES / "azure_conv_2023_head300.csv", "-o", tmp_path / "x.arrow",
            *sharing, "--prefix-block-tokens", "0")
    assert r.exit_code == 1 and isinstance(r.exception, ServelabError)
    assert str(r.exception) == "--prefix-block-tokens must be >= 1 (got 0)"
    assert no_files_like(tmp_path, "x.arrow")


def test_import_prefix_block_tokens_without_sharing_is_refused_not_ignored(tmp_path):
    # before: accepted and ignored (the trace had no hashes to size)
    r = run("trace", "import", "--format", "azure", FIXTURES / "azure_conv_2023_head300.csv", "-o", tmp_path / "x.arrow",
            "--prefix-block-tokens", "32")
    assert r.exit_code == 1 and "--prefix-block-tokens sizes the hashes --shared-prefix-tokens" in str(r.exception)
    assert no_files_like(tmp_path, "x.arrow")


def test_agentic_synth_prefix_block_tokens_zero_is_refused_like_negative(tmp_path):
    for value in ("0", "-3"):
        r = run("trace", "synth", "--shape", "react", "--tasks", "5", "--prefix-block-tokens", value,
                "-o", tmp_path / "r.arrow")
        assert r.exit_code == 1 and f"prefix block tokens must be >= 1 (got {value})" in str(r.exception)
    assert no_files_like(tmp_path, "r.arrow")


def test_transform_sample_integer_is_a_count_and_decimal_a_fraction(tmp_path):
    src = tmp_path / "s.arrow"
    ok("trace", "synth", "-n", "40", "-o", src)
    cases = {"1.0": 40, "1": 1, "0.25": 10, "25": 25, "1e0": 40}
    for text, rows in cases.items():
        ok("trace", "transform", src, "-o", tmp_path / "x.arrow", "--sample", text)
        assert read_trace(tmp_path / "x.arrow").num_rows == rows, text
    for text, rule in {"0": "sample needs n >= 1", "0.0": "sample fraction must be in (0, 1]",
                       "2.5": "sample fraction must be in (0, 1]", "abc": "bad --sample 'abc'"}.items():
        r = run("trace", "transform", src, "-o", tmp_path / "y.arrow", "--sample", text)
        assert r.exit_code == 1 and rule in str(r.exception), (text, r.exception)


@pytest.mark.parametrize("args,message", [
    (["trace", "import", "--format", "azure", FIXTURES / "azure_2024_form.csv", "--shared-prefix-tokens", "-5"],
     "--shared-prefix-tokens must be >= 0 (got -5)"),
    (["trace", "import", "--format", "azure", FIXTURES / "azure_2024_form.csv", "--prompt-pool", "-1"],
     "--prompt-pool must be >= 0 (got -1)"),
    (["trace", "synth", "-n", "10", "--output-len", "fixed:abc"], "bad length spec 'fixed:abc': 'abc' is not a number"),
    (["trace", "transform", "TRACE", "--window", "100"],
     "bad --window '100' (use START_S:END_S, either side may be empty: '100:' from 100 s on, ':100' up to 100 s)"),
])  # fmt: skip
def test_option_errors_are_plain_sentences(tmp_path, args, message):
    ok("trace", "synth", "-n", "5", "-o", tmp_path / "t.arrow")
    args = [tmp_path / "t.arrow" if a == "TRACE" else a for a in args]
    r = run(*args, "-o", tmp_path / "x.arrow")
    assert r.exit_code == 1 and str(r.exception) == message
    assert no_files_like(tmp_path, "x.arrow")


def test_info_rounds_float_noise_for_display(tmp_path):
    from servelab.cli.trace_cmd import _fmt

    src = tmp_path / "c.arrow"
    ok("trace", "synth", "-n", "1000", "--rate", "7", "--arrival", "constant", "-o", src)
    row = next(line for line in ok("trace", "info", src).output.splitlines() if "inter-arrival CV" in line)
    assert row.split("│")[2].strip() == "0"
    assert _fmt(3481.9999999) == "3,482" and _fmt(3481.96) == "3,482" and _fmt(3481.5) == "3,481.5"
    assert _fmt(12.25) == "12.250" and _fmt(13.0) == "13" and _fmt(0.0004) == "0.0004"


def test_blank_lines_in_a_csv_are_skipped_and_rows_keep_their_numbers(tmp_path):
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    src = tmp_path / "b.csv"
    src.write_text(head + "2023-11-16 18:15:46.68,5,5\n\n2023-11-16 18:15:47.68,6,5\n\n")
    ok("trace", "import", "--format", "azure", src, "-o", tmp_path / "b.arrow")
    assert read_trace(tmp_path / "b.arrow").column("prompt_tokens").to_pylist() == [5, 6]
    src.write_text(head + "2023-11-16 18:15:46.68,5,5\n\n2023-11-16 18:15:47.68,x,5\n")
    r = run("trace", "import", "--format", "azure", src, "-o", tmp_path / "c.arrow")
    assert str(r.exception) == f"{src}, column 'ContextTokens', row 3: not an integer: 'x'"  # line 4 of the file
    src.write_text(head + "\n\n")
    assert str(run("trace", "import", "--format", "azure", src, "-o", tmp_path / "c.arrow").exception) == \
        f"{src}: file has no data rows"


@pytest.mark.parametrize("args,message", [
    (["--arrival", "poisson", "--cv", "3"],
     "--cv does not apply to --arrival poisson (its gaps have CV 1); it needs --arrival gamma or weibull"),
    (["--arrival", "constant", "--cv", "3"], "--cv does not apply to --arrival constant (its gaps have CV 0)"),
    (["--cv", "3"], "--cv does not apply to --arrival poisson"),
    (["--schedule", "0:2,10:3"], "--schedule needs --profile piecewise (the profile is flat)"),
    (["--burst-on-s", "5"], "--burst-on-s needs --profile onoff (the profile is flat)"),
    (["--profile", "diurnal", "--burst-off-s", "5"], "--burst-off-s needs --profile onoff (the profile is diurnal)"),
    (["--diurnal-amplitude", "0.3"], "--diurnal-amplitude needs --profile diurnal"),
    (["--profile", "onoff", "--diurnal-period-s", "60"], "--diurnal-period-s needs --profile diurnal"),
    (["--profile", "piecewise", "--schedule", "0:2", "--rate", "5"], "--rate does not apply to --profile piecewise"),
    (["--prefix-groups", "4"], "--prefix-groups needs --shared-prefix-tokens"),
    (["--lengths-from", FIXTURES / "sharegpt_lengths_head300.csv", "--prompt", "100"],
     "--prompt does not apply with --lengths-from (the file gives the lengths)"),
    (["--lengths-from", FIXTURES / "sharegpt_lengths_head300.csv", "--output-len", "9"], "--output-len does not apply"),
    (["--shape", "react", "--tasks", "3", "--cv", "2"], "--cv does not apply to --arrival poisson"),
])  # fmt: skip
def test_synth_refuses_options_it_would_ignore(tmp_path, args, message):
    r = run("trace", "synth", *(["-n", "50"] if "--shape" not in args else []), *args, "-o", tmp_path / "x.arrow")
    assert r.exit_code == 1 and isinstance(r.exception, ServelabError), r.output
    assert message in str(r.exception)
    assert no_files_like(tmp_path, "x.arrow")


def test_synth_still_takes_each_option_where_it_applies(tmp_path):
    for args in (["--arrival", "gamma", "--cv", "3"], ["--arrival", "weibull", "--cv", "0.5"],
                 ["--profile", "piecewise", "--schedule", "0:2,10:3"], ["--profile", "onoff", "--burst-on-s", "5"],
                 ["--profile", "diurnal", "--diurnal-amplitude", "0.3", "--diurnal-period-s", "60"],
                 ["--shared-prefix-tokens", "64", "--prefix-groups", "4"], ["--rate", "3", "--arrival", "constant"]):
        ok("trace", "synth", "-n", "50", *args, "-o", tmp_path / "x.arrow")


def test_lengths_import_refuses_an_arrival_option_it_would_ignore(tmp_path):
    r = run("trace", "import", "--format", "lengths", FIXTURES / "sharegpt_lengths_head300.csv", "--cv", "3",
            "-o", tmp_path / "x.arrow")
    assert r.exit_code == 1 and "--cv does not apply to --arrival poisson" in str(r.exception)
    assert no_files_like(tmp_path, "x.arrow")
