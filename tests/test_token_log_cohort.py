"""`--token-log` keeps the decode cohort (replay/core/cohort.py): the cohort logs each applied run of
iterations once (its timeline) and each member's tokens as one record per membership, which the log
expands at the end. tokens.parquet of a replay with cohorts must equal, byte for byte, that of the
same replay with cohorts off (every token logged per request, as before), for every policy that
promises ``reads_running`` and for what changes a member's tokens: preemption by recompute (with the
journal, and without it: requests that start over and repeat token indices) and by swap, members
rotated out (round-robin), prefix caching, a horizon cutting stretches, closed-loop sessions,
several replicas, and spill chunks small enough for many runs, merge passes and timeline pieces."""

from __future__ import annotations

import io
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_engine import synthetic
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.policies.base import make_policy, policy_class, policy_names
from servelab.replay.core import logs

COHORT_POLICIES = [name for name in policy_names() if make_policy(name, None, EngineConfig()).reads_running is not None]

CASES = {
    "2 replicas": {"engine": {"replicas": 2}},
    "recompute, journal": {"engine": {"num_gpu_blocks": 300}},
    "recompute, no journal": {"engine": {"num_gpu_blocks": 300, "journal": False}},
    "swap, no journal": {"engine": {"num_gpu_blocks": 300, "preemption": "swap", "swap_space_gb": 0.2,
                                    "journal": False}},
    "seat cap": {"engine": {"max_num_seqs": 6}},
    "horizon, 3 replicas": {"engine": {"replicas": 3, "until_s": 12.0}},
    "sessions": {"engine": {"replicas": 2, "router": "least-outstanding"}, "trace": {"turns": 4, "think_s": 2.0}},
    "prefix caching": {"engine": {"num_gpu_blocks": 500, "replicas": 2, "router": "prefix-affinity"},
                       "trace": {"tenants": "a=1,b=1", "shared_prefix_tokens": 300, "turns": 3.0, "think_s": 1.0,
                                 "prefix_block_tokens": 16}},
}
EVERY_POLICY = ["2 replicas", "recompute, no journal", "horizon, 3 replicas"]
PAIRS = ([(case, policy) for policy in COHORT_POLICIES for case in EVERY_POLICY]
         + [(case, policy) for policy in ("sarathi", "round-robin", "vtc") for case in CASES if case not in EVERY_POLICY]
         + [("recompute, journal", "drr")])


def small_trace(**overrides):
    return synthetic(**{"n": 300, "rate": 20.0, "prompt": "lognormal:400:1.0", "output": "lognormal:80:1.0",
                        **overrides})


def token_files(trace, config: ReplayConfig, monkeypatch, tmp_path):
    """tokens.parquet's bytes of a replay with cohorts (it must log memberships), then with the
    policy's ``reads_running`` off (it must log none; requests and steps must not change), and the
    first replay's token log."""
    made: list[logs.TokenLog] = []

    def recording_log(*args, **kwargs):
        made.append(logs.TokenLog(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("servelab.replay.core.engine.TokenLog", recording_log)
    with_cohort = replay(trace, config, token_log=True)
    assert made[-1].num_memberships, "no cohort member logged its tokens: the comparison would prove nothing"
    monkeypatch.setattr(policy_class(config.policy), "reads_running", None)
    without = replay(trace, config, token_log=True)
    assert not made[-1].num_memberships
    assert with_cohort.requests.equals(without.requests)
    assert with_cohort.steps.equals(without.steps)
    files = []
    for name, result in (("with", with_cohort), ("without", without)):
        result.tokens.write(tmp_path / f"{name}.parquet")
        files.append((tmp_path / f"{name}.parquet").read_bytes())
    return files[0], files[1], made[0]


def test_every_cohort_policy_is_covered():
    assert {"sarathi", "orca", "round-robin", "vtc", "drr", "tiers", "edf", "lifo", "srpt", "sjf"} <= set(COHORT_POLICIES)


@pytest.mark.parametrize(("case", "policy"), PAIRS)
@pytest.mark.sampled(keep=8)
def test_token_file_with_cohorts_is_byte_identical(case, policy, monkeypatch, tmp_path):
    spec = CASES[case]
    config = ReplayConfig(engine=EngineConfig(**spec["engine"]), policy=policy)
    with_cohort, without, _ = token_files(small_trace(**spec.get("trace", {})), config, monkeypatch, tmp_path)
    assert with_cohort == without
    if case == "recompute, no journal" and policy == "sarathi":  # some requests started over
        table = pq.read_table(io.BytesIO(with_cohort))
        pairs = list(zip(table.column("request_id").to_pylist(), table.column("token_index").to_pylist()))
        assert len(set(pairs)) < len(pairs)


@pytest.mark.parametrize("reading", ["windowed", "whole", "whole, searched"])
@pytest.mark.parametrize(("policy", "journal"), [("sarathi", False), ("round-robin", True), ("round-robin", False)])
def test_tiny_chunks_many_runs_merge_passes_and_timeline_pieces(policy, journal, reading, monkeypatch, tmp_path):
    """Spill chunks, fan-in, buffers, expansion pieces, timeline pieces and the timeline cache all
    tiny, request ids unrelated to arrival order: memberships are timed from pieces read back out of
    order (and read again after the cache dropped them); or from the timeline read back whole, each
    piece once, iterations found through the position table (or searched, without room for one)."""
    monkeypatch.setattr(logs, "TOKEN_CHUNK", 300)
    monkeypatch.setattr(logs, "MERGE_FAN_IN", 3)
    monkeypatch.setattr(logs, "MERGE_BUFFER", 50)
    monkeypatch.setattr(logs, "ROW_GROUP", 5000)
    monkeypatch.setattr(logs, "EXPAND_ROWS", 400)
    monkeypatch.setattr(logs, "TIMELINE_CHUNK", 40)
    monkeypatch.setattr(logs, "TIMELINE_CACHE", 2)
    whole = reading != "windowed"
    if not whole:  # (small timelines are read whole)
        monkeypatch.setattr(logs, "WHOLE_TIMELINE_BYTES", 0)
    if reading == "whole, searched":
        monkeypatch.setattr(logs, "POSITION_TABLE_BYTES", 0)
    read = []  # timeline pieces read from the spill
    original_read = logs._Timeline._read
    monkeypatch.setattr(logs._Timeline, "_read", lambda self, timeline, k: (
        read.append((timeline, k)), original_read(self, timeline, k))[1])
    trace = small_trace()
    perm = np.random.default_rng(1).permutation(trace.num_rows) * 7 - 1000
    trace = trace.set_column(0, "request_id", pa.array(perm, pa.int64()))
    config = ReplayConfig(engine=EngineConfig(replicas=2, num_gpu_blocks=300, journal=journal, max_num_seqs=10),
                          policy=policy)
    with_cohort, without, log = token_files(trace, config, monkeypatch, tmp_path)
    assert with_cohort == without
    assert log.rows > (logs.MERGE_FAN_IN + 1) * logs.TOKEN_CHUNK  # runs enough for a merge pass (ids shuffled)
    if whole:
        assert len(read) == len(set(read)) > 10  # many pieces, each read once
    else:
        assert len(read) > len(set(read)) > 10  # many pieces, some read more than once


def _step(start_s, a, b, ctx0, m, k):
    return SimpleNamespace(start_s=start_s, a=a, b=b, ctx0=ctx0, decode_requests=m, k=k)


def test_a_membership_expands_to_the_rows_of_the_records_it_replaces():
    """Request 7's tokens logged per record (singles and stretches) and as cohort memberships over
    the same iterations give the same rows, ties included: it starts over, and its second life's
    token 3 (a single iteration) comes before its first life's (a stretch), singles first."""
    one = _step(1.0, 0.125, 1e-4, 300.0, 3, 1)
    stretch = _step(2.0, 0.0625, 3e-4, 410.0, 3, 4)
    later = _step(9.0, 0.25, 1e-3, 120.0, 2, 3)
    per_request, cohort = logs.TokenLog(), logs.TokenLog()
    for log in (per_request, cohort):
        log.single(7, 1, 0.5)
    per_request.single(7, 2, 1.5)
    per_request.stretch(7, 3, 4, stretch)
    per_request.single(7, 1, 8.0)  # it started over
    per_request.single(7, 2, 8.5)
    per_request.single(7, 3, 9.0)
    per_request.stretch(7, 4, 3, later)
    timeline = cohort.timeline()
    cohort.timeline()  # another cohort's timeline: numbers keep them apart
    cohort.advance(timeline, 0, 1, one, 1.5)
    cohort.advance(timeline, 1, 4, stretch, 2.5)
    cohort.membership(7, 2, 5, timeline, 0)
    cohort.single(7, 1, 8.0)
    cohort.single(7, 2, 8.5)
    cohort.advance(timeline, 5, 1, one, 9.0)
    cohort.advance(timeline, 6, 3, later, 9.9)
    cohort.membership(7, 3, 4, timeline, 5)
    expected = per_request.table()
    assert cohort.table().equals(expected)
    rows = expected.to_pydict()
    assert rows["token_index"] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert rows["time_s"][4] == 9.0 and rows["time_s"][5] == 2.0 + 0.0625 + 3e-4 * 410.0  # singles first


def test_cohort_timeline_holds_a_bounded_buffer():
    """A million-request replay has millions of cohort advances: the log holds a chunk of them."""
    log = logs.TokenLog(chunk=4096)
    step = SimpleNamespace(start_s=0.0, a=0.01, b=1e-6, ctx0=100.0, decode_requests=8, k=4)
    single = SimpleNamespace(k=1)
    timelines = [log.timeline() for _ in range(8)]
    at = [0] * 8
    members = 0
    tracemalloc.start()
    try:
        for k in range(200_000):
            c = k % 8
            j = 1 if k % 3 else 4
            log.advance(timelines[c], at[c], j, single if j == 1 else step, k * 1e-3)
            at[c] += j
            if k % 40 == 39 and at[c] >= 30:
                log.membership(k, 1, 30, timelines[c], at[c] - 30)
                members += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8e6, f"token log peaked at {peak / 1e6:.1f} MB of Python allocations"
    assert log.timeline_rows >= 200_000 - logs.TIMELINE_CHUNK
    assert log.finish().num_rows == members * 30 > 100_000
