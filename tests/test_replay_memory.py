"""A million-request replay in under 1 GB (issue #17): Request objects share the int objects they
can, and the requests table frees them as it is built. The results must not change."""

from __future__ import annotations

import functools

import pyarrow as pa
import pytest
from servelab.replay import results
from servelab.replay.core.request import Request


def plain_requests(trace: pa.Table) -> list[tuple]:
    """Each row's fields as the trace gives them (the expected values, without the sharing)."""
    rows = trace.to_pylist()
    return [(r["request_id"], i, r["prompt_tokens"], r["output_tokens"]) for i, r in enumerate(rows)]


def fields(reqs: list[Request]) -> list[tuple]:
    return [(r.request_id, r.index, r.prompt_tokens, r.output_tokens) for r in reqs]


def test_token_counts_share_one_object_per_value_and_index_is_the_id():
    # 300-row batches: sharing holds across them; counts above 256 (ints Python does not cache)
    trace = pa.table({"request_id": pa.array(range(1000), pa.int64()),
                      "arrival_s": pa.array([i * 0.1 for i in range(1000)], pa.float64()),
                      "prompt_tokens": pa.array([1000 + i % 7 for i in range(1000)], pa.int32()),
                      "output_tokens": pa.array([300 + i % 5 for i in range(1000)], pa.int32())})
    trace = pa.Table.from_batches(trace.to_batches(max_chunksize=300))
    reqs, _ = results.requests_from_table(trace)
    assert fields(reqs) == plain_requests(trace)
    assert len({id(r.prompt_tokens) for r in reqs}) == 7
    assert len({id(r.output_tokens) for r in reqs}) == 5
    assert all(r.index is r.request_id for r in reqs)
    assert all(r.max_output_tokens is r.output_tokens for r in reqs)


@pytest.mark.parametrize("ids", [[5, 6, 7, 8], [0, 2, 1, 3], [0, 1, 2, 4]])
def test_index_is_the_row_whatever_the_ids(ids):
    trace = pa.table({"request_id": pa.array(ids, pa.int64()), "arrival_s": pa.array([0.0, 1.0, 2.0, 3.0]),
                      "prompt_tokens": pa.array([10, 20, 30, 40], pa.int32()),
                      "output_tokens": pa.array([1, 2, 3, 4], pa.int32())})
    reqs, _ = results.requests_from_table(trace)
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    assert [r.request_id for r in reqs] == ids


def test_releasing_builds_the_same_table_and_empties_the_list():
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=700, rate=20.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=2)
    reqs, _ = results.requests_from_table(trace)
    kept = results.requests_table_from(reqs, chunk=128)
    assert results.requests_table_from(reqs, chunk=128, release=True).equals(kept)
    assert reqs == [None] * 700


@pytest.fixture
def live_requests(monkeypatch):
    """The number of Request objects alive that this test made: counted as they are made and freed (a
    scan of every object in the process, as ``gc.get_objects`` does, costs seconds in a worker that ran
    many tests). No collection is forced: the freeing under test is by reference count, not by cycle."""
    alive = [0]
    init = Request.__init__

    def made(self, *args):
        init(self, *args)
        alive[0] += 1

    def freed(self):
        alive[0] -= 1

    monkeypatch.setattr(Request, "__init__", made)
    monkeypatch.setattr(Request, "__del__", freed, raising=False)
    return lambda: alive[0]


@pytest.mark.parametrize("closed_loop", [False, True])
def test_a_replay_frees_its_requests_while_building_the_table(monkeypatch, live_requests, closed_loop):
    """Nothing but the list being converted holds the finished requests (not the engine's arrivals,
    nor its closed-loop turns): each chunk converted frees its Request objects."""
    from servelab import assembly as api  # (the module that runs the replay: its requests_table_from is patched)
    from servelab.traces.synth import synth_trace

    kwargs = {"turns": 3.0, "think_s": 2.0} if closed_loop else {}
    trace = synth_trace(n=1200, rate=20.0, prompt="lognormal:200:1.0", output="lognormal:40:1.0", seed=4,
                        **kwargs)
    live = []
    batch = results._requests_batch

    def counting(reqs):
        live.append(live_requests())
        return batch(reqs)

    monkeypatch.setattr(results, "_requests_batch", counting)
    monkeypatch.setattr(api, "requests_table_from", functools.partial(results.requests_table_from, chunk=300))
    result = api.replay(trace, api.ReplayConfig(engine=api.EngineConfig(replicas=2)))
    assert result.requests.num_rows == 1200 and result.meta["counts"]["finished"] == 1200
    # the count before each chunk: all 1,200, then the previous chunk's 300 freed each time
    assert live == [1200, 900, 600, 300]
    assert live_requests() == 0
