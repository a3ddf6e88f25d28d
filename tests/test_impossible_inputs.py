"""Inputs no real deployment could have are refused with one line (or, for one request, rejected), never priced.

Issue #26 item 16: nanosecond-epoch arrivals made every latency 0, KV beyond GPU memory ran, huge
replica counts and synthetic durations ended in MemoryError tracebacks, an over-long prompt was served.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from helpers_search import write_spec
from servelab.api import replay
from servelab.common.errors import InputError, ServelabError
from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.traces.io import read_trace, write_trace
from servelab.traces.synth import synth_trace
from helpers_cli import cli_code


_cli = cli_code


def test_nanosecond_epoch_arrivals_are_refused_with_row_and_reason(tmp_path):
    trace = synth_trace(n=20, rate=5.0, seed=0)
    ns = pc.add(pc.multiply(trace.column("arrival_s"), 1e9), 1.7e18)
    pq.write_table(trace.set_column(trace.column_names.index("arrival_s"), "arrival_s", ns), tmp_path / "ns.parquet")
    with pytest.raises(InputError) as err:
        read_trace(tmp_path / "ns.parquet")
    text = str(err.value)
    assert "column 'arrival_s', row 1" in text and "1.7e+18" in text and "256 s" in text, text
    # Unix-epoch seconds keep microseconds: still accepted (and replayed with real latencies)
    epoch = pc.add(trace.column("arrival_s"), 1.7e9)
    pq.write_table(trace.set_column(trace.column_names.index("arrival_s"), "arrival_s", epoch), tmp_path / "s.parquet")
    result = replay(read_trace(tmp_path / "s.parquet"), ReplayConfig(engine=EngineConfig(num_gpu_blocks=1000)))
    ttft = pc.subtract(result.requests.column("first_token_s"), result.requests.column("arrival_s"))
    assert pc.min(ttft).as_py() > 0


def test_kv_beyond_gpu_memory_is_refused():
    trace = synth_trace(n=5, rate=5.0, seed=0)
    with pytest.raises(ServelabError, match=r"num_gpu_blocks = 1,000,000 does not fit: llama-3.1-8b on 1 x "
                                            r"h100-80gb .* holds at most 32,617 blocks"):
        replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=1_000_000)))
    with pytest.raises(ServelabError, match=r"num_gpu_blocks = 99,999,999,999 is too large"):  # the figure
        replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=99_999_999_999)))
    replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=20_000)))  # within memory: runs as before


def test_a_search_marks_kv_beyond_gpu_memory_infeasible(tmp_path):
    write_trace(synth_trace(n=30, rate=5.0, prompt="uniform:64:512", output="uniform:8:32", seed=1),
                tmp_path / "trace.arrow", "synth")  # fmt: skip
    spec = write_spec(tmp_path, 'trace = "trace.arrow"\nn_trials = 2\nsampler = "grid"\n'
                                "[space]\nnum_gpu_blocks = [2000, 1000000]\n")  # fmt: skip
    assert _cli("search", spec, "-o", tmp_path / "S", "--no-progress") == 0
    rows = {r["param.num_gpu_blocks"]: r for r in pq.read_table(tmp_path / "S" / "trials.parquet").to_pylist()}
    assert rows[1000000]["outcome"] == "infeasible" and "does not fit" in rows[1000000]["reason"]
    assert rows[2000]["outcome"] == "ok"


@pytest.mark.parametrize("args, says", [
    (["replay", "{trace}", "--replicas", "100000000", "-o", "{tmp}/r"], "replicas = 100,000,000 is more than"),
    (["trace", "synth", "-o", "{tmp}/t.arrow", "--duration-s", "1e12"], "about 1e+12 requests, more than one trace"),
    (["trace", "synth", "-o", "{tmp}/t.arrow", "-n", "10000000000"], "n = 10,000,000,000 requests is more than"),
])  # fmt: skip
def test_sizes_beyond_memory_are_one_line(tmp_path, capsys, args, says):
    trace = write_trace(synth_trace(n=5, rate=5.0, seed=0), tmp_path / "small.arrow", "synth")
    assert _cli(*[a.format(trace=trace, tmp=tmp_path) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "t.arrow").exists()


def test_a_prompt_beyond_the_models_context_is_rejected_not_served():
    """vLLM answers 400 to prompt + max_tokens > max_model_len: that request ends rejected, the run goes on."""
    short = synth_trace(n=3, rate=1.0, prompt="1000", output="16", seed=0)
    table = pa.concat_tables([short, synth_trace(n=1, rate=1.0, prompt="200000", output="16", seed=0)])
    table = table.set_column(0, "request_id", pa.array(range(4), pa.int64()))
    table = table.set_column(1, "arrival_s", pa.array([0.0, 1.0, 2.0, 3.0]))
    result = replay(table, ReplayConfig())  # llama-3.1-8b: 131,072 tokens of context
    rows = result.requests.to_pylist()
    assert [r["status"] for r in rows] == ["finished"] * 3 + ["rejected"]
    assert rows[3]["reason"] == "prompt 200000 + max output 16 tokens exceed max_model_len 131072 (vLLM answers 400)"
    longer = replay(table, ReplayConfig(engine=EngineConfig(max_model_len=250_000)))  # vLLM's --max-model-len
    assert [r["status"] for r in longer.requests.to_pylist()] == ["finished"] * 4
