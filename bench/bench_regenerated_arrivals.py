"""How far regenerated arrivals move a real run's mean errors (issue #25: paced results without send times).

A paced benchmark result that recorded no send times (vLLM bench before late 2025, SGLang bench_serving)
is replayed with arrivals drawn from the client's process (fidelity/vllm_bench.py ``_paced_sends``).
This measures what that costs on the bundled server-side runs that did record their arrivals (each sent
by a Poisson client): the run is imported as usual, validated, then its trace's arrivals are replaced by
Poisson draws (seeds 0..N-1) stretched over the recorded span, and validated again. Mean TTFT / TPOT / E2E
errors, recorded vs drawn arrivals.

    .venv/bin/python bench/bench_regenerated_arrivals.py [--seeds 5] [--out /tmp/regen]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

HERE = Path(__file__).resolve().parent
RUNS = {"llmservingsim-rtxpro6000-llama31-8b": ["gpu=rtx-pro-6000"],
        "llmservingsim-rtx4090-llama31-8b-examples": ["model=meta-llama/Llama-3.1-8B", "gpu=rtx-4090"],
        "llmservingsim-rtxpro6000-qwen3-32b": ["gpu=rtx-pro-6000"]}
KEYS = (("ttft", "mean"), ("tpot", "mean"), ("e2e", "mean"))


def servelab(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "servelab", *args], capture_output=True, text=True,
                          check=True).stdout


def mean_errors(run: Path) -> list[float]:
    report = json.loads(servelab("validate", "--real", str(run), "--format", "json"))
    errors = {(r["metric"], r["stat"]): r["error_pct"] for r in report["latency"]}
    return [errors[k] for k in KEYS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp/regen"))
    args = ap.parse_args()
    print("run | arrivals | mean error TTFT / TPOT / E2E (%)")
    for name, settings in RUNS.items():
        run = args.out / name
        servelab("run", "import", str(HERE / "real_runs" / name / "requests.jsonl"), "-o", str(run), "--force",
                 *[a for s in settings for a in ("--setting", s)])
        print(f"{name} | recorded | " + " / ".join(f"{e:+.1f}" for e in mean_errors(run)))
        path = next(run.glob("trace*.arrow"))
        with ipc.open_file(path) as f:
            trace = f.read_all()
        arrival = np.asarray(trace.column("arrival_s").to_numpy(), dtype=float)
        for seed in range(args.seeds):
            gaps = np.random.default_rng(seed).exponential(1.0, len(arrival) - 1)
            drawn = arrival[0] + np.concatenate([[0.0], np.cumsum(gaps)]) * (arrival[-1] - arrival[0]) / gaps.sum()
            copy = args.out / f"{name}-seed{seed}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(run, copy)
            table = trace.set_column(trace.schema.get_field_index("arrival_s"), "arrival_s", pa.array(drawn))
            with ipc.new_file(copy / path.name, table.schema) as w:
                w.write_table(table)
            print(f"{name} | Poisson, seed {seed} | " + " / ".join(f"{e:+.1f}" for e in mean_errors(copy)))


if __name__ == "__main__":
    main()
