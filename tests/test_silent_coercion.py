"""Values that used to be coerced or passed silently are refused with the option's name; names from
the data reach the terminal escaped; `query --read-only` is capped (#26 item 20)."""

from __future__ import annotations

import re

import pytest

from servelab.common.errors import ServelabError
from servelab.replay.config import EngineConfig
from servelab.traces.io import write_trace
from servelab.traces.synth import synth_trace
from helpers_cli import cli_code


_cli = cli_code


@pytest.mark.parametrize("kwargs, says", [
    ({"num_gpu_blocks": 3_000_000_000}, "num_gpu_blocks = 3,000,000,000 is too large (at most 2,147,483,647)"),
    ({"max_num_seqs": 2**31}, "max_num_seqs = 2,147,483,648 is too large"),
    ({"kv_bytes_per_token": -5}, "kv_bytes_per_token must be >= 1, got -5"),
])  # fmt: skip
def test_engine_values_an_int32_column_cannot_hold_or_negative_sizes_are_refused(kwargs, says):
    """num_gpu_blocks = 3e9 used to be written as kv_blocks_total -2147483648 (wrapped)."""
    with pytest.raises(ServelabError, match=re.escape(says)):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("args, says", [
    (["trace", "synth", "-n", "5", "--tiers", "priority=2"], "--tiers: the fraction of 'priority' is 2"),
    (["trace", "synth", "-n", "5", "--tiers", "priority=0.1,standard=0.6"], "--tiers: fractions sum to 0.7, not 1"),
    (["replay", "{trace}", "--kv-bytes-per-token", "-5"], "kv_bytes_per_token must be >= 1"),
])  # fmt: skip
def test_cli_values_are_refused_with_the_option(tmp_path, capsys, args, says):
    trace = write_trace(synth_trace(n=5, rate=1.0, seed=0), tmp_path / "t.arrow", "synth")
    assert _cli(*[a.format(trace=trace) for a in args], "-o", tmp_path / "out.arrow") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err
    assert not (tmp_path / "out.arrow").exists()


def test_tier_fractions_that_sum_to_one_still_work(tmp_path):
    assert _cli("trace", "synth", "-n", "20", "--tiers", "priority=0.1,standard=0.9", "-o", tmp_path / "t.arrow") == 0


def test_control_characters_in_tenant_names_are_escaped_in_printed_tables(tmp_path, capsys):
    from servelab.common.tables import escape_controls

    evil = "evil\x1b]0;owned\x07\x1b[31mred"
    trace = write_trace(synth_trace(n=10, rate=1.0, tenants={evil: 1, "ok": 1}, seed=0), tmp_path / "t.arrow", "synth")
    assert _cli("trace", "info", trace) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b]0;owned\\x07\\x1b[31mred" in out
    assert escape_controls("a\tb\nc\x9b") == "a\\x09b\nc\\x9b"  # the newline stays: a cell may hold lines


def test_read_only_query_is_capped_in_memory_disk_threads_and_time(tmp_path, capsys):
    from servelab.api import replay, write_run
    from servelab.replay.config import ReplayConfig

    run = write_run(replay(synth_trace(n=20, rate=5.0, seed=0), ReplayConfig(
        runner="linear:base=0.01", engine=EngineConfig(num_gpu_blocks=1000))), tmp_path / "run")  # fmt: skip
    sql = ("SELECT current_setting('memory_limit') AS m, current_setting('max_temp_directory_size') AS t, "
           "current_setting('threads') AS th")
    assert _cli("query", run, "--read-only", "--memory-limit", "512MB", "--max-temp-size", "1GB", "--threads", "1",
                sql, "--format", "csv") == 0  # fmt: skip
    assert capsys.readouterr().out.strip().splitlines()[1] == '"488.2 MiB","953.6 MiB",1'
    assert _cli("query", run, "--read-only", "--timeout-s", "0.5", "SELECT count(*) FROM range(100000000000)") == 1
    assert capsys.readouterr().err.strip() == "error: query stopped after 0.5 s (--timeout-s)"
    assert _cli("query", run, "--read-only", "SET memory_limit = '100GB'") == 1  # locked: the SQL cannot lift them
    assert "locked" in capsys.readouterr().err


def test_control_characters_in_tenant_names_are_escaped_in_the_reports_prose(tmp_path, capsys):
    evil = "evil\x1b[31mred"
    trace = write_trace(synth_trace(n=40, rate=20.0, tenants={evil: 3, evil + "2": 1}, seed=0), tmp_path / "t.arrow", "synth")
    assert _cli("replay", trace, "-o", tmp_path / "run", "--no-report", "--runner", "linear:base=0.02", "--num-gpu-blocks", "1000") == 0
    capsys.readouterr()
    assert _cli("report", tmp_path / "run", "--slo", "ttft=50ms") == 0
    out = capsys.readouterr().out
    assert "worst tenant evil\\x1b[31mred" in out and "\x1b" not in out, out


def test_query_limits_without_read_only_are_refused_not_ignored(tmp_path, capsys):
    from servelab.api import replay, write_run
    from servelab.replay.config import ReplayConfig

    run = write_run(replay(synth_trace(n=5, rate=5.0, seed=0), ReplayConfig(
        runner="linear:base=0.01", engine=EngineConfig(num_gpu_blocks=1000))), tmp_path / "run")  # fmt: skip
    assert _cli("query", run, "--timeout-s", "5", "SELECT 1") == 2
    assert "--timeout-s limits a --read-only query: add --read-only" in capsys.readouterr().err
    assert _cli("query", run, "SELECT 1") == 0
