"""`servelab search`: run or continue an Optuna study over engine settings, join one as a worker, export the best config, plot.

    servelab search SPEC.toml -o STUDY_DIR        run (or continue) the study with the spec's local workers
    servelab search worker SPEC.toml [-o DIR]     one more worker on a shared (database) study
    servelab search best STUDY_DIR -o best.toml   the best configuration, for `servelab replay --config`
    servelab search plot STUDY_DIR                history, importances, parallel coordinates, Pareto front (PNG)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from servelab.common.errors import ServelabError


class SearchGroup(click.Group):
    """A group whose first argument may be the spec itself: `search SPEC.toml ...` means `search run SPEC.toml ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-") and (
            args[0].endswith(".toml") or Path(args[0]).is_file()
        ):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _default_dir(spec) -> Path:
    return Path("studies") / spec.study_name


def _spec_with(spec, n_trials, timeout, workers=None):
    changes = {}
    if n_trials is not None:
        if n_trials < 1:
            raise ServelabError(f"--n-trials must be >= 1, got {n_trials}")
        changes["n_trials"] = n_trials
    if timeout is not None:
        if timeout <= 0:
            raise ServelabError(f"--timeout must be > 0 seconds, got {timeout}")
        changes["timeout_s"] = timeout
    if workers is not None:
        if workers < 1:
            raise ServelabError(f"--workers must be >= 1, got {workers}")
        changes["workers"] = workers
    return replace(spec, **changes) if changes else spec


def _best_text(study) -> str:
    from servelab.search.trials import best_trials

    from optuna.trial import TrialState

    front = best_trials(study)
    if not front:
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            return "no trial meets the attainment target yet"
        return "no complete trial yet"
    names = study.user_attrs.get("objectives") or []
    if len(front) == 1 and len(study.directions) == 1:
        t = front[0]
        return f"best {names[0] if names else 'value'} {t.values[0]:.6g} (trial {t.number})"
    return f"Pareto front: {len(front)} trial(s)"


class _Progress:
    """A rich progress bar over finished trials, with the best value so far."""

    def __init__(self, total: int, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled
        self.progress = Progress(TextColumn("[bold]search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), transient=False, disable=not enabled)  # fmt: skip
        self.task = self.progress.add_task("", total=total)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def __call__(self, study) -> None:
        from servelab.search.study import counts

        c = counts(study)
        extra = f", {c['running']} running" if c["running"] else ""
        self.progress.update(self.task, completed=min(c["finished"], self.progress.tasks[0].total),
                             description=f"{_best_text(study)}; {c['pruned']} pruned, {c['fail']} failed{extra}")  # fmt: skip


def _summary(study, study_dir: Path) -> None:
    from servelab.search.study import counts
    from servelab.search.trials import write_trials

    path = write_trials(study, study_dir)
    c = counts(study)
    click.echo(f"study '{study.study_name}': {c['complete']} complete, {c['pruned']} pruned, {c['fail']} failed; "
               f"{_best_text(study)}", err=True)  # fmt: skip
    from servelab.search.trials import best_trials

    front = best_trials(study)
    if len(front) == 1:
        click.echo("  " + ", ".join(f"{k}={v}" for k, v in front[0].params.items()), err=True)
    from servelab.scoring.lengths import output_length_note

    for t in front[:1] if len(front) == 1 else front:
        config = t.user_attrs.get("config") or {}
        note = output_length_note(config.get("policy"), config.get("policy_params"))
        if note:
            click.echo(f"  trial {t.number}: policy {config.get('policy')}: {note}", err=True)
    click.echo(f"wrote {path}; runs under {study_dir / 'trials'}", err=True)


@click.group(cls=SearchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def search() -> None:
    """Search engine settings with Optuna, scored by SLO attainment, goodput or cost (see docs/search.md).

    `servelab search SPEC.toml -o STUDY_DIR` runs (or continues) a study; the sub-commands below
    join, export and plot one.
    """


@search.command("run")
@click.argument("spec_path", metavar="SPEC.toml", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "study_dir", type=click.Path(file_okay=False),
              help="Study directory (default: studies/<study_name>).")
@click.option("--n-trials", type=int, help="Finished trials wanted in total (overrides the spec).")
@click.option("--timeout", type=float, help="Stop starting trials after this many seconds (overrides the spec).")
@click.option("--workers", type=int, help="Local worker processes (overrides the spec; default: one per free core, at most 4).")
@click.option("--storage", help="Database URL (overrides the spec), e.g. postgresql://user@host/db.")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar.")
def run(spec_path, study_dir, n_trials, timeout, workers, storage, progress) -> None:
    """Run or continue the study SPEC.toml describes; finished trials are kept across runs."""
    from servelab.search.spec import load_spec
    from servelab.search.study import check_study_dir, open_study, run_study
    from servelab.search.trials import write_trials

    spec = _spec_with(load_spec(spec_path), n_trials, timeout, workers)
    study_dir = Path(study_dir) if study_dir else _default_dir(spec)
    check_study_dir(spec, study_dir, storage)  # a folder holding another study is refused before anything
    spec = replace(spec, workers=_header(spec, study_dir, storage))
    interrupted = False
    try:
        with _Progress(spec.n_trials, progress) as bar:
            run_study(spec, study_dir, progress=bar, storage_url=storage)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if (study_dir / "study.json").exists():
            try:
                study = open_study(spec, study_dir, storage_url=storage)
            except ServelabError:
                study = None
            if study is not None:
                if interrupted:
                    write_trials(study, study_dir)
                    click.echo(f"stopped; finished trials are kept in {study_dir} (run the same command to continue)", err=True)
                else:
                    _summary(study, study_dir)
    if interrupted:
        raise SystemExit(130)


def _header(spec, study_dir: Path, storage: str | None) -> int:
    """Print the run's header line (trials, workers, where); returns the number of workers it will run."""
    from servelab.search.batch import BATCH_TRIALS, free_cores, resolve_workers, usable_cores

    if storage or spec.storage:  # a database study: independent workers (docs/search.md)
        workers, how = spec.workers or 1, "independent, sharing the database"
    else:
        workers = resolve_workers(spec)
        how = f"batches of {BATCH_TRIALS}"
        if spec.workers is None:
            how += f"; auto: {free_cores()} of {usable_cores()} cores free"
    click.echo(f"search '{spec.study_name}': {spec.n_trials} trials, {workers} worker{'s' if workers > 1 else ''} "
               f"({how}) -> {study_dir}", err=True)  # fmt: skip
    return workers


@search.command("worker")
@click.argument("spec_path", metavar="SPEC.toml", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "study_dir", type=click.Path(file_okay=False),
              help="Where this worker writes its trial runs (default: studies/<study_name>).")
@click.option("--n-trials", type=int, help="Finished trials wanted in total (overrides the spec).")
@click.option("--timeout", type=float, help="Stop starting trials after this many seconds.")
@click.option("--storage", help="Database URL (overrides the spec).")
@click.option("--seed", type=int, help="Sampler seed of this worker (default: the spec's seed mixed with host and pid).")
def worker(spec_path, study_dir, n_trials, timeout, storage, seed) -> None:
    """Join the study SPEC.toml names as one worker process (start any number, on any machines)."""
    import os
    import socket
    import zlib

    from servelab.search.spec import load_spec
    from servelab.search.study import fail_stale_trials, open_study, open_study_dir, run_worker, write_study_json
    from servelab.search.trials import write_trials

    spec = _spec_with(load_spec(spec_path), n_trials, timeout)
    if not (storage or spec.storage):
        click.echo("note: the spec has no storage URL, so this worker shares the study only with processes "
                   "on this machine using the same study directory", err=True)  # fmt: skip
    study_dir = Path(study_dir) if study_dir else _default_dir(spec)
    from servelab.traces.io import read_trace

    read_trace(spec.trace.path)  # fail before writing anything
    if seed is None:  # two workers with one seed would propose the same points
        seed = (spec.seed + zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode())) % (2**31)
    study = open_study_dir(spec, study_dir, storage)  # one folder, one study; refuses a changed spec
    write_study_json(spec, study_dir, storage)
    fail_stale_trials(study, study_dir)

    def report(study_, t) -> None:
        value = ", ".join(f"{v:.6g}" for v in t.values) if t.values else t.user_attrs.get("reason", "")
        click.echo(f"trial {t.number}: {t.state.name.lower()} {value}", err=True)

    try:
        run_worker(spec, study_dir, seed, on_trial=report, storage_url=storage)
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
        raise SystemExit(130)
    finally:
        write_trials(open_study(spec, study_dir, storage_url=storage), study_dir)
    _summary(study, study_dir)


@search.command("best")
@click.argument("study_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--out", "out_path", default="best.toml", show_default=True, type=click.Path(dir_okay=False),
              help="Config file to write (for `servelab replay --config`).")
@click.option("--trial", "trial_number", type=int, help="Export this trial instead of the best one.")
@click.option("--storage", help="Database URL, when study.json's (password-less) URL is not enough.")
def best(study_dir, out_path, trial_number, storage) -> None:
    """Write the best trial's configuration (several objectives: best on the first one, of the Pareto front)."""
    from servelab.search.trials import best_trials, load_study_dir, write_best_toml

    study = load_study_dir(Path(study_dir), storage)
    trial, path = write_best_toml(study, Path(out_path), trial_number, study_dir=Path(study_dir))
    names = study.user_attrs.get("objectives") or []
    if len(study.directions) > 1 and trial_number is None:
        click.echo("Pareto front:", err=True)
        for t in best_trials(study):
            click.echo(f"  trial {t.number}: " + ", ".join(f"{n} = {v:.6g}" for n, v in zip(names, t.values)), err=True)
    click.echo(f"trial {trial.number}: " + ", ".join(f"{n} = {v:.6g}" for n, v in zip(names, trial.values)))
    click.echo(f"wrote {path}", err=True)


@search.command("plot")
@click.argument("study_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Folder for the PNGs (default: STUDY_DIR/plots).")
@click.option("--storage", help="Database URL, when study.json's (password-less) URL is not enough.")
def plot(study_dir, out_dir, storage) -> None:
    """Draw optimization history, parameter importances, parallel coordinates and the Pareto front as PNGs."""
    from servelab.search.plots import plot_study
    from servelab.search.trials import load_study_dir

    study = load_study_dir(Path(study_dir), storage)
    out = Path(out_dir) if out_dir else Path(study_dir) / "plots"
    written, skipped = plot_study(study, out)
    for path in written:
        click.echo(f"wrote {path}")
    for note in skipped:
        click.echo(f"skipped {note}", err=True)


__all__ = ["search"]
