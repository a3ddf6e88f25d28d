"""docs/api.md is a working notebook: its python blocks run, in order, in an empty folder (issue 16 item 15)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_api_page_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs_api__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    # what the page promises happened
    for run in ("sarathi", "vllm-v0"):
        meta = json.loads((tmp_path / "runs" / run / "run.json").read_text())
        assert meta["policy"]["name"] == run and meta["counts"]["finished"] > 0
    assert namespace["attainment"].height == 2
    assert {r["metric"] for r in namespace["table"].to_pylist()} >= {"attainment_pct", "ttft_p99_ms"}
    assert len(namespace["sweep"].points) == 3 and (tmp_path / "runs" / "sweep" / "sweep.json").is_file()
    assert (tmp_path / "best.toml").is_file() and "# scored on trace" in (tmp_path / "best.toml").read_text()
    assert "run sarathi" in out and "best: trial" in out


def test_readme_links_the_api_page():
    readme = README.read_text()
    assert "docs/api.md" in readme
    # the README's first two commands stay as they were
    assert ".venv/bin/servelab demo" in readme and ".venv/bin/pytest" in readme


def test_ci_runs_the_readmes_two_commands_verbatim():
    readme = README.read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv && ")][:2]
    assert len(commands) == 2 and commands[1].endswith("pytest -n auto --dist loadfile")
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert all(command in ci for command in commands), commands
