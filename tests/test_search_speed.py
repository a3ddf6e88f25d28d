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


def test_a_batch_of_tells_is_one_journal_append_and_reads_back_the_same(tmp_path, monkeypatch):
    """search/journal_file.py batched(): records held in memory under the lock, read back from there, written once."""
    from servelab.search.journal_file import CachedJournalFileBackend
    from servelab.search.storage import batched_writes

    writes: list[int] = []
    real_write = CachedJournalFileBackend._write
    monkeypatch.setattr(CachedJournalFileBackend, "_write", lambda self, logs: (writes.append(len(logs)), real_write(self, logs)))
    path = tmp_path / "study.journal"
    study = optuna.create_study(study_name="s", storage=journal_storage(path))
    writes.clear()
    with batched_writes(study):
        trials = [study.ask() for _ in range(3)]
        for i, trial in enumerate(trials):
            x = trial.suggest_int("x", 0, 10)
            trial.set_user_attr("note", f"trial {i}")
            assert study.get_trials(deepcopy=False)[i].params == {"x": x}  # read back before it is written
        for i, trial in enumerate(trials):
            study.tell(trial, float(i))
        assert writes == [] and not path.read_bytes().count(b'"note"')
    assert len(writes) == 1 and writes[0] >= 12  # 3 x (create, param, attribute, result): one append
    again = optuna.load_study(study_name="s", storage=journal_storage(path))
    assert [(t.params, t.user_attrs, t.value, t.state) for t in again.trials] == \
        [(t.params, t.user_attrs, t.value, t.state) for t in study.trials]
    study.tell(study.ask(), 5.0)  # outside a batch: each record written at once again
    assert writes[1:] == [1, 1]
