"""Transforms (window, scale, head, sample, merge, tiers) and trace_info statistics."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from helpers_traces import good_table
from helpers_traces import strings as _s

from servelab.common.errors import ServelabError
from servelab.traces import transforms
from servelab.traces.bundled import default_trace_path
from servelab.traces.info import trace_info
from servelab.traces.io import read_trace
from servelab.traces.synth import synth_trace


def test_window_rebases_and_keeps_whole_sessions():
    t = synth_trace(n=3000, rate=5, turns=3, think_s=20, seed=1)
    w = transforms.window(t, 100, 200)
    arrival = w.column("arrival_s").to_numpy()
    assert arrival.min() >= 0
    sid = w.column("session_id").to_numpy()
    full = t.column("session_id").to_numpy()
    for s in np.unique(sid)[:50]:
        assert (sid == s).sum() == (full == s).sum()  # every turn of a kept session is kept
    plain = transforms.window(good_table(10), 1.0, 3.0)
    assert plain.column("arrival_s").to_pylist() == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ServelabError, match="no requests"):
        transforms.window(good_table(3), 100.0)
    with pytest.raises(ServelabError, match="bad window"):
        transforms.window(good_table(3), 5.0, 1.0)


def test_scale_rate_and_head():
    t = good_table(10)
    s = transforms.scale_rate(t, 2.0)
    assert s.column("arrival_s").to_pylist() == [0.25 * i for i in range(10)]
    assert trace_info(s)["mean_rate_per_s"] == pytest.approx(2 * trace_info(t)["mean_rate_per_s"])
    assert transforms.head(t, 3).num_rows == 3
    with pytest.raises(ServelabError):
        transforms.scale_rate(t, 0)


def test_sample_is_seeded_and_ordered():
    t = synth_trace(n=1000, seed=2)
    a = transforms.sample(t, seed=1, n=100)
    assert a.equals(transforms.sample(t, seed=1, n=100))
    assert not a.equals(transforms.sample(t, seed=2, n=100))
    assert np.all(np.diff(a.column("arrival_s").to_numpy()) >= 0)
    assert transforms.sample(t, seed=1, fraction=0.25).num_rows == 250
    with pytest.raises(ServelabError, match="cannot sample"):
        transforms.sample(t, seed=1, n=5000)


def test_merge_tags_tenants_and_renumbers():
    a = synth_trace(n=100, rate=1, seed=1, tenants="x=1,y=1")
    b = synth_trace(n=50, rate=1, seed=2, turns=2, think_s=1)
    m = transforms.merge([a, b], ["A", "B"])
    assert m.num_rows == 150 and m.column("request_id").to_pylist() == list(range(150))
    assert set(_s(m, "tenant")) == {"A/x", "A/y", "B"}
    assert np.all(np.diff(m.column("arrival_s").to_numpy()) >= 0)


def test_merge_keeps_hash_spaces_apart():
    a = synth_trace(n=20, prefix_block_tokens=16, prompt=64, seed=1)
    m = transforms.merge([a, a], ["a", "b"])
    assert trace_info(m)["prefix_reuse_share"] == pytest.approx(trace_info(a)["prefix_reuse_share"])
    c = synth_trace(n=20, prefix_block_tokens=32, prompt=64, seed=1)
    with pytest.raises(ServelabError, match="different block sizes"):
        transforms.merge([a, c])


def test_tier_rules():
    t = synth_trace(n=10_000, tenants="a=1,b=1,c=2", seed=3)
    by = transforms.tier_by_tenant(t, {"a": "priority", "b": "flex"}, default="standard")
    for tenant, tier in zip(_s(by, "tenant"), _s(by, "tier")):
        assert tier == {"a": "priority", "b": "flex", "c": "standard"}[tenant]
    with pytest.raises(ServelabError, match="not in the trace"):
        transforms.tier_by_tenant(t, {"zzz": "priority"})
    fr = transforms.tier_by_fraction(t, (("priority", 0.2), ("standard", 0.8)), seed=1)
    assert _s(fr, "tier").count("priority") / 10_000 == pytest.approx(0.2, abs=0.015)


def test_info_on_bundled_trace():
    path = default_trace_path()
    assert path.is_file()
    info = trace_info(read_trace(path))
    assert info["rows"] == 19366
    assert info["span_s"] == pytest.approx(3501.72, abs=0.01)
    assert info["mean_rate_per_s"] == pytest.approx(5.53, abs=0.01)
    assert 0.9 < info["interarrival_cv"] < 1.3  # near-Poisson
    assert info["prompt_tokens"]["p50"] == 1020 and info["output_tokens"]["max"] == 1000
    assert info["peak_1s_rate_per_s"] >= 10


def test_info_hand_computed():
    t = good_table(5)  # arrivals 0, .5, 1, 1.5, 2; prompts 100..104
    info = trace_info(t)
    assert info["rows"] == 5 and info["span_s"] == 2.0 and info["mean_rate_per_s"] == 2.0
    assert info["interarrival_cv"] == 0.0
    assert info["peak_1s_rate_per_s"] == 2
    assert info["prompt_tokens"]["p50"] == 102 and info["prompt_tokens"]["max"] == 104
    assert info["prefix_reuse_share"] is None and info["sessions"] is None
    h = good_table(2).append_column("prefix_hashes", pa.array([[1, 2], [1, 3]], pa.list_(pa.int64())))
    h = h.replace_schema_metadata({"prefix_block_tokens": "64"})
    # prompts 100 and 101: block 1 of the second (64 tokens) was seen before
    assert trace_info(h)["prefix_reuse_share"] == pytest.approx(64 / 201)


@pytest.mark.parametrize("k", [float("inf"), float("nan"), 0.0, -2.0])
def test_scale_rate_refuses_a_non_finite_or_non_positive_scale(k):
    with pytest.raises(ServelabError, match=r"rate scale must be a finite number > 0"):
        transforms.scale_rate(good_table(5), k)
