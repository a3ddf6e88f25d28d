"""vLLM ``vllm bench serve --save-result --save-detailed`` result JSON (client side).

Per request (parallel lists): ``start_times`` (when the client sent it, ``time.perf_counter``),
``ttfts`` and ``latencies`` (seconds after the send), ``input_lens``, ``output_lens``, ``itls``
(gaps between streamed chunks) and ``errors`` (empty when it succeeded). ``start_times`` appeared
in vLLM's benchmark in late 2025; a result without it has no arrival times and cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.base import IMPORTERS, Measured, Rows, read_json
from servelab.fidelity.fields import array, integer, number

LISTS = ("start_times", "ttfts", "latencies", "input_lens", "output_lens")


@IMPORTERS.register("vllm-bench")
def import_vllm_bench(paths: list[Path]) -> Measured:
    if len(paths) != 1:
        raise InputError(paths[1], "vllm-bench takes one result JSON")
    path = paths[0]
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise InputError(path, "not a vLLM benchmark result (expected a JSON object)")
    if "ttfts" not in doc:
        raise InputError(path, "no per-request details ('ttfts'): rerun vllm bench serve with --save-detailed",
                         column="ttfts")
    if "start_times" not in doc:
        raise InputError(path, "no per-request send times ('start_times'; vLLM's benchmark writes them since "
                               "late 2025): arrivals are unknown", column="start_times")
    n = len(array(path, doc["ttfts"], "ttfts"))
    for key in LISTS:
        if not isinstance(doc.get(key), list) or len(doc[key]) != n:
            raise InputError(path, f"needs a list of {n} values like 'ttfts'", column=key)
    errors = array(path, doc.get("errors"), "errors", optional=True, length=n) or [""] * n
    itls = array(path, doc.get("itls"), "itls", optional=True, length=n) or [None] * n
    ids = array(path, doc.get("request_ids"), "request_ids", optional=True, length=n) or list(range(n))
    rows = Rows(path)
    for i in range(n):
        row = i + 1
        start = number(path, doc["start_times"][i], "start_times", row)
        if errors[i] is not None and not isinstance(errors[i], str):
            raise InputError(path, f"needs an error text or '', got {errors[i]!r}"[:120], column="errors", row=row)
        failed = bool(errors[i])
        prompt = integer(path, doc["input_lens"][i], "input_lens", row)
        output = integer(path, doc["output_lens"][i], "output_lens", row, optional=failed) or 0
        gaps = [number(path, g, "itls", row) for g in array(path, itls[i], "itls", row, optional=True)]
        rows.add(row, ids[i], start, prompt, output,
                 first_token_s=None if failed else start + number(path, doc["ttfts"][i], "ttfts", row),
                 finish_s=None if failed else start + number(path, doc["latencies"][i], "latencies", row),
                 ok=not failed, reason=str(errors[i])[:200] if failed else None,
                 itls_s=None if failed else gaps)  # fmt: skip
    settings = {"model": doc.get("model_id")}
    source = {k: doc[k] for k in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                                  "burstiness", "max_concurrency", "duration") if k in doc}
    duration = number(path, doc.get("duration"), "duration", optional=True)
    if duration is not None and duration > 0:  # vLLM's, from before its first Poisson gap: its throughputs' divisor
        source["duration_s"] = duration
    notes = ["client-side times: TTFT and E2E include the HTTP round trip and detokenisation"]
    from servelab.traces.prefixes import spec_from_generator  # --random-prefix-len and the like, if saved

    prefix = spec_from_generator({k: v for k, v in doc.items() if not isinstance(v, list)}, origin=path.name)
    load = _load(doc, path)
    if load["shape"] == "closed":
        notes.append(f"--max-concurrency {load['users']}: replayed as a closed loop of {load['users']} users "
                     "(each request sent when one of theirs ends; think times from the recorded gaps)")
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes), prefix=prefix,
                    load=load)


def _load(doc: dict, path: Path) -> dict:
    """How the benchmark sent: ``request_rate`` (``inf``: all at once; vLLM writes it as the string
    "inf" or as Infinity) and ``max_concurrency`` (null: no cap, an open loop)."""
    rate = doc.get("request_rate")
    try:
        rate = None if rate is None else float(rate)
    except (TypeError, ValueError):
        raise InputError(path, f"request_rate is not a number: {rate!r}", column="request_rate") from None
    load = {"request_rate": None if rate is None or rate == float("inf") else rate}
    cap = doc.get("max_concurrency")
    if cap is None:
        return dict(load, shape="open")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap != int(cap) or cap < 1:
        raise InputError(path, f"max_concurrency must be a whole number >= 1 or null, got {cap!r}",
                         column="max_concurrency")
    return dict(load, shape="closed", users=int(cap))
