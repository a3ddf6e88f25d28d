"""`servelab recommend` (issue #30 part 2): the recommendation meets the SLO when its written config is
replayed by `servelab replay --config`, no configuration of a brute-forced grid (replayed and scored
here, in plain Python, independently of the search and the SQL views) is cheaper and meets it, and
bad input is one line. A 160-request synthetic trace on the roofline runner keeps each study to
seconds."""

from __future__ import annotations

import itertools
import os
import uuid
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from servelab.api import ReplayConfig, replay
from servelab.cli.main import main
from servelab.traces.io import read_trace

PRICES = {"h100-80gb": 2.49, "a100-80gb": 1.29}
SLO = {"ttft_s": 0.5, "tpot_s": 0.03}
TARGET = 0.9
GRID = {"gpu": list(PRICES), "tp": [1, 2], "replicas": [1, 2, 3]}  # 12 colocated configurations


def cli(*args: str, expect: int = 0, capsys=None) -> tuple[str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    assert code == expect, (code, out, err)
    return out, err


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.arrow"
    main(["trace", "synth", "-o", str(path), "-n", "160", "--rate", "20", "--prompt", "lognormal:1000:0.5",
          "--output-len", "lognormal:150:0.5", "--seed", "3"])  # fmt: skip
    return path


def recommend_args(trace: Path, study: Path, *extra: str) -> list[str]:
    return ["recommend", str(trace), "--slo", "ttft=0.5,tpot=0.03", "--gpu", "h100-80gb=2.49", "--gpu", "a100-80gb=1.29",
            "--model", "llama-3.1-8b", "--topology", "colocated", "--tp", "1,2", "--replicas", "1-3",
            "--target", str(TARGET), "-o", str(study), "--no-progress", *extra]  # fmt: skip


# -- brute force, independent of the search -------------------------------------------------------


def met_all(row: dict) -> bool:
    if row["status"] != "finished":
        return False
    n = row["generated_tokens"]
    tpot = 0.0 if n <= 1 else (row["finish_s"] - row["first_token_s"]) / (n - 1)
    return row["first_token_s"] - row["arrival_s"] <= SLO["ttft_s"] and tpot <= SLO["tpot_s"]


def evaluate(table, gpu: str, tp: int, replicas: int) -> tuple[float, float]:
    """(attainment, $ per million output tokens): GPUs x price over first arrival .. last finish."""
    config = ReplayConfig.from_dict({"runner": "roofline", "model": "llama-3.1-8b", "gpu": gpu, "tp": tp,
                                     "replicas": replicas})  # fmt: skip
    rows = replay(table, config).requests.to_pylist()
    attainment = sum(met_all(r) for r in rows) / len(rows)
    lo = min(r["arrival_s"] for r in rows)
    hi = max(r["finish_s"] for r in rows if r["status"] == "finished")
    dollars = replicas * tp * PRICES[gpu] * (hi - lo) / 3600
    return attainment, dollars / sum(r["generated_tokens"] for r in rows) * 1e6


@pytest.fixture(scope="module")
def brute(trace) -> dict[tuple[str, int, int], tuple[float, float]]:
    table = read_trace(trace)
    return {(g, tp, r): evaluate(table, g, tp, r) for g, tp, r in itertools.product(*GRID.values())}


def test_recommendation_meets_the_slo_replayed_and_nothing_in_the_grid_is_cheaper(trace, brute, tmp_path, capsys):
    study = tmp_path / "study"
    out, err = cli(*recommend_args(trace, study), capsys=capsys)
    assert "12 configurations, trying all of them (grid)" in err
    config_path = study / "recommended.toml"
    data = tomllib.loads(config_path.read_text())
    (pool,) = data["cluster"]["pools"]
    chosen = (pool["gpu"], pool["tp"], pool["replicas"])

    # replayed as is by `servelab replay --config`: attainment >= the target
    run = tmp_path / "run"
    cli("replay", str(trace), "--config", str(config_path), "-o", str(run), "--no-report", capsys=capsys)
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert sum(met_all(r) for r in rows) / len(rows) >= TARGET

    # brute force: the chosen one meets the SLO, and no configuration meeting it is cheaper
    meets = {k: v for k, v in brute.items() if v[0] >= TARGET}
    assert chosen in meets
    cheapest = min(meets.values(), key=lambda v: v[1])[1]
    assert brute[chosen][1] == pytest.approx(cheapest, rel=1e-9)
    # a real choice: the cheapest GPU-hour (one A100) misses the SLO here
    assert brute[("a100-80gb", 1, 1)][0] < TARGET
    # the table: P50/P95/P99 columns and the chosen configuration first, at the brute force's price
    assert "TTFT p50/p95/p99" in out and "E2E p50/p95/p99" in out
    first = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("1 "))
    assert f"{chosen[2]}x {chosen[0]} TP{chosen[1]}" in first and f"{cheapest:.4g}" in first
    assert (study / "pareto.png").stat().st_size > 0


def test_the_run_resumes_without_repeating_trials(trace, tmp_path, capsys):
    study = tmp_path / "study"
    cli(*recommend_args(trace, study), capsys=capsys)
    first = (study / "recommended.toml").read_text()
    trials = pq.read_table(study / "colocated" / "trials.parquet").num_rows
    cli(*recommend_args(trace, study), capsys=capsys)
    assert pq.read_table(study / "colocated" / "trials.parquet").num_rows == trials == 12
    assert (study / "recommended.toml").read_text() == first


def test_a_run_interrupted_mid_trial_resumes_with_that_configuration(trace, brute, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the 10th replay, then the same command: the interrupted configuration is tried and none
    twice (the resume once lost it, and its 12th trial repeated the first trial's configuration)."""
    import signal

    from servelab.search import objective

    study = tmp_path / "study"
    real = objective.Evaluator._evaluate_interruptibly
    seen = []

    def ctrl_c_on_the_tenth(self, trial, config, attrs):
        seen.append(trial.number)
        if len(seen) == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, trial, config, attrs)

    monkeypatch.setattr(objective.Evaluator, "_evaluate_interruptibly", ctrl_c_on_the_tenth)
    cli(*recommend_args(trace, study), expect=130, capsys=capsys)
    rows = pq.read_table(study / "colocated" / "trials.parquet").to_pylist()
    assert [r["outcome"] for r in rows if r["state"] == "fail"] == ["interrupted"], rows
    monkeypatch.setattr(objective.Evaluator, "_evaluate_interruptibly", real)
    out, _err = cli(*recommend_args(trace, study), capsys=capsys)
    rows = pq.read_table(study / "colocated" / "trials.parquet").to_pylist()
    done = [(r["param.pools.serve.gpu"], r["param.pools.serve.tp"], r["param.pools.serve.replicas"])
            for r in rows if r["state"] == "complete"]  # fmt: skip
    assert sorted(done) == sorted(brute), rows
    assert len(rows) == 13  # the interrupted trial, and one trial per configuration


def test_availability_and_budget_exclude_configurations(trace, brute, tmp_path, capsys):
    """No H100 to be had: the answer is the cheapest A100 configuration that meets the SLO; a $/h budget
    below that one leaves nothing, which is said in one line with the closest configurations."""
    study = tmp_path / "study"
    cli(*recommend_args(trace, study, "--available", "h100-80gb=0"), capsys=capsys)
    (pool,) = tomllib.loads((study / "recommended.toml").read_text())["cluster"]["pools"]
    a100 = {k: v for k, v in brute.items() if k[0] == "a100-80gb" and v[0] >= TARGET}
    best = min(a100, key=lambda k: a100[k][1])
    assert (pool["gpu"], pool["tp"], pool["replicas"]) == best
    per_hour = best[1] * best[2] * PRICES["a100-80gb"]
    out, err = cli(*recommend_args(trace, study, "--available", "h100-80gb=0", "--budget", str(per_hour - 0.01)),
                   expect=1, capsys=capsys)  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "over --available or --budget" in errors[0], err
    assert "closest configurations" in out


def test_an_slo_nobody_meets_says_so_and_shows_the_closest(trace, tmp_path, capsys):
    study = tmp_path / "study"
    args = recommend_args(trace, study, "--replicas", "1")
    args[args.index("--slo") + 1] = "ttft=0.001"
    out, err = cli(*args, expect=1, capsys=capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no configuration meets the SLO" in lines[0] and "closest reaches" in lines[0]
    assert "closest configurations (none meets the SLO)" in out and "below 90%" in out
    assert not (study / "recommended.toml").exists()


def test_nothing_tried_claims_no_pareto_png(trace, tmp_path, capsys):
    """A model no configuration can hold: every trial is infeasible, none is plotted, and the error does not
    point at a pareto.png that was never written."""
    study = tmp_path / "study"
    args = recommend_args(trace, study, "--replicas", "1", "--tp", "1")
    args[args.index("--model") + 1] = "deepseek-v3"
    _out, err = cli(*args, expect=1, capsys=capsys)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "(0 tried; no config written; the studies are in" in line and "pareto.png" not in line, err
    assert not (study / "pareto.png").exists()


@pytest.mark.parametrize("extra,message", [
    (("--gpu", "x100=3"), "--gpu x100: unknown GPU preset 'x100'"),
    (("--budget", "1"), "--budget $1/h is below every configuration searched: the cheapest, 1x a100-80gb TP1"),
    (("--gpu", "l40s=abc"), "--gpu l40s=abc: the price must be a positive $ per GPU-hour"),
    (("--available", "b200=4"), "--available b200: not among the --gpu types"),
    (("--topology", "ring"), "--topology: unknown topology 'ring'"),
    # (a misspelt model once ran every configuration, each refused by its replay, and then said none met the SLO)
    (("--model", "lama-3.1-8b"), "--model lama-3.1-8b: unknown model preset 'lama-3.1-8b'; did you mean 'llama-3.1-8b'?"),
    (("--runner", "roofine"), "--runner roofine: unknown runner 'roofine'; did you mean 'roofline'?"),
    (("--vary", "max_num_seqs=0,8"), "--vary max_num_seqs: value 0: max_num_seqs must be >= 1"),
    (("--available", "h100-80gb=0", "--available", "a100-80gb=0"), "no configuration fits the GPUs --available allows"),
])  # fmt: skip
def test_bad_input_is_one_line_and_writes_nothing(trace, tmp_path, capsys, extra, message):
    study = tmp_path / "study"
    args = recommend_args(trace, study, *extra)
    if extra[0] == "--topology":
        args.remove("colocated")
        args.remove("--topology")
    _out, err = cli(*args, expect=1, capsys=capsys)
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not study.exists()


def test_small_spaces_are_enumerated_large_ones_sampled(trace, tmp_path):
    from servelab.scoring.slo import SloTable
    from servelab.search.recommend import GpuOffer, RecommendSetup, plan

    setup = RecommendSetup(trace=trace, slo=SloTable.parse_cli(["ttft=1"]), model="llama-3.1-8b",
                           offers=(GpuOffer("h100-80gb", 2.49), GpuOffer("a100-80gb", 1.29)),
                           tps=(1, 2), replicas=(1, 2, 3), grid_limit=20, n_trials=10)  # fmt: skip
    colocated, disagg = plan(setup, tmp_path)
    assert (colocated.configurations, colocated.exhaustive, colocated.spec.sampler, colocated.trials) == (12, True, "grid", 12)
    assert (disagg.configurations, disagg.exhaustive, disagg.spec.sampler, disagg.trials) == (144, False, "tpe", 10)
    assert disagg.spec.objectives == ("cost_per_million_tokens", "attainment") and disagg.spec.target == 0.9
    assert not any(tmp_path.iterdir())  # planning writes nothing


def test_a_disaggregated_recommendation_replays_as_written(trace, tmp_path, capsys):
    study = tmp_path / "study"
    args = recommend_args(trace, study, "--tp", "1", "--replicas", "1")
    args[args.index("colocated")] = "disagg"
    cli(*args, capsys=capsys)
    data = tomllib.loads((study / "recommended.toml").read_text())
    assert [p["role"] for p in data["cluster"]["pools"]] == ["prefill", "decode"]
    run = tmp_path / "run"
    cli("replay", str(trace), "--config", str(study / "recommended.toml"), "-o", str(run), "--no-report", capsys=capsys)
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert sum(met_all(r) for r in rows) / len(rows) >= TARGET


def test_two_workers_enumerate_the_whole_grid_once(trace, brute, tmp_path, capsys):
    """-j 2: a grid trial's number picks its point in the grid's seeded order, so every worker must order
    it alike (they once used their own seeds and evaluated duplicates, leaving points untried)."""
    study = tmp_path / "study"
    cli(*recommend_args(trace, study, "-j", "2"), capsys=capsys)
    rows = pq.read_table(study / "colocated" / "trials.parquet").to_pylist()
    done = [r for r in rows if r["state"] == "complete"]  # (a worker losing the race for the last trial adds a failed `surplus` row)
    points = {(r["param.pools.serve.gpu"], r["param.pools.serve.tp"], r["param.pools.serve.replicas"]) for r in done}
    assert len(done) == 12 and points == set(brute)
    (pool,) = tomllib.loads((study / "recommended.toml").read_text())["cluster"]["pools"]
    meets = {k: v for k, v in brute.items() if v[0] >= TARGET}
    assert (pool["gpu"], pool["tp"], pool["replicas"]) == min(meets, key=lambda k: meets[k][1])


@pytest.mark.skipif(not os.environ.get("SERVELAB_TEST_POSTGRES_URL"),
                    reason="SERVELAB_TEST_POSTGRES_URL is unset (run .ci/postgres.sh to get a server)")  # fmt: skip
def test_a_postgres_study_is_shared_by_machines(trace, brute, tmp_path, capsys):
    """--storage: the studies live in PostgreSQL; a second machine (another -o) with the same question
    finds them finished, runs nothing and gives the same answer (latencies '-': its trial runs are elsewhere)."""
    import optuna

    from servelab.search.study import sqlalchemy_url

    url = os.environ["SERVELAB_TEST_POSTGRES_URL"]
    seed = str(uuid.uuid4().int % 10**6)  # a fresh question: its own studies in the shared database
    first, second = tmp_path / "a", tmp_path / "b"
    try:
        cli(*recommend_args(trace, first, "--storage", url, "--seed", seed), capsys=capsys)
        out, _ = cli(*recommend_args(trace, second, "--storage", url, "--seed", seed), capsys=capsys)
        assert not (second / "colocated" / "trials").exists()  # nothing replayed on the second machine
        a, b = ([x for x in (d / "recommended.toml").read_text().splitlines() if not x.startswith("# every")]
                for d in (first, second))  # (that line names the study folder)
        assert a == b
        (pool,) = tomllib.loads((first / "recommended.toml").read_text())["cluster"]["pools"]
        meets = {k: v for k, v in brute.items() if v[0] >= TARGET}
        assert (pool["gpu"], pool["tp"], pool["replicas"]) == min(meets, key=lambda k: meets[k][1])
        assert "-/-/-" in out
    finally:
        name = tomllib.loads((first / "colocated" / "spec.toml").read_text())["study_name"]
        optuna.delete_study(study_name=name, storage=sqlalchemy_url(url))


def test_engine_settings_are_searched_and_a_config_file_is_the_start(trace, tmp_path, capsys):
    """--vary max_num_seqs=1,256: one running request at a time cannot keep up, so the answer runs 256;
    the --config file's settings reach every configuration and the written one."""
    base = tmp_path / "base.toml"
    base.write_text('max_num_batched_tokens = 4096\nmodel = "llama-3.1-8b"\n[slo]\nttft_s = 99.0\n')
    study = tmp_path / "study"
    args = recommend_args(trace, study, "--tp", "1", "--replicas", "1-2", "--vary", "max_num_seqs=1,256",
                          "--config", str(base))  # fmt: skip
    out, err = cli(*args, capsys=capsys)
    assert "8 configurations, trying all of them (grid)" in err
    data = tomllib.loads((study / "recommended.toml").read_text())
    assert data["max_num_seqs"] == 256 and data["max_num_batched_tokens"] == 4096
    assert data["slo"] == SLO  # --slo, not the base file's [slo]
    assert "max_num_seqs=256" in out
    rows = pq.read_table(study / "colocated" / "trials.parquet").to_pylist()
    assert {r["param.max_num_seqs"] for r in rows} == {1, 256}
    assert all(r["attainment"] < TARGET for r in rows if r["param.max_num_seqs"] == 1)
    base.write_text("tp = 2\n")
    _out, err = cli(*args, expect=1, capsys=capsys)
    assert f"error: {base}, column 'tp': recommend chooses the GPUs" in err


def test_every_type_limited_refuses_configurations_over_all_gpus_before_replaying(trace, brute, tmp_path, capsys):
    """--available for every type: their sum is the spec's gpu_budget, so 6-GPU configurations are infeasible
    trials that never replay; those within the sum but over their own type's count are never recommended."""
    study = tmp_path / "study"
    cli(*recommend_args(trace, study, "--available", "h100-80gb=1", "--available", "a100-80gb=4"), capsys=capsys)
    rows = pq.read_table(study / "colocated" / "trials.parquet").to_pylist()
    over = [r for r in rows if r["param.pools.serve.tp"] * r["param.pools.serve.replicas"] > 5]
    assert len(over) == 2 and all(r["outcome"] == "infeasible" for r in over)
    assert not any((study / "colocated" / "trials" / f"{r['number']:04d}").exists() for r in over)
    (pool,) = tomllib.loads((study / "recommended.toml").read_text())["cluster"]["pools"]
    allowed = {k: v for k, v in brute.items() if v[0] >= TARGET and k[1] * k[2] <= (1 if k[0] == "h100-80gb" else 4)}
    assert (pool["gpu"], pool["tp"], pool["replicas"]) == min(allowed, key=lambda k: allowed[k][1])


def test_a_resumed_grid_search_tries_the_points_not_yet_tried(tmp_path, capsys):
    """`servelab search` with sampler = "grid" over 6 points, 3 trials then 6: all six points (the resumed
    run once took another seed, so another grid order, and repeated points of the first run)."""
    from helpers_search import grid_spec

    space = '[space]\nmax_num_seqs = [1, 2, 4, 8, 16, 32]\n'
    spec = grid_spec(tmp_path, n_trials=3, top='sampler = "grid"\n', space=space, name="grid.toml")
    out = tmp_path / "S"
    cli("search", str(spec), "-o", str(out), "--no-progress", capsys=capsys)
    cli("search", str(spec), "-o", str(out), "--no-progress", "--n-trials", "6", capsys=capsys)
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert sorted(r["param.max_num_seqs"] for r in rows) == [1, 2, 4, 8, 16, 32]
