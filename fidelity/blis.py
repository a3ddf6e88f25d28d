"""BLIS (inference-sim) TraceV2: ``trace.yaml`` (header) + ``trace.csv`` (one row per request).

Header (YAML): ``trace_version``, ``time_unit`` (``us``), ``mode`` (``real`` for ``blis observe``),
``warm_up_requests``, ``server`` (``model``, ``tensor_parallel``, ``max_num_seqs``, ``block_size``,
``gpu_memory_utilization``, ``max_model_len``). CSV columns used, by name: ``request_id``,
``tenant_id``, ``input_tokens``, ``server_input_tokens`` (the server's prompt count; 0 = not
recorded), ``output_tokens``, ``send_time_us`` (when the client sent it; ``arrival_time_us`` is the
scheduled arrival), ``first_chunk_time_us``, ``last_chunk_time_us``, ``status`` (ok, error,
timeout) and ``error_message``. The first ``warm_up_requests`` rows are warm-up and left out.
``prefix_group`` (requests of one group share a prefix) and ``prefix_length`` (its tokens) give
the prompt sharing. A row cut short (fewer fields than the header, no send time) or an ``ok`` row
without its chunk times becomes a failed request with a warning; a row without a send time is
placed at the previous row's.
Source: inference-sim/inference-sim, sim/workload/tracev2.go (Apache-2.0).
"""

from __future__ import annotations

import csv
from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, read_yaml

COLUMNS = ("request_id", "input_tokens", "output_tokens", "send_time_us", "first_chunk_time_us",
           "last_chunk_time_us", "status")
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _pair(paths: list[Path]) -> tuple[Path, Path]:
    if len(paths) == 1 and paths[0].is_dir():
        return paths[0] / "trace.yaml", paths[0] / "trace.csv"
    yaml_files = [p for p in paths if p.suffix in (".yaml", ".yml")]
    csv_files = [p for p in paths if p.suffix == ".csv"]
    if len(yaml_files) == 1 and len(csv_files) == 1 and len(paths) == 2:
        return yaml_files[0], csv_files[0]
    if len(csv_files) == 1 and len(paths) == 1:
        return csv_files[0].with_suffix(".yaml"), csv_files[0]
    raise InputError(paths[0], "blis takes a folder with trace.yaml and trace.csv, or the two files")


@IMPORTERS.register("blis")
@detects(lambda p: p.path.suffix in (".yaml", ".yml", ".csv")
         or p.path.is_dir() and ((p.path / "trace.yaml").is_file() or (p.path / "trace.csv").is_file()), order=0)
def import_blis(paths: list[Path]) -> Measured:
    header_path, data_path = _pair(paths)
    for p in (header_path, data_path):
        if not p.is_file():
            raise InputError(p, "file not found (a TraceV2 needs both trace.yaml and trace.csv)")
    header = read_yaml(header_path) or {}
    if not isinstance(header, dict) or "trace_version" not in header:
        raise InputError(header_path, "not a TraceV2 header (no 'trace_version')", column="trace_version")
    unit = str(header.get("time_unit", "us"))
    if unit not in UNITS:
        raise InputError(header_path, f"time_unit '{unit}' not understood (us, ms or s)", column="time_unit")
    scale = UNITS[unit]
    warm = int(header.get("warm_up_requests") or 0)
    rows = Rows(data_path)
    origin: list[int] = []  # the first row's send time: times are rebased in integers, then scaled
    groups: dict[str, int] = {}  # prefix_group names -> indices, in order of first use
    with open(data_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(data_path, "required column is missing", column=missing[0])
        for lineno, rec in enumerate(reader, 1):
            if lineno <= warm:
                continue
            _add(rows, rec, data_path, lineno, scale, origin, groups)
    server = header.get("server") or {}
    settings = {
        "model": server.get("model"), "tp": server.get("tensor_parallel") or server.get("tensor_parallel_size"),
        "max_num_seqs": server.get("max_num_seqs"), "block_size": server.get("block_size"),
        "gpu_memory_utilization": server.get("gpu_memory_utilization"),
        "max_num_batched_tokens": server.get("max_num_batched_tokens"),
        "num_gpu_blocks": server.get("num_gpu_blocks") or server.get("total_kv_blocks"),
        "enable_prefix_caching": server.get("enable_prefix_caching"),
        "replicas": server.get("data_parallel") or server.get("data_parallel_size"),
        "async_scheduling": server.get("async_scheduling"),
    }
    from servelab.fidelity.sidecars import _gpu_in

    hardware = _gpu_in(server) or _gpu_in(header)
    if hardware:
        settings["gpu"] = hardware
    notes = ["client-side times: TTFT and E2E include the HTTP round trip"]
    if warm:
        notes.append(f"first {warm} rows are warm-up (warm_up_requests) and left out")
    source = {"trace_version": header.get("trace_version"), "mode": header.get("mode"),
              "server_type": server.get("type")}
    version = server.get("vllm_version") or server.get("engine_version") or server.get("version")
    if version is not None and str(server.get("type") or "vllm").lower() == "vllm":
        source["vllm_version"] = str(version)  # its defaults (batch limits, async scheduling) follow it
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes))


def _add(rows: Rows, rec: dict, path: Path, row: int, scale: float, origin: list[int], groups: dict) -> None:
    def num(column: str) -> int:
        raw = (rec.get(column) or "").strip()
        try:
            return int(raw) if raw else 0
        except ValueError:
            raise InputError(path, f"not an integer: '{raw}'", column=column, row=row) from None

    cut = None in rec or any(rec.get(c) is None for c in COLUMNS)  # fewer fields than the header
    send = num("send_time_us") or num("arrival_time_us")
    if not (rec.get("send_time_us") or "").strip() and not (rec.get("arrival_time_us") or "").strip():
        cut = True
        send = rows_last_send(rows, origin, scale)
    prompt = num("server_input_tokens") or num("input_tokens")
    status = (rec.get("status") or "").strip()
    first, last = num("first_chunk_time_us"), num("last_chunk_time_us")
    ok = status == "ok" and not cut and first > 0 and last > 0
    if cut:
        reason = "row cut short (fewer fields than the header, or no send time)"
        rows.warnings.append(f"{path.name} row {row}: {reason}; kept as a failed request")
    elif status == "ok" and not ok:
        reason = "status ok but no first or last chunk time"
        rows.warnings.append(f"{path.name} row {row}: {reason}; kept as a failed request")
    else:
        reason = None if ok else f"{status or 'failed'}: {(rec.get('error_message') or '').strip()}"[:200]
    if not origin:
        origin.append(send)
    t0 = origin[0]
    group_name = (rec.get("prefix_group") or "").strip()
    group = groups.setdefault(group_name, len(groups)) if group_name else None
    rows.add(row, rec["request_id"], (send - t0) * scale, prompt, num("output_tokens"),
             first_token_s=(first - t0) * scale if first and not cut else None,
             finish_s=(last - t0) * scale if ok else None, ok=ok, reason=reason,
             tenant=(rec.get("tenant_id") or "").strip() or None, prefix_group=group,
             prefix_length=num("prefix_length") if group is not None else None)


def rows_last_send(rows: Rows, origin: list[int], scale: float) -> int:
    """The previous row's send time in source units (a row without one is placed there)."""
    if not origin or not len(rows):
        return origin[0] if origin else 0
    return origin[0] + round(rows.arrival_s[-1] / scale)
