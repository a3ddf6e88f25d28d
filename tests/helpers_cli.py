"""Helpers for CLI tests: run the real entry point (or its click command), write a small trace file,
snapshot a folder's files."""

from __future__ import annotations

from pathlib import Path

from conftest import make_trace
from servelab.cli.main import main
from servelab.traces.io import write_trace


def run_main(argv, capsys) -> tuple[int, str, str]:
    """Run the real entry point (its error handling included): exit code, stdout, stderr."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_code(*args) -> int:
    """Run the real entry point on ``args`` (paths allowed) and return its exit code."""
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return exit_.code or 0
    return 0


def invoke(*args) -> str:
    """Run the click command tree on ``args`` (paths allowed); it must succeed. Returns its stdout (what a
    pipe gets: notes on stderr stay out of a JSON result)."""
    from click.testing import CliRunner
    from servelab.cli.main import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): to check a command left it untouched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_small_trace(tmp_path: Path, n: int = 20) -> Path:
    """``n`` requests 0.1 s apart, 50 prompt and 10 output tokens each, as ``tmp_path/t.arrow``."""
    path = tmp_path / "t.arrow"
    write_trace(make_trace([i * 0.1 for i in range(n)], [50] * n, [10] * n), path, source="test")
    return path


# A prefill/decode cluster of 8 replicas (4 prefill on an A100, 4 decode on the default H100: 2 runners
# built) whose top-level runner spec every pool inherits: what the typed-once tests and bench read.
PD_8_REPLICAS_TOML = """
runner = "roofline:cpu_overhead=0.5"
policy = "sarathi"
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 4
gpu = "a100-80gb"
[[cluster.pools]]
name = "decode"
role = "decode"
replicas = 4
[[cluster.links]]
from = "prefill"
to = "decode"
bandwidth_gbps = 50.0
"""


def validate_real_json(run: Path, capsys, *extra) -> tuple[dict, dict, dict]:
    """``validate --real RUN --candidate linear:base=0.002 --format json`` (``extra`` options added): the
    report, and its compared and engine-side latency rows by (metric, stat) (the latter empty when absent)."""
    import json

    code, out, err = run_main(["validate", "--real", run, "--candidate", "linear:base=0.002", "--format", "json",
                               *extra], capsys)
    assert code == 0, err
    report = json.loads(out)
    rows = {(r["metric"], r["stat"]): r for r in report["latency"]}
    engine = {(r["metric"], r["stat"]): r for r in report.get("latency_engine") or ()}
    return report, rows, engine
