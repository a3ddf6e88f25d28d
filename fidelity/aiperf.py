"""NVIDIA AIPerf (ai-dynamo/aiperf, genai-perf's successor) per-request records, client side.

``profile_export.jsonl`` holds one record per request (AIPerf's ``MetricRecordInfo``): ``metadata``,
``metrics`` (each ``{"value": V, "unit": U}``) and ``error`` (null, or ``{code, type, message}``).
AIPerf >= 0.2 writes ``metadata.request_start_ns`` / ``request_end_ns`` (ns since the epoch),
``benchmark_phase``, ``was_cancelled``, ``x_request_id``, ``conversation_id`` and ``turn_index``, and
names the first token's metric ``time_to_first_token``; earlier versions wrote ``timestamp_ns`` and
``credit_phase``, and ``ttft``. Per request: the send (``request_start_ns``, else ``timestamp_ns``),
first token = send + ``time_to_first_token`` (``ttft``), last token = send + ``request_latency``
(else ``request_end_ns``), the prompt (``input_sequence_length``; a failed request's
``error_isl``), the output (``output_sequence_length``: the answer's and the reasoning's tokens, as the
server generated them; else ``output_token_count`` + ``reasoning_token_count``) and the gaps between
streamed chunks (``inter_chunk_latency``). A record with an ``error`` is a failed request (a
cancelled one, ``was_cancelled`` or error code 499, ``cancelled``). Warm-up records
(phase ``warmup``) are left out.

``profile_export_aiperf.json`` beside it (the summary) gives the model (``input_config.endpoint.
model_names``) and the load (``input_config.loadgen``: ``concurrency`` C, alone or with a
``request_rate``: a closed loop of C users; a ``request_rate`` alone: an open loop of the recorded
sends); else its ``cli_command``'s ``--concurrency`` / ``--request-rate``. ``inputs.json`` beside it
(the payloads AIPerf sent, per ``session_id`` = the record's ``conversation_id`` and turn) gives each
prompt's text for the prefix-sharing hashes, and the model when the summary is missing.

The client's timeout: AIPerf's aiohttp client gives each request ``--request-timeout-seconds`` in all
(``input_config.endpoint.timeout_seconds``, else the command line's, else its default of 600 s); the
replay abandons a request still unfinished then (``client_timeout_s``, until ``finish``), as the client did.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, optional_json_object, read_json
from servelab.fidelity.fields import array, integer, json_lines, mapping, number, prompt_text

SUMMARY = "profile_export_aiperf.json"
DEFAULT_TIMEOUT_S = 600.0  # AIPerf's --request-timeout-seconds default (docs/cli_options.md, EndpointDefaults.TIMEOUT)
INPUTS = "inputs.json"
_TO_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _is_records(probe) -> bool:
    """A JSON line opening with AIPerf's ``metadata`` (its timestamps and phase) beside ``metrics``."""
    line = probe.line.lstrip()
    return (line.startswith('{"metadata"') or line.startswith('{ "metadata"')) and '"metrics"' in line and any(
        k in line for k in ('"request_start_ns"', '"timestamp_ns"', '"benchmark_phase"', '"credit_phase"'))


@IMPORTERS.register("aiperf")
@detects(_is_records, order=25)
def import_aiperf(paths: list[Path]) -> Measured:
    if len(paths) != 1:
        raise InputError(paths[1], "aiperf takes one profile_export.jsonl")
    path = paths[0]
    prompts, input_models = _inputs(path.parent / INPUTS)
    rows = Rows(path)
    warmup = 0
    base: list[int] = []  # the first record's send (ns): times are rebased to it while whole
    for row, rec in json_lines(path, "AIPerf record"):
        meta = mapping(path, rec.get("metadata"), "metadata", row)
        if str(meta.get("benchmark_phase", meta.get("credit_phase", "profiling"))).lower() == "warmup":
            warmup += 1
            continue
        _add(rows, path, rec, meta, row, prompts, base)
    notes = ["client-side times: TTFT and E2E include the HTTP round trip and detokenisation (AIPerf)"]
    if warmup:
        notes.append(f"{warmup} warm-up records left out (benchmark_phase warmup)")
    summary_path = path.parent / SUMMARY
    summary = optional_json_object(summary_path, "an AIPerf summary")
    config = mapping(summary_path, summary.get("input_config"), "input_config", optional=True)
    endpoint = mapping(summary_path, config.get("endpoint"), "input_config.endpoint", optional=True)
    names = endpoint.get("model_names")
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    model = names[0] if len(names) == 1 else (input_models.pop() if len(input_models) == 1 else None)
    source: dict[str, Any] = {}
    if len(names) > 1:
        source["model_names"] = names  # several models in one run: which replayed is the user's call
    command = _from_command(config["cli_command"]) if isinstance(config.get("cli_command"), str) else {}
    load = _load(summary_path, config, command, notes)
    if endpoint:
        source["endpoint"] = {k: endpoint[k] for k in ("type", "streaming") if k in endpoint}
    if not summary:
        notes.append(f"no {SUMMARY} beside the records: the load shape is not recorded, replayed as the "
                     "recorded sends (an open loop)")
    timeout, why = _timeout(summary_path, endpoint, command)
    notes.append(f"AIPerf's request timeout {timeout:g} s ({why}): a request not finished by then is abandoned, "
                 "as the client did")
    settings = {"model": model, "client_timeout_s": timeout, "client_timeout_until": "finish"}
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes), load=load)


def _metric(path: Path, metrics: dict, names: tuple[str, ...], row: int, *, seconds: bool = False):
    """The first of ``names`` the record has: its value (a time in seconds when ``seconds``, by its unit)."""
    for name in names:
        if name not in metrics:
            continue
        m = metrics[name]
        if not isinstance(m, dict):  # a bare value
            m = {"value": m}
        value = m.get("value")
        if not seconds:
            return value, name
        unit = m.get("unit", "ms")
        if unit not in _TO_SECONDS:
            raise InputError(path, f"needs a time unit ({', '.join(_TO_SECONDS)}), got {unit!r}",
                             column=f"metrics.{name}.unit", row=row)
        if isinstance(value, list):
            return [number(path, v, f"metrics.{name}", row) * _TO_SECONDS[unit] for v in value], name
        return number(path, value, f"metrics.{name}.value", row) * _TO_SECONDS[unit], name
    return None, names[0]


def _add(rows: Rows, path: Path, rec: dict, meta: dict, row: int, prompts: dict, base: list[int]) -> None:
    metrics = mapping(path, rec.get("metrics"), "metrics", row, optional=True)
    key = "request_start_ns" if meta.get("request_start_ns") is not None else "timestamp_ns"
    start_ns = integer(path, meta.get(key), f"metadata.{key}", row)
    end_ns = integer(path, meta.get("request_end_ns"), "metadata.request_end_ns", row, optional=True)
    error = rec.get("error")
    if error is not None and not isinstance(error, dict):
        error = {"message": str(error)}
    ok = error is None
    if not base:
        base.append(start_ns)
    send = (start_ns - base[0]) / 1e9  # whole ns rebased to the first record's send, then seconds
    ttft, _ = _metric(path, metrics, ("time_to_first_token", "ttft"), row, seconds=True)
    latency, _ = _metric(path, metrics, ("request_latency",), row, seconds=True)
    if latency is None and end_ns is not None:
        latency = (end_ns - start_ns) / 1e9
    isl, isl_name = _metric(path, metrics, ("input_sequence_length", "error_isl"), row)
    prompt = integer(path, isl, f"metrics.{isl_name}.value", row, optional=not ok)
    osl, osl_name = _metric(path, metrics, ("output_sequence_length",), row)
    output = integer(path, osl, f"metrics.{osl_name}.value", row, optional=True)
    if output is None:  # the answer's and the reasoning's tokens
        parts = [integer(path, v, f"metrics.{n}.value", row, optional=True)
                 for n in ("output_token_count", "reasoning_token_count")
                 for v in [_metric(path, metrics, (n,), row)[0]]]
        output = sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None
    gaps = None
    if ok:
        gaps, _ = _metric(path, metrics, ("inter_chunk_latency",), row, seconds=True)
        if gaps is not None and not isinstance(gaps, list):
            raise InputError(path, "needs a list of gaps", column="metrics.inter_chunk_latency.value", row=row)
    reason = None
    if not ok:
        kind = error.get("type") or ("cancelled" if meta.get("was_cancelled") else "error")
        code = f" ({error['code']})" if error.get("code") is not None else ""
        reason = f"{kind}{code}: {error.get('message') or ''}".strip()[:200]
        if (meta.get("was_cancelled") or error.get("code") == 499) and "cancel" not in reason.lower():
            reason = f"cancelled: {reason}"
    rid = meta.get("x_request_id") or meta.get("session_num", meta.get("request_num"))
    text = prompts.get((meta.get("conversation_id"), meta.get("turn_index") or 0))
    rows.add(row, rid if rid is not None else row - 1, send, prompt or 0, output or 0,
             first_token_s=send + ttft if ok and ttft is not None else None,
             finish_s=send + latency if ok and latency is not None else None, ok=ok, reason=reason,
             itls_s=gaps, prompt_text=text)


def _load(path: Path, config: dict, command: dict[str, str], notes: list[str]) -> dict:
    """The load shape from ``input_config.loadgen``, else the recorded command line's options (``command``)."""
    loadgen = mapping(path, config.get("loadgen"), "input_config.loadgen", optional=True)
    conc, rate = loadgen.get("concurrency"), loadgen.get("request_rate")
    field = "input_config.loadgen"
    if conc is None and rate is None and command:
        conc, rate = command.get("concurrency"), command.get("request-rate")
        field = "input_config.cli_command"
    users = integer(path, conc, f"{field}.concurrency", optional=True)
    rate = number(path, rate, f"{field}.request_rate", optional=True)
    if users is not None:
        if users < 1:
            raise InputError(path, f"a concurrency of at least 1, got {users}", column=f"{field}.concurrency")
        notes.append(f"--concurrency {users}: replayed as a closed loop of {users} users (each request sent when one "
                     "of theirs ends; think times from the recorded gaps" + (f", with the --request-rate {rate:g} "
                                                                            "pacing in them)" if rate else ")"))
        return {"shape": "closed", "users": users, "request_rate": rate,
                **({"strategy": loadgen["request_rate_mode"]} if loadgen.get("request_rate_mode") else {})}
    if rate is not None:
        return {"shape": "open", "request_rate": rate,
                **({"strategy": loadgen["request_rate_mode"]} if loadgen.get("request_rate_mode") else {})}
    return {}


def _timeout(path: Path, endpoint: dict, command: dict[str, str]) -> tuple[float, str]:
    """AIPerf's per-request timeout and where it comes from: ``input_config.endpoint.timeout_seconds``
    (``--request-timeout-seconds``), else the recorded command line's (``command``), else AIPerf's default.
    Its aiohttp client gives the whole request that long (``ClientTimeout(total=...)``, aiperf/clients/http)."""
    if endpoint.get("timeout_seconds") is not None:
        value, where = endpoint["timeout_seconds"], "input_config.endpoint.timeout_seconds"
        column = where
    elif "request-timeout-seconds" in command:
        value, where = command["request-timeout-seconds"], "input_config.cli_command"
        column = f"{where} --request-timeout-seconds"
    else:
        return DEFAULT_TIMEOUT_S, "AIPerf's default --request-timeout-seconds"
    seconds = number(path, value, column)
    if seconds <= 0:
        raise InputError(path, f"a request timeout above 0 s, got {seconds:g}", column=column)
    return seconds, where


def _from_command(command: str) -> dict[str, str]:
    """The values of the options ``--concurrency``, ``--request-rate`` and ``--request-timeout-seconds`` in
    a recorded command line (``--opt V`` or ``--opt=V``)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    found: dict[str, str] = {}
    for i, word in enumerate(words):
        m = re.fullmatch(r"--(concurrency|request-rate|request-timeout-seconds)(?:=(.+))?", word)
        if m:
            value = m.group(2) if m.group(2) is not None else (words[i + 1] if i + 1 < len(words) else None)
            if value is not None:
                found[m.group(1)] = value
    return found


def _inputs(path: Path) -> tuple[dict, set]:
    """AIPerf's ``inputs.json`` beside the records: (conversation id, turn) -> the prompt's text, and the
    models the payloads name. Missing or unreadable as AIPerf writes it: nothing (the prompts are optional)."""
    if not path.is_file():
        return {}, set()
    doc = read_json(path)
    data = array(path, doc.get("data") if isinstance(doc, dict) else None, "data")
    texts, models = {}, set()
    for i, session in enumerate(data):
        session = mapping(path, session, f"data[{i}]")
        for turn, payload in enumerate(array(path, session.get("payloads"), f"data[{i}].payloads", optional=True)):
            if not isinstance(payload, dict):
                continue
            if isinstance(payload.get("model"), str):
                models.add(payload["model"])
            text = prompt_text(payload)
            if text:
                texts[(session.get("session_id"), turn)] = text
    return texts, models
