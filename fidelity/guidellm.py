"""GuideLLM benchmark report JSON (``guidellm benchmark --output-path report.json``), client side.

``benchmarks[*].requests`` holds ``successful``, ``errored`` and ``incomplete`` request lists. A
request's times are the send (``start_time``, or ``request_start_time`` / ``info.timings.request_start``
in GuideLLM >= 0.4), first and last token (``first_token_time`` / ``info.timings.first_token_iteration``,
``last_token_time`` / ``info.timings.last_token_iteration``), with ``prompt_tokens`` and
``output_tokens``. Every benchmark of the report (a sweep's strategies ran one after another) is
imported as one timeline; ``--benchmark N`` keeps only the N-th (0-based).
"""

from __future__ import annotations

from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.base import IMPORTERS, Measured, Rows, read_json
from servelab.fidelity.fields import array, integer, mapping, number


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


@IMPORTERS.register("guidellm")
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
                prompt = integer(path, req.get("prompt_tokens"), f"{where}.prompt_tokens", row, optional=not ok)
                output = integer(path, req.get("output_tokens"), f"{where}.output_tokens", row, optional=not ok)
                rows.add(row, req.get("request_id") or where, start, prompt or 0, output or 0,
                         first_token_s=first, finish_s=last, ok=ok,
                         reason=None if ok else (str(req.get("error") or status))[:200],
                         prompt_text=req.get("prompt") if isinstance(req.get("prompt"), str) else None)
    notes = ["client-side times: TTFT and E2E include the HTTP round trip"]
    if sampled:
        notes.append("the report kept a sample of the requests (sampled_size): arrivals between them are missing")
    # the data generator's settings (--data 'prefix_tokens=...,prefix_count=...') give the prompt sharing
    from servelab.traces.prefixes import spec_from_generator

    settings = [{k: v for k, v in doc.items() if k != "benchmarks"},
                [{k: v for k, v in b.items() if k != "requests"} for b in benches]]
    prefix = spec_from_generator(settings, origin=path.name)
    return Measured(rows, clock="client", source={"benchmarks": len(benches)}, notes=tuple(notes), prefix=prefix)
