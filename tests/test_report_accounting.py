"""The report's accounting: every request in a column, requests after a horizon named, the duration labelled
by what it measures (docs/metrics.md "Attainment", "Throughput and goodput")."""

from __future__ import annotations

from helpers_scoring import req, step, write_run

from servelab.scoring.report import report_text


def test_requests_after_the_horizon_are_named_and_not_counted(tmp_path):
    reqs = [req(1, arrival=0.0, first_token=0.5, finish=1.0, output=3), req(2, "unfinished", arrival=1.5),
            req(3, "unfinished", arrival=3.0), req(4, "unfinished", arrival=4.0)]
    out = report_text(write_run(tmp_path / "h", reqs, [step(0.0, 2.0)], meta={"simulated_span_s": 2.0}), ["ttft=1s"])
    assert "requests 2: 1 finished, 1 unfinished" in out
    assert "2 more requests of the trace arrive after the run's end (2.00 s) and are not counted" in out


def test_duration_of_a_run_that_finished_nothing_says_it_runs_to_the_end(tmp_path):
    reqs = [req(1, "unfinished", arrival=0.1), req(2, "unfinished", arrival=42.0)]
    out = report_text(write_run(tmp_path / "h", reqs, [step(0.1, 0.2)], meta={"simulated_span_s": 0.3}))
    assert "duration (first arrival to the run's end: nothing finished) 0.20 s" in out


def test_an_imported_benchmarks_own_duration_is_labelled_as_its_own(tmp_path):
    reqs = [req(1, arrival=0.0, first_token=0.5, finish=1.0, output=3), req(2, arrival=0.5, first_token=1.0, finish=2.0)]
    meta = {"source": {"format": "vllm-bench", "duration_s": 2.5}}
    out = report_text(write_run(tmp_path / "vb", reqs, [step(0.0, 2.0)], meta=meta))
    assert "duration (the benchmark's own, as vLLM computes throughput) 2.50 s" in out
    assert "first arrival to last finish" not in out


def _count_row(out: str, header_start: str = "group") -> dict[str, str]:
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    overall = next(line for line in lines[i:] if line.startswith("overall"))
    return dict(zip(lines[i].split()[1:], overall.split()[1:]))


def test_the_count_columns_add_up_to_the_requests(tmp_path):
    reqs = [req(1, arrival=0.0, first_token=0.5, finish=1.0, output=3), req(2, "unfinished", arrival=0.5),
            req(3, "rejected", arrival=0.6), *(req(i, "aborted", arrival=0.1 * i) for i in range(4, 10))]
    row = _count_row(report_text(write_run(tmp_path / "a", reqs, [step(0.0, 2.0)]), ["ttft=1s"], width=200))
    assert row["aborted"] == "6"
    assert sum(int(row[k]) for k in ("finished", "unfin.", "refused", "aborted")) == int(row["requests"]) == 9


def test_several_other_statuses_share_one_named_column(tmp_path):
    reqs = [req(1, arrival=0.0, first_token=0.5, finish=1.0, output=3), req(2, "aborted", arrival=0.5),
            req(3, "skipped", arrival=0.6)]
    out = report_text(write_run(tmp_path / "a", reqs, [step(0.0, 2.0)]), width=200)
    assert _count_row(out)["other"] == "2"
    assert "the count column 'other' holds the requests aborted, skipped" in out
