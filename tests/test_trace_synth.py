"""Synthetic traces: arrival statistics on large samples, lengths, tenants, tiers, sessions, hashes."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from helpers_traces import FIXTURES

from servelab.common.errors import ServelabError
from servelab.traces.arrivals import ArrivalConfig, arrival_times, weibull_shape_for_cv
from servelab.traces.info import trace_info
from servelab.traces.io import read_trace, trace_sha256, write_trace
from servelab.traces.lengths import LengthDist, parse_length
from servelab.traces.synth import SynthConfig, generate, make_config, parse_weights, synth_trace, zipf_tenants


def _gaps(table: pa.Table) -> np.ndarray:
    return np.diff(table.column("arrival_s").to_numpy())


def _cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


@pytest.mark.parametrize(
    "arrival,cv",
    [("poisson", 1.0), ("gamma", 0.5), ("gamma", 2.0), ("gamma", 4.0), ("weibull", 0.6), ("weibull", 1.8)],
)
def test_renewal_cv_and_rate(arrival, cv):
    t = synth_trace(n=200_000, rate=8.0, arrival=arrival, cv=cv, seed=11)
    g = _gaps(t)
    assert _cv(g) == pytest.approx(cv, rel=0.05)
    assert 1.0 / g.mean() == pytest.approx(8.0, rel=0.02)


def test_constant_arrivals_are_evenly_spaced():
    g = _gaps(synth_trace(n=1000, rate=4.0, arrival="constant"))
    np.testing.assert_allclose(g, 0.25)


def test_weibull_shape_solves_cv():
    for cv in (0.3, 1.0, 2.5):
        k = weibull_shape_for_cv(cv)
        mean = math.gamma(1 + 1 / k)
        var = math.gamma(1 + 2 / k) - mean**2
        assert math.sqrt(var) / mean == pytest.approx(cv, rel=1e-9)
    assert weibull_shape_for_cv(1.0) == pytest.approx(1.0, rel=1e-9)  # exponential


def test_piecewise_rate_counts_and_gap():
    cfg = ArrivalConfig(profile="piecewise", schedule=((0, 20.0), (100, 0.0), (200, 50.0)))
    t = arrival_times(cfg, np.random.default_rng(1), duration_s=300)
    assert np.sum(t < 100) == pytest.approx(2000, rel=0.06)
    assert not np.any((t >= 100) & (t < 200))
    assert np.sum(t >= 200) == pytest.approx(5000, rel=0.04)


def test_diurnal_profile_follows_sinusoid():
    cfg = ArrivalConfig(rate_per_s=50.0, profile="diurnal", diurnal_amplitude=0.8, diurnal_period_s=1000)
    t = arrival_times(cfg, np.random.default_rng(2), duration_s=10_000)
    assert len(t) == pytest.approx(500_000, rel=0.02)
    phase = np.mod(t, 1000)
    # expected share in the first half-period: (1 + 2A/π) / 2
    assert np.mean(phase < 500) == pytest.approx((1 + 2 * 0.8 / math.pi) / 2, abs=0.01)


def test_onoff_bursts_only_in_on_parts():
    cfg = ArrivalConfig(rate_per_s=10.0, profile="onoff", burst_on_s=2.0, burst_off_s=8.0, process="gamma", cv=1.5)
    t = arrival_times(cfg, np.random.default_rng(3), n=50_000)
    assert np.all(np.mod(t, 10.0) <= 2.0 + 1e-9)
    assert (len(t) - 1) / (t[-1] - t[0]) == pytest.approx(10.0, rel=0.03)


def test_duration_mode():
    t = synth_trace(duration_s=1000, rate=20.0, seed=4)
    arrival = t.column("arrival_s").to_numpy()
    assert arrival.max() <= 1000 and t.num_rows == pytest.approx(20_000, rel=0.03)


def test_deterministic_bytes(tmp_path):
    kw = dict(n=5000, rate=3, arrival="gamma", cv=2, prompt="lognormal:500:1", tenants=4, tenant_zipf=1.1,
              tiers="priority=0.1,standard=0.9", turns=3, think_s=5, prefix_block_tokens=16, seed=9)
    a = write_trace(synth_trace(**kw), tmp_path / "a.arrow", "s", 16)
    b = write_trace(synth_trace(**kw), tmp_path / "b.arrow", "s", 16)
    assert trace_sha256(a) == trace_sha256(b)
    c = synth_trace(**{**kw, "seed": 10})
    assert not c.equals(read_trace(a).select(c.column_names))
    # changing lengths leaves arrivals alone (independent streams)
    d = synth_trace(**{**kw, "prompt": 100})
    np.testing.assert_array_equal(d.column("arrival_s").to_numpy(), synth_trace(**kw).column("arrival_s").to_numpy())


def test_length_distributions():
    rng = np.random.default_rng(0)
    x = LengthDist("lognormal", 600, 1.0).sample(100_000, rng)
    assert np.median(x) == pytest.approx(600, rel=0.03) and x.min() >= 1
    u = parse_length("uniform:10:20").sample(10_000, rng)
    assert u.min() == 10 and u.max() == 20
    assert parse_length("lognormal:600:2:cap=4096").sample(10_000, rng).max() == 4096
    assert parse_length(64) == LengthDist("fixed", 64)
    for bad in ("uniform:5", "lognormal:0:1", "gauss:1:2", "uniform:9:3", "fixed:x"):
        with pytest.raises(ServelabError, match="bad length spec"):
            parse_length(bad)


def test_resample_lengths_from_file():
    src = FIXTURES / "sharegpt_lengths_head300.csv"
    t = synth_trace(n=2000, lengths_from=src, seed=1)
    lines = src.read_text().splitlines()[1:]
    pairs = {(int(a), int(b)) for a, b, *_ in (ln.split(",") for ln in lines)}
    got = set(zip(t.column("prompt_tokens").to_pylist(), t.column("output_tokens").to_pylist()))
    assert got <= pairs and len(got) > 200


def test_tenants_zipf_and_tiers():
    t = synth_trace(n=100_000, tenants=4, tenant_zipf=1.0, tiers="priority=0.1,standard=0.6,flex=0.3", seed=2)
    info = trace_info(t)
    w = np.array([1, 1 / 2, 1 / 3, 1 / 4])
    for i, share in enumerate(w / w.sum()):
        assert info["tenants"][f"tenant-{i}"] / 100_000 == pytest.approx(share, abs=0.01)
    assert info["tiers"]["priority"] / 100_000 == pytest.approx(0.1, abs=0.01)
    assert info["tiers"]["flex"] / 100_000 == pytest.approx(0.3, abs=0.01)
    assert parse_weights("a=3,b=1") == (("a", 3.0), ("b", 1.0))
    assert zipf_tenants(2, 0.0) == (("tenant-0", 1.0), ("tenant-1", 1.0))
    for bad in ("a=1,a=2", "a", "a=x", "a=0"):
        with pytest.raises(ServelabError):
            parse_weights(bad)


def test_sessions_turns_think_and_context():
    t = synth_trace(n=30_000, rate=2, turns=4, think_s=10, prompt=50, output=20, tenants="a=1,b=1", seed=3)
    assert t.num_rows == 30_000
    sid = t.column("session_id").to_numpy()
    think = t.column("think_s")
    turns = np.bincount(sid)
    assert turns[:-1].mean() == pytest.approx(4, rel=0.05)  # last session may be cut short
    firsts = np.unique(sid, return_index=True)[1]
    assert all(think[i].as_py() is None for i in firsts[:100])
    later = np.array([v for v in think.to_pylist() if v is not None])
    assert later.mean() == pytest.approx(10, rel=0.05)
    rows = t.to_pylist()
    by_session = {}
    for r in rows:
        by_session.setdefault(r["session_id"], []).append(r)
    for turns_of in list(by_session.values())[:200]:
        assert len({r["tenant"] for r in turns_of}) == 1
        for k, r in enumerate(turns_of):
            assert r["prompt_tokens"] == 50 + k * (50 + 20)  # the conversation so far + the new text


def test_prefix_hashes_share_system_prompt_and_history(tmp_path):
    t = synth_trace(n=2000, turns=3, think_s=1, prompt=64, output=32, tenants=2, shared_prefix_tokens=256,
                    prefix_block_tokens=16, seed=5)
    assert t.schema.metadata[b"prefix_block_tokens"] == b"16"
    rows = t.to_pylist()
    for r in rows[:50]:
        assert len(r["prefix_hashes"]) == -(-r["prompt_tokens"] // 16)
    # same tenant => the first 16 blocks (256 tokens) are equal
    by_tenant = {}
    for r in rows:
        by_tenant.setdefault(r["tenant"], []).append(r["prefix_hashes"][:16])
    for prefixes in by_tenant.values():
        assert all(p == prefixes[0] for p in prefixes)
    a, b = by_tenant.values()
    assert a[0] != b[0]
    share = trace_info(t)["prefix_reuse_share"]
    assert 0.5 < share < 1.0
    no_ctx = synth_trace(n=2000, turns=3, think_s=1, prompt=64, output=32, tenants=2, shared_prefix_tokens=256,
                         prefix_block_tokens=16, session_context=False, seed=5)
    assert trace_info(no_ctx)["prefix_reuse_share"] < share
    out = write_trace(t, tmp_path / "p.arrow", "s")  # block size comes from the table's metadata
    assert read_trace(out).num_rows == 2000


def test_config_validation():
    with pytest.raises(ServelabError, match="exactly one of n"):
        SynthConfig(n=None, duration_s=None)
    with pytest.raises(ServelabError, match="unknown arrival process"):
        make_config(arrival="lognormal")
    with pytest.raises(ServelabError, match="need cv > 0|needs cv > 0"):
        make_config(arrival="gamma", cv=0)
    with pytest.raises(ServelabError, match="unknown synth option"):
        make_config(rat=3)
    with pytest.raises(ServelabError, match="schedule must start at 0"):
        make_config(profile="piecewise", schedule=[(5, 1)])
    with pytest.raises(ServelabError, match="turns"):
        make_config(turns=0.5)
    cfg = make_config(n=10, model="llama")
    assert generate(cfg).column("model").cast(pa.string()).to_pylist() == ["llama"] * 10


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 3.0), ("weibull", 0.5)])
def test_duration_mode_expects_rate_times_duration_requests(process, cv):
    # The first arrival is not pinned at 0 (that added one request to every window): Λ(D) = 0.05 × 100 = 5.
    cfg = ArrivalConfig(process=process, rate_per_s=0.05, cv=cv)
    counts = [len(arrival_times(cfg, np.random.default_rng(seed), duration_s=100.0)) for seed in range(4000)]
    assert np.mean(counts) == pytest.approx(5.0, abs=0.25)


def test_duration_mode_constant_gaps_give_exactly_rate_times_duration():
    cfg = ArrivalConfig(process="constant", rate_per_s=0.05)
    for seed in range(50):
        t = arrival_times(cfg, np.random.default_rng(seed), duration_s=100.0)
        assert len(t) == 5 and 0 < t[0] <= 20 and np.allclose(np.diff(t), 20)


def test_source_names_the_piecewise_schedule_not_the_unused_rate():
    """Piecewise arrivals ignore `rate`; the trace's `source` line says the schedule it followed."""
    cfg = make_config(n=10, profile="piecewise", schedule=[(0, 2), (10, 5.5)])
    assert cfg.source == "synth:poisson@[0:2;10:5.5]/s,cv=1,piecewise,n=10,seed=0"
    assert make_config(n=10, rate=3).source == "synth:poisson@3/s,cv=1,flat,n=10,seed=0"
