"""Replay one trace at scaled arrival rates and find the goodput rate: the highest rate meeting an attainment target.

A rate is the offered mean arrival rate ``(n - 1) / (last arrival - first arrival)`` in req/s; the
trace is replayed at rate r by dividing every arrival time by ``k = r / native_rate``. The search
first doubles (or halves) from a start rate until one rate meets the target and a higher one misses
it, then bisects that bracket until ``hi / lo - 1 <= tolerance``. With ``jobs`` processes the next
steps of the walk (or the next levels of the bisection tree) are replayed at once and then read in
order, so the bracket found is the same for any number of processes; only extra, unused rates are
replayed.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import pyarrow as pa

from servelab.common.atomic import atomic_dir, atomic_path
from servelab.common.errors import ServelabError
from servelab.scoring.slo import SloTable

if TYPE_CHECKING:
    from servelab.scoring.memory import RunConnection

MAX_EXPANSIONS = 20  # doublings/halvings before giving up on a bracket
MAX_POINTS = 200


@dataclass(frozen=True, slots=True)
class SweepPoint:
    rate_rps: float  # offered rate asked for
    scale: float  # arrival times divided by this
    run_dir: str  # relative to the sweep directory
    requests: int
    attainment: float
    attainment_ttft: float | None
    attainment_tpot: float | None
    goodput_rps: float | None
    request_throughput_rps: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    unfinished: int
    refused: int
    num_gpus: int


@dataclass(frozen=True, slots=True)
class SweepResult:
    target: float | None
    tolerance: float | None
    native_rate_rps: float
    points: tuple[SweepPoint, ...]
    goodput_rate_rps: float | None = None  # highest tested rate meeting the target below the first miss
    bracket_rps: tuple[float | None, float | None] | None = None  # (meets, misses)
    notes: tuple[str, ...] = field(default=())
    slo: dict | None = None  # the SLO table the points were scored with (SloTable.to_dict), None without one

    @property
    def goodput_rate_per_gpu(self) -> float | None:
        if self.goodput_rate_rps is None or not self.points:
            return None
        return self.goodput_rate_rps / self.points[0].num_gpus

    def to_dict(self) -> dict:
        d = asdict(self)
        d["points"] = [asdict(p) for p in self.points]
        d["goodput_rate_per_gpu"] = self.goodput_rate_per_gpu
        return d


def native_rate(trace: pa.Table) -> float:
    """Offered rate of the trace as written: (n - 1) / arrival span."""
    arrivals = trace.column("arrival_s").to_numpy(zero_copy_only=False)
    if len(arrivals) < 2 or arrivals.max() <= arrivals.min():
        raise ServelabError("sweep needs a trace with at least two distinct arrival times")
    return (len(arrivals) - 1) / float(arrivals.max() - arrivals.min())


def goodput_rate(points: Iterable[tuple[float, float]], target: float) -> tuple[float | None, float | None]:
    """(highest rate meeting ``target`` below the first rate that misses it, that first missing rate).

    Conservative when attainment is not monotone in rate: a pass above a miss does not count.
    """
    lo = hi = None
    for rate, attainment in sorted(points):
        if attainment >= target:
            lo = rate
        else:
            hi = rate
            break
    return lo, hi


def run_name(rate: float) -> str:
    return f"rate_{rate:.6g}"


def _replay_point(trace_path: str, trace_meta: dict, config, slo: SloTable | None, scale: float, rate: float,
                  run_dir: str, scores: RunConnection | None = None) -> dict:
    """Worker: replay at one scale, write the run, score it. Top-level so processes can import it.

    The run is scored from its tables in memory, not read back from the files just written: on
    ``scores`` (the sweep's connection, reused point after point) or, in a worker process, on a
    connection of its own."""
    from servelab.assembly import replay, write_run
    from servelab.scoring.memory import RunConnection
    from servelab.traces.io import read_trace
    from servelab.traces.transforms import scale_rate

    trace = scale_rate(read_trace(trace_path), scale)
    result = replay(trace, config, trace_meta=dict(trace_meta, rate_scale=scale, rate_rps=rate))
    if slo is not None and not slo.is_empty:  # each run keeps the SLO the sweep scored it with
        result.meta["slo"] = slo.to_dict()
    write_run(result, run_dir)
    own = scores is None
    if own:
        scores = RunConnection(slo)
    scores.register(result.requests, result.steps, result.meta)
    con = scores.con
    try:
        rel = con.execute("SELECT * FROM slo_attainment WHERE scope = 'overall'")
        cols = [d[0] for d in rel.description]
        att = dict(zip(cols, rel.fetchall()[0]))
        g = con.execute("SELECT goodput_rps, request_throughput_rps, num_gpus FROM goodput WHERE scope = 'overall'").fetchall()[0]
        lat = dict(con.execute(
            "SELECT metric, p99 FROM latency_summary WHERE scope = 'overall' AND metric IN ('ttft_s', 'tpot_s')"
        ).fetchall())  # fmt: skip
    finally:
        if own:
            scores.close()
    return {
        "requests": att["requests"],
        "attainment": att["attainment"],
        "attainment_ttft": att["attainment_ttft"],
        "attainment_tpot": att["attainment_tpot"],
        "goodput_rps": g[0],
        "request_throughput_rps": g[1],
        "num_gpus": g[2],
        "ttft_p99_s": lat.get("ttft_s"),
        "tpot_p99_s": lat.get("tpot_s"),
        "unfinished": att["unfinished"],
        "refused": att["rejected"] + att["throttled"] + att["dropped"],
    }


class _Evaluator:
    """Replays rates (in parallel when jobs > 1), each once, collecting SweepPoints."""

    def __init__(self, trace_path, trace_meta, config, slo, native, work_dir: Path, jobs: int, progress):
        self.args = (str(trace_path), trace_meta, config, slo)
        self.native = native
        self.work_dir = work_dir
        self.jobs = jobs
        self.progress = progress
        self.points: dict[float, SweepPoint] = {}
        self.pool = None
        self.scores = None  # one scoring connection for the points replayed in this process

    def __enter__(self):
        if self.jobs > 1:
            # spawn, not fork: a forked child would inherit the parent's DuckDB/Arrow thread pools
            self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=get_context("spawn"))
        else:
            from servelab.scoring.memory import RunConnection

            self.scores = RunConnection(self.args[3])
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        if self.scores is not None:
            self.scores.close()

    def evaluate(self, rates: list[float]) -> list[SweepPoint]:
        todo = sorted({r for r in rates if r not in self.points})
        if len(self.points) + len(todo) > MAX_POINTS:
            raise ServelabError(f"sweep would replay more than {MAX_POINTS} rates; loosen --tolerance")
        jobs = []
        for rate in todo:
            scale = rate / self.native
            name = run_name(rate)
            if any(p.run_dir == name for p in self.points.values()):
                raise ServelabError(f"rates too close to tell apart ({name}); loosen --tolerance")
            jobs.append((rate, scale, name, (*self.args, scale, rate, str(self.work_dir / name))))
        if self.pool is None:
            results = [_replay_point(*a, scores=self.scores) for *_, a in jobs]
        else:
            futures = [self.pool.submit(_replay_point, *a) for *_, a in jobs]
            results = [f.result() for f in futures]
        for (rate, scale, name, _), res in zip(jobs, results):
            point = SweepPoint(rate_rps=rate, scale=scale, run_dir=name, **res)
            self.points[rate] = point
            if self.progress:
                self.progress(point)
        return [self.points[r] for r in rates]


def _passes(ev: _Evaluator, rate: float, target: float) -> bool:
    return ev.points[rate].attainment >= target


def _bracket(ev: _Evaluator, start: float, target: float, jobs: int, min_rate, max_rate) -> tuple[float | None, float | None]:
    """Walk from ``start`` by doubling (it passes) or halving (it misses) until the outcome flips.

    ``jobs`` steps of the walk are replayed at once; the walk itself reads them in order, so the
    bracket is the one a single process would find.
    """
    if ev.points:  # a grid was given: start from its conservative bracket if it has one
        lo, hi = goodput_rate([(p.rate_rps, p.attainment) for p in ev.points.values()], target)
        if lo is not None and hi is not None:
            return lo, hi
        start = max(ev.points) if hi is None else min(ev.points)
    ev.evaluate([start])
    up = _passes(ev, start, target)
    limit = max_rate if up else min_rate
    prev = start
    walk: list[float] = []
    rate = start
    for _ in range(MAX_EXPANSIONS):
        if limit is not None and (rate >= limit if up else rate <= limit):
            break
        rate = rate * 2 if up else rate / 2
        if limit is not None:
            rate = min(rate, limit) if up else max(rate, limit)
        walk.append(rate)
    for i in range(0, len(walk), jobs):
        batch = walk[i : i + jobs]
        ev.evaluate(batch)
        for rate in batch:
            if _passes(ev, rate, target) != up:
                return (prev, rate) if up else (rate, prev)
            prev = rate
    return (prev, None) if up else (None, prev)


def _tree(lo: float, hi: float, depth: int) -> list[float]:
    """Midpoints of ``depth`` bisection levels below (lo, hi), computed exactly as the walk computes them."""
    if depth == 0:
        return []
    mid = (lo + hi) / 2
    return [mid, *_tree(lo, mid, depth - 1), *_tree(mid, hi, depth - 1)]


def _bisect(ev: _Evaluator, lo: float, hi: float, target: float, tolerance: float, jobs: int) -> tuple[float, float]:
    """Halve (lo, hi) until hi/lo - 1 <= tolerance; with more jobs, several levels are replayed per round.

    ``2**L - 1`` points cover the next L levels whichever way the path turns, and the path is then
    walked exactly as serial bisection would, so the bracket does not depend on ``jobs``.
    """
    levels = max(1, int(math.log2(jobs + 1)))
    while hi / lo - 1 > tolerance:
        needed = max(1, math.ceil(math.log2((hi - lo) / (tolerance * lo))))  # lo only grows: an upper bound
        depth = min(levels, needed)
        ev.evaluate(_tree(lo, hi, depth))
        for _ in range(depth):
            mid = (lo + hi) / 2
            if _passes(ev, mid, target):
                lo = mid
            else:
                hi = mid
            if hi / lo - 1 <= tolerance:
                break
    return lo, hi


def run_sweep(
    trace_path: str | os.PathLike,
    config,
    out_dir: str | os.PathLike,
    slo: SloTable | None = None,
    rates: list[float] | None = None,
    scales: list[float] | None = None,
    target: float | None = None,
    tolerance: float = 0.02,
    jobs: int = 1,
    min_rate: float | None = None,
    max_rate: float | None = None,
    progress: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """Replay at the given rates and/or search the goodput rate; writes one run dir per rate plus sweep.json."""
    from servelab.traces.io import read_trace, trace_sha256

    if not rates and not scales and target is None:
        raise ServelabError("sweep needs --rates, --rate-scales or --goodput-target")
    if target is not None and not 0 < target <= 1:
        raise ServelabError(f"--goodput-target must be in (0, 1], got {target}")
    if target is not None and not 1e-4 <= tolerance < 1:
        raise ServelabError(f"--tolerance must be in [0.0001, 1), got {tolerance}")
    if jobs < 1:
        raise ServelabError(f"--jobs must be >= 1, got {jobs}")
    for name, values in (("--rates", rates), ("--rate-scales", scales)):
        if values and any(not (v > 0 and math.isfinite(v)) for v in values):
            raise ServelabError(f"{name} must all be positive numbers")
    if min_rate is not None and max_rate is not None and min_rate >= max_rate:
        raise ServelabError("--min-rate must be below --max-rate")
    trace = read_trace(trace_path)
    native = native_rate(trace)
    has_overrides = any(c in trace.column_names and trace.column(c).null_count < trace.num_rows
                        for c in ("ttft_slo_s", "tpot_slo_s"))  # fmt: skip
    if target is not None and slo is None and not has_overrides:
        raise ServelabError("--goodput-target needs an SLO (--slo or --slo-file)")
    meta = {"path": str(trace_path), "name": Path(trace_path).stem, "sha256": trace_sha256(trace_path)}
    grid = sorted({*(rates or []), *(s * native for s in scales or [])})
    out_dir = Path(out_dir)
    notes: list[str] = []
    with atomic_dir(out_dir) as work, _Evaluator(trace_path, meta, config, slo, native, work, jobs, progress) as ev:
        if grid:
            ev.evaluate(grid)
        lo = hi = None
        if target is not None:
            start = min_rate if min_rate is not None else (max_rate if max_rate is not None and max_rate < native else native)
            lo, hi = _bracket(ev, start, target, jobs, min_rate, max_rate)
            if lo is None:
                notes.append(f"attainment is below {target:g} even at the lowest rate tried ({min(ev.points):.6g} req/s)")
            elif hi is None:
                notes.append(f"attainment meets {target:g} at every rate tried, up to {max(ev.points):.6g} req/s")
            else:
                lo, hi = _bisect(ev, lo, hi, target, tolerance, jobs)
        points = tuple(ev.points[r] for r in sorted(ev.points))
        result = SweepResult(
            target=target, tolerance=tolerance if target is not None else None, native_rate_rps=native,
            points=points, goodput_rate_rps=lo if target is not None else None,
            bracket_rps=(lo, hi) if target is not None else None, notes=tuple(notes),
            slo=slo.to_dict() if slo is not None and not slo.is_empty else None,
        )  # fmt: skip
        with atomic_path(work / "sweep.json") as tmp:
            tmp.write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    return result


def sweep_of(run_dirs: Iterable[str | os.PathLike]) -> tuple[Path, dict] | None:
    """The sweep directory and its sweep.json when every run given comes from one sweep, else None."""
    from servelab.scoring.sources import find_runs

    parents = {r.path.resolve().parent for r in find_runs([str(d) for d in run_dirs])}
    if len(parents) != 1:
        return None
    sweep_dir = parents.pop()
    try:
        data = json.loads((sweep_dir / "sweep.json").read_text())
    except (OSError, ValueError):
        return None
    return (sweep_dir, data) if isinstance(data, dict) else None


def sweep_slo(run_dirs: Iterable[str | os.PathLike]) -> SloTable | None:
    """The SLO a sweep scored its points with, when every run given comes from that one sweep.

    Sweeps written before the SLO was stored in sweep.json give None.
    """
    found = sweep_of(run_dirs)
    if found is None or not isinstance(found[1].get("slo"), dict):
        return None
    sweep_dir, data = found
    table = SloTable.from_toml(data["slo"], str(sweep_dir / "sweep.json"))
    return None if table.is_empty else table
