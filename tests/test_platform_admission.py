"""Front-door pieces on their own: quota parsing, token buckets, throttling, retries, queue cap, pause rules, failures."""

from __future__ import annotations

import math

import pytest

from servelab.common.errors import ServelabError
from servelab.replay.platform.admission import Admission, Ledger, PauseRule, Quota, TokenBucket
from servelab.replay.core.journal import Journal
from servelab.replay.core.specs import Failure, check_failures
from servelab.replay.core.request import Request


def req(i, tenant="a", tier="standard", prompt=100, out=50, arrival=0.0):
    return Request(i, arrival, prompt, out, tenant=tenant, tier=tier, index=i)


def test_bucket_refills_at_its_rate_and_caps_at_a_minute():
    b = TokenBucket(600)  # 10 per second
    b.take(600)
    assert b.wait_s(100, 0.0) == pytest.approx(10.0)
    assert b.wait_s(100, 5.0) == pytest.approx(5.0)
    assert b.wait_s(100, 10.0) == 0.0
    b.refill(1000.0)
    assert b.level == 600
    assert math.isinf(b.wait_s(601, 1000.0))


def test_tpm_quota_throttles_only_the_tenant_over_it():
    adm = Admission((Quota.parse("tenant=a:tpm=600"),))
    assert adm.check(req(0), 0.0) is None  # 150 tokens
    assert adm.check(req(1), 0.0) is None
    assert adm.check(req(2), 0.0) is None
    assert adm.check(req(3), 0.0) is None  # 600 used
    t = adm.check(req(4), 0.0)
    assert t is not None and "tpm" in t.reason and t.retry_in_s == pytest.approx(15.0)  # 150 tokens at 10/s
    assert adm.check(req(5, tenant="b"), 0.0) is None  # b has no quota
    assert adm.check(req(6), 15.0) is None


def test_default_quota_gives_each_tenant_its_own_bucket():
    adm = Admission((Quota.parse("tenant=*:rpm=1"),))
    assert adm.check(req(0, tenant="a"), 0.0) is None
    assert adm.check(req(1, tenant="b"), 0.0) is None
    assert adm.check(req(2, tenant="a"), 1.0) is not None


def test_tier_pool_is_shared_by_its_tenants_and_tenant_quota_by_its_tiers():
    adm = Admission((Quota.parse("tier=flex:rpm=2"), Quota.parse("tenant=a:rpm=3")))
    assert adm.check(req(0, tenant="a", tier="flex"), 0) is None
    assert adm.check(req(1, tenant="b", tier="flex"), 0) is None
    assert adm.check(req(2, tenant="c", tier="flex"), 0) is not None  # the flex pool is empty
    assert adm.check(req(3, tenant="a", tier="priority"), 0) is None
    assert adm.check(req(4, tenant="a", tier="standard"), 0) is None
    assert adm.check(req(5, tenant="a", tier="standard"), 0) is not None  # a's 3 rpm shared by its tiers


def test_refused_request_takes_nothing():
    adm = Admission((Quota.parse("tenant=a:rpm=10,tpm=100"),))
    assert adm.check(req(0, prompt=80, out=40), 0) is not None  # 120 > 100: never fits
    assert adm.check(req(1, prompt=50, out=40), 0) is None  # the rpm and tpm were untouched


def test_concurrency_cap_and_release():
    adm = Admission((Quota.parse("tenant=a:concurrency=2"),))
    r0, r1, r2 = req(0), req(1), req(2)
    assert adm.check(r0, 0) is None and adm.check(r1, 0) is None
    t = adm.check(r2, 0)
    assert t is not None and "in flight" in t.reason and t.retry_in_s is None and not t.final
    adm.on_end(r0, 1.0)
    assert adm.check(r2, 1.0) is None


def test_unused_output_is_given_back():
    adm = Admission((Quota.parse("tenant=a:tpm=600"),))
    r = Request(0, 0.0, 100, 20, max_output_tokens=200, tenant="a")
    assert adm.check(r, 0) is None  # takes 300
    r.num_generated_tokens = 20
    adm.on_end(r, 0)  # 180 back
    assert adm.buckets[("tenant:a", "tpm")].level == pytest.approx(480)


def test_retry_backoff_doubles_caps_and_gives_up():
    adm = Admission((Quota.parse("tenant=a:rpm=1"),), retries=3, retry_backoff_s=2.0, retry_max_backoff_s=5.0)
    r = req(0)
    t = adm.check(req(9), 0) or adm.check(r, 0)
    assert [adm.retry_at(r, k, t, 10.0) for k in range(4)] == [12.0, 14.0, 15.0, None]
    after = Admission((Quota.parse("tenant=a:rpm=1"),), retries=1, retry_after=True)
    after.check(req(9), 0)
    t = after.check(r, 0)
    assert after.retry_at(r, 0, t, 0.0) == pytest.approx(60.0)  # exactly when one request refilled


def test_retry_jitter_is_seeded():
    mk = lambda seed: Admission((), retries=2, retry_backoff_s=4.0, retry_jitter=0.5, seed=seed)  # noqa: E731
    from servelab.replay.platform.admission import Throttle

    t = Throttle("x", None)
    a, b, c = mk(1).retry_at(req(3), 0, t, 0.0), mk(1).retry_at(req(3), 0, t, 0.0), mk(2).retry_at(req(3), 0, t, 0.0)
    assert a == b != c and 2.0 <= a <= 4.0


def test_queue_cap_sheds_the_lowest_tier_most_recent():
    class R:
        def __init__(self, waiting):
            self.waiting = waiting

    adm = Admission((), queue_cap=3, tier_ranks={"priority": 0, "standard": 1, "flex": 2})
    w = [req(0, tier="flex", arrival=0.0), req(1, tier="flex", arrival=1.0), req(2, tier="standard", arrival=2.0)]
    replicas = [R(w[:2]), R(w[2:])]
    assert adm.shed_victim(req(3, tier="priority", arrival=3.0), replicas) is w[1]
    incoming = req(4, tier="flex", arrival=3.0)
    assert adm.shed_victim(incoming, replicas) is incoming  # nothing ranks below it
    assert adm.shed_victim(incoming, [R(w[:2])]) is None  # room left


@pytest.mark.parametrize("spec, message", [
    ("tenant=a", "expected tenant=NAME"),
    ("user=a:rpm=1", "expected tenant=NAME"),
    ("tenant=a:rps=1", "unknown field 'rps=1'"),
    ("tenant=a:rpm=0", "'rpm' must be > 0"),
    ("tenant=a:rpm=x", "'rpm' needs a number"),
    ("tenant=a:", "no limits"),
    ("tier=flex:concurrency=3", "concurrency is a tenant limit"),
])
def test_bad_quota_specs(spec, message):
    with pytest.raises(ServelabError, match=message):
        Quota.parse(spec)


def test_pause_rule_parsing():
    assert PauseRule.parse("tier=flex,waiting=32") == PauseRule("flex", "waiting", 32.0, 16.0)
    assert PauseRule.parse("tier=flex,kv=0.9,resume=0.5") == PauseRule("flex", "kv", 0.9, 0.5)
    for bad, message in [("waiting=3", "give tier="), ("tier=flex,kv=1.5", "share in"),
                         ("tier=flex,waiting=4,resume=9", "resume <= threshold"), ("tier=flex,load=3", "unknown field")]:
        with pytest.raises(ServelabError, match=message):
            PauseRule.parse(bad)


def test_failure_specs():
    assert Failure.parse("replica=1,at=30,for=5") == Failure(1, 30.0, 5.0)
    assert Failure.parse("replica=0,at=2.5") == Failure(0, 2.5, None)
    for bad, message in [("at=3", "needs replica= and at="), ("replica=0,at=-1", "at >= 0"),
                         ("replica=0,at=1,for=0", "for must be > 0"), ("replica=x,at=1", "integer"),
                         ("replica=0,at=1,when=2", "unknown field")]:
        with pytest.raises(ServelabError, match=message):
            Failure.parse(bad)
    with pytest.raises(ServelabError, match="only 2 replica"):
        check_failures((Failure(2, 1.0),), 2)
    with pytest.raises(ServelabError, match="still down"):
        check_failures((Failure(0, 1.0, 5.0), Failure(0, 3.0)), 2)


def test_journal_keeps_or_discards_progress():
    for enabled in (True, False):
        ledger = Ledger()
        j = Journal(enabled, ledger)
        r = req(0, prompt=10, out=30)
        r.num_generated_tokens, r.num_computed_tokens, r.first_token_s = 12, 21, 1.0
        j.interrupt(r)
        assert r.num_computed_tokens == 0
        if enabled:
            assert (r.num_generated_tokens, r.first_token_s, j.tokens_lost, j.tokens_recomputed) == (12, 1.0, 0, 21)
            assert ledger.resumes == {0: 1}
        else:
            assert (r.num_generated_tokens, r.first_token_s, j.tokens_lost) == (0, None, 12)
            assert ledger.tokens_lost == {0: 12}
