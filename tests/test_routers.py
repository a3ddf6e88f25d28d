"""Routers (routers/): the registry, and each router's choice on hand-built replica states."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import make_trace
from helpers_engine import run
from servelab.common.errors import ServelabError
from servelab.replay.config import typed_params
from servelab.replay.core.plugins import ROUTERS
from servelab.routers.base import make_router, router_names


def typed(name: str, table: dict):
    """A router's parameters from a table, as a config types them (at the edge, once)."""
    return typed_params(ROUTERS, name, table)


def replica(rid, outstanding=0, used=0, total=100, waiting=0, cached=0, max_num_seqs=10, running=0):
    kv = SimpleNamespace(used=used, total=total, cached_tokens=lambda req: cached)
    return SimpleNamespace(id=rid, outstanding_tokens=outstanding, kv=kv, waiting=[None] * waiting,
                           running=[None] * running, config=SimpleNamespace(max_num_seqs=max_num_seqs), lora=None)


REQ = SimpleNamespace(prompt_tokens=100, session_id=None, lora_adapter=None, arrival_s=0.0)


def test_every_router_is_registered_by_being_in_the_package():
    assert set(router_names()) >= {"round-robin", "least-outstanding", "least-kv", "power-of-two", "weighted",
                                   "prefix-affinity", "session"}


def test_unknown_router_and_bad_parameters_are_clear_errors():
    with pytest.raises(ServelabError, match="unknown router 'least'.*known: least-kv, least-outstanding"):
        make_router("least")
    with pytest.raises(ServelabError, match="unknown parameter 'queu'"):
        make_router("weighted", typed("weighted", {"queu": 1}))
    with pytest.raises(ServelabError, match="kv must be >= 0"):
        make_router("weighted", typed("weighted", {"kv": -1}))
    with pytest.raises(ServelabError, match="unknown router 'random'"):
        run(make_trace([0], [1], [1]), router="random")


def test_least_kv_takes_the_smallest_share_used_not_the_fewest_blocks():
    # 30/100 = 0.3 vs 20/40 = 0.5: the first, although it holds more blocks
    assert make_router("least-kv").route(REQ, [replica(0, used=30), replica(1, used=20, total=40)]).id == 0
    # a tie in share goes to fewer outstanding tokens
    assert make_router("least-kv").route(REQ, [replica(0, used=10, outstanding=9), replica(1, used=10)]).id == 1


def test_weighted_score_by_hand():
    # r0: 1 * 5/10 + 1 * 20/100 - 1 * 0/100 = 0.7 ; r1: 1 * 0/10 + 1 * 80/100 - 1 * 50/100 = 0.3
    r0, r1 = replica(0, waiting=5, used=20), replica(1, used=80, cached=50)
    assert make_router("weighted").route(REQ, [r0, r1]).id == 1
    # without the prefix term r1 scores 0.8 > 0.7
    assert make_router("weighted", typed("weighted", {"prefix": 0})).route(REQ, [r0, r1]).id == 0
    # queue weight 0: r0 scores 0.2 - 0 = 0.2 < 0.3
    assert make_router("weighted", typed("weighted", {"queue": 0})).route(REQ, [r0, r1]).id == 0


def test_power_of_two_is_seeded_and_never_picks_the_most_loaded_of_three():
    loads = [replica(0, outstanding=5), replica(1, outstanding=900), replica(2, outstanding=7)]
    router = make_router("power-of-two", seed=4)
    seq = [router.route(REQ, loads).id for _ in range(60)]
    again = make_router("power-of-two", seed=4)
    assert seq == [again.route(REQ, loads).id for _ in range(60)]
    other = make_router("power-of-two", seed=5)
    assert seq != [other.route(REQ, loads).id for _ in range(60)]
    assert 1 not in seq and set(seq) == {0, 2}  # 0 wins every pair it is in; 2 wins the pair (1, 2)
    two = [replica(0, outstanding=3), replica(1, outstanding=1)]
    assert {make_router("power-of-two", seed=s).route(REQ, two).id for s in range(5)} == {1}


@pytest.mark.parametrize("name", ["least-kv", "power-of-two", "weighted"])
def test_new_routers_replay_every_request(name):
    from helpers_engine import synthetic

    result = run(synthetic(n=200, rate=40.0), runner="linear:base=0.01,prefill_token=0.0001", replicas=3,
                 router=name, num_gpu_blocks=2000)
    assert set(result.requests.column("status").to_pylist()) == {"finished"}
    assert len(set(result.requests.column("replica").to_pylist())) == 3


def test_session_stays_home_until_home_is_overloaded_or_gone():
    router = make_router("session")
    turn = SimpleNamespace(prompt_tokens=100, session_id="s")
    r0, r1 = replica(0, outstanding=100), replica(1, outstanding=50)
    assert router.route(turn, [r0, r1]).id == 1  # first turn: the least loaded becomes home
    r1.outstanding_tokens = 1_000  # busier than r0 now, but within 1.5 x 100 + 4096
    assert router.route(turn, [r0, r1]).id == 1
    r1.outstanding_tokens = 4_247  # 1.5 x 100 + 4096 = 4246: overloaded, so it moves to r0 ...
    assert router.route(turn, [r0, r1]).id == 0
    r1.outstanding_tokens = 0
    assert router.route(turn, [r0, r1]).id == 0  # ... which is its home from then on
    assert router.route(turn, [r1]).id == 1  # home gone (failed): the least loaded live one
    never = make_router("session", typed("session", {"balance": 0}))
    assert never.route(turn, [r0, r1]).id == 1
    r1.outstanding_tokens = 10**9
    assert never.route(turn, [r0, r1]).id == 1  # balance 0: sticky whatever the load
    with pytest.raises(ServelabError, match="balance and slack_tokens must be >= 0"):
        make_router("session", typed("session", {"balance": -1}))
