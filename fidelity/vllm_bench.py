"""vLLM ``vllm bench serve --save-result --save-detailed`` result JSON (client side).

Per request (parallel lists): ``start_times`` (when the client sent it, ``time.perf_counter``),
``ttfts`` and ``latencies`` (seconds after the send), ``input_lens``, ``output_lens``, ``itls``
(gaps between streamed chunks) and ``errors`` (empty when it succeeded). ``start_times`` and
``latencies`` appeared in vLLM's benchmark in late 2025. An older result's latencies are the TTFT
plus the chunk gaps; its sends are known only where the client did not pace them
(``request_rate`` inf): all at once, or with ``max_concurrency`` C each request as one of the C
slots freed (the benchmark's semaphore, in list order). A paced older result (a finite rate: random
gaps) recorded no arrival times: they are drawn from the client's own process (``_paced_sends``), and
run.json ``load.arrivals`` says ``regenerated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, one_json
from servelab.fidelity.fields import array, integer, number

LISTS = ("start_times", "ttfts", "latencies", "input_lens", "output_lens")


def _is_vllm_bench(probe) -> bool:
    """The per-request lists, or (a result saved without --save-detailed) vLLM's summary figures alone:
    detected still, so that the importer says what is missing. A big JSON document's keys may come after
    the first bytes: the whole file is read then."""
    head = probe.head
    if head.lstrip().startswith("{") and len(probe.raw) == probe.size:
        head = probe.path.read_text(errors="replace")
    return any(k in head for k in ('"ttfts"', '"start_times"', '"input_lens"', '"mean_ttft_ms"', '"mean_e2el_ms"'))


@IMPORTERS.register("vllm-bench")
@detects(_is_vllm_bench, order=40)
def import_vllm_bench(paths: list[Path]) -> Measured:
    path, doc = one_json(paths, "vllm-bench takes one result JSON", dict,
                         "not a vLLM benchmark result (expected a JSON object)")
    return measured_from_result(path, doc, VLLM)


@dataclass(frozen=True)
class Client:
    """The benchmark client that wrote a result of these per-request lists, in its own words for the
    notes and errors: ``older`` says why the send times are missing, ``rerun`` how to get them."""

    name: str
    older: str
    rerun: str
    summary: str


VLLM = Client("vllm bench serve", "vLLM before late 2025", "rerun with a newer vllm bench serve",
              "rerun vllm bench serve with --save-result --save-detailed")


def measured_from_result(path: Path, doc: dict, client: Client, row0: int = 0) -> Measured:
    """One result's requests (``row0``: rows before it in the file, for the row numbers of errors)."""
    n = _count(doc, path, client)
    errors = array(path, doc.get("errors"), "errors", optional=True, length=n) or [""] * n
    itls = array(path, doc.get("itls"), "itls", optional=True, length=n) or [None] * n
    rebuilt: list[str] = []
    sends_recorded = "start_times" in doc
    if "start_times" not in doc or "latencies" not in doc:  # vLLM before late 2025 saved neither
        doc = dict(doc, **_older_result(doc, path, n, errors, itls, rebuilt, client))
    for key in LISTS:
        if not isinstance(doc.get(key), list) or len(doc[key]) != n:
            raise InputError(path, f"needs a list of {n} values like 'ttfts'", column=key)
    ids = array(path, doc.get("request_ids"), "request_ids", optional=True, length=n) or list(range(n))
    rows = Rows(path)
    for i in range(n):
        row = row0 + i + 1
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
    settings = {"model": doc.get("model_id") or doc.get("model")}
    source = {k: doc[k] for k in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                                  "burstiness", "max_concurrency", "duration", "dataset_name") if k in doc}
    duration = number(path, doc.get("duration"), "duration", optional=True)
    if duration is not None and duration > 0:  # vLLM's, from before its first Poisson gap: its throughputs' divisor
        source["duration_s"] = duration
    notes = ["client-side times: TTFT and E2E include the HTTP round trip and detokenisation", *rebuilt]
    from servelab.traces.prefixes import spec_from_generator  # --random-prefix-len and the like, if saved

    prefix = spec_from_generator({k: v for k, v in doc.items() if not isinstance(v, list)}, origin=path.name)
    load = _load(doc, path)
    if not sends_recorded and (load["request_rate"] is not None or doc.get("ramp_up_strategy")):  # (_paced_sends)
        load["arrivals"] = "regenerated"
    if load["shape"] == "closed":
        notes.append(f"--max-concurrency {load['users']}: replayed as a closed loop of {load['users']} users "
                     "(each request sent when one of theirs ends; think times from the recorded gaps)")
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes), prefix=prefix,
                    load=load)


def _count(doc: dict, path: Path, client: Client) -> int:
    """How many requests the per-request lists hold: the length most of them have (``input_lens``'s on
    a tie), so that the error names the list that differs. A result without the lists is a summary."""
    lists = {k: doc[k] for k in (*LISTS, "errors", "itls") if isinstance(doc.get(k), list)}
    if not lists:
        summary = "mean_ttft_ms" in doc or "mean_e2el_ms" in doc
        raise InputError(path, ("a summary only (mean_ttft_ms, ...; saved without --save-detailed): "
                                if summary else "") + "no per-request lists (ttfts, input_lens, output_lens, "
                         f"start_times) to replay; {client.summary}", column="ttfts")
    if "ttfts" not in lists:
        raise InputError(path, f"no per-request 'ttfts' list (the result has {', '.join(lists)}): the file was "
                               "cut or edited; without each request's first token it cannot be replayed",
                         column="ttfts")
    lengths = [len(v) for v in lists.values()]
    n = max(sorted(set(lengths)), key=lambda m: (lengths.count(m), m == len(lists.get("input_lens", ()))))
    for key, values in lists.items():
        if len(values) != n:
            like = [k for k, v in lists.items() if len(v) == n]
            raise InputError(path, f"needs a list of {n} values like {', '.join(repr(k) for k in like)}, got "
                                   f"{len(values)}", column=key)
    return n


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


def _older_result(doc: dict, path: Path, n: int, errors: list, itls: list, notes: list[str], client: Client) -> dict:
    """``latencies`` and ``start_times`` of a result saved without them (vLLM before late 2025, SGLang's
    bench_serving: ``notes`` says how they were rebuilt)."""
    out: dict = {}
    failed = [bool(e) for e in errors]
    load = _load(doc, path)
    if "start_times" not in doc and "request_rate" not in doc:
        raise InputError(path, f"no per-request send times ('start_times': {client.older}) and no request_rate "
                               f"(request_rate not recorded): arrivals are unknown; {client.rerun}",
                         column="start_times")
    if "latencies" not in doc:
        if "itls" not in doc:
            raise InputError(path, "no per-request 'latencies' and no 'itls' to rebuild them from", column="latencies")
        ttfts = [number(path, t, "ttfts", i + 1) for i, t in enumerate(doc["ttfts"])]
        out["latencies"] = [0.0 if failed[i] else ttfts[i] + sum(number(path, g, "itls", i + 1) for g in
                                                                 array(path, itls[i], "itls", i + 1, optional=True))
                            for i in range(n)]
        notes.append(f"no per-request latencies ({client.older}): each is the TTFT plus the chunk gaps (itls)")
    if "start_times" in doc:
        return out
    latencies = [number(path, v, "latencies", i + 1) for i, v in enumerate(out.get("latencies") or doc["latencies"])]
    if load["request_rate"] is not None or doc.get("ramp_up_strategy"):
        out["start_times"] = _paced_sends(doc, path, load, latencies, failed, notes, client)
        return out
    if load["shape"] == "open":
        out["start_times"] = [0.0] * n
        notes.append(f"no per-request send times ({client.older}): request_rate inf without "
                     "--max-concurrency sends every request at once, at time 0")
        return out
    out["start_times"] = _through_slots([0.0] * n, _held(latencies, failed), load["users"])
    notes.append(f"no per-request send times ({client.older}): request_rate inf with --max-concurrency "
                 f"{load['users']}: each request sent when one of the {load['users']} slots freed, in list order")
    return out


def _held(latencies: list[float], failed: list[bool]) -> list[float]:
    """How long each request held its client slot: its latency; a failed request frees it when it fails."""
    return [0.0 if bad else latency for latency, bad in zip(latencies, failed)]


def _through_slots(paced: list[float], held: list[float], users: int) -> list[float]:
    """Send times of requests the client paced at ``paced`` through ``users`` slots (vLLM bench's semaphore,
    in list order): each waits for its pacing and for a slot to free."""
    import heapq

    slots: list[float] = []  # when each busy slot frees
    starts = []
    for at, hold in zip(paced, held):
        start = max(at, heapq.heappop(slots)) if len(slots) >= users else at
        starts.append(start)
        heapq.heappush(slots, start + hold)
    return starts


def _paced_sends(doc: dict, path: Path, load: dict, latencies: list[float], failed: list[bool], notes: list[str],
                 client: Client) -> list[float]:
    """Send times for a paced result that recorded none, drawn from the client's own process: vLLM's
    benchmark (and SGLang's) sends request i + 1 a gamma-distributed gap after request i (shape
    ``burstiness``, 1 = Poisson; mean 1 / ``request_rate``), through ``max_concurrency`` slots when capped.
    The draw is seeded (0), and its time scale fitted so that the run lasts the ``duration`` it recorded
    (first send to last response), which pins the achieved rate. The sends are not the real ones: means
    compare, single requests do not (run.json ``load.arrivals`` says so, and validate --real)."""
    import numpy as np

    n = len(latencies)
    burst = number(path, doc.get("burstiness", 1.0), "burstiness", optional=True)
    burst = 1.0 if burst is None else burst
    rates, how = _rates(doc, path, load["request_rate"], n)
    if (rates <= 0).any() or burst < 0:
        raise InputError(path, f"request rates and burstiness must be above 0, got {how} and {burst}",
                         column="request_rate")
    gaps = (1.0 / rates[:-1] if burst == 0 else  # burstiness 0: a fixed interval (a benchmark that allows it)
            np.random.default_rng(0).gamma(burst, 1.0 / (rates[:-1] * burst)))
    paced = np.concatenate([[0.0], np.cumsum(gaps)])
    held = _held(latencies, failed)
    users = load.get("users")

    def sends(scale: float) -> list[float]:
        paced_at = (paced * scale).tolist()
        return paced_at if users is None else _through_slots(paced_at, held, users)

    def end(scale: float) -> float:
        return max(s + h for s, h in zip(sends(scale), held))

    scale, fitted = 1.0, ""
    duration = number(path, doc.get("duration"), "duration", optional=True)
    if duration is not None and n > 1 and end(0.0) < duration:
        lo, hi = 0.0, 1.0
        while end(hi) < duration and hi < 1e6:
            lo, hi = hi, hi * 2
        for _ in range(60):  # the run's end grows with the scale: bisect to its recorded duration
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if end(mid) < duration else (lo, mid)
        scale = (lo + hi) / 2
        fitted = f", its time scale fitted (x{scale:.3f}) so the run lasts its recorded {duration:.3f} s"
    notes.append(f"no per-request send times ({client.older}) and the client paced its sends: arrivals regenerated "
                 f"as its process (gamma gaps of burstiness {burst:g} at {how}, seed 0{fitted}"
                 f"{f', through {users} slots' if users else ''}); means compare, single requests do not")
    return sends(scale)


def _rates(doc: dict, path: Path, rate: float | None, n: int):
    """The rate each request's gap was drawn at (vLLM's get_current_request_rate): ``request_rate``, or with
    ``ramp_up_strategy`` ``linear`` / ``exponential`` from ``ramp_up_start_rps`` to ``ramp_up_end_rps`` by the
    request's place in the run; and the words for it."""
    import numpy as np

    strategy = doc.get("ramp_up_strategy")
    if not strategy:
        return np.full(n, float(rate)), f"{rate:g} req/s"
    if strategy not in ("linear", "exponential"):
        raise InputError(path, f"unknown ramp_up_strategy {strategy!r} (linear or exponential)",
                         column="ramp_up_strategy")
    start = number(path, doc.get("ramp_up_start_rps"), "ramp_up_start_rps")
    end = number(path, doc.get("ramp_up_end_rps"), "ramp_up_end_rps")
    progress = np.arange(n) / max(n - 1, 1)
    if strategy == "linear":
        return start + (end - start) * progress, f"{start:g} to {end:g} req/s (linear ramp-up)"
    if start <= 0:
        raise InputError(path, f"an exponential ramp-up needs ramp_up_start_rps above 0, got {start}",
                         column="ramp_up_start_rps")
    return start * (end / start) ** progress, f"{start:g} to {end:g} req/s (exponential ramp-up)"
