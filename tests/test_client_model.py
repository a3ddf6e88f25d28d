"""The client/API-server model (fidelity/client_model.py): outside time per request, the API server's
per-token queue, its fit, and how validate --real shows it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from helpers_cli import run_main, validate_real_json

from servelab.common.errors import ServelabError
from servelab.fidelity import client_model as cm
from servelab.fidelity.base import Measured, Rows, build_run, write_measured_run
from servelab.fidelity.client_model import ClientModel, api_server_waits, fit_client, with_client_columns


def test_the_api_server_queue_by_hand():
    # four tokens reach one server of 0.1 s per token: three at once, one later
    waits = api_server_waits(np.array([0.0, 0.0, 0.0, 1.0]), 0.1)
    assert waits.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.0])
    # out of order in, in order of arrival served
    assert api_server_waits(np.array([0.5, 0.0]), 1.0).tolist() == pytest.approx([0.5, 0.0])


def requests(first, finish, prompt=(100, 100), out=(3, 3)):
    n = len(first)
    return pa.table({"request_id": pa.array(range(n), pa.int64()), "arrival_s": [0.0] * n,
                     "first_token_s": first, "finish_s": finish, "prompt_tokens": pa.array(prompt, pa.int32()),
                     "output_tokens": pa.array(out, pa.int32()), "generated_tokens": pa.array(out, pa.int32())})


def test_outside_time_adds_to_ttft_and_e2e_but_not_tpot():
    model = ClientModel("vllm", request_s=0.005, prompt_token_s=1e-5)
    r = with_client_columns(requests([0.1, 0.2], [0.3, None], out=(3, 3)), model)
    assert r.column("client_ttft_s").to_pylist() == pytest.approx([0.1 + 0.006, 0.2 + 0.006])
    assert r.column("client_e2e_s").to_pylist()[0] == pytest.approx(0.3 + 0.006)
    assert r.column("client_e2e_s").to_pylist()[1] is None  # not finished: no E2E
    assert r.column("client_tpot_s").to_pylist()[0] == pytest.approx(0.1)


def test_many_streams_queue_for_one_api_server():
    # two requests whose tokens leave the engine at the same instants 0.1, 0.2, 0.3 (evenly spread):
    # the server streams one token per 0.05 s, so the second request's tokens wait 0.05 s each
    model = ClientModel("vllm", request_s=0.0, prompt_token_s=0.0, token_s=0.05)
    r = with_client_columns(requests([0.1, 0.1], [0.3, 0.3]), model)
    assert r.column("client_ttft_s").to_pylist() == pytest.approx([0.1, 0.15])
    assert r.column("client_e2e_s").to_pylist() == pytest.approx([0.3, 0.35])
    # 20 streams of 10 tokens in lockstep, 1 ms apart in the engine: the server's 1/0.005 = 200 tokens/s
    # (not the engine's 20,000) sets the pace; the last token leaves 200 x 5 ms after the first arrived
    n = 20
    r = with_client_columns(requests([0.001] * n, [0.010] * n, prompt=[1] * n, out=[10] * n),
                            ClientModel("vllm", 0.0, 0.0, token_s=0.005))
    assert max(r.column("client_finish_s").to_pylist()) == pytest.approx(0.001 + 200 * 0.005 - 0.005)


def test_the_token_log_gives_the_queue_its_arrivals():
    tokens = pa.table({"request_id": pa.array([0, 0, 1, 1], pa.int64()), "token_index": pa.array([1, 2, 1, 2], pa.int32()),
                       "time_s": [0.1, 0.5, 0.1, 0.2]})
    r = with_client_columns(requests([0.1, 0.1], [0.5, 0.2], out=(2, 2)), ClientModel("v", 0.0, 0.0, 0.1), tokens)
    # tokens in order: (0, 0.1) served [0.1, 0.2], (1, 0.1) [0.2, 0.3], (1, 0.2) waits to 0.3 -> [0.3, 0.4]
    assert r.column("client_first_token_s").to_pylist() == pytest.approx([0.1, 0.2])
    assert r.column("client_finish_s").to_pylist() == pytest.approx([0.5, 0.3])


def test_fit_recovers_the_terms():
    truth = ClientModel("vllm", 0.004, 3e-6, 0.0)
    obs = [{"prompt_tokens": p, "server_ttft_s": 0.01 + p * 1e-5,
            "client_ttft_s": 0.01 + p * 1e-5 + truth.request_s + truth.prompt_token_s * p} for p in (16, 256, 1024)]
    obs[0].update(output_tokens=11, server_decode_s=0.05, client_decode_s=0.05 + 10 * 2e-4)
    model = fit_client(obs)
    assert model.request_s == pytest.approx(0.004) and model.prompt_token_s == pytest.approx(3e-6)
    assert model.token_s == pytest.approx(2e-4)
    with pytest.raises(ServelabError, match="two prompt lengths"):
        fit_client(obs[:1])
    with pytest.raises(ServelabError, match=">= 0"):
        ClientModel("vllm", -1.0, 0.0)


def test_the_shipped_vllm_cpu_default_is_fitted_on_the_shipped_observations():
    data = json.loads(cm.CPU_CALIBRATION.read_text())
    assert len(data["observations"]) == 8 and len(data["held_out"]) == 12 and "vLLM 0.32" in data["about"]
    model = cm.DEFAULTS["vllm-cpu"]
    assert model == fit_client(data["observations"], "vllm-cpu", provenance=model.provenance.split("; fitted on")[0],
                               api_server_runs=data["api_server_cpu"]["runs"])
    # token_s is the API server's CPU per streamed token, measured (~0.1 ms on this CPU): 16 users
    # streaming 256 tokens each cost it 4.9-6.0 s of CPU against 0.7 s for 8 tokens each
    assert 5e-5 < model.token_s < 2e-4
    assert "attempt b1" in model.provenance
    # the closed loops of 4-16 users identify the load term: the outside time grows with the streams open
    loads = sorted({o["open_streams"] for o in data["observations"]})
    assert loads[0] == 0.0 and loads[-1] > 10 and model.stream_s > 0.001
    # the lone 16-token level: 12.66 ms at the client, 6.16 in the engine; the model says ~6.1 outside
    assert model.outside_s(16.0) == pytest.approx(0.0065, abs=5e-4)
    # 16 users (11.25 others open at a send): 24.3 ms outside the engine measured
    assert model.outside_s(64.0, 11.25) == pytest.approx(0.0243, abs=2e-3)
    assert cm.resolve("vllm-cpu") is model


def test_the_shipped_vllm_default_is_a_gpu_servers():
    # fitted on a real H100 server's client (GuideLLM) and server (OpenTelemetry) times of the same requests
    data = json.loads(cm.CALIBRATION.read_text())
    model = cm.DEFAULTS["vllm"]
    fitted = fit_client(data["observations"], "vllm", provenance=model.provenance.split("; fitted on")[0],
                        load="admitting")
    # the client's terms are that fit; the API server's own time is fitted apart (tests/test_client_api_server.py)
    assert dataclasses.replace(model, api_request_s=0.0, api_prompt_token_s=0.0, provenance=fitted.provenance) == fitted
    assert model.provenance.startswith(fitted.provenance) and "API server time fitted on" in model.provenance
    assert "H100" in model.provenance and "GuideLLM" in data["about"]
    # its load term counts the requests not yet at their first token: 8 streams open at a constant rate
    # (a request every 0.26 s, each at its first token after 0.25 s) measured no more outside time than alone
    assert model.load == "admitting"
    steady = next(o for o in data["observations"] if "constant 3.842" in o["source"] and "requests" in o)
    assert steady["open_streams"] > 8 and steady["admitting"] < 1.1
    assert steady["client_ttft_s"] - steady["server_ttft_s"] < 0.0105
    benchmarks = [o for o in data["observations"] if "requests" in o]
    assert len(benchmarks) == 10 and sum(o["requests"] for o in benchmarks) == 397
    # one request at a time, ~3,000-token prompts: 9.4-10.0 ms outside the engine measured
    for o in benchmarks:
        if "synchronous" in o["source"]:
            assert model.outside_s(o["prompt_tokens"], o["admitting"]) == pytest.approx(
                o["client_ttft_s"] - o["server_ttft_s"], abs=1.5e-3)
    # its API server has a host of its own: 40 requests sent at once add ~4-10 ms, not the CPU server's 60
    assert model.stream_s < cm.DEFAULTS["vllm-cpu"].stream_s / 3
    assert model.outside_s(3000.0, 19.5) < 0.020
    # the per-token term comes from the request records (2,274-3,119 tokens): tokenisation, as on CPU
    assert 1e-6 < model.prompt_token_s < 4e-6 and 0.0 < model.request_s < 0.005


def _live_like_run(tmp_path):
    """A client-side run of two requests at 0 and 1 s, prompt 100, 5 tokens, TTFT 10 ms, E2E 30 ms."""
    rows = Rows(tmp_path / "src.json")
    for i in range(2):
        rows.add(i + 1, i, float(i), 100, 5, first_token_s=i + 0.010, finish_s=i + 0.030)
    result, trace = build_run(Measured(rows, clock="client", settings={"num_gpu_blocks": 1000, "model": "llama-3.1-8b", "gpu": "h100-80gb"}), "vllm-bench",
                              [tmp_path / "src.json"])
    (tmp_path / "src.json").write_text("{}")
    out = tmp_path / "run"
    write_measured_run(result, trace, out)
    return out


def test_validate_real_compares_client_side_times_and_keeps_the_engine_side(tmp_path, capsys):
    (tmp_path / "src.json").write_text("{}")
    run = _live_like_run(tmp_path)
    report, rows, engine = validate_real_json(run, capsys)
    default = cm.DEFAULTS["vllm"]  # the API server's own time, then the client's outside vLLM's own times
    outside = default.api_request_s + 100 * default.api_prompt_token_s + default.request_s + 100 * default.prompt_token_s
    assert engine[("ttft", "mean")]["simulated_s"] == pytest.approx(0.002)  # one 2 ms prefill step
    assert rows[("ttft", "mean")]["simulated_s"] == pytest.approx(0.002 + outside)
    assert rows[("e2e", "mean")]["simulated_s"] == pytest.approx(0.010 + outside)  # 5 steps
    assert report["client_model"]["server"] == "vllm" and report["errors"]["measured"] == 0.0
    none, none_rows, _ = validate_real_json(run, capsys, "--client-model", "none")
    assert none["client_model"] is None and "latency_engine" not in none
    assert none_rows[("ttft", "mean")]["simulated_s"] == pytest.approx(0.002)
    # the table shows both columns and the model's terms
    code, out, _ = run_main(["validate", "--real", run, "--candidate", "linear:base=0.002"], capsys)
    assert code == 0 and "engine-side" in out and "client model (vllm)" in out


def test_validate_real_plots_the_client_side_times_its_table_compares(tmp_path, capsys, monkeypatch):
    """--plot on a client-side run draws the simulated times the table compares (engine + client model),
    not the engine's, and its legend says which clock each side is on."""
    from servelab.fidelity import validate as fv

    (tmp_path / "src.json").write_text("{}")
    run = _live_like_run(tmp_path)
    drawn = {}
    monkeypatch.setattr(fv, "plot_cdfs", lambda measured, simulated, path, title="", labels=():
                        drawn.update(simulated=simulated, labels=labels))
    code, out, err = run_main(["validate", "--real", str(run), "--candidate", "linear:base=0.002", "--format", "json",
                               "--plot", str(tmp_path / "cdf.png")], capsys)
    assert code == 0, err
    rows = {(r["metric"], r["stat"]): r for r in json.loads(out)["latency"]}
    ttft = drawn["simulated"].column("ttft_s").to_numpy()
    assert ttft.mean() == pytest.approx(rows[("ttft", "mean")]["simulated_s"])  # the table's simulated TTFT
    assert ttft.mean() > 0.002 + cm.DEFAULTS["vllm"].request_s / 2  # not the 2 ms engine-side one
    assert drawn["labels"] == ("measured (client-side)", "simulated (client-side: engine + vllm client model)")
    code, out, err = run_main(["validate", "--real", str(run), "--candidate", "linear:base=0.002", "--plot",
                               str(tmp_path / "cdf.png"), "--client-model", "none"], capsys)
    assert code == 0, err
    assert drawn["simulated"].column("ttft_s").to_numpy().mean() == pytest.approx(0.002)
    assert drawn["labels"] == ("measured (client-side)", "simulated (engine-side)")


def test_fit_client_cli_writes_a_model_validate_reads(tmp_path, capsys):
    obs = {"observations": [{"prompt_tokens": 10, "client_ttft_s": 0.011, "server_ttft_s": 0.005},
                            {"prompt_tokens": 1010, "client_ttft_s": 0.015, "server_ttft_s": 0.007}]}
    src = tmp_path / "obs.json"
    src.write_text(json.dumps(obs))
    code, out, err = run_main(["fit", "--client", str(src), "-o", str(tmp_path / "c.json")], capsys)
    assert code == 0, err
    model = cm.resolve(str(tmp_path / "c.json"))
    assert model.request_s + 10 * model.prompt_token_s == pytest.approx(0.006)
    assert model.prompt_token_s == pytest.approx(2e-6)
    with pytest.raises(ServelabError, match="neither a server kind"):
        cm.resolve(str(tmp_path / "missing.json"))


def test_observations_from_a_live_run_with_vllm_metrics(tmp_path):
    (tmp_path / "src.json").write_text("{}")
    run = _live_like_run(tmp_path)
    rows = []
    for t, scale in ((-0.1, 0.0), (2.0, 1.0)):  # baseline, then after the two requests
        for name, value in (("queue", 0.001), ("prefill", 0.003), ("decode", 0.018)):
            rows.append({"time_s": t, "metric": f"vllm:request_{name}_time_seconds_sum", "labels": "{}",
                         "value": 10.0 + 2 * value * scale})
            rows.append({"time_s": t, "metric": f"vllm:request_{name}_time_seconds_count", "labels": "{}",
                         "value": 5.0 + 2 * scale})
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), run / "metrics.parquet")
    (obs,) = cm.observations_from(run)
    assert obs["server_ttft_s"] == pytest.approx(0.004) and obs["client_ttft_s"] == pytest.approx(0.010)
    assert obs["client_decode_s"] == pytest.approx(0.020) and obs["server_decode_s"] == pytest.approx(0.018)
    assert obs["prompt_tokens"] == 100 and obs["weight"] == 2


def test_replay_adds_client_columns_only_when_asked(tmp_path, capsys):
    import pyarrow.parquet as pq
    from conftest import make_trace

    from servelab.traces.io import write_trace

    write_trace(make_trace([0.0, 0.5], [100, 200], [4, 4]), tmp_path / "t.arrow", source="test")
    base = ["replay", str(tmp_path / "t.arrow"), "--runner", "linear:base=0.01", "--num-gpu-blocks", "1000",
            "--no-report"]
    assert run_main([*base, "-o", str(tmp_path / "plain")], capsys)[0] == 0
    assert run_main([*base, "-o", str(tmp_path / "client"), "--client-model", "vllm"], capsys)[0] == 0
    plain = pq.read_table(tmp_path / "plain" / "requests.parquet")
    client = pq.read_table(tmp_path / "client" / "requests.parquet")
    assert not set(cm.CLIENT_COLUMNS) & set(plain.column_names)
    assert client.select(plain.column_names).equals(plain)  # the engine-side columns are the same
    model = cm.DEFAULTS["vllm"]
    assert client.column("client_ttft_s").to_pylist() == pytest.approx(
        [t + model.api_server_s(p) + model.request_s + p * model.prompt_token_s
         for t, p in zip(plain.column("ttft_s").to_pylist(), (100, 200))])
    meta = json.loads((tmp_path / "client" / "run.json").read_text())
    assert meta["client_model"]["server"] == "vllm"


def test_validate_compares_error_shares_with_client_timeouts(tmp_path, capsys):
    (tmp_path / "src.json").write_text("{}")
    rows = Rows(tmp_path / "src.json")
    for i in range(4):  # four requests, one the client gave up on
        ok = i != 3
        rows.add(i + 1, i, float(i), 100, 5, first_token_s=i + 0.010, finish_s=i + 0.030 if ok else None,
                 ok=ok, reason=None if ok else "Timeout on reading data from socket")
    result, trace = build_run(Measured(rows, clock="client", settings={"num_gpu_blocks": 1000, "model": "llama-3.1-8b", "gpu": "h100-80gb"}), "vllm-bench",
                              [tmp_path / "src.json"])
    assert result.requests.column("status").to_pylist()[3] == "timeout"
    write_measured_run(result, trace, tmp_path / "run")
    base = ["validate", "--real", str(tmp_path / "run"), "--candidate", "linear:base=0.002", "--format", "json"]
    report = json.loads(run_main(base, capsys)[1])
    assert report["errors"]["measured"] == pytest.approx(0.25) and report["errors"]["simulated"] == 0.0
    report = json.loads(run_main([*base, "--set", "client_timeout_s=0.005"], capsys)[1])
    assert report["errors"]["simulated"] == 1.0  # every request needs 10 ms of engine time: all aborted


# -- the load term (stream_s): outside time per other stream open at a request's send ----------------
def test_open_streams_by_hand():
    # sends at 0, 0.1, 0.2, 0.3; the first ends at 0.25, the second never, the third at once (no
    # chunk: its end is its send), the fourth at 1: at 0.3 only the second is still open
    send = np.array([0.0, 0.1, 0.2, 0.3])
    end = np.array([0.25, np.nan, 0.2, 1.0])
    assert cm.open_streams(send, end).tolist() == [0.0, 1.0, 2.0, 1.0]
    # sent at the same instant: row order decides who was first (each sees those before it)
    assert cm.open_streams(np.zeros(3), np.ones(3)).tolist() == [0.0, 1.0, 2.0]


def test_fit_identifies_the_load_term_from_several_load_levels():
    truth = {"request_s": 0.0057, "prompt_token_s": 2e-6, "stream_s": 0.003}
    obs = []
    for p, load in ((16, 0.0), (1536, 0.0), (64, 3.0), (64, 7.0), (200, 0.4)):
        outside = truth["request_s"] + truth["prompt_token_s"] * p + truth["stream_s"] * load
        obs.append({"prompt_tokens": p, "open_streams": load, "server_ttft_s": 0.004, "client_ttft_s": 0.004 + outside})
    model = fit_client(obs)
    assert model.request_s == pytest.approx(truth["request_s"])
    assert model.prompt_token_s == pytest.approx(truth["prompt_token_s"])
    assert model.stream_s == pytest.approx(truth["stream_s"])
    # one load level only: not identifiable, so 0 and the fit says so
    lone = [dict(o, open_streams=0.0) for o in obs[:2]]
    model = fit_client(lone)
    assert model.stream_s == 0.0 and "one load level" in model.provenance
    with pytest.raises(ServelabError, match="observation 1 has no open_streams"):
        fit_client([obs[0], {k: v for k, v in obs[1].items() if k != "open_streams"}])
    assert "no observation records open_streams" in fit_client(
        [{k: v for k, v in o.items() if k != "open_streams"} for o in obs]).provenance


def test_the_load_term_grows_the_outside_time_with_the_streams_open_at_send():
    # three requests sent 10 ms apart, each streaming until 1 s: the second is sent with one stream
    # open, the third with two; 3 ms per open stream on top of the lone 5 ms
    model = ClientModel("vllm", request_s=0.005, prompt_token_s=0.0, stream_s=0.003)
    table = pa.table({"request_id": pa.array(range(3), pa.int64()), "arrival_s": [0.0, 0.01, 0.02],
                      "first_token_s": [0.1, 0.11, 0.12], "finish_s": [1.0, 1.0, 1.0],
                      "prompt_tokens": pa.array([10] * 3, pa.int32()), "output_tokens": pa.array([5] * 3, pa.int32()),
                      "generated_tokens": pa.array([5] * 3, pa.int32())})
    r = with_client_columns(table, model)
    assert r.column("client_ttft_s").to_pylist() == pytest.approx([0.105, 0.108, 0.111])
    assert r.column("client_e2e_s").to_pylist() == pytest.approx([1.005, 0.998, 0.991])
    # the same requests one after another (each ended, at the client, before the next is sent): no load
    apart = table.set_column(1, "arrival_s", pa.array([0.0, 2.0, 4.0])).set_column(
        2, "first_token_s", pa.array([0.1, 2.1, 4.1])).set_column(3, "finish_s", pa.array([1.0, 3.0, 5.0]))
    r = with_client_columns(apart, model)
    assert r.column("client_ttft_s").to_pylist() == pytest.approx([0.105] * 3)


def test_the_admitting_load_counts_only_requests_before_their_first_token():
    # three requests sent 100 ms apart, first token 50 ms after the send, streaming until 1 s: every one
    # is open at the later sends, none still waiting for its first token
    table = pa.table({"request_id": pa.array(range(3), pa.int64()), "arrival_s": [0.0, 0.1, 0.2],
                      "first_token_s": [0.05, 0.15, 0.25], "finish_s": [1.0, 1.0, 1.0],
                      "prompt_tokens": pa.array([10] * 3, pa.int32()), "output_tokens": pa.array([5] * 3, pa.int32()),
                      "generated_tokens": pa.array([5] * 3, pa.int32())})
    streams = ClientModel("vllm", request_s=0.005, prompt_token_s=0.0, stream_s=0.003)
    admitting = ClientModel("vllm", request_s=0.005, prompt_token_s=0.0, stream_s=0.003, load="admitting")
    assert with_client_columns(table, streams).column("client_ttft_s").to_pylist() == pytest.approx([0.055, 0.058, 0.061])
    assert with_client_columns(table, admitting).column("client_ttft_s").to_pylist() == pytest.approx([0.055] * 3)
    # sent at once: each earlier one is still before its first token (5 ms lone time included)
    burst = table.set_column(1, "arrival_s", pa.array([0.0, 0.0, 0.0]))
    assert with_client_columns(burst, admitting).column("client_ttft_s").to_pylist() == pytest.approx(
        [0.055, 0.158, 0.261])
    with pytest.raises(ServelabError, match="load must be one of"):
        ClientModel("vllm", 0.005, 0.0, load="busy")
    with pytest.raises(ServelabError, match="has no admitting"):
        fit_client([{"prompt_tokens": 10, "client_ttft_s": 0.02, "server_ttft_s": 0.01, "admitting": 1.0},
                    {"prompt_tokens": 20, "client_ttft_s": 0.02, "server_ttft_s": 0.01}], load="admitting")


def test_observations_from_a_live_run_count_the_streams_open_at_send(tmp_path):
    (tmp_path / "src.json").write_text("{}")
    rows = Rows(tmp_path / "src.json")
    for i in range(3):  # sent 10 ms apart, each streaming 100 ms: 0, 1 and 2 others open at its send
        rows.add(i + 1, i, i * 0.01, 100, 5, first_token_s=i * 0.01 + 0.010, finish_s=i * 0.01 + 0.100)
    result, trace = build_run(Measured(rows, clock="client", settings={"num_gpu_blocks": 1000, "model": "llama-3.1-8b",
                                                                        "gpu": "h100-80gb"}), "vllm-bench",
                              [tmp_path / "src.json"])
    run = tmp_path / "run"
    write_measured_run(result, trace, run)
    metrics = []
    for t, scale in ((-0.1, 0.0), (2.0, 1.0)):
        for name in ("queue", "prefill"):
            metrics.append({"time_s": t, "metric": f"vllm:request_{name}_time_seconds_sum", "labels": "{}",
                            "value": 0.003 * scale})
            metrics.append({"time_s": t, "metric": f"vllm:request_{name}_time_seconds_count", "labels": "{}",
                            "value": 3.0 * scale})
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(metrics), run / "metrics.parquet")
    (obs,) = cm.observations_from(run)
    assert obs["open_streams"] == pytest.approx(1.0)  # (0 + 1 + 2) / 3
    # before their first token: each one's first token came at the next one's send, which counts (ties)
    assert obs["admitting"] == pytest.approx(2 / 3)  # (0 + 1 + 1) / 3


def test_a_client_model_file_keeps_its_load_term(tmp_path):
    model = ClientModel("vllm", 0.005, 1e-6, stream_s=0.002, provenance="by hand", load="admitting")
    cm.save(model, tmp_path / "c.json")
    assert cm.resolve(str(tmp_path / "c.json")) == model


def test_the_api_servers_cpu_per_token_is_fitted_apart_from_its_polling_and_requests(tmp_path, capsys):
    runs = [{"wall_s": w, "tokens": n, "requests": q, "api_cpu_s": 0.2 * w + 1e-4 * n + 5e-4 * q}
            for w, n, q in ((3.0, 768, 96), (6.0, 6144, 96), (15.0, 24576, 96), (13.0, 6144, 96), (40.0, 24576, 48))]
    assert cm.api_server_token_s(runs) == pytest.approx(1e-4, rel=1e-6)
    obs = [{"prompt_tokens": 10, "client_ttft_s": 0.011, "server_ttft_s": 0.005},
           {"prompt_tokens": 1010, "client_ttft_s": 0.015, "server_ttft_s": 0.007}]
    model = fit_client(obs, api_server_runs=runs)
    assert model.token_s == pytest.approx(1e-4, rel=1e-6) and "CPU per streamed token" in model.provenance
    src = tmp_path / "obs.json"  # fit --client reads them beside the observations
    src.write_text(json.dumps({"observations": obs, "api_server_cpu": {"runs": runs}}))
    code, out, err = run_main(["fit", "--client", str(src), "-o", str(tmp_path / "c.json")], capsys)
    assert code == 0, err
    assert cm.resolve(str(tmp_path / "c.json")).token_s == pytest.approx(1e-4, rel=1e-6)
    with pytest.raises(ServelabError, match="needs runs that vary the tokens"):
        cm.api_server_token_s([dict(r, tokens=r["wall_s"] * 100) for r in runs[:3]] * 2)
