"""The vLLM server log as several vLLM versions write it: the arguments (0.10+ ``non-default args``,
before that ``args: Namespace(...)``), the KV cache (V1 ``num_gpu_blocks is``, V0 ``# GPU blocks`` /
``# cuda blocks``, V1 ``GPU KV cache size: N tokens``, ``Maximum concurrency ...``) and the prefix-cache
hit rate (V1 ``Prefix cache hit rate: X%``, V0 ``... GPU: X%, CPU: Y%``). The lines below have the
shapes of real vLLM logs (vllm-project/vllm issues and source), shortened."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_cli import run_main

FIX = Path(__file__).parent / "fixtures" / "real_runs"

# vLLM 0.5 (V0): every argument in a Namespace, "# GPU blocks", the hit rate on its own line
V05 = (
    "INFO 07-10 10:00:00 api_server.py:206] vLLM API server version 0.5.1\n"
    "INFO 07-10 10:00:00 api_server.py:207] args: Namespace(host=None, port=8000, uvicorn_log_level='info', "
    "allow_credentials=False, allowed_origins=['*'], api_key=None, chat_template=None, model='meta-llama/Llama-2-7b-hf', "
    "tokenizer=None, dtype='auto', max_model_len=4096, block_size=16, enable_prefix_caching=True, seed=0, "
    "gpu_memory_utilization=0.85, num_gpu_blocks_override=None, max_num_batched_tokens=None, max_num_seqs=128, "
    "tensor_parallel_size=1, served_model_name=None, engine_use_ray=False, disable_log_requests=True)\n"
    "INFO 07-10 10:00:01 llm_engine.py:169] Initializing an LLM engine (v0.5.1) with config: "
    "model='meta-llama/Llama-2-7b-hf', speculative_config=None, tokenizer='meta-llama/Llama-2-7b-hf', "
    "tensor_parallel_size=1, pipeline_parallel_size=1, disable_custom_all_reduce=False, enable_prefix_caching=True)\n"
    "INFO 07-10 10:00:30 distributed_gpu_executor.py:56] # GPU blocks: 6976, # CPU blocks: 512\n"
    "INFO 07-10 10:05:00 metrics.py:295] Avg prompt throughput: 1532.1 tokens/s, Avg generation throughput: 210.3 "
    "tokens/s, Running: 12 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 15.2%, CPU KV cache usage: 0.0%.\n"
    "INFO 07-10 10:05:00 metrics.py:311] Prefix cache hit rate: GPU: 31.25%, CPU: 0.00%\n")

# vLLM 0.6-0.9 `vllm serve` (V0 engine): a Namespace with a function repr, "# cuda blocks", max concurrency
V06 = (
    "INFO 11-20 10:00:00 api_server.py:585] vLLM API server version 0.6.4\n"
    "INFO 11-20 10:00:00 api_server.py:586] args: Namespace(subparser='serve', model_tag='Qwen/Qwen2.5-7B-Instruct', "
    "config='', host=None, port=8000, lora_modules=None, model='Qwen/Qwen2.5-7B-Instruct', max_model_len=32768, "
    "block_size=16, enable_prefix_caching=False, gpu_memory_utilization=0.9, max_num_batched_tokens=None, "
    "max_num_seqs=256, tensor_parallel_size=1, pipeline_parallel_size=1, served_model_name=None, "
    "override_neuron_config=None, compilation_config={'level': 0}, "
    "dispatch_function=<function serve at 0x7f3c2a1b5e40>)\n"
    "INFO 11-20 10:00:40 executor_base.py:112] # cuda blocks: 27423, # CPU blocks: 4681\n"
    "INFO 11-20 10:00:40 executor_base.py:117] Maximum concurrency for 32768 tokens per request: 13.39x\n"
    "INFO 11-20 10:06:00 metrics.py:467] Prefix cache hit rate: GPU: 0.00%, CPU: 0.00%\n")

# vLLM 0.8-0.9 V1 engine: a Namespace, the KV size in tokens, the V1 metrics line
V08 = (
    "INFO 05-01 10:00:00 [api_server.py:1043] vLLM API server version 0.8.5\n"
    "INFO 05-01 10:00:00 [api_server.py:1044] args: Namespace(subparser='serve', model_tag='meta-llama/Llama-3.1-8B', "
    "model='meta-llama/Llama-3.1-8B', block_size=None, enable_prefix_caching=None, gpu_memory_utilization=0.9, "
    "max_num_batched_tokens=8192, max_num_seqs=None, tensor_parallel_size=1, served_model_name=None, "
    "dispatch_function=<function ServeSubcommand.cmd at 0x7f0e7c1d9c60>)\n"
    "INFO 05-01 10:00:05 [core.py:58] Initializing a V1 LLM engine (v0.8.5) with config: "
    "model='meta-llama/Llama-3.1-8B', tensor_parallel_size=1, enable_prefix_caching=True, chunked_prefill_enabled=True\n"
    "INFO 05-01 10:00:30 [kv_cache_utils.py:634] GPU KV cache size: 455,328 tokens\n"
    "INFO 05-01 10:00:30 [kv_cache_utils.py:637] Maximum concurrency for 131,072 tokens per request: 3.47x\n"
    "INFO 05-01 10:03:00 [loggers.py:111] Engine 000: Avg prompt throughput: 1200.3 tokens/s, Avg generation "
    "throughput: 300.0 tokens/s, Running: 10 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.1%, Prefix cache hit rate: 29.8%\n")

# vLLM 0.10+ with process prefixes; only the max-concurrency line survives of the KV lines (a filtered log)
V011 = (
    "(APIServer pid=1) INFO 10-01 12:00:00 [api_server.py:1896] vLLM API server version 0.11.0\n"
    "(APIServer pid=1) INFO 10-01 12:00:00 [utils.py:233] non-default args: {'model_tag': 'Qwen/Qwen2.5-32B', "
    "'model': 'Qwen/Qwen2.5-32B', 'tensor_parallel_size': 2, 'max_num_seqs': 128}\n"
    "(EngineCore_DP0 pid=300) INFO 10-01 12:00:40 [kv_cache_utils.py:1091] Maximum concurrency for 40,960 tokens "
    "per request: 4.88x\n")


@pytest.mark.parametrize("text, settings, source", [
    (V05, {"model": "meta-llama/Llama-2-7b-hf", "block_size": 16, "enable_prefix_caching": True,
           "gpu_memory_utilization": 0.85, "max_num_seqs": 128, "tp": 1, "num_gpu_blocks": 6976},
     {"vllm_version": "0.5.1", "prefix_cache_hit_rate": 0.3125}),
    (V06, {"model": "Qwen/Qwen2.5-7B-Instruct", "block_size": 16, "enable_prefix_caching": False,
           "gpu_memory_utilization": 0.9, "max_num_seqs": 256, "tp": 1, "num_gpu_blocks": 27423},
     {"vllm_version": "0.6.4", "prefix_cache_hit_rate": 0.0}),
    (V08, {"model": "meta-llama/Llama-3.1-8B", "gpu_memory_utilization": 0.9, "max_num_batched_tokens": 8192,
           "tp": 1, "enable_prefix_caching": True, "num_gpu_blocks": 455328 // 16},
     {"vllm_version": "0.8.5", "prefix_cache_hit_rate": 0.298, "kv_cache_tokens": 455328}),
    (V011, {"model": "Qwen/Qwen2.5-32B", "tp": 2, "max_num_seqs": 128, "num_gpu_blocks": round(4.88 * 40960 / 16)},
     {"vllm_version": "0.11.0"}),
], ids=["v0.5", "v0.6-cuda-blocks", "v0.8-v1", "v0.11-max-concurrency-only"])
def test_log_lines_of_several_vllm_versions(tmp_path, text, settings, source):
    from servelab.fidelity.vllm_log import read_log

    log = tmp_path / "vllm.log"
    log.write_text(text)
    got, src, origin = read_log(log)
    assert got == settings
    for key, value in source.items():
        assert src[key] == pytest.approx(value), key
    assert origin["model"] == "vllm.log line 2"
    if "Maximum concurrency" in text and "blocks:" not in text and "KV cache size" not in text:
        assert "maximum concurrency" in origin["num_gpu_blocks"]


def test_namespace_fields_keep_odd_values_as_text():
    from servelab.fidelity.vllm_log import namespace_args

    args = namespace_args("a=None, b='x, y', c=[1, 2], d={'k': (1, 2)}, e=<function f at 0x7f>, f=inf, g=-1.5")
    assert args == {"a": None, "b": "x, y", "c": [1, 2], "d": {"k": (1, 2)}, "e": "<function f at 0x7f>",
                    "f": "inf", "g": -1.5}
    # a repr with a bare comma is the previous value's text, not a reason to drop the whole line
    assert namespace_args("h=Foo(1), 2, i=3") == {"h": "Foo(1), 2", "i": 3}


def test_a_v0_log_beside_a_run_reaches_validate_real(tmp_path, capsys):
    """An older server's log: its blocks, arguments and V0 hit rate are used and listed with their lines;
    the hit rate with no hashes in the trace is a loud warning on import and in validate --real."""
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(FIX / "vllm_bench_serve.json", folder / "result.json")
    (folder / "server.log").write_text(V05)
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", folder / "result.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert "31.2% prefix-cache hit rate" in err or "hit rate of 31.2%" in err
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["num_gpu_blocks"] == 6976 and meta["config_sources"]["num_gpu_blocks"] == "server.log line 4"
    assert meta["config"]["max_num_seqs"] == 128 and meta["config_sources"]["max_num_seqs"] == "server.log line 2"
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    used = {s["setting"]: s for s in rep["settings"]}
    assert used["num_gpu_blocks"] == {"setting": "num_gpu_blocks", "value": 6976, "from": "run: server.log line 4"}
    assert used["gpu"]["from"] == "run: --setting" and used["policy"]["from"] == "default"
    assert rep["prefix"]["measured"] == pytest.approx(0.3125) and rep["prefix"]["measured_from"] == "server.log line 6"
    assert "--prefix-from-hit-rate" in rep["prefix"]["warning"]
    assert rep["errors"]["measured"] is not None


def test_the_chunked_prefill_line_gives_the_batch_limit_the_server_ran_with(tmp_path):
    from servelab.fidelity.vllm_log import read_log

    log = tmp_path / "vllm.log"
    log.write_text(V011 + "(EngineCore_DP0 pid=300) INFO 10-01 12:00:05 [scheduler.py:222] Chunked prefill is enabled "
                          "with max_num_batched_tokens=8192.\n")
    settings, _, origin = read_log(log)
    assert settings["max_num_batched_tokens"] == 8192 and origin["max_num_batched_tokens"] == "vllm.log line 4"


def _import_with_log(tmp_path, capsys, version: str, gpu: str, args: str = "") -> tuple[Path, dict]:
    """An OTel run beside a vllm.log of ``version`` whose non-default args add ``args``: (run dir, run.json)."""
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    (folder / "vllm.log").write_text(
        f"INFO 10-01 12:00:00 [api_server.py:1896] vLLM API server version {version}\n"
        f"INFO 10-01 12:00:00 [utils.py:233] non-default args: {{'model': 'meta-llama/Llama-2-7b-hf'{args}}}\n")
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--setting", f"gpu={gpu}"], capsys)
    assert code == 0, err
    return run, json.loads((run / "run.json").read_text())


@pytest.mark.parametrize("version, gpu, expected", [
    ("0.11.0", "h100-80gb", (8192, 1024)),  # >= 70 GiB, not an A100
    ("0.10.1.1", "h200", (8192, 1024)),
    ("0.11.0", "a100-80gb", (2048, 256)),  # the A100 exception
    ("0.11.0", "l40s", (2048, 256)),  # 48 GB
    ("0.8.5", "h100-80gb", None),  # before the per-GPU defaults: the replay's own, listed as defaults
])
def test_a_run_started_with_vllms_defaults_gets_them_not_the_replays(tmp_path, capsys, version, gpu, expected):
    run, meta = _import_with_log(tmp_path, capsys, version, gpu)
    got = tuple(meta["config"].get(k) for k in ("max_num_batched_tokens", "max_num_seqs"))
    if expected is None:
        assert got == (None, None)
        return
    assert got == expected
    assert meta["config_sources"]["max_num_seqs"].startswith(f"vLLM {version}'s default on ")
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    used = {s["setting"]: s for s in json.loads(out)["settings"]}
    assert used["max_num_batched_tokens"]["value"] == expected[0]
    assert used["max_num_batched_tokens"]["from"].startswith(f"run: vLLM {version}'s default")


@pytest.mark.parametrize("version, args, expected", [
    ("0.14.0", "", True),  # vLLM's default since 0.14
    ("0.19.1", "", True),
    ("0.13.0", "", None),  # before: off, the replay's own default
    ("0.19.1", ", 'async_scheduling': False", False),  # --no-async-scheduling, as the log records it
])
def test_async_scheduling_comes_from_the_version_or_the_servers_args(tmp_path, capsys, version, args, expected):
    run, meta = _import_with_log(tmp_path, capsys, version, "h100-80gb", args)
    assert meta["config"].get("async_scheduling") is expected
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    used = {s["setting"]: s for s in json.loads(out)["settings"]}
    assert used["async_scheduling"]["value"] is bool(expected)
    if expected:
        assert "default (async scheduling, on since 0.14)" in used["async_scheduling"]["from"]


def test_async_scheduling_is_not_assumed_with_pipeline_parallelism():
    from servelab.fidelity.vllm_defaults import fill_async_default

    settings: dict = {}
    fill_async_default(settings, {}, {"vllm_version": "0.15.0", "pipeline_parallel_size": 2})
    assert settings == {}
    fill_async_default(settings, {}, {"pipeline_parallel_size": 2})  # (nor with the version assumed)
    assert settings == {}


def test_a_recorded_batch_limit_caps_the_default_sequences(tmp_path):
    from servelab.fidelity.vllm_defaults import fill_batch_defaults

    settings, origin = {"gpu": "h100-80gb", "max_num_batched_tokens": 512}, {"max_num_batched_tokens": "vllm.log line 3"}
    fill_batch_defaults(settings, origin, {"vllm_version": "0.11.0"})
    assert settings["max_num_seqs"] == 512 and origin["max_num_batched_tokens"] == "vllm.log line 3"
    older = {"gpu": "h100-80gb"}
    fill_batch_defaults(older, {}, {"vllm_version": "0.8.5"})  # before 0.9: servelab's own, as the replay's defaults
    assert older == {"gpu": "h100-80gb"}


@pytest.mark.parametrize("source, expected", [
    ({}, {"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "async_scheduling": True}),  # assumed: 0.14+
    ({"backend": "vllm"}, {"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "async_scheduling": True}),
    ({"backend": "openai-chat"}, {"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "async_scheduling": True}),
    ({"backend": "sglang"}, {}),  # another server's run: none of vLLM's defaults
    ({"backend": "lmdeploy"}, {}),
    ({"server_type": "sglang"}, {}),  # TraceV2's server block
    ({"vllm_version": "0.11.0"}, {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}),  # recorded: no async
    ({"vllm_version": "0.8.5"}, {}),
])
def test_a_run_without_a_version_gets_the_defaults_of_todays_vllm(source, expected):
    from servelab.fidelity.vllm_defaults import assumed_warning, fill_async_default, fill_batch_defaults

    settings, origin = {"gpu": "h100-80gb"}, {"gpu": "--setting"}
    fill_batch_defaults(settings, origin, source)
    fill_async_default(settings, origin, source)
    assert {k: v for k, v in settings.items() if k != "gpu"} == expected
    warning = assumed_warning(settings, origin, source)
    if expected and "vllm_version" not in source:
        assert all("vLLM 0.14+ assumed (no version recorded): its default" in origin[k] for k in expected)
        assert warning is not None and "--setting vllm_version=VERSION" in warning
    else:
        assert warning is None


def test_data_parallel_engines_hit_rates_are_averaged(tmp_path):
    from servelab.fidelity.vllm_log import read_log

    def metrics(engine: int, prompt: float, rate: float) -> str:
        return (f"(APIServer pid=1) INFO 10-01 12:01:00 [loggers.py:123] Engine {engine:03d}: Avg prompt throughput: "
                f"{prompt} tokens/s, Avg generation throughput: 80.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, "
                f"GPU KV cache usage: 4.0%, Prefix cache hit rate: {rate}%\n")

    log = tmp_path / "vllm.log"
    log.write_text(V011 + metrics(0, 900.0, 20.0) + metrics(1, 900.0, 40.0) + metrics(0, 850.0, 30.0)
                   + metrics(1, 0.0, 2.0))  # engine 1's last line is idle: its busy one counts
    _, source, _ = read_log(log)
    assert source["prefix_cache_hit_rate"] == pytest.approx(0.35)
    assert source["prefix_cache_hit_rate_from"] == "vllm.log lines 5, 6 (mean over 2 engines)"


# vLLM 0.12+: the version only in the start-up banner, async scheduling said as resolved, a config object
# among the non-default args
V017 = (
    "(APIServer pid=1) INFO 03-20 10:08:10 [utils.py:297]        \u2588     \u2588     \u2588\u2584   \u2584\u2588\n"
    "(APIServer pid=1) INFO 03-20 10:08:10 [utils.py:297]  \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  "
    "version 0.17.1\n"
    "(APIServer pid=1) INFO 03-20 10:08:10 [utils.py:233] non-default args: {'model_tag': 'meta-llama/Llama-3.1-8B', "
    "'model': 'meta-llama/Llama-3.1-8B', 'max_num_seqs': 64, 'kv_transfer_config': KVTransferConfig("
    "kv_connector='P2pNcclConnector', kv_role='kv_producer', kv_connector_extra_config={'proxy_port': '30001'})}\n"
    "(APIServer pid=1) INFO 03-20 10:08:17 [scheduler.py:231] Chunked prefill is enabled with "
    "max_num_batched_tokens=8192.\n"
    "(APIServer pid=1) INFO 03-20 10:08:17 [vllm.py:748] Asynchronous scheduling is enabled.\n")


def test_a_newer_log_gives_its_version_from_the_banner_and_async_scheduling_as_resolved(tmp_path):
    from servelab.fidelity.vllm_log import read_log

    log = tmp_path / "vllm.log"
    log.write_text(V017)
    settings, source, origin = read_log(log)
    assert source["vllm_version"] == "0.17.1" and "kv_offload" not in source  # (a transfer, not an offload)
    assert settings == {"model": "meta-llama/Llama-3.1-8B", "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                        "async_scheduling": True}
    assert origin["async_scheduling"] == "vllm.log line 5" and origin["model"] == "vllm.log line 3"
    log.write_text(V017.replace("is enabled.", "is disabled."))
    assert read_log(log)[0]["async_scheduling"] is False


def test_a_model_served_under_an_alias_is_replayed_as_the_model_it_loaded(tmp_path, capsys):
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    (folder / "vllm.log").write_text(V017.replace("'max_num_seqs': 64,", "'max_num_seqs': 64, 'served_model_name': "
                                                  "['chat-prod'],"))
    run = tmp_path / "run"
    code, out, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["model"] == "meta-llama/Llama-3.1-8B" and meta["source"]["model_recorded"] == "chat-prod"
    assert "the model it loaded" in meta["config_sources"]["model"]
    # a served name that is a preset stays the model
    (folder / "vllm.log").write_text(V017.replace("'max_num_seqs': 64,", "'max_num_seqs': 64, 'served_model_name': "
                                                  "['Qwen/Qwen2.5-7B-Instruct'],"))
    code, out, err = run_main(["run", "import", folder / "traces.json", "-o", tmp_path / "r2", "--setting",
                               "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "r2" / "run.json").read_text())["config"]["model"] == "Qwen/Qwen2.5-7B-Instruct"


def _import_otel(tmp_path, capsys, *extra: str, log: str | None = None) -> tuple[int, Path, str]:
    folder = tmp_path / "src"
    folder.mkdir(exist_ok=True)
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "traces.json")
    if log is not None:
        (folder / "vllm.log").write_text(
            f"INFO 10-01 12:00:00 [api_server.py:1896] vLLM API server version {log}\n"
            "INFO 10-01 12:00:00 [utils.py:233] non-default args: {'model': 'meta-llama/Llama-2-7b-hf'}\n")
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder / "traces.json", "-o", run, "--force", "--setting", "gpu=h100-80gb",
                             "--setting", "model=llama-2-7b", *extra], capsys)
    return code, run, err


def test_a_run_without_a_version_is_replayed_as_todays_vllm_and_says_so(tmp_path, capsys):
    code, run, err = _import_otel(tmp_path, capsys)
    assert code == 0, err
    assert "the run records no vLLM version" in err and "--setting vllm_version=VERSION" in err
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["async_scheduling"] is True and meta["config"]["max_num_seqs"] == 1024
    code, out, err = run_main(["validate", "--real", run, "--format", "json"], capsys)
    assert code == 0, err
    used = {s["setting"]: s for s in json.loads(out)["settings"]}
    assert used["async_scheduling"]["value"] is True
    assert "vLLM 0.14+ assumed (no version recorded): its default" in used["async_scheduling"]["from"]
    assert used["max_num_batched_tokens"]["value"] == 8192


def test_the_version_given_names_the_servers_defaults(tmp_path, capsys):
    code, run, err = _import_otel(tmp_path, capsys, "--setting", "vllm_version=0.11.0")
    assert code == 0, err
    assert "records no vLLM version" not in err
    meta = json.loads((run / "run.json").read_text())
    assert "async_scheduling" not in meta["config"]  # 0.11: synchronous, the replay's own default
    assert meta["config"]["max_num_batched_tokens"] == 8192
    assert meta["config_sources"]["max_num_seqs"].startswith("vLLM 0.11.0's default on h100-80gb")
    assert meta["source"]["vllm_version"] == "0.11.0" and meta["source"]["vllm_version_from"] == "--setting"
    assert not any("vLLM version" in w for w in meta["warnings"])


def test_the_version_given_wins_over_the_logs_with_a_note(tmp_path, capsys):
    code, run, err = _import_otel(tmp_path, capsys, "--setting", "vllm_version=0.11.0", log="0.15.1")
    assert code == 0, err
    meta = json.loads((run / "run.json").read_text())
    assert "async_scheduling" not in meta["config"] and meta["source"]["vllm_version"] == "0.11.0"
    assert "the run records vLLM 0.15.1; --setting vllm_version=0.11.0 decides" in meta["notes"]


def test_a_version_that_is_not_one_is_refused(tmp_path, capsys):
    code, run, err = _import_otel(tmp_path, capsys, "--setting", "vllm_version=latest")
    assert code != 0 and "--setting vllm_version=latest: must be a vLLM release such as 0.14 or 0.11.0" in err
    assert not run.exists()
