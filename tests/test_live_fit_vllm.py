"""Closing the loop against a real vLLM server (SERVELAB_TEST_ENDPOINT, started by .ci/vllm.sh): a cost
model fitted to the server's calibration sweep (`servelab fit --endpoint`) predicts the live run of a
DIFFERENT trace (`servelab bench`, then `servelab validate --real`) within 15% on mean TTFT and E2E.

CPU timing is noisy, so the trace is run three times and the median of the three simulated means is compared with the
median of the three measured means; the spread is printed (run pytest with -s to see it; bench/RESULTS_live.md).
Skips without a server; fails instead under SERVELAB_TEST_REQUIRE_ENDPOINT=1 (CI).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
from servelab.traces.io import write_trace
from servelab.traces.synth import synth_trace

ENDPOINT = os.environ.get("SERVELAB_TEST_ENDPOINT")
REQUIRED = os.environ.get("SERVELAB_TEST_REQUIRE_ENDPOINT") == "1"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOLERANCE_PCT = 15.0

if not ENDPOINT and REQUIRED:
    pytest.fail("SERVELAB_TEST_REQUIRE_ENDPOINT=1 but SERVELAB_TEST_ENDPOINT is unset: the vLLM server did not start",
                pytrace=False)
pytestmark = pytest.mark.skipif(not ENDPOINT, reason="SERVELAB_TEST_ENDPOINT is unset (source .ci/vllm.sh to start "
                                                     "a vLLM CPU server)")
if ENDPOINT:
    assert urlparse(ENDPOINT).hostname in LOOPBACK, f"live tests use loopback servers only, not {ENDPOINT}"


def cli(*args, timeout=180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "servelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_fitted_model_predicts_a_different_trace_within_15_pct(tmp_path):
    model = tmp_path / "tiny.json"
    cli("fit", "--endpoint", ENDPOINT, "--sweep-out", tmp_path / "sweep", "-o", model)
    fitted = json.loads(model.read_text())
    assert fitted["metadata"]["fit"]["train"]["r2"] > 0.9  # the sweep's shapes follow the linear terms
    # A different trace from the sweep's: Poisson arrivals at 5/s, prompts 32..384, outputs 8..48 tokens.
    trace = tmp_path / "validation.arrow"
    write_trace(synth_trace(n=40, rate=5.0, prompt="uniform:32:384", output="uniform:8:48", seed=2), trace,
                source="test")
    measured, simulated = {"ttft": [], "e2e": []}, {"ttft": [], "e2e": []}
    for k in range(3):
        run = tmp_path / f"live{k}"
        seed = time.time_ns() % 1_000_000_007  # prompts the server has not cached
        cli("bench", ENDPOINT, trace, "-o", run, "--no-report", "--seed", seed)
        report = json.loads(cli("validate", "--real", run, "--candidate", f"fitted:{model}", "--set", "max_num_seqs=16",
                                "--format", "json").stdout)
        assert report["finished"] == {"measured": 40, "simulated": 40}
        rows = {(r["metric"], r["stat"]): r for r in report["latency"]}
        for m, values in measured.items():
            values.append(rows[(m, "mean")]["measured_s"])
            simulated[m].append(rows[(m, "mean")]["simulated_s"])
    # Each replay is of its own run's send times (trace.arrow), so the simulated means differ by a little too.
    lines, errors = [], {}
    for m, values in measured.items():
        real, sim = statistics.median(values), statistics.median(simulated[m])
        errors[m] = (sim / real - 1) * 100
        lines.append(f"mean {m}: measured {', '.join(f'{v * 1000:.2f}' for v in values)} ms (median "
                     f"{real * 1000:.2f}); simulated {', '.join(f'{v * 1000:.2f}' for v in simulated[m])} ms "
                     f"(median {sim * 1000:.2f}); error {errors[m]:+.1f}%")
    print("\n" + "\n".join(lines))
    for m, line in zip(measured, lines):
        assert abs(errors[m]) <= TOLERANCE_PCT, line
