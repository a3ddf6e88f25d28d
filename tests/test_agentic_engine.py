"""Requests that depend on requests (trace schema v2, replay/core/depends.py): hand-computed timelines on
an idle engine with the linear runner, reuse of a parent's KV by its dependent, skipped dependents.

The runner's weights are powers of two, so every time below is exact in binary and the goldens
compare with ``==``: an iteration costs 1/4 s, plus 1/128 s per prompt token it computes, plus 1/8 s
per decoding request. A call of prompt P and output O alone on the engine takes one prefill
iteration (its first token) and O - 1 decode iterations: 1/4 + P/128 + (O - 1) * 3/8 seconds.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import make_trace
from helpers_engine import column, run

from servelab.common.errors import InputError
from servelab.traces import schema

RUNNER = "linear:base=0.25,prefill_token=0.0078125,decode_seq=0.125"


def service_s(prompt: int, output: int, cached: int = 0) -> float:
    return 0.25 + (prompt - cached) / 128 + (output - 1) * 0.375


def agent_trace(prompts, outputs, depends_on, think_s, arrivals=None, **extra):
    n = len(prompts)
    return make_trace(arrivals or [0.0] * n, prompts, outputs, session_id=[1] * n,
                      depends_on=pa.array(depends_on, pa.list_(pa.int64())),
                      think_s=pa.array(think_s, pa.float64()), **extra)


def test_react_chain_takes_its_calls_and_tool_waits():
    """Three calls, tool waits of 1 s and 2 s: the task ends at the sum of the service times and waits."""
    prompts, outputs = [64, 128, 192], [4, 8, 2]
    trace = agent_trace(prompts, outputs, [[], [0], [1]], [None, 1.0, 2.0])
    r = run(trace, runner=RUNNER)
    assert column(r, "status") == ["finished"] * 3
    s = [service_s(p, o) for p, o in zip(prompts, outputs)]
    arrival, finish = column(r, "arrival_s"), column(r, "finish_s")
    assert arrival == [0.0, s[0] + 1.0, s[0] + 1.0 + s[1] + 2.0]
    assert finish[2] == s[0] + s[1] + s[2] + 1.0 + 2.0
    assert column(r, "e2e_s") == s  # alone on the engine: no queueing
    assert r.meta["dependencies"] == {"dependent_requests": 2, "released": 2, "skipped": 0}


def test_fan_out_aggregator_arrives_after_the_last_branch():
    """A root, four branches of different lengths, an aggregator 0.5 s after the last branch finishes."""
    prompts = [32, 16, 16, 16, 16, 64]
    outputs = [2, 3, 9, 5, 7, 4]
    deps = [[], [0], [0], [0], [0], [1, 2, 3, 4]]
    think = [None, 0.25, 0.25, 0.25, 0.25, 0.5]
    r = run(agent_trace(prompts, outputs, deps, think), runner=RUNNER)
    assert column(r, "status") == ["finished"] * 6
    finish, arrival = column(r, "finish_s"), column(r, "arrival_s")
    assert arrival[1:5] == [finish[0] + 0.25] * 4
    assert finish[2] == max(finish[1:5])  # the longest branch ends last
    assert arrival[5] == finish[2] + 0.5
    assert finish[5] == arrival[5] + service_s(64, 4)


def test_kept_kv_means_the_next_call_prefills_only_new_tokens():
    """The second call's prompt is the first call's prompt and output, then 31 new tokens; its hashes
    continue the first call's chain. With prefix caching the first call's 80 computed tokens (five full
    16-token blocks: its prompt and all but its last output token, which no iteration ever computes)
    stay cached over the 1 s tool wait, so the second call computes its 31 new tokens and that one."""
    p1, o1, new, o2 = 64, 17, 31, 4
    p2 = p1 + o1 + new
    chain1 = [11, 12, 13, 14, 15, 16]  # 16-token blocks over prompt + output (81 tokens)
    chain2 = chain1[:5] + [26, 27, 28]  # the parent's five full context blocks, then its own
    trace = agent_trace([p1, p2], [o1, o2], [[], [0]], [None, 1.0], prefix_hashes=[chain1, chain2])
    trace = trace.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    for caching, cached in ((True, 80), (False, 0)):
        r = run(trace, runner=RUNNER, enable_prefix_caching=caching)
        assert column(r, "cached_tokens") == [0, cached]
        steps = r.steps.to_pylist()
        second = [s for s in steps if s["start_s"] >= column(r, "arrival_s")[1]]
        assert second[0]["prefill_tokens"] == p2 - cached
        if caching:
            assert second[0]["prefill_tokens"] == new + 1
        assert column(r, "finish_s")[1] == column(r, "arrival_s")[1] + service_s(p2, o2, cached)


def test_v1_hashes_do_not_cover_outputs():
    """Without depends_on (schema v1) a request's hashes key its prompt only, as before."""
    trace = make_trace([0.0, 100.0], [64, 96], [17, 2], prefix_hashes=[[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    trace = trace.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    r = run(trace, runner=RUNNER)
    assert column(r, "cached_tokens") == [0, 64]  # the prompt's four blocks, not the output's


def test_a_failed_parent_skips_its_dependents_transitively():
    """The first call is larger than any replica's KV (rejected): the rest of its task is never sent;
    another task runs untouched."""
    trace = make_trace([0.0, 0.0, 0.0, 0.0, 0.5], [4000, 16, 16, 16, 16], [2, 2, 2, 2, 2],
                       session_id=[1, 1, 1, 1, 2],
                       depends_on=pa.array([[], [0], [1], [0, 1], []], pa.list_(pa.int64())),
                       think_s=pa.array([None, 1.0, 1.0, 0.0, None], pa.float64()))
    r = run(trace, runner=RUNNER, num_gpu_blocks=64)
    assert column(r, "status") == ["rejected", "skipped", "skipped", "skipped", "finished"]
    reasons = column(r, "reason")
    assert reasons[1] == "request 0 it depends on ended rejected"
    assert reasons[2] == "request 1 it depends on ended skipped"
    assert column(r, "arrival_s")[1:4] == [None] * 3
    assert column(r, "replica")[1:4] == [None] * 3
    assert r.meta["dependencies"]["skipped"] == 3


def test_an_aborted_call_ends_its_task():
    """A client timeout aborts the second call: the third is skipped; the first finished."""
    trace = agent_trace([16, 512, 16], [2, 40, 2], [[], [0], [1]], [None, 1.0, 1.0],
                        timeout_s=pa.array([None, 2.0, None], pa.float64()))
    r = run(trace, runner=RUNNER)
    assert column(r, "status") == ["finished", "aborted", "skipped"]
    assert column(r, "reason")[2] == "request 1 it depends on ended aborted"


def test_horizon_leaves_dependents_unfinished():
    trace = agent_trace([16, 16], [2, 2], [[], [0]], [None, 50.0])
    r = run(trace, runner=RUNNER, until_s=10.0)
    assert column(r, "status") == ["finished", "unfinished"]


def test_closed_loop_sessions_still_chain_without_depends_on():
    """A v1 closed-loop session (think_s, no depends_on) in the same trace as a dependent task."""
    trace = make_trace([0.0, 0.0, 0.0, 0.0], [16, 16, 16, 16], [2, 2, 2, 2], session_id=[1, 1, 2, 2],
                       think_s=pa.array([None, 1.0, None, 3.0], pa.float64()),
                       depends_on=pa.array([None, None, [], [2]], pa.list_(pa.int64())))
    r = run(trace, runner=RUNNER)
    finish, arrival = column(r, "finish_s"), column(r, "arrival_s")
    assert arrival[1] == finish[0] + 1.0 and arrival[3] == finish[2] + 3.0


# ---- validation: the file, the column and the row


def _validate(depends_on, arrivals=None):
    n = len(depends_on)
    t = make_trace(arrivals or [0.0] * n, [8] * n, [2] * n, depends_on=pa.array(depends_on, pa.list_(pa.int64())))
    schema.validate(t, "t.arrow")


@pytest.mark.parametrize("deps, arrivals, row, rule", [
    ([[], [7]], None, 2, "depends on request 7, which is not in the trace"),
    ([[], [1]], None, 2, "depends on itself (a cycle)"),
    ([[], [0, 0]], None, 2, "lists request 0 twice"),
    ([[1], []], [0.0, 0.0], 1, "dependency cycle"),  # row order alone is no error ...
    ([[2], [0], [1]], None, 1, "dependency cycle: request 0 waits for 2 waits for 1 waits for 0"),
    ([[], [2], []], [0.0, 1.0, 2.0], 2, "depends on request 2, which arrives later"),
])
def test_bad_dependencies_name_column_and_row(deps, arrivals, row, rule):
    if rule == "dependency cycle" and deps == [[1], []]:  # ... a parent on a later row, arriving together, is fine
        _validate(deps, arrivals)
        return
    with pytest.raises(InputError) as err:
        _validate(deps, arrivals)
    assert err.value.column == "depends_on" and err.value.row == row and err.value.path == "t.arrow"
    assert rule in err.value.rule


def test_task_deadline_must_be_positive():
    t = make_trace([0.0, 0.0], [8, 8], [2, 2], task_deadline_s=pa.array([None, -1.0], pa.float64()))
    with pytest.raises(InputError) as err:
        schema.validate(t, "t.arrow")
    assert err.value.column == "task_deadline_s" and err.value.row == 2


def test_v2_files_round_trip_and_v1_files_stay_v1(tmp_path):
    from servelab.traces.io import read_trace, trace_metadata, write_trace

    v2 = agent_trace([16, 16], [2, 2], [[], [0]], [None, 1.0])
    got = read_trace(write_trace(v2, tmp_path / "v2.arrow", source="unit"))
    assert trace_metadata(got)["servelab.schema_version"] == "2"
    assert got.column("depends_on").to_pylist() == [[], [0]]
    v1 = make_trace([0.0], [8], [2])
    assert trace_metadata(read_trace(write_trace(v1, tmp_path / "v1.arrow", source="unit")))[
        "servelab.schema_version"] == "1"


# ---- the KV bookkeeping with output blocks cached (keep_outputs) under pressure


AGENT_CASES = {
    "recompute": ("sarathi", {}, {"num_gpu_blocks": 300}),
    "swap": ("srpt", {"preempt": True}, {"num_gpu_blocks": 300, "preemption": "swap", "kv_bytes_per_token": 1024,
                                         "swap_space_gb": 0.0002}),
    "small chunks": ("vllm-v0", {}, {"num_gpu_blocks": 300, "max_num_batched_tokens": 40}),
    "tiers, two replicas": ("sarathi", {}, {"num_gpu_blocks": 300, "replicas": 2, "router": "prefix-affinity",
                                            "kv_tiers": ("dram:capacity_gb=0.0005",), "kv_bytes_per_token": 1024}),
}


@pytest.mark.parametrize("block", [16, 24])
@pytest.mark.parametrize("case", sorted(AGENT_CASES))
def test_kv_bookkeeping_adds_up_with_dependent_requests(monkeypatch, case, block):
    import servelab.assembly
    from test_engine_invariants import CheckedEngine

    from servelab.traces.agentic_synth import generate_agentic, make_agent_config

    policy, params, engine = AGENT_CASES[case]
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = generate_agentic(make_agent_config(shape="mix", tasks=60, arrival={"rate_per_s": 8.0},
                                               prompt="lognormal:200:0.5", output="lognormal:40:0.5",
                                               new_tokens="lognormal:60:0.5", tool_s="exp:0.2", user_think_s="exp:0.3",
                                               prefix_block_tokens=block, seed=block))
    before = CheckedEngine.events
    r = run(trace, policy=policy, policy_params=params,
            runner="linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", **engine)
    assert CheckedEngine.events - before > 300
    assert set(column(r, "status")) == {"finished"}
    assert sum(column(r, "cached_tokens")) > 0


def test_skipped_requests_count_as_misses_in_the_views(tmp_path):
    from servelab.api import write_run
    from servelab.scoring.db import query
    from servelab.scoring.slo import SloTable

    trace = make_trace([0.0, 0.0, 0.0], [4000, 16, 16], [2, 2, 2], session_id=[1, 1, 2],
                       depends_on=pa.array([[], [0], []], pa.list_(pa.int64())),
                       think_s=pa.array([None, 1.0, None], pa.float64()))
    run_dir = write_run(run(trace, runner=RUNNER, num_gpu_blocks=64), tmp_path / "r")
    row = query(run_dir, "SELECT requests, finished, rejected, skipped, met_all FROM slo_attainment "
                         "WHERE scope = 'overall'", slo=SloTable.parse_cli(["ttft=10s"])).to_pylist()[0]
    assert row == {"requests": 3, "finished": 1, "rejected": 1, "skipped": 1, "met_all": 1}
    # the run's span counts the same requests as offered (the skipped one, with no arrival, among them)
    assert query(run_dir, "SELECT requests, after_horizon FROM run_span").to_pylist() == [{"requests": 3, "after_horizon": 0}]


@pytest.mark.parametrize("shape", ["react", "chat"])
def test_synthetic_chains_on_an_idle_engine_match_a_hand_computation(shape):
    """Chains of calls (tasks 1,000 s apart: the engine is idle for each): every call arrives its
    delay after its parent finished, is served in exactly its closed-form time, and finds its
    parent's computed context cached: all full 16-token blocks of the parent's prompt and output but
    the never-computed last token."""
    from servelab.traces.agentic_synth import generate_agentic, make_agent_config

    trace = generate_agentic(make_agent_config(
        shape=shape, tasks=6, arrival={"process": "constant", "rate_per_s": 0.001}, calls="uniform:2:5",
        chat_turns="uniform:2:5", prompt="lognormal:300:0.5", output="lognormal:40:0.8",
        new_tokens="lognormal:80:0.5", tool_s="exp:2", user_think_s="exp:4", seed=7))
    r = run(trace, runner=RUNNER, max_num_batched_tokens=8192)
    got = {x["request_id"]: x for x in r.requests.to_pylist()}
    for row in trace.to_pylist():
        x = got[row["request_id"]]
        assert x["status"] == "finished"
        if row["depends_on"]:
            (p,) = row["depends_on"]
            parent = got[p]
            assert x["arrival_s"] == pytest.approx(parent["finish_s"] + row["think_s"], rel=1e-12, abs=1e-9)
            assert x["cached_tokens"] == (parent["prompt_tokens"] + parent["output_tokens"] - 1) // 16 * 16
        else:
            assert x["arrival_s"] == row["arrival_s"] and x["cached_tokens"] == 0
        expected = service_s(row["prompt_tokens"], row["output_tokens"], x["cached_tokens"])
        assert x["finish_s"] - x["arrival_s"] == pytest.approx(expected, rel=1e-12, abs=1e-9)
