"""`servelab bench` end to end against the FALLBACK scripted server (tests/helpers_live_server.py),
for server faults a real vLLM never produces on demand: bad usage counts, huge SSE lines,
non-streaming answers, signals. What `bench` does against a real server: tests/test_live_vllm.py."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main, write_small_trace
from helpers_live_server import Reply, ServerThread, chunk, usage

DONE = b"data: [DONE]\n\n"


def eight(completion_tokens) -> Reply:
    """8 text chunks, then a usage chunk saying ``completion_tokens``, then [DONE]."""
    return Reply(pieces=[(0, chunk(c)) for c in "abcdefgh"] + [(0, usage(completion_tokens)), (0, DONE)])


def bench(tmp_path, capsys, reply: Reply, *args, n: int = 3, **server):
    trace = write_small_trace(tmp_path, n)
    out = tmp_path / "run"
    with ServerThread({}, default=reply, **server) as srv:
        code, stdout, stderr = run_main(["bench", srv.url, trace, "-o", out, "--no-metrics", "--no-report",
                                         "--extensions", "off", *args], capsys)  # fmt: skip
    return code, stderr, out


@pytest.mark.parametrize("bad", [0, -3, 2**40])
def test_a_bad_usage_count_keeps_the_run_with_the_streamed_count(tmp_path, capsys, bad):
    code, err, out = bench(tmp_path, capsys, eight(bad))
    assert code == 0, err
    req = pq.read_table(out / "requests.parquet").to_pylist()
    assert [r["status"] for r in req] == ["finished"] * 3
    assert [r["output_tokens"] for r in req] == [8, 8, 8]  # the streamed chunks stand in
    assert [r["usage_output_tokens"] for r in req] == [bad] * 3  # what the server said is kept
    assert [r["usage_reported"] for r in req] == [False] * 3  # ... but not used
    assert f"3 requests: the server's usage completion_tokens ({bad})" in err
    assert "10 asked" in err and "ended early" in err  # 8 of the 10 tokens the trace asked for
    json.loads((out / "run.json").read_text())


def test_usage_that_disagrees_with_the_stream_is_kept_and_warned(tmp_path, capsys):
    code, err, out = bench(tmp_path, capsys, eight(10))
    assert code == 0, err
    req = pq.read_table(out / "requests.parquet").to_pylist()
    assert [r["output_tokens"] for r in req] == [10] * 3 and all(r["usage_reported"] for r in req)
    assert "3 requests: the server's usage (10 tokens) differs from the 8 text chunks streamed" in err
    assert "ended early" not in err


def test_a_sweep_keeps_a_level_with_bad_usage(tmp_path, capsys):
    code, err, out = bench(tmp_path, capsys, eight(0), "--shape", "poisson", "--sweep-rates", "50,100")
    assert code == 0, err
    for level in ("rate_50", "rate_100"):
        assert pq.read_table(out / level / "requests.parquet").num_rows == 3


SLOW = Reply(pieces=[(0, chunk("a")), (30.0, chunk("b", "length")), (0, DONE)])  # one token, then a long wait


def _bench_process(tmp_path, server, *args):
    import subprocess
    import sys

    trace = write_small_trace(tmp_path, 5)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "servelab", "bench", server.url, str(trace), "-o", str(out), "--no-report",
           "--extensions", "off", "--model", "m", *args]  # fmt: skip
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), out


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


@pytest.mark.parametrize("signals, code", [(["SIGTERM"], 143), (["SIGINT", "SIGINT"], 130),
                                           (["SIGTERM", "SIGTERM"], 143)])
def test_a_signal_stops_the_run_and_keeps_it_even_when_repeated(tmp_path, signals, code):
    """SIGTERM stops `bench` as Ctrl-C does (the run is written); a second signal while the run winds
    down (here: during the final /metrics scrape, 1.5 s) is acknowledged, not obeyed."""
    import signal
    import time

    with ServerThread({}, default=SLOW, metrics_delay_s=1.5) as server:
        proc, out = _bench_process(tmp_path, server)
        _wait_for(lambda: server.completions >= 2)
        for k, name in enumerate(signals):
            if k:
                time.sleep(0.5)
            proc.send_signal(getattr(signal, name))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    meta = json.loads((out / "run.json").read_text())
    assert meta["stopped_by"] == "interrupt" and meta["signal"] == signals[0]
    req = pq.read_table(out / "requests.parquet").to_pylist()
    assert {r["status"] for r in req} == {"cancelled"} and len(req) >= 2
    assert "Traceback" not in err and f"stopped by {signals[0]}" in err


@pytest.mark.parametrize("option, value", [("--timeout", "nan"), ("--timeout", "inf"), ("--metrics-interval", "nan"),
                                           ("--duration", "inf"), ("--rate", "inf")])
def test_non_finite_numbers_are_refused(tmp_path, capsys, option, value):
    trace = write_small_trace(tmp_path, 3)
    args = ["--shape", "poisson"] + (["--rate", "5"] if option != "--rate" else [])
    code, _, err = run_main(["bench", "http://127.0.0.1:9", trace, "-o", tmp_path / "r", "--model", "m", *args,
                             option, value], capsys)  # fmt: skip
    assert code == 2 and f"Invalid value for {option}: must be a finite number" in err, err
    assert not (tmp_path / "r").exists()


def test_the_server_check_waits_as_long_as_timeout_says(tmp_path, capsys):
    """A server that accepts connections but does not answer fails the command after --timeout, not a fixed 30 s."""
    import time

    trace = write_small_trace(tmp_path, 3)
    with ServerThread({}, default=SLOW, models_delay_s=20.0) as server:
        t0 = time.perf_counter()
        code, _, err = run_main(["bench", server.url, trace, "-o", tmp_path / "r", "--model", "m", "--no-metrics",
                                 "--timeout", "1"], capsys)  # fmt: skip
        wall_s = time.perf_counter() - t0
    assert code == 1 and "cannot reach the server" in err and wall_s < 8.0, (wall_s, err)


def test_a_slow_tokenize_does_not_fail_a_run_with_a_short_timeout(tmp_path, capsys):
    """--timeout limits requests; the run's /tokenize calls (prompt lengths, before the first send) wait at
    least a minute: a busy server that counts tokens in 0.6 s must not fail a --timeout 0.3 run."""
    trace = write_small_trace(tmp_path, 3)
    out = tmp_path / "r"
    with ServerThread({}, default=eight(8), tokenize_delay_s=0.6) as server:
        code, _, err = run_main(["bench", server.url, trace, "-o", out, "--model", "m", "--no-metrics", "--no-report",
                                 "--extensions", "off", "--timeout", "0.3", "--tokenizer", "server"], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["prompts"]["tokenizer"] == "server"


@pytest.mark.parametrize("extensions, probes", [("auto", 1), ("off", 0)])
def test_the_extensions_probe_is_recorded(tmp_path, capsys, extensions, probes):
    """The probe is a generation request the server counts (41 against 40 in its own counters): run.json says so."""
    trace = write_small_trace(tmp_path, 3)
    out = tmp_path / "run"
    with ServerThread({}, default=eight(8)) as srv:
        code, _, err = run_main(["bench", srv.url, trace, "-o", out, "--no-metrics", "--no-report",
                                 "--extensions", extensions], capsys)  # fmt: skip
        completions = srv.completions
    assert code == 0, err
    assert completions == 3 + probes
    assert json.loads((out / "run.json").read_text())["endpoint"]["probe_requests"] == probes


def _characters(body: dict) -> dict:
    """A character-level tokenizer with a BOS (id 1): no English word is one token."""
    text = body.get("prompt") or "".join(m["content"] for m in body.get("messages") or [])
    ids = [ord(c) for c in text]
    if body.get("add_special_tokens", True):
        ids = [1] + ids
    return {"count": len(ids), "tokens": ids}


def test_a_tokenizer_without_single_token_words_gets_token_id_prompts(tmp_path, capsys):
    reply = Reply(pieces=[(0, chunk("a")), (0, chunk("b", "length")), (0, DONE)])  # no usage: our counts stand
    trace = write_small_trace(tmp_path, 3)
    out = tmp_path / "run"
    with ServerThread({}, default=reply, tokenize=_characters) as srv:
        code, _, err = run_main(["bench", srv.url, trace, "-o", out, "--no-metrics", "--no-report",
                                 "--extensions", "off"], capsys)  # fmt: skip
        received = list(srv.received)
    assert code == 0, err
    assert "prompts are token ids instead" in err
    prompts = [b["prompt"] for b in received]
    letters = {ord(c) for c in "abcdefghijklmnopqrstuvwxyz"}
    assert all(isinstance(p, list) and len(p) == 50 and set(p) <= letters | {ord(" ")} for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3  # each request its own text
    assert [r["prompt_tokens"] for r in pq.read_table(out / "requests.parquet").to_pylist()] == [50] * 3
    assert json.loads((out / "run.json").read_text())["prompts"]["token_ids"] is True


def test_token_id_prompts_need_the_completions_api(tmp_path, capsys):
    trace = write_small_trace(tmp_path, 2)
    with ServerThread({}, default=eight(8), tokenize=_characters) as srv:
        code, _, err = run_main(["bench", srv.url, trace, "-o", tmp_path / "r", "--no-metrics", "--api", "chat"],
                                capsys)  # fmt: skip
    assert code == 1 and "token-id prompts need --api completions" in err


def test_bench_slo_scores_the_report_and_a_sweep_keeps_it(tmp_path, capsys):
    trace = write_small_trace(tmp_path, 3)
    with ServerThread({}, default=eight(8)) as srv:
        code, out, err = run_main(["bench", srv.url, trace, "-o", tmp_path / "one", "--no-metrics",
                                   "--slo", "ttft=0.5,tpot=0.05"], capsys)  # fmt: skip
        assert code == 0, err
        assert "SLO: global: ttft_s=0.5, tpot_s=0.05" in out
        code, out, err = run_main(["bench", srv.url, trace, "-o", tmp_path / "sw", "--no-metrics", "--no-report",
                                   "--shape", "poisson", "--sweep-rates", "50,100", "--slo", "e2e=2"], capsys)  # fmt: skip
        assert code == 0, err
        sent = srv.completions
        code, _, err = run_main(["bench", srv.url, trace, "-o", tmp_path / "bad", "--no-metrics", "--slo", "ttft"],
                                capsys)  # fmt: skip
        assert code != 0 and "--slo 'ttft': 'ttft' is not key=value" in err
        assert srv.completions == sent and not (tmp_path / "bad").exists()  # refused before anything was sent
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["slo"] == {"e2e_s": 2.0}
    assert json.loads((tmp_path / "one" / "run.json").read_text())["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05}
    code, out, err = run_main(["report", tmp_path / "one"], capsys)  # a later report scores as the run did
    assert code == 0 and "SLO: global: ttft_s=0.5, tpot_s=0.05" in out and "recorded in run.json" in out, out
    code, out, err = run_main(["report", tmp_path / "sw" / "rate_50"], capsys)
    assert "SLO: global: e2e_s=2" in out


def test_rate_scale_is_the_inverse_time_scale_and_request_rate_names_rate(tmp_path, capsys):
    trace = write_small_trace(tmp_path, 3)
    with ServerThread({}, default=eight(8)) as srv:
        for name, args in (("scaled", ["--rate-scale", "4"]), ("timed", ["--time-scale", "0.25"]),
                           ("poisson", ["--shape", "poisson", "--request-rate", "50"])):  # fmt: skip
            code, _, err = run_main(["bench", srv.url, trace, "-o", tmp_path / name, "--no-metrics", "--no-report",
                                     "--extensions", "off", *args], capsys)  # fmt: skip
            assert code == 0, err
        code, _, err = run_main(["bench", srv.url, trace, "-o", tmp_path / "both", "--no-metrics",
                                 "--rate-scale", "2", "--time-scale", "0.5"], capsys)  # fmt: skip
        assert code == 2 and "--rate-scale" in err and not (tmp_path / "both").exists()

    def load(name):
        return json.loads((tmp_path / name / "run.json").read_text())["load"]

    assert load("scaled")["time_scale"] == load("timed")["time_scale"] == 0.25
    assert load("poisson")["rate"] == 50.0
