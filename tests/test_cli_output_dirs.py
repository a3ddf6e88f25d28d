"""`replay`, `demo` and `sweep` check every option before any work, and replace an existing result only with --force."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from servelab.traces.io import trace_sha256
from helpers_cli import run_main as run
from helpers_cli import snapshot as _snapshot
from helpers_cli import write_small_trace

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.001"
REPLAY = ["--runner", RUNNER, "--num-gpu-blocks", "200"]




def test_bad_slo_fails_before_replaying_and_keeps_the_old_run(small_trace_file, tmp_path, capsys):
    out = tmp_path / "R"
    assert run(["replay", small_trace_file, "-o", out, *REPLAY, "--no-report"], capsys)[0] == 0
    before = _snapshot(out)
    for extra in ([], ["--force"], ["--no-report"], ["--no-report", "--force"]):
        code, _, err = run(["replay", small_trace_file, "-o", out, *REPLAY, "--slo", "garbage", *extra], capsys)
        assert code == 1 and err.strip() == "error: --slo 'garbage': 'garbage' is not key=value", err
        assert "replaying" not in err  # nothing was replayed
        assert _snapshot(out) == before
    code, _, err = run(["replay", small_trace_file, *REPLAY, "--no-report", "--slo", "ttft=oops"], capsys)  # no -o, no report
    assert code == 1 and "--slo" in err and "replaying" not in err


def test_existing_run_is_replaced_only_with_force(small_trace_file, tmp_path, capsys):
    out = tmp_path / "R"
    assert run(["replay", small_trace_file, "-o", out, *REPLAY, "--no-report", "--max-num-seqs", "2"], capsys)[0] == 0
    before = _snapshot(out)
    code, _, err = run(["replay", small_trace_file, "-o", out, *REPLAY, "--no-report"], capsys)
    assert code == 1 and err.strip() == f"error: {out}: a run directory is already there; add --force to replace it"
    assert _snapshot(out) == before
    assert run(["replay", small_trace_file, "-o", out, *REPLAY, "--no-report", "--force"], capsys)[0] == 0
    assert json.loads((out / "run.json").read_text())["engine"]["max_num_seqs"] != 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    # an empty directory is simply written
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(["replay", small_trace_file, "-o", empty, *REPLAY, "--no-report"], capsys)[0] == 0
    assert pq.read_table(empty / "requests.parquet").num_rows == 20


def test_a_directory_that_is_not_a_run_is_never_replaced(small_trace_file, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    code, _, err = run(["replay", small_trace_file, "-o", other, *REPLAY, "--no-report", "--force"], capsys)
    assert code == 1 and "is not a run directory" in err and "replaying" not in err
    assert (other / "todo.txt").read_text() == "keep me"


def test_sweep_needs_force_to_replace_a_sweep(small_trace_file, tmp_path, capsys):
    out = tmp_path / "S"
    args = ["sweep", small_trace_file, "--rates", "5,10", *REPLAY, "--slo", "ttft=1", "-o", out]
    assert run(args, capsys)[0] == 0
    before = _snapshot(out)
    code, _, err = run(args, capsys)
    assert code == 1 and err.strip() == f"error: {out}: a sweep directory is already there; add --force to replace it"
    assert _snapshot(out) == before
    code, _, err = run([*args[:-2], "--slo", "garbage", "-o", out, "--force"], capsys)
    assert code == 1 and "--slo" in err and _snapshot(out) == before
    assert run([*args, "--force"], capsys)[0] == 0
    assert json.loads((out / "sweep.json").read_text())["points"]


def test_demo_replaces_its_own_run_but_not_another(tmp_path, capsys, monkeypatch):
    import servelab.traces.bundled

    # (the demo on a 20-request stand-in for the bundled trace: the rule, not the 19,366-request replay
    # that tests/test_cli_replay.py runs, is under test)
    bundled = write_small_trace(tmp_path)
    monkeypatch.setattr(servelab.traces.bundled, "default_trace_path", lambda: bundled)
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"trace": {"sha256": "0" * 64}}))
    code, _, err = run(["demo", "-o", other], capsys)
    assert code == 1 and "add --force" in err and "replaying" not in err
    # an earlier demo run (of the bundled trace) is replaced without --force: `servelab demo` twice works
    own = tmp_path / "demo"
    own.mkdir()
    (own / "run.json").write_text(json.dumps({"trace": {"sha256": trace_sha256(bundled)}}))
    code, out, err = run(["demo", "-o", own], capsys)
    assert code == 0, err
    assert pq.read_table(own / "requests.parquet").num_rows == 20
