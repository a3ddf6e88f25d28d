"""CI (.ci/run) builds its virtualenv once and runs the README's test command as README.md writes it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The commands of README.md's first code block (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def ci_commands() -> list[str]:
    return [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_ci_builds_one_venv_with_the_test_extras_and_runs_the_readme_test_command():
    main, tests = readme_commands()
    setup, test_command = tests.rsplit(" && ", 1)
    assert setup == "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'"
    assert main.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    job = main.rsplit(" && ", 1)[1]
    ci = ci_commands()
    assert [line for line in ci if "-m venv .venv " in line] == [setup]  # the venv built once, with everything
    assert ci.index(setup) < ci.index(job) < ci.index(test_command) == len(ci) - 1  # the README's job, tests last
    assert not [line for line in ci if "pip install -e" in line and line != setup]
