"""The per-step check of bench/RESULTS_fidelity.md: real vLLM step times of Llama-2-70B TP4 on
H100 against the roofline (all-reduce by vLLM's kernels, and NCCL ring only) and against a
``fitted`` model learned from the same log with held-out steps.

    python bench/bench_step_log.py [--shared ../shared]

Reads ``shared/calibration/real_vllm/vllm-v1-h100-steps/steps.parquet`` through
``servelab.fidelity.step_log`` (step time = start of step id + 1 minus start of step id), fits
with ``servelab fit --steps`` (printed) and prints the error of each model on the held-out steps
(the fit's seeded 20% split) and, for the roofline, which is not fitted on them, on all steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def errors(pred: np.ndarray, y: np.ndarray) -> str:
    ape = np.abs(pred / y - 1) * 100
    signed = (pred / y - 1) * 100
    return (f"MAPE {ape.mean():5.1f}%  median APE {np.median(ape):5.1f}%  p90 APE {np.quantile(ape, 0.9):5.1f}%  "
            f"mean signed {signed.mean():+5.1f}%  (n={len(y)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default="../shared", type=Path)
    args = ap.parse_args()
    from servelab.fidelity.step_log import read_step_log
    from servelab.runners.base import StepPlan, StepShape, make_runner
    from servelab.runners.fitted import feature_matrix, load_model, median_per_shape

    log = args.shared / "calibration/real_vllm/vllm-v1-h100-steps/steps.parquet"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps_model.json"
        cmd = [sys.executable, "-m", "servelab", "fit", "--steps", str(log), "-o", str(out), "--buckets", "none",
               "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "4"]
        print("$", " ".join(["servelab", *cmd[3:]]))
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        model = load_model(out)
        print("coefficients:", json.dumps(model.to_json()["coefficients_s"][0]))
    table, _ = read_step_log(log)
    shapes = median_per_shape(table)  # as fit_model splits: one row per distinct shape, same seed
    x, y = feature_matrix(shapes), shapes.column("step_s").to_numpy()
    order = np.random.default_rng(0).permutation(len(y))
    test = order[: round(len(y) * 0.2)]
    fields = ("prefill_tokens", "prefill_seqs", "prefill_context_tokens", "prefill_attention_pairs", "decode_seqs",
              "decode_context_tokens")
    print(f"{table.num_rows} steps with a logged successor, {len(y)} distinct shapes; median step "
          f"{np.median(table.column('step_s').to_numpy()) * 1000:.2f} ms")
    print(f"{'fitted (held-out shapes)':42} {errors(model.predict(x[test]), y[test])}")
    for spec in ("roofline:model=llama-2-70b,gpu=h100-80gb,tp=4",
                 "roofline:model=llama-2-70b,gpu=h100-80gb,tp=4,all_reduce=nccl",
                 "roofline:model=llama-2-70b,gpu=h100-80gb,tp=4,host=vidur-2023"):
        r = make_runner(spec, max_num_batched_tokens=2048, max_num_seqs=128)
        pred = np.array([r.step_time(StepPlan(StepShape(**{f: int(v) for f, v in zip(fields, row)}))) for row in x])
        print(f"{spec.removeprefix('roofline:model=llama-2-70b,gpu=h100-80gb,'):42} held-out {errors(pred[test], y[test])}")
        print(f"{'':42} all      {errors(pred, y)}")


if __name__ == "__main__":
    main()
