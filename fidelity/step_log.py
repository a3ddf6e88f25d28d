"""Per-step logs of a real engine: read them as (batch counts, step time) rows and fit a cost model.

Two layouts are read (docs/fidelity.md, "Fitting on per-step logs"):

- **servelab step log** (Parquet or CSV, one row per engine step): ``step_s`` (the step's wall
  time, start to the next step's start), ``prefill_tokens``, ``prefill_seqs``, ``decode_seqs``,
  ``decode_context_tokens``; optionally ``prefill_context_tokens`` and ``prefill_attention_pairs``
  (0 when absent), with the meanings of StepShape (replay/core/protocols.py).
- **vLLM step trace** (Parquet; the layout of inference-sim's ``enriched_steps.parquet``, detected
  by its ``step.ts_start_ns`` column): ``step.id``, ``step.ts_start_ns``, ``batch.prefill_tokens``,
  ``batch.num_prefill_reqs``, ``batch.num_decode_reqs``, ``kv.usage_gpu_ratio``,
  ``kv.blocks_total_gpu``, optionally ``experiment_id`` (steps are paired within one). A step's
  time is the next step's start minus its own, kept only where the next step id (id + 1) was
  logged; its decode context is the KV blocks in use x ``block_size`` (an upper bound on the
  tokens the decodes read: it counts prefills' blocks and partly filled blocks too). Its
  ``step.duration_us`` (the engine-side span) and ``cycle_time_us`` (a derived estimate) are not
  used: see bench/RESULTS_fidelity.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from servelab.common.atomic import atomic_path
from servelab.common.errors import InputError, require_file
from servelab.runners.profiling import FEATURES

REQUIRED = ("step_s", "prefill_tokens", "prefill_seqs", "decode_seqs", "decode_context_tokens")
OPTIONAL = ("prefill_context_tokens", "prefill_attention_pairs")
VLLM_TRACE_COLUMNS = ("step.id", "step.ts_start_ns", "batch.prefill_tokens", "batch.num_prefill_reqs",
                      "batch.num_decode_reqs", "kv.usage_gpu_ratio", "kv.blocks_total_gpu")


def _read_table(path: Path) -> pa.Table:
    require_file(path, "step log")
    try:
        if path.suffix.lower() in (".csv", ".tsv"):
            return pacsv.read_csv(path)
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise InputError(path, f"not a readable {'CSV' if path.suffix.lower() == '.csv' else 'Parquet'} file "
                               f"({str(err).splitlines()[0]})") from None


def _numbers(path: Path, table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        raise InputError(path, f"must be numeric, got {col.type}", column=name)
    if col.null_count:
        row = col.to_pylist().index(None)
        raise InputError(path, "must not be null", column=name, row=row)
    return col.to_numpy(zero_copy_only=False).astype(np.float64)


def _steps_table(path: Path, columns: dict[str, np.ndarray]) -> pa.Table:
    """Validate the counts (non-negative integers) and times (positive, finite): the first bad row is named."""
    for name, values in columns.items():
        if name == "step_s":
            bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
            rule = "step times must be positive and finite seconds"
        else:
            bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values != np.round(values)))
            rule = "counts must be non-negative integers"
        if len(bad):
            raise InputError(path, f"{rule}, got {values[bad[0]]}", column=name, row=int(bad[0]))
    if not len(columns["step_s"]):
        raise InputError(path, "no steps to fit")
    return pa.table({**{f: pa.array(columns[f].astype(np.int64)) for f in FEATURES},
                     "step_s": pa.array(columns["step_s"])})


def _from_servelab(path: Path, table: pa.Table) -> pa.Table:
    for name in REQUIRED:
        if name not in table.column_names:
            raise InputError(path, f"required column missing (a step log has {', '.join(REQUIRED)})", column=name)
    n = table.num_rows
    cols = {name: _numbers(path, table, name) if name in table.column_names else np.zeros(n)
            for name in (*FEATURES, "step_s")}
    return _steps_table(path, cols)


def _from_vllm_trace(path: Path, table: pa.Table, block_size: int) -> pa.Table:
    for name in VLLM_TRACE_COLUMNS:
        if name not in table.column_names:
            raise InputError(path, "required column missing for a vLLM step trace", column=name)
    ids = _numbers(path, table, "step.id").astype(np.int64)
    start = table.column("step.ts_start_ns").to_numpy(zero_copy_only=False).astype(np.int64)
    group = (table.column("experiment_id").to_pylist() if "experiment_id" in table.column_names
             else [""] * table.num_rows)
    keys = {g: i for i, g in enumerate(dict.fromkeys(group))}
    gid = np.array([keys[g] for g in group], dtype=np.int64)
    order = np.lexsort((ids, gid))
    nxt = np.full(len(ids), -1)
    same = (gid[order][1:] == gid[order][:-1]) & (ids[order][1:] == ids[order][:-1] + 1)
    nxt[order[:-1][same]] = order[1:][same]
    keep = np.sort(order[:-1][same])  # rows in file order whose step id + 1 was logged
    step_s = (start[nxt[keep]] - start[keep]) / 1e9  # integers first: float epoch ns keep ~0.2 us
    kv_tokens = np.round(_numbers(path, table, "kv.usage_gpu_ratio") * _numbers(path, table, "kv.blocks_total_gpu")
                         * block_size)
    cols = {
        "prefill_tokens": _numbers(path, table, "batch.prefill_tokens")[keep],
        "prefill_seqs": _numbers(path, table, "batch.num_prefill_reqs")[keep],
        "prefill_context_tokens": np.zeros(len(keep)),
        "prefill_attention_pairs": np.zeros(len(keep)),
        "decode_seqs": _numbers(path, table, "batch.num_decode_reqs")[keep],
        "decode_context_tokens": kv_tokens[keep],
        "step_s": step_s,
    }
    return _steps_table(path, cols)


def read_step_log(path: str | Path, block_size: int = 16) -> tuple[pa.Table, str]:
    """Rows of FEATURES + ``step_s`` from a step log, and which layout it was (``servelab`` or ``vllm-trace``)."""
    path = Path(path)
    table = _read_table(path)
    if "step.ts_start_ns" in table.column_names:
        return _from_vllm_trace(path, table, block_size), "vllm-trace"
    return _from_servelab(path, table), "servelab"


def fit_steps(path: str | Path, output: str | Path, *, buckets: tuple[int, ...] = (), test_fraction: float = 0.2,
              seed: int = 0, block_size: int = 16, meta: dict | None = None):
    """Fit a ``fitted`` cost model (runners/fitted.py) to a step log; write it atomically."""
    import json

    from servelab.runners.fitted import fit_model

    if not (isinstance(block_size, int) and block_size >= 1):
        raise InputError(path, f"block size must be a positive integer, got {block_size}")
    table, layout = read_step_log(path, block_size)
    model = fit_model(table, buckets=buckets, test_fraction=test_fraction, seed=seed, source=str(path), meta=meta)
    model.metadata["fit"]["step_log_layout"] = layout
    if not all(math.isfinite(c) for cs in model.coefficients for c in cs):
        raise InputError(path, "the fit did not converge (non-finite coefficients)")
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(model.to_json(), indent=2, allow_nan=False) + "\n")
    return model
