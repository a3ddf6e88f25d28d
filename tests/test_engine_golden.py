"""Hand-computed timelines: one processor doing one unit of work per iteration.

A 20-token job arrives at t=0 and twenty 1-token jobs at t=1..20; prompts are one token and
cost nothing, so every iteration costs exactly 1 (``linear:base=1``) and a job's work is its
output length. ``max_num_seqs = 1`` makes it a single server.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from helpers_engine import column, run


def jobs():
    arrivals = [0] + list(range(1, 21))
    return make_trace(arrivals, [1] * 21, [20] + [1] * 20)


def test_fcfs_run_to_completion():
    r = run(jobs(), policy="sarathi", max_num_seqs=1)
    finish = column(r, "finish_s")
    assert finish[0] == 20.0  # the long job is never interrupted
    # short job i (arrived at i) starts at 19 + i and ends at 20 + i: each takes 20 end to end
    assert column(r, "e2e_s")[1:] == [20.0] * 20
    assert max(finish) == 40.0
    assert column(r, "max_itl_s")[0] == 1.0


def test_srpt_preempts_the_long_job():
    r = run(jobs(), policy="srpt", policy_params={"preempt": True}, max_num_seqs=1)
    assert column(r, "e2e_s")[1:] == [1.0] * 20  # each short job finishes one unit after arriving
    assert column(r, "finish_s")[0] == 40.0
    # its first token at t=1, then preempted until t=21; the recompute step emits token 2 at t=22
    assert column(r, "max_itl_s")[0] == 21.0
    assert column(r, "num_preemptions")[0] == 1
    assert max(column(r, "finish_s")) == 40.0


def test_sjf_without_preemption_is_fcfs_here():
    r = run(jobs(), policy="sjf", max_num_seqs=1)
    assert column(r, "finish_s")[0] == 20.0


def test_round_robin_time_slices():
    r = run(jobs(), policy="round-robin", policy_params={"quantum": 1}, max_num_seqs=1)
    finish = column(r, "finish_s")
    assert finish[0] == 40.0 and max(finish) == 40.0
    # Hand-traced FIFO round robin (arrivals at t join before the job preempted at t):
    # long runs [0,1], s1 [1,2], long [2,3], s2 [3,4], s3 [4,5], long [5,6], s4, s5, long [8,9]...
    assert finish[1:4] == [2.0, 4.0, 5.0]
    # the long job's stalls grow with the queue, but it is never starved the way SRPT starves it
    assert column(r, "max_itl_s")[0] < 21.0


def test_all_three_finish_everything_at_40():
    for policy, params in [("sarathi", {}), ("srpt", {"preempt": True}), ("round-robin", {})]:
        r = run(jobs(), policy=policy, policy_params=params, max_num_seqs=1)
        assert set(column(r, "status")) == {"finished"}
        assert max(column(r, "finish_s")) == 40.0


TEACHING = "linear:base=1,prefill_token=0.25,decode_seq=0.125"  # step = 1 + prefill/4 + decodes/8


def chunk_trace():
    # A: long output; B: long prompt arriving while A decodes; C, D: short requests right after B.
    return make_trace([0, 5, 6, 6.5], [8, 256, 8, 8], [40, 2, 4, 4])


def test_teaching_formula_exact_first_steps():
    r = run(make_trace([0], [8], [3]), runner=TEACHING)
    # prefill 8 tokens: 1 + 8/4 = 3 -> first token at 3; two decodes of 1 + 1/8 each
    assert column(r, "first_token_s") == [3.0]
    assert column(r, "finish_s") == [3.0 + 2 * 1.125]


def test_smaller_chunks_shorten_the_long_stall_and_delay_short_requests():
    big = run(chunk_trace(), runner=TEACHING, max_num_batched_tokens=512)
    small = run(chunk_trace(), runner=TEACHING, max_num_batched_tokens=32)
    # A decodes at 3, 4.125, 5.25; at 5.25 B's whole prompt joins A's decode: 1 + 256/4 + 1/8
    assert column(big, "max_itl_s")[0] == pytest.approx(65.125)
    # with a 32-token budget B's prompt goes in 31-token chunks beside A's decode: 1 + 31/4 + 1/8
    assert column(small, "max_itl_s")[0] == pytest.approx(8.875)
    ttft_big = column(big, "ttft_s")[2:]
    ttft_small = column(small, "ttft_s")[2:]
    assert all(s > b for s, b in zip(ttft_small, ttft_big))


def test_lifo_serves_the_newest_waiting_job_first():
    # The long job runs alone until 20; job i (arrived at i) waits while every newer job runs:
    # job 20 runs [20, 21], job 19 [21, 22], ..., job 1 [39, 40], so job i ends at 41 - i.
    r = run(jobs(), policy="lifo", max_num_seqs=1)
    finish = column(r, "finish_s")
    assert finish[0] == 20.0
    assert finish[1:] == [41.0 - i for i in range(1, 21)]
    assert column(r, "e2e_s")[1:] == [41.0 - 2 * i for i in range(1, 21)]


def test_lifo_with_room_for_everyone_is_fcfs():
    # with a free slot for every job, the order of the waiting queue never matters
    a, b = run(jobs(), policy="lifo", max_num_seqs=64), run(jobs(), policy="sarathi", max_num_seqs=64)
    assert column(a, "finish_s") == column(b, "finish_s")
