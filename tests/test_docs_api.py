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


def test_ci_builds_one_venv_and_runs_the_readmes_commands():
    """.ci/run builds the venv once, with README's second command's setup (the test extras: a superset
    of the first's ``pip install -e .``), runs the first command's job, and ends with README's test
    command as README writes it, then the live-server tests; both README commands still work alone on a
    fresh machine."""
    readme = README.read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv && ")][:2]
    assert len(commands) == 2 and commands[1].endswith(" && .venv/bin/pytest -n auto --dist loadfile")
    main, tests = commands
    setup, test_command = tests.rsplit(" && ", 1)
    assert setup == "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'"
    assert main.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    job = main.rsplit(" && ", 1)[1]
    ci = [line for line in (README.parent / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert [line for line in ci if "-m venv .venv " in line] == [setup]  # the venv built once, with everything
    assert not [line for line in ci if "pip install -e" in line and line != setup]
    assert ci.index(setup) < ci.index(job) < ci.index(test_command)  # the README's job, then its tests
    # After it, only the files that need the real vLLM/transformers servers, which start after it (their
    # model worker busy-waits on a CPU): every such file, and nothing else
    live = ci[ci.index(test_command) + 1:]
    assert [line for line in live if "pytest" in line] == [live[-1]]
    needs_server = {f"tests/{path.name}" for path in (README.parent / "tests").glob("test_*.py")
                    if path.name != Path(__file__).name and any(marker in path.read_text() for marker in ("from helpers_vllm_endpoint import",
                                                                     'environ.get("SERVELAB_TEST_REQUIRE_ENDPOINT")'))}
    assert live[-1].startswith(".venv/bin/pytest -p no:xdist ") and set(live[-1].split()[3:]) == needs_server
    assert any(line.startswith("source .ci/vllm.sh") for line in live)
