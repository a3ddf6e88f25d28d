"""`servelab replay` checks names before any work and suggests the nearest one; `--slo` is
reported with or without -o (issue 16, item 13)."""

from __future__ import annotations

import pytest

from servelab.common.errors import ServelabError
from servelab.common.registry import Registry, did_you_mean
from helpers_cli import run_main as run
from helpers_cli import write_small_trace as write

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.001"


def test_registry_suggests_the_nearest_name():
    reg = Registry("policy")
    for name in ("sarathi", "srpt", "least-outstanding"):
        reg.register(name)(object())
    with pytest.raises(ServelabError, match=r"^unknown policy 'sarath'; did you mean 'sarathi'\? \(known: "):
        reg.get("sarath")
    with pytest.raises(ServelabError, match=r"did you mean 'least-outstanding'\?"):
        reg.get("least")  # a unique prefix
    with pytest.raises(ServelabError) as err:
        reg.get("zzzz")
    assert "did you mean" not in str(err.value)
    assert did_you_mean("SRPT", ["sarathi", "srpt"]) == "; did you mean 'srpt'?"


def test_a_name_several_presets_start_with_suggests_one_of_those():
    """'h100' is a prefix of two GPU presets: the suggestion is the first of them, not the nearer-spelt h200."""
    from servelab.runners.presets import GPUS, get_gpu

    assert did_you_mean("h100", GPUS) == "; did you mean 'h100-80gb'?"
    assert did_you_mean("h100-p", GPUS) == "; did you mean 'h100-pcie'?"
    with pytest.raises(ServelabError, match=r"unknown GPU preset 'h100'; did you mean 'h100-80gb'\?"):
        get_gpu("h100")
    assert did_you_mean("h201", GPUS) == "; did you mean 'h200'?"  # no prefix: the nearest as before


@pytest.mark.parametrize("args, message", [
    (["--policy", "sarath"], "error: unknown policy 'sarath'; did you mean 'sarathi'?"),
    (["--runner", "roofln"], "error: unknown runner 'roofln'; did you mean 'roofline'?"),
    (["--router", "least-out"], "did you mean 'least-outstanding'?"),  # (least-kv shares "least")
    (["--runner", RUNNER, "--policy-param", "long_prefill_treshold=4"],
     "unknown parameter 'long_prefill_treshold'; did you mean 'long_prefill_threshold'?"),
    (["--runner", RUNNER, "--policy", "srpt", "--policy-param", "preempt=maybe"], "preempt: expected bool"),
    (["--model", "lama-3.1-8b"], "unknown model preset 'lama-3.1-8b'; did you mean 'llama-3.1-8b'?"),
    (["--runner", RUNNER], "set num_gpu_blocks"),  # the KV size cannot be derived
    (["--slo", "tpt=0.1"], "unknown SLO field 'tpt'; did you mean 'tpot'?"),
])
def test_bad_names_fail_first_with_one_line_and_a_suggestion(tmp_path, capsys, args, message):
    """Checked before the trace is read (it does not even exist here) and before anything is printed."""
    code, out, err = run(["replay", str(tmp_path / "missing.arrow"), "-o", str(tmp_path / "run"), *args], capsys)
    assert code == 1
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert "replaying" not in err and "file not found" not in err
    assert not (tmp_path / "run").exists()


def test_slo_without_out_dir_is_reported(tmp_path, capsys):
    trace = write(tmp_path)
    code, out, err = run(["replay", str(trace), "--runner", RUNNER, "--num-gpu-blocks", "200",
                          "--slo", "ttft=1ms,tpot=0.1"], capsys)
    assert code == 0, err
    assert "SLO: global: ttft_s=0.001, tpot_s=0.1" in out
    assert "attainment" in out
    assert "not saved: add -o RUN_DIR to keep it" in out
    assert list(tmp_path.iterdir()) == [trace]  # nothing written beside the trace


def test_slo_table_of_a_replay_config_file_is_used_and_checked(tmp_path, capsys):
    trace = write(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(f'runner = "{RUNNER}"\nnum_gpu_blocks = 200\n[slo]\nttft_s = 0.5\n')
    code, out, err = run(["replay", str(trace), "--config", str(config)], capsys)
    assert code == 0, err
    assert "SLO: global: ttft_s=0.5" in out
    code, out, err = run(["replay", str(trace), "--config", str(config), "--slo", "tpot=0.2"], capsys)
    assert "SLO: global: ttft_s=0.5, tpot_s=0.2" in out  # the flags add to (and override) the file
    config.write_text(f'runner = "{RUNNER}"\nnum_gpu_blocks = 200\n[slo]\ntpt_s = 0.5\n')
    code, out, err = run(["replay", str(trace), "--config", str(config)], capsys)
    assert code == 1 and out == ""
    assert "unknown SLO field; did you mean 'tpot_s'?" in err and "replaying" not in err
