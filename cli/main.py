"""`servelab` entry point: a click group whose sub-commands live in their own modules, loaded lazily.

Each sub-command module is imported only when that command runs, so `servelab --help` stays fast
and `servelab replay` never imports optuna or torch.
"""

from __future__ import annotations

import importlib
import sys

import click

from servelab import __version__
from servelab.common.errors import ServelabError

# command name -> "module:attribute" (a click.Command or click.Group)
COMMANDS: dict[str, str] = {
    "trace": "servelab.cli.trace_cmd:trace",
    "replay": "servelab.cli.replay_cmd:replay",
    "policies": "servelab.cli.replay_cmd:policies",
    "routers": "servelab.cli.replay_cmd:routers",
    "demo": "servelab.cli.replay_cmd:demo",
    "bench": "servelab.cli.bench_cmd:bench",
    "presets": "servelab.cli.runner_cmd:presets",
    "fit": "servelab.cli.runner_cmd:fit",
    "profile": "servelab.cli.runner_cmd:profile",
    "validate": "servelab.cli.runner_cmd:validate",
    "query": "servelab.cli.score_cmd:query",
    "report": "servelab.cli.score_cmd:report",
    "compare": "servelab.cli.score_cmd:compare",
    "sweep": "servelab.cli.score_cmd:sweep",
    "plot": "servelab.cli.score_cmd:plot",
    "runs": "servelab.cli.score_cmd:runs",
    "search": "servelab.cli.search_cmd:search",
    "run": "servelab.cli.run_cmd:run",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self._load(name) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:  # that command is not part of this build
                return None
            raise
        return getattr(module, attr, None)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="servelab")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Replay LLM-serving traces against scheduling policies, cost models and real GPUs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="servelab", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # a bare `servelab` / `servelab trace`: the help (click >= 8.2)
            err.show()
            sys.exit(err.exit_code)
        click.echo(f"error: {_one_line(err, args)}", err=True)
        sys.exit(err.exit_code)  # 2 for usage errors (unknown option, missing argument, bad value), else 1
    except ServelabError as err:
        if debug:
            raise
        click.echo(f"error: {_one_line(err)}", err=True)
        sys.exit(1)
    except OSError as err:  # a file the command could not read or write, named; never a traceback
        if debug:
            raise
        why = err.strerror or str(err) or type(err).__name__
        click.echo(f"error: {err.filename}: {why}" if err.filename is not None else f"error: {why}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


def _command_path(err: click.UsageError, args: list[str]) -> str:
    """'servelab trace import' for an error in that command (click sometimes reports the group's context)."""
    if err.ctx is not None and err.ctx.command is not cli:
        return err.ctx.command_path
    path, command = ["servelab"], cli
    for arg in args:
        if not isinstance(command, click.Group):
            break
        if arg.startswith("-"):
            continue
        sub = command.get_command(err.ctx, arg)  # type: ignore[arg-type]
        if sub is None:
            break
        path.append(arg)
        command = sub
    return " ".join(path)


def _one_line(err: Exception, args: list[str] = ()) -> str:
    """The error's message on one line; a usage error adds where to find the command's options."""
    if isinstance(err, click.ClickException):
        text = err.format_message()
        if isinstance(err, click.UsageError):
            text = f"{text.rstrip()} (see '{_command_path(err, list(args))} --help')"
    else:
        text = str(err)
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


if __name__ == "__main__":
    main()
