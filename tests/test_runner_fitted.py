"""The fitted runner: recovers known coefficients, exact decode_affine, clean errors on bad profiles."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servelab.common.errors import InputError, ServelabError
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.fitted import TERMS, FittedModel, FittedRunner, fit_model, fit_profile, load_model
from servelab.runners.profiling import FEATURES, GRIDS, PROFILE_META_KEY, PROFILE_SCHEMA, Grid, profile

TRUE = {  # seconds per count, in TERMS order
    "intercept": 2e-3, "prefill_tokens": 5e-5, "prefill_seqs": 1e-4, "prefill_context_tokens": 2e-6,
    "prefill_attention_pairs": 3e-10, "decode_seqs": 4e-5, "decode_context_tokens": 7e-8,
}


def synthetic_table(rng: np.random.Generator, n: int = 400, coef=TRUE, meta: dict | None = None) -> pa.Table:
    chunks = rng.integers(0, 2048, n)
    seqs = np.where(chunks > 0, rng.integers(1, 4, n), 0)
    ctx = chunks + rng.integers(0, 8192, n) * (chunks > 0)
    pairs = chunks * (ctx - chunks) + chunks * (chunks + 1) // 2
    decodes = rng.integers(0, 256, n)
    decodes[(chunks == 0) & (decodes == 0)] = 1
    dctx = decodes * rng.integers(16, 4096, n)
    cols = dict(zip(FEATURES, (chunks, seqs, ctx, pairs, decodes, dctx)))
    step = coef["intercept"] + sum(coef[f] * cols[f].astype(float) for f in FEATURES)
    table = pa.table({**{f: pa.array(v, pa.int64()) for f, v in cols.items()}, "step_s": step})
    if meta is not None:
        table = table.replace_schema_metadata({PROFILE_META_KEY: json.dumps(meta).encode()})
    return table


def test_fit_recovers_known_coefficients(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(synthetic_table(np.random.default_rng(7)), path)
    model = fit_profile(path, tmp_path / "m.json", buckets=())
    for name, value in zip(TERMS, model.coefficients[0]):
        assert value == pytest.approx(TRUE[name], rel=0.01), name
    test = model.metadata["fit"]["test"]
    assert test["mape_pct"] < 0.01 and test["r2"] > 0.99999


def test_piecewise_fit_recovers_each_buckets_coefficients():
    rng = np.random.default_rng(3)
    small, large = synthetic_table(rng, 600), synthetic_table(rng, 600, coef={k: 2 * v for k, v in TRUE.items()})
    tokens_small = small.column("prefill_tokens").to_numpy() + small.column("decode_seqs").to_numpy()
    tokens_large = large.column("prefill_tokens").to_numpy() + large.column("decode_seqs").to_numpy()
    table = pa.concat_tables([small.filter(pa.array(tokens_small <= 512)), large.filter(pa.array(tokens_large > 512))])
    model = fit_model(table, buckets=(512,))
    for name, lo, hi in zip(TERMS, *model.coefficients):
        assert lo == pytest.approx(TRUE[name], rel=0.01) and hi == pytest.approx(2 * TRUE[name], rel=0.01), name


def test_decode_affine_is_exact_for_fitted():
    model = FittedModel((16, 256), tuple(tuple(v * (1 + b) for v in TRUE.values()) for b in range(3)))
    runner = FittedRunner(model)
    for n in (1, 16, 17, 256, 300):
        a, b = runner.decode_affine(n)
        for context in (n, 1234 * n + 7, 10**7 + 3):
            assert runner.step_time(StepPlan(StepShape(decode_seqs=n, decode_context_tokens=context))) == a + b * context


def test_profile_of_roofline_then_fit_reproduces_roofline(tmp_path):
    """End to end: roofline as the measured runner -> profile -> fit -> fitted within a few %."""
    roof = make_runner("roofline")
    profile(roof, tmp_path / "p.parquet", spec="roofline", context={"model": "llama-3.1-8b", "gpu": "h100-80gb", "tp": 1})
    fit_profile(tmp_path / "p.parquet", tmp_path / "m.json", buckets=(16, 64, 256, 1024))
    fitted = make_runner(f"fitted:{tmp_path / 'm.json'}")
    # Fresh shapes, not the profile grid: random mixed batches within a 2048-token budget.
    rng = np.random.default_rng(11)
    errors = []
    for _ in range(300):
        chunk, ctx = int(rng.integers(0, 2048)), int(rng.integers(0, 8192))
        n = int(rng.integers(0 if chunk else 1, 128))
        shape = StepShape(chunk, int(chunk > 0), (chunk + ctx) * (chunk > 0), (chunk * ctx + chunk * (chunk + 1) // 2),
                          n, n * int(rng.integers(16, 4096)))
        truth = roof.step_time(StepPlan(shape))
        errors.append(abs(fitted.step_time(StepPlan(shape)) / truth - 1) * 100)
    assert np.median(errors) < 2 and np.quantile(errors, 0.9) < 5
    # The fitted runner knows its model and GPU from the profile, so the engine can size KV.
    assert fitted.kv_bytes_per_token == roof.kv_bytes_per_token
    assert fitted.kv_capacity_tokens(0.9) == roof.kv_capacity_tokens(0.9)


def test_fit_and_profile_are_deterministic(tmp_path):
    roof = make_runner("roofline:model=mistral-7b,gpu=a100-80gb")
    for i in (1, 2):
        profile(roof, tmp_path / f"p{i}.parquet", spec="roofline", grid=GRIDS["small"])
        fit_profile(tmp_path / f"p{i}.parquet", tmp_path / f"m{i}.json", buckets=(), seed=5)
    assert (tmp_path / "p1.parquet").read_bytes() == (tmp_path / "p2.parquet").read_bytes()
    m1 = json.loads((tmp_path / "m1.json").read_text())
    m2 = json.loads((tmp_path / "m2.json").read_text())
    m1["metadata"]["source"] = m2["metadata"]["source"] = ""
    assert m1 == m2


def _write(tmp_path, table) -> str:
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.drop(["decode_seqs"]), r"bad.parquet, column 'decode_seqs': required column missing"),
        (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 4 + [0.0] + [0.01] * 35)),
         r"bad.parquet, column 'step_s', row 4: step times must be positive and finite, got 0.0"),
        (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 9 + [-1.0] + [0.01] * 30)),
         r"column 'step_s', row 9: step times must be positive"),
        (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 2 + [float("nan")] + [0.01] * 37)),
         r"column 'step_s', row 2: step times must be positive and finite"),
        (lambda t: t.set_column(6, "step_s", pa.array([0.01] * 3 + [None] + [0.01] * 36, pa.float64())),
         r"column 'step_s', row 3: must not be null"),
        (lambda t: t.set_column(0, "prefill_tokens", pa.array([-5] + [1] * 39, pa.int64())),
         r"column 'prefill_tokens', row 0: counts must be non-negative integers"),
        (lambda t: t.set_column(1, "prefill_seqs", pa.array(["a"] * 40)), r"column 'prefill_seqs': must be numeric"),
        (lambda t: t.slice(0, 0), r"profile has no rows"),
    ],
)
def test_bad_profiles_are_input_errors_and_write_nothing(tmp_path, mutate, message):
    table = synthetic_table(np.random.default_rng(0), n=40)
    path = _write(tmp_path, mutate(table))
    with pytest.raises(InputError, match=message):
        fit_profile(path, tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.parquet"]  # no temp file left either


def test_missing_or_unreadable_profile(tmp_path):
    with pytest.raises(InputError, match="nope.parquet: profile file not found"):
        fit_profile(tmp_path / "nope.parquet", tmp_path / "m.json")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(InputError, match="x.parquet: not a Parquet file"):
        fit_profile(tmp_path / "x.parquet", tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_too_many_buckets_for_the_rows_is_an_error(tmp_path):
    path = _write(tmp_path, synthetic_table(np.random.default_rng(0), n=40))
    with pytest.raises(InputError, match=r"bucket of 1\.\.2 batch tokens has 0 training rows"):
        fit_profile(path, tmp_path / "m.json", buckets=(2, 4))
    assert not (tmp_path / "m.json").exists()


def test_bad_model_files(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{")
    with pytest.raises(InputError, match="m.json: invalid JSON"):
        load_model(bad)
    bad.write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(InputError, match="not a servelab fitted model"):
        load_model(bad)
    good = FittedModel((), (tuple(TRUE.values()),)).to_json()
    good["coefficients_s"][0]["decode_seqs"] = -1
    bad.write_text(json.dumps(good))
    with pytest.raises(InputError, match=r"column 'coefficients_s', row 0: coefficients must be finite and >= 0"):
        load_model(bad)
    with pytest.raises(ServelabError, match="needs a model file"):
        make_runner("fitted")
    with pytest.raises(ServelabError, match="unknown parameter 'scale'"):
        make_runner("fitted:m.json,scale=2")


def test_fitted_without_gpu_metadata_leaves_kv_size_to_the_user(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(synthetic_table(np.random.default_rng(1), meta={"runner": "torch", "model": "tiny"}), path)
    fit_profile(path, tmp_path / "m.json", buckets=())
    runner = make_runner(f"fitted:path={tmp_path / 'm.json'}")
    assert runner.kv_capacity_tokens is None  # the engine then asks for --num-gpu-blocks
    assert runner.kv_bytes_per_token == 512  # tiny's K+V per token, from the model preset
    json.dumps(runner.describe())


def test_profile_schema_is_the_features_plus_step_time():
    assert PROFILE_SCHEMA.names == [*FEATURES, "step_s"]
    assert Grid().max_batched_tokens == 8192


def test_repeats_are_reduced_to_their_median_so_outliers_do_not_bend_the_fit():
    clean = synthetic_table(np.random.default_rng(4), n=200)
    step = clean.column("step_s").to_numpy()
    noisy = clean.set_column(6, "step_s", pa.array(step * 30))  # one wild repeat of every shape
    table = pa.concat_tables([clean, clean, noisy])
    model = fit_model(table, buckets=())
    assert model.metadata["fit"]["rows_read"] == 600 and model.metadata["fit"]["rows"] == 200
    for name, value in zip(TERMS, model.coefficients[0]):
        assert value == pytest.approx(TRUE[name], rel=0.01), name


def test_median_per_shape_by_hand():
    from servelab.runners.fitted import median_per_shape

    t = pa.table({**{f: pa.array([3, 1, 3, 1, 3, 2], pa.int64()) for f in FEATURES},
                  "step_s": [5.0, 1.0, 1.0, 3.0, 2.0, 7.0]})
    out = median_per_shape(t)
    assert out.column("prefill_tokens").to_pylist() == [3, 1, 2]  # first-appearance order
    assert out.column("step_s").to_pylist() == [2.0, 2.0, 7.0]  # odd, even (mean of middle two), single


def test_profile_fit_and_fitted_runner_need_no_polars(tmp_path):
    """The GPU image has numpy, pyarrow and scipy but no polars: the device path must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['polars'] = None\n"
        "from servelab.runners.base import make_runner\n"
        "from servelab.runners.profiling import profile, GRIDS\n"
        "from servelab.runners.fitted import fit_profile\n"
        "import servelab.runners.validation\n"
        f"profile(make_runner('roofline'), r'{tmp_path}/p.parquet', spec='roofline', grid=GRIDS['small'], repeats=2)\n"
        f"fit_profile(r'{tmp_path}/p.parquet', r'{tmp_path}/m.json', buckets=())\n"
        f"print(make_runner(r'fitted:{tmp_path}/m.json').decode_affine(4))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Using the runners needs neither polars nor scipy (make_runner imports every runner module).
    code = (
        "import sys; sys.modules['polars'] = None; sys.modules['scipy'] = None\n"
        "from servelab.runners.base import make_runner\n"
        f"print(make_runner(r'fitted:{tmp_path}/m.json').decode_affine(4), make_runner('roofline').decode_affine(4))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
