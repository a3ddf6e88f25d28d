"""vLLM's balancing over its DP ranks (routers/vllm_dp.py): lowest 4 x waiting + running, from counts
published every 100 ms, with the API server's own sends counted as waiting in between."""

import pytest
from conftest import make_trace
from servelab.api import replay
from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig
from servelab.routers.base import make_router
from servelab.routers.vllm_dp import Params


class Rank:
    def __init__(self, rid: int, waiting: int, running: int):
        self.id, self.waiting, self.running = rid, [None] * waiting, [None] * running


class Req:
    def __init__(self, t: float):
        self.arrival_s = t


def test_the_lowest_four_times_waiting_plus_running_ties_to_the_first_rank():
    router = make_router("vllm-dp")
    ranks = [Rank(0, 1, 0), Rank(1, 0, 3), Rank(2, 0, 5)]  # scores 4, 3, 5
    assert router.route(Req(0.0), ranks) is ranks[1]
    router = make_router("vllm-dp")
    assert router.route(Req(0.0), [Rank(0, 0, 2), Rank(1, 0, 2)]).id == 0


def test_its_own_sends_count_as_waiting_until_the_next_snapshot():
    router = make_router("vllm-dp")
    ranks = [Rank(0, 0, 0), Rank(1, 0, 0)]
    # the ranks' lists do not change here: only the router's own count moves the second request
    assert [router.route(Req(t), ranks).id for t in (0.0, 0.01, 0.02, 0.03)] == [0, 1, 0, 1]
    ranks[0].running = [None] * 9  # published at the next snapshot, 100 ms after the last
    assert router.route(Req(0.05), ranks).id == 0  # (the old snapshot: 2 sent to each)
    assert router.route(Req(0.12), ranks).id == 1  # the new one: 9 running against 0
    with pytest.raises(ServelabError, match="stats_interval_s"):
        Params(stats_interval_s=-1.0)


def test_a_dp_replay_with_it_balances_the_ranks():
    trace = make_trace([i * 0.01 for i in range(60)], [300 + 50 * (i % 7) for i in range(60)],
                       [20 + i % 11 for i in range(60)])
    result = replay(trace, ReplayConfig.from_dict({"model": "llama-3.1-8b", "gpu": "h100-80gb", "dp": 2,
                                                   "router": "vllm-dp"}))
    ranks = result.requests.column("replica").to_pylist()
    assert set(ranks) == {0, 1} and abs(ranks.count(0) - ranks.count(1)) <= 6
