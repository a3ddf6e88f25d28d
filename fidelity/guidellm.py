"""GuideLLM benchmark report JSON (``guidellm benchmark --output-path report.json``), client side.

``benchmarks[*].requests`` holds ``successful``, ``errored`` and ``incomplete`` request lists. A
request's times are the send (``start_time``, or ``request_start_time`` / ``info.timings.request_start``
in GuideLLM >= 0.4), first and last token (``first_token_time`` / ``info.timings.first_token_iteration``,
``last_token_time`` / ``info.timings.last_token_iteration``), with ``prompt_tokens`` and
``output_tokens``. Every benchmark of the report (a sweep's strategies ran one after another) is
imported as one timeline; ``--benchmark N`` keeps only the N-th (0-based). The client's HTTP timeout
(``config.backend.timeout``) is a setting: ``client_timeout_s`` with ``client_timeout_until =
first_token``, since httpx's timeout is a read timeout. The model is the one the client named
(``config.backend.model``, ``args.model`` in v0.2, else the request bodies'). A request's prompt text
(v0.2 ``prompt``; in GuideLLM >= 0.4 the ``request_args`` body: a completion's ``prompt`` or the
chat messages' text) is kept for the prefix-sharing hashes (fidelity/prefix_sharing.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, read_json
from servelab.fidelity.fields import array, integer, mapping, number, prompt_text


def _first(*values):
    return next((v for v in values if v is not None), None)


def _times(path: Path, req: dict, where: str, row: int) -> tuple:
    info = mapping(path, req.get("info"), f"{where}.info", row, optional=True)
    timings = mapping(path, info.get("timings"), f"{where}.info.timings", row, optional=True)
    start = _first(req.get("start_time"), req.get("request_start_time"), timings.get("request_start"))
    first = _first(req.get("first_token_time"), timings.get("first_token_iteration"))
    last = _first(req.get("last_token_time"), timings.get("last_token_iteration"),
                  req.get("end_time"), req.get("request_end_time"), timings.get("request_end"))
    return tuple(number(path, v, f"{where}.{name}", row, optional=True)
                 for name, v in (("start_time", start), ("first_token_time", first), ("last_token_time", last)))


def _body(req: dict) -> dict:
    """The HTTP body a GuideLLM >= 0.4 request sent (``request_args``, a JSON string or a mapping, its
    ``body``); empty when the record has none."""
    args = req.get("request_args")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}
    if not isinstance(args, dict):
        return {}
    body = args.get("body", args)
    return body if isinstance(body, dict) else {}


def _prompt_text(req: dict, body: dict) -> str | None:
    """The prompt as text: v0.2's ``prompt``, else the body's (completions' ``prompt`` or its chat
    messages' text parts, in order: the template vLLM puts around them is the same for every request)."""
    prompt = req.get("prompt")
    return prompt if isinstance(prompt, str) else prompt_text(body)


def _model(doc: dict, benches: list, bodies_model: str | None) -> str | None:
    """The model the client asked for: ``config.backend.model`` (>= 0.4), ``args.model`` (v0.2), else a
    request body's ``model``."""
    for bench in benches:
        backend = (bench.get("config") or {}).get("backend") if isinstance(bench.get("config"), dict) else None
        if isinstance(backend, dict) and isinstance(backend.get("model"), str) and backend["model"].strip():
            return backend["model"].strip()
    args = doc.get("args") if isinstance(doc.get("args"), dict) else {}
    if isinstance(args.get("model"), str) and args["model"].strip():
        return args["model"].strip()
    return bodies_model


@IMPORTERS.register("guidellm")
@detects(lambda p: '"benchmarks"' in p.head, order=30)
def import_guidellm(paths: list[Path], benchmark: int | None = None) -> Measured:
    if len(paths) != 1:
        raise InputError(paths[1], "guidellm takes one report JSON")
    path = paths[0]
    doc = read_json(path)
    benches = doc.get("benchmarks") if isinstance(doc, dict) else None
    if not isinstance(benches, list) or not benches:
        raise InputError(path, "not a GuideLLM report (no 'benchmarks' list)", column="benchmarks")
    if benchmark is not None:
        if not 0 <= benchmark < len(benches):
            raise InputError(path, f"--benchmark {benchmark}: the report has benchmarks 0..{len(benches) - 1}")
        benches = [benches[benchmark]]
    rows = Rows(path)
    sampled = False
    bodies_model = None
    for b, bench in enumerate(benches):
        bench = mapping(path, bench, f"benchmarks[{b}]")
        reqs = bench.get("requests")
        if not isinstance(reqs, dict):
            raise InputError(path, f"benchmark {b} has no 'requests' breakdown", column="requests")
        sampled = sampled or bench.get("sampled_size") not in (None, {})
        for status in ("successful", "errored", "incomplete"):
            for j, req in enumerate(array(path, reqs.get(status), f"benchmarks[{b}].requests.{status}",
                                          optional=True)):  # fmt: skip
                where = f"benchmarks[{b}].requests.{status}[{j}]"
                row = len(rows) + 1
                req = mapping(path, req, where, row)
                start, first, last = _times(path, req, where, row)
                if start is None:
                    raise InputError(path, f"{where}: no start time", column="start_time", row=row)
                ok = status == "successful"
                body = _body(req)
                if bodies_model is None and isinstance(body.get("model"), str) and body["model"].strip():
                    bodies_model = body["model"].strip()
                prompt = integer(path, req.get("prompt_tokens"), f"{where}.prompt_tokens", row, optional=not ok)
                output = integer(path, req.get("output_tokens"), f"{where}.output_tokens", row, optional=not ok)
                rows.add(row, req.get("request_id") or where, start, prompt or 0, output or 0,
                         first_token_s=first, finish_s=last, ok=ok,
                         reason=None if ok else (str(req.get("error") or status))[:200],
                         prompt_text=_prompt_text(req, body))
    notes = ["client-side times: TTFT and E2E include the HTTP round trip"]
    if sampled:
        notes.append("the report kept a sample of the requests (sampled_size): arrivals between them are missing")
    # the data generator's settings (--data 'prefix_tokens=...,prefix_count=...') give the prompt sharing
    from servelab.traces.prefixes import spec_from_generator

    settings = [{k: v for k, v in doc.items() if k != "benchmarks"},
                [{k: v for k, v in b.items() if k != "requests"} for b in benches]]
    prefix = spec_from_generator(settings, origin=path.name)
    load = load_of(benches[0], path) if len(benches) == 1 else {}
    if load.get("shape") == "closed":
        notes.append(f"GuideLLM {load['strategy']} profile: replayed as a closed loop of {load['users']} users")
    source = {"benchmarks": len(benches), **({"strategy": load["strategy"]} if load else {})}
    settings = {}
    model = _model(doc, benches, bodies_model)
    if model is not None:
        settings["model"] = model
    timeout = client_timeout(doc, benches)
    if timeout is not None:  # httpx's timeout is a read timeout: a request without a first byte by then is dropped
        settings.update(client_timeout_s=timeout, client_timeout_until="first_token")
        notes.append(f"GuideLLM's HTTP timeout {timeout:g} s: replayed as a read timeout (a request without a "
                     f"first token by then is abandoned)")
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes), prefix=prefix,
                    load=load)


def client_timeout(doc: dict, benches: list) -> float | None:
    """The client's HTTP timeout as the report records it (GuideLLM >= 0.4: ``config.backend.timeout``
    of a benchmark; else ``args.backend_kwargs.timeout``), when it is a number of seconds > 0."""
    candidates = [((b.get("config") or {}).get("backend") or {}).get("timeout")
                  for b in benches if isinstance(b, dict) and isinstance(b.get("config"), dict)
                  and isinstance(b["config"].get("backend"), dict)]
    args = doc.get("args") if isinstance(doc.get("args"), dict) else {}
    if isinstance(args.get("backend_kwargs"), dict):
        candidates.append(args["backend_kwargs"].get("timeout"))
    for value in candidates:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return float(value)
    return None


def count_benchmarks(path: Path) -> int:
    """How many benchmarks a report holds (a sweep's strategies: each is imported as a run of its own)."""
    doc = read_json(path)
    benches = doc.get("benchmarks") if isinstance(doc, dict) else None
    return len(benches) if isinstance(benches, list) else 0


def load_of(bench: dict, path: Path) -> dict:
    """A benchmark's load shape from its scheduling strategy (``config.strategy`` in GuideLLM >= 0.4,
    ``args.strategy`` in v0.2): ``synchronous`` is one user, ``concurrent`` ``streams`` users and
    ``throughput`` with ``max_concurrency`` that many (closed loops); ``constant`` and ``poisson``
    send at ``rate`` (open). Empty when the report does not say."""
    holder = bench.get("config") if isinstance(bench.get("config"), dict) else bench.get("args")
    strategy = holder.get("strategy") if isinstance(holder, dict) else None
    if not isinstance(strategy, dict):
        return {}
    kind = strategy.get("type_") or strategy.get("type")
    users = {"synchronous": 1, "concurrent": strategy.get("streams"),
             "throughput": strategy.get("max_concurrency")}.get(kind)
    if users is not None:
        if isinstance(users, bool) or not isinstance(users, int) or users < 1:
            raise InputError(path, f"strategy {kind}: the number of streams must be a whole number >= 1, got {users!r}",
                             column="streams")
        return {"shape": "closed", "users": users, "strategy": kind, "request_rate": None}
    rate = strategy.get("rate")
    return {"shape": "open", "strategy": str(kind), "request_rate": float(rate) if isinstance(rate, (int, float)) else None}
