"""Compare a candidate runner with a reference one: per-step error on identical batches, and TTFT/TPOT.

Two measures, because they answer different questions. Step-time error prices every iteration
of the reference replay with both runners (same batch, so a pure cost-model error). TTFT/TPOT
percentile errors come from each runner's own full replay of the same trace slice, so they
include how a different step time changes batching and queueing downstream. All replays use the
reference's KV size, so memory does not differ between them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from servelab.common.atomic import atomic_path
from servelab.common.errors import ServelabError
from servelab.runners.base import Runner, StepPlan

PERCENTILES = (50, 99)


class PairedRunner:
    """Acts as ``reference`` for the engine; prices each plan with ``candidate`` too and keeps both.

    It promises no ``decode_affine`` line, so the engine prices every iteration through
    ``step_time`` instead of advancing a decode stretch in closed form (which only the reference
    would have priced): both runners price every iteration of the reference replay.
    """

    def __init__(self, reference: Runner, candidate: Runner):
        self._reference = reference
        self._candidate = candidate
        self.reference_s: list[float] = []
        self.candidate_s: list[float] = []

    def step_time(self, plan: StepPlan) -> float:
        ref = self._reference.step_time(plan)
        self.reference_s.append(ref)
        self.candidate_s.append(self._candidate.step_time(plan))
        return ref

    def decode_affine(self, num_seqs: int) -> None:
        return None

    def __getattr__(self, name: str):
        # name, describe, kv_capacity_tokens, needs_block_tables, make_allocator, ...
        return getattr(self._reference, name)


def slice_trace(trace: pa.Table, limit: int | None = None, duration_s: float | None = None) -> pa.Table:
    """The first ``limit`` requests and/or those arriving within ``duration_s`` of the first."""
    if duration_s is not None:
        if duration_s <= 0:
            raise ServelabError(f"validate: duration must be > 0 s, got {duration_s}")
        arrival = trace.column("arrival_s")
        start = pc.min(arrival).as_py() if trace.num_rows else 0.0
        trace = trace.filter(pc.less(arrival, start + duration_s))
    if limit is not None:
        if limit < 1:
            raise ServelabError(f"validate: limit must be >= 1, got {limit}")
        trace = trace.slice(0, limit)
    if trace.num_rows == 0:
        raise ServelabError("validate: the trace slice is empty")
    return trace


def latency_percentiles(requests: pa.Table) -> dict[str, float | None]:
    """TTFT and TPOT p50/p99 over finished requests, as vLLM ``bench serve`` reports them.

    TPOT leaves out one-token outputs (they have no inter-token time), like vLLM does.
    """
    finished = requests.filter(pc.equal(requests.column("status"), "finished"))
    ttft = finished.column("ttft_s").to_numpy(zero_copy_only=False)
    multi = finished.filter(pc.greater(finished.column("output_tokens"), 1))
    tpot = multi.column("tpot_s").to_numpy(zero_copy_only=False)
    out: dict[str, float | None] = {}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for p in PERCENTILES:
            out[f"{name}_p{p}_s"] = float(np.percentile(values, p)) if len(values) else None
    return out


def _rel_error_pct(candidate: float | None, reference: float | None) -> float | None:
    if candidate is None or reference is None or reference == 0:
        return None
    return (candidate / reference - 1.0) * 100


def validate(trace: pa.Table, config, reference: Runner, candidate: Runner, *,
             reference_spec: str = "", candidate_spec: str = "") -> dict:
    """Replay ``trace`` with each runner under ``config`` and report how far the candidate is."""
    from servelab.assembly import replay, resolve_num_gpu_blocks

    blocks = resolve_num_gpu_blocks(config, reference)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_gpu_blocks=blocks))
    paired = PairedRunner(reference, candidate)
    # step times: the reference's batches one iteration at a time; latencies: each runner's own replay
    # (decode stretches in closed form, as `servelab replay` runs it), so a runner against itself is 0% off
    paired_steps = replay(trace, config, runner=paired).steps
    ref_result = replay(trace, config, runner=reference)
    cand_result = replay(trace, config, runner=candidate)
    ref_s, cand_s = np.asarray(paired.reference_s), np.asarray(paired.candidate_s)
    if len(ref_s) == 0:
        raise ServelabError("validate: the reference replay ran no steps")
    signed = (cand_s / ref_s - 1.0) * 100
    ape = np.abs(signed)
    iterations = int(pc.sum(paired_steps.column("num_iterations")).as_py() or 0)
    if len(ref_s) != iterations:  # every iteration is a step_time call (PairedRunner has no decode_affine)
        raise ServelabError(f"validate: priced {len(ref_s)} steps of a replay of {iterations} iterations")
    step = {
        "steps_priced": int(len(ref_s)),
        "iterations": iterations,
        "mape_pct": float(ape.mean()),
        "median_ape_pct": float(np.median(ape)),
        "p90_ape_pct": float(np.percentile(ape, 90)),
        "p99_ape_pct": float(np.percentile(ape, 99)),
        "mean_signed_pct": float(signed.mean()),
        "reference_total_s": float(ref_s.sum()),
        "candidate_total_s": float(cand_s.sum()),
    }
    ref_lat, cand_lat = latency_percentiles(ref_result.requests), latency_percentiles(cand_result.requests)
    metrics = [
        {"metric": k, "reference": ref_lat[k], "candidate": cand_lat[k], "error_pct": _rel_error_pct(cand_lat[k], ref_lat[k])}
        for k in ref_lat
    ]

    def finished(result) -> int:
        return int(pc.sum(pc.equal(result.requests.column("status"), "finished")).as_py() or 0)

    return {
        "reference": {"spec": reference_spec or reference.name, "runner": reference.describe()},
        "candidate": {"spec": candidate_spec or candidate.name, "runner": candidate.describe()},
        "requests": trace.num_rows,
        "num_gpu_blocks": blocks,
        "policy": config.policy,
        "finished": {"reference": finished(ref_result), "candidate": finished(cand_result)},
        "makespan_s": {
            "reference": ref_result.meta.get("simulated_span_s"),
            "candidate": cand_result.meta.get("simulated_span_s"),
        },
        "step_time": step,
        "latency": metrics,
    }


def write_report(report: dict, output: str | Path) -> None:
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
