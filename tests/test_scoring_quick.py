"""scoring/quick.py: numpy scoring of a run, bit-equal to the DuckDB summary the search scorer runs (same doubles, same keys)."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest
from sampled_suites import cases

from servelab.api import ReplayConfig, replay
from servelab.scoring import quick
from servelab.scoring.slo import Slo, SloTable
from servelab.search.scorer import RunScorer
from servelab.traces.synth import synth_trace

RUNNER = "linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002"


def _exact(scores: dict) -> dict:
    """Each value with its type and repr: equal only if every float is the same double."""
    return {k: (type(v).__name__, repr(v)) for k, v in scores.items()}


def _both(result, slo: SloTable | None) -> tuple[dict, dict]:
    # DuckDB on one thread, as a search scores a small trace (two threads may add a mean's rows in another order)
    duck, fast = RunScorer(slo, threads=1), RunScorer(slo, quick=True)
    try:
        return duck.score(result), fast.score(result)
    finally:
        duck.close()
        fast.close()


@pytest.fixture(scope="module")
def runs() -> list:
    """Replays of one synthetic trace under settings from idle to overloaded (queues, preemptions, requests cut off)."""
    trace = synth_trace(n=300, rate=40.0, prompt="uniform:16:1024", output="uniform:1:80", seed=3)
    out = []
    for seqs, tokens, policy, until in itertools.product((2, 16, 64), (256, 2048), ("sarathi", "vllm-v0"), (None, 4.0)):
        config = {"runner": RUNNER, "num_gpu_blocks": 600, "max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                  "policy": policy}  # fmt: skip
        if until is not None:
            config["until_s"] = until  # a horizon: requests in flight stay unfinished
        out.append(replay(trace, ReplayConfig.from_dict(config)))
    return out


def _with(result, **columns):
    """The run with request columns replaced or added (tiers, tenants, per-request SLOs)."""
    requests = result.requests
    for name, values in columns.items():
        array = pa.array(values, pa.string() if name in ("tier", "tenant") else pa.float64())
        if name in requests.column_names:
            requests = requests.set_column(requests.column_names.index(name), name, array)
        else:
            requests = requests.append_column(name, array)
    return type(result)(requests, result.steps, result.meta)


SLOS = [
    None,
    SloTable.parse_cli(["ttft=0.3,tpot=0.01"]),
    SloTable.parse_cli(["ttft=1.0"]),
    SloTable.parse_cli(["e2e=2.0,max_stall=0.05"]),
    SloTable.parse_cli(["ttft=0.5,tpot=0.02", "tier=premium:ttft=0.1", "tenant=acme:tpot=0.005,e2e=1.5"]),
    SloTable.parse_cli(["tier=premium:ttft=0.2"]),  # no global entry: other tiers have no SLO (attainment = finished)
]


@pytest.fixture(scope="module")
def scorers() -> list:
    """(DuckDB scorer, quick scorer) for each of SLOS, each reused for every run it scores, as a search
    reuses its scorer across trials (a DuckDB connection opened per score cost most of these tests)."""
    pairs = [(RunScorer(slo, threads=1), RunScorer(slo, quick=True)) for slo in SLOS]
    yield pairs
    for duck, fast in pairs:
        duck.close()
        fast.close()


def test_quick_scores_equal_duckdb_on_every_run_and_slo(runs, scorers):
    unfinished = 0
    for result, (duck_scorer, fast_scorer) in cases(list(itertools.product(runs, scorers)), 48, "every run and slo"):
        unfinished += result.requests.column("status").to_pylist().count("unfinished")
        duck, fast = duck_scorer.score(result), fast_scorer.score(result)
        assert _exact(fast) == _exact(duck)
        assert list(fast) == list(duck)  # the same keys in the same order (the trial's metrics attribute)
    assert unfinished > 0  # the horizons and the overload cut requests off


def test_quick_scores_equal_duckdb_with_tiers_tenants_and_request_slos(runs, scorers):
    """(SLO tables with tier or tenant entries go to DuckDB: its join reorders the rows a mean adds.)"""
    rng = np.random.default_rng(7)
    for result in cases(runs[::3], 3, "tiers, tenants and request slos"):
        n = result.requests.num_rows
        tiers = rng.choice(["premium", "standard", "batch"], n).tolist()
        tiers[0] = None  # a request without a tier: its own group, sorted last
        tenants = rng.choice(["acme", "other"], n).tolist()
        own = [float(v) if rng.random() < 0.2 else None for v in rng.uniform(0.05, 0.5, n)]
        for columns in ({"tier": tiers}, {"tier": tiers, "tenant": tenants, "ttft_slo_s": own},
                        {"tier": ["premium"] * n, "tpot_slo_s": own, "e2e_slo_s": own}):  # fmt: skip
            run = _with(result, **columns)
            for duck_scorer, fast_scorer in scorers:
                duck, fast = duck_scorer.score(run), fast_scorer.score(run)
                assert _exact(fast) == _exact(duck)
                assert list(fast) == list(duck)
        assert any(k.startswith("attainment.tier.") for k in fast)


def test_a_latency_exactly_at_its_slo_meets_it_in_both(runs):
    result = runs[5]
    finished = [i for i, s in enumerate(result.requests.column("status").to_pylist()) if s == "finished"]
    i = finished[0]
    ttft = result.requests.column("first_token_s").to_pylist()[i] - result.requests.column("arrival_s").to_pylist()[i]
    slo = SloTable(global_=Slo(ttft_s=ttft))
    duck, fast = _both(result, slo)
    assert _exact(fast) == _exact(duck)
    just_below = SloTable(global_=Slo(ttft_s=float(np.nextafter(ttft, 0))))
    assert _both(result, just_below)[1]["attainment"] < fast["attainment"]  # that request now misses


def test_checkpoint_attainment_is_equal_too(runs, scorers):
    for result, (duck, fast) in itertools.product(runs[:6], scorers[:3]):
        for horizon in (0.5, 2.0, 100.0):
            assert repr(fast.attainment(result, arrived_by_s=horizon)) == repr(duck.attainment(result, arrived_by_s=horizon))


def test_requests_after_a_horizon_are_in_no_denominator_in_either(runs, scorers):
    duck, fast = scorers[1]
    for result in runs[1::2]:  # the runs cut at 4.0 s; the trace arrives until ~7.5 s
        arrived = sum(a <= 4.0 for a in result.requests.column("arrival_s").to_pylist())
        assert arrived < result.requests.num_rows
        assert duck.score(result)["requests"] == fast.score(result)["requests"] == arrived
        # a search checkpoint (arrived_by_s = its horizon) scores the run as every view does
        for scorer in (duck, fast):
            assert repr(scorer.attainment(result)) == repr(scorer.attainment(result, arrived_by_s=4.0))


def test_runs_quick_does_not_model_go_to_duckdb(runs):
    result = runs[0]
    nan = [float("nan")] + [None] * (result.requests.num_rows - 1)
    with pytest.raises(quick.NotQuick):  # a real NaN compares differently in SQL and numpy
        quick.summary_rows(_with(result, ttft_slo_s=nan).requests, result.steps, 1, None, by_tier=False)
    with pytest.raises(quick.NotQuick):
        quick.summary_rows(result.requests.slice(0, 0), result.steps, 1, None, by_tier=False)
    with pytest.raises(quick.NotQuick):
        quick.summary_rows(result.requests, result.steps, 1, SLOS[5], by_tier=False)
    run = _with(result, ttft_slo_s=nan)
    duck, fast = _both(run, SLOS[1])
    assert _exact(fast) == _exact(duck)  # the quick scorer fell back to DuckDB: the same answer


def test_quick_quantiles_and_means_are_duckdbs_not_numpys():
    """numpy's pairwise sum and its lerp differ from DuckDB in the last bit on some inputs; these must not."""
    import duckdb

    rng = np.random.default_rng(1)
    con = duckdb.connect(config={"threads": 1})
    for _ in range(100):
        x = rng.lognormal(0, 2, int(rng.integers(1, 3000))) * rng.choice([1e-3, 1.0, 1e3])
        con.register("t", pa.table({"x": x}))
        avg, q = con.execute("SELECT avg(x), quantile_cont(x, [0.5, 0.9, 0.99]) FROM t").fetchone()
        assert repr(quick._avg(x)) == repr(avg)
        assert repr(quick._quantiles(x)) == repr(q)
    con.close()


def test_quick_quantiles_select_their_ranks_without_sorting_every_value(monkeypatch):
    """scoring/quick.py `_quantiles`: np.partition places the ranks either side of each quantile where a sort would
    (ties, one value, two values included); five full sorts were ~0.2 ms of a 2,000-request trial's scoring."""
    rng = np.random.default_rng(2)
    cases = [rng.lognormal(0, 1, n) for n in (1, 2, 3, 101, 2000)] + [rng.integers(0, 5, 500).astype(float)]
    expected = []
    for x in cases:
        ordered = np.sort(x)
        row = []
        for q in quick.QUANTILES:
            rn = (x.size - 1) * q
            lo, hi = int(np.floor(rn)), int(np.ceil(rn))
            row.append(float(ordered[lo]) if lo == hi else float(ordered[lo]) * (1.0 - (rn - lo)) + float(ordered[hi]) * (rn - lo))
        expected.append(row)

    def no_sort(*args, **kwargs):
        raise AssertionError("a full sort")

    monkeypatch.setattr(np, "sort", no_sort)
    for x, row in zip(cases, expected):
        assert repr(quick._quantiles(x)) == repr(row)


@pytest.mark.parametrize("values, type_", [
    ([0.5, None, 2.25, float("inf")], pa.float64()),
    ([1.5, 3.0], pa.float64()),
    ([0.1, None, -3.5], pa.float32()),
    ([3, None, 1, 2**53], pa.int64()),
    ([7, 0, 12], pa.int32()),
    ([None, None], pa.int64()),
    ([4, None], pa.uint16()),
])  # fmt: skip
def test_columns_become_the_doubles_arrows_cast_gives_without_pyarrow_compute(values, type_):
    """quick._float64 (numpy) is ``cast(float64).fill_null(nan)`` (Arrow's kernels), value for value, on one or
    several chunks: the scorer's columns reach numpy without importing pyarrow.compute (common/kernels.py)."""
    import pyarrow.compute as pc

    for column in (pa.chunked_array([pa.array(values, type_)]),
                   pa.chunked_array([pa.array(values[:1], type_), pa.array(values[1:], type_)])):  # fmt: skip
        expected = pc.fill_null(column.cast(pa.float64()), np.nan).to_numpy()
        got = quick._float64(column)
        assert got.dtype == np.float64
        assert [repr(v) for v in got.tolist()] == [repr(v) for v in expected.tolist()]


def test_a_missing_column_is_all_null_and_a_column_named_twice_is_refused():
    table = pa.table({"a": [1.0, None], "b": [2, 3]})
    assert [repr(v) for v in quick._floats(table, "a").tolist()] == ["1.0", "nan"]
    assert quick._floats(table, "b").tolist() == [2.0, 3.0]
    assert np.isnan(quick._floats(table, "missing")).all() and len(quick._floats(table, "missing")) == 2
    twice = pa.Table.from_arrays([pa.array([1.0]), pa.array([2.0])], names=["a", "a"])
    with pytest.raises(KeyError):
        quick._floats(twice, "a")
