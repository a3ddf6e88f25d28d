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
