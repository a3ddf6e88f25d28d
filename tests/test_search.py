"""Search: optimum found on a known grid, objectives (attainment, goodput, cost, several), pruning, infeasible
settings, resume (also after kill -9 and Ctrl-C), local workers, trials.parquet, best-config round trip, plots."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers_search import GRID_SPACE, POLICIES, RUNNER, SEQS, SLO, TOKENS, grid_spec, write_spec, write_trace_file
from helpers_search import trials_table as _table
from servelab.cli.main import main
from servelab.api import ReplayConfig, replay, write_run
from servelab.scoring.db import connect
from servelab.scoring.slo import SloTable
from servelab.search.scorer import RunScorer
from servelab.search.spec import load_spec
from servelab.search.study import counts, run_study
from servelab.search.trials import load_study_dir
from servelab.traces.io import read_trace

SLO_TABLE = SloTable.parse_cli([f"ttft={SLO['ttft_s']},tpot={SLO['tpot_s']}"])
SERVELAB = [sys.executable, "-m", "servelab"]


def _cli(*args: str) -> None:
    try:
        main(list(args))
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise AssertionError(f"servelab {' '.join(args)} exited {exit_.code}") from None


def _config(seqs: int, tokens: int, policy: str) -> ReplayConfig:
    return ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 4000, "max_num_seqs": seqs,
                                   "max_num_batched_tokens": tokens, "policy": policy})  # fmt: skip


@pytest.fixture(scope="module")
def exhaustive(grid_dir) -> dict:
    """Attainment of every point of the test grid, by plain replays."""
    trace = read_trace(grid_dir / "trace.arrow")
    scorer = RunScorer(SLO_TABLE)
    try:
        return {(s, t, p): scorer.attainment(replay(trace, _config(s, t, p)))
                for s, t, p in itertools.product(SEQS, TOKENS, POLICIES)}  # fmt: skip
    finally:
        scorer.close()


def test_scorer_matches_the_scoring_views_on_the_written_run(grid_dir, tmp_path):
    trace = read_trace(grid_dir / "trace.arrow")
    result = replay(trace, _config(8, 512, "sarathi"))
    scorer = RunScorer(SLO_TABLE)
    scores = scorer.score(result)
    early = scorer.attainment(result, arrived_by_s=3.0)
    scorer.close()
    write_run(result, tmp_path / "run")
    con = connect(tmp_path / "run", SLO_TABLE)
    att, att_ttft = con.execute("SELECT attainment, attainment_ttft FROM slo_attainment WHERE scope = 'overall'").fetchone()
    p99 = con.execute("SELECT p99 FROM latency_summary WHERE scope = 'overall' AND metric = 'tpot_s'").fetchone()[0]
    (early_sql,) = con.execute("SELECT count(*) FILTER (WHERE met_all) / count(*) FROM request_metrics WHERE arrival_s <= 3").fetchone()
    assert 0 < att < 1  # the case is not trivial
    assert scores["attainment"] == pytest.approx(att, abs=1e-12)
    assert scores["attainment_ttft"] == pytest.approx(att_ttft, abs=1e-12)
    assert scores["tpot_p99"] == pytest.approx(p99, rel=1e-12)
    assert scores["attainment.tier.standard"] == pytest.approx(att, abs=1e-12)
    assert early == pytest.approx(early_sql, abs=1e-12)


def test_scorer_per_tier_attainment_matches_the_views(grid_dir, tmp_path):
    """With one tier the scorer skips the per-tier pass (its row equals the overall one); with two it
    runs it: both agree with slo_attainment on the written run."""
    import pyarrow as pa

    trace = read_trace(grid_dir / "trace.arrow")
    tiers = pa.array(["priority" if i % 3 == 0 else "standard" for i in range(trace.num_rows)])
    two_tiers = trace.set_column(trace.column_names.index("tier"), "tier", tiers) if "tier" in trace.column_names \
        else trace.append_column("tier", tiers)
    for name, t in (("one", trace), ("two", two_tiers)):
        result = replay(t, _config(8, 512, "sarathi"))
        scorer = RunScorer(SLO_TABLE)
        scores = scorer.score(result)
        scorer.close()
        write_run(result, tmp_path / name)
        con = connect(tmp_path / name, SLO_TABLE)
        expected = dict(con.execute("SELECT name, attainment FROM slo_attainment WHERE scope = 'tier'").fetchall())
        got = {k.removeprefix("attainment.tier."): v for k, v in scores.items() if k.startswith("attainment.tier.")}
        assert got.keys() == expected.keys() and len(got) == (1 if name == "one" else 2)
        for tier, value in expected.items():
            assert got[tier] == pytest.approx(value, abs=1e-12)
        if name == "two":
            assert len(set(got.values())) == 2  # the tiers really differ


def test_tpe_reaches_the_grid_optimum(grid_dir, exhaustive, tmp_path):
    best_possible = max(exhaustive.values())
    near = sum(v >= 0.98 * best_possible for v in exhaustive.values())
    assert best_possible < 1 and near <= 10  # few of the 70 points are within 2% (4 when written)
    spec = grid_spec(grid_dir, n_trials=50, name="tpe.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "study"), "--no-progress")
    rows = _table(tmp_path / "study")
    assert len(rows) == 50 and all(r["state"] == "complete" for r in rows)
    best = max(r["attainment"] for r in rows)
    assert best >= 0.98 * best_possible
    for r in rows:  # every trial scored what a plain replay of its settings scores
        key = (r["param.max_num_seqs"], r["param.max_num_batched_tokens"], r["param.policy"])
        assert r["attainment"] == pytest.approx(exhaustive[key], abs=1e-12)


def test_seeded_study_is_reproducible_and_trials_are_runs(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=6, name="repro.toml")
    for name in ("a", "b"):
        _cli("search", "run", str(spec), "-o", str(tmp_path / name), "--no-progress")
    cols = ("number", "state", "attainment", "param.max_num_seqs", "param.max_num_batched_tokens", "param.policy")
    a, b = ([{c: r[c] for c in cols} for r in _table(tmp_path / n)] for n in ("a", "b"))
    assert a == b
    for n in range(6):
        assert (tmp_path / "a" / "trials" / f"{n:04d}" / "requests.parquet").is_file()
    con = connect([str(tmp_path / "a" / "trials" / "*")], SLO_TABLE)
    rows = con.execute("SELECT run_id, attainment FROM slo_attainment WHERE scope = 'overall' ORDER BY run_id").fetchall()
    assert [r[1] for r in rows] == pytest.approx([r["attainment"] for r in _table(tmp_path / "a")])
    meta = json.loads((tmp_path / "a" / "trials" / "0003" / "run.json").read_text())
    assert meta["search"]["trial"] == 3


def test_conditional_policy_parameters(grid_dir, tmp_path):
    space = """
[space]
policy = ["sarathi", "vllm-v0", "round-robin"]
max_num_seqs = { low = 2, high = 32, log = true }
[space.policy_params.sarathi]
long_prefill_threshold = { low = 0, high = 1024 }
[space.policy_params.round-robin]
quantum = { low = 1, high = 8 }
"""
    spec = grid_spec(grid_dir, n_trials=12, space=space, name="cond.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    assert {r["param.policy"] for r in rows} >= {"sarathi", "vllm-v0"}
    for r in rows:
        config = json.loads(r["attr.config"])
        has_lpt = r["param.policy_params.sarathi.long_prefill_threshold"] is not None
        has_quantum = r["param.policy_params.round-robin.quantum"] is not None
        assert has_lpt == (r["param.policy"] == "sarathi")
        assert has_quantum == (r["param.policy"] == "round-robin")
        assert config["policy"] == r["param.policy"]
        if has_lpt:
            assert config["policy_params"] == {"long_prefill_threshold": r["param.policy_params.sarathi.long_prefill_threshold"]}
        if r["param.policy"] == "vllm-v0":
            assert "policy_params" not in config


def test_goodput_objective_agrees_with_servelab_sweep(grid_dir, tmp_path):
    space = "[space]\nmax_num_seqs = [4, 8]\n"
    spec = grid_spec(grid_dir, n_trials=2, top='objective = ["goodput", "goodput_per_gpu"]\ntarget = 0.9\nsampler = "grid"\n',
                     tables="[goodput]\ntolerance = 0.05\n", space=space, name="goodput.toml")  # fmt: skip
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = {r["param.max_num_seqs"]: r for r in _table(tmp_path / "s")}
    assert set(rows) == {4, 8}
    for seqs, row in rows.items():
        config = tmp_path / f"c{seqs}.toml"
        config.write_text(f'runner = "{RUNNER}"\nnum_gpu_blocks = 4000\nmax_num_seqs = {seqs}\n')
        _cli("sweep", str(grid_dir / "trace.arrow"), "--config", str(config), "--goodput-target", "0.9",
             "--tolerance", "0.05", "--slo", f"ttft={SLO['ttft_s']},tpot={SLO['tpot_s']}", "-o", str(tmp_path / f"sw{seqs}"))  # fmt: skip
        sweep = json.loads((tmp_path / f"sw{seqs}" / "sweep.json").read_text())
        assert sweep["goodput_rate_rps"] > 0
        assert row["goodput"] == pytest.approx(sweep["goodput_rate_rps"], rel=1e-12)
        assert row["goodput_per_gpu"] == pytest.approx(sweep["goodput_rate_per_gpu"], rel=1e-12)
        trial_sweep = json.loads((tmp_path / "s" / row["attr.trial_dir"] / "sweep.json").read_text())
        assert trial_sweep["bracket_rps"] == sweep["bracket_rps"]


def test_cost_objective_picks_the_cheapest_config_meeting_the_target(grid_dir, tmp_path):
    space = "[space]\nmax_num_seqs = [4, 8]\nreplicas = { low = 1, high = 3 }\n"
    spec = grid_spec(grid_dir, n_trials=6, top='objective = "cost"\ntarget = 0.99\nsampler = "grid"\n',
                     tables='[cost]\ngpu_prices = { "h100-80gb" = 2.5 }\n', space=space, name="cost.toml")  # fmt: skip
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    assert len(rows) == 6
    for r in rows:
        assert r["cost"] == pytest.approx(2.5 * r["param.replicas"])
    feasible = [r for r in rows if r["attr.attainment"] >= 0.99]
    infeasible = [r for r in rows if r["attr.attainment"] < 0.99]
    assert feasible and infeasible  # the target splits the space
    # each says so: a `feasible` column and an outcome (it used to be `ok` for both)
    assert all(r["feasible"] is True and r["outcome"] == "ok" and r["reason"] is None for r in feasible)
    for r in infeasible:
        assert r["state"] == "complete" and r["feasible"] is False and r["outcome"] == "infeasible", r
        assert r["reason"] == f"infeasible: attainment {r['attr.attainment']:.4f} < target 0.99"
        assert "attr.constraint_violation" not in r
    cheapest = min(r["cost"] for r in feasible)
    assert cheapest > min(r["cost"] for r in rows)  # the cheapest overall misses the target
    _cli("search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "best.toml"))
    best = ReplayConfig.from_toml(tmp_path / "best.toml")
    assert best.engine.replicas * 2.5 == pytest.approx(cheapest)


def test_multi_objective_pareto_front_best_and_plots(grid_dir, tmp_path):
    space = "[space]\nmax_num_seqs = { low = 1, high = 64, log = true }\nmax_num_batched_tokens = { low = 128, high = 2048, step = 128 }\n"
    spec = grid_spec(grid_dir, n_trials=10, top='objective = ["attainment", "ttft_p99"]\n', space=space, name="mo.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    study = load_study_dir(tmp_path / "s")
    front = study.best_trials
    assert front
    for t in front:  # nothing in the study dominates a front member
        for u in study.trials:
            assert not (u.values[0] >= t.values[0] and u.values[1] <= t.values[1] and u.values != t.values)
    _cli("search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "best.toml"))
    best = ReplayConfig.from_toml(tmp_path / "best.toml")
    top = max(front, key=lambda t: (t.values[0], -t.number))
    assert best.engine.max_num_seqs == top.params["max_num_seqs"]
    _cli("search", "plot", str(tmp_path / "s"))
    for name in ("pareto", "history_attainment", "history_ttft_p99", "importances_attainment", "parallel_ttft_p99"):
        png = tmp_path / "s" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pruning_reports_honest_checkpoints(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=16, name="prune.toml",
                     top='pruner = { name = "median", n_startup_trials = 2, checkpoints = [0.25, 0.5] }\n')  # fmt: skip
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    pruned = [r for r in rows if r["state"] == "pruned"]
    complete = [r for r in rows if r["state"] == "complete"]
    assert pruned and complete
    for r in pruned:
        assert r["reason"].startswith("pruned at") and [i["step"] for i in r["intermediate"]][-1] in (25, 50)
        assert not (tmp_path / "s" / "trials" / f"{r['number']:04d}").exists()
    # a checkpoint is the full run seen up to its horizon: replay causality makes the values exact
    trace = read_trace(grid_dir / "trace.arrow")
    arrivals = trace.column("arrival_s").to_pylist()
    r = complete[0]
    config = _config(r["param.max_num_seqs"], r["param.max_num_batched_tokens"], r["param.policy"])
    horizon = arrivals[0] + 0.25 * (arrivals[-1] - arrivals[0])
    full = replay(trace, config).requests.to_pylist()
    cut = replay(trace, ReplayConfig.from_dict({**config.to_dict(), "until_s": horizon})).requests.to_pylist()
    for a, b in zip(full, cut):
        if a["finish_s"] is not None and a["finish_s"] <= horizon:
            assert b["finish_s"] == a["finish_s"]
    scorer = RunScorer(SLO_TABLE)
    assert r["intermediate"][0]["value"] == pytest.approx(
        scorer.attainment(replay(trace, ReplayConfig.from_dict({**config.to_dict(), "until_s": horizon})), horizon))
    scorer.close()


def test_infeasible_settings_are_pruned_with_a_reason(grid_dir, tmp_path):
    text = """
trace = "trace.arrow"
n_trials = 6
runner = "roofline"
model = "llama-3.1-70b"
[slo]
ttft_s = 1.0
[space]
tp = [1, 2]
max_num_seqs = [8, 16, 32]
"""
    spec = write_spec(grid_dir, text, "infeasible.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    assert len(rows) == 6
    bad = [r for r in rows if r["param.tp"] == 1]
    good = [r for r in rows if r["param.tp"] == 2]
    assert bad and good
    for r in bad:
        assert r["state"] == "pruned" and r["outcome"] == "infeasible"
        assert r["reason"].startswith("infeasible:") and "does not fit" in r["reason"]
    assert all(r["state"] == "complete" for r in good)


def test_resume_continues_without_repeating(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=4, name="resume.toml")
    out = tmp_path / "s"
    _cli("search", str(spec), "-o", str(out), "--no-progress")
    first = _table(out)
    _cli("search", str(spec), "-o", str(out), "--no-progress", "--n-trials", "7")
    second = _table(out)
    assert [r["number"] for r in second] == list(range(7))
    cols = ("number", "attainment", "param.max_num_seqs", "param.policy", "datetime_start")
    assert [{c: r[c] for c in cols} for r in second[:4]] == [{c: r[c] for c in cols} for r in first]
    _cli("search", str(spec), "-o", str(out), "--no-progress", "--n-trials", "7")  # already done: nothing new
    assert len(_table(out)) == 7


def test_changed_spec_is_refused(grid_dir, tmp_path, capsys):
    spec = grid_spec(grid_dir, n_trials=2, name="changed.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    spec.write_text(spec.read_text().replace("ttft_s = 0.3", "ttft_s = 0.4"))
    with pytest.raises(SystemExit) as exit_:
        main(["search", str(spec), "-o", str(tmp_path / "s"), "--no-progress"])
    assert exit_.value.code == 1
    assert "different spec (changed: slo)" in capsys.readouterr().err


def test_local_workers_share_the_study(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=10, name="workers.toml", top="workers = 2\n")
    meet = [sys.executable, str(Path(__file__).parent / "sync_workers.py"), str(tmp_path / "met"), "2"]
    subprocess.run([*meet, "search", str(spec), "-o", str(tmp_path / "s"), "--no-progress"], check=True, timeout=300)
    rows = _table(tmp_path / "s")
    complete = [r for r in rows if r["state"] == "complete"]
    assert len(complete) == 10
    assert all(r["outcome"] == "surplus" for r in rows if r["state"] != "complete")
    assert len({r["attr.worker"] for r in complete}) == 2
    dirs = sorted(p.name for p in (tmp_path / "s" / "trials").iterdir())
    assert dirs == [f"{r['number']:04d}" for r in complete]


def _start(spec: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*SERVELAB, "search", str(spec), "-o", str(out), "--no-progress", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip


def _wait_for_trials(out: Path, n: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        trials = out / "trials"
        if trials.is_dir() and sum(1 for p in trials.iterdir() if not p.name.startswith(".")) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("no trials appeared")


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory) -> Path:
    """A trace big enough that a trial lasts a good fraction of a second (a kill lands mid-trial)."""
    folder = tmp_path_factory.mktemp("slow")
    write_trace_file(folder, n=6000)
    return folder


def _wait_until_group_exits(pgid: int, timeout_s: float = 10.0) -> None:
    """Until no process of group ``pgid`` is left running (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


def test_resume_after_kill_9(slow_dir, tmp_path):
    from optuna.trial import TrialState

    spec = grid_spec(slow_dir, n_trials=8, name="kill.toml", top="workers = 2\n")
    out = tmp_path / "s"
    proc = _start(spec, out)
    _wait_for_trials(out, 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers: no cleanup at all
    proc.wait()
    _wait_until_group_exits(proc.pid)  # SIGKILL is delivered asynchronously: a worker may still be exiting
    study = load_study_dir(out)
    running = [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
    done_before = {t.number: t.params for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert running  # the kill left trials mid-way
    _cli("search", str(spec), "-o", str(out), "--no-progress")
    study = load_study_dir(out)
    c = counts(study)
    states = [(t.number, t.state.name, t.user_attrs.get("outcome"), t.user_attrs.get("reason")) for t in study.trials]
    assert c["complete"] == 8 and c["running"] == 0, (running, states)
    for t in study.trials:
        if t.number in running:
            assert t.state == TrialState.FAIL and t.user_attrs["outcome"] == "stale"
        if t.number in done_before:
            assert t.state == TrialState.COMPLETE and t.params == done_before[t.number]
    names = sorted(p.name for p in (out / "trials").iterdir())
    assert names == [f"{t.number:04d}" for t in study.trials if t.state == TrialState.COMPLETE]  # no half-written dirs


def test_ctrl_c_stops_cleanly_and_keeps_finished_trials(slow_dir, tmp_path):
    spec = grid_spec(slow_dir, n_trials=30, name="ctrlc.toml")
    out = tmp_path / "s"
    proc = _start(spec, out)
    _wait_for_trials(out, 3, proc)  # the third may be interrupted between its write and its tell
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"finished trials are kept" in err
    rows = _table(out)
    complete = [r["number"] for r in rows if r["state"] == "complete"]
    assert 2 <= len(complete) < 30
    assert not any(r["state"] == "running" for r in rows)
    # the trial in flight (if Ctrl-C did not land between two trials) is failed as interrupted
    assert [r["outcome"] for r in rows if r["state"] == "fail"] in ([], ["interrupted"])
    assert sorted(p.name for p in (out / "trials").iterdir()) == [f"{n:04d}" for n in complete]
    _cli("search", str(spec), "-o", str(out), "--no-progress", "--n-trials", str(len(complete) + 1))
    assert sum(r["state"] == "complete" for r in _table(out)) == len(complete) + 1


def test_best_config_round_trip_through_servelab_replay(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=8, name="best.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    best_row = max(_table(tmp_path / "s"), key=lambda r: (r["attainment"], -r["number"]))
    _cli("search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "best.toml"))
    config = ReplayConfig.from_toml(tmp_path / "best.toml")
    assert config.to_dict() == json.loads(best_row["attr.config"])
    _cli("replay", str(grid_dir / "trace.arrow"), "--config", str(tmp_path / "best.toml"), "-o", str(tmp_path / "run"),
         "--no-report")  # fmt: skip
    con = connect(tmp_path / "run", SLO_TABLE)
    (att,) = con.execute("SELECT attainment FROM slo_attainment WHERE scope = 'overall'").fetchone()
    assert att == pytest.approx(best_row["attainment"], abs=1e-12)


def test_trials_parquet_columns(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=3, name="cols.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    table = pq.read_table(tmp_path / "s" / "trials.parquet")
    names = set(table.column_names)
    for col in ("number", "state", "outcome", "duration_s", "attainment", "param.max_num_seqs", "param.policy",
                "attr.attainment.tier.standard", "attr.ttft_p99", "attr.tpot_p99", "attr.replay_s", "attr.worker"):  # fmt: skip
        assert col in names, col
    assert str(table.schema.field("param.max_num_seqs").type) == "int64"
    assert all(d > 0 for d in table.column("duration_s").to_pylist())


SAMPLERS = ["tpe", "random", "grid", "nsga2", "cmaes"]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_runs_a_study(grid_dir, tmp_path, sampler):
    """The same invariants for each sampler: n_trials finished, each a run scored like a plain replay."""
    if sampler == "cmaes":
        pytest.importorskip("cmaes", reason="sampler 'cmaes' needs the cmaes package")
    space = "[space]\nmax_num_seqs = { low = 2, high = 32, step = 2 }\nmax_num_batched_tokens = [256, 512, 1024]\n"
    spec = grid_spec(grid_dir, n_trials=5, top=f'sampler = "{sampler}"\n', space=space, name=f"s_{sampler}.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    assert sum(r["state"] == "complete" for r in rows) == 5
    trace = read_trace(grid_dir / "trace.arrow")
    scorer = RunScorer(SLO_TABLE)
    r = rows[-1]
    expected = scorer.attainment(replay(trace, _config(r["param.max_num_seqs"], r["param.max_num_batched_tokens"], "sarathi")))
    scorer.close()
    assert r["attainment"] == pytest.approx(expected, abs=1e-12)
    if sampler == "grid":
        points = {(r["param.max_num_seqs"], r["param.max_num_batched_tokens"]) for r in rows}
        assert len(points) == 5  # a grid never repeats a point


def test_hyperband_pruner_and_timeout(grid_dir, tmp_path):
    spec = grid_spec(grid_dir, n_trials=10, name="hb.toml", top='pruner = "hyperband"\n')
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    rows = _table(tmp_path / "s")
    assert sum(r["state"] in ("complete", "pruned") for r in rows) == 10
    assert all(r["intermediate"] and r["intermediate"][0]["step"] == 25 for r in rows)
    _cli("search", str(spec), "-o", str(tmp_path / "t"), "--no-progress", "--n-trials", "1000", "--timeout", "0.5")
    assert 1 <= len(_table(tmp_path / "t")) < 1000


def test_best_and_plot_errors(grid_dir, tmp_path, capsys):
    for args in (["search", "best", str(tmp_path), "-o", str(tmp_path / "b.toml")], ["search", "plot", str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 1
        assert f"{tmp_path}: not a study directory (no study.json)" in capsys.readouterr().err
    assert not (tmp_path / "b.toml").exists() and not (tmp_path / "plots").exists()
    spec = grid_spec(grid_dir, n_trials=2, name="errs.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    with pytest.raises(SystemExit):
        main(["search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "b.toml"), "--trial", "7"])
    assert "has no trial 7" in capsys.readouterr().err
    assert not (tmp_path / "b.toml").exists()
    _cli("search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "b.toml"), "--trial", "1")
    assert ReplayConfig.from_toml(tmp_path / "b.toml").to_dict() == json.loads(_table(tmp_path / "s")[1]["attr.config"])


def test_unexpected_errors_fail_trials_and_stop_after_five_in_a_row(grid_dir, tmp_path, monkeypatch):
    from servelab.common.errors import ServelabError
    from servelab.search import objective

    def boom(self, trial, config, attrs):
        raise RuntimeError("boom")

    monkeypatch.setattr(objective.Evaluator, "_evaluate", boom)
    spec = load_spec(grid_spec(grid_dir, n_trials=20, name="boom.toml"))
    with pytest.raises(ServelabError, match="5 trials in a row failed; the last: error: RuntimeError: boom"):
        run_study(spec, tmp_path / "s")
    study = load_study_dir(tmp_path / "s")
    assert [t.user_attrs["outcome"] for t in study.trials] == ["error"] * 5
    assert counts(study)["fail"] == 5


def test_best_toml_carries_the_studys_slo(grid_dir, tmp_path, capsys):
    """best.toml holds the study's [slo] (it once had none, so its replay said "SLO: none given"), as
    recommend's recommended.toml does; a study begun before the SLO was recorded takes it from its spec."""
    import tomllib
    from types import SimpleNamespace

    from servelab.search.storage import SLO_ATTR
    from servelab.search.trials import study_slo

    spec = grid_spec(grid_dir, n_trials=2, name="best_slo.toml")
    _cli("search", str(spec), "-o", str(tmp_path / "s"), "--no-progress")
    _cli("search", "best", str(tmp_path / "s"), "-o", str(tmp_path / "best.toml"))
    assert tomllib.loads((tmp_path / "best.toml").read_text())["slo"] == SLO
    capsys.readouterr()
    _cli("replay", str(grid_dir / "trace.arrow"), "--config", str(tmp_path / "best.toml"), "-o", str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "SLO: none given" not in out and "ttft_s=0.3" in out, out
    study = load_study_dir(tmp_path / "s")
    older = SimpleNamespace(user_attrs={k: v for k, v in study.user_attrs.items() if k != SLO_ATTR})
    assert study_slo(older, tmp_path / "s") == SLO
    spec.write_text(spec.read_text().replace("ttft_s = 0.3", "ttft_s = 0.4"))  # no longer this study's spec
    assert study_slo(older, tmp_path / "s") is None
