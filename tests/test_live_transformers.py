"""The live client against a second real server, `transformers serve` (from the vLLM venv of .ci/vllm.sh,
found through SERVELAB_TEST_TRANSFORMERS_ENDPOINT): its stream has no [DONE], it rejects vLLM's
ignore_eos (HTTP 422) and has no /tokenize or /metrics, so the client must fall back on all three."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest
from servelab.traces.io import write_trace
from servelab.traces.synth import synth_trace

ENDPOINT = os.environ.get("SERVELAB_TEST_TRANSFORMERS_ENDPOINT")
MODEL = os.environ.get("SERVELAB_TEST_VLLM_MODEL")  # transformers serve preloads that same tiny model
if not ENDPOINT and os.environ.get("SERVELAB_TEST_REQUIRE_ENDPOINT") == "1":
    pytest.fail("SERVELAB_TEST_REQUIRE_ENDPOINT=1 but SERVELAB_TEST_TRANSFORMERS_ENDPOINT is unset", pytrace=False)
pytestmark = pytest.mark.skipif(not (ENDPOINT and MODEL), reason="SERVELAB_TEST_TRANSFORMERS_ENDPOINT / "
                                "SERVELAB_TEST_VLLM_MODEL unset (source .ci/vllm.sh to start the servers)")


def test_no_done_no_ignore_eos_no_tokenize(tmp_path):
    assert urlparse(ENDPOINT).hostname in ("127.0.0.1", "localhost", "::1")
    trace = tmp_path / "t.arrow"
    write_trace(synth_trace(n=8, rate=4.0, prompt="uniform:20:60", output="uniform:3:8", seed=2), trace, source="test")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "servelab", "bench", ENDPOINT, str(trace), "-o", str(out),
                           "--model", MODEL, "--shape", "closed", "--users", "2", "--metrics-interval", "0.5",
                           "--no-report"], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "does not take ignore_eos/min_tokens (HTTP 422" in proc.stderr
    assert "prompt lengths approximate" in proc.stderr
    req = pq.read_table(out / "requests.parquet").to_pydict()
    meta = json.loads((out / "run.json").read_text())
    assert set(req["status"]) == {"finished"} and len(req["status"]) == 8
    assert not any(req["saw_done"])  # no [DONE]: still finished
    assert all(req["usage_reported"])  # it reports usage in its last chunk: the counts are its own
    # the approximation counts one BOS this tokenizer does not add: every prompt is one token short,
    # and the recorded prompt length is the server's count, not the trace's
    assert req["prompt_tokens"] == [t - 1 for t in req["trace_prompt_tokens"]]
    assert all(0 < g <= t for g, t in zip(req["generated_tokens"], req["trace_output_tokens"]))
    assert meta["endpoint"]["ignore_eos"] is False and meta["prompts"]["tokenizer"] == "approximate"
    assert meta["metrics"]["scrapes"] == 0 and meta["metrics"]["failures"] >= 2
