"""`servelab` entry point: a click group whose sub-commands live in their own modules, loaded lazily.

Each sub-command module is imported only when that command runs, so `servelab --help` stays fast
and `servelab replay` never imports optuna or torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from servelab import __version__
from servelab.common.errors import ServelabError

# command name -> ("module:attribute" of a click.Command or click.Group, its one line in `servelab
# --help`): the listing is printed from here, so `--help` imports no command module
# (tests/test_cli_help.py checks each line against its command).
COMMANDS: dict[str, tuple[str, str]] = {
    "trace": ("servelab.cli.trace_cmd:trace", "Work with request traces: import, generate, transform, inspect."),
    "replay": ("servelab.cli.replay_cmd:replay", "Replay a trace through the engine; write a run directory."),
    "policies": ("servelab.cli.replay_cmd:policies", "List the registered scheduling policies and their parameters."),
    "routers": ("servelab.cli.replay_cmd:routers", "List the registered routers and their parameters."),
    "demo": ("servelab.cli.replay_cmd:demo", "Replay the bundled Azure conversation trace and print the report."),
    "bench": ("servelab.cli.bench_cmd:bench", "Send a trace's requests to a live OpenAI-compatible server."),
    "presets": ("servelab.cli.runner_cmd:presets", "List the model and GPU presets of the roofline runner."),
    "fit": ("servelab.cli.runner_cmd:fit", "Fit a cost model to profiles, step logs, real or live runs."),
    "profile": ("servelab.cli.runner_cmd:profile", "Sweep batch shapes through a runner; write their step times."),
    "validate": ("servelab.cli.runner_cmd:validate", "Compare two runners, or the simulator against a real run."),
    "query": ("servelab.cli.score_cmd:query", "Run SQL over one or more run directories."),
    "report": ("servelab.cli.score_cmd:report", "Readable summary of each run: attainment, latency, resources."),
    "compare": ("servelab.cli.score_cmd:compare", "The report's metrics for several runs side by side."),
    "sweep": ("servelab.cli.score_cmd:sweep", "Replay a trace at several arrival rates, one run each."),
    "plot": ("servelab.cli.score_cmd:plot", "PNG charts of one or more runs."),
    "runs": ("servelab.cli.score_cmd:runs", "Work with many run directories at once."),
    "search": ("servelab.cli.search_cmd:search", "Search engine settings with Optuna."),
    "recommend": ("servelab.cli.recommend_cmd:recommend", "The cheapest GPUs, topology and settings that meet an SLO."),
    "run": ("servelab.cli.run_cmd:run", "Work with run directories from outside a replay (real runs)."),
    "serve": ("servelab.cli.serve_cmd:serve", "An OpenAI-compatible server backed by the simulated engine."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _present(COMMANDS[name][0]))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command listing from the table (importing every command module would take ~0.2 s)."""
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module_name, attr = entry[0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:  # that command is not part of this build
                return None
            raise
        command = getattr(module, attr, None)
        if command is not None:
            command.short_help = entry[1]  # the same line wherever click lists it
        return command


def _present(target: str) -> bool:
    """Is the command's module part of this build? (Found without importing it.)"""
    return importlib.util.find_spec(target.split(":")[0]) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="servelab")
@click.option("--debug/--no-debug", default=False, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Replay LLM-serving traces against scheduling policies, cost models and real GPUs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _leave_to_exit() -> None:
    """Spare the interpreter's shutdown its garbage collections over everything the command made
    (~5% of a 10-request replay's instructions, bench/RESULTS.md "Session 18: start-up"): ``gc.freeze``
    moves every object to the permanent generation. The command has written and closed its files;
    objects in reference cycles are then not finalized at exit, which Python does not promise anyway.
    Only for the console command, never for a caller that goes on (tests call ``main(argv)``)."""
    import gc

    gc.freeze()


def _one_blas_thread() -> None:
    """One OpenBLAS thread for the console command, unless the user chose a number: numpy's OpenBLAS
    starts a thread per core when numpy is imported, and each spins ~0.1 s waiting for work that no
    command gives it (servelab's arrays are elementwise; its few least-squares fits are small). On a
    2-core machine those threads took the core from the command: a 10-request replay's whole process
    0.25 s -> 0.21 s wall median, its user CPU halved (bench/RESULTS.md "Session 26: start-up"). Set before
    numpy is first imported (OpenBLAS reads it then), and inherited by a search's worker processes.
    Only for the console command: a caller of ``main(argv)`` keeps its own environment."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if argv is None:
        _one_blas_thread()
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="servelab", standalone_mode=False)
        if argv is None:  # the process ends here: what it made stays until exit (below)
            _leave_to_exit()
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
    except MemoryError as err:  # a size no check caught: one line, not a numpy traceback
        if debug:
            raise
        click.echo(f"error: out of memory ({type(err).__name__}: {err or 'no detail'}); ask for less", err=True)
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
