"""NVIDIA genai-perf ``genai-perf profile`` per-request export (client side, Perf Analyzer's clock).

``profile_export.json`` is what Perf Analyzer writes for genai-perf (triton-inference-server/perf_analyzer
``src/profile_data_exporter.cc``): ``experiments[*]``, each with ``experiment`` (``mode``
``concurrency`` or ``request_rate`` and its ``value``) and ``requests[*]``: ``timestamp`` (the send,
ns since the epoch of the client's system clock), ``request_inputs`` (an OpenAI request's JSON
``payload`` as text; Triton's ``text_input``; the C API's ``input_ids``), ``response_timestamps``
(ns, one per response received) and ``response_outputs`` (per response: an OpenAI server-sent event
as text, ``response``; Triton's ``text_output``; the C API's ``output_ids``); then ``version``,
``service_kind`` and ``endpoint``.

As genai-perf does (``genai_perf/profile_data_parser/llm_profile_data_parser.py``), responses without
content (the chat role chunk, an empty delta, ``[DONE]``, a usage-only chunk) are not tokens: the
first token is the first response with content, the last token the last one. An SSE ``error`` event
(or a JSON ``error`` member) marks the request failed, as does a request with no response with content
(genai-perf skips those).

Token counts: the server's ``usage`` where a response carries it (``stream_options.include_usage``,
or a non-streamed reply); the C API's ``input_ids``/``output_ids``; a successful request that asked
for ``ignore_eos`` generated its ``max_tokens``. Otherwise genai-perf's own counts exist only as
averages, in the summary ``profile_export_genai_perf.json`` beside the export (its tokenizer over the
prompts and the streamed text): each request's count is its text's length in characters at that
run's mean characters per token (a note says how many). Without the summary such a run is refused.

The summary's ``input_config`` also names the model (``model`` / ``model_names``) where the requests'
payloads do not (a Triton endpoint). The load: ``concurrency`` N is a closed loop of N users
(fidelity/load_shape.py), ``request_rate`` R an open loop of the recorded sends. An export of several
experiments is a sweep: one run each, or ``--benchmark N`` for the N-th (0-based).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, optional_json_object, read_json
from servelab.fidelity.fields import array, integer, json_body, mapping, number, prompt_text

SUMMARY = "profile_export_genai_perf.json"


def _is_export(probe) -> bool:
    """Perf Analyzer's export: a JSON object opening with ``experiments`` whose requests open with
    ``timestamp`` (the prompt in ``request_inputs`` may push the rest past the probe)."""
    head = probe.head.lstrip()
    return (head.startswith("{") and '"experiments"' in head[:256] and '"requests"' in head
            and '"timestamp"' in head)


def _experiments(path: Path) -> tuple[dict, list[dict]]:
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise InputError(path, "not a genai-perf profile export (expected a JSON object with 'experiments')")
    exps = array(path, doc.get("experiments"), "experiments")
    return doc, [mapping(path, e, f"experiments[{i}]") for i, e in enumerate(exps)]


def count_benchmarks(path: Path) -> int:
    """How many experiments (load levels) the export holds."""
    return len(_experiments(path)[1])


@IMPORTERS.register("genai-perf")
@detects(_is_export, order=25)
def import_genai_perf(paths: list[Path], benchmark: int | None = None) -> Measured:
    if len(paths) != 1:
        raise InputError(paths[1], "genai-perf takes one profile_export.json")
    path = paths[0]
    doc, exps = _experiments(path)
    if not exps:
        raise InputError(path, "no experiment in it (an empty 'experiments' list)", column="experiments")
    if benchmark is not None:
        if not 0 <= benchmark < len(exps):
            raise InputError(path, f"--benchmark {benchmark}: the export has experiments 0..{len(exps) - 1}")
        index = benchmark
    elif len(exps) > 1:
        raise InputError(path, f"{len(exps)} experiments (load levels): pass --benchmark N for one")
    else:
        index = 0
    exp = exps[index]
    where = f"experiments[{index}]"
    level = mapping(path, exp.get("experiment"), f"{where}.experiment")
    mode = level.get("mode")
    if mode not in ("concurrency", "request_rate"):
        raise InputError(path, f"needs 'concurrency' or 'request_rate', got {mode!r}", column=f"{where}.experiment.mode")
    value = number(path, level.get("value"), f"{where}.experiment.value")
    kind = doc.get("service_kind") or "openai"
    summary_path = path.parent / SUMMARY
    summary = optional_json_object(summary_path, "a genai-perf summary")
    rows = Rows(path)
    pending = []  # per request: what _add needs once the run's characters per token are known
    for i, req in enumerate(array(path, exp.get("requests"), f"{where}.requests")):
        row = i + 1
        req = mapping(path, req, f"{where}.requests[{i}]", row)
        pending.append(_read(path, req, row, kind))
    counted = _fill_counts(path, pending, summary, summary_path)
    base = min((p["send"] for p in pending), default=0)  # whole ns rebased before they become float seconds
    for p in pending:
        for key in ("send", "first", "last"):
            if p[key] is not None:
                p[key] = (p[key] - base) / 1e9
    for p in pending:
        rows.add(p["row"], p["row"] - 1, p["send"], p["prompt"], p["output"], first_token_s=p["first"],
                 finish_s=p["last"], ok=p["ok"], reason=p["reason"], itls_s=p["itls"], prompt_text=p["text"],
                 token_ids=p["input_ids"])
    notes = ["client-side times: TTFT and E2E include the HTTP round trip and detokenisation (genai-perf); "
             "the last token is the last response with content, as genai-perf counts it"]
    for what, n in counted.items():
        if n:
            notes.append(what.format(n=n))
    config = mapping(summary_path, summary.get("input_config"), "input_config", optional=True)
    model = _payload_model(pending) or _config_model(config)
    source = {k: doc[k] for k in ("version", "service_kind", "endpoint") if k in doc}
    source.update(experiment={"mode": mode, "value": value}, experiments=len(exps))
    if benchmark is not None:
        source["benchmark"] = benchmark
    if mode == "concurrency":
        users = integer(path, level.get("value"), f"{where}.experiment.value")
        if users < 1:
            raise InputError(path, f"a concurrency of at least 1, got {users}", column=f"{where}.experiment.value")
        load = {"shape": "closed", "users": users, "request_rate": None}
        notes.append(f"--concurrency {users}: replayed as a closed loop of {users} users (each request sent when "
                     "one of theirs ends; think times from the recorded gaps)")
    else:
        load = {"shape": "open", "request_rate": value}
    return Measured(rows, clock="client", settings={"model": model}, source=source, notes=tuple(notes), load=load)


def _read(path: Path, req: dict, row: int, kind: str) -> dict:
    """One request's times, outcome, token counts where recorded, and texts."""
    send_ns = integer(path, req.get("timestamp"), "timestamp", row)
    inputs = mapping(path, req.get("request_inputs"), "request_inputs", row, optional=True)
    stamps = [integer(path, t, "response_timestamps", row)
              for t in array(path, req.get("response_timestamps"), "response_timestamps", row, optional=True)]
    outputs = array(path, req.get("response_outputs"), "response_outputs", row, optional=True)
    if len(outputs) != len(stamps):
        raise InputError(path, f"needs one response output per response timestamp ({len(stamps)}), got "
                               f"{len(outputs)}", column="response_outputs", row=row)
    body = json_body(path, inputs.get("payload"), "request_inputs.payload", row)
    content_times, out_text, out_ids, usage, error = [], [], [], {}, None
    for k, (t, out) in enumerate(zip(stamps, outputs)):
        out = mapping(path, out, f"response_outputs[{k}]", row)
        text, ids, use, err = _response(out)
        usage.update(use)
        error = error or err
        if text or ids:
            content_times.append(t)
            out_text.append(text)
            out_ids.extend(ids)
    input_ids = inputs.get("input_ids") if kind == "triton_c_api" else None
    if input_ids is not None and not (isinstance(input_ids, list) and all(isinstance(x, int) for x in input_ids)):
        raise InputError(path, "needs a list of token ids", column="request_inputs.input_ids", row=row)
    ok = error is None and bool(content_times)
    reason = None
    if not ok:
        reason = f"error: {error}"[:200] if error else "no response with content"
    prompt = integer(path, usage.get("prompt_tokens"), "usage.prompt_tokens", row, optional=True)
    output = integer(path, usage.get("completion_tokens"), "usage.completion_tokens", row, optional=True)
    how = {"prompt": "usage" if prompt is not None else None, "output": "usage" if output is not None else None}
    if prompt is None and input_ids is not None:
        prompt, how["prompt"] = len(input_ids), "ids"
    if output is None and kind == "triton_c_api" and ok:
        output, how["output"] = len(out_ids), "ids"
    max_tokens = integer(path, body.get("max_tokens", body.get("max_completion_tokens")), "payload.max_tokens", row,
                         optional=True)
    nvext = body.get("nvext") if isinstance(body.get("nvext"), dict) else {}
    if output is None and ok and max_tokens and (body.get("ignore_eos") is True or nvext.get("ignore_eos") is True):
        output, how["output"] = max_tokens, "max_tokens"
    gaps = [b - a for a, b in zip(content_times, content_times[1:])]
    return {"row": row, "send": send_ns, "ok": ok, "reason": reason,  # ns until rebased (_seconds)
            "first": content_times[0] if ok else None, "last": content_times[-1] if ok else None,
            "itls": [g / 1e9 for g in gaps] if ok else None, "prompt": prompt, "output": output, "how": how,
            "text": prompt_text(body, inputs.get("text_input")), "out_chars": len("".join(out_text)),
            "input_ids": input_ids, "model": body.get("model")}


def _response(out: dict) -> tuple[str, list, dict, str | None]:
    """(text, token ids, usage, error) of one response: Triton's ``text_output``, the C API's
    ``output_ids``, or an OpenAI reply (one or more server-sent events, or a plain JSON body)."""
    if "output_ids" in out:
        ids = out["output_ids"]
        return "", ids if isinstance(ids, list) else ([ids] if isinstance(ids, int) else []), {}, None
    if "text_output" in out:
        text = out["text_output"]
        return text if isinstance(text, str) else "", [], {}, None
    raw = out.get("response")
    if not isinstance(raw, str):
        return "", [], {}, None
    text, usage, error = [], {}, None
    events = raw.strip().split("\n\n") if "data:" in raw or "event:" in raw else [raw]
    for event in events:
        data_lines, name = [], None
        for line in event.splitlines():
            if line.startswith("data:"):
                data_lines.append(line[5:].strip())
            elif line.startswith("event:"):
                name = line[6:].strip()
            elif not line.startswith((":", "id:", "retry:")):
                data_lines.append(line.strip())  # a reply not framed as an event (non-streaming)
        data = "\n".join(d for d in data_lines if d)
        if name == "error":
            error = error or (data or "error event")
            continue
        if not data or data == "[DONE]":
            continue
        try:
            msg = json.loads(data)
        except json.JSONDecodeError:
            continue  # a splintered event: no tokens to read from it
        if not isinstance(msg, dict):
            continue
        if msg.get("error"):
            err = msg["error"]
            error = error or (err.get("message") if isinstance(err, dict) and err.get("message") else str(err))
            continue
        if isinstance(msg.get("usage"), dict):
            usage.update({k: v for k, v in msg["usage"].items() if k in ("prompt_tokens", "completion_tokens")
                          and v is not None})
        for choice in msg.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta") or choice.get("message") or {}
            for value in (choice.get("text"), *(part.get(k) for k in ("content", "reasoning_content", "reasoning")
                                                if isinstance(part, dict))):
                if isinstance(value, str) and value:
                    text.append(value)
        if isinstance(msg.get("text_output"), str):  # Triton's generate endpoint over SSE
            text.append(msg["text_output"])
    return "".join(text), [], usage, error


def _fill_counts(path: Path, pending: list[dict], summary: dict, summary_path: Path) -> dict[str, int]:
    """Counts the export does not record: text length at the run's characters per token (genai-perf's
    average input and output sequence lengths over the requests' text). Returns the notes' counts."""
    counted = {"prompt tokens of {n} requests: their text's length at the run's mean characters per token "
               f"(genai-perf's average input_sequence_length in {SUMMARY}; the export records no usage)": 0,
               "output tokens of {n} requests: their streamed text's length at the run's mean characters per "
               f"token (genai-perf's average output_sequence_length in {SUMMARY})": 0,
               "output tokens of {n} requests: their max_tokens (ignore_eos)": 0}
    keys = list(counted)
    counted[keys[2]] = sum(p["how"]["output"] == "max_tokens" for p in pending)
    for side, key, chars in (("prompt", "input_sequence_length", lambda p: len(p["text"] or "")),
                             ("output", "output_sequence_length", lambda p: p["out_chars"])):
        need = [p for p in pending if p[side] is None and (side == "prompt" or p["ok"])]
        if not need:
            continue
        stat = mapping(summary_path, summary.get(key), key, optional=True)
        mean_tokens = number(summary_path, stat.get("avg"), f"{key}.avg", optional=True)
        # genai-perf's average is over the requests with a response (the successful ones)
        counted_by = [p for p in pending if p["ok"]]
        mean_chars = sum(chars(p) for p in counted_by) / len(counted_by) if counted_by else 0
        if mean_tokens is None or mean_chars <= 0:
            if not any(p["ok"] for p in need):  # failed requests alone: nothing the replay sends, counted 0
                for p in need:
                    p[side] = 0
                continue
            first = next(p for p in need if p["ok"])
            why = (f"{SUMMARY} is not beside it" if not summary else f"{SUMMARY} has no {key}.avg"
                   if mean_tokens is None else "the requests record no text to count")
            raise InputError(path, f"no {side} token count: the export records no usage and {why}; keep genai-perf's "
                                   f"{SUMMARY} beside the export (or rerun with --extra-inputs ignore_eos:true and "
                                   "--output-tokens-mean N for the outputs)",
                             column="usage.prompt_tokens" if side == "prompt" else "usage.completion_tokens",
                             row=first["row"])
        for p in need:
            p[side] = max(1, round(chars(p) * mean_tokens / mean_chars)) if chars(p) else 0
        counted[keys[0 if side == "prompt" else 1]] = len(need)
    for p in pending:
        if p["output"] is None:  # a failed request: nothing generated that the export counts
            p["output"] = 0
    return counted


def _payload_model(pending: list[dict]) -> str | None:
    models = {p["model"] for p in pending if isinstance(p["model"], str) and p["model"].strip()}
    return models.pop() if len(models) == 1 else None


def _config_model(config: dict) -> str | None:
    """The model the summary's ``input_config`` names (``model``: a name or a list; ``model_names``)."""
    for key in ("model", "model_names", "formatted_model_name"):
        value: Any = config.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None
