"""vLLM's CPU KV offloading read from a run's files and replayed as a host-memory tier (fidelity/kv_offload.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_cli import run_main
from servelab.fidelity.kv_offload import Offload, recorded_offload, settings
from servelab.fidelity.vllm_log import dict_args

FIX = Path(__file__).parent / "fixtures" / "real_runs"
GIB = 1 << 30
# what vLLM's non-default args line prints for --kv-transfer-config: the parsed config object's repr
KV_TRANSFER = ("KVTransferConfig(kv_connector='OffloadingConnector', engine_id='5a7c-e1', kv_buffer_device='cuda', "
               "kv_buffer_size=1000000000.0, kv_role='kv_both', kv_rank=None, kv_parallel_size=1, "
               "kv_ip='127.0.0.1', kv_port=14579, kv_connector_extra_config={EXTRA}, "
               "kv_connector_module_path=None, enable_permute_local_kv=False)")


@pytest.mark.parametrize("args, want", [
    ({"kv_offloading_size": 8.0}, Offload(8 * GIB / 1e9, None, "kv_offloading_size 8.0 GiB (native)")),
    ({"kv_offloading_size": 4, "kv_offloading_backend": "lmcache"}, None),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 2e9}}}, Offload(2.0, None, "")),
    ({"kv_transfer_config": json.dumps({"kv_connector": "OffloadingConnector",
                                        "kv_connector_extra_config": {"num_cpu_blocks": 1000}})},
     Offload(None, 1000, "", None)),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 10, "block_size": 64}}},
     Offload(None, 10, "", 64)),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector"},
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1e9}}]}}},
     Offload(1.0, None, "")),
    ({"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}, "none"),
    ({"max_num_seqs": 8}, "none"),
    ({"kv_offloading_size": "8GiB"}, "unsized"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": "lots"}}}, "unsized"),
])
def test_recorded_offload_forms(args, want):
    got = recorded_offload(args)
    if want == "none":
        assert got is None
    elif want == "unsized":  # recorded, but no size to replay: said, not guessed
        assert got is not None and got.gb is None and got.blocks is None
    elif want is None:  # LMCache: offloading, size not in vLLM's arguments
        assert got is not None and got.gb is None and got.blocks is None and "LMCache" in got.how
    else:
        assert (got.gb, got.blocks, got.block_tokens) == (pytest.approx(want.gb) if want.gb else None, want.blocks,
                                                          want.block_tokens)


def test_settings_in_gb_or_tokens():
    assert settings(Offload(8.589934592, None, ""), 16) == {"kv_offload_gb": 8.589935}
    assert settings(Offload(None, 100, ""), 32) == {"kv_offload_tokens": 3200}
    assert settings(Offload(None, 100, "", 64), 16) == {"kv_offload_tokens": 6400}
    assert settings(Offload(None, None, "LMCache"), 16) == {}


def test_non_default_args_with_config_objects_are_read():
    """A literal dict stays one; a config object's repr becomes its fields, a value with no literal its text."""
    text = ("{'model': 'm', 'max_num_seqs': 64, 'kv_transfer_config': "
            + KV_TRANSFER.replace("{EXTRA}", "{'cpu_bytes_to_use': 8589934592.0}")
            + ", 'compilation_config': <CompilationMode.VLLM_COMPILE: 3>, 'enable_prefix_caching': True}")
    args = dict_args(text)
    assert args["model"] == "m" and args["max_num_seqs"] == 64 and args["enable_prefix_caching"] is True
    assert args["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    assert args["kv_transfer_config"]["kv_connector_extra_config"] == {"cpu_bytes_to_use": 8589934592.0}
    assert args["compilation_config"] == "<CompilationMode.VLLM_COMPILE: 3>"
    assert dict_args("{'a': 1, 'b': [1, 2]}") == {"a": 1, "b": [1, 2]}
    with pytest.raises(ValueError):
        dict_args("{'a': 1, not an item}")


def offload_run(tmp_path: Path, capsys, extra: str) -> Path:
    folder = tmp_path / "exp"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    (folder / "vllm.log").write_text(
        "x INFO vllm.entrypoints.utils: non-default args: {'model': '/m/Llama-2-7b-hf', 'max_num_seqs': 64, "
        f"'kv_transfer_config': {KV_TRANSFER.replace('{EXTRA}', extra)}, "
        "'served_model_name': ['meta-llama/Llama-2-7b-hf']}\n"
        "x INFO vllm.v1.core.kv_cache_utils: GPU KV cache size: 119,008 tokens\n"
        "x INFO vllm.v1.metrics.loggers: Engine 000: Avg prompt throughput: 900.0 tokens/s, Avg generation "
        "throughput: 50.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 4.0%, Prefix cache hit "
        "rate: 20.0%, External prefix cache hit rate: 12.5%\n")
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    return run


def validated(run: Path, capsys, *options) -> dict:
    code, out, err = run_main(["validate", "--real", run, "--format", "json", *options], capsys)
    assert code == 0, err
    return json.loads(out)


def test_cpu_offload_in_the_server_log_is_replayed_as_a_write_through_dram_tier(tmp_path, capsys):
    run = offload_run(tmp_path, capsys, "{'cpu_bytes_to_use': 8589934592.0}")
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["kv_offload_gb"] == pytest.approx(8.589935)
    assert meta["config_sources"]["kv_offload_gb"] == "vllm.log line 1"
    assert meta["config"]["max_num_seqs"] == 64  # the rest of the line is read as before
    report = validated(run, capsys)
    assert report["config"]["kv_tiers"] == ["dram:capacity_gb=8.589935"]
    assert report["config"]["kv_tier_write"] == "through"
    assert "simulated_lower_tiers" in report["prefix"]  # the GPU cache's hits compare with vLLM's rate, apart
    assert report["prefix"]["measured"] == 0.2 and report["prefix"]["measured_external"] == 0.125
    shown = {s["setting"]: s for s in report["settings"]}
    assert shown["kv_tiers"]["value"] == ["dram:capacity_gb=8.589935"]
    assert "CPU KV offloading" in shown["kv_tiers"]["from"] and "vllm.log line 1" in shown["kv_tiers"]["from"]
    # an option wins over the run's tier
    report = validated(run, capsys, "--set", "kv_tiers=dram:capacity_gb=1")
    assert report["config"]["kv_tiers"] == ["dram:capacity_gb=1"] and report["config"]["kv_tier_write"] == "back"


def test_cpu_offload_in_blocks_is_priced_at_the_models_kv_bytes(tmp_path, capsys):
    run = offload_run(tmp_path, capsys, "{'num_cpu_blocks': 1000}")
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["kv_offload_tokens"] == 16_000 and "kv_offload_gb" not in meta["config"]
    report = validated(run, capsys)
    # Llama-2-7B: 32 layers x 2 (K, V) x 4,096 x 2 bytes = 524,288 bytes per token
    assert report["config"]["kv_tiers"] == ["dram:capacity_gb=8.388608"]  # 16,000 x 524,288 bytes


def test_offload_without_a_size_is_said_not_guessed(tmp_path, capsys):
    run = offload_run(tmp_path, capsys, "{}")  # OffloadingConnector without a size
    meta = json.loads((run / "run.json").read_text())
    assert "kv_offload_gb" not in meta["config"] and "without cpu_bytes_to_use" in meta["source"]["kv_offload"]
    report = validated(run, capsys)
    assert not report["config"].get("kv_tiers")
    shown = {s["setting"]: s for s in report["settings"]}
    assert "not recorded" in shown["kv_tiers"]["from"] and "--set kv_tiers" in shown["kv_tiers"]["from"]


def test_lmcache_sizes_from_its_workers_config_line(tmp_path, capsys):
    """LMCache's CPU and disk stores, per worker as its config line gives them, become the dram and ssd tiers
    of the replica (tp workers each holding their shard)."""
    folder = tmp_path / "exp"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    worker = ("(Worker_TP{r} pid=1) LMCache INFO: Creating LMCacheEngine with config: {{'chunk_size': 256, "
              "'local_cpu': True, 'max_local_cpu_size': 20.0, 'local_disk': 'file:///tmp/lmc/', "
              "'max_local_disk_size': 100.0, 'remote_url': None}}\n")
    (folder / "vllm.log").write_text(
        "x INFO vllm.entrypoints.utils: non-default args: {'model': 'meta-llama/Llama-2-7b-hf', "
        "'tensor_parallel_size': 2, 'kv_transfer_config': KVTransferConfig(kv_connector='LMCacheConnectorV1', "
        "kv_role='kv_both', kv_connector_extra_config={})}\n" + worker.format(r=0) + worker.format(r=1))
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["kv_offload_gb"] == pytest.approx(2 * 20 * GIB / 1e9, abs=1e-6)
    assert meta["config"]["kv_offload_disk_gb"] == pytest.approx(2 * 100 * GIB / 1e9, abs=1e-6)
    assert "max_local_cpu_size 20 GB x 2 workers" in meta["config_sources"]["kv_offload_gb"]
    report = validated(run, capsys)
    assert report["config"]["kv_tiers"] == ["dram:capacity_gb=42.949673", "ssd:capacity_gb=214.748365"]
