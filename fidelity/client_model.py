"""A model of what lies between a benchmark client and the engine, applied after a replay (docs/fidelity.md).

A replay's times are the engine's: arrival at the engine, first and last token out of it. A run
timed at the client (``clock: client``: ``vllm bench serve``, GuideLLM, ``servelab bench``) also
holds the HTTP round trip, the API server's parsing and tokenisation, and each token's way back
(detokenisation, the server-sent event). The client model adds them to simulated per-request times:

- ``request_s + prompt_token_s * prompt_tokens``: the time of a lone request outside the engine
  (HTTP, tokenisation, the first token's way back), which delays its first and last token alike;
- ``stream_s * open_streams``: the load term. The API server is one process: while it serves other
  requests, a new request's parsing, tokenisation and first chunk wait their turn, so the outside
  time grows with the other requests in its way when it is sent. Which ones is the model's ``load``:
  ``streams`` (every other request open: sent, its last token not yet read; live vLLM on CPU, whose
  API server streaming on a small CPU slows everything: 4.4 ms alone, 5.2-8.4 ms under load) or
  ``admitting`` (the others still waiting for their first token: being parsed, tokenised, queued or
  prefilled; a GPU server's, whose outside time grows with requests sent at once, 40 at once: 14-20
  ms against 10 alone, but not with streams in steady decode: 8 open at a constant rate, no more than
  alone). Counted on the replay's own timeline: the other requests sent before it (arrival order)
  whose client-side finish (``streams``) or first token (``admitting``), engine time + their lone
  outside time, is after its send. Fitted only where the observations span several load levels,
  else 0;
- ``token_s``: the API server's own work per streamed token. One API server process streams every
  response, so the tokens of all requests queue for it: a single-server FIFO queue whose arrivals are
  the engine's token times and whose service takes ``token_s`` each. A token's extra delay is its
  wait in that queue; at low load there is none (``token_s`` itself is already inside the lone
  request's time above), under many concurrent streams the queue grows and the API server's
  throughput (1 / ``token_s`` tokens a second) caps the output the client sees.

- ``api_request_s + api_prompt_token_s * prompt_tokens``: the API server's own time for a request, which
  vLLM's own TTFT and E2E (its OpenTelemetry spans, ``/metrics``' TTFT and E2E histograms) include and the
  engine's do not (nor the engine core's queue + prefill histograms, which a live fit uses: a model fitted
  on those holds this time in its outside time already, and has none of it apart): from
  its receipt of the request (tokenisation, the hand-over to the engine core, where the engine's time
  begins) and, at the other end, its processing of the token the engine made. Measured on requests
  that ran alone, from their spans (``otel.api_server_observations``): ~1.9 ms on vLLM 0.11 (H100 host).
  The client's times hold it too, so client-side times are the engine's + this + the terms above
  (whose observations, client minus vLLM's own times, leave it out); a server-side run timed by the
  API server (spans) is compared with the engine's times + this (``with_api_server_times``).

It is a post-pass over the replay's per-request times (and its token log, when there is one: else a
request's tokens are spread evenly between its first and last), not part of the engine's loop: the
engine still sees each request at its send time (the outside time is not taken off its arrival) and
a closed loop's next turn leaves when the engine finished the last (not when the client read it).
``fit_client`` fits the terms to observations with both client and engine times; ``DEFAULTS``
holds the calibrated model per server kind, with where its numbers come from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from servelab.common.errors import InputError, ServelabError

# the load term's count (ClientModel.load), and the observation key each is fitted on
LOADS = {"streams": "open_streams", "admitting": "admitting"}
CLIENT_COLUMNS = ("client_first_token_s", "client_finish_s", "client_ttft_s", "client_tpot_s", "client_e2e_s")


@dataclass(frozen=True)
class ClientModel:
    server: str  # the server kind it describes ("vllm")
    request_s: float  # a lone request's time outside the engine, constant part (seconds)
    prompt_token_s: float  # ... and per prompt token (tokenisation)
    token_s: float = 0.0  # the API server's work per streamed token (its single-server queue)
    provenance: str = ""  # where the numbers come from and how they were fitted
    stream_s: float = 0.0  # the load term: outside time per other request in the way at the request's send
    load: str = "streams"  # which others are in its way: every open one (streams), or those before their first token
    api_request_s: float = 0.0  # the API server's own time for a request inside vLLM's own TTFT/E2E: constant
    api_prompt_token_s: float = 0.0  # ... and per prompt token

    def __post_init__(self) -> None:
        for name in ("request_s", "prompt_token_s", "token_s", "stream_s", "api_request_s", "api_prompt_token_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ServelabError(f"client model {name} must be a finite number of seconds >= 0, got {value!r}")
        if self.load not in LOADS:
            raise ServelabError(f"client model load must be one of {', '.join(LOADS)}, got {self.load!r}")

    def outside_s(self, prompt_tokens: np.ndarray, open_streams: np.ndarray | float = 0.0) -> np.ndarray:
        return self.request_s + self.prompt_token_s * prompt_tokens + self.stream_s * open_streams

    @property
    def has_api_server(self) -> bool:
        """Whether it holds the API server's own time apart (a model fitted on the engine core's times has none)."""
        return bool(self.api_request_s or self.api_prompt_token_s)

    def api_server_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """The API server's own time for requests of ``prompt_tokens`` (inside vLLM's own TTFT and E2E)."""
        return self.api_request_s + self.api_prompt_token_s * prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The calibrated model per server kind, fitted when this module loads on the observations shipped
# beside it (client_calibration_<kind>.json, with where they come from): ``vllm`` a GPU server's,
# ``vllm-cpu`` the CPU server's of the live tests (its API server shares a small machine's CPUs).
DEFAULTS: dict[str, ClientModel] = {}
CALIBRATION = Path(__file__).with_name("client_calibration_vllm.json")
CPU_CALIBRATION = Path(__file__).with_name("client_calibration_vllm-cpu.json")


def open_streams(send_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """Per request, how many other requests were open (sent, not yet ended) when it was sent: those
    before it in send order (ties: row order) whose end is not before its send. ``end_s`` NaN: never
    ended (open to the end of the run); an end before its own send counts as at its send."""
    n = send_s.size
    if n == 0:
        return np.zeros(0)
    order = np.argsort(send_s, kind="stable")
    rank = np.empty(n, dtype=np.float64)
    rank[order] = np.arange(n, dtype=np.float64)  # requests sent before it
    ends = np.sort(np.maximum(np.where(np.isfinite(end_s), end_s, np.inf), send_s))
    # ended strictly before its send: each of those was sent before it (an end is never before its send)
    ended = np.searchsorted(ends, send_s, side="left")
    return rank - ended


def api_server_token_s(runs: list[dict]) -> float:
    """The API server's own CPU per streamed token, from runs that measured its process's CPU time: NNLS
    of ``api_cpu_s`` on ``wall_s`` (its event loop's polling, a share of a CPU whatever the load),
    ``tokens`` and ``requests``; the tokens' coefficient is ``token_s``."""
    from scipy.optimize import nnls

    try:
        a = np.array([[float(r["wall_s"]), float(r["tokens"]), float(r["requests"])] for r in runs])
        b = np.array([float(r["api_cpu_s"]) for r in runs])
    except (KeyError, TypeError, ValueError):
        raise ServelabError("api_server_cpu runs need wall_s, tokens, requests and api_cpu_s (numbers)") from None
    if len(runs) < 3 or np.linalg.matrix_rank(a) < 3:
        raise ServelabError("api_server_cpu: fitting the API server's CPU per token needs runs that vary the "
                            "tokens apart from the wall time and the requests (3 or more)")
    return float(nnls(a, b)[0][1])


def fit_client(observations: list[dict], server: str = "vllm", provenance: str = "",
               api_server_runs: list[dict] | None = None, load: str = "streams") -> ClientModel:
    """Non-negative least squares (scipy's NNLS) of the client-minus-engine TTFT on ``1,
    prompt_tokens, open_streams`` for ``request_s``, ``prompt_token_s`` and ``stream_s``.
    ``stream_s`` is fitted when the observations record ``open_streams`` (the mean number of other
    streams open at a request's send) at two levels or more that the other terms cannot explain
    (the design matrix has full rank); else it is 0 and the fit says why. ``token_s`` is the mean,
    over observations that have decode times, of the client-minus-engine decode time per gap
    (``(client_decode_s - server_decode_s) / (output_tokens - 1)``, at least 0): the delay the API
    server adds per streamed token beyond the engine, which only shows under load. Each observation
    may carry a ``weight`` (requests behind a mean). ``api_server_runs``: runs that measured the API
    server process's CPU time (``api_server_token_s``): then ``token_s`` is its CPU per streamed token,
    the service time of the queue, which the decode times of lightly loaded runs cannot show. ``load``:
    what the load term counts (``streams``: the observations' ``open_streams``; ``admitting``: their
    ``admitting``, the other requests not yet at their first token at a send)."""
    from scipy.optimize import nnls

    if load not in LOADS:
        raise ServelabError(f"client model load must be one of {', '.join(LOADS)}, got {load!r}")
    key = LOADS[load]
    rows, target, weights = [], [], []
    with_load = [i for i, obs in enumerate(observations) if obs.get(key) is not None]
    if with_load and len(with_load) != len(observations):
        missing = next(i for i in range(len(observations)) if i not in set(with_load))
        raise ServelabError(f"client observation {missing} has no {key} while others have: "
                            f"give every observation its load or none")
    for i, obs in enumerate(observations):
        try:
            p, c, s = float(obs["prompt_tokens"]), float(obs["client_ttft_s"]), float(obs["server_ttft_s"])
            count = float(obs[key]) if with_load else 0.0
        except (KeyError, TypeError, ValueError):
            raise ServelabError(f"client observation {i} needs prompt_tokens, client_ttft_s and server_ttft_s "
                                f"(numbers; {key} too where given): {obs}") from None
        w = float(obs.get("weight", 1.0))
        rows.append([1.0, p, count])
        target.append(c - s)
        weights.append(np.sqrt(w))
    if len(rows) < 2 or len({r[1] for r in rows}) < 2:
        raise ServelabError("fitting a client model needs observations at two prompt lengths or more")
    a, b = np.asarray(rows), np.asarray(target)
    w = np.asarray(weights)
    identified = bool(with_load) and np.linalg.matrix_rank(a) == 3
    columns = 3 if identified else 2
    x = nnls(a[:, :columns] * w[:, None], b * w)[0]
    request_s, prompt_token_s = float(x[0]), float(x[1])
    stream_s = float(x[2]) if identified else 0.0
    per_gap = [max(0.0, (float(o["client_decode_s"]) - float(o["server_decode_s"])) / (float(o["output_tokens"]) - 1))
               for o in observations if o.get("client_decode_s") is not None and o.get("server_decode_s") is not None
               and float(o.get("output_tokens") or 0) > 1]
    token_s = float(np.mean(per_gap)) if per_gap else 0.0
    if api_server_runs:
        token_s = api_server_token_s(api_server_runs)
    residual = b - a @ np.array([request_s, prompt_token_s, stream_s])
    load_note = ("" if identified else f"; stream_s: no observation records {key}, set to 0" if not with_load
                 else "; stream_s: the observations do not separate the load from the other terms (one load level), set to 0")
    token_note = (f"; token_s: the API server's CPU per streamed token over {len(api_server_runs)} runs"
                  if api_server_runs else "" if per_gap else "; token_s: no observation with decode times, set to 0")
    fit = (f"fitted on {len(rows)} observations (outside time residual max {np.abs(residual).max() * 1e3:.2f} ms)"
           + load_note + token_note)
    return ClientModel(server, request_s, prompt_token_s, token_s,
                       provenance=f"{provenance}; {fit}" if provenance else fit, stream_s=stream_s, load=load)


def fit_api_server(observations: list[dict]) -> tuple[float, float, str]:
    """``(api_request_s, api_prompt_token_s, note)``: NNLS of the API server's time (each observation's
    ``first_s`` and ``last_s``, otel.api_server_observations) on ``1, prompt_tokens``."""
    from scipy.optimize import nnls

    try:
        rows = [(float(o["prompt_tokens"]), float(o[k])) for o in observations for k in ("first_s", "last_s")]
    except (KeyError, TypeError, ValueError):
        raise ServelabError("API server observations need prompt_tokens, first_s and last_s (numbers)") from None
    if len({p for p, _ in rows}) < 2:
        raise ServelabError("fitting the API server's time needs observations at two prompt lengths or more")
    a = np.array([[1.0, p] for p, _ in rows])
    b = np.array([t for _, t in rows])
    (fixed, per), _ = nnls(a, b)
    residual = b - a @ np.array([fixed, per])
    note = (f"API server time fitted on {len(observations)} lone requests' first and last tokens (prompts "
            f"{int(a[:, 1].min()):,}-{int(a[:, 1].max()):,} tokens; residual median {np.median(np.abs(residual)) * 1e3:.2f} ms)")
    return float(fixed), float(per), note


def _with_api_server(model: ClientModel, observations: list[dict], provenance: str) -> ClientModel:
    fixed, per, note = fit_api_server(observations)
    return replace(model, api_request_s=fixed, api_prompt_token_s=per,
                   provenance=f"{model.provenance}; {note}, from {provenance}")


_vllm = json.loads(CALIBRATION.read_text())
DEFAULTS["vllm"] = _with_api_server(fit_client(
    _vllm["observations"], "vllm", load="admitting",
    provenance="vLLM 0.11 on an H100 (CodeLlama-34B) against GuideLLM 0.6 over a cluster network, "
               "fidelity/client_calibration_vllm.json: 10 benchmarks of two sweeps (one request at a time to 40 at "
               "once) and 10 request records, the client's times against the same requests' OpenTelemetry spans "
               "(inference-sim's ground truth, bench/RESULTS_fidelity.md session 21)"),
    _vllm["api_server"]["observations"], _vllm["api_server"]["about"])
_cpu = json.loads(CPU_CALIBRATION.read_text())
DEFAULTS["vllm-cpu"] = fit_client(
    _cpu["observations"], "vllm-cpu", api_server_runs=_cpu["api_server_cpu"]["runs"],
    provenance="vLLM 0.32 CPU (the tiny CI model, API server pinned off the worker's CPU, a loaded 2-vCPU VM), "
               "fidelity/client_calibration_vllm-cpu.json: 4 lone-request levels (16-1,536 prompt tokens) and 4 "
               "closed loops of 1-16 users (0-11 other streams open at a send), client times against vLLM's "
               "engine-side /metrics (bench/RESULTS_fidelity.md, attempt b1); its 12 live runs are held out; "
               "token_s from the API server process's CPU time in 10 closed loops (session 21)")


def fit_from_sources(sources: list[Path], server: str = "vllm", load: str = "streams") -> ClientModel:
    """``servelab fit --client``'s model from its sources: observation JSON files and live run directories
    give the client's terms (``fit_client``); vLLM OpenTelemetry span files (``llm_request`` spans with
    vLLM's latency breakdown) give the API server's own time, from their requests that ran alone
    (``otel.api_server_observations``, ``fit_api_server``). Span files alone keep the server kind's
    calibrated client terms and replace its API server time (a host of another speed). A live run's terms
    were fitted against the engine core's own times and hold the API server's time already: spans beside
    one are refused, rather than counting it twice."""
    from servelab.fidelity.otel import api_server_observations

    sources = [Path(p) for p in sources]
    spans = [p for p in sources if _is_span_file(p)]
    rest = [p for p in sources if p not in spans]
    provenance = "servelab fit --client " + " ".join(map(str, sources))
    live = next((p for p in rest if p.is_dir()), None)
    if spans and live is not None:
        raise ServelabError(f"fit --client: {live} is a live run, whose client terms were fitted against the engine "
                            f"core's own times and so hold the API server's time already; fit the spans "
                            f"({spans[0]}) with observation files, or alone")
    if rest:
        observations = [o for src in rest for o in observations_from(src)]
        runs = [r for src in rest for r in api_server_runs_from(src)]
        model = fit_client(observations, server, provenance=provenance, api_server_runs=runs or None, load=load)
    elif server in DEFAULTS:
        base = DEFAULTS[server]
        model = replace(base, provenance=f"{provenance}; client terms: the calibrated {server} model's ({base.provenance})")
    else:
        raise ServelabError(f"fit --client with span files alone keeps a server kind's calibrated client terms, and "
                            f"'{server}' has none (known: {', '.join(sorted(DEFAULTS))}); give client observations too")
    if spans:
        observations = [o for p in spans for o in api_server_observations(p)]
        if not observations:
            raise InputError(spans[0], "no request in the spans ran alone (no other request's span overlapping it) "
                                       "with vLLM's latency breakdown (time_in_queue, time_in_model_prefill, "
                                       "time_in_model_inference): the API server's own time cannot be told apart")
        model = _with_api_server(model, observations, " ".join(map(str, spans)))
    return model


def _is_span_file(path: Path) -> bool:
    """Whether ``path`` is a file that run import reads as vLLM's OpenTelemetry spans."""
    from servelab.fidelity.base import detect_format

    if not path.is_file():
        return False
    try:
        return detect_format([path]) == "otel"
    except ServelabError:
        return False


def resolve(spec: str) -> ClientModel:
    """A server kind of ``DEFAULTS`` (``vllm``, ``vllm-cpu``) or a JSON file written by ``servelab fit --client``."""
    if spec in DEFAULTS:
        return DEFAULTS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ServelabError(f"client model '{spec}': neither a server kind ({', '.join(sorted(DEFAULTS))}) nor a file")
    try:
        data = json.loads(path.read_text())
        return ClientModel(**{k: data[k] for k in ("server", "request_s", "prompt_token_s", "token_s", "provenance",
                                                   "stream_s", "load", "api_request_s", "api_prompt_token_s")
                              if k in data})
    except (json.JSONDecodeError, TypeError) as err:
        raise InputError(path, f"not a client model JSON ({err})") from None


def save(model: ClientModel, path: str | Path) -> None:
    from servelab.common.atomic import atomic_path

    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(json.dumps(model.to_dict(), indent=2, sort_keys=True) + "\n")


# -- the post-pass -------------------------------------------------------------------------------
def api_server_waits(token_times: np.ndarray, token_s: float) -> np.ndarray:
    """Each token's wait in one FIFO server of service ``token_s`` (tokens in arrival order; Lindley:
    departure_i = max(arrival_i, departure_{i-1}) + s, in closed form with a running maximum)."""
    if token_times.size == 0 or token_s == 0:
        return np.zeros_like(token_times)
    order = np.argsort(token_times, kind="stable")
    t = token_times[order]
    k = np.arange(t.size, dtype=np.float64)
    departure = token_s * (k + 1) + np.maximum.accumulate(t - token_s * k)
    waits = np.empty_like(t)
    waits[order] = departure - t - token_s
    return waits


def with_client_columns(requests: pa.Table, model: ClientModel, tokens: pa.Table | None = None) -> pa.Table:
    """``requests`` (a replay's table) with the simulated client-side times appended (CLIENT_COLUMNS):
    the first and last token as the client would read them, and TTFT / TPOT / E2E from them (null
    where the engine-side value is null). ``tokens``: the replay's token log (request_id, token_index,
    time_s), else each request's tokens are spread evenly over its decode."""
    rid = requests.column("request_id").to_numpy(zero_copy_only=False)
    arrival = _f(requests, "arrival_s")
    first = _f(requests, "first_token_s")
    finish = _f(requests, "finish_s")
    out_tokens = requests.column("generated_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    prompt = requests.column("prompt_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    api = model.api_server_s(prompt)  # the API server's own time, then the client's beyond vLLM's own times
    outside = api + model.outside_s(prompt)
    if model.stream_s > 0:  # the load term, counted with each request's lone client-side finish or first token
        end = finish if model.load == "streams" else first
        end = np.where(np.isfinite(end), end + outside, _f(requests, "refused_s")
                       if "refused_s" in requests.column_names else np.nan)
        outside = api + model.outside_s(prompt, open_streams(arrival, end))
    wait_first = np.zeros(len(rid))
    wait_last = np.zeros(len(rid))
    if model.token_s > 0:
        owner, times, is_first, is_last = _token_times(rid, first, finish, out_tokens, tokens)
        waits = api_server_waits(times, model.token_s)
        row = {r: i for i, r in enumerate(rid.tolist())}
        rows = np.fromiter((row[o] for o in owner.tolist()), dtype=np.int64, count=owner.size)
        wait_first[rows[is_first]] = waits[is_first]
        wait_last[rows[is_last]] = waits[is_last]
    c_first = first + outside + wait_first
    c_finish = finish + outside + wait_last
    n_out = requests.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (c_finish - c_first) / (n_out - 1), 0.0)
    tpot[~np.isfinite(finish)] = np.nan
    columns = {"client_first_token_s": c_first, "client_finish_s": c_finish, "client_ttft_s": c_first - arrival,
               "client_tpot_s": tpot, "client_e2e_s": c_finish - arrival}
    for name in CLIENT_COLUMNS:
        values = columns[name]
        requests = requests.append_column(pa.field(name, pa.float64()),
                                          pa.array(values, pa.float64(), mask=~np.isfinite(values)))
    return requests


def _f(table: pa.Table, name: str) -> np.ndarray:
    return pc.fill_null(table.column(name).cast(pa.float64()), float("nan")).to_numpy(zero_copy_only=False)


def _token_times(rid, first, finish, out_tokens, tokens):
    """Every output token's engine time: (owner request id, time, is first token, is last token)."""
    if tokens is not None and tokens.num_rows:
        owner = tokens.column("request_id").to_numpy(zero_copy_only=False)
        times = tokens.column("time_s").to_numpy(zero_copy_only=False).astype(np.float64)
        index = tokens.column("token_index").to_numpy(zero_copy_only=False)
        counts = dict(zip(rid.tolist(), out_tokens.tolist()))
        last = np.fromiter((counts.get(o, -1) for o in owner.tolist()), dtype=np.int64, count=owner.size)
        return owner, times, index == 1, index == last
    owners, times, firsts, lasts = [], [], [], []
    for r, f, e, n in zip(rid.tolist(), first.tolist(), finish.tolist(), out_tokens.tolist()):
        if not np.isfinite(f) or n < 1:
            continue
        if n == 1 or not np.isfinite(e):
            owners.append([r])
            times.append([f])
            firsts.append([True])
            lasts.append([n == 1])
            continue
        owners.append([r] * n)
        times.append(np.linspace(f, e, n).tolist())
        firsts.append([True] + [False] * (n - 1))
        lasts.append([False] * (n - 1) + [True])
    flat = lambda xs, dtype: np.asarray([v for x in xs for v in x], dtype=dtype)  # noqa: E731
    return flat(owners, rid.dtype), flat(times, np.float64), flat(firsts, bool), flat(lasts, bool)


def with_api_server_times(requests: pa.Table, model: ClientModel) -> pa.Table:
    """``requests`` with each first and last token, TTFT and E2E later by the API server's own time
    (``ClientModel.api_server_s``): the times vLLM's API server records (its spans), which a server-side
    run timed by the API server is compared with. TPOT, the queue and the tokens' gaps are unchanged."""
    prompt = requests.column("prompt_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    api = model.api_server_s(prompt)
    out = requests
    for name in ("first_token_s", "finish_s", "ttft_s", "e2e_s"):
        values = _f(out, name) + api
        out = out.set_column(out.column_names.index(name), name,
                             pa.array(values, pa.float64(), mask=~np.isfinite(values)))
    return out


def as_client_side(requests: pa.Table) -> pa.Table:
    """``requests`` with its client-side columns taking the place of the engine-side times (what a
    client-side measurement is compared with)."""
    out = requests
    for engine, client in (("first_token_s", "client_first_token_s"), ("finish_s", "client_finish_s"),
                           ("ttft_s", "client_ttft_s"), ("tpot_s", "client_tpot_s"), ("e2e_s", "client_e2e_s")):
        out = out.set_column(out.column_names.index(engine), engine, out.column(client))
    return out


# -- observations from live runs -----------------------------------------------------------------
def api_server_runs_from(path: Path) -> list[dict]:
    """The API server CPU runs of an observations JSON (``{"api_server_cpu": {"runs": [...]}}``: each
    ``wall_s``, ``tokens``, ``requests``, ``api_cpu_s``, see ``api_server_token_s``), else none."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    runs = (data.get("api_server_cpu") or {}).get("runs") if isinstance(data, dict) else None
    if runs is not None and not isinstance(runs, list):
        raise InputError(path, "api_server_cpu.runs is not a list", column="api_server_cpu")
    return runs or []


def observations_from(path: Path) -> list[dict]:
    """Observations with client and engine times: a JSON file (``{"observations": [...]}``: each
    ``prompt_tokens``, ``client_ttft_s``, ``server_ttft_s``, optionally ``open_streams``, ``output_tokens``,
    ``client_decode_s``, ``server_decode_s``, ``weight``), or a live run directory (``servelab bench``
    with ``/metrics`` scraped) whose metrics.parquet holds vLLM's engine-side histograms: one
    observation of the run's means (engine TTFT = queue + prefill time, engine decode time, and the
    mean number of other streams open at a finished request's send, from the client's own times)."""
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON: {err.msg}") from None
        obs = data.get("observations") if isinstance(data, dict) else None
        if not isinstance(obs, list):
            raise InputError(path, "no 'observations' list", column="observations")
        return obs
    metrics_path, requests_path = path / "metrics.parquet", path / "requests.parquet"
    if not metrics_path.is_file() or not requests_path.is_file():
        raise InputError(path, "neither an observations JSON nor a live run directory with metrics.parquet "
                               "(servelab bench scrapes it from vLLM's /metrics)")
    import pyarrow.parquet as pq

    metrics = pq.read_table(metrics_path)
    increase = _counter_increases(metrics)

    def mean(name: str) -> float | None:
        count = increase.get(f"vllm:{name}_count")
        total = increase.get(f"vllm:{name}_sum")
        return total / count if count and total is not None else None

    queue, prefill, decode = (mean("request_queue_time_seconds"), mean("request_prefill_time_seconds"),
                              mean("request_decode_time_seconds"))
    if queue is None or prefill is None:
        raise InputError(metrics_path, "no vllm:request_queue_time_seconds / request_prefill_time_seconds "
                                       "histograms (a vLLM server's engine-side times)", column="metric")
    req = pq.read_table(requests_path)
    # the streams open at each send: every sent request counts, ended at its last chunk (or its
    # first, or at once where it got none)
    sent = _f(req, "arrival_s")
    end = _f(req, "finish_s")
    end = np.where(np.isfinite(end), end, _f(req, "first_token_s"))
    end = np.where(np.isfinite(end), end, sent)
    load = open_streams(sent, end)
    first_all = _f(req, "first_token_s")
    admitting = open_streams(sent, np.where(np.isfinite(first_all), first_all, end))
    is_done = pc.equal(req.column("status"), "finished").to_numpy(zero_copy_only=False)
    done = req.filter(pc.equal(req.column("status"), "finished"))
    if done.num_rows == 0:
        raise InputError(requests_path, "no finished request")
    ttft = _f(done, "ttft_s")
    first, finish = _f(done, "first_token_s"), _f(done, "finish_s")
    out = done.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    obs = {"prompt_tokens": float(done.column("prompt_tokens").to_numpy(zero_copy_only=False).mean()),
           "client_ttft_s": float(ttft.mean()), "server_ttft_s": queue + prefill,
           "open_streams": float(load[is_done].mean()), "admitting": float(admitting[is_done].mean()),
           "weight": done.num_rows, "source": str(path)}
    if decode is not None:
        obs.update(output_tokens=float(out.mean()), client_decode_s=float((finish - first).mean()),
                   server_decode_s=decode)
    return [obs]


def _counter_increases(metrics: pa.Table) -> dict[str, float]:
    """Per metric name: last value minus the first (the baseline scrape), summed over label sets
    (the histograms' ``_sum`` / ``_count`` over engines and models)."""
    names = metrics.column("metric").to_pylist()
    labels = metrics.column("labels").to_pylist()
    times = metrics.column("time_s").to_pylist()
    values = metrics.column("value").to_pylist()
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for n, lab, t, v in zip(names, labels, times, values):
        if n.endswith(("_sum", "_count")):
            series.setdefault((n, lab), []).append((t, v))
    out: dict[str, float] = {}
    for (n, _), points in series.items():
        points.sort()
        out[n] = out.get(n, 0.0) + points[-1][1] - points[0][1]
    return out


__all__ = ["CLIENT_COLUMNS", "ClientModel", "DEFAULTS", "LOADS", "api_server_waits", "as_client_side", "fit_client",
           "observations_from", "open_streams", "resolve", "save", "with_client_columns"]
