"""The calibration sweep's arithmetic and a live run's replay, offline: run directories written by the
real writer (write_live_run) from hand-made records, so every expected value is traced by hand here.
Against the real vLLM server: tests/test_live_fit_vllm.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from helpers_cli import run_main
from servelab.common.errors import InputError, ServelabError
from servelab.live.bench import LiveRun, write_live_run
from servelab.live.calibrate import SweepPlan, fit_live, profile_rows
from servelab.live.client import Record
from servelab.live.prometheus import METRICS_SCHEMA, server_settings
from servelab.live.results import requests_table, sent_trace

CACHE_INFO = ('{"block_size": "128", "enable_prefix_caching": "True", "engine": "0", "num_cpu_blocks": "None", '
              '"num_gpu_blocks": "4096"}')


def _metrics(labels: str = CACHE_INFO) -> pa.Table:
    rows = [{"time_s": -0.01, "metric": "vllm:cache_config_info", "labels": labels, "value": 1.0},
            {"time_s": -0.01, "metric": "vllm:num_requests_running", "labels": "{}", "value": 0.0}]
    return pa.Table.from_pylist(rows, schema=METRICS_SCHEMA)


def test_server_settings_from_vllm_cache_config_info():
    assert server_settings(_metrics()) == {"block_size": 128, "num_gpu_blocks": 4096, "enable_prefix_caching": True}
    assert server_settings(_metrics('{"block_size": "None"}')) == {}
    assert server_settings(None) == {} and server_settings(_metrics().slice(1)) == {}


def _record(index, rid, send, tokens, status="finished"):
    return Record(index, rid, scheduled_s=send, send_s=send, first_token_s=tokens[0] if tokens else None,
                  finish_s=tokens[-1] if status == "finished" else None, end_s=tokens[-1] if tokens else send,
                  token_times=list(tokens), usage_prompt_tokens=None, status=status)


def test_sent_trace_has_send_times_and_real_lengths():
    trace = pa.table({"request_id": [5, 6], "arrival_s": [0.0, 1.0], "prompt_tokens": [10, 20],
                      "output_tokens": [4, 3], "max_output_tokens": [4, 3]})
    records = [_record(0, 5, 0.002, [0.01, 0.02]), _record(1, 6, 0.9, [1.0], status="failed")]
    requests = requests_table(records, trace, [0, 1], [11, 20])
    sent = sent_trace(requests, trace, [0, 1]).to_pydict()
    # finished: generated 2 of 4 (its real output); failed: the trace's 3; prompts as counted (11, 20)
    assert sent == {"request_id": [5, 6], "arrival_s": [0.002, 0.9], "prompt_tokens": [11, 20],
                    "output_tokens": [2, 3], "max_output_tokens": [4, 3]}


# A hand-made sweep: one prefill level (1 user, P=100) and one decode level (2 users, P=40, O=5).
PREFILL = [  # (send, token times): TTFT 0.010 and 0.014
    (0.0, [0.010, 0.011]), (0.1, [0.114, 0.115])]
DECODE = [  # request 2's gaps are all 0.002; request 3 gets its first token at 0.0045, which lies in
    # request 2's gap ending at 0.006 and in the window of the gap ending at 0.008 (from two tokens
    # back, 0.004): both left out; its gaps ending at 0.004 and 0.010 remain, mean 0.002. Request 3's
    # gaps are all 0.003 and nobody else's first token falls in them: mean 0.003.
    (0.0, [0.002, 0.004, 0.006, 0.008, 0.010]), (0.0, [0.0045, 0.0075, 0.0105, 0.0135, 0.0165])]


def _write_sweep(root, levels):
    from servelab.common.atomic import atomic_path

    runs, rid = [], 0
    for name, users, prompt, output, reqs in levels:
        records = [_record(i, rid + i, send, tokens) for i, (send, tokens) in enumerate(reqs)]
        trace = pa.table({"request_id": [rid + i for i in range(len(reqs))], "arrival_s": [0.0] * len(reqs),
                          "prompt_tokens": [prompt] * len(reqs), "output_tokens": [len(t) for _, t in reqs]})
        run = LiveRun(records, list(range(len(reqs))), [prompt] * len(reqs), {"kind": "live", "counts": {}}, None)
        write_live_run(run, trace, {"name": name}, root / name, token_log=True)
        runs.append({"run": name, "users": users, "prompt_tokens": prompt, "output_tokens": output})
        rid += len(reqs)
    with atomic_path(root / "sweep.json") as tmp:
        tmp.write_text(json.dumps({"kind": "live-calibration-sweep", "runs": runs}))
    return root


def test_profile_rows_from_a_hand_made_sweep(tmp_path):
    sweep = _write_sweep(tmp_path / "sw", [("prefill_100", 1, 100, 2, PREFILL), ("users_2_prompt_40", 2, 40, 5, DECODE)])
    rows = profile_rows([sweep]).to_pylist()
    prefill = {"prefill_tokens": 100, "prefill_seqs": 1, "prefill_context_tokens": 0, "prefill_attention_pairs": 5050,
               "decode_seqs": 0, "decode_context_tokens": 0}
    # 2 sequences at mean context 40 + 5 // 2 = 42 each
    decode = {"prefill_tokens": 0, "prefill_seqs": 0, "prefill_context_tokens": 0, "prefill_attention_pairs": 0,
              "decode_seqs": 2, "decode_context_tokens": 84}
    assert [{k: v for k, v in r.items() if k != "step_s"} for r in rows] == [prefill, prefill, decode, decode]
    assert [r["step_s"] for r in rows] == pytest.approx([0.010, 0.014, 0.002, 0.003])


def _linear_sweep(root, plan: SweepPlan, c0: float, per_token: float, per_seq: float, per_decode_seq: float):
    """A sweep whose every step follows a known linear model, requests one after another (no interference)."""
    levels = []
    for name, users, prompt, output, rounds, _ in plan.levels():
        ttft = c0 + per_token * prompt + per_seq
        gap = c0 + per_decode_seq * users
        reqs = []
        for k in range(users * rounds):
            send = k * 10.0
            reqs.append((send, [send + ttft + j * gap for j in range(output)]))
        levels.append((name, users, prompt, output, reqs))
    return _write_sweep(root, levels)


def test_fit_live_recovers_a_linear_server(tmp_path):
    plan = SweepPlan(prefill_prompt_tokens=(16, 64, 256, 1024), users=(1, 2, 4, 8), decode_prompt_tokens=(32, 128),
                     output_tokens=4, rounds=1, prefill_rounds=1)
    # decode rows of the 1-user level include its TTFT too; decode_context varies with P but costs 0
    sweep = _linear_sweep(tmp_path / "sw", plan, c0=0.001, per_token=2e-5, per_seq=0.004, per_decode_seq=3e-4)
    out = tmp_path / "m.json"
    model = fit_live([sweep], out, test_fraction=0.0)
    coef = json.loads(out.read_text())["coefficients_s"][0]
    assert coef["intercept"] == pytest.approx(0.001, rel=1e-4)
    assert coef["prefill_tokens"] == pytest.approx(2e-5, rel=1e-4)
    assert coef["prefill_seqs"] == pytest.approx(0.004, rel=1e-4)
    assert coef["decode_seqs"] == pytest.approx(3e-4, rel=1e-4)
    assert coef["decode_context_tokens"] == pytest.approx(0.0, abs=1e-9)
    assert model.metadata["fit"]["train"]["mape_pct"] < 1e-3


def test_fit_live_errors(tmp_path, capsys):
    with pytest.raises(InputError, match="no sweep.json"):
        profile_rows([tmp_path])
    (tmp_path / "sweep.json").write_text('{"kind": "live-sweep", "runs": []}')
    with pytest.raises(InputError, match="not a calibration sweep"):
        profile_rows([tmp_path])
    (tmp_path / "sweep.json").write_text('{"kind": "live-calibration-sweep", "runs": [{"run": "x", "users": 1, '
                                         '"prompt_tokens": 8, "output_tokens": 4}]}')
    with pytest.raises(InputError, match=r"sweep.json.*row 0.*requests.parquet is missing"):
        profile_rows([tmp_path])
    with pytest.raises(ServelabError, match="output tokens must be >= 3"):
        SweepPlan(output_tokens=2)
    code, _, err = run_main(["fit", "--endpoint", "http://127.0.0.1:9", "-o", str(tmp_path / "m.json")], capsys)
    assert code != 0 and "needs --sweep-out" in err
    code, _, err = run_main(["fit", "--live", str(tmp_path), "--steps", "x.parquet", "-o", "m.json"], capsys)
    assert code != 0 and "no PROFILE, --steps" in err
    code, _, err = run_main(["fit", "--endpoint", "http://127.0.0.1:9", "--sweep-out", str(tmp_path / "s"),
                             "-o", str(tmp_path / "m.json"), "--model", "tiny"], capsys)
    assert code != 0 and "cannot reach the server" in err and not (tmp_path / "m.json").exists()


def test_validate_real_replays_a_live_run(tmp_path, capsys):
    """A live run directory (one request, P=100, 5 tokens, TTFT 4 ms, E2E 16 ms) replayed by a fitted
    model priced by hand: prefill step 0.001 + 100 x 1e-5 = 2 ms; each decode step of one sequence
    0.001 + 5e-4 = 1.5 ms, so E2E 2 + 4 x 1.5 = 8 ms: errors -50% on TTFT and E2E."""
    trace = pa.table({"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [100], "output_tokens": [5]})
    rec = _record(0, 0, 0.0, [0.004, 0.007, 0.010, 0.013, 0.016])
    run = LiveRun([rec], [0], [100], {"kind": "live", "measured": True, "counts": {}}, _metrics())
    out = write_live_run(run, trace, {"name": "t"}, tmp_path / "live")
    assert json.loads((out / "run.json").read_text())["config"]["num_gpu_blocks"] == 4096
    terms = ("intercept", "prefill_tokens", "prefill_seqs", "prefill_context_tokens", "prefill_attention_pairs",
             "decode_seqs", "decode_context_tokens")
    coef = dict(zip(terms, (0.001, 1e-5, 0.0, 0.0, 0.0, 5e-4, 0.0)))
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"format": 1, "kind": "servelab-fitted-runner", "terms": list(terms),
                                 "bucket_edges_tokens": [], "coefficients_s": [coef], "metadata": {}}))
    code, stdout, err = run_main(["validate", "--real", str(out), "--candidate", f"fitted:{model}",
                                  "--format", "json", "--client-model", "none"], capsys)
    assert code == 0, err
    report = json.loads(stdout)
    rows = {(r["metric"], r["stat"]): r for r in report["latency"]}
    assert rows[("ttft", "mean")]["simulated_s"] == pytest.approx(0.002)
    assert rows[("ttft", "mean")]["measured_s"] == pytest.approx(0.004)
    assert rows[("e2e", "mean")]["simulated_s"] == pytest.approx(0.008)
    assert rows[("e2e", "mean")]["error_pct"] == pytest.approx(-50.0)
    assert report["num_gpu_blocks"] == 4096 and report["clock"] == "client"
