"""Per-request engine timestamps as JSON lines (vLLM ``RequestStateStats`` per finished request).

Each line: ``input_toks``, ``output_toks``, ``queued_ts``, ``scheduled_ts``, ``first_token_ts``,
``last_token_ts`` (seconds on the engine core's monotonic clock), optionally ``request_id`` and
``arrival_time`` (the frontend's wall clock: another clock, so it is kept only to order requests
that share a queued time). The arrival used is ``queued_ts``, when the engine received the
request; tokenisation and IPC before it are not what the simulator models. A ``meta.json`` beside
the file (``engine_kwargs``: max_num_seqs, max_num_batched_tokens, tensor_parallel_size, model,
block_size, gpu_memory_utilization, enable_prefix_caching; ``num_gpu_blocks``) gives the settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.base import IMPORTERS, Measured, Rows, read_json

REQUIRED = ("input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts")


@IMPORTERS.register("timestamps-jsonl")
def import_timestamps(paths: list[Path]) -> Measured:
    rows = Rows(paths[0])
    for path in paths:
        rows.path = path
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(path, f"not valid JSON ({err.msg})", row=lineno) from None
            if not isinstance(rec, dict):
                raise InputError(path, "each line must be a JSON object", row=lineno)
            for key in REQUIRED:
                if not isinstance(rec.get(key), (int, float)):
                    raise InputError(path, "missing or not a number", column=key, row=lineno)
            scheduled = rec.get("scheduled_ts")
            rows.add(lineno, rec.get("request_id", lineno), float(rec["queued_ts"]), int(rec["input_toks"]),
                     int(rec["output_toks"]), first_token_s=float(rec["first_token_ts"]),
                     finish_s=float(rec["last_token_ts"]),
                     first_scheduled_s=None if scheduled is None else float(scheduled))
    settings, source, notes = _meta(paths[0].parent / "meta.json")
    return Measured(rows, clock="server", settings=settings, source=source, notes=notes)


def _meta(path: Path) -> tuple[dict, dict, tuple[str, ...]]:
    if not path.is_file():
        return {}, {}, ("no meta.json beside the file: engine settings unknown",)
    meta = read_json(path)
    kw = meta.get("engine_kwargs") or {}
    settings = {
        "model": kw.get("model") or meta.get("model"),
        "tp": kw.get("tensor_parallel_size"),
        "max_num_seqs": kw.get("max_num_seqs"),
        "max_num_batched_tokens": kw.get("max_num_batched_tokens"),
        "block_size": kw.get("block_size"),
        "gpu_memory_utilization": kw.get("gpu_memory_utilization"),
        "enable_prefix_caching": kw.get("enable_prefix_caching"),
        "num_gpu_blocks": meta.get("num_gpu_blocks"),
        # parallelism beyond TP and quantisation, where not vLLM's default (1, 1, false, none, auto):
        # docs/runners.md "Parallelism" and "Quantisation"
        **{k: kw[k] for k in ("data_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                              "quantization", "kv_cache_dtype")
           if str(kw.get(k)).lower() not in ("none", "1", "false", "auto")},
    }
    source = {k: meta[k] for k in ("vllm_version", "started_at", "finished_at", "dataset_path") if k in meta}
    source["meta_json"] = str(path)
    return settings, source, ()
