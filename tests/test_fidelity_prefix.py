"""Prompt sharing a real run records (token ids, TraceV2 groups, generator settings, a reported hit
rate) reaches the imported trace as prefix hashes, and a replay serves what they share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers_cli import run_main
from servelab.traces import prefixes
from servelab.traces.io import read_trace

FIX = Path(__file__).parent / "fixtures" / "real_runs"


def test_acceptance_golden_shared_prefix_and_prompt_pool_replay(tmp_path, capsys):
    """A 1,024-token shared prefix and a 100-prompt pool: the replay's prefix hits equal the shared
    tokens (the prefix for a pool prompt's first use, its whole prompt after) within one block."""
    from servelab.api import replay
    from servelab.replay.config import EngineConfig, ReplayConfig

    path = tmp_path / "pool.arrow"
    code, _, err = run_main(["trace", "synth", "-o", path, "-n", 400, "--arrival", "constant", "--rate", 1,
                             "--prompt", "uniform:64:512", "--output-len", 32, "--shared-prefix-tokens", 1024,
                             "--prefix-groups", 1, "--prompt-pool", 100, "--seed", 3], capsys)
    assert code == 0, err
    trace = read_trace(path)
    prompt = trace.column("prompt_tokens").to_numpy()
    ids = trace.column("request_id").to_numpy()
    # the generator's own arithmetic: request i sends pool prompt i mod 100 (1,024 shared tokens first)
    assert (prompt == prompt[ids % 100]).all() and prompt.min() >= 1024 + 64
    block = 16
    expected = np.zeros(len(prompt), dtype=np.int64)
    for i in range(1, len(prompt)):
        expected[i] = prompt[i] - 1 if i >= 100 else 1024  # seen pool prompt: all but the last token
    config = ReplayConfig(model="llama-3.1-8b", gpu="h100-80gb", engine=EngineConfig(num_gpu_blocks=30_000))
    sim = replay(trace, config).requests.sort_by("request_id")
    cached = sim.column("cached_tokens").to_numpy()
    assert (np.abs(cached - expected) < block).all(), np.nonzero(np.abs(cached - expected) >= block)
    share = cached.sum() / prompt.sum()
    assert share == pytest.approx(expected.sum() / prompt.sum(), abs=block * len(prompt) / prompt.sum())
    assert share > 0.7


def test_hash_chain_is_vllms_block_chaining():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    ha, hb = prefixes.token_hashes(a, 16), prefixes.token_hashes(b, 16)
    assert len(ha) == 2 and len(prefixes.token_hashes(a[:47], 16)) == 2  # full blocks only
    assert ha[:2] == hb[:2]
    c = [7] + list(range(1, 40))  # the first block differs: no later block can match (chained)
    hc = prefixes.token_hashes(c, 16)
    assert hc[1] != ha[1] and hc[0] != ha[0]
    assert prefixes.token_hashes(a, 16) == ha  # deterministic across calls and processes (blake2b)


def test_hit_rate_prefix_reproduces_the_rate():
    prompt = [1000, 2000, 1500, 800] * 25
    length = prefixes.hit_rate_prefix(prompt, 0.30, 16)
    share = sum(min(p // 16 * 16, length) for p in prompt[1:]) / sum(prompt)
    assert length % 16 == 0 and share == pytest.approx(0.30, abs=16 / 800)


def test_generator_settings_from_key_value_text_and_dicts():
    spec = prefixes.spec_from_generator({"data": ["prompt_tokens=512,prefix_tokens=1024,prefix_count=4"]}, "r.json")
    assert (spec.prefix_tokens, spec.prefix_groups, spec.prompt_pool) == (1024, 4, 0)
    assert prefixes.spec_from_generator({"data": {"prefix_tokens": 0, "prompt_tokens": 17}}, "p") is None


def _workload_run(tmp_path: Path, shared: int) -> Path:
    """The rtx4090 fixture with a workload.jsonl whose prompts share their first ``shared`` tokens."""
    folder = tmp_path / "src"
    shutil.copytree(FIX / "rtx4090", folder)
    rng = np.random.default_rng(0)
    common = rng.integers(0, 30000, shared).tolist()
    lines = []
    for rec in map(json.loads, (folder / "requests.jsonl").read_text().splitlines()):
        ids = common + rng.integers(0, 30000, rec["input_toks"] - shared).tolist()
        lines.append(json.dumps({"input_toks": rec["input_toks"], "input_tok_ids": ids}))
    (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_token_ids_beside_the_run_become_prefix_hashes(tmp_path, capsys):
    folder = _workload_run(tmp_path, 200)
    out = tmp_path / "run"
    code, stdout, err = run_main(["run", "import", folder / "requests.jsonl", "-o", out, "--setting", "gpu=rtx-4090"],
                                 capsys)
    assert code == 0, err
    trace = read_trace(out / "trace.arrow")
    hashes = trace.column("prefix_hashes").to_pylist()
    assert trace.schema.metadata[b"prefix_block_tokens"] == b"16"
    shared_blocks = 200 // 16
    assert all(h[:shared_blocks] == hashes[0][:shared_blocks] for h in hashes)
    assert len({h[shared_blocks] for h in hashes}) == len(hashes)  # block 13 straddles the end: all differ
    meta = json.loads((out / "run.json").read_text())
    assert "token ids" in meta["prefix"]["origin"]
    assert meta["prefix"]["ideal_hit_share"] == pytest.approx(3 * 192 / sum(trace.column("prompt_tokens").to_pylist()))
    # validate --real prints the measured and simulated shares side by side
    code, stdout, err = run_main(["validate", "--real", out, "--format", "json"], capsys)
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["prefix"]["hashes"] is True and rep["prefix"]["simulated"] > 0


def test_trace_v2_prefix_group_columns(tmp_path, capsys):
    folder = tmp_path / "b"
    shutil.copytree(FIX / "blis", folder)
    lines = (folder / "trace.csv").read_text().splitlines()
    header = lines[0].split(",")
    g, n = header.index("prefix_group"), header.index("prefix_length")
    rows = [line.split(",") for line in lines[1:]]
    for r in rows[1:3]:  # both successful requests in group "sys", 128 shared tokens
        r[g], r[n] = "sys", "128"
    (folder / "trace.csv").write_text("\n".join([lines[0]] + [",".join(r) for r in rows]) + "\n")
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder, "-o", out, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    hashes = read_trace(out / "trace.arrow").column("prefix_hashes").to_pylist()
    assert len(hashes[0]) == len(hashes[1]) == 8 and hashes[0] == hashes[1]


def test_hit_rate_in_the_log_warns_and_applies_on_request(tmp_path, capsys):
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(FIX / "otel_llm_request.jsonl", folder / "spans.jsonl")
    (folder / "vllm.log").write_text(
        "x INFO vllm.entrypoints.utils: non-default args: {'model': 'meta-llama/Llama-2-7b-hf'}\n"
        "x INFO vllm.v1.metrics.loggers: Engine 000: Avg prompt throughput: 900.0 tokens/s, Avg generation "
        "throughput: 50.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 2.5%, Prefix cache hit rate: 30.0%\n"
        "x INFO vllm.v1.metrics.loggers: Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 1.0%\n")
    args = ["run", "import", folder / "spans.jsonl", "-o", tmp_path / "a", "--setting", "gpu=h100-80gb"]
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    assert "prefix-cache hit rate of 30.0%" in err and "--prefix-from-hit-rate" in err
    assert "prefix_hashes" not in read_trace(tmp_path / "a" / "trace.arrow").column_names
    code, _, err = run_main([*args[:4], tmp_path / "b", *args[5:], "--prefix-from-hit-rate"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "b" / "run.json").read_text())
    assert meta["prefix"]["measured_hit_rate"] == pytest.approx(0.30)
    # the fitted prefix's ideal share is the measured rate within a block per request
    assert meta["prefix"]["ideal_hit_share"] == pytest.approx(0.30, abs=16 * 6 / 10774)


def test_options_describe_sharing_no_file_records(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_main(["run", "import", FIX / "vllm_bench_serve.json", "-o", out, "--setting", "gpu=h100-80gb",
                             "--shared-prefix-tokens", 64, "--prefix-groups", 2], capsys)
    assert code == 0, err
    hashes = read_trace(out / "trace.arrow").column("prefix_hashes").to_pylist()
    # rows 0..3 are in groups 0, 1, 0, 1 (round robin over the requests sent); row 2 failed: no trace row
    assert [len(h) for h in hashes] == [4, 4, 4] and hashes[1] == hashes[2] != hashes[0]
    # trace import: the same options on a source without hashes
    src = tmp_path / "l.csv"
    src.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n200,5\n300,5\n")
    code, _, err = run_main(["trace", "import", src, "-o", tmp_path / "t.arrow", "--prompt-pool", 2], capsys)
    assert code == 0, err
    assert "format: lengths (detected" in err
    t = read_trace(tmp_path / "t.arrow")
    assert t.column("prefix_hashes").to_pylist()[0] == prefixes.spec_hashes([100], prefixes.PrefixSpec(0, 1, 2), 16)[0]


def test_guidellm_generator_args_and_prompt_text(tmp_path, capsys):
    doc = json.loads((FIX / "guidellm_report.json").read_text())
    doc["args"] = {"data": ["prompt_tokens=80,output_tokens=5,prefix_tokens=32,prefix_count=1"]}
    src = tmp_path / "report.json"
    src.write_text(json.dumps(doc))
    given = ["--setting", "model=llama-3.1-8b", "--setting", "gpu=h100-80gb"]
    code, out, err = run_main(["run", "import", src, "-o", tmp_path / "a", *given], capsys)
    assert code == 0, err  # two benchmarks: a sweep, one run each
    assert "benchmark_0: 3 requests (2 finished), prefix sharing: generator settings in report.json: a 32-token shared prefix in 1 group(s)" in out, out
    hashes = read_trace(tmp_path / "a" / "benchmark_0" / "trace.arrow").column("prefix_hashes").to_pylist()
    assert all(len(h) == 2 and h == hashes[0] for h in hashes)
    # prompt text wins over the generator's settings: equal leading text, equal leading blocks
    for i, req in enumerate(r for b in doc["benchmarks"] for s in ("successful", "errored", "incomplete")
                            for r in b["requests"].get(s) or []):
        req["prompt"] = "You are a helpful assistant. " * 40 + f"question {i} " * 30
    src.write_text(json.dumps(doc))
    code, out, err = run_main(["run", "import", src, "-o", tmp_path / "b", *given], capsys)
    assert code == 0, err
    assert "the prompts' text" in out
    hashes = read_trace(tmp_path / "b" / "benchmark_0" / "trace.arrow").column("prefix_hashes").to_pylist()
    assert len(hashes) == 2 and hashes[0][0] == hashes[1][0] and hashes[0][-1] != hashes[1][-1]


def test_hit_rate_from_a_metrics_scrape(tmp_path, capsys):
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(FIX / "vllm_bench_serve.json", folder / "res.json")
    (folder / "metrics.txt").write_text(
        "# HELP vllm:prefix_cache_queries Prefix cache queries\n# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 3000.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 800.0\n')
    run = tmp_path / "run"
    code, _, err = run_main(["run", "import", folder / "res.json", "-o", run, "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, err
    assert "prefix-cache hit rate of 30.0%" in err
    code, out, err = run_main(["validate", "--real", run], capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "measured 30.0% (metrics.txt)" in text and "shares no prefix" in text


def test_generator_settings_in_json_text():
    spec = prefixes.spec_from_generator('{"prompt_tokens": 256, "prefix_tokens": 1024, "prompt_pool": 100}', "x")
    assert (spec.prefix_tokens, spec.prefix_groups, spec.prompt_pool) == (1024, 1, 100)
