"""The packaged roofline constants reproduce vidur's public GPU measurements (skipped without shared/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from servelab.common.errors import InputError
from servelab.runners import calibration as cb
from servelab.runners.base import StepShape, make_runner
from servelab.runners.roofline import load_calibration_file

SHARED = Path(__file__).resolve().parents[2] / "shared"
VIDUR = SHARED / "profiles" / "vidur"

pytestmark = pytest.mark.skipif(not (VIDUR / "compute").is_dir(), reason="shared/profiles/vidur not present")

# Honest bounds, set after looking at the fit (docs/runners.md has the full table).
BOUNDS = {  # group -> (median APE %, p90 APE %)
    "qkv_proj": (10, 25), "o_proj": (10, 25), "mlp_up": (10, 25), "mlp_down": (10, 25),
    "mlp_act": (10, 30), "norm": (16, 35), "rope": (10, 40), "add": (10, 50), "emb": (6, 12),
    "prefill_attention": (10, 20), "decode_attention": (10, 25), "all_reduce": (12, 30), "cpu_overhead": (20, 40),
}


@pytest.fixture(scope="module")
def fresh():
    return cb.calibrate(VIDUR)


def test_every_group_reproduces_its_measurements_within_bounds(fresh):
    seen = set()
    for e in fresh["errors"]:
        median, p90 = BOUNDS[e["group"]]
        assert e["median_ape_pct"] < median, e
        assert e["p90_ape_pct"] < p90, e
        assert e["n"] > 50
        seen.add((e["gpu"], e["group"]))
    for gpu in ("a100", "h100", "a40"):
        for op in ("qkv_proj", "o_proj", "mlp_up", "mlp_down"):
            assert (gpu, op) in seen


def test_packaged_constants_are_what_the_calibration_code_fits(fresh):
    packaged = load_calibration_file()
    for gpu, fitted in fresh["gpus"].items():
        stored = packaged["gpus"][gpu]
        for op, values in fitted["ops"].items():
            for key, value in values.items():
                assert stored["ops"][op][key] == pytest.approx(value, rel=1e-4, abs=1e-9), (gpu, op, key)
        for group in ("prefill_attention", "decode_attention", "all_reduce", "cpu_overhead"):
            for key, value in fitted[group].items():
                assert stored[group][key] == pytest.approx(value, rel=1e-4, abs=1e-9), (gpu, group, key)
    assert [f["sha256"] for f in packaged["source"]["files"]] == [f["sha256"] for f in fresh["source"]["files"]]


def _ape(pred, measured) -> np.ndarray:
    return np.abs(np.asarray(pred) / np.asarray(measured) - 1) * 100


def test_runner_layer_reproduces_llama3_8b_on_a100():
    """The runner's own per-layer sum against the measured sum of the same operators, every TP."""
    df = pl.read_csv(VIDUR / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv")
    columns = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj", "input_layernorm",
               "post_attention_layernorm", "attn_rope", "add"]
    measured = sum(df[f"time_stats.{c}.median"].to_numpy() for c in columns) * 1e-3
    # the operator fit itself (host=vidur-2023: no real-run scaling of GEMM efficiencies or launch latencies)
    runners = {tp: make_runner(f"roofline:model=llama-3.1-8b,gpu=a100-80gb,tp={tp},host=vidur-2023") for tp in (1, 2, 4, 8)}
    pred = [
        sum(runners[tp]._op(f, t) for f in runners[tp]._ops)
        for tp, t in zip(df["num_tensor_parallel_workers"].to_list(), df["num_tokens"].to_list())
    ]
    ape = _ape(pred, measured)
    assert np.median(ape) < 5 and np.quantile(ape, 0.9) < 15  # measured 2.3% and 9.7%


def test_runner_attention_reproduces_the_a100_attention_profile():
    pre, dec = cb.attention_frames(VIDUR)
    r = make_runner("roofline:model=llama-3.1-70b,gpu=a100-80gb,tp=2")  # Llama-2-70B attention shape
    n = dec["batch_size"].to_numpy()
    kv = dec["kv_cache_size"].to_numpy()
    pred = [r.decode_attention_s(int(a), int(a * b)) for a, b in zip(n, kv)]
    ape = _ape(pred, dec["ms"].to_numpy() * 1e-3)
    assert np.median(ape) < 10 and np.quantile(ape, 0.9) < 25
    # The profiled prefill kernel computed the whole chunk x context rectangle (see calibration.py).
    c, p = pre["prefill_chunk_size"].to_numpy(), pre["kv_cache_size"].to_numpy()
    pred = [r.prefill_attention_s(StepShape(int(a), 1, int(a + b), int(a * (a + b)))) for a, b in zip(c, p)]
    ape = _ape(pred, pre["ms"].to_numpy() * 1e-3)
    assert np.median(ape) < 10 and np.quantile(ape, 0.9) < 20


def test_missing_profiles_are_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"compute/a100: no \*/\*/mlp.csv profiles found"):
        cb.calibrate(tmp_path)


def test_calibration_main_writes_atomically(tmp_path):
    out = tmp_path / "cal.json"
    cb.main(["--profiles", str(VIDUR), "-o", str(out)])
    assert out.read_text().startswith("{") and '"errors"' in out.read_text()
    with pytest.raises(InputError):
        cb.main(["--profiles", str(tmp_path / "nowhere"), "-o", str(tmp_path / "bad.json")])
    assert not (tmp_path / "bad.json").exists()


def test_gemm_efficiencies_transfer_to_a_model_left_out_of_the_fit():
    """Leave one model out on the A100: the constants describe the GPU, not the models fitted."""
    from servelab.runners.presets import get_gpu

    gpu, files = get_gpu("a100-80gb"), cb.mlp_files(VIDUR, "a100")
    errors = []
    for held in files:
        train, test = cb.layer_samples([f for f in files if f != held]), cb.layer_samples([held])
        for op in ("qkv_proj", "o_proj", "mlp_up", "mlp_down"):
            fitted = cb.fit_roofline(train[op], gpu)
            errors.append(_ape(cb.roofline_predict(test[op], gpu, **fitted), test[op].time_s))
    ape = np.concatenate(errors)
    assert np.median(ape) < 8 and np.quantile(ape, 0.9) < 20  # measured 5.5% and 16.3%
