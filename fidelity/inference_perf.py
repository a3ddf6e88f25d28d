"""inference-perf (kubernetes-sigs/inference-perf) per-request lifecycle report, client side.

``per_request_lifecycle_metrics.json`` is a JSON list, one object per request: ``start_time`` and
``end_time`` (the client's monotonic clock, seconds), ``request`` (the request body as JSON text:
``prompt`` or ``messages``, ``max_tokens``, ``ignore_eos``), ``info`` and ``error`` (null, or
``{error_type, error_msg}``). Older reports' ``info`` holds ``input_tokens``, ``output_tokens`` and
``output_token_times``; newer ones ``request_metrics.text.input_tokens`` and ``response_metrics``
(``output_tokens``, ``output_token_times``, ``chunk_times``, the server's ``server_usage``), and each
request its ``stage_id``. The first token is the first of ``output_token_times`` (else of
``chunk_times``).

Token counts: the server's ``usage`` where the report kept it. Else the prompt is the client's count
(``input_tokens``: the model's tokenizer over the prompt) and the output is the request's
``max_tokens`` when it asked for ``ignore_eos`` and succeeded (the server then generates exactly that
many; the client's own count re-tokenises the streamed text and comes out short for random-token
prompts), else the client's count.

``config.yaml``, which inference-perf writes beside the report, gives the model
(``server.model_name``), the load (``load.stages``: a rate per stage, ``constant`` or ``poisson``
sends, an open loop) and the data generator. ``--benchmark N`` keeps stage N (requests whose
``stage_id`` is N). The client's timeout (``load.request_timeout``, else aiohttp's total default of 300 s,
which inference-perf leaves in place) is the setting ``client_timeout_s``, until the last chunk.
"""

from __future__ import annotations

from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows, one_json, read_yaml
from servelab.fidelity.fields import array, integer, json_body, mapping, number, prompt_text

AIOHTTP_TOTAL_TIMEOUT_S = 300.0  # aiohttp.client.DEFAULT_TIMEOUT: ClientTimeout(total=5 * 60), a session's default


def _is_report(probe) -> bool:
    """A JSON list whose first request opens with ``start_time`` and ``end_time`` (inference-perf writes
    them first), then its ``request`` body or ``info`` (after a long prompt, maybe past the probe)."""
    head = probe.head.lstrip()
    return (head.startswith("[") and '"start_time"' in head[:4096] and '"end_time"' in head[:4096]
            and ('"info"' in head or '"request"' in head))


@IMPORTERS.register("inference-perf")
@detects(_is_report, order=35)
def import_inference_perf(paths: list[Path], benchmark: int | None = None) -> Measured:
    path, doc = one_json(paths, "inference-perf takes one per_request_lifecycle_metrics.json", list,
                         "not an inference-perf per-request report (expected a JSON list of requests)")
    cfg_path = path.parent / "config.yaml"  # errors in it name it
    config = _config(cfg_path)
    load_cfg = mapping(cfg_path, config.get("load"), "load", optional=True)
    stages = [mapping(cfg_path, s, "load.stages") for s in array(cfg_path, load_cfg.get("stages"), "load.stages",
                                                                 optional=True)]
    if benchmark is not None:
        if not any(isinstance(r, dict) and r.get("stage_id") is not None for r in doc):
            raise InputError(path, f"--benchmark {benchmark}: the report records no stage_id per request "
                                   "(inference-perf before 2026): import the whole run")
        if not any(isinstance(r, dict) and r.get("stage_id") == benchmark for r in doc):
            raise InputError(path, f"--benchmark {benchmark}: no request of stage {benchmark}", column="stage_id")
    rows = Rows(path)
    counted = {"max_tokens": 0, "client": 0}  # output counts not the server's: said in a note
    for i, req in enumerate(doc):
        row = i + 1
        req = mapping(path, req, f"[{i}]", row)
        if benchmark is not None and req.get("stage_id") != benchmark:
            continue
        _add(rows, path, req, row, counted)
    notes = ["client-side times: TTFT and E2E include the HTTP round trip and detokenisation"]
    if counted["max_tokens"]:
        notes.append(f"output tokens of {counted['max_tokens']} requests: their max_tokens (ignore_eos; the "
                     "client's re-tokenised count is not the server's)")
    if counted["client"]:
        notes.append(f"output tokens of {counted['client']} finished requests: the client's count of the streamed "
                     "text (no server usage recorded)")
    server = mapping(cfg_path, config.get("server"), "server", optional=True)
    settings = {"model": server.get("model_name") or _body_model(path, doc)}
    # inference-perf passes load.request_timeout to aiohttp as a total timeout; without one, aiohttp's session
    # default applies: 300 s for the whole request (aiohttp DEFAULT_TIMEOUT, total=5 * 60)
    timeout = number(cfg_path, load_cfg.get("request_timeout") or config.get("request_timeout"), "request_timeout",
                     optional=True)
    why = "config.yaml request_timeout" if timeout else "none set: aiohttp's default total timeout"
    timeout = timeout or AIOHTTP_TOTAL_TIMEOUT_S
    settings.update(client_timeout_s=timeout, client_timeout_until="finish")
    notes.append(f"inference-perf's client timeout {timeout:g} s ({why}): a request not finished by then is "
                 "abandoned, as the client did")
    load = _load(load_cfg, stages, cfg_path, benchmark)
    source = {"stages": [{k: s.get(k) for k in ("rate", "duration", "concurrency_level") if k in s} for s in stages],
              **({"benchmark": benchmark} if benchmark is not None else {}),
              # the server kind the client talked to (vllm, sglang, tgi, ...): whose defaults apply (vllm_defaults.py)
              **({"server_type": str(server["type"])} if server.get("type") else {})}
    from servelab.traces.prefixes import PrefixSpec

    prefix = None
    data = mapping(cfg_path, config.get("data"), "data", optional=True)
    shared = mapping(cfg_path, data.get("shared_prefix"), "data.shared_prefix", optional=True)
    if shared.get("system_prompt_len"):  # each group's system prompt, then a question from a pool per group
        def count(key: str) -> int:
            return integer(cfg_path, shared.get(key) or 1, f"data.shared_prefix.{key}")

        groups = count("num_groups")
        prefix = PrefixSpec(count("system_prompt_len"), groups, groups * count("num_prompts_per_group"),
                            origin="config.yaml")
        source["generator_data"] = shared
    return Measured(rows, clock="client", settings=settings, source=source, notes=tuple(notes), prefix=prefix,
                    load=load)


def _add(rows: Rows, path: Path, req: dict, row: int, counted: dict) -> None:
    start = number(path, req.get("start_time"), "start_time", row)
    end = number(path, req.get("end_time"), "end_time", row, optional=True)
    info = mapping(path, req.get("info"), "info", row, optional=True)
    response = mapping(path, info.get("response_metrics"), "info.response_metrics", row, optional=True)
    usage = mapping(path, response.get("server_usage") or info.get("server_usage"), "server_usage", row,
                    optional=True)
    body = json_body(path, req.get("request"), "request", row)
    error = req.get("error")
    ok = not error
    times = response.get("output_token_times", info.get("output_token_times"))
    times = [number(path, t, "output_token_times", row) for t in array(path, times, "output_token_times", row,
                                                                         optional=True)]
    if not times:
        times = [number(path, t, "chunk_times", row) for t in array(path, response.get("chunk_times"),
                                                                      "chunk_times", row, optional=True)]
    prompt = integer(path, usage.get("prompt_tokens"), "server_usage.prompt_tokens", row, optional=True)
    output = integer(path, usage.get("completion_tokens"), "server_usage.completion_tokens", row, optional=True)
    if prompt is None or output is None:  # no server usage: the request body and the client's counts
        text = mapping(path, (mapping(path, info.get("request_metrics"), "info.request_metrics", row,
                                      optional=True)).get("text"), "info.request_metrics.text", row, optional=True)
        if prompt is None:
            prompt = integer(path, info.get("input_tokens", text.get("input_tokens")), "info.input_tokens", row,
                             optional=not ok)
        if output is None:
            max_tokens = integer(path, body.get("max_tokens"), "request.max_tokens", row, optional=True)
            if ok and body.get("ignore_eos") is True and max_tokens:
                output = max_tokens
                counted["max_tokens"] += 1
            else:
                output = integer(path, response.get("output_tokens", info.get("output_tokens")),
                                 "info.output_tokens", row, optional=not ok)
                counted["client"] += ok
    reason = None
    if not ok:
        err = error if isinstance(error, dict) else {"error_msg": error}
        reason = f"{err.get('error_type') or 'error'}: {err.get('error_msg') or ''}".strip()[:200]
    itls = None
    if ok and output and len(times) == output:  # one time per token: its gaps are the ITLs
        itls = [b - a for a, b in zip(times, times[1:])]
    rows.add(row, req.get("request_id") or body.get("request_id") or row - 1, start, prompt or 0, output or 0,
             first_token_s=times[0] if ok and times else None, finish_s=end if ok else None, ok=ok,
             reason=reason, itls_s=itls, prompt_text=prompt_text(body))


def _body_model(path: Path, doc: list) -> str | None:
    """The model the first request's body names (a report beside no config.yaml)."""
    model = json_body(path, doc[0].get("request"), "request", 1).get("model") if doc and isinstance(doc[0], dict) else None
    return model if isinstance(model, str) else None


def _config(path: Path) -> dict:
    """inference-perf's ``config.yaml`` (the config it ran with), beside the report; {} without one."""
    data = read_yaml(path) if path.is_file() else None
    return data if isinstance(data, dict) else {}


def _load(load: dict, stages: list[dict], path: Path, benchmark: int | None) -> dict:
    """The load shape: stages of a rate are an open loop (``constant``: evenly spaced sends, ``poisson``);
    stages of a ``concurrency_level`` are a closed loop of that many users."""
    if not load:
        return {}
    if benchmark is not None and benchmark < len(stages):
        stages = [stages[benchmark]]
    kind = str(load.get("type", "constant"))
    users = {s.get("concurrency_level") for s in stages}
    if stages and None not in users and len(users) == 1:
        level = integer(path, users.pop(), "load.stages.concurrency_level")
        return {"shape": "closed", "users": level, "strategy": kind, "request_rate": None}
    rates = [s.get("rate") for s in stages]
    rate = rates[0] if len(rates) == 1 and isinstance(rates[0], (int, float)) else None
    return {"shape": "open", "strategy": kind, "request_rate": float(rate) if rate is not None else None,
            **({"stage_rates": rates} if len(rates) > 1 else {})}
