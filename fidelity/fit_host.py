"""Fit a host profile's launch-latency scale and per-step CPU overhead to measured runs by replaying them.

    python -m servelab.fidelity.fit_host RUN_DIR [RUN_DIR ...] --profile vllm-v1-cudagraph

For every (launch_scale, cpu_base_s) on a grid the runs are replayed with the profile so changed,
and the objective is the mean of |error| of mean TTFT and mean TPOT over the fitting half of each
run's requests (even request ids); the other half (odd ids) is reported as held out. Nothing is
written: the chosen values go into roofline_calibration.json by hand, with this command's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from servelab.fidelity.validate import compare, config_for, load_measured


def _half(table, parity: int):
    return table.filter(pc.equal(pc.bit_wise_and(table.column("request_id"), 1), parity))


def score(run_dirs: list[Path], profile: str, launch_scale: float, cpu_base_s: float, compute_scale: float,
          overrides: dict) -> dict:
    from servelab.api import replay
    from servelab.runners import roofline

    base = roofline.load_host_profile(profile)
    prof = dataclasses.replace(base, launch_scale=launch_scale, cpu_base_s=cpu_base_s, compute_scale=compute_scale)
    out = {"fit": [], "held_out": []}
    for run_dir in run_dirs:
        meta, measured, trace = load_measured(run_dir)
        config = config_for(meta, dict(overrides, runner=f"roofline:host={profile}"))
        from servelab.api import build_runner, resolve_num_gpu_blocks

        runner = build_runner(config)
        runner = dataclasses.replace(runner, host_profile=prof, calibration=roofline.apply_host_profile(
            roofline.load_calibration(runner.gpu.calibration), prof))
        blocks = resolve_num_gpu_blocks(config, runner)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_gpu_blocks=blocks))
        sim = replay(trace, config, runner=runner).requests
        for key, parity in (("fit", 0), ("held_out", 1)):
            rep = compare(_half(measured, parity), _half(sim, parity))
            rows = {(r["metric"], r["stat"]): r["error_pct"] for r in rep["latency"]}
            out[key].append({"run": run_dir.name, "ttft_mean": rows[("ttft", "mean")],
                             "tpot_mean": rows[("tpot", "mean")], "e2e_mean": rows[("e2e", "mean")]})
    out["objective"] = float(np.mean([abs(r["ttft_mean"]) + abs(r["tpot_mean"]) for r in out["fit"]]) / 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--profile", default="vllm-v1-cudagraph")
    ap.add_argument("--launch-scales", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.8,1.0")
    ap.add_argument("--cpu-base-ms", default="0,0.1,0.2,0.3,0.5,0.75,1.0")
    ap.add_argument("--compute-scales", default="1.0,1.05,1.1,1.15,1.2,1.25")
    args = ap.parse_args(argv)
    grid = itertools.product([float(v) for v in args.launch_scales.split(",")],
                             [float(v) / 1000 for v in args.cpu_base_ms.split(",")],
                             [float(v) for v in args.compute_scales.split(",")])
    results = [(ls, cb, cs, score(args.runs, args.profile, ls, cb, cs, {})) for ls, cb, cs in grid]
    results.sort(key=lambda r: r[3]["objective"])
    for ls, cb, cs, res in results[:3]:
        print(f"launch_scale {ls:.2f} cpu_base {cb * 1000:.2f} ms compute_scale {cs:.2f}: "
              f"objective {res['objective']:.2f}%")
        for key in ("fit", "held_out"):
            for r in res[key]:
                print(f"  {key:8} {r['run']}: TTFT {r['ttft_mean']:+.1f}%  TPOT {r['tpot_mean']:+.1f}%  "
                      f"E2E {r['e2e_mean']:+.1f}%")


if __name__ == "__main__":
    main()
