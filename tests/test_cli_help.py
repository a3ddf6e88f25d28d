"""`servelab --help` lists every command from cli/main.py's table without importing a command module."""

from __future__ import annotations

import subprocess
import sys

import click
from servelab.cli.main import COMMANDS, LazyGroup, cli


def test_help_lists_every_command_without_importing_one():
    code = ("import sys; from servelab.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('servelab.cli.') and m.endswith('_cmd')))\n"
            "print('pyarrow' in sys.modules, 'duckdb' in sys.modules, 'optuna' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    listing, imported, heavy = out.rsplit("\n", 3)[:3]
    for name, (_, line) in COMMANDS.items():
        assert f"  {name} " in listing and line in listing, (name, line)
    assert imported == "[]"
    assert heavy == "False False False"


def test_each_line_names_a_real_command_and_is_its_short_help():
    group = cli
    assert isinstance(group, LazyGroup)
    ctx = click.Context(group)
    for name, (target, line) in COMMANDS.items():
        command = group.get_command(ctx, name)
        assert isinstance(command, click.Command), target
        assert command.short_help == line
        assert line.endswith(".") and len(line) <= 70, line
        assert command.help, f"{name} has no help text of its own"
