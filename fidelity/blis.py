"""BLIS (inference-sim) TraceV2: ``trace.yaml`` (header) + ``trace.csv`` (one row per request).

Header (YAML): ``trace_version``, ``time_unit`` (``us``), ``mode`` (``real`` for ``blis observe``),
``warm_up_requests``, ``server`` (``model``, ``tensor_parallel``, ``max_num_seqs``, ``block_size``,
``gpu_memory_utilization``, ``max_model_len``). CSV columns used, by name: ``request_id``,
``tenant_id``, ``input_tokens``, ``server_input_tokens`` (the server's prompt count; 0 = not
recorded), ``output_tokens``, ``send_time_us`` (when the client sent it; ``arrival_time_us`` is the
scheduled arrival), ``first_chunk_time_us``, ``last_chunk_time_us``, ``status`` (ok, error,
timeout) and ``error_message``. The first ``warm_up_requests`` rows are warm-up and left out.
Source: inference-sim/inference-sim, sim/workload/tracev2.go (Apache-2.0).
"""

from __future__ import annotations

import csv
from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.base import IMPORTERS, Measured, Rows

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
def import_blis(paths: list[Path]) -> Measured:
    import yaml

    header_path, data_path = _pair(paths)
    for p in (header_path, data_path):
        if not p.is_file():
            raise InputError(p, "file not found (a TraceV2 needs both trace.yaml and trace.csv)")
    try:
        header = yaml.safe_load(header_path.read_text()) or {}
    except yaml.YAMLError as err:
        raise InputError(header_path, f"not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(header, dict) or "trace_version" not in header:
        raise InputError(header_path, "not a TraceV2 header (no 'trace_version')", column="trace_version")
    unit = str(header.get("time_unit", "us"))
    if unit not in UNITS:
        raise InputError(header_path, f"time_unit '{unit}' not understood (us, ms or s)", column="time_unit")
    scale = UNITS[unit]
    warm = int(header.get("warm_up_requests") or 0)
    rows = Rows(data_path)
    origin: list[int] = []  # the first row's send time: times are rebased in integers, then scaled
    with open(data_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(data_path, "required column is missing", column=missing[0])
        for lineno, rec in enumerate(reader, 1):
            if lineno <= warm:
                continue
            _add(rows, rec, data_path, lineno, scale, origin)
    server = header.get("server") or {}
    settings = {
        "model": server.get("model"), "tp": server.get("tensor_parallel"),
        "max_num_seqs": server.get("max_num_seqs"), "block_size": server.get("block_size"),
        "gpu_memory_utilization": server.get("gpu_memory_utilization"),
    }
    notes = ["client-side times: TTFT and E2E include the HTTP round trip"]
    if warm:
        notes.append(f"first {warm} rows are warm-up (warm_up_requests) and left out")
    source = {"trace_version": header.get("trace_version"), "mode": header.get("mode"),
              "server_type": server.get("type")}
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes))


def _add(rows: Rows, rec: dict, path: Path, row: int, scale: float, origin: list[int]) -> None:
    def num(column: str) -> int:
        raw = (rec.get(column) or "").strip()
        try:
            return int(raw) if raw else 0
        except ValueError:
            raise InputError(path, f"not an integer: '{raw}'", column=column, row=row) from None

    send = num("send_time_us") or num("arrival_time_us")
    prompt = num("server_input_tokens") or num("input_tokens")
    status = (rec.get("status") or "").strip()
    ok = status == "ok"
    first, last = num("first_chunk_time_us"), num("last_chunk_time_us")
    reason = None if ok else f"{status or 'failed'}: {(rec.get('error_message') or '').strip()}"[:200]
    if not origin:
        origin.append(send)
    t0 = origin[0]
    rows.add(row, rec["request_id"], (send - t0) * scale, prompt, num("output_tokens"),
             first_token_s=(first - t0) * scale if first else None, finish_s=(last - t0) * scale if ok else None,
             ok=ok, reason=reason, tenant=(rec.get("tenant_id") or "").strip() or None)
