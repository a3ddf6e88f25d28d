"""Policies and KV for agents (#28 item 5): least attained service per task, KV retention across
tool waits, task-affinity routing. Timelines are hand-computed on the linear runner."""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import column, run

from servelab.common.errors import ServelabError

ONE_AT_A_TIME = dict(max_num_seqs=1, max_num_batched_tokens=4096)


# -- las ----------------------------------------------------------------------------------------
def _las_trace():
    """Task 1's first call (1 + 3 tokens of service) runs alone from t=0 to t=3 (1 s iterations:
    prefill + first token, then two decodes); task 1's second call and task 2's first wait."""
    return make_trace([0.0, 0.5, 0.6], [1, 1, 1], [3, 2, 2], session_id=[1, 1, 2])


def test_las_serves_the_least_served_task_first():
    fcfs = run(_las_trace(), policy="sarathi", **ONE_AT_A_TIME)
    assert column(fcfs, "finish_s") == [3.0, 5.0, 7.0]
    las = run(_las_trace(), policy="las", **ONE_AT_A_TIME)
    # at t=3 task 1 has 4 tokens of service, task 2 none: task 2's call goes first
    assert column(las, "first_scheduled_s") == [0.0, 5.0, 3.0]
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def test_las_weights_count_service():
    # w_in = 0, w_out = 0.1: task 1 has 0.3; task 2 none still: the same order
    las = run(_las_trace(), policy="las", policy_params={"w_in": 0, "w_out": 0.1}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def test_las_requests_without_session_are_their_own_tasks():
    trace = make_trace([0.0, 0.5, 0.6], [1, 1, 1], [3, 2, 2])
    # every task has 0 service at t=3 (the first call's task is done): arrival order
    assert column(run(trace, policy="las", **ONE_AT_A_TIME), "finish_s") == [3.0, 5.0, 7.0]


def test_las_starvation_bound_promotes_the_oldest():
    # task 1's second call has waited 2.5 s at t=3: past a 1 s bound it goes first, oldest first
    las = run(_las_trace(), policy="las", policy_params={"max_wait_s": 1.0}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 5.0, 7.0]
    # a 3 s bound is not reached by then: least attained service decides
    las = run(_las_trace(), policy="las", policy_params={"max_wait_s": 3.0}, **ONE_AT_A_TIME)
    assert column(las, "finish_s") == [3.0, 7.0, 5.0]


def _starving_trace(n_new=30):
    """Task 1 (two calls) against a stream of new one-call tasks arriving faster than they are served:
    each new task has no service, so without a bound task 1's second call waits for all of them."""
    arrivals = [0.0, 0.1] + [0.2 + i for i in range(n_new)]
    return make_trace(arrivals, [1] * len(arrivals), [3, 2] + [2] * n_new,
                      session_id=[1, 1] + list(range(2, 2 + n_new)))


def test_las_without_bound_starves_a_served_task():
    las = run(_starving_trace(), policy="las", **ONE_AT_A_TIME)
    start = column(las, "first_scheduled_s")
    assert start[1] == max(start)  # served last of all


@pytest.mark.parametrize("bound", [2.0, 5.0, 11.0])
def test_las_starvation_bound_holds(bound):
    """Task 1's second call waits at most the bound plus the service under way when it is reached
    (one at a time; the longest service: 3 s), and requests that reached the bound are served
    oldest first (the stream overloads the replica, so most of them do)."""
    las = run(_starving_trace(), policy="las", policy_params={"max_wait_s": bound}, **ONE_AT_A_TIME)
    arrival, start = column(las, "arrival_s"), column(las, "first_scheduled_s")
    assert start[1] - arrival[1] <= bound + 3.0
    assert start[1] < max(start)
    starved = sorted((s, a) for a, s in zip(arrival, start) if s - a >= bound + 3.0)
    assert len(starved) > 5
    assert [a for _, a in starved] == sorted(a for _, a in starved)


def test_las_params_are_checked():
    with pytest.raises(ServelabError, match="max_wait_s"):
        run(_las_trace(), policy="las", policy_params={"max_wait_s": -1})
    with pytest.raises(ServelabError, match="w_in and w_out"):
        run(_las_trace(), policy="las", policy_params={"w_in": 0, "w_out": 0})


def test_las_does_not_count_cached_prefix_as_service(monkeypatch):
    """Task 1's second call reuses its first call's two full 16-token blocks from the prefix cache:
    only its 17 other prompt tokens and its output count (task 1: 33 + 1, then 17 + 1; task 2: 21 + 1)."""
    from servelab.policies.las import LeastAttainedService

    seen = {}
    orig = LeastAttainedService.on_step

    def spy(self, batch, num_iterations):
        orig(self, batch, num_iterations)
        seen.update(self.attained)

    monkeypatch.setattr(LeastAttainedService, "on_step", spy)
    trace = make_trace([0.0, 5.0, 10.0], [33, 49, 21], [1, 1, 1], session_id=[1, 1, 2],
                       prefix_hashes=[[1, 2, 3], [1, 2, 4, 5], [9, 10]])
    trace = trace.replace_schema_metadata({b"prefix_block_tokens": b"16"})
    result = run(trace, policy="las", **ONE_AT_A_TIME)
    assert column(result, "cached_tokens")[1] == 32
    assert seen == {1: 33 + 1 + 17 + 1, 2: 21 + 1}
