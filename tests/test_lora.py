"""Multi-LoRA serving (replay/core/lora.py): the cap on distinct adapters per batch, adapter load times in
TTFT, the adapters' kernel cost by rank, their slots' memory, prefix-cache keys per adapter, and the
lora-affinity router. Sizes are computed here by hand from the model's shape."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from conftest import make_trace
from helpers_engine import column
from servelab.api import EngineConfig, ReplayConfig, replay
from servelab.common.errors import ServelabError
from servelab.policies.base import policy_names
from servelab.replay.core.protocols import StepPlan, StepShape
from servelab.runners.base import make_runner
from servelab.traces.io import prepare

MODEL, GPU = "llama-3.1-8b", "h100-80gb"
# Llama-3.1-8B per layer, in + out of each adapted linear layer: q (4096 + 4096), k and v (4096 + 1024
# each), o (4096 + 4096), gate and up (4096 + 14336 each), down (14336 + 4096); 32 layers.
PARAMS_PER_RANK = 32 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096))


def config(**engine) -> ReplayConfig:
    engine.setdefault("num_gpu_blocks", 20_000)
    return ReplayConfig(engine=EngineConfig(**engine), model=MODEL, gpu=GPU)


def runner():
    return make_runner("roofline", model=MODEL, gpu=GPU)


class Recorder:
    """The roofline runner, recording how many distinct adapters each priced batch holds."""

    def __init__(self, inner):
        self.inner = inner
        self.distinct: list[int] = []

    def lora_step_s(self, rank_tokens, ranks):
        self.distinct.append(len(ranks))
        return self.inner.lora_step_s(rank_tokens, ranks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def adapter_trace(n: int, adapters: int, seed: int, rate: float = 40.0) -> pa.Table:
    rng = np.random.default_rng(seed)
    names = [None if i == adapters else f"a{i}" for i in rng.integers(0, adapters + 1, n)]
    table = make_trace(np.cumsum(rng.exponential(1 / rate, n)), rng.integers(20, 800, n).tolist(),
                       rng.integers(1, 120, n).tolist(), lora_adapter=names)
    return prepare(table, "test", "test")


def test_the_params_per_rank_are_the_hand_count():
    assert PARAMS_PER_RANK == 2_621_440
    assert runner().lora_params_per_rank == PARAMS_PER_RANK


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("seed", [1, 2])
def test_a_batch_never_holds_more_than_max_loras_distinct_adapters(policy, seed):
    trace = adapter_trace(300, adapters=9, seed=seed)
    capped, free = Recorder(runner()), Recorder(runner())
    for max_loras, rec in ((3, capped), (64, free)):
        cfg = config(max_loras=max_loras, num_gpu_blocks=4000)
        cfg = ReplayConfig(engine=cfg.engine, model=MODEL, gpu=GPU, policy=policy)
        result = replay(trace, cfg, runner=rec)
        assert set(column(result, "status")) == {"finished"}
    assert max(capped.distinct) <= 3
    assert max(free.distinct) > 3  # the same trace uncapped mixes more: the cap is what held it


def test_a_cold_adapter_load_appears_exactly_in_its_ttft():
    # One request at a time on an idle engine: A cold (from disk), A again (resident), B (evicts A from
    # the one slot; from disk), A (back from the host cache of 2).
    trace = prepare(make_trace([0, 100, 200, 300], [256] * 4, [4] * 4, lora_adapter=["A", "A", "B", "A"]),
                    "test", "test")
    r = runner()
    result = replay(trace, config(max_loras=1, max_cpu_loras=2, lora_rank=16), runner=r)
    ttft = column(result, "ttft_s")
    size = 16 * PARAMS_PER_RANK * 2  # bytes of a rank-16 bf16 adapter
    disk, host = size / 2e9, size / 25e9
    alone = r.step_time(StepPlan(StepShape(prefill_tokens=256, prefill_seqs=1, prefill_context_tokens=256,
                                           prefill_attention_pairs=256 * 257 // 2)))
    kernels = r.lora_step_s(256 * 16, [16])
    assert kernels > 0
    assert ttft[1] == pytest.approx(alone + kernels, rel=1e-12)
    assert ttft[0] == pytest.approx(alone + kernels + disk + host, rel=1e-12)
    assert ttft[2] == pytest.approx(ttft[0], rel=1e-12)
    assert ttft[3] == pytest.approx(alone + kernels + host, rel=1e-12)
    assert result.meta["lora"]["loads_from_disk"] == 2 and result.meta["lora"]["loads_from_host"] == 1


def test_a_second_adapter_waits_for_the_slot_when_max_loras_is_one():
    trace = prepare(make_trace([0, 0.001], [128, 128], [50, 50], lora_adapter=["A", "B"]), "test", "test")
    result = replay(trace, config(max_loras=1), runner=runner())
    first_token, finish = column(result, "ttft_s"), column(result, "finish_s")
    # B is admitted only after A finished (it could have shared A's first batch otherwise)
    assert 0.001 + first_token[1] > finish[0]
    both = replay(trace, config(max_loras=2), runner=runner())
    assert 0.001 + column(both, "ttft_s")[1] < column(both, "finish_s")[0]


def test_kernel_cost_grows_with_rank_and_with_adapters_read():
    r = runner()
    assert 0 < r.lora_step_s(64 * 8, [8]) < r.lora_step_s(64 * 64, [64])
    assert r.lora_step_s(64 * 16, [16]) < r.lora_step_s(64 * 16, [16, 16, 16, 16])  # more weights read
    assert r.lora_step_s(0, []) == 0.0


def test_higher_ranks_make_decode_steps_slower_and_the_slots_take_kv_memory():
    trace = adapter_trace(60, adapters=2, seed=3)
    low = replay(trace, config(max_loras=2, lora_rank=8), runner=runner())
    high = replay(trace, config(max_loras=2, lora_rank=128), runner=runner())
    assert sum(column(high, "e2e_s")) > sum(column(low, "e2e_s"))
    derived = lambda **e: replay(trace if e else trace.drop(["lora_adapter"]), ReplayConfig(engine=EngineConfig(**e), model=MODEL, gpu=GPU),  # noqa: E731
                                 runner=runner()).meta["engine"]["num_gpu_blocks"]
    capacity = runner().kv_capacity_tokens(0.9)
    slots = 4 * 64 * PARAMS_PER_RANK * 2  # 4 slots at the largest rank (a0's 64), bf16
    assert derived() == capacity // 16
    assert derived(max_loras=4, lora_ranks=("a0=64",)) == (capacity - -(-slots // (128 * 1024))) // 16


def test_prefix_cache_keys_include_the_adapter():
    hashes = [[1, 2, 3, 4]] * 3
    table = make_trace([0, 20, 40], [64] * 3, [1] * 3, lora_adapter=["A", "B", "A"])
    table = table.append_column("prefix_hashes", pa.array(hashes, pa.list_(pa.int64())))
    trace = prepare(table, "test", "test", prefix_block_tokens=16)
    result = replay(trace, config(max_loras=2), runner=runner())
    assert column(result, "cached_tokens") == [0, 0, 63]  # B's KV differs from A's; A's second hits


def test_adapters_without_lora_serving_or_a_runner_without_a_model_are_clear_errors():
    trace = prepare(make_trace([0, 1], [10, 10], [1, 1], lora_adapter=[None, "A"]), "test", "test")
    with pytest.raises(ServelabError, match="lora_adapter, row 2.*'A'.*max_loras"):
        replay(trace, config(), runner=runner())
    cfg = ReplayConfig(engine=EngineConfig(max_loras=2, num_gpu_blocks=100), runner="linear:base=1")
    with pytest.raises(ServelabError, match="cannot serve LoRA"):
        replay(trace, cfg)
    for bad, match in (({"max_loras": -1}, "max_loras"), ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
                       ({"lora_ranks": ("x",)}, "NAME=RANK"), ({"lora_ranks": ("x=0",)}, ">= 1"),
                       ({"lora_disk_gbps": 0}, "gbps")):
        with pytest.raises(ServelabError, match=match):
            EngineConfig(**bad)


def test_lora_affinity_sends_requests_where_their_adapter_is_resident():
    trace = adapter_trace(400, adapters=8, seed=5, rate=30.0)
    loads = {}
    for router in ("least-outstanding", "lora-affinity"):
        cfg = config(max_loras=2, replicas=4, router=router)
        result = replay(trace, cfg, runner=runner())
        assert set(column(result, "status")) == {"finished"}
        meta = result.meta["lora"]
        loads[router] = meta["loads_from_disk"] + meta["loads_from_host"]
    assert loads["lora-affinity"] < loads["least-outstanding"]


def test_adapters_are_assigned_with_zipf_popularity_per_session():
    from servelab.traces.synth import synth_trace
    from servelab.traces.transforms import lora_adapters

    trace = synth_trace(n=6000, rate=10.0, seed=1)
    names = lora_adapters(trace, 4, zipf_s=1.0, seed=2).column("lora_adapter").to_pylist()
    counts = [names.count(f"lora-{k}") for k in range(4)]
    share = [c / len(names) for c in counts]
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert share == pytest.approx([1 / harmonic / (k + 1) for k in range(4)], abs=0.02)
    assert lora_adapters(trace, 4, zipf_s=1.0, seed=2).equals(lora_adapters(trace, 4, zipf_s=1.0, seed=2))
    base = lora_adapters(trace, 4, base_fraction=0.25, seed=2).column("lora_adapter").null_count / trace.num_rows
    assert base == pytest.approx(0.25, abs=0.02)
    sessions = synth_trace(n=600, rate=10.0, seed=1, turns=4, think_s=1.0)
    table = lora_adapters(sessions, 8, seed=3)
    by_session = {}
    for sid, name in zip(table.column("session_id").to_pylist(), table.column("lora_adapter").to_pylist()):
        by_session.setdefault(sid, set()).add(name)
    assert all(len(v) == 1 for v in by_session.values())  # a conversation keeps its adapter
    with pytest.raises(ServelabError, match="count must be >= 1"):
        lora_adapters(trace, 0)


def test_the_cli_synthesises_adapters_and_replays_them(tmp_path):
    from click.testing import CliRunner

    from servelab.cli.main import cli

    runner_ = CliRunner()
    path = tmp_path / "t.parquet"
    done = runner_.invoke(cli, ["trace", "synth", "-o", str(path), "-n", "80", "--rate", "20", "--lora-adapters", "6"])
    assert done.exit_code == 0, done.output
    out = tmp_path / "run"
    done = runner_.invoke(cli, ["replay", str(path), "-o", str(out), "--model", MODEL, "--gpu", GPU,
                                "--max-loras", "2", "--router", "lora-affinity", "--replicas", "2"])
    assert done.exit_code == 0, done.output
    import json

    meta = json.loads((out / "run.json").read_text())
    assert meta["lora"]["loads_from_disk"] >= 6 and meta["engine"]["max_loras"] == 2
