"""Parallel local searches (search/batch.py, search/pool.py): the same trials for any number of workers,
a dying worker stops the study with a clear error, and the default picks one worker per free core."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers_search import grid_spec, pool_workers, running, start_slow_search
from servelab.search import batch
from servelab.search.spec import load_spec
from servelab.search.study import run_study
from servelab.search.trials import load_study_dir, trials_table

# what times a trial or names its process: everything else is the search's result
TIMING = {"datetime_start", "datetime_complete", "duration_s", "attr.worker", "attr.eval_s", "attr.eval_cpu_s",
          "attr.replay_s", "attr.replay_cpu_s", "attr.final_replay_s", "attr.score_s", "attr.write_s",
          "attr.score_write_s", "attr.checkpoint_replay_s"}  # fmt: skip


def _result(study_dir: Path) -> list[dict]:
    table = trials_table(load_study_dir(study_dir))
    return table.select([c for c in table.column_names if c not in TIMING]).to_pylist()


# TPE past its random start-up (2 trials), and a median pruner asking the parent mid-trial
@pytest.mark.parametrize("top", ['sampler = { name = "tpe", n_startup_trials = 2 }\n',
                                 'sampler = { name = "tpe", n_startup_trials = 2 }\n'
                                 'pruner = { name = "median", n_startup_trials = 2, checkpoints = [0.25, 0.5] }\n'])  # fmt: skip
def test_one_and_two_workers_give_the_same_trials(tmp_path, top):
    spec = load_spec(grid_spec(tmp_path, n_trials=10, name="same.toml", top=top))
    run_study(replace(spec, workers=1), tmp_path / "one")
    run_study(replace(spec, workers=2), tmp_path / "two")
    one, two = _result(tmp_path / "one"), _result(tmp_path / "two")
    assert [r["state"] for r in one].count("complete") + [r["state"] for r in one].count("pruned") == 10
    assert len({(r["param.max_num_seqs"], r["param.max_num_batched_tokens"], r["param.policy"]) for r in one}) > 3
    assert one == two
    # each trial's run directory is there, written by whichever process evaluated it
    for r in two:
        if r["state"] == "complete":
            assert (tmp_path / "two" / r["attr.trial_dir"] / "requests.parquet").is_file()


def test_auto_workers_is_one_per_free_core_up_to_a_batch(monkeypatch, tmp_path):
    spec = replace(load_spec(grid_spec(tmp_path, n_trials=50)), workers=None)
    for cores, load, n_trials, expected in ((16, 0.0, 50, batch.BATCH_TRIALS), (2, 0.0, 50, 2), (2, 1.2, 50, 1),
                                            (8, 30.0, 50, 1), (16, 0.0, 1, 1), (4, 1.0, 50, 3)):  # fmt: skip
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert batch.resolve_workers(replace(spec, n_trials=n_trials)) == expected, (cores, load, n_trials)
    assert batch.resolve_workers(replace(spec, workers=3)) == 3
    assert batch.resolve_workers(replace(spec, workers=64)) == batch.BATCH_TRIALS  # more would have no trial


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_killed_mid_trial_stops_the_study_with_a_clear_error(tmp_path):
    proc, out, log = start_slow_search(tmp_path, "crash.toml")
    try:
        workers = pool_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)  # as the OOM killer would
        assert proc.wait(timeout=120) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert f"(pid {workers[0]}) was killed by signal 9 while evaluating trial " in text, text
    assert "Traceback" not in text, text
    rows = trials_table(load_study_dir(out)).to_pylist()
    assert not any(r["state"] == "running" for r in rows), rows
    failed = {r["number"]: r for r in rows if r["state"] == "fail"}
    lost = int(text.split("while evaluating trial ")[1].split(";")[0])
    assert failed[lost]["outcome"] == "error" and "was killed by signal 9" in failed[lost]["reason"], failed
    assert all(r["outcome"] == "interrupted" for n, r in failed.items() if n != lost), failed  # the batch's others
    assert sum(r["state"] == "complete" for r in rows) < 100
    deadline = time.monotonic() + 60  # the other worker is stopped too
    while time.monotonic() < deadline and running(workers[1]):
        time.sleep(0.1)
    assert not running(workers[1]), "the other worker outlived the study"


def test_an_orphaned_workers_write_is_retried_then_given_up_with_a_word(monkeypatch, capsys):
    """Orphaned workers write trials.parquet at once: a failed write is tried again (backing off) until it
    succeeds, or until TRIALS_WRITE_S pass, and then says so on stderr instead of raising."""
    import servelab.search.trials as trials

    tries = []

    def flaky() -> None:
        tries.append(1)
        if len(tries) < 3:
            raise OSError("the journal is locked")

    trials.write_trials_retrying(flaky)
    assert len(tries) == 3 and capsys.readouterr().err == ""

    monkeypatch.setattr(trials, "TRIALS_WRITE_S", 0.25)

    def never() -> None:
        raise OSError("the journal is locked")

    trials.write_trials_retrying(never)
    assert "could not write trials.parquet: the journal is locked" in capsys.readouterr().err
