"""Fit a host profile (launch-latency scale, per-step CPU overhead, GEMM compute scale), or a GPU's
efficiency scales over a profiled GPU's, to measured runs by replaying them.

    python -m servelab.fidelity.fit_host RUN_DIR [RUN_DIR ...] --profile vllm-v1-cudagraph
    python -m servelab.fidelity.fit_host RUN_DIR --gpu-from a40 --memory-scales 1.1,1.2 --compute-scales 1,1.2

For every point of the grid the runs are replayed with the profile (or GPU) so changed,
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


def scaled_calibration(base: str, memory_scale: float, compute_scale: float):
    """A profiled GPU's calibration with its efficiencies scaled (capped at 1), as real_calibration.json's
    ``derived_gpus`` are built."""
    from servelab.runners.roofline import OpCalibration, load_calibration

    cal = load_calibration(base)

    def scaled(op):
        return OpCalibration(min(1.0, op.eff_compute * compute_scale) if op.eff_compute < 1.0 else 1.0,
                             min(1.0, op.eff_memory * memory_scale), op.latency_s)

    return dataclasses.replace(cal, ops={n: scaled(op) for n, op in cal.ops.items()},
                               prefill_attention=scaled(cal.prefill_attention),
                               decode_attention_eff_memory=min(1.0, cal.decode_attention_eff_memory * memory_scale))


def score(run_dirs: list[Path], profile: str, launch_scale: float, cpu_base_s: float, compute_scale: float,
          overrides: dict, gpu_from: str | None = None, memory_scale: float = 1.0, gpu_compute_scale: float = 1.0,
          metrics: tuple[str, ...] = ("ttft", "tpot")) -> dict:
    from servelab.assembly import replay
    from servelab.runners import roofline

    base = roofline.load_host_profile(profile)
    prof = dataclasses.replace(base, launch_scale=launch_scale, cpu_base_s=cpu_base_s, compute_scale=compute_scale)
    out = {"fit": [], "held_out": []}
    for run_dir in run_dirs:
        meta, measured, trace = load_measured(run_dir)
        config = config_for(meta, dict(overrides, runner=f"roofline:host={profile}"))
        from servelab.assembly import build_runner, resolve_num_gpu_blocks

        runner = build_runner(config)
        base = (scaled_calibration(gpu_from, memory_scale, gpu_compute_scale) if gpu_from
                else roofline.load_calibration(runner.gpu.calibration))
        runner = dataclasses.replace(runner, host_profile=prof, calibration=roofline.apply_host_profile(base, prof))
        blocks = resolve_num_gpu_blocks(config, runner)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_gpu_blocks=blocks))
        sim = replay(trace, config, runner=runner).requests
        for key, parity in (("fit", 0), ("held_out", 1)):
            rep = compare(_half(measured, parity), _half(sim, parity))
            rows = {(r["metric"], r["stat"]): r["error_pct"] for r in rep["latency"]}
            out[key].append({"run": run_dir.name, "ttft_mean": rows[("ttft", "mean")],
                             "tpot_mean": rows[("tpot", "mean")], "e2e_mean": rows[("e2e", "mean")]})
    out["objective"] = float(np.mean([sum(abs(r[f"{m}_mean"]) for m in metrics) / len(metrics) for r in out["fit"]]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--profile", default="vllm-v1-cudagraph")
    ap.add_argument("--launch-scales", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.8,1.0")
    ap.add_argument("--cpu-base-ms", default="0,0.1,0.2,0.3,0.5,0.75,1.0")
    ap.add_argument("--compute-scales", default="1.0,1.05,1.1,1.15,1.2,1.25")
    ap.add_argument("--gpu-from", help="fit a GPU instead: this profiled GPU's efficiencies x (memory, compute) "
                                       "scales, under the profile as packaged")
    ap.add_argument("--memory-scales", default="1.0,1.1,1.2,1.25,1.3")
    args = ap.parse_args(argv)
    if args.gpu_from:
        _fit_gpu(args)
        return
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


def _fit_gpu(args) -> None:
    from servelab.runners import roofline

    p = roofline.load_host_profile(args.profile)
    grid = itertools.product([float(v) for v in args.memory_scales.split(",")],
                             [float(v) for v in args.compute_scales.split(",")])
    results = [(ms, cs, score(args.runs, args.profile, p.launch_scale, p.cpu_base_s, p.compute_scale, {},
                              gpu_from=args.gpu_from, memory_scale=ms, gpu_compute_scale=cs,
                              metrics=("ttft", "tpot", "e2e")))
               for ms, cs in grid]
    results.sort(key=lambda r: r[2]["objective"])
    for ms, cs, res in results[:3]:
        print(f"{args.gpu_from} x memory {ms:.2f} x compute {cs:.2f}: objective {res['objective']:.2f}%")
        for key in ("fit", "held_out"):
            for r in res[key]:
                print(f"  {key:8} {r['run']}: TTFT {r['ttft_mean']:+.1f}%  TPOT {r['tpot_mean']:+.1f}%  "
                      f"E2E {r['e2e_mean']:+.1f}%")


if __name__ == "__main__":
    main()
