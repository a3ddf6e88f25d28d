"""The report's overload signs (docs/metrics.md "Overload") on hand-made runs: the ones the wait signs miss."""

from __future__ import annotations

from helpers_scoring import req, step, write_run

from servelab.scoring.db import connect
from servelab.scoring.report import report_data


def _overload(run_dir) -> dict:
    con = connect(run_dir)
    try:
        return report_data(con, run_dir.name)["overload"]
    finally:
        con.close()


def _served(i, arrival, sched, service, output=50):
    return req(i, arrival=arrival, first_scheduled=sched, first_token=sched + 0.1, finish=sched + service, output=output)


def test_a_backlog_under_ballooning_service_is_overload(tmp_path):
    # 100 arrivals at 10 req/s, admitted at 2 req/s; each then takes 60 s in a full batch, so the median wait
    # (~20 s) stays under the median service time and the wait signs see nothing
    reqs = [_served(i, 0.1 * i, 0.5 * i, 60.0) for i in range(100)]
    over = _overload(write_run(tmp_path / "backlog", reqs, [step(0.0, 110.0, batch=64)]))
    assert over["overloaded"] is True
    assert any(r.startswith("the queue kept growing while requests arrived") for r in over["reasons"])
    assert (over["queued_last"], over["arrived_last"]) == (80, 100)


def test_a_short_healthy_trace_drained_by_one_long_request_is_not_overload(tmp_path):
    reqs = [_served(i, 0.5 * i, 0.5 * i, 0.2) for i in range(19)] + [_served(19, 9.5, 9.5, 100.0, output=4000)]
    over = _overload(write_run(tmp_path / "drain", reqs, [step(0.0, 109.5)]))
    assert over["offered_rate_rps"] > 1.2 * over["served_rate_rps"]  # the served rate alone would say overload
    assert over["overloaded"] is False, over["reasons"]


def test_a_horizon_run_is_judged_on_the_arrivals_it_replayed(tmp_path):
    # arrivals for 40 s at 10 req/s, admitted at 3 req/s, 12 s each, cut at 20 s: the trace's last quarter is after
    # the horizon, and the median wait stays under the median service time
    reqs = []
    for i in range(400):
        arrival, sched = 0.1 * i, 0.3 * i
        if arrival > 20.0:
            reqs.append(req(i, "unfinished", arrival=arrival))
        elif sched > 20.0:
            reqs.append(req(i, "unfinished", arrival=arrival))
        else:
            reqs.append(_served(i, arrival, sched, 12.0) if sched + 12.0 <= 20.0 else
                        req(i, "unfinished", arrival=arrival, first_scheduled=sched, first_token=sched + 0.1))
    over = _overload(write_run(tmp_path / "cut", reqs, [step(0.0, 20.0, batch=64)], meta={"simulated_span_s": 20.0}))
    assert over["wait_p50_s"] < over["service_p50_s"]
    assert over["overloaded"] is True
    assert over["arrived_last"] == 201


def test_requests_giving_up_at_the_client_timeout_are_called_out(tmp_path):
    reqs = [_served(i, 0.5 * i, 0.5 * i, 0.2) for i in range(5)]
    reqs += [req(i, "aborted", arrival=0.5 * i, first_scheduled=0.5 * i) for i in range(5, 20)]
    over = _overload(write_run(tmp_path / "abort", reqs, [step(0.0, 10.0)]))
    assert "15 of 20 requests (75%) gave up at the client timeout" in over["reasons"]
