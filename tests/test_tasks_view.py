"""The `tasks` and `task_summary` views (scoring/tasks.py) on hand-made run tables: job completion times,
critical paths through depends_on and their time split, reused tokens, skipped requests, task deadlines.

Every expected number is computed by hand in the comments; the request tables are built directly, so
these tests do not need the engine to honour depends_on.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers_scoring import req, write_run

from servelab.replay.core.schema import REQUESTS_SCHEMA
from servelab.scoring.db import connect
from servelab.scoring.slo import SloTable

AGENT_SCHEMA = pa.schema(list(REQUESTS_SCHEMA) + [
    pa.field("depends_on", pa.list_(pa.int64())), pa.field("think_s", pa.float64()),
    pa.field("task_deadline_s", pa.float64()),
])


def _r(rid, task, arrival, sched, finish, deps=(), think=None, status="finished", prompt=100, cached=0,
       deadline=None, tenant="t0"):
    row = req(rid, status=status, arrival=arrival, first_scheduled=sched,
              first_token=None if sched is None else sched + 0.1, finish=finish, prompt=prompt, output=5,
              tenant=tenant)
    row.update(session_id=task, depends_on=list(deps), think_s=think, task_deadline_s=deadline, cached_tokens=cached)
    if status != "finished":
        row["finish_s"] = None
    return row


def agent_rows():
    return [
        # task 0, a ReAct chain with tool waits of 1 s and 2 s:
        # r0 0 -> 2 (llm 2); r1 arrives 2 + 1 = 3, starts 3.5, ends 5; r2 arrives 5 + 2 = 7, ends 8.
        # JCT 8 = queue 0.5 + llm (2 + 1.5 + 1) + waits (1 + 2)
        _r(0, 0, 0.0, 0.0, 2.0, prompt=100),
        _r(1, 0, 3.0, 3.5, 5.0, deps=[0], think=1.0, prompt=150, cached=96),
        _r(2, 0, 7.0, 7.0, 8.0, deps=[1], think=2.0, prompt=200, cached=144),
        # task 1, a fan-out of 4 then an aggregator; branch 3 finishes last (16) and gates the aggregator
        _r(3, 1, 10.0, 10.0, 11.0),
        _r(4, 1, 11.5, 11.5, 13.0, deps=[3], think=0.5),
        _r(5, 1, 11.5, 11.5, 14.0, deps=[3], think=0.5),
        _r(6, 1, 11.5, 12.0, 16.0, deps=[3], think=0.5),
        _r(7, 1, 11.5, 11.5, 15.0, deps=[3], think=0.5),
        _r(8, 1, 17.0, 17.2, 18.0, deps=[4, 5, 6, 7], think=1.0, deadline=7.0),
        # task 2: the second call is rejected, so the third is never sent (skipped)
        _r(9, 2, 20.0, 20.0, 21.0),
        _r(10, 2, 21.5, None, None, deps=[9], think=0.5, status="rejected"),
        _r(11, 2, None, None, None, deps=[10], think=0.5, status="skipped"),
        # task 3: two independent calls; the later one (arrives 30.5, ends 34) ends the task
        _r(12, 3, 30.0, 30.0, 31.0, tenant="t1"),
        _r(13, 3, 30.5, 30.5, 34.0, tenant="t1"),
        # no session: in no task
        _r(14, None, 1.0, 1.0, 1.5),
    ]


@pytest.fixture
def agent_run(tmp_path):
    return write_run(tmp_path / "agents", agent_rows(), schema=AGENT_SCHEMA)


def _tasks(con):
    rel = con.execute("SELECT * FROM tasks ORDER BY task_id")
    cols = [d[0] for d in rel.description]
    return {r[cols.index("task_id")]: dict(zip(cols, r)) for r in rel.fetchall()}


def test_react_chain_jct_and_critical_path(agent_run):
    t = _tasks(connect(agent_run))[0]
    assert (t["requests"], t["finished"], t["complete"]) == (3, 3, True)
    assert t["jct_s"] == pytest.approx(8.0)
    assert t["critical_path_requests"] == 3
    assert (t["cp_start_s"], t["cp_queue_s"], t["cp_llm_s"], t["cp_wait_s"]) == pytest.approx((0.0, 0.5, 4.5, 3.0))
    assert (t["queue_s"], t["llm_s"]) == pytest.approx((0.5, 4.5))
    assert (t["prompt_tokens"], t["reused_tokens"]) == (450, 240)
    assert t["reuse_rate"] == pytest.approx(240 / 450)


def test_fan_out_critical_path_follows_the_last_branch(agent_run):
    t = _tasks(connect(agent_run))[1]
    assert t["jct_s"] == pytest.approx(8.0)  # 10 -> 18
    # aggregator <- branch 6 (finished 16, the latest) <- root: 3 requests, not 6
    assert t["critical_path_requests"] == 3
    # queue: 0 + 0.5 + 0.2; llm: 1 + 4 + 0.8; waits: (11.5 - 11) + (17 - 16)
    assert (t["cp_queue_s"], t["cp_llm_s"], t["cp_wait_s"]) == pytest.approx((0.7, 5.8, 1.5))
    assert t["cp_start_s"] + t["cp_queue_s"] + t["cp_llm_s"] + t["cp_wait_s"] == pytest.approx(t["jct_s"])
    # all six requests' service: 1 + 1.5 + 2.5 + 4 + 3.5 + 0.8
    assert t["llm_s"] == pytest.approx(13.3)


def test_skipped_and_failed_requests_leave_the_task_incomplete(agent_run):
    t = _tasks(connect(agent_run))[2]
    assert (t["requests"], t["finished"], t["failed"], t["skipped"], t["unfinished"]) == (3, 1, 1, 1, 0)
    assert t["complete"] is False and t["jct_s"] is None
    assert t["first_arrival_s"] == 20.0 and t["last_finish_s"] == 21.0


def test_a_later_root_gives_a_start_offset(agent_run):
    t = _tasks(connect(agent_run))[3]
    assert t["jct_s"] == pytest.approx(4.0)
    assert t["critical_path_requests"] == 1
    assert (t["cp_start_s"], t["cp_queue_s"], t["cp_llm_s"], t["cp_wait_s"]) == pytest.approx((0.5, 0.0, 3.5, 0.0))


def test_requests_without_a_session_are_in_no_task(agent_run):
    con = connect(agent_run)
    assert con.execute("SELECT count(*), sum(requests) FROM tasks").fetchone() == (4, 14)


def test_task_deadline_trace_wins_and_incomplete_tasks_miss(agent_run):
    con = connect(agent_run, SloTable.parse_cli(["task=8.5s"]))
    t = _tasks(con)
    # task 0: 8 <= 8.5 met; task 1: its trace deadline 7 wins over 8.5, 8 > 7 missed;
    # task 2: incomplete, missed; task 3: 4 <= 8.5 met
    assert [t[i]["deadline_s"] for i in range(4)] == [8.5, 7.0, 8.5, 8.5]
    assert [t[i]["met_deadline"] for i in range(4)] == [True, False, False, True]
    s = con.execute("SELECT tasks, complete, with_deadline, met_deadline, deadline_attainment, with_skipped, "
                    "with_failed FROM task_summary WHERE scope = 'overall'").fetchone()
    assert s == (4, 3, 4, 2, 0.5, 1, 1)


def test_tenant_task_deadline_over_global(agent_run):
    con = connect(agent_run, SloTable.parse_cli(["task=8.5", "tenant=t1:task=3"]))
    t = _tasks(con)
    assert t[3]["deadline_s"] == 3.0 and t[3]["met_deadline"] is False  # 4 > 3
    assert t[0]["deadline_s"] == 8.5
    rows = con.execute("SELECT name, tasks, met_deadline FROM task_summary WHERE scope = 'tenant' ORDER BY name").fetchall()
    assert rows == [("t0", 3, 1), ("t1", 1, 0)]


def test_without_a_deadline_met_is_null(agent_run):
    con = connect(agent_run)
    t = _tasks(con)
    assert t[0]["deadline_s"] is None and t[0]["met_deadline"] is None
    assert t[1]["deadline_s"] == 7.0  # the trace's own
    assert con.execute("SELECT with_deadline, deadline_attainment FROM task_summary WHERE scope='overall'").fetchone() \
        == (1, 0.0)


def test_task_summary_jct_and_shares(agent_run):
    con = connect(agent_run)
    s = con.execute("SELECT * FROM task_summary WHERE scope = 'overall'")
    row = dict(zip([d[0] for d in s.description], s.fetchone()))
    # complete tasks' JCTs: 8, 8, 4
    assert row["jct_mean_s"] == pytest.approx(20 / 3)
    assert row["jct_p50_s"] == pytest.approx(8.0) and row["jct_max_s"] == pytest.approx(8.0)
    # critical-path llm: 4.5 + 5.8 + 3.5 = 13.8 of 20; waits 3 + 1.5; queue 0.5 + 0.7; start 0.5
    assert row["cp_llm_share"] == pytest.approx(13.8 / 20)
    assert row["cp_wait_share"] == pytest.approx(4.5 / 20)
    assert row["cp_queue_share"] == pytest.approx(1.2 / 20)
    assert row["cp_start_share"] == pytest.approx(0.5 / 20)
    assert (row["requests"], row["finished"], row["skipped"], row["failed"]) == (14, 12, 1, 1)


def test_closed_loop_sessions_without_depends_on(tmp_path):
    schema = pa.schema(list(REQUESTS_SCHEMA) + [pa.field("think_s", pa.float64())])
    rows = [_r(0, 5, 0.0, 0.0, 1.0), _r(1, 5, 3.0, 3.0, 4.0, think=2.0), _r(2, 6, 0.5, 0.5, 0.7)]
    for r in rows:
        r.pop("depends_on")
        r.pop("task_deadline_s")
    con = connect(write_run(tmp_path / "closed", rows, schema=schema))
    t = _tasks(con)
    assert t[5]["critical_path_requests"] == 2 and t[5]["cp_wait_s"] == pytest.approx(2.0)
    assert t[5]["jct_s"] == pytest.approx(4.0) and t[6]["jct_s"] == pytest.approx(0.2)


def test_runs_without_sessions_have_no_tasks(tmp_path):
    con = connect(write_run(tmp_path / "plain", [req(0, arrival=0.0, first_token=0.1, finish=0.2)]))
    assert con.execute("SELECT count(*) FROM tasks").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM task_summary").fetchone() == (0,)


# ---- report, compare, plots and the CLI


def test_report_shows_tasks_and_deadline_attainment(agent_run):
    from servelab.scoring.report import report_text

    text = report_text(agent_run, ["task=8.5s"], width=200)
    assert "SLO: global: task_s=8.5" in text
    assert "tasks 4: 3 complete, 1 with skipped requests (1 never sent), 1 with failed requests" in text
    assert "job completion time p50 8.00 s" in text
    # critical-path shares of the complete tasks' 20 s: LLM 13.8, waits 4.5, queue 1.2, start 0.5
    assert "LLM 69.0%, tool/think waits 22.5%, queueing 6.0%, later first calls 2.5%" in text
    assert "task deadline met by 2 of 4 tasks (50.0%" in text
    plain = report_text(agent_run, width=200)
    assert "tasks 4:" in plain and "task deadline met by 0 of 1 tasks (0.0%" in plain  # task 1's own deadline


def test_report_without_tasks_has_no_task_lines(tmp_path):
    from servelab.scoring.report import report_text

    run = write_run(tmp_path / "plain", [req(0, arrival=0.0, first_token=0.1, finish=0.2)])
    assert "\ntasks " not in report_text(run, width=200)


def test_compare_lists_task_metrics(agent_run, tmp_path):
    from servelab.scoring.compare import compare_table

    rows = agent_rows()
    rows[2]["finish_s"] = 9.0  # task 0 now ends at 9: JCT 9, mean (9 + 8 + 4) / 3 = 7
    other = write_run(tmp_path / "slower", rows, schema=AGENT_SCHEMA)
    con = connect([agent_run, other], SloTable.parse_cli(["task=8.5"]))
    table = {r["metric"]: r for r in compare_table(con, ["agents", "slower"]).to_pylist()}
    assert table["task_jct_mean_s"]["agents"] == pytest.approx(20 / 3)
    assert table["task_jct_mean_s"]["slower"] == pytest.approx(7.0)
    assert table["task_deadline_attainment_pct"]["agents"] == pytest.approx(50.0)
    assert table["task_deadline_attainment_pct"]["slower"] == pytest.approx(25.0)  # task 0 missed now
    assert table["requests_skipped"]["agents"] == 1.0


def test_plot_task_jct_cdf(agent_run, tmp_path):
    from servelab.scoring.plots import plot_task_jct_cdf, write_plots

    con = connect(agent_run, SloTable.parse_cli(["task=8.5"]))
    assert plot_task_jct_cdf(con, tmp_path / "jct.png").stat().st_size > 1000
    assert (tmp_path / "out" / "task_jct_cdf.png") in write_plots(con, tmp_path / "out")
    plain = connect(write_run(tmp_path / "plain", [req(0, arrival=0.0, first_token=0.1, finish=0.2)]))
    assert plot_task_jct_cdf(plain, tmp_path / "none.png") is None


def test_cli_query_and_report_take_a_task_slo(agent_run):
    from click.testing import CliRunner

    from servelab.cli.main import cli

    res = CliRunner().invoke(cli, ["query", str(agent_run), "--slo", "task=8.5s", "--format", "csv",
                                   "SELECT task_id, met_deadline FROM tasks ORDER BY task_id"])
    assert res.exit_code == 0, res.output
    assert res.output.split() == ['"task_id","met_deadline"', "0,true", "1,false", "2,false", "3,true"]
    res = CliRunner().invoke(cli, ["query", str(agent_run), "--slo", "tsak=1", "SELECT 1"])
    assert res.exit_code != 0 and "did you mean 'task'" in str(res.exception)


def test_links_count_dependencies_and_the_report_says_when_none_are_recorded(agent_run, tmp_path):
    from servelab.scoring.report import report_text

    t = _tasks(connect(agent_run))
    assert [t[i]["links"] for i in range(4)] == [2, 8, 2, 0]  # the aggregator waits for 4 branches
    rows = [_r(0, 0, 0.0, 0.0, 1.0), _r(1, 0, 2.0, 2.0, 3.0)]  # a run written without depends_on/think_s
    for r in rows:
        for name in ("depends_on", "think_s", "task_deadline_s"):
            r.pop(name)
    run = write_run(tmp_path / "unlinked", rows)
    text = report_text(run, width=200)
    assert "critical paths unknown: the run's requests.parquet records no dependencies" in text
    assert "along the critical paths" not in text


def test_a_file_collected_before_task_deadlines_still_opens(agent_run, tmp_path):
    import duckdb

    old = tmp_path / "old.duckdb"
    src = connect(agent_run, SloTable.parse_cli(["ttft=1"]))
    con = duckdb.connect(str(old))
    for name in ("requests", "steps", "runs", "pools"):
        con.register("_t", src.execute(f"SELECT * FROM {name}").to_arrow_table())
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _t")
        con.unregister("_t")
    con.register("_t", src.execute("SELECT * EXCLUDE (task_s) FROM slo_table").to_arrow_table())
    con.execute("CREATE TABLE slo_table AS SELECT * FROM _t")  # the SLO table as collected before task_s
    con.close()
    reopened = connect(str(old))
    assert reopened.execute("SELECT count(*), count(deadline_s) FROM tasks").fetchone() == (4, 1)  # task 1's own



def test_replayed_fan_out_has_its_critical_path(tmp_path, capsys):
    """A replay of a v2 trace writes depends_on/think_s/task_deadline_s into requests.parquet, so the
    tasks view walks the replay's own critical path: root -> the branch that finished last -> the
    aggregator, checked against the requests table by hand."""
    import pyarrow.parquet as pq
    from helpers_cli import run_main

    trace, out = tmp_path / "fan.arrow", tmp_path / "run"
    code, _, err = run_main(["trace", "synth", "--shape", "fanout", "--tasks", "3", "--branches", "4",
                             "--rate", "0.05", "--task-deadline-s", "60", "--seed", "3", "-o", trace], capsys)
    assert code == 0, err
    code, _, err = run_main(["replay", trace, "-o", out, "--runner", "linear:base=0.01,prefill_token=0.0001",
                             "--num-gpu-blocks", "4096"], capsys)
    assert code == 0, err
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    assert {"depends_on", "think_s", "task_deadline_s"} <= set(rows[0])
    by_id = {r["request_id"]: r for r in rows}
    tasks = _tasks(connect(out))
    assert len(tasks) == 3
    for task_id, t in tasks.items():
        members = [r for r in rows if r["session_id"] == task_id]
        assert t["complete"] and t["jct_s"] == pytest.approx(max(r["finish_s"] for r in members)
                                                             - min(r["arrival_s"] for r in members))
        path, r = 1, max(members, key=lambda r: r["finish_s"])  # the aggregator
        while r["depends_on"]:
            r = by_id[max(r["depends_on"], key=lambda d: by_id[d]["finish_s"])]
            path += 1
        assert t["critical_path_requests"] == path >= 2
        assert t["deadline_s"] == 60 and t["met_deadline"] == (t["jct_s"] <= 60)


def test_replayed_closed_loop_sessions_have_their_critical_paths(tmp_path, capsys):
    """A replay of a session trace (turns linked by think_s, no depends_on) writes think_s into
    requests.parquet, so the tasks view links each turn to the one before: a session's critical path
    is all its turns, and its waits are the think times it replayed."""
    import pyarrow.parquet as pq
    from helpers_cli import run_main

    trace, out = tmp_path / "sess.arrow", tmp_path / "run"
    code, _, err = run_main(["trace", "synth", "-n", "12", "--rate", "2", "--turns", "3", "--think-s", "2",
                             "--prompt", "100", "--output-len", "10", "--seed", "1", "-o", trace], capsys)
    assert code == 0, err
    code, _, err = run_main(["replay", trace, "-o", out, "--runner", "linear:base=0.03,decode_seq=0.001",
                             "--num-gpu-blocks", "600", "--max-num-seqs", "4"], capsys)
    assert code == 0, err
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    think = [r["think_s"] for r in rows]
    assert any(t is not None for t in think)
    for task_id, t in _tasks(connect(out)).items():
        turns = sorted((r for r in rows if r["session_id"] == task_id), key=lambda r: r["request_id"])
        assert t["links"] == sum(r["think_s"] is not None for r in turns[1:]) == len(turns) - 1
        assert t["critical_path_requests"] == len(turns)
        assert t["cp_wait_s"] == pytest.approx(sum(r["think_s"] for r in turns[1:]))
