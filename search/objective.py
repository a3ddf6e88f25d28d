"""Evaluate one trial: build its config, replay (or bisect the goodput rate), write the run, score it, return the objectives.

Pruning replays the trace up to checkpoints of its span with the engine's ``until_s`` horizon. An
event replay is causal, so the run up to a horizon is exactly the start of the full run; the value
reported at a checkpoint is the attainment of the requests that had arrived by then, with requests
still in flight counted as misses (a pessimistic, honest "attainment so far"). A pruned trial stops
there; a trial that survives pays for its checkpoint replays on top of the full one (the sum of the
checkpoint fractions: 0.75 of a replay for the default 0.25, 0.5).

Infeasible settings (the engine or runner raises ServelabError: KV larger than GPU memory, bad
policy parameter) become pruned trials with the reason as a user attribute.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from servelab.common.errors import ServelabError
from servelab.common.processes import start_token
from servelab.search.recorded import Pruned
from servelab.search.spec import CONSTRAINED, SearchSpec


def trial_dir(study_dir: Path, number: int) -> Path:
    return Path(study_dir) / "trials" / f"{number:04d}"


def process_start_token(pid: int) -> str:
    """The kernel's start time of ``pid`` as a worker id records it ("?": unknown)."""
    return start_token(pid) or "?"


def worker_id() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start_token(pid)}"


def prepare_trace(spec: SearchSpec, study_dir: Path) -> tuple[pa.Table, Path, dict]:
    """The trace every trial replays: the spec's file with its window/head/rate transforms applied.

    A transformed trace is written to STUDY_DIR/trace.arrow (the goodput sweep reads a file, and the
    study keeps what it replayed).
    """
    from servelab.traces.io import read_trace, trace_metadata, trace_sha256, write_trace
    from servelab.traces import transforms

    t = spec.trace
    table = read_trace(t.path)
    meta: dict[str, Any] = {"path": str(t.path), "name": t.path.stem, "sha256": trace_sha256(t.path)}
    if not t.transformed:
        return table, t.path, meta
    if t.window_s is not None:
        table = transforms.window(table, t.window_s[0], t.window_s[1])
        meta["window_s"] = list(t.window_s)
    if t.head is not None:
        table = transforms.head(table, t.head)
        meta["head"] = t.head
    scale = t.rate_scale
    if t.rate_rps is not None:
        from servelab.scoring.sweep import native_rate  # (only here: the sweep module costs ~10 ms to import)

        scale = t.rate_rps / native_rate(table)
    if scale is not None:
        table = transforms.scale_rate(table, scale)
        meta["rate_scale"] = scale
    source = trace_metadata(table).get("source", "")
    path = write_trace(table, Path(study_dir) / "trace.arrow", f"{source} | search {json.dumps(meta, sort_keys=True)}")
    return read_trace(path), path, meta


# Up to this many requests a trial is scored on one DuckDB thread: on 2,000 requests the scoring
# query took ~10 ms on one thread against ~18 ms on two (starting and joining the threads costs more
# than the work they share; bench/RESULTS.md, issue #31). Larger runs keep DuckDB's default. Runs this
# small are scored by numpy instead when it gives the same doubles (scoring/quick.py: ~1 ms).
ONE_THREAD_ROWS = 100_000


class QuotaReached(Exception):
    """The study already has n_trials finished (or running) trials: this one is surplus."""


class Evaluator:
    """The Optuna objective of one worker process (holds the trace and a scoring connection).

    ``prepared`` is `prepare_trace`'s (path, metadata) when another process prepared the trace: a pool
    worker then reads the file, rather than transforming, hashing and writing the spec's trace again.
    """

    def __init__(self, spec: SearchSpec, study_dir: Path, threads: int | None = None,
                 prepared: tuple[Path, dict] | None = None):  # fmt: skip
        from servelab.search.scorer import RunScorer

        self.spec = spec
        self.study_dir = Path(study_dir)
        if prepared is None:
            self.trace, self.trace_path, self.trace_meta = prepare_trace(spec, self.study_dir)
        else:  # the parent prepared it (`prepare_trace`): this process maps the file (an Arrow file: no copy)
            from servelab.traces.io import read_trace

            self.trace_path, self.trace_meta = Path(prepared[0]), dict(prepared[1])
            self.trace = read_trace(self.trace_path)
        if threads is None and self.trace.num_rows <= ONE_THREAD_ROWS:
            threads = 1
        # a small trace is scored by numpy (scoring/quick.py), bit-equal to DuckDB on one thread
        quick = threads == 1 and self.trace.num_rows <= ONE_THREAD_ROWS
        self.scorer = RunScorer(spec.slo, threads=threads, gpu_prices=dict(spec.gpu_prices), quick=quick)
        # the cost view's figures are read only when an objective needs them (a query per trial)
        self.wants_cost = "cost_per_million_tokens" in spec.objectives or (
            "cost" in spec.objectives and spec.base.cluster is not None)
        self.worker = worker_id()
        arrivals = self.trace.column("arrival_s")
        self.first_s = float(arrivals[0].as_py())
        self.last_s = float(arrivals[-1].as_py())
        self.quota_check = None  # set by the study loop: raises when n_trials is already met
        self.interrupted = None  # set by the study loop: a flag (is_set()), set on Ctrl-C
        # True while the replay and scoring run: only then may Ctrl-C raise KeyboardInterrupt (anywhere
        # else it could land in a storage write or Optuna's own bookkeeping, which it breaks)
        self.in_trial = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-write")
        self._writing = None  # the run being written in the background, if any

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.scorer.close()

    def __call__(self, trial) -> float | tuple[float, ...]:
        """Evaluate ``trial`` (Optuna's, or a pool worker's `RecordedTrial`); `Pruned`: pruned, or infeasible."""
        from servelab.search.space import config_for, suggest

        started, started_cpu = time.perf_counter(), time.process_time()
        attrs: dict[str, Any] = {}
        try:
            if self._interrupted():
                raise KeyboardInterrupt  # Ctrl-C came during Optuna's ask: this trial never starts
            trial.set_user_attr("worker", self.worker)
            if self.quota_check is not None:
                self.quota_check(trial)
            values = suggest(trial, self.spec.space, self.spec.base)
            config = config_for(self.spec.base, self.spec.space, values, source=f"trial {trial.number}",
                                gpu_budget=self.spec.gpu_budget, fill_pool=self.spec.fill_pool,
                                gpu_prices=dict(self.spec.gpu_prices))
            trial.set_user_attr("config", config.to_dict())
            result = self._evaluate_interruptibly(trial, config, attrs)
            attrs["eval_s"] = time.perf_counter() - started
            attrs["eval_cpu_s"] = time.process_time() - started_cpu  # this process's CPU (the writer thread's too)
            violation = attrs.pop("constraint_violation", None)
            if violation is not None and violation > 0:  # complete, with its values, but below the target
                _set_attrs(trial, attrs, outcome="infeasible", reason=(
                    f"infeasible: attainment {attrs['attainment']:.4f} < target {self.spec.target:g}"))
            else:
                _set_attrs(trial, attrs, outcome="ok")
            return result
        except QuotaReached:
            raise
        except ServelabError as err:
            self._discard(trial)
            _set_attrs(trial, attrs, outcome="infeasible", reason=f"infeasible: {err}")
            raise Pruned(f"infeasible: {err}") from None
        except Pruned as err:
            _set_attrs(trial, attrs, outcome="pruned", reason=str(err))
            raise
        except KeyboardInterrupt:
            self._discard(trial)
            _set_attrs(trial, {}, outcome="interrupted", reason="interrupted (Ctrl-C)")
            raise
        except Exception as err:
            interrupted = self.interrupted is not None and self.interrupted.is_set()
            if _duckdb_interrupt(err) or interrupted:
                # Ctrl-C arrived, but a library (DuckDB, a thread pool) turned it into its own exception
                self._discard(trial)
                _set_attrs(trial, {}, outcome="interrupted", reason="interrupted (Ctrl-C)")
                raise KeyboardInterrupt from err
            self._discard(trial)
            _set_attrs(trial, attrs, outcome="error", reason=f"error: {type(err).__name__}: {err}")
            raise
        finally:
            self.in_trial = False

    def _interrupted(self) -> bool:
        return self.interrupted is not None and self.interrupted.is_set()

    def _evaluate_interruptibly(self, trial, config, attrs: dict[str, Any]):
        """The replay and scoring: the one stretch where Ctrl-C raises at once (the study's signal handler reads in_trial)."""
        self.in_trial = True
        try:
            if self._interrupted():
                raise KeyboardInterrupt
            return self._evaluate(trial, config, attrs)
        finally:
            self.in_trial = False

    def _discard(self, trial) -> None:
        """Only complete trials keep a run directory (a failed one would mislead `servelab query trials/*`)."""
        writing, self._writing = self._writing, None
        if writing is not None:  # interrupted while its run was being written: let that finish first
            try:
                writing.result()
            except Exception:
                pass
        shutil.rmtree(trial_dir(self.study_dir, trial.number), ignore_errors=True)

    # -- one trial ---------------------------------------------------------------------------------

    def _evaluate(self, trial, config, attrs: dict[str, Any]) -> float | tuple[float, ...]:
        spec = self.spec
        out_dir = trial_dir(self.study_dir, trial.number)
        attrs["trial_dir"] = str(out_dir.relative_to(self.study_dir))
        if "goodput" in spec.objectives or "goodput_per_gpu" in spec.objectives:
            scores = self._goodput(trial, config, out_dir, attrs)
        else:
            if spec.checkpoints:
                self._checkpoints(trial, config, attrs)
            scores = self._replay(trial, config, out_dir, attrs)
        attrs.update(scores)
        values = []
        for name in spec.objectives:
            value = self._objective_value(name, scores, config)
            if value is None:
                raise ServelabError(f"objective '{name}' is undefined for this run (no request finished)")
            values.append(float(value))
        if "cost" in spec.objectives:
            attrs["cost"] = values[spec.objectives.index("cost")]
        if any(name in CONSTRAINED for name in spec.objectives):
            # feasible when attainment >= target; Optuna samplers and best_trial read this
            violation = spec.target - scores["attainment"]
            attrs["constraint_violation"] = violation
            if hasattr(trial, "set_constraint"):
                trial.set_constraint("attainment", violation)
            else:  # Optuna < 5: the list form of the same system attribute
                trial.storage.set_trial_system_attr(trial._trial_id, "constraints", [violation])
        if spec.checkpoints and spec.objectives == ("attainment",):
            trial.report(values[0], 100)
        return values[0] if len(values) == 1 else tuple(values)

    def _objective_value(self, name: str, scores: dict[str, Any], config) -> float | None:
        if name == "cost":
            if config.cluster is not None:
                # $/hour of the time-averaged GPUs (the cost view's dollars over the run's duration),
                # or the time-averaged GPUs when no pool has a price
                if scores.get("cost_duration_s") is None:
                    return None
                if scores.get("dollars"):
                    return scores["dollars"] / scores["cost_duration_s"] * 3600.0
                return scores.get("mean_gpus")
            gpus = config.engine.replicas * config.gpus_per_replica
            prices = dict(self.spec.gpu_prices)
            return gpus * prices[config.gpu] if prices else float(gpus)
        if name == "cost_per_million_tokens":
            return scores.get("dollars_per_million_output_tokens")
        return scores.get(name)

    def _replay_timed(self, config, attrs: dict[str, Any], trace_meta: dict | None = None):
        from servelab.assembly import replay

        t0, c0 = time.perf_counter(), time.thread_time()
        result = replay(self.trace, config, trace_meta=trace_meta or self.trace_meta)
        attrs["replay_s"] = attrs.get("replay_s", 0.0) + time.perf_counter() - t0
        attrs["replay_cpu_s"] = attrs.get("replay_cpu_s", 0.0) + time.thread_time() - c0
        return result

    def _checkpoints(self, trial, config, attrs: dict[str, Any]) -> None:
        span = self.last_s - self.first_s
        for fraction in self.spec.checkpoints:
            horizon = self.first_s + fraction * span
            cut = replace(config, engine=replace(config.engine, until_s=horizon))
            t0 = time.perf_counter()
            result = self._replay_timed(cut, attrs)
            attrs["checkpoint_replay_s"] = attrs.get("checkpoint_replay_s", 0.0) + time.perf_counter() - t0
            value = self.scorer.attainment(result, arrived_by_s=horizon)
            step = round(fraction * 100)
            trial.report(value, step)
            if trial.should_prune():
                attrs["pruned_at"] = fraction
                raise Pruned(f"pruned at {fraction:.0%} of the trace: attainment so far {value:.4f}")

    def _replay(self, trial, config, out_dir: Path, attrs: dict[str, Any]) -> dict[str, Any]:
        from servelab.replay import write_run

        t0 = time.perf_counter()
        result = self._replay_timed(config, attrs)
        t1 = time.perf_counter()
        result.meta["search"] = {"study": self.spec.study_name, "trial": trial.number, "params": dict(trial.params)}
        if not self.spec.slo.is_empty:  # the trial's report then shows the SLO the study ranked it under
            result.meta["slo"] = self.spec.slo.to_dict()

        def write() -> float:
            start = time.perf_counter()
            write_run(result, out_dir)
            return time.perf_counter() - start

        # Both finish before the trial is told complete (a complete trial always has its run).
        if self.scorer.quick:
            # scored by numpy in ~1.5 ms on a small trace: writing beside it in a thread saved no time and cost
            # ~2 ms of CPU a trial (the two threads contending: bench/RESULTS.md, Session 25), more beside
            # another worker's process, so this process writes the run itself
            scores = self.scorer.score(result, cost=self.wants_cost)
            t2 = time.perf_counter()
            write_s = write()
        else:
            # Parquet writing and DuckDB both release the GIL: the run is written while DuckDB scores it
            writing = self._writing = self._writer.submit(write)
            scores = self.scorer.score(result, cost=self.wants_cost)
            t2 = time.perf_counter()
            write_s = writing.result()
            self._writing = None
        attrs.update(final_replay_s=t1 - t0, score_s=t2 - t1, write_s=write_s, score_write_s=time.perf_counter() - t1)
        return scores

    def _goodput(self, trial, config, out_dir: Path, attrs: dict[str, Any]) -> dict[str, Any]:
        """Bisect the goodput rate with `servelab sweep`'s own search; trace-rate metrics from its native-rate run."""
        from servelab.replay import RunResult, write_run
        from servelab.scoring.gpus import num_gpus
        from servelab.scoring.sweep import native_rate, run_name, run_sweep

        spec = self.spec
        t0 = time.perf_counter()
        result = run_sweep(self.trace_path, config, out_dir, slo=spec.slo, target=spec.target,
                           tolerance=spec.goodput.tolerance, min_rate=spec.goodput.min_rate,
                           max_rate=spec.goodput.max_rate)  # fmt: skip
        attrs["sweep_s"] = time.perf_counter() - t0
        native = native_rate(self.trace)
        replay_s = 0.0
        for point in result.points:
            meta = json.loads((out_dir / point.run_dir / "run.json").read_text())
            replay_s += meta.get("wall_time_s", 0.0)
        attrs["replay_s"] = replay_s
        attrs["goodput_rates_tried"] = len(result.points)
        native_dir = out_dir / run_name(native)
        if not (native_dir / "requests.parquet").is_file():
            # the bisection never replayed the trace's own rate (min_rate/max_rate exclude it)
            native_dir = out_dir / "trace_rate"
            write_run(self._replay_timed(config, attrs), native_dir)
        run = RunResult(pq.read_table(native_dir / "requests.parquet"), pq.read_table(native_dir / "steps.parquet"),
                        json.loads((native_dir / "run.json").read_text()))  # fmt: skip
        scores = self.scorer.score(run, cost=self.wants_cost)
        goodput = result.goodput_rate_rps if result.goodput_rate_rps is not None else 0.0
        # GPUs provisioned: replicas x tp summed over a cluster's pools (an autoscaled one at its max)
        gpus = num_gpus(run.meta)
        scores.update(goodput=goodput, goodput_per_gpu=goodput / gpus, goodput_bracket_hi=result.bracket_rps[1])
        if result.notes:
            scores["goodput_note"] = "; ".join(result.notes)
        return scores


def _duckdb_interrupt(err: BaseException) -> bool:
    """``err`` is DuckDB's form of Ctrl-C (without importing DuckDB: a small trace's worker scores by numpy)."""
    duckdb = sys.modules.get("duckdb")
    return duckdb is not None and isinstance(err, duckdb.InterruptException)


# Shown as separate user attributes (Optuna's own tools list them); the rest go in one "metrics"
# attribute. Each attribute is one storage write (a journal append, a database row): writing
# thirteen of them was a third of a trial's overhead once the replay got fast. trials.parquet
# flattens both into the same attr.* columns.
KEY_ATTRS = ("attainment", "goodput", "cost", "trial_dir", "pruned_at")


def _set_attrs(trial, attrs: dict[str, Any], outcome: str, reason: str | None = None) -> None:
    metrics = {}
    for key, value in attrs.items():
        if not (value is None or isinstance(value, (int, float, str, bool))):
            continue
        if key in KEY_ATTRS:
            trial.set_user_attr(key, value)
        else:
            metrics[key] = value
    trial.set_user_attr("metrics", metrics)
    trial.set_user_attr("outcome", outcome)
    if reason is not None:
        trial.set_user_attr("reason", reason)


__all__ = ["Evaluator", "prepare_trace", "trial_dir", "worker_id", "process_start_token"]
