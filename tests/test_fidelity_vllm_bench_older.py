"""``vllm bench serve`` results from before vLLM saved ``start_times`` and ``latencies`` (late 2025),
and results saved without ``--save-detailed``: what can be rebuilt is, with a note; what cannot is a
one-line error naming the file and field."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main
from test_fidelity_load_shape import GIVEN, bench_result


def _older(doc: dict) -> dict:
    """The same result as an older vLLM writes it: no start_times, no latencies."""
    return {k: v for k, v in doc.items() if k not in ("start_times", "latencies")}


def _run(tmp_path, capsys, doc, name):
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / name
    code, text, err = run_main(["run", "import", src, "-o", out, *GIVEN], capsys)
    return code, out, text + err


def test_an_older_capped_result_is_rebuilt_as_the_semaphore_sent_it(tmp_path, capsys):
    doc = bench_result(n=30, users=4)
    for i in range(len(doc["ttfts"])):  # make the itls add up to the latency, as the stream's chunks do
        doc["latencies"][i] = doc["ttfts"][i] + sum(doc["itls"][i])
    code, new, text = _run(tmp_path, capsys, doc, "new")
    assert code == 0, text
    code, old, text = _run(tmp_path, capsys, _older(doc), "old")
    assert code == 0, text
    assert "format: vllm-bench (detected" in text and "one of the 4 slots freed" in text
    a, b = pq.read_table(new / "requests.parquet"), pq.read_table(old / "requests.parquet")
    # the recorded sends were a slot's release + 1 ms of client time: the rebuilt ones are the releases
    gaps = [x - y for x, y in zip(a.column("arrival_s").to_pylist(), b.column("arrival_s").to_pylist())]
    assert all(-1e-9 <= g <= 0.001 * 30 + 1e-9 for g in gaps)
    assert b.column("e2e_s").to_pylist() == pytest.approx(a.column("e2e_s").to_pylist())
    meta = json.loads((old / "run.json").read_text())
    assert meta["load"] == {"shape": "closed", "users": 4, "request_rate": None}
    assert meta["source"]["format_detected"] is True  # detected by the command, recorded as such


def test_an_older_unpaced_result_sends_everything_at_once(tmp_path, capsys):
    doc = _older(bench_result(n=6, users=1))
    doc["max_concurrency"] = None
    code, out, text = _run(tmp_path, capsys, doc, "burst")
    assert code == 0, text
    assert set(pq.read_table(out / "requests.parquet").column("arrival_s").to_pylist()) == {0.0}
    assert "at once" in text


def test_an_older_paced_result_draws_its_arrivals_and_one_without_a_rate_is_refused(tmp_path, capsys):
    doc = _older(bench_result(n=6, users=2))
    doc.update(request_rate=4.0, max_concurrency=None)
    code, out, text = _run(tmp_path, capsys, doc, "paced")
    assert code == 0, text
    assert "arrivals regenerated" in text and json.loads((out / "run.json").read_text())["load"]["arrivals"] == "regenerated"
    doc.pop("request_rate")
    code, out, text = _run(tmp_path, capsys, doc, "unknown")
    assert code == 1 and "column 'start_times'" in text and "request_rate not recorded" in text
    assert not out.exists()


def test_a_result_saved_without_save_detailed_is_detected_and_explained(tmp_path, capsys):
    doc = {k: v for k, v in bench_result(n=4).items() if not isinstance(v, list)}
    doc.update(mean_ttft_ms=21.7, median_ttft_ms=20.1, mean_e2el_ms=191.0, completed=4)
    code, out, text = _run(tmp_path, capsys, doc, "summary")
    assert code == 1 and "format: vllm-bench (detected" in text
    assert "saved without --save-detailed" in text and "--save-result --save-detailed" in text
    assert not out.exists()
