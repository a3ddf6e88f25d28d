"""vLLM's OpenTelemetry ``llm_request`` spans (OTLP JSON), one span per request, server side.

A file is one OTLP export document or one per line (what an OTLP file exporter appends). Per span:
``startTimeUnixNano`` is the request's arrival at the server, and the attributes
``gen_ai.latency.time_to_first_token``, ``.e2e``, ``.time_in_queue`` (seconds after arrival) and
``gen_ai.usage.prompt_tokens``, ``.completion_tokens`` give the rest. A span whose status code is
2 (ERROR) is a failed request.
"""

from __future__ import annotations

import json
from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.base import IMPORTERS, Measured, Rows

SPAN_NAME = "llm_request"


def _value(v: dict):
    for key in ("doubleValue", "intValue", "stringValue", "boolValue"):
        if key in v:
            raw = v[key]
            return int(raw) if key == "intValue" else raw
    return None


def _documents(path: Path) -> list[tuple[int, dict]]:
    """(line number, document): the whole file, or one document per non-empty line."""
    text = path.read_text()
    try:
        return [(1, json.loads(text))]
    except json.JSONDecodeError:
        pass
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            docs.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise InputError(path, f"line {lineno} is not valid JSON ({err.msg})") from None
    return docs


@IMPORTERS.register("otel")
def import_otel(paths: list[Path]) -> Measured:
    notes = []
    skipped = 0
    rows = Rows(paths[0])
    services = set()
    origin: list[int] = []  # the first span's start (ns): times are taken relative to it, in integers,
    # before becoming float seconds (epoch seconds as a float64 keep only ~0.2 us)
    for path in paths:
        rows.path = path
        for lineno, doc in _documents(path):
            if not isinstance(doc, dict) or "resourceSpans" not in doc:
                raise InputError(path, f"line {lineno}: not an OTLP JSON export (no 'resourceSpans')")
            for rs in doc["resourceSpans"]:
                for attr in (rs.get("resource") or {}).get("attributes", []):
                    if attr.get("key") == "service.name":
                        services.add(_value(attr.get("value", {})))
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        if span.get("name") != SPAN_NAME:
                            skipped += 1
                            continue
                        _add_span(rows, path, lineno, span, origin)
    if skipped:
        notes.append(f"{skipped} spans not named '{SPAN_NAME}' left out")
    source = {"service": sorted(s for s in services if s)}
    if origin:
        source["first_span_start_unix_ns"] = origin[0]
    return Measured(rows, clock="server", source=source, notes=tuple(notes))


def _add_span(rows: Rows, path: Path, lineno: int, span: dict, origin: list[int]) -> None:
    attrs = {a.get("key"): _value(a.get("value", {})) for a in span.get("attributes", [])}
    row = len(rows) + 1

    def need(key: str):
        if attrs.get(key) is None:
            raise InputError(path, f"span on line {lineno} lacks attribute '{key}'", column=key, row=row)
        return attrs[key]

    try:
        start_ns = int(span["startTimeUnixNano"])
    except (KeyError, ValueError, TypeError):
        raise InputError(path, f"span on line {lineno} has no valid startTimeUnixNano",
                         column="startTimeUnixNano", row=row) from None
    if not origin:
        origin.append(start_ns)
    start = (start_ns - origin[0]) / 1e9
    failed = (span.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR")
    prompt = int(need("gen_ai.usage.prompt_tokens"))
    output = int(attrs.get("gen_ai.usage.completion_tokens") or 0)
    if failed:
        ttft = attrs.get("gen_ai.latency.time_to_first_token")
        rows.add(row, attrs.get("gen_ai.request.id", row), start, prompt, output, ok=False,
                 first_token_s=None if ttft is None else start + float(ttft),
                 reason=(span.get("status") or {}).get("message") or "span status ERROR")
        return
    ttft = float(need("gen_ai.latency.time_to_first_token"))
    e2e = float(need("gen_ai.latency.e2e"))
    queue = attrs.get("gen_ai.latency.time_in_queue")
    rows.add(row, attrs.get("gen_ai.request.id", row), start, prompt, int(need("gen_ai.usage.completion_tokens")),
             first_token_s=start + ttft, finish_s=start + e2e,
             first_scheduled_s=None if queue is None else start + float(queue))
