"""Issue 16, items 8 (policy parameters, prefix_hashes metadata) and 11 (errors that leaked
tracebacks): every bad input gives one line naming the file (column, row) and exit 1; nothing
half-written is left behind."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_traces import FIXTURES, assert_input_error, good_table, no_files_like

from servelab.common.errors import InputError, ServelabError
from servelab.common.textfile import read_text
from servelab.policies.base import make_policy
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.traces.importers import import_trace
from servelab.traces.info import trace_info
from servelab.traces.io import read_trace, write_trace
from helpers_cli import run_main as cli




def one_line_error(code: int, err: str, *needles: str, progress: bool = False) -> None:
    """Exit 1 and one `error:` line (``progress``: after the command's own "replaying ..."/"search ..." lines)."""
    assert code == 1, err
    lines = err.strip().splitlines()
    if progress:
        lines = [ln for ln in lines if not ln.startswith(("replaying ", "simulated ", "search '"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def small_trace(tmp_path, trace_factory):
    return write_trace(trace_factory([0.0, 0.5, 1.0], [64, 80, 96], [4, 5, 6]), tmp_path / "small.arrow", "test")


# ---------------------------------------------------------------- item 8: policy parameters


@pytest.mark.parametrize("policy, params, rule", [
    ("sarathi", {"long_prefill_threshold": "-5"}, "long_prefill_threshold must be >= 0"),
    ("srpt", {"noise_sigma": "-0.5"}, "noise_sigma must be >= 0"),
    ("sjf", {"noise_sigma": -1}, "noise_sigma must be >= 0"),
])  # fmt: skip
def test_out_of_range_policy_params_are_refused(policy, params, rule):
    with pytest.raises(ServelabError, match=rule):
        ReplayConfig(policy=policy, policy_params=params)


def test_every_policy_accepts_its_defaults():
    from servelab.policies.base import policy_names

    for name in policy_names():
        make_policy(name, ReplayConfig(policy=name, policy_params={}).policy_params, EngineConfig())
        make_policy(name, None, EngineConfig())


def test_negative_long_prefill_threshold_on_the_command_line(small_trace, tmp_path, capsys):
    code, _, err = cli(["replay", small_trace, "--policy-param", "long_prefill_threshold=-5",
                        "-o", tmp_path / "run"], capsys)  # fmt: skip
    one_line_error(code, err, "policy 'sarathi'", "long_prefill_threshold must be >= 0", "-5", progress=True)
    assert "priced a step" not in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- item 8: prefix_hashes metadata


def _with_hashes(meta: dict | None) -> pa.Table:
    t = good_table(3).append_column("prefix_hashes", pa.array([[1], [1, 2], [3]], pa.list_(pa.int64())))
    return t.replace_schema_metadata(meta)


@pytest.mark.parametrize("meta, rule", [
    (None, "needs the file metadata key 'prefix_block_tokens'"),
    ({"prefix_block_tokens": "abc"}, "must be a whole number >= 1, got 'abc'"),
    ({"prefix_block_tokens": "0"}, "must be a whole number >= 1, got '0'"),
])  # fmt: skip
def test_prefix_hashes_need_block_tokens_metadata(tmp_path, meta, rule, capsys):
    path = tmp_path / "h.parquet"
    pq.write_table(_with_hashes(meta), path)
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, rule, "prefix_hashes")
    code, _, stderr = cli(["trace", "info", path], capsys)
    one_line_error(code, stderr, str(path), "column 'prefix_hashes'")


def test_prefix_hashes_with_block_tokens_still_load(tmp_path):
    path = tmp_path / "h.parquet"
    pq.write_table(_with_hashes({"prefix_block_tokens": "16"}), path)
    assert read_trace(path).column("prefix_hashes").to_pylist() == [[1], [1, 2], [3]]
    with pytest.raises(InputError) as err:
        write_trace(_with_hashes(None), tmp_path / "o.arrow", "test")
    assert_input_error(err, tmp_path / "o.arrow", "needs the file metadata key 'prefix_block_tokens'", "prefix_hashes")


# ---------------------------------------------------------------- item 11: unwritable outputs

PROC = "/proc/servelab-test-no-such"  # /proc takes no new files: creating one fails


@pytest.fixture
def a_run(tmp_path):
    from helpers_scoring import req, step, write_run

    return write_run(tmp_path / "run", [req(1, first_token=0.5, finish=1.0)], [step(0.0, 1.0)], meta={"run_id": "run"})


def _commands(small_trace, a_run):
    azure = FIXTURES / "azure_conv_2023_head300.csv"
    return {
        "trace import": lambda out: ["trace", "import", "--format", "azure", azure, "-o", f"{out}.arrow"],
        "trace synth": lambda out: ["trace", "synth", "-n", "5", "-o", f"{out}.arrow"],
        "trace transform": lambda out: ["trace", "transform", small_trace, "--head", "2", "-o", f"{out}.arrow"],
        "replay": lambda out: ["replay", small_trace, "--no-report", "-o", out],
        "sweep": lambda out: ["sweep", small_trace, "--rates", "1", "-o", out],
        "query -o": lambda out: ["query", a_run, "select 1 as x", "-o", f"{out}.csv"],
        "report -o": lambda out: ["report", a_run, "-o", f"{out}.txt"],
        "runs collect": lambda out: ["runs", "collect", a_run, "-o", f"{out}.duckdb"],
    }


@pytest.mark.parametrize("command", ["trace import", "trace synth", "trace transform", "replay", "sweep", "query -o",
                                     "report -o", "runs collect"])  # fmt: skip
def test_output_under_a_file_is_one_line(command, small_trace, a_run, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder\n")
    argv = _commands(small_trace, a_run)[command](blocker / "out")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = cli(argv, capsys)
    one_line_error(code, err, str(blocker / "out"), "is a file, not a folder", progress=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and blocker.read_text() == "not a folder\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("command", ["trace import", "trace synth", "trace transform", "replay", "sweep", "query -o",
                                     "report -o", "runs collect"])  # fmt: skip
def test_output_in_proc_is_one_line(command, small_trace, a_run, capsys):
    argv = _commands(small_trace, a_run)[command](PROC)
    code, _, err = cli(argv, capsys)
    one_line_error(code, err, PROC, "cannot write it", progress=True)


def test_plot_into_proc_is_one_line(a_run, capsys):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    code, _, err = cli(["plot", a_run, "-o", PROC], capsys)
    one_line_error(code, err, PROC)


# ---------------------------------------------------------------- item 11: bad input files


def test_non_utf8_azure_csv_names_row_and_column(tmp_path, capsys):
    src = tmp_path / "az.csv"
    src.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    b"2023-11-16 18:15:47.6805900,3\xff4,44\n")  # fmt: skip
    with pytest.raises(InputError) as err:
        import_trace("azure", [src])
    assert_input_error(err, src, "not UTF-8 text (byte 0xff)", "ContextTokens", 2)
    code, _, stderr = cli(["trace", "import", "--format", "azure", src, "-o", tmp_path / "o.arrow"], capsys)
    one_line_error(code, stderr, f"{src}, column 'ContextTokens', row 2")
    assert no_files_like(tmp_path, "o.arrow")


def test_non_utf8_first_timestamp_is_reported_too(tmp_path):
    src = tmp_path / "az.csv"
    src.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68\xff,374,44\n")
    with pytest.raises(InputError) as err:
        import_trace("azure", [src])
    assert_input_error(err, src, "not UTF-8 text", "TIMESTAMP", 1)


MOONCAKE_OK = b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("line, column, rule", [
    (b'{"timestamp": 5, "input_length": 12, "output_length": 3, "hash_ids": [1], "note": "\xff"}\n', None,
     "not UTF-8 text (byte 0xff)"),
    (b'{"timestamp": 5, "input_length": 12, "output_length": 3, "hash_ids": [1, 99999999999999999999]}\n',
     "hash_ids", "block id 99999999999999999999 is outside the signed 64-bit range (-2^63 .. 2^63 - 1)"),
    (b'{"timestamp": 5, "input_length": 1099511627776, "output_length": 3, "hash_ids": [1]}\n', "input_length",
     "token count too large (got 1099511627776"),
])  # fmt: skip
def test_bad_mooncake_line_is_named(tmp_path, line, column, rule, capsys):
    src = tmp_path / "m.jsonl"
    src.write_bytes(MOONCAKE_OK * 2 + line)
    with pytest.raises(InputError) as err:
        import_trace("mooncake", [src])
    assert_input_error(err, src, rule, column, 3)
    code, _, stderr = cli(["trace", "import", "--format", "mooncake", src, "-o", tmp_path / "o.arrow"], capsys)
    one_line_error(code, stderr, str(src), "row 3")
    assert no_files_like(tmp_path, "o.arrow")


def test_token_count_of_2_pow_40_in_a_csv_is_not_wrapped(tmp_path):
    src = tmp_path / "az.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:47.6805900,1099511627776,44\n")  # fmt: skip
    with pytest.raises(InputError) as err:
        import_trace("azure", [src])
    assert_input_error(err, src, "token count too large (got 1099511627776, at most 2,147,483,647)", "ContextTokens", 2)


@pytest.mark.parametrize("column, values, typ, rule", [
    ("prompt_tokens", [5, 2**40, 7], pa.int64(), "value 1099511627776 is too large (the column is int32"),
    ("output_tokens", [5, 6, 2**31], pa.int64(), "value 2147483648 is too large (the column is int32"),
    ("request_id", [0, 1, 2**64 - 1], pa.uint64(), "is too large (the column is int64"),
])  # fmt: skip
def test_trace_integers_too_large_for_their_column(tmp_path, column, values, typ, rule, capsys):
    t = good_table(3)
    t = t.set_column(t.column_names.index(column), column, pa.array(values, typ))
    path = tmp_path / "t.parquet"
    pq.write_table(t, path)
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, rule, column, values.index(max(values)) + 1)
    for argv in (["trace", "info", path], ["replay", path], ["trace", "transform", path, "--head", "1", "-o",
                                                            tmp_path / "o.arrow"]):  # fmt: skip
        code, _, stderr = cli(argv, capsys)
        one_line_error(code, stderr, f"column '{column}'", progress=True)


def test_uint64_prefix_hash_beyond_int64_names_its_row(tmp_path):
    t = good_table(3).append_column("prefix_hashes", pa.array([[1], [2], [3, 2**64 - 1]], pa.list_(pa.uint64())))
    path = tmp_path / "t.parquet"
    pq.write_table(t.replace_schema_metadata({"prefix_block_tokens": "16"}), path)
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "block id 18446744073709551615 does not fit in int64", "prefix_hashes", 3)


def test_trace_info_over_a_span_of_1e12_seconds(tmp_path, trace_factory, capsys):
    table = trace_factory([0.0, 0.2, 0.4, 1e12], [5, 6, 7, 8], [1, 2, 3, 4])
    info = trace_info(table)  # the statistics themselves hold at any span
    assert info["peak_1s_rate_per_s"] == 3 and info["span_s"] == 1e12
    assert trace_info(trace_factory([0.0, 1e19], [5, 6], [1, 2]))["peak_1s_rate_per_s"] == 1
    # a trace file whose arrivals are beyond 2**32 s (nanoseconds or milliseconds given as seconds?) is
    # refused on reading, with its row, rather than replayed at float64's coarse resolution there
    with pytest.raises(InputError, match="row 4: arrival 1e\\+12 s is too large"):
        write_trace(table, tmp_path / "w.arrow", "x")
    import pyarrow.feather as feather

    path = tmp_path / "t.arrow"
    feather.write_feather(table, path)
    code, out, err = cli(["trace", "info", path, "--json"], capsys)
    assert code == 1 and err.count("\n") == 1 and "column 'arrival_s', row 4: arrival 1e+12 s is too large" in err


def test_binary_config_fitted_model_spec_and_slo_file(small_trace, tmp_path, capsys):
    blob = tmp_path / "blob.toml"
    blob.write_bytes(b"\x00\xfc\xff" * 100 + b"\n\x89PNG")
    rule = "not a text file: byte 0xfc on line 1 is not UTF-8"
    for argv in (["replay", small_trace, "--config", blob], ["replay", small_trace, "--runner", f"fitted:{blob}"],
                 ["sweep", small_trace, "--rates", "1", "--config", blob, "-o", tmp_path / "sw"],
                 ["search", blob, "-o", tmp_path / "study", "--no-progress"], ["search", "worker", blob],
                 ["report", small_trace, "--slo-file", blob]):  # fmt: skip
        code, _, err = cli(argv, capsys)
        one_line_error(code, err, f"{blob}: {rule}", progress=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.toml", "small.arrow"]


def test_unreachable_storage_leaves_nothing_behind(tmp_path, capsys):
    from helpers_search import grid_spec

    spec = grid_spec(tmp_path, n_trials=1, top='storage = "sqlite:////proc/servelab-no-such/db.sqlite"\n')
    for argv in (["search", spec, "-o", tmp_path / "S" / "deep", "--no-progress"], ["search", "worker", spec, "-o",
                                                                                    tmp_path / "W"]):  # fmt: skip
        code, _, err = cli(argv, capsys)
        one_line_error(code, err, "cannot open storage sqlite:////proc/servelab-no-such/db.sqlite", progress=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.toml", "trace.arrow"]


# ---------------------------------------------------------------- item 11: usage errors, folders


@pytest.mark.parametrize("argv, message, where", [
    (["trace", "info", "--bogus"], "No such option '--bogus'", "servelab trace info --help"),
    (["replay"], "Missing argument 'TRACE'", "servelab replay --help"),
    (["replay", "x.arrow", "--policy-param"], "'--policy-param' requires an argument", "servelab replay --help"),
    (["trace", "import", "--format", "nope", "x", "-o", "y"], "Invalid value for '--format'",
     "servelab trace import --help"),
    (["runs", "collect", "--bad"], "No such option '--bad'", "servelab runs collect --help"),
    (["nosuchcommand"], "No such command 'nosuchcommand'", "servelab --help"),
])  # fmt: skip
def test_usage_errors_are_one_line_with_exit_2(argv, message, where, capsys):
    code, out, err = cli(argv, capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert lines[0].endswith(f"(see '{where}')")


def test_a_folder_given_as_a_trace_or_source(tmp_path, capsys):
    folder = tmp_path / "looks_like.arrow"
    folder.mkdir()
    with pytest.raises(InputError, match="is a folder, not a trace file"):
        read_trace(folder)
    code, _, err = cli(["trace", "info", folder], capsys)
    one_line_error(code, err, f"{folder}: is a folder, not a trace file")
    for fmt in ("azure", "mooncake", "burstgpt", "vidur", "lengths"):
        code, _, err = cli(["trace", "import", "--format", fmt, tmp_path, "-o", tmp_path / "o.arrow"], capsys)
        one_line_error(code, err, f"{tmp_path}: is a folder, not a file")
    with pytest.raises(InputError, match="is a folder, not a file"):
        read_text(folder)


@pytest.mark.parametrize("name, tail", [("chunk-9-trace.csv", b"0,1.0,1.0,Gam\xffma,1,1\n"),
                                        ("chunk-9-dataset.json", b"\xff")])  # fmt: skip
def test_non_utf8_servegen_files_name_their_line(tmp_path, name, tail):
    import shutil

    folder = tmp_path / "sg"
    shutil.copytree(FIXTURES / "servegen" / "mm-image", folder)
    path = folder / name
    path.chmod(0o644)
    lines = path.read_bytes().count(b"\n")
    with open(path, "ab") as f:
        f.write(tail)
    with pytest.raises(InputError) as err:
        import_trace("servegen", [folder], duration_s=86400)
    assert_input_error(err, path, f"not a text file: byte 0xff on line {lines + 1} is not UTF-8")
