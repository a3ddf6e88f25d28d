"""A live run: build the trace's prompts, drive the load against the server, collect the records.

``run_live`` returns a ``LiveRun`` (records, tables, run.json); ``write_live_run`` writes the run
directory in the replay's schema (live/results.py), marked ``"kind": "live"`` in run.json. The
requests go through a ``Backend`` (live/backend.py): an OpenAI-compatible HTTP server by default,
or Amazon SageMaker runtime streaming (live/sagemaker.py).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
from servelab.live.backend import Backend, HttpBackend
from servelab.live.client import Record, Target
from servelab.live.counts import check_counts
from servelab.live.load import LoadConfig, schedule
from servelab.live.prompts import (
    Approximate,
    FewWords,
    Vocabulary,
    build_prompt,
    id_prompt,
    measure_vocabulary,
    token_id_vocabulary,
)
from servelab.live.tokenize import LocalTokenizer

LAG_WARN_S = 0.010  # warn when the 99th percentile of send lag exceeds this
PROMPT_CONCURRENCY = 16  # /tokenize calls in flight while building prompts


@dataclass(frozen=True, slots=True)
class LiveOptions:
    metrics: bool = True  # sample /metrics during the run
    metrics_interval_s: float = 1.0
    tokenizer: str = "auto"  # auto (server's /tokenize when it answers) | server | approximate | a tokenizer.json path
    extensions: str = "auto"  # auto (probe) | on | off: vLLM's ignore_eos + min_tokens


@dataclass
class LiveRun:
    records: list[Record]  # sent requests, in trace order
    rows: list[int]  # trace row of each record
    prompt_tokens: list[int]  # the built prompt's counted tokens, per record
    meta: dict
    metrics: pa.Table | None
    not_sent: int = 0
    log: list[str] = field(default_factory=list)  # warnings for the user


async def _prompts(backend: Backend, target, trace: pa.Table, rows: list[int], seed: int, salt: int, mode: str,
                   log: list[str]) -> tuple[list[str], list[int], dict]:  # fmt: skip
    tokenizer = None
    kind = "server"
    why = None  # why the server's tokenizer cannot be used
    if mode in ("auto", "server"):
        tokenizer, why = await backend.tokenizer(target)
        if tokenizer is None and mode == "server":
            raise RuntimeError(f"--tokenizer server: {why}; use --tokenizer approximate or a tokenizer.json")
    elif mode != "approximate":  # a local tokenizer.json
        if target.api == "chat":
            raise RuntimeError("a local tokenizer.json counts completions prompts only (a chat prompt's template "
                               "is the server's): use --api completions, or the server's /tokenize")  # fmt: skip
        tokenizer, kind = LocalTokenizer(mode), "local"
    exact = tokenizer is not None
    if not exact:
        log.append(f"prompt lengths approximate (real counts come from usage): {why or '--tokenizer approximate'}")
        tokenizer = Approximate()
    token_ids = False
    try:
        vocab: Vocabulary = await measure_vocabulary(tokenizer, exact)
    except FewWords as err:
        if target.api != "completions":  # a chat message is text: no way round it
            raise RuntimeError(f"{err}; token-id prompts need --api completions") from None
        vocab, token_ids = await token_id_vocabulary(tokenizer), True
        log.append(f"{err}: prompts are token ids instead ({len(vocab.words)} distinct ids; exact lengths)")
    block_tokens = None
    meta_bytes = trace.schema.metadata or {}
    if b"prefix_block_tokens" in meta_bytes:
        block_tokens = int(meta_bytes[b"prefix_block_tokens"])
    lengths = trace.column("prompt_tokens").to_pylist()
    ids = trace.column("request_id").to_pylist()
    hashes = trace.column("prefix_hashes").to_pylist() if "prefix_hashes" in trace.column_names else None
    gate = asyncio.Semaphore(PROMPT_CONCURRENCY)

    async def one(row: int) -> tuple[str | list[int], int]:
        if token_ids:
            return id_prompt(vocab, seed + salt, ids[row], lengths[row], hashes[row] if hashes else None, block_tokens)
        async with gate:
            return await build_prompt(tokenizer, vocab, seed + salt, ids[row], lengths[row],
                                      hashes[row] if hashes else None, block_tokens)  # fmt: skip

    built = await asyncio.gather(*(one(r) for r in rows))
    texts = [b[0] for b in built]
    counts = [b[1] for b in built]
    off = sum(1 for r, c in zip(rows, counts) if c != lengths[r])
    info = {"tokenizer": kind if exact else "approximate", "tokenizer_file": mode if kind == "local" else None, "overhead_tokens": vocab.overhead,
            "vocabulary_words": len(vocab.words), "length_mismatches": off, "token_ids": token_ids,
            "prefix_block_tokens": block_tokens, "prefix_sharing": hashes is not None}  # fmt: skip
    if exact and off:
        log.append(f"{off} prompts could not be made exactly the trace's length (shorter than the overhead)")
    return texts, counts, info


class _Flight:
    """Requests outstanding now, and the most there ever were."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def _drive(backend: Backend, target: Target, load: LoadConfig, records: list[Record], texts: list[str],
                 max_tokens: list[int], sched: np.ndarray | None, clock: Callable[[], float], flight: _Flight) -> None:  # fmt: skip
    async def one(i: int) -> None:
        flight.enter()
        try:
            await backend.send(target, records[i], texts[i], max_tokens[i], clock)
        finally:
            flight.leave()

    n = len(records)
    async with asyncio.TaskGroup() as group:
        if load.open_loop:
            gate = asyncio.Semaphore(load.max_in_flight) if load.max_in_flight else None

            async def gated(i: int) -> None:
                try:
                    await one(i)
                finally:
                    gate.release()

            for i in range(n):
                at = float(sched[i])
                if load.duration_s is not None and at >= load.duration_s:
                    break
                records[i].scheduled_s = at
                delay = at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if gate is not None:
                    await gate.acquire()
                    group.create_task(gated(i))
                else:
                    group.create_task(one(i))
        else:
            queue = iter(range(n))

            async def user() -> None:
                for i in queue:  # shared iterator: each request goes to exactly one user
                    now = clock()
                    if load.duration_s is not None and now >= load.duration_s:
                        return
                    records[i].scheduled_s = now
                    await one(i)
                    if load.think_s:
                        await asyncio.sleep(load.think_s)

            for _ in range(min(load.users, n)):
                group.create_task(user())


async def run_live(trace: pa.Table, target: Target, load: LoadConfig, options: LiveOptions = LiveOptions(),
                   backend: Backend | None = None) -> LiveRun:  # fmt: skip
    """Run the trace against the server (through ``backend``, default: HTTP to ``target.base_url``).
    Ctrl-C (task cancellation) stops the run and keeps what finished."""
    backend = HttpBackend() if backend is None else backend
    log: list[str] = []
    total = trace.num_rows if load.num_requests is None else min(load.num_requests, trace.num_rows)
    rows = list(range(total))
    started = time.time()
    # the most requests in flight at once (a hint for backends that size a connection pool)
    concurrency = max(1, load.users or load.max_in_flight or max(total, min(load.warmup, trace.num_rows)))
    async with backend.open(target, concurrency):
        extensions, why = (False, "off") if options.extensions == "off" else (True, "on")
        probes = 0  # generation requests sent before the run (the server's own counters include them)
        if not (target.ignore_eos or target.min_tokens):
            extensions, why = False, "not asked"
        elif options.extensions == "auto":
            probes += 1
            extensions, why = await backend.probe_extensions(target)
            if not extensions:
                log.append(f"the server does not take ignore_eos/min_tokens ({why}): outputs may end early")
        target = _with_extensions(target, extensions)
        texts, counts, prompt_info = await _prompts(backend, target, trace, rows, load.seed, 0, options.tokenizer, log)
        out_lengths = trace.column("output_tokens").to_pylist()
        max_tokens = [out_lengths[r] for r in rows]
        ids = trace.column("request_id").to_pylist()

        warm = {}
        if load.warmup:
            wrows = list(range(min(load.warmup, trace.num_rows)))
            wtexts, _, _ = await _prompts(backend, target, trace, wrows, load.seed, 1_000_003, options.tokenizer, [])
            wrecords = [Record(k, ids[r]) for k, r in enumerate(wrows)]
            gate = asyncio.Semaphore(load.users or load.max_in_flight or len(wrows))

            async def warm_one(k: int) -> None:
                async with gate:
                    await backend.send(target, wrecords[k], wtexts[k], out_lengths[wrows[k]], time.perf_counter)

            t_warm = time.perf_counter()
            await asyncio.gather(*(warm_one(k) for k in range(len(wrows))))
            warm = {"requests": len(wrows), "wall_s": time.perf_counter() - t_warm,
                    "finished": sum(r.status == "finished" for r in wrecords)}  # fmt: skip

        records = [Record(k, ids[r]) for k, r in enumerate(rows)]
        sched = schedule(load, np.asarray(trace.column("arrival_s").to_numpy()[:total])) if load.open_loop else None
        sampler = None
        stop_sampling = asyncio.Event()
        sampling = None
        if options.metrics:
            sampler = backend.metrics_sampler(target, options.metrics_interval_s, time.perf_counter)
        if sampler is not None:
            await sampler.scrape()  # the baseline, before the first request
        # Everything built so far (the trace, prompts, imported modules) stays put: the cyclic garbage
        # collector then scans only what the run itself allocates, so its pauses cannot delay a send.
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        if sampler is not None:
            sampling = asyncio.create_task(sampler.run(stop_sampling, first_after=options.metrics_interval_s))
        flight = _Flight()
        stopped_by = None
        try:
            if load.duration_s is not None:
                async with asyncio.timeout(load.duration_s):
                    await _drive(backend, target, load, records, texts, max_tokens, sched, clock, flight)
            else:
                await _drive(backend, target, load, records, texts, max_tokens, sched, clock, flight)
        except TimeoutError:
            stopped_by = "duration"
        except asyncio.CancelledError:
            stopped_by = "interrupt"
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            gc.unfreeze()
        if stopped_by is None and load.duration_s is not None and any(r.status == "unsent" for r in records):
            stopped_by = "duration"  # the rest were due after it (the last sent ones ended before it)
        span = clock()
        if sampling is not None:
            stop_sampling.set()
            try:
                await sampling
                await sampler.scrape()  # the final state, after the last request
            except asyncio.CancelledError:  # stopped while sampling the end: the run is kept without it
                stopped_by = stopped_by or "interrupt"
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
    if stopped_by == "duration":
        for rec in records:
            if rec.status == "cancelled":
                rec.reason = "in flight when the duration limit was reached"
    sent = [r for r in records if r.status != "unsent"]
    check_counts(sent, [max_tokens[r.index] for r in sent], log)
    lags = np.array([r.send_s - r.scheduled_s for r in sent if r.scheduled_s is not None])
    lag = {}
    if len(lags):
        lag = {"p50_s": float(np.percentile(lags, 50)), "p99_s": float(np.percentile(lags, 99)),
               "max_s": float(lags.max()), "mean_s": float(lags.mean())}  # fmt: skip
        if load.open_loop and lag["p99_s"] > LAG_WARN_S and not load.max_in_flight:
            log.append(f"the client lagged: p99 send delay {lag['p99_s'] * 1000:.1f} ms behind schedule "
                       f"(max {lag['max_s'] * 1000:.1f} ms); the offered load was lower than asked")  # fmt: skip
    metrics_table = sampler.table(t0) if sampler is not None else None  # parsed now, after the run
    counts_by_status: dict[str, int] = {}
    for r in sent:
        counts_by_status[r.status] = counts_by_status.get(r.status, 0) + 1
    meta = {
        "kind": "live",
        "measured": True,
        "endpoint": {"url": target.root, "api": target.api, "model": target.model, "timeout_s": target.timeout_s,
                     "ignore_eos": target.ignore_eos, "min_tokens": target.min_tokens,
                     "include_usage": target.include_usage, "extensions_probe": why, "probe_requests": probes,
                     **backend.describe()},
        "load": asdict(load),
        "prompts": prompt_info,
        "runner": {"name": "live", "spec": target.root},
        "engine": {"replicas": 1},
        "seed": load.seed,
        "started_at_unix": started,
        "measured_span_s": span,
        "wall_time_s": time.time() - started,
        "stopped_by": stopped_by,
        "counts": dict(sorted(counts_by_status.items()), not_sent=len(records) - len(sent)),
        "client": {"send_lag": lag, "peak_in_flight": flight.peak},
        "warmup": warm,
        "metrics": sampler.meta() if sampler is not None else None,
    }
    keep = [k for k, r in enumerate(records) if r.status != "unsent"]
    return LiveRun([records[k] for k in keep], [rows[k] for k in keep], [counts[k] for k in keep], meta,
                   metrics_table, len(records) - len(keep), log)  # fmt: skip


def _with_extensions(target: Target, on: bool) -> Target:
    from dataclasses import replace

    return replace(target, ignore_eos=on and target.ignore_eos, min_tokens=on and target.min_tokens)


def write_live_run(run: LiveRun, trace: pa.Table, trace_meta: dict, run_dir, token_log: bool = False):
    """requests.parquet, steps.parquet (no rows), metrics.parquet (when sampled), tokens.parquet (with
    ``token_log``) and run.json into ``run_dir``, all or nothing."""
    import json
    from pathlib import Path

    from servelab import __version__
    from servelab.common.atomic import atomic_dir
    from servelab.live.prometheus import server_settings
    from servelab.live.results import (
        empty_steps,
        requests_table,
        sent_trace,
        tokens_table,
    )
    from servelab.replay.results import write_parquet
    from servelab.traces.io import write_trace

    run_dir = Path(run_dir)
    requests = requests_table(run.records, trace, run.rows, run.prompt_tokens)
    # "config" and "clock" as `servelab run import` writes them: what `validate --real` replays with
    meta = dict(run.meta, servelab_version=__version__, run_id=run_dir.name, clock="client",
                config=server_settings(run.metrics), trace=dict(trace_meta, rows=trace.num_rows))  # fmt: skip
    with atomic_dir(run_dir) as tmp:
        write_parquet(requests, tmp / "requests.parquet")
        if requests.num_rows:
            write_trace(sent_trace(requests, trace, run.rows, run.meta.get("load")), tmp / "trace.arrow", source="servelab bench (as sent)")
        write_parquet(empty_steps(), tmp / "steps.parquet")
        if token_log:
            write_parquet(tokens_table(run.records), tmp / "tokens.parquet")
        if run.metrics is not None:
            write_parquet(run.metrics, tmp / "metrics.parquet")
        (tmp / "run.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return run_dir
