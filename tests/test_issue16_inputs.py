"""Issue 16, items 8 (policy parameters, prefix_hashes metadata) and 11 (errors that leaked
tracebacks): every bad input gives one line naming the file (column, row) and exit 1; nothing
half-written is left behind."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_traces import assert_input_error, good_table

from servelab.cli.main import main
from servelab.common.errors import InputError, ServelabError
from servelab.policies.base import make_policy
from servelab.replay.config import EngineConfig
from servelab.traces.io import read_trace, write_trace


def cli(argv, capsys) -> tuple[int, str, str]:
    """Run the real entry point (its error handling included): exit code, stdout, stderr."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str, *needles: str, progress: bool = False) -> None:
    """Exit 1 and one `error:` line (``progress``: after the command's own "replaying ..." line)."""
    assert code == 1, err
    lines = err.strip().splitlines()
    if progress:
        lines = [ln for ln in lines if not ln.startswith("replaying ")]
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
        make_policy(policy, params, EngineConfig())


def test_every_policy_accepts_its_defaults():
    from servelab.policies.base import policy_names

    for name in policy_names():
        make_policy(name, {}, EngineConfig())


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
