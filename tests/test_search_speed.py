"""Issue #31, fast searches: a trial's storage writes skip the per-record fsync, small runs score on one DuckDB thread."""

from __future__ import annotations

import os

import optuna

from helpers_search import grid_spec
from servelab.search.objective import Evaluator
from servelab.search.spec import load_spec
from servelab.search.study import journal_storage, run_study
from servelab.search.trials import load_study_dir


def test_a_study_fsyncs_its_journal_once_per_run_not_per_record(tmp_path, monkeypatch):
    spec = load_spec(grid_spec(tmp_path, n_trials=4))
    journal = tmp_path / "study" / "study.journal"
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    run_study(spec, tmp_path / "study")
    # Optuna's own backend fsyncs every record: ~12 a trial, ~50 here
    assert synced.count(str(journal)) == 1
    # the records are all there, and the journal reads back as the same study
    assert len(load_study_dir(tmp_path / "study").trials) == 4
    study = optuna.load_study(study_name=spec.study_name, storage=journal_storage(journal))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert study.trials[0].user_attrs["outcome"] == "ok"


def test_a_small_trace_is_scored_on_one_duckdb_thread(tmp_path):
    spec = load_spec(grid_spec(tmp_path, n_trials=1))
    evaluator = Evaluator(spec, tmp_path / "study")
    try:
        assert evaluator.scorer.con.execute("SELECT current_setting('threads')").fetchone()[0] == 1
    finally:
        evaluator.close()
    evaluator = Evaluator(spec, tmp_path / "study", threads=2)  # an explicit count is kept
    try:
        assert evaluator.scorer.con.execute("SELECT current_setting('threads')").fetchone()[0] == 2
    finally:
        evaluator.close()
