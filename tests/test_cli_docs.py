"""docs/cli.md names every option of every command, and no option that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import click

from servelab.cli.main import cli

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# placeholders the page uses to explain conventions, not options
NOT_OPTIONS = {"--x", "--no-x", "--no-", "--bogus"}


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _commands(cmd.get_command(ctx, name), (*path, name))


def _options(cmd: click.Command, hidden: bool) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) and (hidden or not p.hidden)
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def test_cli_md_names_every_option_and_only_real_ones():
    doc = CLI_MD.read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc))
    commands = list(_commands(cli))
    missing = {f"servelab {' '.join(path)} {o}".replace("  ", " ")
               for path, cmd in commands for o in _options(cmd, hidden=False)
               # every on/off option's --no- form is the page's stated rule
               if o not in named and not (o.startswith("--no-") and "--" + o[5:] in named)}
    assert not missing, f"options docs/cli.md does not name: {sorted(missing)}"
    real = set().union(*(_options(cmd, hidden=True) for _, cmd in commands))  # deprecated names included
    unknown = named - real - NOT_OPTIONS - {"--help"}  # click adds --help (and -h) to every command
    assert not unknown, f"docs/cli.md names options no command has: {sorted(unknown)}"
    for path, _ in commands:
        if path:
            assert f"`{path[-1]}`" in doc or f"servelab {' '.join(path)}" in doc, f"docs/cli.md never names {path}"
