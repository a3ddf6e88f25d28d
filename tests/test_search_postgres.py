"""Distributed search: two `servelab search worker` processes, as if on two machines, share one study in PostgreSQL.

Needs SERVELAB_TEST_POSTGRES_URL (CI's .ci/postgres.sh starts a throwaway server and sets it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers_search import grid_spec

SYNC_WORKERS = Path(__file__).parent / "sync_workers.py"
URL = os.environ.get("SERVELAB_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not URL, reason="SERVELAB_TEST_POSTGRES_URL is unset (run .ci/postgres.sh to get a server)")


@pytest.fixture
def study_name():
    import optuna

    from servelab.search.study import sqlalchemy_url

    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        optuna.delete_study(study_name=name, storage=sqlalchemy_url(URL))
    except KeyError:
        pass


def test_two_workers_share_a_postgres_study(tmp_path, study_name):
    import optuna
    from optuna.trial import TrialState

    from servelab.search.study import sqlalchemy_url

    n = 12
    spec = grid_spec(tmp_path, n_trials=n, top=f'storage = "{URL}"\nstudy_name = "{study_name}"\n', trace_n=3000)
    machines = [tmp_path / "machine_a", tmp_path / "machine_b"]
    meet = [sys.executable, str(SYNC_WORKERS), str(tmp_path / "met"), "2"]  # each takes a trial before the other ends
    procs = [subprocess.Popen([*meet, "search", "worker", str(spec), "-o", str(m)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for m in machines]  # fmt: skip
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err.decode()
    study = optuna.load_study(study_name=study_name, storage=sqlalchemy_url(URL))
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == n  # none lost
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    assert all(t.user_attrs.get("outcome") == "surplus" and not t.params for t in trials if t.state == TrialState.FAIL)
    assert sorted(t.number for t in trials) == list(range(len(trials)))  # none numbered twice
    workers = {t.user_attrs["worker"] for t in complete}
    assert len(workers) == 2  # both took part
    # each complete trial's run is on exactly one machine, and that run is the trial's own config
    for t in complete:
        homes = [m for m in machines if (m / "trials" / f"{t.number:04d}" / "run.json").is_file()]
        assert len(homes) == 1
        meta = (homes[0] / "trials" / f"{t.number:04d}" / "run.json").read_text()
        assert f'"trial": {t.number}' in meta
    # each machine's trials.parquet lists the whole study as its worker left it: the first to stop
    # may leave while the other finishes the last trial
    done = [pq.read_table(m / "trials.parquet").column("state").to_pylist().count("complete") for m in machines]
    assert max(done) == n and min(done) >= n - 1


def test_a_topology_study_runs_on_a_postgres_worker(tmp_path, study_name):
    """A cluster spec (pool keys, cost per million tokens under the attainment constraint) goes through
    the same worker path: every trial's config carries its cluster, and the database study's best is
    the one a local (journal) run of the same spec finds."""
    import optuna

    from servelab.replay.config import ReplayConfig
    from servelab.search.study import sqlalchemy_url

    example = Path(__file__).resolve().parents[1] / "examples" / "search_topology_hardware.toml"
    text = example.read_text().replace('path = "../data/', f'path = "{example.parent.parent / "data"}/')
    local = tmp_path / "local.toml"
    local.write_text(text)
    shared = tmp_path / "shared.toml"
    shared.write_text(f'storage = "{URL}"\nstudy_name = "{study_name}"\n' + text)
    run = [sys.executable, "-m", "servelab"]
    for args in (["search", str(local), "-o", str(tmp_path / "local"), "--no-progress"],
                 ["search", "worker", str(shared), "-o", str(tmp_path / "machine")]):  # fmt: skip
        done = subprocess.run([*run, *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name=study_name, storage=sqlalchemy_url(URL))
    assert len(study.trials) == 8  # complete, and "infeasible" exactly where the attainment constraint fails
    assert all(t.user_attrs["outcome"] == ("ok" if t.constraints["attainment"] <= 0 else "infeasible") for t in study.trials)
    assert all(len(t.user_attrs["config"]["cluster"]["pools"]) == 2 for t in study.trials)
    assert sum(t.constraints["attainment"] > 0 for t in study.trials) >= 1  # infeasible trials are in the database
    bests = []
    for folder in ("local", "machine"):
        out = tmp_path / f"{folder}-best.toml"
        done = subprocess.run([*run, "search", "best", str(tmp_path / folder), "-o", str(out)], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        bests.append(ReplayConfig.from_toml(out).cluster)
    assert bests[0] == bests[1]
    assert [(p.name, dict(p.settings)["gpu"], p.replicas) for p in bests[0].pools] == \
        [("prefill", "h100-80gb", 1), ("decode", "a100-80gb", 1)]
