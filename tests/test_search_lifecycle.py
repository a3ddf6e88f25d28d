"""A study's life across runs: one folder holds one study, a resumed sampler does not repeat itself,
workers die with a killed `search`, and Ctrl-C stops cleanly wherever it lands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers_cli import cli_code
from helpers_cli import snapshot as _snapshot
from helpers_search import grid_spec, pool_workers, running, start_slow_search, write_trace_file
from helpers_search import trials_table as _table
from servelab.search.batch import BATCH_TRIALS
from servelab.search.spec import load_spec
from servelab.search.study import resumed_seed, run_worker
from servelab.search.trials import load_study_dir



_cli = cli_code


# -- one folder, one study -------------------------------------------------------------------------


def test_a_folder_holding_another_study_is_refused(grid_dir, tmp_path, capsys):
    spec = grid_spec(grid_dir, n_trials=2, name="spec.toml")  # study_name defaults to the file's stem
    other = grid_spec(grid_dir, n_trials=2, name="other.toml")
    out = tmp_path / "S"
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    capsys.readouterr()
    before = _snapshot(out)
    for command in (["search", other, "--no-progress"], ["search", "worker", other]):
        assert _cli(*command, "-o", out) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]  # (the worker first notes it has no storage URL)
        assert err.startswith(f"error: {out} holds study 'spec' ") and "not 'other'" in err, err
        assert "one folder holds one study" in err
        assert _snapshot(out) == before  # trials/0000.., trials.parquet, study.json, the journal: untouched
    # another study in the journal (study.json lost) is refused too
    (out / "study.json").unlink()
    assert _cli("search", other, "-o", out, "--no-progress") == 1
    assert "holds study 'spec' in its study.journal" in capsys.readouterr().err
    # the same study resumes as before
    assert _cli("search", spec, "-o", out, "--no-progress", "--n-trials", "3") == 0
    assert sum(r["state"] == "complete" for r in _table(out)) == 3
    assert json.loads((out / "study.json").read_text())["study_name"] == "spec"


def test_a_changed_spec_leaves_study_json_alone(grid_dir, tmp_path, capsys):
    spec = grid_spec(grid_dir, n_trials=2, name="changing.toml")
    out = tmp_path / "S"
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    info = (out / "study.json").read_bytes()
    spec.write_text(spec.read_text().replace("ttft_s = 0.3", "ttft_s = 0.4"))
    assert _cli("search", spec, "-o", out, "--no-progress") == 1
    assert "different spec (changed: slo)" in capsys.readouterr().err
    assert (out / "study.json").read_bytes() == info  # it used to be rewritten with the refused spec


def test_a_resume_over_a_replaced_trace_is_refused(tmp_path, capsys):
    """The trace file replaced at the same path: its trials would mix two workloads in one study."""
    spec = grid_spec(tmp_path, n_trials=2, name="traced.toml")
    out = tmp_path / "S"
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    trials = load_study_dir(out).get_trials()
    write_trace_file(tmp_path, n=150, rate=40.0)  # another workload, same file name
    capsys.readouterr()
    for command in (["search", spec, "--no-progress", "--n-trials", "4"], ["search", "worker", spec]):
        assert _cli(*command, "-o", out) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "was made from another trace" in err and "trace.arrow has changed" in err, err
        assert load_study_dir(out).get_trials() == trials  # refused before a trial was begun
    assert sum(r["state"] == "complete" for r in _table(out)) == 2


def test_a_resume_from_another_working_directory_is_accepted(tmp_path, monkeypatch, capsys):
    """A relative spec path names the same trace from elsewhere: the study is the same one."""
    grid_spec(tmp_path, n_trials=2, name="cwd.toml")
    monkeypatch.chdir(tmp_path)
    assert _cli("search", "cwd.toml", "-o", "S", "--no-progress") == 0
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert _cli("search", "../cwd.toml", "-o", "../S", "--no-progress", "--n-trials", "3") == 0, capsys.readouterr().err
    assert sum(r["state"] == "complete" for r in _table(tmp_path / "S")) == 3


def test_a_torn_last_journal_record_is_cut_before_a_resume_appends(grid_dir, tmp_path, capsys):
    """A worker killed mid-write leaves a record without its newline; appending behind it glued the
    next record onto it, and from then on nothing could read the journal (Optuna's reader skips a
    torn last line only while it is the last)."""
    spec = grid_spec(grid_dir, n_trials=2, name="torn.toml")
    out = tmp_path / "S"
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    journal = out / "study.journal"
    whole = journal.read_bytes()
    with open(journal, "ab") as f:
        f.write(b'{"op_code":5,"worker_id":"dead-wor')  # what a kill -9 mid-append leaves
    assert _cli("search", spec, "-o", out, "--no-progress", "--n-trials", "4") == 0, capsys.readouterr().err
    assert journal.read_bytes().startswith(whole)
    assert all(line.endswith("}") for line in journal.read_text().splitlines())
    assert sum(r["state"] == "complete" for r in _table(out)) == 4
    assert _cli("search", "best", out, "-o", tmp_path / "best.toml") == 0
    # a journal broken before this fix (a torn record with more behind it): one line naming the record
    with open(journal, "ab") as f:
        f.write(b'{"op_code":5,"wor\n{"op_code":5}\n')
    capsys.readouterr()
    assert _cli("search", "best", out, "-o", tmp_path / "best2.toml") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {journal}: line ") and "is not a whole record" in err and "\n" not in err, err


# -- a resumed sampler continues ------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_resumed_sampler_does_not_repeat_the_first_run(grid_dir, tmp_path, sampler):
    spec = grid_spec(grid_dir, n_trials=4, name=f"resume_{sampler}.toml", top=f'sampler = "{sampler}"\n')
    out = tmp_path / "S"
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    assert _cli("search", spec, "-o", out, "--no-progress", "--n-trials", "8") == 0
    rows = sorted(_table(out), key=lambda r: r["number"])
    settings = [(r["param.max_num_seqs"], r["param.max_num_batched_tokens"], r["param.policy"]) for r in rows]
    assert len(settings) == 8
    # a restarted random stream proposed exactly the first run's settings again
    assert settings[4:] != settings[:4], settings
    assert len(set(settings)) >= 6, settings  # 8 draws from 70 grid points: a few repeats at most by chance


def _fail_one_trial(spec, out, outcome: str = "interrupted") -> dict:
    """Leave in OUT's study one trial failed as a Ctrl-C (or a dead worker, an error) leaves it; returns its params."""
    from optuna.trial import TrialState

    from servelab.search.space import suggest
    from servelab.search.study import open_study_dir

    study = open_study_dir(load_spec(spec), out)
    trial = study.ask()
    suggest(trial, load_spec(spec).space, load_spec(spec).base)
    trial.set_user_attr("outcome", outcome)
    study.tell(trial, state=TrialState.FAIL)
    return dict(trial.params)


@pytest.mark.parametrize("outcome", ["interrupted", "stale", "error"])
def test_a_resumed_grid_runs_the_failed_point_and_none_twice(grid_dir, tmp_path, outcome):
    """A grid point whose trial failed in an earlier run (Ctrl-C, a killed worker, an error) is run by the
    resume: Optuna counted it visited, never ran it, and re-ran another point once the numbers passed the grid."""
    space = "[space]\nmax_num_batched_tokens = [128, 256, 512, 1024]\n"
    spec = grid_spec(grid_dir, n_trials=4, top='sampler = "grid"\n', space=space, name=f"grid_fail_{outcome}.toml")
    out = tmp_path / "S"
    lost = _fail_one_trial(spec, out, outcome)
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    rows = sorted(_table(out), key=lambda r: r["number"])
    done = [r["param.max_num_batched_tokens"] for r in rows if r["state"] == "complete"]
    assert sorted(done) == [128, 256, 512, 1024], rows
    assert lost["max_num_batched_tokens"] in done
    assert len(rows) == 5  # the failed trial and one trial per point: nothing evaluated twice
    assert _cli("search", spec, "-o", out, "--no-progress") == 0  # covered: a further resume runs nothing
    assert len(_table(out)) == 5


def test_a_grid_point_failing_in_this_run_is_not_retried_until_a_resume(grid_dir, tmp_path, monkeypatch):
    """An error fails a point in this run: the study ends once the other points are done (it would fail
    again), rather than run some point twice; the next run tries it again."""
    from servelab.search import objective

    space = "[space]\nmax_num_batched_tokens = [128, 256, 512, 1024, 2048]\n"
    spec = grid_spec(grid_dir, n_trials=5, top='sampler = "grid"\nworkers = 1\n', space=space, name="grid_err.toml")
    out = tmp_path / "S"
    real = objective.Evaluator._evaluate_interruptibly

    def failing(self, trial, config, attrs):
        if config.engine.max_num_batched_tokens == 256:
            raise RuntimeError("boom")
        return real(self, trial, config, attrs)

    monkeypatch.setattr(objective.Evaluator, "_evaluate_interruptibly", failing)
    _cli("search", spec, "-o", out, "--no-progress")
    rows = _table(out)
    assert sorted(r["param.max_num_batched_tokens"] for r in rows) == [128, 256, 512, 1024, 2048], rows
    assert [r["outcome"] for r in rows if r["state"] == "fail"] == ["error"]
    monkeypatch.setattr(objective.Evaluator, "_evaluate_interruptibly", real)
    assert _cli("search", spec, "-o", out, "--no-progress") == 0
    rows = _table(out)
    assert sorted(r["param.max_num_batched_tokens"] for r in rows if r["state"] == "complete") == [128, 256, 512, 1024, 2048]
    assert len(rows) == 6


def test_resumed_seed_is_the_seed_for_a_fresh_study_and_differs_after():
    assert resumed_seed(7, 0) == 7
    seeds = {resumed_seed(s, n) for s in (0, 1, 2) for n in range(1, 50)}
    assert len(seeds) == 3 * 49 and not seeds & {0, 1, 2}


# -- Ctrl-C lands anywhere --------------------------------------------------------------------------


def test_ctrl_c_in_optunas_tell_stops_after_the_trial(grid_dir, tmp_path, monkeypatch):
    """Ctrl-C while Optuna records a finished trial: that trial completes, the study stops, no UnboundLocalError."""
    import optuna.study._optimize as optimize

    spec = load_spec(grid_spec(grid_dir, n_trials=6, name="tell.toml"))
    real = optimize._tell_with_warning
    calls = []

    def tell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled at once, inside Optuna's bookkeeping
        return real(*args, **kwargs)

    monkeypatch.setattr(optimize, "_tell_with_warning", tell)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run_worker(spec, tmp_path / "S", seed=0)
    study = load_study_dir_or_open(spec, tmp_path / "S")
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    assert states == ["COMPLETE", "COMPLETE"], states
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored (what it was, not assumed default)


def load_study_dir_or_open(spec, study_dir):
    from servelab.search.study import open_study

    return open_study(spec, study_dir)


CTRL_C_AT = """
import os, signal, sys
import optuna.study._optimize as optimize
import optuna.study.study as study_module
from servelab.search import objective
from servelab.cli.main import main

where, spec, out = sys.argv[1:4]
calls = []
def interrupt_second():
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
if where == "tell":
    real_tell = optimize._tell_with_warning
    def tell(*a, **k):
        interrupt_second()
        return real_tell(*a, **k)
    optimize._tell_with_warning = study_module._tell_with_warning = tell  # (Study.tell: a local search's batches)
elif where == "replay":
    real_replay = objective.Evaluator._replay_timed
    def replay(self, *a, **k):
        interrupt_second()
        return real_replay(self, *a, **k)
    objective.Evaluator._replay_timed = replay
elif where == "ask":
    import optuna
    real_ask = optuna.Study.ask
    def ask(self, *a, **k):
        interrupt_second()
        return real_ask(self, *a, **k)
    optuna.Study.ask = ask
main(["search", spec, "-o", out, "--no-progress"])
"""


# Ctrl-C in a tell lets the batch's tells finish (its trials are evaluated by then): a whole batch
# completes; in a replay or an ask, the trials finished before it are told and the one in hand fails.
@pytest.mark.parametrize("where, complete, failed", [("tell", BATCH_TRIALS, []), ("replay", 1, ["interrupted"]),
                                                     ("ask", 1, ["interrupted"])])  # fmt: skip
def test_ctrl_c_prints_one_line_and_exits_130(grid_dir, tmp_path, where, complete, failed):
    # one worker, in the search process, where the patches above run (the default, one worker per free
    # core, gave two on an idle machine: the replay's patch then ran in forked workers)
    spec = grid_spec(grid_dir, n_trials=6, name=f"ctrlc_{where}.toml", top="workers = 1\n")
    out = tmp_path / "S"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C_AT), where, str(spec), str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    # no Optuna warning with a traceback, no UnboundLocalError: the one line of the CLI
    header, *rest = proc.stderr.splitlines()
    assert header.startswith(f"search 'ctrlc_{where}': 6 trials, ") and "batches of" in header, header
    assert rest == [f"stopped; finished trials are kept in {out} (run the same command to continue)"], proc.stderr
    rows = _table(out)
    assert sum(r["state"] == "complete" for r in rows) == complete
    assert [r["outcome"] for r in rows if r["state"] == "fail"] == failed
    assert not any(r["state"] == "running" for r in rows)
    names = sorted(p.name for p in (out / "trials").iterdir())
    assert names == [f"{r['number']:04d}" for r in rows if r["state"] == "complete"]


# -- kill -9 of `search`: its workers stop too -----------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_search_stops_its_workers(tmp_path):
    proc, out, log = start_slow_search(tmp_path, "orphans.toml")
    try:
        workers = pool_workers(proc.pid)
        assert len([p for p in workers if running(p)]) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone: its workers get no signal from us
        proc.wait()
        # left alone, the workers would go on through all 400 trials (several minutes); each finishes
        # or fails the trial in hand and writes trials.parquet first, which under a loaded CI
        # machine took more than 15 s once
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and any(running(p) for p in workers):
            time.sleep(0.1)
        assert not any(running(p) for p in workers), f"workers outlived the killed search: {log.read_text()}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the session (only on failure)
        except ProcessLookupError:
            pass
    # the workers failed their trials in flight and wrote trials.parquet themselves
    rows = _table(out)
    assert not any(r["state"] == "running" for r in rows), rows
    assert sum(r["state"] == "complete" for r in rows) < 100
    assert all(r["outcome"] in ("interrupted", "surplus") for r in rows if r["state"] == "fail"), rows
    study = load_study_dir(out)
    assert not [t for t in study.trials if t.state.name == "RUNNING"]


# -- a burst of signals: the handler runs inside itself, and must not wait on a lock it holds ------

_BURST_CHILD = textwrap.dedent("""
    import signal, sys, time
    from servelab.search.study import PARENT_DIED, Interrupt, _ParentWatch
    interrupt = Interrupt().install((signal.SIGINT, signal.SIGTERM))
    watch = _ParentWatch(__import__("os").getppid(), interrupt)  # its handler sets a second flag
    print("ready", flush=True)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # Python code for the handlers to run between (and inside each other)
        sum(range(50))
    print("set" if interrupt.is_set() and watch.died.is_set() else "not set", flush=True)
""")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_burst_of_signals_does_not_hang_a_worker():
    # a worker once hung in threading.Event.set (its Condition's lock) when the kernel's parent-death
    # signal and its watch thread's came at once: the second handler ran inside the first's set
    from servelab.search.study import PARENT_DIED

    proc = subprocess.Popen([sys.executable, "-c", _BURST_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        end, i = time.monotonic() + 2.0, 0
        while time.monotonic() < end:  # a sustained barrage: with threading.Event it hung 1 run in 3
            os.kill(proc.pid, PARENT_DIED if i % 2 else signal.SIGTERM)
            i += 1
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "set", (proc.returncode, out)
