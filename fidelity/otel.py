"""vLLM's OpenTelemetry ``llm_request`` spans (OTLP JSON), one span per request, server side.

A file is one OTLP export document or one per line (what an OTLP file exporter appends). Per span:
``startTimeUnixNano`` is the request's arrival at the server, and the attributes
``gen_ai.latency.time_to_first_token``, ``.e2e``, ``.time_in_queue`` (seconds after arrival) and
``gen_ai.usage.prompt_tokens``, ``.completion_tokens`` give the rest. A span whose status code is
2 (ERROR) is a failed request.

A trace of vLLM's request journey (its scheduler's ``llm_core`` spans, scope ``vllm.scheduler``, the
events ``journey.QUEUED``, ``.SCHEDULED``, ``.FIRST_TOKEN``, ``.PREEMPTED`` and ``.FINISHED`` of each
request, keyed by ``gen_ai.request.id``) is read when the file has no ``llm_request`` span: a request
arrives when the engine core queues it and is first scheduled, has its first token and finishes at
those events (their ``ts.monotonic``, else the event's time), its prompt is ``prefill.total_tokens``
and its output ``decode.done_tokens`` at FINISHED; ``finish.status`` ``abort``/``error`` is a failed
request, and one with no FINISHED event did not finish while traced.
"""

from __future__ import annotations

import json
from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows
from servelab.fidelity.fields import array, integer, mapping, number

SPAN_NAME = "llm_request"
JOURNEY_SPAN = "llm_core"  # vLLM's request journey: the scheduler's span, its events each request's lifecycle


def _value(v: object):
    if not isinstance(v, dict):
        return v  # not an OTLP AnyValue: the caller's typed read reports it
    for key in ("doubleValue", "intValue", "stringValue", "boolValue"):
        if key in v:
            return v[key]  # OTLP writes an intValue as a string: the typed reads convert it
    return None


def _documents(path: Path, warnings: list[str]) -> list[tuple[int, dict]]:
    """(line number, document): the whole file, or one document per non-empty line. A last line that is
    not JSON (the exporter was cut while appending) is left out with a warning; one before it is an error."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text (expected OTLP JSON)") from None
    try:
        return [(1, json.loads(text))]
    except json.JSONDecodeError:
        pass
    docs = []
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            docs.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            if lineno == last and len(docs) > 0:
                warnings.append(f"{path.name} line {lineno}: cut short (not valid JSON); its spans are left out")
                continue
            raise InputError(path, f"line {lineno} is not valid JSON ({err.msg})") from None
    return docs


@IMPORTERS.register("otel")
@detects(lambda p: '"resourceSpans"' in p.head[:4096] or '"llm_request"' in p.head, order=10)
def import_otel(paths: list[Path]) -> Measured:
    notes = []
    skipped = 0
    rows = Rows(paths[0])
    services = set()
    journeys: dict[str, list[tuple[float, int, str, dict, Path, int]]] = {}  # request id -> its journey events
    origin: list[int] = []  # the first span's start (ns): times are taken relative to it, in integers,
    # before becoming float seconds (epoch seconds as a float64 keep only ~0.2 us)
    for path in paths:
        rows.path = path
        for lineno, at, span in _spans(path, rows.warnings, services):
            span = mapping(path, span, at, len(rows) + 1)
            if span.get("name") == JOURNEY_SPAN:
                _add_journey(journeys, path, lineno, span)
                continue
            if span.get("name") != SPAN_NAME:
                skipped += 1
                continue
            _add_span(rows, path, lineno, span, origin)
    from_spans = len(rows) > 0  # the llm_request spans' times are the API server's (client_model.py api_request_s)
    if journeys and not len(rows):
        _journey_rows(rows, journeys)
        notes.append(f"vLLM request journey trace ({len(journeys)} requests' '{JOURNEY_SPAN}' events): times from "
                     "the engine core, a request arriving when it queued it (after the API server)")
    elif journeys:
        notes.append(f"{len(journeys)} requests' journey events ('{JOURNEY_SPAN}' spans) beside the "
                     f"'{SPAN_NAME}' spans: the latter are the requests")
    if skipped:
        notes.append(f"{skipped} spans not named '{SPAN_NAME}' left out")
    source = {"service": sorted(s for s in services if s)}
    if len(rows):
        source["times"] = "api-server" if from_spans else "engine-core"
    if origin:
        source["first_span_start_unix_ns"] = origin[0]
    return Measured(rows, clock="server", source=source, notes=tuple(notes))


def _spans(path: Path, warnings: list[str], services: set | None = None):
    """(line number, where, span) for each span of an OTLP JSON file, each level of the document checked
    (``where`` names the span in an error); ``services`` collects the resources' ``service.name``."""
    for lineno, doc in _documents(path, warnings):
        if not isinstance(doc, dict) or "resourceSpans" not in doc:
            raise InputError(path, f"line {lineno}: not an OTLP JSON export (no 'resourceSpans')")
        for r, rs in enumerate(array(path, doc["resourceSpans"], f"line {lineno}: resourceSpans")):
            at = f"line {lineno}: resourceSpans[{r}]"
            rs = mapping(path, rs, at)
            resource = mapping(path, rs.get("resource"), f"{at}.resource", optional=True)
            if services is not None:
                for attr in _attributes(path, resource.get("attributes"), f"{at}.resource.attributes"):
                    if attr.get("key") == "service.name":
                        name = _value(attr.get("value", {}))
                        if isinstance(name, str):
                            services.add(name)
            for k, ss in enumerate(array(path, rs.get("scopeSpans"), f"{at}.scopeSpans", optional=True)):
                ss = mapping(path, ss, f"{at}.scopeSpans[{k}]")
                for m, span in enumerate(array(path, ss.get("spans"), f"{at}.scopeSpans[{k}].spans", optional=True)):
                    yield lineno, f"{at}.scopeSpans[{k}].spans[{m}]", span


def _attributes(path: Path, value: object, field: str, row: int | None = None) -> list[dict]:
    out = array(path, value, field, row, optional=True)
    for a in out:
        if not isinstance(a, dict):
            raise InputError(path, f"needs key/value objects, got {a!r}"[:120], column=field, row=row)
    return out


def _attribute_map(path: Path, value: object, field: str, row: int | None = None) -> dict:
    """An OTLP attribute list as ``{key: value}``."""
    return {a.get("key"): _value(a.get("value", {})) for a in _attributes(path, value, field, row)}


def _add_span(rows: Rows, path: Path, lineno: int, span: dict, origin: list[int]) -> None:
    row = len(rows) + 1
    attrs = _attribute_map(path, span.get("attributes"), "attributes", row)

    def need(key: str):
        if attrs.get(key) is None:
            raise InputError(path, f"span on line {lineno} lacks attribute '{key}'", column=key, row=row)
        return attrs[key]

    def num(key: str, optional: bool = False) -> float | None:
        return number(path, need(key) if not optional else attrs.get(key), key, row, optional=optional)

    def count(key: str, optional: bool = False) -> int | None:
        return integer(path, need(key) if not optional else attrs.get(key), key, row, optional=optional)

    try:
        start_ns = int(span["startTimeUnixNano"])
    except (KeyError, ValueError, TypeError):
        raise InputError(path, f"span on line {lineno} has no valid startTimeUnixNano",
                         column="startTimeUnixNano", row=row) from None
    if not origin:
        origin.append(start_ns)
    start = (start_ns - origin[0]) / 1e9
    status = mapping(path, span.get("status"), "status", row, optional=True)
    failed = status.get("code") in (2, "STATUS_CODE_ERROR")
    prompt = count("gen_ai.usage.prompt_tokens")
    if failed:
        output = count("gen_ai.usage.completion_tokens", optional=True) or 0
        ttft = num("gen_ai.latency.time_to_first_token", optional=True)
        rows.add(row, attrs.get("gen_ai.request.id", row), start, prompt, output, ok=False,
                 first_token_s=None if ttft is None else start + ttft,
                 reason=str(status.get("message") or "span status ERROR"))
        return
    ttft = num("gen_ai.latency.time_to_first_token")
    e2e = num("gen_ai.latency.e2e")
    queue = num("gen_ai.latency.time_in_queue", optional=True)
    rows.add(row, attrs.get("gen_ai.request.id", row), start, prompt, count("gen_ai.usage.completion_tokens"),
             first_token_s=start + ttft, finish_s=start + e2e,
             first_scheduled_s=None if queue is None else start + queue)


JOURNEY_OK = ("length", "stop", "stopped", "finished_length", "finished_stopped")


def _add_journey(journeys: dict, path: Path, lineno: int, span: dict) -> None:
    """Keep a journey span's events under its request id (a request preempted and resumed has several spans)."""
    attrs = _attribute_map(path, span.get("attributes"), "attributes")
    request = attrs.get("gen_ai.request.id")
    if request is None:
        raise InputError(path, f"line {lineno}: a '{JOURNEY_SPAN}' span lacks attribute 'gen_ai.request.id'",
                         column="gen_ai.request.id")
    for e, event in enumerate(array(path, span.get("events"), f"line {lineno}: events", optional=True)):
        event = mapping(path, event, f"line {lineno}: events[{e}]")
        name = str(event.get("name", ""))
        if not name.startswith("journey."):
            continue
        ev = _attribute_map(path, event.get("attributes"), f"line {lineno}: events[{e}]")
        ts = ev.get("ts.monotonic")
        if ts is None:
            try:
                ts = int(event["timeUnixNano"]) / 1e9
            except (KeyError, ValueError, TypeError):
                raise InputError(path, f"line {lineno}: journey event {name} of request {request} has neither "
                                       "ts.monotonic nor timeUnixNano", column="ts.monotonic") from None
        step = integer(path, ev.get("scheduler.step", 0), "scheduler.step", optional=True) or 0
        journeys.setdefault(str(request), []).append((number(path, ts, "ts.monotonic"), step, name[8:], ev,
                                                      path, lineno))


def _journey_rows(rows: Rows, journeys: dict) -> None:
    """One row per journeyed request, in the order of their QUEUED events, times after the first of them."""
    timelines = []
    for request, events in journeys.items():
        events.sort(key=lambda e: (e[1], e[0]))  # by scheduler step, then time: an exporter's order may differ
        first = {}
        for ts, _, name, ev, path, lineno in events:
            first.setdefault(name, (ts, ev, path, lineno))
        if "QUEUED" not in first:
            _, _, _, _, path, lineno = events[0]
            rows.warnings.append(f"{path.name} line {lineno}: request {request} has journey events but no QUEUED "
                                 "event (traced from the middle of its life): left out")
            continue
        timelines.append((first["QUEUED"][0], request, first, events))
    if not timelines:
        return
    t0 = min(t[0] for t in timelines)
    for queued, request, first, events in sorted(timelines, key=lambda t: (t[0], t[1])):
        _, _, path, lineno = first["QUEUED"]
        rows.path = path
        row = len(rows) + 1
        total = next((ev.get("prefill.total_tokens") for _, _, _, ev, _, _ in events
                      if ev.get("prefill.total_tokens") is not None), None)
        prompt = integer(path, total, "prefill.total_tokens", row)
        at = {k: (None if k not in first else first[k][0] - t0) for k in ("SCHEDULED", "FIRST_TOKEN", "FINISHED")}
        output, reason = 0, "no FINISHED journey event: not finished while traced"
        if "FINISHED" in first:
            ev = first["FINISHED"][1]
            output = integer(path, ev.get("decode.done_tokens"), "decode.done_tokens", row)
            status = str(ev.get("finish.status") or "length").lower()
            ok = status in JOURNEY_OK and at["FIRST_TOKEN"] is not None
            reason = None if ok else f"journey finish.status {status}"
        rows.add(row, request, queued - t0, prompt, output, ok=reason is None, reason=reason,
                 first_token_s=at["FIRST_TOKEN"], first_scheduled_s=at["SCHEDULED"],
                 finish_s=at["FINISHED"] if reason is None else None)


def api_server_observations(path: Path) -> list[dict]:
    """What vLLM's API server adds to its own TTFT and E2E beyond the engine core, from the ``llm_request``
    spans of requests that ran alone (no other request's span overlaps theirs: the engine was idle when
    each came, so no iteration in flight delays its intake). A span's TTFT runs from the API server's
    receipt to its processing of the first token, its ``time_in_queue`` and ``time_in_model_prefill``
    from the engine core's queue to the first token there; what is left is the API server's intake
    (tokenisation, the hand-over to the engine core) and its processing of that output. The same for the
    last token: E2E - time_in_queue - time_in_model_inference. One observation per such request:
    ``prompt_tokens``, ``first_s`` and ``last_s`` (seconds), ``request`` (its span's request id)."""
    keys = ("time_to_first_token", "e2e", "time_in_queue", "time_in_model_prefill", "time_in_model_inference")
    spans = []
    for lineno, at, span in _spans(path, []):
        row = len(spans) + 1
        span = mapping(path, span, at, row)
        status = mapping(path, span.get("status"), "status", row, optional=True)
        if span.get("name") != SPAN_NAME or status.get("code") in (2, "STATUS_CODE_ERROR"):
            continue
        attrs = _attribute_map(path, span.get("attributes"), "attributes", row)
        if any(attrs.get(f"gen_ai.latency.{k}") is None for k in keys):
            continue  # (spans of vLLM releases that do not record the engine's part)
        lat = {k: number(path, attrs[f"gen_ai.latency.{k}"], f"gen_ai.latency.{k}", row) for k in keys}
        try:
            start = int(span["startTimeUnixNano"]) / 1e9
        except (KeyError, ValueError, TypeError):
            raise InputError(path, f"span on line {lineno} has no valid startTimeUnixNano",
                             column="startTimeUnixNano", row=row) from None
        prompt = integer(path, attrs.get("gen_ai.usage.prompt_tokens"), "gen_ai.usage.prompt_tokens", row)
        spans.append((start, start + lat["e2e"], lat, prompt, str(attrs.get("gen_ai.request.id", row))))
    spans.sort(key=lambda s: s[0])
    out = []
    ended = -float("inf")  # the latest end of the spans that started before this one
    for i, (start, end, lat, prompt, request) in enumerate(spans):
        after = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        alone = ended <= start and after >= end
        ended = max(ended, end)
        if alone:
            out.append({"request": request, "prompt_tokens": prompt,
                        "first_s": lat["time_to_first_token"] - lat["time_in_queue"] - lat["time_in_model_prefill"],
                        "last_s": lat["e2e"] - lat["time_in_queue"] - lat["time_in_model_inference"]})
    return out

