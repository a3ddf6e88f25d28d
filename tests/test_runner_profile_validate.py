"""`profile` (shapes through any runner), `validate` (runner A vs B on a trace) and the runner CLI commands."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from servelab.cli.main import cli
from servelab.common.errors import ServelabError
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.runners.base import RunnerBase, StepPlan, StepShape, make_runner
from servelab.runners.paged_kv import BlockAllocator
from servelab.runners.profiling import GRIDS, Batch, Grid, batches, plan_for, profile, read_profile
from servelab.runners.validation import PairedRunner, latency_percentiles, slice_trace, validate
from servelab.traces.io import prepare, write_trace


def small_trace(n: int = 60, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    table = pa.table({
        "request_id": pa.array(np.arange(n), pa.int64()),
        "arrival_s": pa.array(np.cumsum(rng.exponential(0.05, n)), pa.float64()),
        "prompt_tokens": pa.array(rng.integers(16, 1500, n), pa.int32()),
        "output_tokens": pa.array(rng.integers(1, 200, n), pa.int32()),
    })
    return prepare(table, "test", "synthetic")


# --- profile ----------------------------------------------------------------------------------
def test_batch_shape_counts_follow_the_stepshape_definition():
    b = Batch(chunks=((100, 50), (30, 0)), decodes=(10, 20, 30))
    s = b.shape()
    assert s == StepShape(130, 2, 180, 100 * 50 + 100 * 101 // 2 + 30 * 31 // 2, 3, 60)
    assert b.kv_tokens == 240


def test_grid_respects_token_budget_and_kv_capacity():
    grid = Grid(max_batched_tokens=1024, max_kv_tokens=20_000)
    shapes = list(batches(grid))
    assert shapes
    for b in shapes:
        s = b.shape()
        assert s.prefill_tokens + s.decode_seqs <= 1024 and b.kv_tokens <= 20_000
    assert any(s.shape().prefill_seqs and s.shape().decode_seqs for s in shapes)  # mixed batches too


def test_profile_records_exactly_what_the_runner_prices(tmp_path):
    runner = make_runner("linear:base=0.001,prefill_token=0.00002,decode_context_token=0.0000001,seq=0.0001")
    table = profile(runner, tmp_path / "p.parquet", spec="linear:...", grid=GRIDS["small"], repeats=2)
    read, meta = read_profile(tmp_path / "p.parquet")
    assert read.equals(table.replace_schema_metadata(read.schema.metadata))
    assert meta["runner"] == "linear:..." and meta["repeats"] == 2 and meta["format"] == 1
    assert table.num_rows == 2 * len(list(batches(GRIDS["small"])))
    for row in table.to_pylist()[:30]:
        shape = StepShape(**{k: row[k] for k in StepShape._fields if k in row})  # (a profile has no drafts)
        assert row["step_s"] == runner.step_time(StepPlan(shape))


def test_profile_bad_options_write_nothing(tmp_path):
    runner = make_runner("roofline")
    with pytest.raises(ServelabError, match="repeats must be >= 1"):
        profile(runner, tmp_path / "p.parquet", spec="roofline", repeats=0)
    with pytest.raises(ServelabError, match="no shape within the token budget"):
        profile(runner, tmp_path / "p.parquet", spec="roofline", grid=Grid(max_batched_tokens=0))
    assert list(tmp_path.iterdir()) == []


class ItemRunner(RunnerBase):
    """Stands in for a runner that executes items: checks every plan it gets is self-consistent."""

    name = "items"
    needs_block_tables = True
    block_size = 16
    total_blocks = 4096

    def __init__(self):
        self.plans = 0

    def step_time(self, plan: StepPlan) -> float:
        s = plan.shape
        assert sum(it.num_tokens for it in plan.items) == s.prefill_tokens + s.decode_seqs
        assert len(plan.items) == s.prefill_seqs + s.decode_seqs
        for it in plan.items:
            req = it.request
            assert it.start == req.num_computed_tokens
            assert len(req.block_table) * self.block_size >= it.start + it.num_tokens
            assert it.start + it.num_tokens <= req.num_tokens
        self.plans += 1
        return 1e-3 * (1 + s.prefill_tokens + s.decode_seqs)

    def decode_affine(self, n):
        return None

    def describe(self):
        return {"runner": self.name}


def test_profile_gives_item_runners_real_requests_and_frees_their_blocks(tmp_path):
    runner = ItemRunner()
    table = profile(runner, tmp_path / "p.parquet", spec="items", grid=GRIDS["small"])
    assert runner.plans == table.num_rows > 0
    alloc = BlockAllocator(64)
    plan, reqs = plan_for(Batch(chunks=((20, 12),), decodes=(33,)), runner, alloc, 16)
    assert [r.block_table for r in reqs] == [[0, 1], [2, 3, 4]]
    assert reqs[1].is_decoding and plan.items[1].num_tokens == 1


def test_profile_of_the_torch_runner_on_cpu(tmp_path):
    pytest.importorskip("torch")
    runner = make_runner("torch:model=tiny,device=cpu")
    grid = Grid((8, 32), (0, 16), (1,), (1, 4), (8,), (), (), max_batched_tokens=64)
    table = profile(runner, tmp_path / "p.parquet", spec="torch:model=tiny", grid=grid, context={"model": "tiny"})
    assert table.num_rows == len(list(batches(grid))) and min(table.column("step_s").to_pylist()) > 0


# --- validate ---------------------------------------------------------------------------------
def test_paired_runner_prices_the_same_plan_with_both():
    a, b = make_runner("roofline"), make_runner("roofline:cpu_overhead=0")
    paired = PairedRunner(a, b)
    p = StepPlan(StepShape(decode_seqs=4, decode_context_tokens=400))
    assert paired.step_time(p) == a.step_time(p)
    assert paired.candidate_s == [b.step_time(p)]
    assert paired.kv_capacity_tokens() == a.kv_capacity_tokens()  # everything else is the reference's
    # no closed-form decode stretch: the engine asks step_time (so both runners) for every iteration
    assert a.decode_affine(4) is not None and paired.decode_affine(4) is None


def test_validate_prices_every_iteration_of_the_reference_replay():
    """Issue #26 item 3: decode stretches were priced by the reference alone (574 of 9,790 iterations)."""
    from servelab.api import replay

    ref = make_runner("roofline")
    cand = make_runner("linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002")
    trace, config = small_trace(80), ReplayConfig()
    iterations = pa.compute.sum(replay(trace, config, runner=ref).steps.column("num_iterations")).as_py()
    plain_rows = replay(trace, config, runner=ref).steps.num_rows
    assert plain_rows < iterations / 2  # stretches: most iterations are not a row of their own
    report = validate(trace, config, ref, cand)
    assert report["step_time"]["steps_priced"] == report["step_time"]["iterations"] == iterations


def test_validate_a_runner_against_itself_has_zero_error():
    config = ReplayConfig()
    report = validate(small_trace(), config, make_runner("roofline"), make_runner("roofline"))
    assert report["step_time"]["mape_pct"] == 0 and report["step_time"]["steps_priced"] > 0
    assert all(m["error_pct"] == 0 for m in report["latency"])
    assert report["finished"] == {"reference": 60, "candidate": 60}
    json.dumps(report)


def test_validate_reports_the_known_error_of_a_scaled_runner():
    """A linear candidate at exactly 1.5x the reference: +50% on every step and every latency."""
    ref = make_runner("linear:base=0.004,prefill_token=0.00002,decode_context_token=0.00000002")
    cand = make_runner("linear:base=0.006,prefill_token=0.00003,decode_context_token=0.00000003")
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=4000))
    trace = small_trace(40)
    trace = trace.set_column(1, "arrival_s", pa.array(np.arange(40) * 100.0))  # isolated: no queueing
    report = validate(trace, config, ref, cand)
    assert report["step_time"]["median_ape_pct"] == pytest.approx(50, rel=1e-9)
    assert report["step_time"]["mean_signed_pct"] == pytest.approx(50, rel=1e-9)
    for m in report["latency"]:
        assert m["error_pct"] == pytest.approx(50, rel=1e-6), m


def test_latency_percentiles_follow_vllm_bench_serve():
    from servelab.replay.core.schema import REQUESTS_SCHEMA

    rows = [dict.fromkeys(REQUESTS_SCHEMA.names) for _ in range(5)]
    for i, r in enumerate(rows):
        r.update(status="finished", ttft_s=float(i + 1), tpot_s=0.1 * (i + 1), output_tokens=10)
    rows[0].update(output_tokens=1, tpot_s=0.0)  # no inter-token time: left out of TPOT
    rows[4].update(status="unfinished", ttft_s=None, tpot_s=None)
    table = pa.Table.from_pylist(rows, schema=REQUESTS_SCHEMA)
    p = latency_percentiles(table)
    assert p["ttft_p50_s"] == np.percentile([1, 2, 3, 4], 50)
    assert p["tpot_p99_s"] == pytest.approx(np.percentile([0.2, 0.3, 0.4], 99))


def test_slice_trace():
    trace = small_trace(60)
    assert slice_trace(trace, limit=10).num_rows == 10
    start = trace.column("arrival_s")[0].as_py()
    sliced = slice_trace(trace, duration_s=1.0)
    assert max(sliced.column("arrival_s").to_pylist()) < start + 1.0
    with pytest.raises(ServelabError, match="limit must be >= 1"):
        slice_trace(trace, limit=0)
    with pytest.raises(ServelabError, match="duration must be > 0"):
        slice_trace(trace, duration_s=0)


# --- CLI --------------------------------------------------------------------------------------
def test_cli_presets_lists_models_and_gpus():
    result = CliRunner().invoke(cli, ["presets"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    for name in ("llama-3.1-8b", "qwen2.5-72b", "mistral-7b", "tiny", "h100-80gb", "h200", "l40s", "a40"):
        assert name in result.output
    data = json.loads(CliRunner().invoke(cli, ["presets", "--format", "json"]).output)
    assert {m["name"] for m in data["models"]} >= {"llama-3.1-70b", "qwen2.5-7b"}


def test_cli_profile_fit_validate_chain(tmp_path):
    prof, model, report = tmp_path / "p.parquet", tmp_path / "m.json", tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["profile", "--runner", "roofline", "--model", "qwen2.5-7b", "--gpu", "a100-80gb",
                                 "-o", str(prof)])
    assert r.exit_code == 0, r.output
    _, meta = read_profile(prof)
    assert (meta["model"], meta["gpu"], meta["tp"]) == ("qwen2.5-7b", "a100-80gb", 1)
    assert (meta["repeats"], meta["warmup"]) == (1, 0)  # a cost model is deterministic: one run per shape
    r = CliRunner().invoke(cli, ["fit", str(prof), "-o", str(model)])
    assert r.exit_code == 0 and "test  rows=" in r.output and "R^2" in r.output
    trace = tmp_path / "t.arrow"
    write_trace(small_trace(30), trace, source="synthetic")
    r = CliRunner().invoke(cli, ["validate", str(trace), "--reference", "roofline", "--candidate", f"fitted:{model}",
                                 "--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--limit", "20", "-o", str(report)],
                           env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["requests"] == 20 and data["step_time"]["median_ape_pct"] < 3
    assert "ttft_p99_s" in r.output
    assert f"step time over all {data['step_time']['iterations']:,} iterations of the reference replay" in r.output


@pytest.mark.parametrize("config_text", ["", "max_num_batched_tokens = 16384\nmax_num_seqs = 512\n"])
def test_cli_validate_derives_the_kv_blocks_replay_derives(tmp_path, config_text):
    """validate builds its runners as replay does (the engine's batch sizes set the activation memory beside
    the KV cache), so both derive the same KV blocks from the same settings; validate once sized its runners
    from model, GPU and TP only, 300 blocks fewer than replay's at the defaults."""
    trace = tmp_path / "t.arrow"
    write_trace(small_trace(10), trace, source="synthetic")
    config = tmp_path / "c.toml"
    config.write_text(config_text)
    report, run = tmp_path / "report.json", tmp_path / "run"
    r = CliRunner().invoke(cli, ["validate", str(trace), "--reference", "roofline", "--candidate", "roofline",
                                 "--config", str(config), "--limit", "5", "-o", str(report)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["replay", str(trace), "--config", str(config), "-o", str(run),
                                 "--no-report"])
    assert r.exit_code == 0, r.output
    replayed = json.loads((run / "run.json").read_text())["engine"]["num_gpu_blocks"]
    assert json.loads(report.read_text())["num_gpu_blocks"] == replayed


def test_cli_fit_bad_profile_exits_1_with_one_line(tmp_path, capsys):
    from servelab.cli.main import main

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prefill_tokens": [1]}), bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", str(bad), "-o", str(tmp_path / "m.json")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {bad}, column 'prefill_seqs': required column missing"]
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(SystemExit):
        main(["fit", str(bad), "-o", str(tmp_path / "m.json"), "--buckets", "a,b"])
    assert "--buckets needs comma-separated" in capsys.readouterr().err
