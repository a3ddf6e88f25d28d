"""`servelab replay`, `demo` and `policies` through the CLI: options, config files, errors."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from click.testing import CliRunner

from servelab.cli.main import cli, main
from helpers_cli import write_small_trace as write

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.001"




def test_replay_writes_a_run_and_reports(tmp_path):
    trace = write(tmp_path)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["replay", str(trace), "-o", str(out), "--runner", RUNNER,
                                      "--num-gpu-blocks", "200", "--policy", "srpt",
                                      "--policy-param", "preempt=true", "--slo", "ttft=1,tpot=0.1"])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "requests.parquet").num_rows == 20
    meta = json.loads((out / "run.json").read_text())
    assert meta["policy"] == {"name": "srpt", "params": {"preempt": True, "noise_sigma": 0.0}}
    assert meta["counts"]["finished"] == 20
    assert "attainment" in result.output.lower()


def test_config_file_and_command_line_precedence(tmp_path):
    trace = write(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(f'policy = "round-robin"\nrunner = "{RUNNER}"\nnum_gpu_blocks = 100\nmax_num_seqs = 2\n'
                      '[policy_params]\nquantum = 3\n')
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["replay", str(trace), "-o", str(out), "--config", str(config),
                                      "--max-num-seqs", "4", "--no-report"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "run.json").read_text())
    assert meta["engine"]["max_num_seqs"] == 4  # the command line wins
    assert meta["engine"]["num_gpu_blocks"] == 100  # the file wins over the default
    assert meta["policy"]["params"] == {"quantum": 3}


def test_bad_option_is_one_clear_line_and_nothing_written(tmp_path, capsys):
    trace = write(tmp_path)
    out = tmp_path / "run"
    try:
        main(["replay", str(trace), "-o", str(out), "--runner", RUNNER, "--num-gpu-blocks", "100",
              "--preemption", "evict"])
    except SystemExit as exit_:
        assert exit_.code == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: preemption must be one of recompute, swap; got 'evict'"
    assert not out.exists()


def test_unknown_config_key_names_the_file(tmp_path, capsys):
    trace = write(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text("max_seqs = 3\n")
    try:
        main(["replay", str(trace), "--config", str(config)])
    except SystemExit as exit_:
        assert exit_.code == 1
    assert f"{config}: unknown key 'max_seqs'" in capsys.readouterr().err


def test_demo_replays_the_bundled_trace(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["demo", "-o", str(out), "--replicas", "2"])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "requests.parquet").num_rows == 19_366
    assert "19366 finished" in result.output


def test_policies_lists_every_policy_with_parameters():
    result = CliRunner().invoke(cli, ["policies"])
    assert result.exit_code == 0
    for name in ("static", "orca", "vllm-v0", "sarathi", "sjf", "srpt", "round-robin"):
        assert name in result.output
    assert "long_prefill_threshold=0" in result.output
