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


def _first(*values):
    return next((v for v in values if v is not None), None)


def _times(req: dict) -> tuple:
    timings = ((req.get("info") or {}).get("timings") or {}) if isinstance(req.get("info"), dict) else {}
    start = _first(req.get("start_time"), req.get("request_start_time"), timings.get("request_start"))
    first = _first(req.get("first_token_time"), timings.get("first_token_iteration"))
    last = _first(req.get("last_token_time"), timings.get("last_token_iteration"),
                  req.get("end_time"), req.get("request_end_time"), timings.get("request_end"))
    return start, first, last


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
        reqs = bench.get("requests")
        if not isinstance(reqs, dict):
            raise InputError(path, f"benchmark {b} has no 'requests' breakdown", column="requests")
        sampled = sampled or bench.get("sampled_size") not in (None, {})
        for status in ("successful", "errored", "incomplete"):
            for j, req in enumerate(reqs.get(status) or []):
                where = f"benchmarks[{b}].requests.{status}[{j}]"
                start, first, last = _times(req)
                if start is None:
                    raise InputError(path, f"{where}: no start time", column="start_time")
                ok = status == "successful"
                prompt = req.get("prompt_tokens")
                output = req.get("output_tokens")
                if ok and (prompt is None or output is None):
                    raise InputError(path, f"{where}: no token counts", column="prompt_tokens")
                rows.add(len(rows) + 1, req.get("request_id") or where, float(start), int(prompt or 0),
                         int(output or 0), first_token_s=None if first is None else float(first),
                         finish_s=None if last is None else float(last), ok=ok,
                         reason=None if ok else (str(req.get("error") or status))[:200])
    notes = ["client-side times: TTFT and E2E include the HTTP round trip"]
    if sampled:
        notes.append("the report kept a sample of the requests (sampled_size): arrivals between them are missing")
    load = load_of(benches[0], path) if len(benches) == 1 else {}
    if load.get("shape") == "closed":
        notes.append(f"GuideLLM {load['strategy']} profile: replayed as a closed loop of {load['users']} users")
    source = {"benchmarks": len(benches), **({"strategy": load["strategy"]} if load else {})}
    return Measured(rows, clock="client", source=source, notes=tuple(notes), load=load)


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
