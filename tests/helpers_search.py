"""Factories for search tests: a tiny synthetic trace on the linear runner whose best settings are interior."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from servelab.traces.io import write_trace
from servelab.traces.synth import synth_trace

RUNNER = "linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002"
SEQS = [1, 2, 4, 8, 16, 32, 64]
TOKENS = [128, 256, 512, 1024, 2048]
POLICIES = ["sarathi", "vllm-v0"]
SLO = {"ttft_s": 0.3, "tpot_s": 0.01}

# At 20 req/s with these SLOs attainment peaks inside the grid (max_num_seqs 8, budget 512: 0.96);
# small batches queue (TTFT), big ones slow every decode (TPOT).
BASE_SPEC = f"""
trace = "trace.arrow"
n_trials = {{n_trials}}
seed = 0
runner = "{RUNNER}"
[replay]
num_gpu_blocks = 4000
[slo]
ttft_s = {SLO['ttft_s']}
tpot_s = {SLO['tpot_s']}
"""

GRID_SPACE = f"""
[space]
max_num_seqs = {SEQS}
max_num_batched_tokens = {TOKENS}
policy = {POLICIES!r}
""".replace("'", '"')


def write_trace_file(folder: Path, n: int = 200, rate: float = 20.0, name: str = "trace.arrow") -> Path:
    table = synth_trace(n=n, rate=rate, prompt="uniform:64:1024", output="uniform:8:64", seed=1)
    return write_trace(table, Path(folder) / name, "synth")


def write_spec(folder: Path, text: str, name: str = "spec.toml") -> Path:
    path = Path(folder) / name
    path.write_text(text)
    return path


def grid_spec(folder: Path, n_trials: int = 50, top: str = "", tables: str = "", space: str = GRID_SPACE,
              trace_n: int = 200, name: str = "spec.toml") -> Path:  # fmt: skip
    """A trace plus a spec over the exhaustive test grid (or ``space``); ``top`` holds extra top-level keys."""
    if not (Path(folder) / "trace.arrow").exists():
        write_trace_file(folder, n=trace_n)
    return write_spec(folder, top + BASE_SPEC.format(n_trials=n_trials) + tables + space, name=name)


def trials_table(study_dir: Path) -> list[dict]:
    """A study folder's trials.parquet as rows."""
    return pq.read_table(Path(study_dir) / "trials.parquet").to_pylist()
