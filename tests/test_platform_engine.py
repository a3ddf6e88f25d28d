"""Platform features in the engine: quotas and retries, queue cap, policy drops, pausing, failures and the journal.

Hand-checkable timelines: ``linear:base=1`` (one unit per iteration, prompts cost nothing).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import make_trace
from helpers_engine import column, run

from servelab.common.errors import ServelabError
from servelab.policies.base import policy_names
from servelab.replay import EngineConfig, ReplayConfig

UNIT = "linear:base=1"


# -- quotas -----------------------------------------------------------------------------------------
def test_tpm_quota_throttles_the_tenant_over_it_at_the_configured_rate():
    # a and b each send a 150-token request every second for 120 s; a may use 4500 tokens/min
    n = 120
    arrivals = [float(t) for t in range(n) for _ in (0, 1)]
    tenants = ["a", "b"] * n
    trace = make_trace(arrivals, [100] * (2 * n), [50] * (2 * n), tenant=tenants)
    r = run(trace, runner="linear:base=0.001", quota=("tenant=a:tpm=4500",), max_num_seqs=64)
    status, tenant = column(r, "status"), column(r, "tenant")
    assert all(s == "finished" for s, t in zip(status, tenant) if t == "b")
    a_ok = [arrivals[i] for i in range(2 * n) if tenant[i] == "a" and status[i] == "finished"]
    # the full bucket lets the first minute through; after that 75 tokens/s = one request per 2 s
    late = [t for t in a_ok if t >= 60]
    assert len(late) == 30
    assert column(r, "status").count("throttled") == 120 - len(a_ok)
    assert r.meta["platform"]["throttles"] == 120 - len(a_ok)
    refused = [s for s, t in zip(column(r, "refused_s"), tenant) if s is not None]
    assert all(t == "a" for s, t in zip(column(r, "refused_s"), tenant) if s is not None) and refused


@pytest.mark.parametrize("retry_after, retries, first_scheduled", [
    (True, 3, [0.0, 0.0, 30.0, 60.0]),  # each retry comes exactly when one request has refilled
    (False, 3, [0.0, 0.0, 30.0, 70.0]),  # backoff 10, 20, 40: refused at 10, then in at 30 / 70
])
def test_retries_arrive_when_the_bucket_refills(retry_after, retries, first_scheduled):
    trace = make_trace([0, 0, 0, 0], [1] * 4, [1] * 4, tenant=["a"] * 4)
    r = run(trace, runner=UNIT, quota=("tenant=a:rpm=2",), retries=retries, retry_backoff_s=10.0,
            retry_after=retry_after)
    assert column(r, "first_scheduled_s") == first_scheduled
    assert column(r, "num_retries") == ([0, 0, 1, 2] if retry_after else [0, 0, 2, 3])
    # latency counts from the original arrival
    assert column(r, "arrival_s") == [0.0] * 4
    assert column(r, "ttft_s")[3] == first_scheduled[3] + 1.0


def test_retries_run_out():
    trace = make_trace([0, 0, 0], [1] * 3, [1] * 3, tenant=["a"] * 3)
    r = run(trace, runner=UNIT, quota=("tenant=a:rpm=1",), retries=2, retry_backoff_s=1.0)
    assert column(r, "status") == ["finished", "throttled", "throttled"]
    assert column(r, "num_retries") == [0, 2, 2]
    assert column(r, "refused_s")[1:] == [3.0, 3.0]  # tried at 0, 1, 3
    assert "rpm" in column(r, "reason")[1]


def test_concurrency_cap_with_backoff():
    trace = make_trace([0, 0], [1, 1], [5, 5], tenant=["a", "a"])
    r = run(trace, runner=UNIT, quota=("tenant=a:concurrency=1",), retries=5, retry_backoff_s=2.0)
    # the second request is refused at 0 and 2 (the first runs until 5), backs off 4 s, gets in at 6
    assert column(r, "num_retries") == [0, 2]
    assert column(r, "first_scheduled_s") == [0.0, 6.0]


# -- queue cap ----------------------------------------------------------------------------------------
def test_queue_cap_sheds_the_lowest_tier():
    trace = make_trace([0, 0.1, 0.2, 0.3, 0.4], [1] * 5, [3] * 5,
                       tier=["standard", "flex", "standard", "priority", "flex"])
    r = run(trace, runner=UNIT, policy="tiers", queue_cap=2, max_num_seqs=1)
    assert column(r, "status") == ["finished", "dropped", "finished", "finished", "dropped"]
    assert "shed" in column(r, "reason")[1]
    assert column(r, "refused_s")[1] == 0.3 and column(r, "refused_s")[4] == 0.4
    assert r.meta["counts"]["dropped"] == 2


# -- policy drops (edf) -------------------------------------------------------------------------------------
def test_edf_drops_requests_past_their_deadline():
    trace = make_trace([0, 0.5, 0.5], [1] * 3, [3, 1, 1], ttft_slo_s=[None, 10.0, 2.0])
    keep = run(trace, runner=UNIT, policy="edf", max_num_seqs=1)
    assert column(keep, "finish_s") == [3.0, 5.0, 4.0]
    drop = run(trace, runner=UNIT, policy="edf", policy_params={"drop": True}, max_num_seqs=1)
    assert column(drop, "status") == ["finished", "finished", "dropped"]
    assert column(drop, "refused_s")[2] == 3.0  # the boundary after its 2.5 s deadline
    assert "deadline" in column(drop, "reason")[2]
    assert column(drop, "finish_s")[1] == 4.0


def test_edf_drop_wakes_a_stretch_at_the_deadline():
    fast = run(make_trace([0, 0.5, 0.5], [1] * 3, [30, 1, 1], ttft_slo_s=[None, 40.0, 7.25]),
               runner=UNIT, policy="edf", policy_params={"drop": True}, max_num_seqs=1)
    assert column(fast, "refused_s")[2] == 8.0


# -- pausing ---------------------------------------------------------------------------------------------------
def test_pause_holds_flex_while_others_wait():
    trace = make_trace([0, 0.5, 0.5, 0.5], [1] * 4, [10, 2, 2, 2], tier=["flex", "standard", "standard", "standard"])
    r = run(trace, runner=UNIT, pause="tier=flex,waiting=1,resume=0", max_num_seqs=2)
    # at t=1 three standard requests wait: flex is preempted and held until none waits (t=4)
    assert column(r, "paused_s") == [3.0, 0.0, 0.0, 0.0]
    assert column(r, "finish_s") == [13.0, 3.0, 3.0, 5.0]
    assert r.meta["platform"]["pauses"] == 1
    plain = run(trace, runner=UNIT, max_num_seqs=2)
    assert max(column(plain, "ttft_s")[1:]) > max(column(r, "ttft_s")[1:])


# -- faults and the journal -------------------------------------------------------------------------------------
def failing(journal: bool):
    trace = make_trace([0, 0], [1, 1], [20, 20])
    return run(trace, runner=UNIT, replicas=2, fail=("replica=0,at=5.5",), journal=journal)


def test_failure_with_journal_resumes_from_the_last_token():
    r = failing(True)
    assert column(r, "status") == ["finished", "finished"]
    assert column(r, "replica") == [1, 1]
    # tokens at 1..5 on replica 0; the iteration under way at 5.5 is lost; joins replica 1 at 6,
    # recomputes prompt + 5 tokens and emits token 6 at 7
    assert column(r, "first_token_s")[0] == 1.0 and column(r, "finish_s")[0] == 21.0
    assert column(r, "num_resumes") == [1, 0] and column(r, "tokens_lost") == [0, 0]
    assert column(r, "recomputed_tokens") == [5, 0]  # KV of prompt + 4 tokens (the 5th had none yet)
    faults = r.meta["platform"]["faults"]
    assert faults["failures"] == 1 and faults["requests_moved"] == 1 and faults["tokens_lost"] == 0
    assert faults["work_lost_s"] == pytest.approx(0.5)
    # no output token was computed twice: decode tokens + first tokens + resume tokens = 40
    steps = r.steps.to_pydict()
    emitted = sum(d * k for d, k in zip(steps["decode_requests"], steps["num_iterations"]))
    assert emitted + 2 + 1 == 40


def test_failure_without_journal_starts_over():
    r = failing(False)
    assert column(r, "tokens_lost") == [5, 0]
    assert column(r, "first_token_s")[0] == 7.0  # the new attempt's first token
    assert column(r, "finish_s")[0] == 26.0  # 5 tokens of work lost
    assert r.meta["platform"]["faults"]["tokens_lost"] == 5
    steps = r.steps.to_pydict()
    emitted = sum(d * k for d, k in zip(steps["decode_requests"], steps["num_iterations"]))
    assert emitted + 3 == 40 + 5  # the lost tokens were generated twice


def test_replica_back_after_downtime_and_orphans():
    trace = make_trace([0, 2, 3], [1, 1, 1], [4, 2, 2])
    r = run(trace, runner=UNIT, fail=("replica=0,at=1.5,for=3",))
    # one replica: while it is down nothing runs; all resume at 4.5
    assert column(r, "status") == ["finished"] * 3
    assert column(r, "first_scheduled_s")[1] == 4.5
    down = run(trace, runner=UNIT, fail=("replica=0,at=1.5",))
    assert column(down, "status") == ["unfinished"] * 3
    assert column(down, "generated_tokens")[0] == 1


def test_journal_off_restarts_preempted_requests():
    trace = make_trace([0, 0.5], [16, 16], [40, 40])
    on = run(trace, runner=UNIT, num_gpu_blocks=6, block_size=16)
    off = run(trace, runner=UNIT, num_gpu_blocks=6, block_size=16, journal=False)
    assert column(on, "tokens_lost")[1] == 0 and column(on, "num_resumes")[1] == 1
    assert column(off, "tokens_lost")[1] > 0
    assert column(off, "finish_s")[1] > column(on, "finish_s")[1]


@pytest.mark.parametrize("bad, message", [
    (dict(fail=("replica=3,at=1",)), "only 1 replica"),
    (dict(fail=("replica=0",)), "needs replica= and at="),
    (dict(quota=("tenant=a:rpm=-1",)), "'rpm' must be > 0"),
    (dict(pause="tier=flex"), "exactly one of waiting= or kv="),
    (dict(queue_cap=0), "queue_cap must be >= 1"),
    (dict(retry_jitter=2.0), "retry_jitter"),
])
def test_bad_platform_config(bad, message):
    # (a failure's replica id is checked by the replay's config: in a cluster ids count across its pools)
    with pytest.raises(ServelabError, match=message):
        ReplayConfig(engine=EngineConfig(**bad))


def test_toml_round_trip_and_cli(tmp_path):
    cfg = ReplayConfig.from_dict({"quota": ["tenant=a:rpm=3"], "fail": "replica=0,at=3", "journal": "off"})
    assert cfg.engine.quota == ("tenant=a:rpm=3",) and cfg.engine.fail == ("replica=0,at=3",)
    assert cfg.engine.journal is False
    assert ReplayConfig.from_dict(cfg.to_dict()) == cfg

    from servelab.cli.main import cli
    from servelab.traces.io import write_trace

    trace_path = tmp_path / "t.parquet"
    write_trace(make_trace([0, 0, 1], [4, 4, 4], [6, 6, 6], tenant=["a", "a", "b"]), trace_path, source="test")
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, [
        "replay", str(trace_path), "-o", str(out), "--no-report", "--runner", UNIT, "--num-gpu-blocks", "100",
        "--replicas", "2", "--fail", "replica=1,at=2", "--quota", "tenant=a:rpm=1", "--retries", "1",
        "--retry-backoff-s", "90", "--no-journal"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "run.json").read_text())
    assert meta["platform"]["faults"]["failures"] == 1 and meta["engine"]["journal"] is False
    assert meta["counts"]["finished"] == 3 and meta["platform"]["retries"] == 1

    bad = tmp_path / "bad"
    result = CliRunner().invoke(cli, ["replay", str(trace_path), "-o", str(bad), "--runner", UNIT,
                                      "--num-gpu-blocks", "100", "--fail", "replica=2,at=1"])
    assert isinstance(result.exception, ServelabError) and "only 1 replica" in str(result.exception)
    assert not bad.exists()


def test_scoring_counts_refused_requests_as_misses(tmp_path):
    from servelab.replay import write_run
    from servelab.scoring import SloTable, connect

    trace = make_trace([0, 0, 0, 0.1, 0.2], [1] * 5, [2] * 5, tenant=["a", "a", "a", "b", "b"],
                       tier=["standard", "standard", "standard", "flex", "priority"])
    r = run(trace, runner=UNIT, policy="tiers", quota=("tenant=a:rpm=2",), queue_cap=1, max_num_seqs=1)
    assert column(r, "status") == ["finished", "dropped", "throttled", "dropped", "finished"]
    write_run(r, tmp_path / "run")
    con = connect([tmp_path / "run"], slo=SloTable.parse_cli(["ttft=100s"]))
    rows = con.sql("SELECT scope, name, requests, throttled, dropped, attainment FROM slo_attainment "
                   "ORDER BY scope, name").fetchall()
    assert ("overall", None, 5, 1, 2, 0.4) in rows
    assert ("tenant", "a", 3, 1, 1, pytest.approx(1 / 3)) in rows
    fair = con.execute("SELECT tenants, worst_tenant, worst_tenant_attainment FROM fairness").fetchone()
    assert fair[0] == 2 and fair[1] == "a"
    extra = con.execute("SELECT sum(num_retries), sum(num_resumes), count(refused_s) FROM requests").fetchone()
    assert extra == (0, 0, 3)


# -- every policy under every platform feature at once -----------------------------------------------------
PLATFORM = dict(replicas=2, fail=("replica=0,at=1.5,for=1", "replica=1,at=4"), quota=("tenant=a:rpm=20",),
                retries=2, retry_backoff_s=0.2, queue_cap=40, pause="tier=flex,waiting=6,resume=2")


@pytest.mark.parametrize("journal", [True, False])
@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_survives_the_platform(policy, journal):
    from test_policy_contract import ENGINE, RUNNER, check_invariants, workload

    runs = [run(workload(), policy=policy, runner=RUNNER, preemption="swap", kv_bytes_per_token=1024,
                journal=journal, **PLATFORM, **ENGINE) for _ in range(2)]
    r = runs[0]
    status = column(r, "status")
    assert set(status) <= {"finished", "throttled", "dropped"}, set(status)
    assert status.count("finished") > 50
    check_invariants(r, policy)
    assert "throttled" in status and sum(column(r, "num_retries")) > 0 and r.meta["platform"]["pauses"] > 0
    assert r.requests.equals(runs[1].requests) and r.steps.equals(runs[1].steps)  # deterministic
    faults = r.meta["platform"]["faults"]
    assert faults["failures"] == 2 and faults["requests_moved"] > 0
    gen, out = column(r, "generated_tokens"), column(r, "output_tokens")
    assert all(g == o for g, o, s in zip(gen, out, status) if s == "finished")
    if journal:
        assert sum(column(r, "tokens_lost")) == 0



def _with_and_without_aggregate(trace, policy, monkeypatch, **settings):
    """The replay kept with the decode aggregate (checked: it was made) and the same replay with the
    platform asking for it off from the start, as when every hook that reads running requests did."""
    import servelab.replay.core.engine as engine_module
    from servelab.replay.platform.hooks import Platform

    calls = []
    aggregate = engine_module.aggregate_decodes
    monkeypatch.setattr(engine_module, "aggregate_decodes", lambda *a: (calls.append(1), aggregate(*a)))
    kept = run(trace, policy, **settings)
    assert calls
    monkeypatch.setattr(Platform, "walks_running", property(lambda self: True))
    calls.clear()
    off = run(trace, policy, **settings)
    assert not calls
    return kept, off


@pytest.mark.parametrize("policy", ["sarathi", "vllm-v0", "static", "las", "srpt"])
def test_a_pause_on_waiting_keeps_decodes_in_aggregate_and_changes_nothing(policy, monkeypatch):
    # a pause on the other tiers' waiting requests reads no running counters until it fires (then it
    # lets go of the aggregate itself): the same tables as with the aggregate off from the start
    import pyarrow as pa

    from helpers_engine import synthetic

    trace = synthetic(n=600, rate=40.0)
    tiers = pa.array(["flex" if i % 4 == 0 else "standard" for i in range(trace.num_rows)])
    trace = trace.drop_columns([c for c in ("tier",) if c in trace.column_names]).append_column("tier", tiers)
    kept, off = _with_and_without_aggregate(trace, policy, monkeypatch, pause="tier=flex,waiting=2,resume=1",
                                            max_num_seqs=8, num_gpu_blocks=3000)
    assert kept.meta["platform"]["pauses"] > 0
    assert kept.requests.equals(off.requests) and kept.steps.equals(off.steps)


@pytest.mark.parametrize("policy", ["sarathi", "vllm-v0", "las", "srpt"])
@pytest.mark.parametrize("journal", [False, True])
def test_a_failure_lets_go_of_the_aggregate_when_it_comes_and_changes_nothing(policy, journal, monkeypatch):
    # failures read the failed replica's running requests only when one comes: the aggregate is kept
    # until then, and the tables are those of a replay without it (its blocks for the cut iteration
    # once stayed counted on the failed replica: kv_blocks_used one higher after it came back)
    from helpers_engine import synthetic

    kept, off = _with_and_without_aggregate(synthetic(n=800, rate=30.0), policy, monkeypatch, replicas=2,
                                            max_num_seqs=16, journal=journal,
                                            fail=("replica=0,at=8,for=5", "replica=1,at=20,for=3"))
    assert kept.meta["platform"]["faults"]["requests_moved"] > 0
    assert kept.requests.equals(off.requests) and kept.steps.equals(off.steps)


@pytest.mark.parametrize("policy", ["sarathi", "vllm-v0", "static", "las", "srpt"])
@pytest.mark.parametrize("rule,blocks", [("kv=0.3,resume=0.2", 400), ("kv=0.9", 3000)])
def test_a_pause_on_the_kv_share_keeps_decodes_in_aggregate_and_changes_nothing(policy, rule, blocks, monkeypatch):
    # a pause on the KV share reads kv.used before each decision, which the aggregate keeps current:
    # every reading, and the tables, are those of a replay with the aggregate off from the start; the
    # rule fires (and lets go of the aggregate) in the first, never in the second
    import pyarrow as pa

    from helpers_engine import synthetic
    from servelab.replay.platform.hooks import Platform

    readings: dict = {}  # each replay's Platform (kept alive here, so no two share a key) -> its readings
    check = Platform.check_pause

    def recorded(self, replica, now):
        readings.setdefault(self, []).append((replica.id, now, replica.kv.used))
        return check(self, replica, now)

    monkeypatch.setattr(Platform, "check_pause", recorded)
    trace = synthetic(n=600, rate=40.0)
    tiers = pa.array(["flex" if i % 4 == 0 else "standard" for i in range(trace.num_rows)])
    trace = trace.drop_columns([c for c in ("tier",) if c in trace.column_names]).append_column("tier", tiers)
    kept, off = _with_and_without_aggregate(trace, policy, monkeypatch, pause=f"tier=flex,{rule}",
                                            max_num_seqs=8, num_gpu_blocks=blocks)
    assert (kept.meta["platform"]["pauses"] > 0) == (rule != "kv=0.9")
    first, second = readings.values()
    assert len(first) > 100 and first == second
    assert kept.requests.equals(off.requests) and kept.steps.equals(off.steps)
