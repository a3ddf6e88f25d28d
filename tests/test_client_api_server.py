"""The API server's own time (fidelity/client_model.py ``api_request_s``): what vLLM's own TTFT and E2E
hold beyond the engine's, measured from spans of requests that ran alone, and where it is added."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers_cli import run_main, validate_real_json

from servelab.fidelity import client_model as cm
from servelab.fidelity.client_model import ClientModel, fit_api_server, with_api_server_times, with_client_columns
from servelab.fidelity.otel import api_server_observations

REAL_RUNS = Path(__file__).resolve().parents[1] / "bench" / "real_runs"


def _span(start_s: float, ttft: float, e2e: float, queue: float, prefill: float, inference: float, prompt: int,
          rid: str, error: bool = False) -> dict:
    attrs = {"gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.e2e": e2e, "gen_ai.latency.time_in_queue": queue,
             "gen_ai.latency.time_in_model_prefill": prefill, "gen_ai.latency.time_in_model_inference": inference}
    attributes = [{"key": k, "value": {"doubleValue": v}} for k, v in attrs.items()]
    attributes += [{"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": str(prompt)}},
                   {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "4"}},
                   {"key": "gen_ai.request.id", "value": {"stringValue": rid}}]
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": [
        {"name": "llm_request", "startTimeUnixNano": str(int(start_s * 1e9)), "attributes": attributes,
         "status": {"code": 2} if error else {}}]}]}]}


def test_only_requests_that_ran_alone_are_observed(tmp_path):
    spans = [
        _span(0.0, 0.105, 0.5, 0.001, 0.100, 0.497, 1000, "alone"),  # first: 4 ms beyond, last: 2 ms
        _span(1.0, 0.2, 0.5, 0.0, 0.1, 0.4, 2000, "a"),  # a and b overlap: neither is alone
        _span(1.3, 0.2, 0.5, 0.0, 0.1, 0.4, 2000, "b"),
        _span(3.0, 0.2, 0.5, 0.0, 0.1, 0.4, 2000, "failed", error=True),  # failed: not observed
        _span(5.0, 0.052, 0.3, 0.0005, 0.05, 0.298, 500, "late"),
    ]
    path = tmp_path / "traces.json"
    path.write_text("\n".join(json.dumps(s) for s in spans) + "\n")
    obs = api_server_observations(path)
    assert [o["request"] for o in obs] == ["alone", "late"]
    assert obs[0]["first_s"] == pytest.approx(0.004) and obs[0]["last_s"] == pytest.approx(0.002)
    assert obs[1]["prompt_tokens"] == 500 and obs[1]["first_s"] == pytest.approx(0.0015)


def test_a_span_that_ends_after_a_later_one_starts_is_not_alone(tmp_path):
    # a long request (0-10 s) spans a short one (2-3 s) and the one after it (4-5 s): none ran alone
    spans = [_span(0.0, 0.2, 10.0, 0.0, 0.1, 9.9, 100, "long"), _span(2.0, 0.2, 1.0, 0.0, 0.1, 0.9, 100, "short"),
             _span(4.0, 0.2, 1.0, 0.0, 0.1, 0.9, 100, "after")]
    path = tmp_path / "traces.json"
    path.write_text("\n".join(json.dumps(s) for s in spans))
    assert api_server_observations(path) == []


@pytest.mark.skipif(not REAL_RUNS.is_dir(), reason="bench/real_runs not in this checkout")
def test_the_shipped_observations_are_the_bundled_runs_spans():
    data = json.loads(cm.CALIBRATION.read_text())["api_server"]
    derived = []
    for run in ("jan20-codellama-prefill-1", "jan20-codellama-train-1", "jan20-prefill-llama7b-tp1-1"):
        derived += [(f"{run}: request {o['request']}", o["prompt_tokens"], o["first_s"], o["last_s"])
                    for o in api_server_observations(REAL_RUNS / run / "traces.json")]
    shipped = [(o["source"], o["prompt_tokens"], o["first_s"], o["last_s"]) for o in data["observations"]]
    assert len(shipped) == len(derived) == 103
    for s, d in zip(shipped, derived):
        assert s[:2] == d[:2] and s[2:] == pytest.approx(d[2:], abs=1e-9)


def test_the_vllm_default_carries_the_fitted_api_server_time():
    data = json.loads(cm.CALIBRATION.read_text())["api_server"]["observations"]
    model = cm.DEFAULTS["vllm"]
    fixed, per, _ = fit_api_server(data)
    assert (model.api_request_s, model.api_prompt_token_s) == (fixed, per)
    # ~1.9 ms for the runs' ~3,000-token prompts, within the observations' spread
    values = np.array([o[k] for o in data for k in ("first_s", "last_s")])
    at = model.api_server_s(3000.0)
    assert np.percentile(values, 10) < at < np.percentile(values, 90)
    assert 1e-3 < at < 3e-3
    # the CPU server's outside time was fitted against the engine core's own times: it holds the API server's
    assert cm.DEFAULTS["vllm-cpu"].api_server_s(3000.0) == 0.0


def test_fit_api_server_recovers_its_terms_and_refuses_one_prompt_length():
    obs = [{"prompt_tokens": p, "first_s": 0.001 + 2e-7 * p, "last_s": 0.001 + 2e-7 * p} for p in (100, 1000, 4000)]
    fixed, per, note = fit_api_server(obs)
    assert fixed == pytest.approx(0.001) and per == pytest.approx(2e-7) and "3 lone requests" in note
    with pytest.raises(Exception, match="two prompt lengths"):
        fit_api_server(obs[:1])


def _requests():
    return pa.table({"request_id": pa.array([0, 1], pa.int64()), "arrival_s": [0.0, 1.0], "first_token_s": [0.1, None],
                     "finish_s": [0.3, None], "ttft_s": [0.1, None], "e2e_s": [0.3, None], "tpot_s": [0.1, None],
                     "prompt_tokens": pa.array([1000, 500], pa.int32()), "output_tokens": pa.array([3, 3], pa.int32()),
                     "generated_tokens": pa.array([3, 0], pa.int32())})


def test_client_side_times_hold_the_api_servers_time_and_the_clients():
    client = ClientModel("vllm", request_s=0.005, prompt_token_s=1e-5)
    both = ClientModel("vllm", request_s=0.005, prompt_token_s=1e-5, api_request_s=0.001, api_prompt_token_s=1e-6)
    a, b = with_client_columns(_requests(), client), with_client_columns(_requests(), both)
    assert b.column("client_ttft_s")[0].as_py() == pytest.approx(a.column("client_ttft_s")[0].as_py() + 0.002)
    assert b.column("client_e2e_s")[0].as_py() == pytest.approx(a.column("client_e2e_s")[0].as_py() + 0.002)
    assert b.column("client_tpot_s")[0].as_py() == pytest.approx(a.column("client_tpot_s")[0].as_py())


def test_server_side_times_of_the_api_server_are_later_by_its_time_and_keep_their_gaps():
    model = ClientModel("vllm", request_s=0.005, prompt_token_s=1e-5, api_request_s=0.001, api_prompt_token_s=1e-6)
    out = with_api_server_times(_requests(), model)
    assert out.column("ttft_s").to_pylist() == pytest.approx([0.102, None], nan_ok=True)
    assert out.column("ttft_s")[1].as_py() is None  # never had a first token: still none
    assert out.column("e2e_s")[0].as_py() == pytest.approx(0.302)
    assert out.column("first_token_s")[0].as_py() == pytest.approx(0.102)
    assert out.column("finish_s")[0].as_py() == pytest.approx(0.302)
    assert out.column("tpot_s").equals(_requests().column("tpot_s"))
    assert out.schema == _requests().schema


def test_validate_real_adds_it_to_an_otel_runs_simulated_times(tmp_path, capsys):
    spans = [_span(float(i), 0.2, 0.5, 0.0, 0.19, 0.49, 100, f"r{i}") for i in range(4)]
    src = tmp_path / "traces.json"
    src.write_text("\n".join(json.dumps(s) for s in spans))
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", str(src), "--format", "otel", "-o", str(run), "--setting", "model=llama-3.1-8b",
                             "--setting", "gpu=h100-80gb", "--setting", "num_gpu_blocks=1000"], capsys)
    assert code == 0, err
    assert json.loads((run / "run.json").read_text())["source"]["times"] == "api-server"
    report, rows, engine = validate_real_json(run, capsys)
    api = cm.DEFAULTS["vllm"].api_server_s(100.0)
    assert report["api_server"]["mean_s"] == pytest.approx(api)
    assert rows[("ttft", "mean")]["simulated_s"] == pytest.approx(engine[("ttft", "mean")]["simulated_s"] + api)
    assert rows[("e2e", "mean")]["simulated_s"] == pytest.approx(engine[("e2e", "mean")]["simulated_s"] + api)
    assert rows[("tpot", "mean")]["simulated_s"] == pytest.approx(engine[("tpot", "mean")]["simulated_s"])
    none, _, _ = validate_real_json(run, capsys, "--client-model", "none")  # the engine's times alone
    assert "api_server" not in none and "latency_engine" not in none
    code, out, _ = run_main(["validate", "--real", run, "--candidate", "linear:base=0.002"], capsys)
    assert code == 0 and "API server (vllm)" in out and "engine-side" in out


@pytest.mark.skipif(not REAL_RUNS.is_dir(), reason="bench/real_runs not in this checkout")
def test_fit_client_takes_a_servers_spans_for_its_api_server_time(tmp_path, capsys):
    spans = REAL_RUNS / "jan20-codellama-prefill-1" / "traces.json"
    out = tmp_path / "client.json"
    code, text, err = run_main(["fit", "--client", spans, "-o", out], capsys)
    assert code == 0, err
    model = cm.resolve(str(out))
    fixed, per, _ = fit_api_server(api_server_observations(spans))
    assert (model.api_request_s, model.api_prompt_token_s) == pytest.approx((fixed, per))
    default = cm.DEFAULTS["vllm"]  # spans alone: the calibrated client terms, its own API server time
    assert (model.request_s, model.prompt_token_s, model.stream_s, model.load) == (
        default.request_s, default.prompt_token_s, default.stream_s, default.load)
    assert "API server" in text and "40 lone requests" in model.provenance


def test_fit_client_with_spans_and_observations_fits_each_part(tmp_path):
    spans = tmp_path / "traces.json"
    spans.write_text("\n".join(json.dumps(_span(10.0 * i, 0.105, 0.5, 0.001, 0.100, 0.497, 500 + 1000 * i, f"r{i}"))
                               for i in range(3)))
    obs = tmp_path / "obs.json"
    obs.write_text(json.dumps({"observations": [
        {"prompt_tokens": p, "client_ttft_s": 0.1 + 0.004 + 3e-6 * p, "server_ttft_s": 0.1} for p in (100, 1000, 3000)]}))
    model = cm.fit_from_sources([spans, obs], "vllm")
    assert model.request_s == pytest.approx(0.004) and model.prompt_token_s == pytest.approx(3e-6)
    # each span: 4 ms beyond the engine's first token, 2 ms beyond its last, at every prompt length
    assert model.api_request_s == pytest.approx(0.003) and model.api_prompt_token_s == pytest.approx(0.0, abs=1e-12)


def test_fit_client_refuses_spans_beside_a_live_run_and_spans_with_no_lone_request(tmp_path):
    overlapping = tmp_path / "traces.json"
    overlapping.write_text("\n".join(json.dumps(_span(0.1 * i, 0.2, 1.0, 0.0, 0.1, 0.9, 100, f"r{i}")) for i in range(3)))
    with pytest.raises(Exception, match="no request in the spans ran alone"):
        cm.fit_from_sources([overlapping], "vllm")
    live = tmp_path / "live"
    live.mkdir()
    with pytest.raises(Exception, match="hold the API server's time already"):
        cm.fit_from_sources([overlapping, live], "vllm")
    with pytest.raises(Exception, match="has none"):
        cm.fit_from_sources([overlapping], "sglang")


def test_a_span_run_imported_before_its_times_were_recorded_is_told_by_its_format_and_notes():
    from servelab.fidelity.validate import server_times

    assert server_times({"source": {"format": "otel"}, "notes": []}) == "api-server"
    assert server_times({"source": {"format": "otel"},
                         "notes": ["vLLM request journey trace (4 requests' 'llm_core' events): ..."]}) == "engine-core"
    assert server_times({"source": {"format": "otel", "times": "engine-core"}}) == "engine-core"
    assert server_times({"source": {"format": "timestamps-jsonl"}}) is None
