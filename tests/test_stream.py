"""Streamed replay (servelab.api.replay_to, `servelab replay --stream`): the same files as a replay in
memory, a trace read a batch at a time (refills at every boundary, ties across them), errors that
name the file's row, and the fallbacks to memory with their reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from servelab.api import EngineConfig, ReplayConfig, not_streamed, replay, replay_to, write_run
from servelab.cli.main import cli
from servelab.common.errors import InputError
from servelab.replay import stream
from servelab.traces.io import read_trace, write_trace
from servelab.traces.synth import synth_trace

FILES = ("requests.parquet", "steps.parquet", "tokens.parquet")
RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.001"


def _trace_file(tmp_path: Path, table: pa.Table, name: str = "t.arrow") -> Path:
    path = tmp_path / name
    write_trace(table, path, "test")
    return path


def _same_run(a: Path, b: Path, bytes_too: bool = True) -> None:
    for name in FILES:
        if not (a / name).exists():
            assert not (b / name).exists()
            continue
        left, right = pq.read_table(a / name), pq.read_table(b / name)
        assert left.equals(right), name
        if bytes_too:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "run.json").read_text()) for d in (a, b))
    for meta in (meta_a, meta_b):
        meta.pop("wall_time_s")
        meta.pop("run_id")
    assert meta_a == meta_b


def _both(tmp_path: Path, path: Path, config: ReplayConfig, **kwargs) -> tuple[Path, Path]:
    mem = write_run(replay(read_trace(path), config, token_log=kwargs.get("token_log", False)), tmp_path / "mem")
    fell_back: list[str] = []
    streamed = replay_to(path, config, tmp_path / "streamed", on_fallback=fell_back.append, **kwargs)
    assert fell_back == []
    return mem, streamed


CONFIGS = {
    "sarathi": ReplayConfig(),
    "srpt-recompute": ReplayConfig(engine=EngineConfig(num_gpu_blocks=300), policy="srpt",
                                   policy_params={"preempt": True}),
    "swap": ReplayConfig(engine=EngineConfig(num_gpu_blocks=300, preemption="swap", kv_bytes_per_token=131072,
                                             swap_space_gb=0.5)),
    "reserve": ReplayConfig(engine=EngineConfig(num_gpu_blocks=1500, kv_allocation="reserve"), policy="sjf"),
    "small-budget": ReplayConfig(engine=EngineConfig(max_num_batched_tokens=256, max_num_seqs=8), policy="vtc"),
    "router": ReplayConfig(engine=EngineConfig(replicas=3, router="least-outstanding")),
    "round-robin": ReplayConfig(engine=EngineConfig(replicas=2), policy="edf"),
    # a horizon: requests still in flight, waiting or not arrived yet (never read, when streamed) end unfinished
    "horizon": ReplayConfig(engine=EngineConfig(num_gpu_blocks=300, until_s=12.0), policy="srpt"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_streamed_files_are_the_in_memory_bytes(tmp_path, name):
    path = _trace_file(tmp_path, synth_trace(n=400, rate=15.0, tenants="a=1,b=1", seed=5))
    mem, streamed = _both(tmp_path, path, CONFIGS[name], batch_rows=37, token_log=name == "srpt-recompute")
    _same_run(mem, streamed)
    if name == "horizon":  # (rows past the horizon were never read into requests by the replay itself)
        arrival = pq.read_table(streamed / "requests.parquet", columns=["arrival_s", "status"]).to_pydict()
        late = [s for a, s in zip(arrival["arrival_s"], arrival["status"]) if a > 12.0 + 37 / 15.0 * 3]
        assert len(late) > 37 and set(late) == {"unfinished"}


def test_prefix_hashes_and_prefix_affinity_stream_the_same(tmp_path):
    table = synth_trace(n=300, rate=8.0, shared_prefix_tokens=1024, prompt="lognormal:1500:0.5",
                        output="lognormal:100:0.5", prefix_block_tokens=48, seed=3)
    path = _trace_file(tmp_path, table, "hashed.parquet")  # (and a Parquet source)
    config = ReplayConfig(engine=EngineConfig(replicas=2, router="prefix-affinity", num_gpu_blocks=2500))
    _same_run(*_both(tmp_path, path, config, batch_rows=50))


def test_offload_tiers_columns_stream_the_same(tmp_path):
    table = synth_trace(n=300, rate=8.0, shared_prefix_tokens=1024, prompt="lognormal:1500:0.5",
                        output="lognormal:100:0.5", prefix_block_tokens=16, tenants="a=1,b=1,c=1", seed=4)
    path = _trace_file(tmp_path, table)
    config = ReplayConfig(engine=EngineConfig(num_gpu_blocks=900, kv_tiers=("dram:capacity_gb=0.05",),
                                              kv_bytes_per_token=131072))
    mem, streamed = _both(tmp_path, path, config, batch_rows=40)
    _same_run(mem, streamed)
    assert "cached_tokens_dram" in pq.read_schema(streamed / "requests.parquet").names
    assert pq.read_table(streamed / "requests.parquet", columns=["cached_tokens_dram"]).column(0).to_numpy().sum() > 0


@pytest.mark.parametrize("batch_rows", [1, 2, 3, 16])
def test_refills_at_every_boundary_with_ties_across_them(tmp_path, batch_rows):
    """Arrivals in bursts of equal times, on the instants steps complete: batch boundaries fall inside
    bursts, between them, and at every row (batch_rows 1); each arrival must come before the
    completions at its instant and the policy see each burst whole, as in memory (least-outstanding
    routing tells the orders apart)."""
    table = synth_trace(n=150, rate=30.0, prompt="lognormal:300:1.0", output="lognormal:30:1.0", seed=9)
    # steps of exactly 1/8 s and arrivals on that grid: completions and arrivals at the same instants
    bursts = pa.array([float(i // 3) * 0.125 for i in range(table.num_rows)], pa.float64())
    table = table.set_column(table.column_names.index("arrival_s"), "arrival_s", bursts)
    path = _trace_file(tmp_path, table)
    for router in ("least-outstanding", "round-robin"):
        config = ReplayConfig(runner="linear:base=0.125,prefill_token=0,decode_seq=0", policy="srpt",
                              engine=EngineConfig(replicas=3, num_gpu_blocks=300, router=router))
        _same_run(*_both(tmp_path / router, path, config, batch_rows=batch_rows))


def test_requests_in_several_chunks_are_the_same_rows(tmp_path, monkeypatch):
    """Chunks of the requests table written as all their requests end, out of order (a long
    request holds its chunk back): the same rows; and in row groups of its chunks."""
    monkeypatch.setattr(stream, "CHUNK", 32)
    path = _trace_file(tmp_path, synth_trace(n=300, rate=20.0, output="lognormal:300:1.2", seed=2))
    mem, streamed = _both(tmp_path, path, ReplayConfig(engine=EngineConfig(replicas=2)), batch_rows=10)
    _same_run(mem, streamed, bytes_too=False)
    assert pq.read_metadata(streamed / "requests.parquet").num_row_groups == 1  # (one group of 65,536 rows)


def test_row_group_size(tmp_path):
    path = _trace_file(tmp_path, synth_trace(n=50, rate=5.0, seed=1))
    with pytest.raises(Exception, match="multiple of 65,536"):
        replay_to(path, ReplayConfig(), tmp_path / "run", group_rows=1000)
    replay_to(path, ReplayConfig(), tmp_path / "run", group_rows=1 << 20)
    assert pq.read_metadata(tmp_path / "run" / "requests.parquet").num_rows == 50


def test_a_table_streams_too(tmp_path):
    """The Python API: a loaded table replayed straight into a run directory."""
    table = read_trace(_trace_file(tmp_path, synth_trace(n=200, rate=10.0, seed=4)))
    write_run(replay(table, ReplayConfig()), tmp_path / "mem")
    replay_to(table, ReplayConfig(), tmp_path / "streamed", batch_rows=64)
    _same_run(tmp_path / "mem", tmp_path / "streamed")


def _raw(tmp_path: Path, table: pa.Table) -> Path:
    """A trace file written as is (no validation, so that the stream's own is tested)."""
    path = tmp_path / "raw.parquet"
    meta = {b"servelab_trace_version": b"1"}
    pq.write_table(table.replace_schema_metadata(meta), path)
    return path


def _simple(n: int, **columns) -> pa.Table:
    data = {"request_id": list(range(n)), "arrival_s": [i * 0.1 for i in range(n)],
            "prompt_tokens": [100] * n, "output_tokens": [10] * n}
    data.update(columns)
    return pa.table({k: pa.array(v, pa.float64() if k == "arrival_s" else pa.int64()) for k, v in data.items()})


def test_errors_name_the_files_row_across_batches(tmp_path):
    rows = 10
    bad = _simple(rows, prompt_tokens=[100] * 7 + [0] + [100] * 2)
    with pytest.raises(InputError, match=r"column 'prompt_tokens', row 8: token count must be >= 1"):
        replay_to(_raw(tmp_path, bad), ReplayConfig(runner=RUNNER, engine=EngineConfig(num_gpu_blocks=100)),
                  tmp_path / "run", batch_rows=3)
    unsorted = _simple(rows, arrival_s=[0.0, 0.1, 0.2, 0.15, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    with pytest.raises(InputError, match=r"column 'arrival_s', row 4: arrivals not sorted"):
        replay_to(_raw(tmp_path, unsorted), ReplayConfig(), tmp_path / "run", batch_rows=3)
    repeated = _simple(rows, request_id=[0, 1, 2, 3, 4, 5, 1, 7, 8, 9])
    with pytest.raises(InputError, match=r"column 'request_id', row 7: duplicate request_id"):
        replay_to(_raw(tmp_path, repeated), ReplayConfig(), tmp_path / "run", batch_rows=3)
    assert not (tmp_path / "run").exists()  # nothing half-written


CONFIG_REASONS = {
    "a cluster": {"cluster": {"pools": [{"name": "a", "replicas": 1}]}},
    "kv_retention": {"kv_retention": "keep"},
    "LoRA": {"max_loras": 2},
    "client timeouts": {"client_timeout_s": 5.0},
    "platform": {"quota": ["tenant=*:rpm=60"]},
}


@pytest.mark.parametrize("what", sorted(CONFIG_REASONS))
def test_config_reasons(what):
    assert what in not_streamed(ReplayConfig.from_dict(CONFIG_REASONS[what]))


def test_shedding_policy_is_not_streamed():
    assert "platform" in not_streamed(ReplayConfig(policy="edf", policy_params={"drop": True}))
    assert not_streamed(ReplayConfig(policy="edf")) is None


def test_closed_loop_sessions_replay_in_memory_saying_why(tmp_path):
    table = synth_trace(n=60, rate=2.0, turns=3.0, think_s=5.0, seed=3)
    path = _trace_file(tmp_path, table)
    reasons: list[str] = []
    replay_to(path, ReplayConfig(), tmp_path / "run", on_fallback=reasons.append)
    assert reasons == ["the trace has closed-loop sessions (session_id with think_s)"]
    write_run(replay(read_trace(path), ReplayConfig()), tmp_path / "mem")
    _same_run(tmp_path / "mem", tmp_path / "run")


def test_trace_columns_that_are_not_streamed(tmp_path):
    base = _simple(6)
    timeouts = base.append_column("timeout_s", pa.array([None, 2.0, None, None, None, None], pa.float64()))
    assert "client timeouts" in stream.TraceFile(timeouts).scan()
    depends = base.append_column("depends_on", pa.array([None, [0], None, None, None, None], pa.list_(pa.int64())))
    assert "depends_on" in stream.TraceFile(depends).scan()
    assert "LoRA" in stream.TraceFile(base.append_column("lora_adapter", pa.array(["x"] * 6))).scan()
    empty_timeouts = base.append_column("timeout_s", pa.nulls(6, pa.float64()))
    assert stream.TraceFile(empty_timeouts).scan() is None


def test_cli_stream_writes_the_same_run(tmp_path):
    path = _trace_file(tmp_path, synth_trace(n=150, rate=10.0, seed=8))
    args = ["replay", str(path), "--runner", RUNNER, "--num-gpu-blocks", "400", "--no-report", "--token-log"]
    first = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "mem")])
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "streamed"), "--stream", "--slo", "ttft=1"])
    assert second.exit_code == 0, second.output
    assert "not streaming" not in second.output
    for name in FILES:
        assert (tmp_path / "mem" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes()
    assert json.loads((tmp_path / "streamed" / "run.json").read_text())["slo"]


def test_cli_stream_falls_back_saying_why_once(tmp_path):
    path = _trace_file(tmp_path, synth_trace(n=40, rate=10.0, seed=8))
    result = CliRunner().invoke(cli, ["replay", str(path), "--runner", RUNNER, "--num-gpu-blocks", "400",
                                      "--no-report", "--stream"])
    assert result.exit_code == 0, result.output
    assert result.output.count("not streaming: no run directory (-o)") == 1
    result = CliRunner().invoke(cli, ["replay", str(path), "--runner", RUNNER, "--num-gpu-blocks", "400",
                                      "--no-report", "--stream", "-o", str(tmp_path / "run"), "--queue-cap", "5"])
    assert result.exit_code == 0, result.output
    assert result.output.count("not streaming: the platform's features") == 1
    assert pq.read_table(tmp_path / "run" / "requests.parquet").num_rows == 40


def test_progress_counts_the_whole_trace(tmp_path):
    path = _trace_file(tmp_path, synth_trace(n=300, rate=20.0, seed=6))
    calls: list[tuple[float, int, int]] = []
    replay_to(path, ReplayConfig(), tmp_path / "run", progress=lambda now, ended, total: calls.append((now, ended, total)),
              batch_rows=50)
    assert calls and {total for _, _, total in calls} == {300}
    assert calls[-1][1] == 300  # every request ended by the last report


def test_report_without_scoring_reads_a_streamed_run(tmp_path, monkeypatch):
    """A build without the scoring package prints percentiles, read back from the streamed run."""
    import sys

    from servelab.cli.replay_cmd import _report

    path = _trace_file(tmp_path, synth_trace(n=80, rate=10.0, seed=2))
    replay_to(path, ReplayConfig(), tmp_path / "run")
    monkeypatch.setitem(sys.modules, "servelab.scoring.report", None)  # (importing it raises ImportError)
    text = _report(None, str(tmp_path / "run"), None)
    assert text.startswith("requests: 80  finished: 80") and "ttft_s  p50" in text
