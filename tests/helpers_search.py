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


# -- a search process and its pool workers, for the kill tests (Linux: they read /proc) --------------


def pool_workers(pid: int) -> list[int]:
    """The children of ``pid`` (a `servelab search` process: its pool workers, forked or spawned)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def running(pid: int) -> bool:
    """Is ``pid`` alive and not a zombie?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_slow_search(tmp_path: Path, name: str):
    """``servelab search`` with 2 workers over a 6,000-request trace (400 trials of a good fraction of a
    second each: a kill lands mid-trial), in its own session, its output in ``tmp_path/search.log`` (a
    file: workers that outlive it would block on a full pipe nobody reads). Returns (process, study
    directory, log path) once its first trial has finished; the caller kills what is left."""
    import subprocess
    import sys
    import time

    folder = tmp_path / "slow"
    folder.mkdir()
    write_trace_file(folder, n=6000)
    spec = grid_spec(folder, n_trials=400, name=name, top="workers = 2\n")
    out, log = tmp_path / "S", tmp_path / "search.log"
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "servelab", "search", str(spec), "-o", str(out), "--no-progress"],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        trials = out / "trials"
        if trials.is_dir() and any(not p.name.startswith(".") for p in trials.iterdir()):
            return proc, out, log
        if proc.poll() is not None:
            raise AssertionError(log.read_text())
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no trial finished")
