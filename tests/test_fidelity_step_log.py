"""`servelab fit --steps`: per-step logs of a real engine (fidelity/step_log.py).

The synthetic log is generated from a known linear model; the fit must give its coefficients
back. The vLLM-trace rows are hand-built, with their expected step times and contexts worked out
below by hand.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main
from servelab.common.errors import InputError
from servelab.fidelity.step_log import read_step_log

# intercept, prefill_tokens, prefill_seqs, prefill_context_tokens, prefill_attention_pairs, decode_seqs, decode_context_tokens
TRUE = {"intercept": 2e-3, "prefill_tokens": 3e-5, "prefill_seqs": 4e-4, "prefill_context_tokens": 1e-8,
        "prefill_attention_pairs": 2e-10, "decode_seqs": 5e-5, "decode_context_tokens": 2e-8}


def synthetic_log(n: int = 400, seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {
        "prefill_tokens": rng.integers(0, 2048, n),
        "prefill_seqs": rng.integers(0, 8, n),
        "prefill_context_tokens": rng.integers(0, 8000, n),
        "prefill_attention_pairs": rng.integers(0, 2_000_000, n),
        "decode_seqs": rng.integers(1, 256, n),
        "decode_context_tokens": rng.integers(0, 200_000, n),
    }
    step = TRUE["intercept"] + sum(TRUE[k] * v.astype(float) for k, v in cols.items())
    return pa.table({**{k: pa.array(v) for k, v in cols.items()}, "step_s": pa.array(step)})


def test_fit_steps_recovers_the_generating_coefficients(tmp_path, capsys):
    log, out = tmp_path / "steps.parquet", tmp_path / "m.json"
    pq.write_table(synthetic_log(), log)
    code, stdout, err = run_main(["fit", "--steps", log, "-o", out, "--buckets", "none",
                                  "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "4"], capsys)
    assert code == 0, err
    assert "test  rows=    80" in stdout  # 20% of 400 held out
    raw = json.loads(out.read_text())
    (coef,) = raw["coefficients_s"]
    for term, value in TRUE.items():
        assert coef[term] == pytest.approx(value, rel=1e-6), term
    assert raw["metadata"]["fit"]["test"]["mape_pct"] < 1e-6
    assert raw["metadata"]["fit"]["step_log_layout"] == "servelab"
    assert raw["metadata"]["model"] == "llama-2-70b"


def test_csv_log_without_the_optional_attention_columns(tmp_path, capsys):
    table = synthetic_log().drop_columns(["prefill_context_tokens", "prefill_attention_pairs"])
    step = (TRUE["intercept"] + TRUE["prefill_tokens"] * table.column("prefill_tokens").to_numpy()
            + TRUE["prefill_seqs"] * table.column("prefill_seqs").to_numpy()
            + TRUE["decode_seqs"] * table.column("decode_seqs").to_numpy()
            + TRUE["decode_context_tokens"] * table.column("decode_context_tokens").to_numpy())
    table = table.set_column(table.schema.get_field_index("step_s"), "step_s", pa.array(step))
    log, out = tmp_path / "steps.csv", tmp_path / "m.json"
    pacsv.write_csv(table, log)
    code, _, err = run_main(["fit", "--steps", log, "-o", out, "--buckets", "none"], capsys)
    assert code == 0, err
    (coef,) = json.loads(out.read_text())["coefficients_s"]
    assert coef["decode_context_tokens"] == pytest.approx(2e-8, rel=1e-6)
    assert coef["prefill_attention_pairs"] == 0.0


def vllm_trace(path: Path) -> Path:
    # Two experiments; step ids 7, 8, 9, 11 in the first (8 -> 9 consecutive, 9 -> 11 not), 7, 8 in the second.
    pq.write_table(pa.table({
        "step.id": [7, 8, 9, 11, 7, 8],
        "step.ts_start_ns": [1_000_000_000_000, 1_000_018_500_000, 1_000_036_000_000, 1_000_080_000_000,
                             5_000_000_000_000, 5_000_020_000_000],
        "step.duration_us": [300, 310, 320, 330, 340, 350],
        "batch.prefill_tokens": [0, 512, 0, 0, 3, 0],
        "batch.num_prefill_reqs": [0, 1, 0, 0, 1, 0],
        "batch.num_decode_reqs": [30, 31, 32, 33, 40, 41],
        "kv.usage_gpu_ratio": [0.05, 0.0625, 0.07, 0.08, 0.1, 0.1],
        "kv.blocks_total_gpu": [1000, 1000, 1000, 1000, 2000, 2000],
        "experiment_id": ["a", "a", "a", "a", "b", "b"],
    }), path)
    return path


def test_vllm_trace_steps_are_start_to_next_start_of_consecutive_ids(tmp_path):
    table, layout = read_step_log(vllm_trace(tmp_path / "trace.parquet"), block_size=16)
    assert layout == "vllm-trace"
    rows = table.to_pylist()
    # a/7 -> a/8: 18.5 ms; a/8 -> a/9: 17.5 ms; a/9 and a/11 have no logged successor; b/7 -> b/8: 20 ms.
    assert [r["step_s"] for r in rows] == pytest.approx([0.0185, 0.0175, 0.020], abs=1e-12)
    # decode context = blocks in use x 16: 0.05 x 1000 x 16 = 800, 0.0625 x 1000 x 16 = 1000, 0.1 x 2000 x 16 = 3200
    assert [r["decode_context_tokens"] for r in rows] == [800, 1000, 3200]
    assert [r["decode_seqs"] for r in rows] == [30, 31, 40]
    assert [(r["prefill_tokens"], r["prefill_seqs"]) for r in rows] == [(0, 0), (512, 1), (3, 1)]


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.drop_columns(["decode_seqs"]), "column 'decode_seqs': required column missing"),
    (lambda t: t.set_column(4, "decode_seqs", pa.array([-1] + [1] * 399)),
     "column 'decode_seqs', row 0: counts must be non-negative integers, got -1.0"),
    (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 5 + [0.0] + [0.01] * 394)),
     "column 'step_s', row 5: step times must be positive and finite seconds"),
    (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 3 + [None] + [0.01] * 396, pa.float64())),
     "column 'step_s', row 3: must not be null"),
])
def test_bad_step_logs_name_file_column_row_and_write_nothing(tmp_path, capsys, mutate, message):
    log, out = tmp_path / "steps.parquet", tmp_path / "m.json"
    pq.write_table(mutate(synthetic_log()), log)
    code, _, err = run_main(["fit", "--steps", log, "-o", out], capsys)
    assert code != 0
    assert f"{log}, {message}" in err
    assert not out.exists()


def test_vllm_trace_missing_column_and_missing_file(tmp_path):
    path = vllm_trace(tmp_path / "trace.parquet")
    pq.write_table(pq.read_table(path).drop_columns(["kv.usage_gpu_ratio"]), path)
    with pytest.raises(InputError, match="column 'kv.usage_gpu_ratio': required column missing"):
        read_step_log(path)
    with pytest.raises(InputError, match="file not found"):
        read_step_log(tmp_path / "nope.parquet")


def test_fit_steps_options_are_checked(tmp_path, capsys):
    log = tmp_path / "steps.parquet"
    pq.write_table(synthetic_log(), log)
    code, _, err = run_main(["fit", "--steps", log], capsys)
    assert code != 0 and "fit --steps takes a step log and -o OUT" in err
    code, _, err = run_main(["fit", "--steps", log, "-o", tmp_path / "m.json", "--block-size", "0"], capsys)
    assert code != 0 and "block size must be a positive integer" in err
    code, _, err = run_main(["fit", log, "-o", tmp_path / "m.json", "--tp", "4"], capsys)
    assert code != 0 and "--model, --gpu and --tp apply to fit --steps" in err


REAL_LOG = Path(__file__).resolve().parents[2] / "shared/calibration/real_vllm/vllm-v1-h100-steps/steps.parquet"


@pytest.mark.skipif(not REAL_LOG.is_file(), reason="needs ../shared/calibration/real_vllm (not in a fresh clone)")
def test_real_70b_tp4_steps_are_above_the_weight_read_floor():
    table, _ = read_step_log(REAL_LOG)
    steps = table.column("step_s").to_numpy()
    # Llama-2-70B bf16: 68,976,648,192 params x 2 B / 4 GPUs / 3.35 TB/s = 10.30 ms per step at the least.
    floor = 68_976_648_192 * 2 / 4 / 3.35e12
    assert table.num_rows == 1251
    assert np.mean(steps >= floor) > 0.99
