"""How far is the simulator from a real run? Replay a measured run's trace with its settings and
compare, metric by metric and request by request.

Per metric (TTFT, TPOT, E2E, queueing: mean, p50, p90, p99) the measured value, the simulated one
and the relative error ``sim / measured - 1``; the pooled ITL (decode time over decode gaps, as
vLLM's mean ITL with one token per chunk) and throughput; per request, the absolute percentage
error of TTFT, TPOT and E2E (MAPE and median). Percentiles are numpy's linear interpolation, as
DuckDB's ``quantile_cont`` in the SQL views and vLLM's benchmark use. A latency both sides put under
1 ms has no relative error (null). A server-side run's queue is vLLM's ``time_in_queue``, which starts
when the engine core takes the request in between iterations; the simulated queue starts there too
(``engine_intake``), not at the arrival.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from servelab.common.errors import InputError, ServelabError
from servelab.replay.config import Options, ReplayConfig

STATS = ("mean", "p50", "p90", "p99")
METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s")


def load_measured(run_dir: Path) -> tuple[dict, pa.Table, pa.Table]:
    """run.json, requests.parquet and the trace of a run written by ``servelab run import``."""
    from servelab.scoring.sources import read_meta  # what `servelab report` says of a broken run.json

    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        raise InputError(run_dir, "not a run directory (no run.json)")
    meta = read_meta(run_dir)
    if not meta.get("measured"):
        raise InputError(meta_path, "not a measured run (run.json has no \"measured\": true); "
                                    "import one with `servelab run import`")
    scale = (meta.get("endpoint") or {}).get("server_time_scale")
    if isinstance(scale, (int, float)) and scale > 0 and scale != 1:
        # its times (and trace.arrow's sends) are wall seconds of a server whose clock ran scale x faster
        raise InputError(meta_path, f"measured against `servelab serve --time-scale {scale:g}`: its times are "
                                    f"wall-clock seconds of a simulated clock {scale:g}x as fast, not comparable with a "
                                    "replay's; bench the server at --time-scale 1 to validate",
                         column="endpoint.server_time_scale")
    trace_path = run_dir / "trace.arrow"
    if not trace_path.is_file():
        raise InputError(run_dir, "has no trace.arrow (import it again with this version)")
    from servelab.traces.io import read_trace

    return meta, _read_requests(run_dir / "requests.parquet"), read_trace(trace_path)


# the columns of requests.parquet the comparison reads
REQUEST_COLUMNS = ("request_id", "status", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "ttft_s",
                   "tpot_s", "e2e_s", "output_tokens")


def _read_requests(path: Path) -> pa.Table:
    """A measured run's requests.parquet, or an InputError naming the file and what is wrong with it (as
    `servelab report` words it: missing, not a readable Parquet file, a column missing)."""
    from servelab.common.errors import require_file

    require_file(path, "requests table")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise InputError(path, f"not a readable Parquet file ({err})") from None
    for column in REQUEST_COLUMNS:
        if column not in table.column_names:
            raise InputError(path, "missing required column", column=column)
    return table


def sweep_runs(run_dir: Path) -> list[Path] | None:
    """The run directories of a sweep that ``run import`` split into one run per benchmark (a GuideLLM
    report of several benchmarks: ``sweep.json`` and ``benchmark_<i>/``), or None for a single run."""
    sweep = run_dir / "sweep.json"
    if (run_dir / "run.json").is_file() or not sweep.is_file():
        return None
    try:
        runs = json.loads(sweep.read_text())["runs"]
        paths = [run_dir / str(r["name"]) for r in runs]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise InputError(sweep, "not a sweep written by `servelab run import` (no 'runs' list of names)") from None
    for path in paths:
        if not (path / "run.json").is_file():
            raise InputError(path, "a run of the sweep is missing (no run.json)")
    return paths


def sweep_summary(reports: list[dict]) -> list[dict]:
    """Per run of a sweep: its name and the error of the mean TTFT, TPOT and E2E and of the error share."""
    out = []
    for rep in reports:
        means = {row["metric"]: row["error_pct"] for row in rep["latency"] if row["stat"] == "mean"}
        errors = rep.get("errors") or {}
        out.append({"run": Path(rep["run"]).name, "requests": rep["requests"],
                    **{f"{m}_mean_error_pct": means.get(m) for m in ("ttft", "tpot", "e2e")},
                    "not_finished_measured": errors.get("measured"), "not_finished_simulated": errors.get("simulated")})
    return out


Overrides = dict[str, Any] | Options | tuple[Options, ...]


def option_layers(overrides: Overrides) -> tuple[Options, ...]:
    """``overrides`` as typed options in the order they go over a run's settings (later ones win): raw values
    (typed here; None and () are options not given), `Options` typed once, or a tuple of them (a config
    file's, then the command line's). Typed once, they go over every run of a sweep as they are."""
    if isinstance(overrides, dict):
        return (Options.parse({k: v for k, v in overrides.items() if v is not None and v != ()}, "validate --real"),)
    return (overrides,) if isinstance(overrides, Options) else tuple(overrides)


def keys_set(layers: tuple[Options, ...]) -> set[str]:
    """The keys any of the option layers sets."""
    return set().union(*(o.keys() for o in layers))


def config_for(meta: dict, overrides: Overrides) -> ReplayConfig:
    """The recorded settings (run.json ``config``, typed here: the run's edge) with ``overrides`` (a config
    file, command-line options) on top. Only the keys the overrides set go over the run's: a key a config
    file leaves out is the run's, not the file's default. The source's model name (a Hugging Face id or
    path) becomes the preset with that shape."""
    layers = option_layers(overrides)
    given = keys_set(layers)
    data = {k: v for k, v in (meta.get("config") or {}).items() if k not in OFFLOAD_KEYS}  # (with_offload_tier)
    runner = next((o.top["runner"] for o in reversed(layers) if "runner" in o.top), data.get("runner"))
    fitted = str(runner or "").startswith("fitted")  # prices with its own profile, not these
    for key, option in (("model", "--model MODEL"), ("gpu", "--gpu GPU")):
        if key not in data and key not in given and not fitted:  # a default would replay another model or GPU
            raise ServelabError(f"the measured run names no {key if key == 'model' else 'GPU'} (run.json config); "
                                f"pass {option} (or import it again with --setting {key}=...)")
    _recorded_runner_settings(meta, data, given)
    if (meta.get("source") or {}).get("gpu_p2p") is False and runner is None:
        data["runner"] = "roofline:link=pcie-host"  # the server's GPUs had no peer-to-peer access (its log)
    try:
        config = ReplayConfig.from_dict(data, source="validate --real")
        for options in layers:
            config = config.with_options(options)
    except ServelabError as err:
        raise ServelabError(f"{err} (settings of the measured run with the options given)") from None
    if "model" in data or "model" in given:
        config = _model_preset(config, meta, from_option="model" in given)
    return config


OFFLOAD_KEYS = ("kv_offload_gb", "kv_offload_tokens", "kv_offload_disk_gb")  # run.json config: KV offloading


def with_offload_tier(config: ReplayConfig, meta: dict, given: set[str], runner) -> ReplayConfig:
    """``config`` with the host-memory tier of the run's CPU KV offloading (fidelity/kv_offload.py), a
    ``dram`` tier written through, unless an option sets ``kv_tiers`` or the run cached no prefixes (vLLM
    offloads cached blocks only). A size in tokens is priced at the runner's KV bytes per token."""
    from servelab.assembly import kv_bytes_per_token
    from servelab.fidelity.kv_offload import tier_spec

    recorded = meta.get("config") or {}
    gb, tokens = recorded.get("kv_offload_gb"), recorded.get("kv_offload_tokens")
    if (gb is None and tokens is None) or "kv_tiers" in given or not config.engine.enable_prefix_caching:
        return config
    if gb is None:
        gb = tokens * kv_bytes_per_token(config.engine, runner) / 1e9
    disk = recorded.get("kv_offload_disk_gb")  # LMCache's local disk store, below its CPU one
    tiers = (tier_spec(gb),) + ((tier_spec(disk, "ssd"),) if disk else ())
    engine = dataclasses.replace(config.engine, kv_tiers=tiers,
                                 kv_tier_write=config.engine.kv_tier_write if "kv_tier_write" in given else "through")
    return dataclasses.replace(config, engine=engine)


def _model_preset(config: ReplayConfig, meta: dict, from_option: bool) -> ReplayConfig:
    """``config`` with its model as the preset of that shape (a config.json path stays a path)."""
    import os

    from servelab.runners.presets import find_model

    if os.path.isfile(config.model):
        return config
    try:
        return dataclasses.replace(config, model=find_model(config.model).name)
    except ServelabError as err:
        if from_option:
            raise
        where = (meta.get("config_sources") or {}).get("model", "run.json config")
        raise ServelabError(f"the measured run's model '{config.model}' (from {where}) matches no model preset; pass "
                            f"--model MODEL (a preset, or the model's Hugging Face config.json): {err}") from None


# vLLM's arguments run import keeps in run.json "source" that the runner prices (docs/runners.md
# "Parallelism" and "Quantisation"), with the replay config key each sets
RECORDED_RUNNER_KEYS = {"pipeline_parallel_size": "pp", "enable_expert_parallel": "enable_expert_parallel",
                        "quantization": "quantization", "kv_cache_dtype": "kv_cache_dtype"}


def _recorded_runner_settings(meta: dict, data: dict[str, Any], given: set[str]) -> None:
    """Fill ``data`` with the run's parallelism and quantisation as vLLM recorded them, where no option
    or config key sets them. Run import counts each of ``data_parallel_size`` ranks as a replica;
    they are one server's DP ranks, so the replay gets ``dp`` ranks of one replica (the same engines
    and GPUs, and an MoE model's experts spread over the ranks)."""
    from servelab.runners.quant import WEIGHT_FORMATS, ALIASES

    source = meta.get("source") or {}
    dp = source.get("data_parallel_size")
    if (dp and int(dp) > 1 and not given & {"dp", "data_parallel_size", "replicas"}
            and int(data.get("replicas", 1) or 1) == int(dp)):
        data["replicas"], data["dp"] = 1, int(dp)
        if "router" not in given and "router" not in data:  # vLLM's own balancing over its ranks
            data["router"] = DP_ROUTER
    for key, name in RECORDED_RUNNER_KEYS.items():
        value = source.get(key)
        if value in (None, "", "auto", False) or given & {key, name} or name in data:
            continue
        if key == "quantization" and str(value).lower() not in {*WEIGHT_FORMATS, *ALIASES}:
            continue  # a method only the checkpoint's config.json resolves (compressed-tensors, modelopt)
        data[name] = value


def _metric_columns(requests: pa.Table, queue_from: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Finished requests' metrics by request id (queue only where the source recorded it). ``queue_from``
    (one per row of ``requests``): when each request's queue starts, else its arrival."""
    finished = pc.equal(requests.column("status"), "finished")
    done = requests.filter(finished)
    cols = {name: done.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
            for name in ("request_id", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                         "ttft_s", "tpot_s", "e2e_s")}
    cols["output_tokens"] = done.column("output_tokens").to_numpy().astype(np.float64)
    start = cols["arrival_s"] if queue_from is None else queue_from[finished.to_numpy(zero_copy_only=False)]
    cols["queue_s"] = cols["first_scheduled_s"] - start
    return cols


def engine_intake(requests: pa.Table, steps: pa.Table) -> np.ndarray:
    """When each simulated request reached the scheduler as vLLM's engine core takes it in: the first
    iteration that starts at or after its arrival (a request arriving mid-iteration waits for it to
    end; an idle replica takes it at once), never after its first scheduling. vLLM's ``time_in_queue``
    (OTel spans, RequestStateStats) runs from the engine core's intake, between iterations, not from the
    API server's arrival: a queue measured from the arrival would count the iteration in flight."""
    arrival = requests.column("arrival_s").to_numpy(zero_copy_only=False).astype(np.float64)
    scheduled = requests.column("first_scheduled_s").to_numpy(zero_copy_only=False).astype(np.float64)
    replica = requests.column("replica").to_numpy(zero_copy_only=False)
    out = arrival.copy()
    for r in np.unique(steps.column("replica").to_numpy()):
        mine = steps.filter(pc.equal(steps.column("replica"), r))  # stretches of equal iterations
        start = mine.column("start_s").to_numpy()
        order = np.argsort(start, kind="stable")
        start = start[order]
        iterations = np.maximum(mine.column("num_iterations").to_numpy(), 1)[order]
        each = mine.column("duration_s").to_numpy()[order] / iterations
        end = start + each * iterations
        rows = np.flatnonzero(replica == r)
        k = np.searchsorted(start, arrival[rows], side="right") - 1  # the stretch in progress (or last before)
        inside = (k >= 0) & (arrival[rows] < end[np.maximum(k, 0)])
        kk = np.maximum(k, 0)
        nxt = start[kk] + np.ceil((arrival[rows] - start[kk]) / np.where(each[kk] > 0, each[kk], 1.0)) * each[kk]
        out[rows] = np.where(inside, nxt, arrival[rows])
    return np.where(np.isfinite(scheduled), np.minimum(out, scheduled), out)


def _stats(values: np.ndarray) -> dict[str, float | None]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {s: None for s in STATS}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}


NEGLIGIBLE_S = 1e-3  # a latency both sides put under this has no meaningful relative error (a queue of ~0)


def _err(sim: float | None, real: float | None, seconds: bool = False) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    if seconds and abs(sim) < NEGLIGIBLE_S and abs(real) < NEGLIGIBLE_S:
        return None
    return (sim / real - 1.0) * 100


def _summary(cols: dict[str, np.ndarray]) -> dict[str, Any]:
    multi = cols["output_tokens"] > 1
    out: dict[str, Any] = {}
    for m in METRICS:
        values = cols[m][multi] if m == "tpot_s" else cols[m]
        out[m] = _stats(values)
    gaps = (cols["output_tokens"] - 1)[multi].sum()
    out["itl_pooled_s"] = float((cols["finish_s"] - cols["first_token_s"])[multi].sum() / gaps) if gaps else None
    # first arrival to last finish: none without a finished request (not a duration of 0)
    span = float(cols["finish_s"].max() - cols["arrival_s"].min()) if cols["finish_s"].size else None
    out["duration_s"] = span
    out["request_throughput_rps"] = float(len(cols["finish_s"]) / span) if span else None
    out["output_throughput_tps"] = float(cols["output_tokens"].sum() / span) if span else None
    out["finished"] = len(cols["finish_s"])
    return out


def _per_request(real: dict[str, np.ndarray], sim: dict[str, np.ndarray]) -> dict[str, Any]:
    common, ri, si = np.intersect1d(real["request_id"], sim["request_id"], return_indices=True)
    out: dict[str, Any] = {"matched": len(common)}
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        r, s = real[m][ri], sim[m][si]
        ok = np.isfinite(r) & np.isfinite(s) & (r > 0)
        if m == "tpot_s":
            ok &= real["output_tokens"][ri] > 1
        ape = np.abs(s[ok] / r[ok] - 1.0) * 100
        out[m] = {"mape_pct": float(ape.mean()) if ape.size else None,
                  "median_ape_pct": float(np.median(ape)) if ape.size else None, "n": int(ape.size)}
    return out


def compare(real_requests: pa.Table, sim_requests: pa.Table,
            sim_queue_from: np.ndarray | None = None) -> dict[str, Any]:
    real, sim = _metric_columns(real_requests), _metric_columns(sim_requests, sim_queue_from)
    rs, ss = _summary(real), _summary(sim)
    rows = []
    for m in METRICS:
        for stat in STATS:
            rows.append({"metric": m.removesuffix("_s"), "stat": stat, "measured_s": rs[m][stat],
                         "simulated_s": ss[m][stat], "error_pct": _err(ss[m][stat], rs[m][stat], seconds=True)})
    rows.append({"metric": "itl", "stat": "pooled mean", "measured_s": rs["itl_pooled_s"],
                 "simulated_s": ss["itl_pooled_s"], "error_pct": _err(ss["itl_pooled_s"], rs["itl_pooled_s"])})
    throughput = [{"metric": k, "measured": rs[k], "simulated": ss[k], "error_pct": _err(ss[k], rs[k])}
                  for k in ("request_throughput_rps", "output_throughput_tps", "duration_s")]
    return {"finished": {"measured": rs["finished"], "simulated": ss["finished"]},
            "latency": rows, "throughput": throughput, "per_request": _per_request(real, sim)}


def error_shares(measured: pa.Table, simulated: pa.Table) -> dict[str, Any]:
    """Share of requests that did not finish (failed, timed out, aborted, refused), measured over every
    request of the run (the trace leaves out those that failed before any output) and simulated."""
    def share(table: pa.Table) -> float | None:
        n = table.num_rows
        done = int(pc.sum(pc.equal(table.column("status"), "finished")).as_py() or 0)
        return (n - done) / n if n else None

    m, s = share(measured), share(simulated)
    return {"measured": m, "simulated": s, "difference_pct_points": None if m is None or s is None else (s - m) * 100}


def not_measured(meta: dict, latency: list[dict]) -> dict[str, str]:
    """Why a latency the table compares has no measured value (the queue: the time from arrival to the
    first scheduling, which only the server sees), by metric."""
    if any(r["measured_s"] is not None for r in latency if r["metric"] == "queue"):
        return {}
    source = meta.get("source") or {}
    if source.get("format") == "vllm-bench":
        # vllm/benchmarks/serve.py: queue_times = client_queue_time = start_time - request_arrival_time,
        # the wait on the client's own --max-concurrency semaphore; its TTFT and E2E leave it out
        why = ("vLLM's bench records no server queue: its queue_times is the client's wait for one of its own "
               "--max-concurrency slots before sending, which the server never sees")
    elif meta.get("clock") == "client":
        why = "a client-side run does not see when the server first scheduled each request"
    else:
        why = "the source records no time of each request's first scheduling"
    return {"queue": why}


def not_finished(simulated: pa.Table, kv_capacity_tokens: int) -> dict[str, Any] | None:
    """Why simulated requests did not finish, or None when all did: their count by status, the shortest
    prompt beside the KV cache's tokens (a replica's), and the shortest refused prompt's reason (what
    the smallest request that could not run was told)."""
    status = simulated.column("status").to_numpy(zero_copy_only=False)
    left = status != "finished"
    if not left.any():
        return None
    names, counts = np.unique(status[left], return_counts=True)
    prompt = simulated.column("prompt_tokens").to_numpy(zero_copy_only=False)
    out: dict[str, Any] = {"by_status": {str(n): int(c) for n, c in zip(names, counts)},
                           "kv_capacity_tokens": kv_capacity_tokens, "shortest_prompt_tokens": int(prompt.min())}
    reasons = simulated.column("reason").to_pylist()
    told = [i for i in np.flatnonzero(left) if reasons[i]]
    if told:
        i = min(told, key=lambda k: prompt[k])
        out["example"] = {"request_id": int(simulated.column("request_id")[int(i)].as_py()),
                          "prompt_tokens": int(prompt[i]), "status": str(status[i]), "reason": reasons[i]}
    return out


def validate_real(run_dir: Path, overrides: Overrides, client_model: str | None = "auto"
                  ) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    """Replay the measured run's trace under its settings (+ overrides): (report, measured, simulated),
    ``simulated`` holding the times the report compares (what ``plot_cdfs`` draws beside the measured).

    A client-side run (``clock: client``) is compared with the simulated times as its client would
    have seen them (fidelity/client_model.py): ``client_model`` ``auto`` (the calibrated model of the
    run's server kind, vLLM's unless the source says otherwise), a server kind, a model JSON, or None
    to compare engine-side times. The engine-side comparison is kept in the report (``latency_engine``)."""
    from servelab.assembly import (build_cluster, build_runner, most_gpu_blocks, replay, resolve_num_gpu_blocks,
                                   trace_block_tokens)
    from servelab.fidelity import client_model as cm

    meta, measured, trace = load_measured(run_dir)
    layers = option_layers(overrides)  # (typed already when a sweep's caller passes Options)
    given = keys_set(layers)
    config = config_for(meta, layers)
    runner = build_runner(config)
    config = with_offload_tier(config, meta, given, runner)
    # the run's own KV blocks are what its server allocated: kept even where the memory model cannot fit
    # them (the server's KV bytes per token or weights are smaller than modelled), and said
    ran_with = "num_gpu_blocks" not in given and (meta.get("config") or {}).get("num_gpu_blocks") is not None
    blocks = resolve_num_gpu_blocks(config, runner, measured=ran_with)
    most = most_gpu_blocks(config, runner) if ran_with else None
    memory_warning = None if most is None or blocks <= most else (
        f"the run's {blocks:,} KV blocks exceed the {most:,} of {config.engine.block_size} tokens that the runner's "
        f"memory model fits beside the weights in all of GPU memory: the server's KV bytes per token or weights are "
        f"smaller than modelled (a compressed or fp8 KV cache, a different checkpoint); replayed with the run's blocks")
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_gpu_blocks=blocks))
    model = None
    # a model fitted to a live server's calibration sweep (fit --endpoint / --live) has the outside time
    # in its prefill terms already (docs/live.md): auto leaves it out rather than count it twice
    live_fitted = (getattr(getattr(runner, "model", None), "metadata", None) or {}).get("runner") == "live"
    if client_model is not None and meta.get("clock") == "client" and not (client_model == "auto" and live_fitted):
        model = cm.resolve("vllm" if client_model == "auto" else client_model)
    # a server-side run timed by vLLM's API server (its spans) holds the API server's own time, the engine's does not
    api_model = None
    if client_model is not None and meta.get("clock") == "server" and server_times(meta) == "api-server":
        api_model = cm.resolve("vllm" if client_model == "auto" else client_model)
        api_model = api_model if api_model.has_api_server else None
    cluster = build_cluster(config, runner, trace_block_tokens(trace), measured_blocks=ran_with)
    result = replay(trace, config, runner=runner, token_log=model is not None and model.token_s > 0, cluster=cluster)
    simulated = result.requests
    engine_side = None
    # a server-side run's queue is vLLM's time_in_queue, from the engine core's intake
    intake = engine_intake(simulated, result.steps) if meta.get("clock") == "server" else None
    if model is not None:
        tokens = result.tokens.read() if hasattr(result.tokens, "read") else result.tokens
        simulated = cm.with_client_columns(simulated, model, tokens)
        engine_side = compare(measured, simulated)["latency"]
        compared = cm.as_client_side(simulated)
        report = compare(measured, compared)
    elif api_model is not None:
        engine_side = compare(measured, simulated, intake)["latency"]
        compared = cm.with_api_server_times(simulated, api_model)
        report = compare(measured, compared, intake)
    else:
        compared = simulated
        report = compare(measured, simulated, intake)
    report["errors"] = error_shares(measured, simulated)
    shown = model or api_model
    if shown is not None and shown.has_api_server:
        prompt = simulated.column("prompt_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
        report["api_server"] = {"request_s": shown.api_request_s, "prompt_token_s": shown.api_prompt_token_s,
                                "mean_s": float(np.mean(shown.api_server_s(prompt))) if prompt.size else None,
                                "server": shown.server}
    report["not_measured"] = not_measured(meta, report["latency"])
    report["client_model"] = None if model is None else model.to_dict()
    if engine_side is not None:
        report["latency_engine"] = engine_side
    settings = settings_used(meta, given, config, blocks)
    report.update({
        "settings": settings,
        "prefix": prefix_share(meta, trace, result.requests),
        "run": str(run_dir),
        "clock": meta.get("clock"),
        # "regenerated": the client recorded no send times; they were drawn from its process (run import)
        "arrivals": (meta.get("load") or {}).get("arrivals", "recorded"),
        "requests": trace.num_rows,
        "config": config.to_dict(),
        "num_gpu_blocks": blocks,
        "kv_capacity_tokens": blocks * config.engine.block_size,
        # where the block count came from, as the settings list says (an option, the run's file or
        # --setting at import, derived)
        "kv_blocks_from": next(s["from"] for s in settings if s["setting"] == "num_gpu_blocks"),
        "preemptions_simulated": int(pc.sum(result.requests.column("num_preemptions")).as_py() or 0),
        "not_finished_simulated": not_finished(result.requests, blocks * config.engine.block_size),
        **({"memory_warning": memory_warning} if memory_warning else {}),
        "runner": result.meta["runner"],
    })
    return report, measured, compared


def server_times(meta: dict) -> str | None:
    """Where a server-side run's times were taken: ``api-server`` (vLLM's ``llm_request`` spans, from the API
    server's receipt) or ``engine-core``, as run.json ``source.times`` says; a run imported from spans before
    it said so is told by its notes (a request-journey trace is the engine core's)."""
    source = meta.get("source") or {}
    if source.get("times") or source.get("format") != "otel":
        return source.get("times")
    journey = any("request journey trace" in str(note) for note in meta.get("notes") or ())
    return "engine-core" if journey else "api-server"


def clock_labels(report: dict[str, Any]) -> tuple[str, str]:
    """How the measured and the compared simulated times were taken, for a plot's legend: a client-side
    run's are the client's; the simulated are the engine's, or the client's through the client model."""
    measured = {"client": "client-side", "server": "server-side"}.get(report.get("clock") or "", "clock unrecorded")
    model = report.get("client_model")
    simulated = (f"client-side: engine + {model['server']} client model" if model
                 else f"engine + {report['api_server']['server']} API server" if report.get("api_server") else "engine-side")
    return f"measured ({measured})", f"simulated ({simulated})"


RUNNER_SHOWN = ("dp", "pp", "enable_expert_parallel", "quantization", "kv_cache_dtype")  # listed when set
TIMEOUT_SHOWN = ("client_timeout_s", "client_timeout_until")  # listed when the client had a timeout
DP_ROUTER = "vllm-dp"  # a DP run's ranks, balanced as vLLM's API server does (listed when used)
SHOWN = ("model", "gpu", "tp", "replicas", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks",
         "gpu_memory_utilization", "enable_prefix_caching", "async_scheduling", "kv_tiers", "runner", "policy",
         *RUNNER_SHOWN)


def settings_used(meta: dict, given: set[str], config: ReplayConfig, blocks: int) -> list[dict]:
    """Each setting the replay used, its value and where it came from: an option (a key of ``given``: set
    by a config file or the command line), the run (with the file run import read it from), derived, or
    the default."""
    recorded = meta.get("config") or {}
    sources = meta.get("config_sources") or {}
    flat = config.to_dict()
    out = []
    for key in (*SHOWN, "router", *TIMEOUT_SHOWN):
        if key in RUNNER_SHOWN and key not in flat:
            continue
        if key == "router" and flat.get("dp", 1) == 1 and "router" not in given:  # a DP run's router only
            continue
        if key in TIMEOUT_SHOWN and flat.get("client_timeout_s") is None:
            continue
        if key == "kv_tiers" and not flat.get(key) and not (meta.get("source") or {}).get("kv_offload"):
            continue  # (listed when a tier is set or the run offloaded KV to CPU)
        value = blocks if key == "num_gpu_blocks" else flat.get(key)
        if key in ("model", "gpu") and str(flat.get("runner", "")).startswith("fitted") and key not in recorded \
                and key not in given:
            value, origin = None, "not used: the fitted runner prices and sizes with its own profile"
        elif key in given:
            origin = "option"
        elif key in recorded:
            origin = f"run: {sources.get(key, 'the source')}"
        elif key == "kv_tiers" and value and (offload := next((k for k in OFFLOAD_KEYS if k in recorded), None)):
            origin = (f"run: {sources.get(offload, 'the source')} (vLLM's CPU KV offloading: "
                      f"{(meta.get('source') or {}).get('kv_offload', offload)}; written through)")
        elif key == "kv_tiers" and not value and (meta.get("source") or {}).get("kv_offload"):
            origin = (f"default: the run offloaded KV to CPU ({meta['source']['kv_offload']}) at a size not "
                      "recorded or without prefix caching; --set kv_tiers=dram:capacity_gb=G gives it")
        elif key in RUNNER_SHOWN:
            origin = "run: vLLM's arguments (run.json source)"
        elif key == "router" and value == DP_ROUTER:
            origin = "run: vLLM balances its DP ranks by 4 x waiting + running (data_parallel_size)"
        elif key == "runner" and (meta.get("source") or {}).get("gpu_p2p") is False:
            origin = f"run: {meta['source'].get('gpu_p2p_from', 'the server log')} (no GPU peer-to-peer)"
        elif key == "num_gpu_blocks":
            origin = "derived from the model, GPU and gpu_memory_utilization"
        else:
            origin = "default"
        out.append({"setting": key, "value": value, "from": origin})
    return out


def prefix_share(meta: dict, trace: pa.Table, simulated: pa.Table) -> dict[str, Any]:
    """Prefix-cache hits as a share of prompt tokens: what the server reported, what the trace's
    hashes allow (an unlimited cache) and what the replay served (``cached_tokens``)."""
    info = meta.get("prefix") or {}
    measured = info.get("measured_hit_rate")
    if measured is None:
        measured = (meta.get("source") or {}).get("prefix_cache_hit_rate")
    prompt = pc.sum(simulated.column("prompt_tokens")).as_py() or 0
    # vLLM's hit rate counts its GPU prefix cache; a KV connector's hits (CPU offloading) are its own figure
    gpu = "cached_tokens_gpu" if "cached_tokens_gpu" in simulated.column_names else "cached_tokens"
    cached = pc.sum(simulated.column(gpu)).as_py() or 0
    hashes = "prefix_hashes" in trace.column_names
    out = {"measured": measured, "measured_from": info.get("measured_hit_rate_from"),
           "simulated": cached / prompt if prompt else None, "ideal": info.get("ideal_hit_share"), "hashes": hashes,
           "origin": info.get("origin", "none recorded (imported before prefix sharing was read)")}
    if gpu != "cached_tokens" and prompt:  # hits below GPU memory, apart (their share of prompt tokens)
        out["simulated_lower_tiers"] = ((pc.sum(simulated.column("cached_tokens")).as_py() or 0) - cached) / prompt
    external = (meta.get("source") or {}).get("external_prefix_cache_hit_rate")
    if external is not None:  # the server log's "External prefix cache hit rate" (its KV connector's hits)
        out["measured_external"] = external
    pressure = (meta.get("source") or {}).get("prefix_cache_hit_rate_pressure")
    if pressure:
        out["pressure"] = pressure
    if measured is not None and measured > 0.01 and not hashes and not pressure:
        out["warning"] = (f"the server reported {measured:.1%} prefix-cache hits but the trace shares no prefix: "
                          "import it again with --prefix-from-hit-rate or --shared-prefix-tokens/--prompt-pool")
    return out


def plot_cdfs(measured: pa.Table, simulated: pa.Table, path: Path, title: str = "",
              labels: tuple[str, str] = ("measured", "simulated")) -> None:
    """TTFT, TPOT and E2E CDFs of both runs side by side (PNG/SVG/PDF by suffix), written atomically;
    ``labels``: the legend's names of the two (``clock_labels``: which clock each side's times are on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from servelab.common.atomic import atomic_path

    real, sim = _metric_columns(measured), _metric_columns(simulated)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, m, label in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT (s)", "TPOT (s)", "E2E (s)")):
        for cols, name, style in ((real, labels[0], "-"), (sim, labels[1], "--")):
            v = np.sort(cols[m][np.isfinite(cols[m])])
            if m == "tpot_s":
                v = np.sort(cols[m][(cols["output_tokens"] > 1) & np.isfinite(cols[m])])
            ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), style, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=110)
    plt.close(fig)
