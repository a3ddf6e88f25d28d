"""Hand-made run directories for the scoring tests: requests/steps tables with the engine's columns."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA


def req(request_id, status="finished", arrival=0.0, first_token=None, finish=None, output=1, prompt=10,
        tenant="t0", tier="standard", first_scheduled=None, max_itl=None, ttft_slo=None, tpot_slo=None,
        replica=0, preemptions=0, generated=None, **extra):
    """One request row; derived columns follow the schema's definitions where the times exist."""
    if first_scheduled is None and first_token is not None:
        first_scheduled = arrival
    finished = status == "finished"
    row = {
        "request_id": request_id, "tenant": tenant, "tier": tier, "session_id": None, "replica": replica,
        "status": status, "reason": None if status in ("finished", "unfinished") else "test",
        "arrival_s": arrival, "first_scheduled_s": first_scheduled, "first_token_s": first_token,
        "finish_s": finish if finished else None, "prompt_tokens": prompt, "output_tokens": output,
        "generated_tokens": generated if generated is not None else (output if finished else (1 if first_token is not None else 0)),
        "num_preemptions": preemptions,
        "ttft_s": None if first_token is None else first_token - arrival,
        "tpot_s": None if not finished else ((finish - first_token) / (output - 1) if output > 1 else 0.0),
        "e2e_s": None if not finished else finish - arrival,
        "max_itl_s": max_itl, "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
    }
    row.update(extra)
    return row


def step(start, duration, batch=1, kv_used=0, kv_total=100, waiting=0, replica=0, iterations=1,
         prefill_tokens=0, prefill_requests=0, decode_requests=None, preemptions=0):
    return {
        "replica": replica, "start_s": start, "duration_s": duration, "num_iterations": iterations,
        "prefill_tokens": prefill_tokens, "prefill_requests": prefill_requests,
        "decode_requests": batch - prefill_requests if decode_requests is None else decode_requests,
        "batch_requests": batch, "kv_blocks_used": kv_used, "kv_blocks_total": kv_total, "waiting": waiting,
        "preemptions": preemptions,
    }


def write_run(run_dir, requests, steps=(), meta=None, drop_columns=(), schema=REQUESTS_SCHEMA):
    """Write requests.parquet, steps.parquet and run.json the way the engine lays them out."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fields = [f for f in schema if f.name not in drop_columns]
    extra = sorted({k for r in requests for k in r} - {f.name for f in schema})
    for name in extra:
        sample = next(r[name] for r in requests if name in r)
        fields.append(pa.field(name, pa.float64() if isinstance(sample, float) else pa.int32()))
    sch = pa.schema(fields)
    table = pa.table({f.name: [r.get(f.name) for r in requests] for f in sch}, schema=sch)
    pq.write_table(table, run_dir / "requests.parquet")
    pq.write_table(pa.Table.from_pylist(list(steps), schema=STEPS_SCHEMA), run_dir / "steps.parquet")
    base = {
        "servelab_version": "0.1.0", "run_id": run_dir.name,
        "trace": {"path": "t.parquet", "name": "t", "sha256": "0" * 64, "rows": len(requests)},
        "policy": {"name": "fcfs", "params": {}},
        "engine": {"block_size": 16, "num_gpu_blocks": 100, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                   "preemption": "recompute", "replicas": 1, "router": "round-robin"},
        "runner": {"name": "linear", "params": {"base": 0.01}},
        "seed": 0, "simulated_span_s": None, "wall_time_s": 0.0,
        "counts": {"finished": sum(r["status"] == "finished" for r in requests),
                   "unfinished": sum(r["status"] == "unfinished" for r in requests),
                   "rejected": sum(r["status"] == "rejected" for r in requests)},
    }
    if meta:
        for k, v in meta.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                base[k] = {**base[k], **v}
            else:
                base[k] = v
    (run_dir / "run.json").write_text(json.dumps(base, indent=2))
    return run_dir
