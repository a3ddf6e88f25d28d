"""`servelab run import`: each format's slice (tests/fixtures/real_runs, NOTICE.md there) becomes a
run directory whose counts and one hand-computed request's TTFT/TPOT/E2E match the source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main
from servelab.traces.io import read_trace

FIX = Path(__file__).parent / "fixtures" / "real_runs"


class Result:
    def __init__(self, code, out, err):
        self.exit_code, self.output = code, out + err


@pytest.fixture
def run_cli(capsys):
    return lambda argv: Result(*run_main(argv, capsys))


# what the fixtures do not record (run import refuses to guess a model or a GPU)
GIVEN = {"otel": ["--setting", "model=llama-2-7b", "--setting", "gpu=h100-80gb"],
         "guidellm": ["--setting", "model=llama-3.1-8b", "--setting", "gpu=h100-80gb"],
         "timestamps-jsonl": ["--setting", "gpu=rtx-4090"], "vllm-bench": ["--setting", "gpu=h100-80gb"],
         "blis": ["--setting", "gpu=h100-80gb"]}


def _import(run_cli, tmp_path: Path, fmt: str, *sources, extra=None) -> tuple[dict, list[dict], Path]:
    out = tmp_path / fmt
    r = run_cli(["run", "import", "--format", fmt, *map(str, sources), "-o", str(out),
                 *(GIVEN[fmt] if extra is None else extra)])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "run.json").read_text())
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    return meta, rows, out


def _check_request(row: dict, arrival, ttft, e2e, tpot, prompt, output) -> None:
    assert row["status"] == "finished"
    assert row["arrival_s"] == pytest.approx(arrival, abs=1e-9)
    assert row["ttft_s"] == pytest.approx(ttft, abs=1e-9)
    assert row["e2e_s"] == pytest.approx(e2e, abs=1e-9)
    assert row["tpot_s"] == pytest.approx(tpot, abs=1e-9)
    assert (row["prompt_tokens"], row["output_tokens"]) == (prompt, output)


def test_otel_spans(run_cli, tmp_path):
    meta, rows, out = _import(run_cli, tmp_path, "otel", FIX / "otel_llm_request.jsonl")
    assert meta["measured"] is True and meta["clock"] == "server"
    # 4 export lines holding 1, 1, 2 and 2 spans
    assert len(rows) == 6 and meta["counts"] == {"finished": 6, "unfinished": 0}
    # second span: start 1769021453850741760 ns, the first 1769021450278127360 ns
    second = rows[1]
    _check_request(second, 3.5726144, 0.0355076789855957, 3.3592677116394043,
                   (3.3592677116394043 - 0.0355076789855957) / 499, 1493, 500)
    assert second["first_scheduled_s"] - second["arrival_s"] == pytest.approx(8.802860975265503e-06, abs=1e-9)
    trace = read_trace(out / "trace.arrow")
    assert trace.num_rows == 6
    assert trace.column("prompt_tokens").to_pylist() == [1527, 1493, 1566, 2542, 1547, 2099]
    assert trace.column("output_tokens").to_pylist() == [500, 500, 500, 500, 381, 238]


def test_timestamps_jsonl_with_meta(run_cli, tmp_path):
    meta, rows, _ = _import(run_cli, tmp_path, "timestamps-jsonl", FIX / "rtx4090" / "requests.jsonl")
    assert len(rows) == 4
    # bench-1: queued 15823.405014459 (bench-0 queued 15823.144060012), first token 15823.528791577,
    # last token 15849.385311748, 769 tokens
    _check_request(rows[1], 15823.405014459 - 15823.144060012, 15823.528791577 - 15823.405014459,
                   15849.385311748 - 15823.405014459, (15849.385311748 - 15823.528791577) / 768, 1034, 769)
    assert meta["config"] == {"model": "meta-llama/Llama-3.1-8B", "tp": 1, "max_num_seqs": 128,
                              "max_num_batched_tokens": 2048, "replicas": 1, "gpu": "rtx-4090",
                              "async_scheduling": True}  # vLLM 0.19's default
    assert meta["config_sources"]["max_num_seqs"] == "meta.json" and meta["config_sources"]["gpu"] == "--setting"
    assert meta["source"]["vllm_version"] == "0.19.0"


def test_vllm_bench_serve(run_cli, tmp_path):
    meta, rows, out = _import(run_cli, tmp_path, "vllm-bench", FIX / "vllm_bench_serve.json")
    assert meta["clock"] == "client"
    assert len(rows) == 4 and meta["counts"]["finished"] == 3 and meta["counts"]["failed"] == 1
    # request 1: sent at 100.5 (first at 100.0), ttft 0.08, latency 2.08, 21 tokens, longest gap 0.25
    _check_request(rows[1], 0.5, 0.08, 2.08, 2.0 / 20, 200, 21)
    assert rows[1]["max_itl_s"] == pytest.approx(0.25)
    failed = rows[2]
    assert failed["status"] == "failed" and failed["reason"] == "Bad Request" and failed["e2e_s"] is None
    assert read_trace(out / "trace.arrow").num_rows == 3  # the failed request produced nothing to replay
    # no vLLM version recorded: vLLM 0.14+'s defaults on an H100, each said to be assumed (vllm_defaults.py)
    assert meta["config"] == {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "h100-80gb",
                              "max_num_batched_tokens": 8192, "max_num_seqs": 1024, "async_scheduling": True}
    assert all("vLLM 0.14+ assumed (no version recorded)" in meta["config_sources"][k]
               for k in ("max_num_batched_tokens", "max_num_seqs", "async_scheduling"))


def test_guidellm_both_schemas(run_cli, tmp_path):
    # a report of two benchmarks is a sweep: each is a run of its own (tests/test_fidelity_load_shape.py)
    meta, rows, _ = _import(run_cli, tmp_path, "guidellm", FIX / "guidellm_report.json",
                           extra=["--benchmark", "0", *GIVEN["guidellm"]])
    assert len(rows) == 3 and meta["counts"]["finished"] == 2
    _check_request(rows[1], 0.4, 0.2, 0.6, 0.4 / 4, 80, 5)  # v0.2 fields
    assert rows[2]["status"] == "timeout" and rows[2]["reason"] == "timeout"  # kept as the client recorded it
    _, rows1, _ = _import(run_cli, tmp_path / "one", "guidellm", FIX / "guidellm_report.json",
                          extra=["--benchmark", "1", *GIVEN["guidellm"]])
    assert len(rows1) == 1
    _check_request(rows1[0], 0.0, 0.3, 0.5, 0.2 / 2, 200, 3)  # v0.4 info.timings


def test_blis_trace_v2(run_cli, tmp_path):
    meta, rows, out = _import(run_cli, tmp_path, "blis", FIX / "blis")
    assert len(rows) == 3  # the warm-up row is left out
    assert meta["counts"] == {"finished": 2, "unfinished": 0, "failed": 1}
    # request 1: sent 1000200 us, first chunk 1120200, last 2720200, server prompt 515, 17 tokens
    _check_request(rows[0], 0.0, 0.12, 1.72, 1.6 / 16, 515, 17)
    _check_request(rows[1], 0.4999, 0.1, 0.4, 0.3 / 3, 256, 4)
    assert rows[1]["tenant"] == "t2"
    assert rows[2]["reason"] == "error: connection reset"
    assert meta["config"]["max_num_seqs"] == 128 and meta["config"]["block_size"] == 16
    assert read_trace(out / "trace.arrow").num_rows == 2
    _, rows2, _ = _import(run_cli, tmp_path / "files", "blis", FIX / "blis" / "trace.yaml", FIX / "blis" / "trace.csv")
    assert rows2 == rows


def test_blis_header_version_gives_vllms_defaults(run_cli, tmp_path):
    """A TraceV2 header that names the server's vLLM version: its defaults follow (async scheduling
    from 0.14), and an explicit async_scheduling in the server block wins."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "trace.csv").write_text((FIX / "blis" / "trace.csv").read_text())
    header = (FIX / "blis" / "trace.yaml").read_text().replace("  type: vllm\n", "  type: vllm\n  vllm_version: 0.15.1\n")
    (src / "trace.yaml").write_text(header)
    meta, _, _ = _import(run_cli, tmp_path / "a", "blis", src)
    assert meta["source"]["vllm_version"] == "0.15.1" and meta["config"]["async_scheduling"] is True
    (src / "trace.yaml").write_text(header.replace("  type: vllm\n", "  type: vllm\n  async_scheduling: false\n"))
    meta, _, _ = _import(run_cli, tmp_path / "b", "blis", src)
    assert meta["config"]["async_scheduling"] is False


def test_imported_run_works_with_report_query_compare(run_cli, tmp_path):
    _, _, a = _import(run_cli, tmp_path, "otel", FIX / "otel_llm_request.jsonl")
    _, _, b = _import(run_cli, tmp_path, "vllm-bench", FIX / "vllm_bench_serve.json")
    r = run_cli(["report", str(a)])
    assert r.exit_code == 0, r.output
    assert "requests 6: 6 finished" in r.output
    r = run_cli(["query", str(a), str(b), "select run_id, count(*) as n from requests group by all order by 1",
                 "--format", "json"])
    assert r.exit_code == 0, r.output
    assert [row["n"] for row in json.loads(r.output)] == [6, 4]
    assert run_cli(["compare", str(a), str(b)]).exit_code == 0


def test_import_is_deterministic_and_writes_trace_out(run_cli, tmp_path):
    _, _, a = _import(run_cli, tmp_path / "1", "blis", FIX / "blis",
                      extra=["--trace-out", str(tmp_path / "t.parquet"), *GIVEN["blis"]])
    _, _, b = _import(run_cli, tmp_path / "2", "blis", FIX / "blis")
    assert (a / "requests.parquet").read_bytes() == (b / "requests.parquet").read_bytes()
    assert read_trace(tmp_path / "t.parquet").num_rows == 2


def test_settings_from_options_and_vllm_log(run_cli, tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "x INFO vllm.entrypoints.openai.api_server: vLLM API server version 0.11.0\n"
        "x INFO vllm.entrypoints.utils: non-default args: {'model': '/m/meta-llama/Llama-2-7b-hf', "
        "'max_num_batched_tokens': 8192, 'max_num_seqs': 64}\n"
        "x INFO vllm.v1.metrics.loggers: Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 999\n"
        "x INFO vllm.entrypoints.utils: non-default args: {'model': '/m/meta-llama/Llama-2-7b-hf', "
        "'max_num_batched_tokens': 4096, 'max_num_seqs': 256, 'served_model_name': ['meta-llama/Llama-2-7b-hf']}\n"
        "x INFO vllm.v1.core.kv_cache_utils: GPU KV cache size: 119,008 tokens\n"
        "x INFO vllm.v1.metrics.loggers: Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 7438\n")
    meta, _, _ = _import(run_cli, tmp_path, "otel", FIX / "otel_llm_request.jsonl",
                         extra=["--vllm-log", str(log), "--setting", "gpu=h100-80gb", "--setting", "max_num_seqs=128"])
    # the last server start wins; --setting wins over the log
    assert meta["config"] == {"model": "meta-llama/Llama-2-7b-hf", "max_num_batched_tokens": 4096,
                              "max_num_seqs": 128, "num_gpu_blocks": 7438, "gpu": "h100-80gb"}
    assert meta["source"]["kv_cache_tokens"] == 119008 and meta["source"]["vllm_version"] == "0.11.0"


@pytest.mark.parametrize("fmt, text, expected", [
    ("vllm-bench", '{"ttfts": [0.1]}', "no per-request send times ('start_times'"),
    ("vllm-bench", '{"ttfts": [0.1], "start_times": [1.0], "latencies": [], "input_lens": [1], "output_lens": [1]}',
     "column 'latencies': needs a list of 1 values"),
    ("vllm-bench", "{not json", "not valid JSON"),
    ("guidellm", '{"benchmarks": []}', "not a GuideLLM report"),
    ("timestamps-jsonl", '{"input_toks": 5, "output_toks": 2, "queued_ts": 1.0, "first_token_ts": 0.5, "last_token_ts": 2.0}',
     "column 'first token', row 1: times out of order"),
    ("timestamps-jsonl", '{"input_toks": 5, "output_toks": 2, "queued_ts": 1.0, "first_token_ts": "x"}\n',
     "column 'first_token_ts', row 1: not a number"),
    ("timestamps-jsonl", '{"input_toks": 5, "output_toks": 2, "first_token_ts": 1.0}\n',
     "column 'queued_ts', row 1: missing or not a number"),
    ("otel", ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "llm_request", "startTimeUnixNano": "5", '
              '"attributes": [{"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "3"}}]}]}]}]}'),
     "lacks attribute 'gen_ai.latency.time_to_first_token'"),
])
def test_bad_input_is_one_line_naming_file_and_field(run_cli, tmp_path, fmt, text, expected):
    src = tmp_path / "src.json"
    src.write_text(text)
    out = tmp_path / "run"
    r = run_cli(["run", "import", "--format", fmt, str(src), "-o", str(out), *GIVEN[fmt]])
    assert r.exit_code == 1
    assert str(src) in r.output and expected in r.output, r.output
    assert not out.exists()  # nothing half-written


def test_blis_missing_column(run_cli, tmp_path):
    folder = tmp_path / "b"
    shutil.copytree(FIX / "blis", folder)
    csv = folder / "trace.csv"
    lines = csv.read_text().splitlines()
    csv.write_text("\n".join([lines[0].replace("send_time_us", "sent_us")] + lines[1:]) + "\n")
    r = run_cli(["run", "import", "--format", "blis", str(folder), "-o", str(tmp_path / "run"), *GIVEN["blis"]])
    assert r.exit_code == 1 and "column 'send_time_us': required column is missing" in r.output


REAL_VLLM = FIX / "vllm_bench_serve_real_40req.json"


def test_vllm_bench_itl_percentiles_are_vllms_own(run_cli, tmp_path):
    """A real `vllm bench serve --save-detailed` file: the imported run's itl_summary gives vLLM's own
    ITL mean and p50/p90/p99 (np.percentile, linear, over every successful request's chunk gaps)."""
    from servelab.scoring.db import query

    doc = json.loads(REAL_VLLM.read_text())
    meta, rows, out = _import(run_cli, tmp_path, "vllm-bench", REAL_VLLM)
    got = query([out], "SELECT * FROM itl_summary").to_pylist()[0]
    assert got["gaps"] == sum(len(g) for g in doc["itls"])
    for key, ours in (("mean_itl_ms", "mean_itl_s"), ("p50_itl_ms", "p50_itl_s"), ("p90_itl_ms", "p90_itl_s"),
                      ("p99_itl_ms", "p99_itl_s")):
        assert got[ours] * 1000 == pytest.approx(doc[key], rel=1e-12), key
    # every gap is the source's own, in the source's order; max_itl_s is each request's largest
    tokens = pq.read_table(out / "tokens.parquet").to_pylist()
    first = [t["itl_s"] for t in tokens if t["request_id"] == 0][1:]
    assert first == doc["itls"][0] and rows[0]["max_itl_s"] == max(doc["itls"][0])
    assert [r["source_request_id"] for r in rows] == [str(i) for i in range(40)]  # a vLLM-bench row's list index


def test_vllm_bench_throughputs_are_vllms_own(run_cli, tmp_path):
    """vLLM's duration runs from before its first Poisson gap (not from the first send): the imported run
    keeps it, so its throughputs are vLLM's figure for figure; the send-to-finish span is kept beside it."""
    from servelab.scoring.db import query

    doc = json.loads(REAL_VLLM.read_text())
    _, _, out = _import(run_cli, tmp_path, "vllm-bench", REAL_VLLM)
    g = query([out], "SELECT * FROM goodput WHERE scope = 'overall'").to_pylist()[0]
    assert g["request_throughput_rps"] == pytest.approx(doc["request_throughput"], rel=1e-12)
    assert g["output_throughput_tps"] == pytest.approx(doc["output_throughput"], rel=1e-12)
    assert g["total_token_throughput_tps"] == pytest.approx(doc["total_token_throughput"], rel=1e-12)
    span = query([out], "SELECT duration_s, measured_duration_s FROM run_span").to_pylist()[0]
    first_send = min(doc["start_times"])
    last_end = max(s + e for s, e in zip(doc["start_times"], doc["latencies"]))
    assert span["duration_s"] == doc["duration"]
    assert span["measured_duration_s"] == pytest.approx(last_end - first_send, abs=1e-9)
    assert doc["duration"] / span["measured_duration_s"] - 1 == pytest.approx(0.0173, abs=5e-4)  # the 1.7%


def test_guidellm_request_ids_are_kept(run_cli, tmp_path):
    _, rows, _ = _import(run_cli, tmp_path, "guidellm", FIX / "guidellm_report.json",
                         extra=["--benchmark", "0", *GIVEN["guidellm"]])
    _, rows1, _ = _import(run_cli, tmp_path / "one", "guidellm", FIX / "guidellm_report.json",
                          extra=["--benchmark", "1", *GIVEN["guidellm"]])
    assert [r["source_request_id"] for r in rows + rows1] == ["a", "b", "c", "d"]


def test_query_help_lists_the_token_views(capsys):
    code, out, _ = run_main(["query", "--help"], capsys)
    assert code == 0 and "itl_summary" in out and "tokens" in out
