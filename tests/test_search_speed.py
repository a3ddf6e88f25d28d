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


def _pool_worker_trial(spec_path, study_dir, params: dict) -> tuple[str, list[str]]:
    """One trial as a pool worker runs it (search/pool.py `_worker_main`), in a fresh interpreter: its
    outcome and the Optuna modules the worker imported."""
    import pickle
    import subprocess
    import sys

    spec_pickle = study_dir.parent / "spec.pickle"
    spec_pickle.write_bytes(pickle.dumps(load_spec(spec_path)))
    code = f"""
import pickle, sys
from pathlib import Path
spec = pickle.loads(Path({str(spec_pickle)!r}).read_bytes())  # as the spawned worker gets it
from servelab.search.objective import Evaluator
from servelab.search.pool import evaluate, preload
preload(spec)
evaluator = Evaluator(spec, Path({str(study_dir)!r}), threads=1)
outcome = evaluate(evaluator, 0, {params!r})
evaluator.close()
print(outcome.state, outcome.user_attrs.get("reason", ""))
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] == "optuna")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    state_line, modules_line = (done.stdout.splitlines() + ["", ""])[:2]
    return state_line.split()[0], modules_line.split()


def test_a_pool_worker_evaluates_trials_without_importing_optuna(tmp_path):
    """A worker gets the parameters the parent drew: it needs no sampler or storage, and Optuna's import
    was ~80 ms of each worker's start (search/recorded.py)."""
    spec_path = grid_spec(tmp_path, n_trials=1)
    state, optuna_modules = _pool_worker_trial(spec_path, tmp_path / "study",
                                               {"max_num_seqs": 8, "max_num_batched_tokens": 512, "policy": "sarathi"})
    assert state == "complete"
    assert optuna_modules == []
    # an infeasible trial is pruned the same way (the Evaluator's own `Pruned`, not Optuna's)
    state, optuna_modules = _pool_worker_trial(spec_path, tmp_path / "study2",
                                               {"max_num_seqs": 0, "max_num_batched_tokens": 512, "policy": "sarathi"})
    assert (state, optuna_modules) == ("pruned", [])


def test_a_small_trace_is_scored_in_memory_not_read_back_from_its_files(tmp_path, monkeypatch):
    """A trial's run is written (for `servelab query trials/*`) but scored from the replay's Arrow tables in
    memory: no Parquet read, and for a small trace no DuckDB connection either (scoring/quick.py)."""
    import pyarrow.parquet as pq

    import servelab.scoring.memory as memory_module
    from servelab.scoring import SloTable, connect
    from servelab.search.pool import evaluate

    spec = load_spec(grid_spec(tmp_path, n_trials=1))
    evaluator = Evaluator(spec, tmp_path / "study")

    def refuse(*args, **kwargs):
        raise AssertionError("a trial's scoring went through files or DuckDB")

    with monkeypatch.context() as patched:
        for name in ("read_table", "ParquetFile", "ParquetDataset"):
            patched.setattr(pq, name, refuse)
        patched.setattr(memory_module, "RunConnection", refuse)  # (the scorer imports it from there, for DuckDB)
        try:
            outcome = evaluate(evaluator, 0, {"max_num_seqs": 8, "max_num_batched_tokens": 512, "policy": "sarathi"})
        finally:
            evaluator.close()
    assert outcome.state == "complete", outcome.user_attrs.get("reason")
    assert evaluator.scorer._run is None  # DuckDB never opened
    # the same number as the scoring views give on the run directory the trial wrote
    con = connect(tmp_path / "study" / outcome.user_attrs["trial_dir"], spec.slo)
    (att,) = con.execute("SELECT attainment FROM slo_attainment WHERE scope = 'overall'").fetchone()
    assert 0 < att < 1 and outcome.values == [att]


def test_a_study_on_a_small_trace_imports_neither_duckdb_nor_pyarrow_compute(tmp_path):
    """Importing DuckDB (~90 ms of CPU) and pyarrow.compute (~75 ms) was most of a 20-trial study's setup, ~8 ms a
    trial (bench/RESULTS.md, Session 25); a study that scores by numpy (scoring/quick.py) and prepares its trace by
    head and rate scale needs neither, in process or in what the `search` process imports for its pool workers."""
    import subprocess
    import sys

    from helpers_search import BASE_SPEC, GRID_SPACE, write_spec, write_trace_file

    write_trace_file(tmp_path)
    text = BASE_SPEC.format(n_trials=2).replace('trace = "trace.arrow"',
                                                'trace = { path = "trace.arrow", head = 150, rate_scale = 2.0 }')
    spec_path = write_spec(tmp_path, text + GRID_SPACE)
    probe = (
        "import sys\n"
        "from dataclasses import replace\n"
        "from servelab.search.pool import preload\n"
        "from servelab.search.spec import load_spec\n"
        "from servelab.search.study import run_study\n"
        "spec = load_spec(sys.argv[1])\n"
        "run_study(replace(spec, workers=1), sys.argv[2])\n"
        "preload(spec)\n"
        "print(sorted(m for m in ('duckdb', 'pyarrow.compute') if m in sys.modules))\n"
        "print('servelab.scoring.sources' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(spec_path), str(tmp_path / "study")], check=True,
                          capture_output=True, text=True)  # fmt: skip
    # (nor scoring/sources.py, the run directories' DuckDB tables, for a run's GPU count: scoring/gpus.py)
    assert done.stdout.split() == ["[]", "False"]
    assert {t.user_attrs["metrics"]["requests"] for t in load_study_dir(tmp_path / "study").trials} == {150}
    # nor does the whole command, its summary included (the policy's output-length note: scoring/lengths.py)
    command = ("import sys\n"
               "from servelab.cli.main import main\n"
               "try:\n    main(['search', sys.argv[1], '-o', sys.argv[2], '--workers', '1', '--no-progress'])\n"
               "except SystemExit as stop:\n    assert not stop.code, stop.code\n"
               "print(sorted(m for m in ('duckdb', 'pyarrow.compute') if m in sys.modules))\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", command, str(spec_path), str(tmp_path / "cli")], check=True,
                          capture_output=True, text=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr
    assert "best attainment" in done.stderr and (tmp_path / "cli" / "trials.parquet").is_file()


def test_a_trial_scored_by_numpy_writes_its_run_in_its_own_thread(tmp_path, monkeypatch):
    """With numpy's ~1.5 ms scoring, writing the run beside it in a second thread saved no time and cost ~2 ms of
    CPU a trial (bench/RESULTS.md, Session 25); a run DuckDB scores is still written while DuckDB works."""
    import threading

    import servelab.replay as replay_module
    from servelab.search.pool import evaluate

    spec = load_spec(grid_spec(tmp_path, n_trials=1))
    writers: list[str] = []
    real = replay_module.write_run

    def write_run(result, run_dir):
        writers.append(threading.current_thread().name)
        return real(result, run_dir)

    monkeypatch.setattr(replay_module, "write_run", write_run)
    params = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "policy": "sarathi"}
    for threads, study in ((None, "quick"), (2, "duckdb")):
        evaluator = Evaluator(spec, tmp_path / study, threads=threads)
        try:
            outcome = evaluate(evaluator, 0, params)
        finally:
            evaluator.close()
        assert outcome.state == "complete" and (tmp_path / study / "trials" / "0000" / "run.json").is_file()
    assert writers[0] == threading.current_thread().name
    assert writers[1].startswith("servelab-write")


def test_pool_workers_read_the_trace_the_parent_prepared(tmp_path):
    """A transformed trace is prepared (windowed, hashed, written to STUDY_DIR/trace.arrow) once, by the
    `search` process, before the first trial (before it forks the workers); each worker maps that file
    instead of preparing it again."""
    from dataclasses import replace

    from helpers_search import BASE_SPEC, GRID_SPACE, write_spec, write_trace_file
    from servelab.search.objective import prepare_trace

    write_trace_file(tmp_path)
    text = BASE_SPEC.format(n_trials=4).replace('trace = "trace.arrow"', 'trace = { path = "trace.arrow", head = 150 }')
    spec = load_spec(write_spec(tmp_path, text + GRID_SPACE))
    study_dir = tmp_path / "study"
    run_study(replace(spec, workers=2), study_dir)
    written_ns = (study_dir / "trace.arrow").stat().st_mtime_ns
    study = load_study_dir(study_dir)
    first_start = min(t.datetime_start for t in study.trials).timestamp() * 1e9
    assert written_ns < first_start  # (a worker preparing it again wrote it after the first trial was asked)
    assert {t.user_attrs["metrics"]["requests"] for t in study.trials} == {150}
    # an Evaluator given the prepared trace reads the same table
    table, path, meta = prepare_trace(spec, study_dir)
    evaluator = Evaluator(spec, study_dir, prepared=(path, meta))
    try:
        assert evaluator.trace.equals(table) and evaluator.trace_meta == meta
    finally:
        evaluator.close()


def _config_by_round_trip(base, space, values, source, gpu_budget=None, fill_pool=None, gpu_prices=None):
    """search/space.py's config_for before session 17: the whole base written as a table and parsed again."""
    from dataclasses import fields

    from servelab.policies.base import policy_class
    from servelab.replay.config import ReplayConfig
    from servelab.search.space import _with_pools

    by_name = {p.name: p for p in space}
    pooled = {(by_name[n].pool, by_name[n].key): v for n, v in values.items() if by_name[n].pool is not None}
    if pooled or gpu_budget is not None or (gpu_prices and base.cluster is not None):
        base = _with_pools(base, pooled, source, gpu_budget, fill_pool, gpu_prices)
    data = base.to_dict()
    params = dict(data.pop("policy_params", {}))
    for name, value in values.items():
        if not by_name[name].is_policy_param and by_name[name].pool is None:
            data[by_name[name].key] = value
    if data["policy"] != base.policy:
        own = {f.name for f in fields(policy_class(data["policy"]).Params)}
        params = {k: v for k, v in params.items() if k in own}
    for name, value in values.items():
        if by_name[name].is_policy_param:
            params[by_name[name].key] = value
    if params:
        data["policy_params"] = params
    return ReplayConfig.from_dict(data, source=source)


# a base with policy and router parameters, and a space that changes both: parameters the new policy
# shares are kept, others dropped; a router that lacks the base's router parameters is infeasible
SWITCHING = """
trace = "trace.arrow"
n_trials = 40
runner = "roofline"
[replay]
policy = "sjf"
router = "session"
replicas = 2
[replay.policy_params]
preempt = true
noise_sigma = 0.2
[replay.router_params]
balance = 2.0
[slo]
ttft_s = 1.0
[space]
policy = ["sjf", "srpt", "edf", "las", "vtc", "sarathi"]
router = ["session", "weighted", "round-robin"]
"policy_params.noise_sigma" = { low = 0.0, high = 1.0 }
max_num_seqs = { low = 1, high = 512, log = true }
tp = [1, 2]
[space.policy_params.sarathi]
long_prefill_threshold = { low = 0, high = 4096, step = 256 }
"""


def test_trial_configs_are_typed_variants_of_the_base_equal_to_a_parsed_table(tmp_path):
    """config_for puts only the trial's values over the typed base (``with_options``); the configs (and the
    errors of infeasible trials) are those the per-trial to_dict/from_dict round trip gave."""
    import glob
    from pathlib import Path

    from helpers_search import write_spec, write_trace_file
    from servelab.common.errors import ServelabError
    from servelab.search.space import config_for, suggest

    write_trace_file(tmp_path)
    examples = Path(__file__).resolve().parents[1] / "examples"
    paths = [write_spec(tmp_path, SWITCHING, "switching.toml"), *map(Path, sorted(glob.glob(str(examples / "search_*.toml"))))]
    checked = errors = 0
    for path in paths:
        spec = load_spec(path)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
        for _ in range(40):
            trial = study.ask()
            values = suggest(trial, spec.space, spec.base)
            kwargs = dict(source=f"trial {trial.number}", gpu_budget=spec.gpu_budget, fill_pool=spec.fill_pool,
                          gpu_prices=dict(spec.gpu_prices))  # fmt: skip
            outcomes = []
            for build in (config_for, _config_by_round_trip):
                try:
                    outcomes.append(build(spec.base, spec.space, values, **kwargs))
                except ServelabError as err:
                    outcomes.append(f"error: {err}")
            new, old = outcomes
            assert new == old, (path.name, values)
            if isinstance(new, str):
                errors += 1
            else:
                assert new.to_dict() == old.to_dict()
                checked += 1
            study.tell(trial, 0.0)
    assert checked > 300 and errors > 5  # (the switching spec's routers without `balance` are refused)


def test_the_objects_a_study_starts_with_are_frozen_during_its_trials_and_handed_back(tmp_path, monkeypatch):
    """search/batch.py: a full collection during the trials walks only what they made, not every object the
    `search` process had when they began (~45,000: Optuna, numpy, pyarrow; the first full one after the imports
    came during the trials, 15-30 ms of CPU); the caller's collector is as it was afterwards."""
    import gc

    from servelab.search.objective import Evaluator

    spec = load_spec(grid_spec(tmp_path, n_trials=2))
    frozen_in_trials: list[int] = []
    real_call = Evaluator.__call__
    monkeypatch.setattr(Evaluator, "__call__", lambda self, trial: (frozen_in_trials.append(gc.get_freeze_count()),
                                                                     real_call(self, trial))[1])  # fmt: skip
    assert gc.get_freeze_count() == 0
    run_study(spec, tmp_path / "study")
    assert len(frozen_in_trials) == 2 and min(frozen_in_trials) > 10_000
    assert gc.get_freeze_count() == 0  # unfrozen again
    # a caller that froze objects itself keeps them frozen
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        run_study(load_spec(grid_spec(tmp_path, n_trials=3)), tmp_path / "study2")
        assert gc.get_freeze_count() > before // 2  # (not unfrozen: a frozen object freed leaves the count)
    finally:
        gc.unfreeze()
