"""Score one run's request table with numpy, bit-equal to the scoring views' summary (no DuckDB, no files).

A search scores every trial; on a small trace (2,000 requests) DuckDB spends most of a trial's
scoring time planning the views, not aggregating. This module computes the same figures as one
pass over `request_metrics` joined with `run_span` (search/scorer.py's summary query) straight from
the Arrow columns, with the same float operations in the same order, so every value is the very
same double:

- an average is a sequential sum divided by the count (DuckDB's `avg` on one thread adds the rows in
  order; numpy's `sum` is pairwise and may differ in the last bit, so a cumulative sum is used);
- `quantile_cont` sorts and interpolates as DuckDB does, ``lo * (1 - d) + hi * d`` at
  ``(n - 1) * q`` (numpy's own interpolation rounds differently);
- SQL NULLs are NaN here, so a run holding a real NaN (or a NULL status) is refused (NotQuick) and
  the caller asks DuckDB; so is an empty run (DuckDB's 0 / 0 is NULL);
- so is an SLO table with per-tier or per-tenant entries: `request_metrics` joins them on, and
  DuckDB's hash join then emits the rows in another order (matched ones first), which changes the
  last bit of a mean. The per-request SLO columns (`ttft_slo_s`, ...) need no join and are modelled.

A mean is only reproducible when DuckDB scores on one thread (two threads add in another order):
the search's scorer for a small trace does (search/objective.py).

tests/test_scoring_quick.py compares both on many runs: unfinished requests, tiers, tenants,
per-request SLOs, a latency exactly at its SLO.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from servelab.common.kernels import call
from servelab.scoring.slo import SloTable

QUANTILES = (0.5, 0.9, 0.99)  # the summary's quantile_cont list
METRICS = ("ttft", "tpot", "e2e", "queue", "max_itl")
# the SLO fields of request_metrics' met_* flags, with the per-request column that overrides each
_SLO_FIELDS = (("ttft_s", "ttft_slo_s"), ("tpot_s", "tpot_slo_s"), ("e2e_s", "e2e_slo_s"), ("max_stall_s", "max_stall_slo_s"))


class NotQuick(Exception):
    """The run holds something the numpy path does not model (a NaN, a NULL status): score it with DuckDB."""


def _floats(table: pa.Table, name: str) -> np.ndarray:
    """A float column as float64 with NULL as NaN (a missing optional column: all NULL); a real NaN refuses."""
    index = table.schema.get_field_index(name)  # (~2 us: `table.column_names` builds the list, ~35 us a call)
    if index < 0:  # absent, or named twice (which table.column refuses, as before)
        if name not in table.column_names:
            return np.full(table.num_rows, np.nan)
        column = table.column(name)
    else:
        column = table.column(index)
    values = _float64(column)
    if int(np.count_nonzero(np.isnan(values))) != column.null_count:
        raise NotQuick(f"NaN in {name}")
    return values


def _float64(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as float64, NULL as NaN: what ``column.cast(pa.float64()).fill_null(nan)`` gives, without
    ``pyarrow.compute`` (those two methods import it: ~75 ms of CPU, common/kernels.py). Arrow converts a float or
    integer column holding NULLs to a float64 array with NaN there; integers are exact up to 2**53 either way."""
    return column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _avg(values: np.ndarray) -> float | None:
    """DuckDB's avg on one thread: the rows added in order, over their count."""
    if values.size == 0:
        return None
    return float(np.cumsum(values)[-1]) / values.size


def _quantiles(values: np.ndarray) -> list[float] | None:
    """DuckDB's quantile_cont(x, [0.5, 0.9, 0.99]): linear interpolation, computed its way.

    Only the ranks either side of each quantile are needed: ``np.partition`` puts those values where a sort
    would (the same doubles) in a quarter of a sort's time (2,000 values: ~12 us against ~44, five metrics
    a trial)."""
    if values.size == 0:
        return None
    bounds = []
    for q in QUANTILES:
        rn = (values.size - 1) * q
        bounds.append((rn, math.floor(rn), math.ceil(rn)))
    ordered = np.partition(values, sorted({k for _, lo, hi in bounds for k in (lo, hi)}))
    out = []
    for rn, lo, hi in bounds:
        if lo == hi:
            out.append(float(ordered[lo]))
        else:
            d = rn - lo
            out.append(float(ordered[lo]) * (1.0 - d) + float(ordered[hi]) * d)
    return out


def _effective_slo(requests: pa.Table, slo: SloTable, field: str, column: str) -> np.ndarray:
    """coalesce(the request's own, the global) per request (no tier or tenant entries here); NaN where none applies."""
    value = getattr(slo.global_, field)
    own = _floats(requests, column)
    return np.where(np.isnan(own), np.nan if value is None else float(value), own)


def _met(metric: np.ndarray, limit: np.ndarray, finished: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the flag is defined, it is true): ``CASE WHEN slo IS NOT NULL THEN finished AND coalesce(x <= slo, false) END``."""
    defined = ~np.isnan(limit)
    with np.errstate(invalid="ignore"):
        ok = finished & ~np.isnan(metric) & (metric <= limit)
    return defined, defined & ok


def _span_duration(requests: pa.Table, steps: pa.Table, arrival: np.ndarray, first_token: np.ndarray,
                   finish: np.ndarray, finished: np.ndarray, end_s: float | None) -> float | None:  # fmt: skip
    """run_span's duration_s: first arrival to the last finish (to the run's end when none finished); NULL if 0.

    ``end_s`` is where the replay stopped (run.json's simulated_span_s); without it, the last event."""
    last_event = float(np.max(np.maximum(arrival, np.maximum(np.where(np.isnan(first_token), arrival, first_token),
                                                             np.where(np.isnan(finish), arrival, finish)))))  # fmt: skip
    done = finish[finished & ~np.isnan(finish)]
    if done.size:
        end = float(np.max(done))
    elif end_s is not None:
        end = float(end_s)
    else:
        step_ends = _floats(steps, "start_s") + _floats(steps, "duration_s")
        step_ends = step_ends[~np.isnan(step_ends)]
        end = max(last_event, float(np.max(step_ends))) if step_ends.size else last_event
    duration = end - float(np.min(arrival))
    return None if duration == 0.0 else duration


def summary_rows(requests: pa.Table, steps: pa.Table | None, num_gpus: int | None, slo: SloTable | None,
                 by_tier: bool, end_s: float | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The scorer's summary rows: the overall one, then (``by_tier``) one per tier, ordered as the SQL's.

    Without ``steps`` the overall row has only the counts and attainments (no latencies, no span).
    ``end_s`` is the run's end (run.json's simulated_span_s): requests arriving after it were never
    offered and are left out, as the views' run_span does. Raises NotQuick for a run only DuckDB
    scores faithfully.
    """
    if end_s is not None and requests.num_rows:
        late = call("greater", requests.column("arrival_s"), end_s)
        if call("any", late).as_py():
            requests = requests.filter(call("invert", late))  # (Table.filter imports pyarrow.compute: rare)
    slo = slo or SloTable()
    if slo.tiers or slo.tenants:
        raise NotQuick("per-tier or per-tenant SLO entries (DuckDB joins them on and reorders the rows)")
    if any(isinstance(v, float) and math.isnan(v) for v in (getattr(slo.global_, f) for f, _ in _SLO_FIELDS)):
        raise NotQuick("NaN SLO")
    n = requests.num_rows
    if n == 0:
        raise NotQuick("no requests")
    status = requests.column("status")
    if status.null_count:
        raise NotQuick("NULL status")
    finished = call("equal", status, "finished").to_numpy(zero_copy_only=False)
    arrival = _floats(requests, "arrival_s")
    if np.isnan(arrival).any():
        raise NotQuick("NULL arrival_s")
    first_token, finish = _floats(requests, "first_token_s"), _floats(requests, "finish_s")
    output = requests.column("output_tokens")
    tokens = _float64(output)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (finish - first_token) / (tokens - 1.0), np.nan)
    # a finished output of at most one token meets any TPOT SLO (vLLM's goodput: TPOT 0) but has no TPOT to summarise
    tpot_flag = np.where(tokens <= 1, 0.0, tpot)
    max_itl = _floats(requests, "max_itl_s")
    metrics = {"ttft": first_token - arrival, "tpot": np.where(finished, tpot, np.nan),
               "e2e": np.where(finished, finish - arrival, np.nan),
               "queue": _floats(requests, "first_scheduled_s") - arrival, "max_itl": max_itl}  # fmt: skip
    stall = np.where(finished, np.where(np.isnan(max_itl), 0.0, max_itl), np.nan)
    flags = {}
    met_all = finished.copy()
    for (field, column), metric in zip(_SLO_FIELDS, (metrics["ttft"], tpot_flag, metrics["e2e"], stall)):
        defined, met = _met(metric, _effective_slo(requests, slo, field, column), finished)
        flags[field] = (defined, met)
        met_all &= ~defined | met
    met_count = int(np.count_nonzero(met_all))
    row: dict[str, Any] = {"by_tier": False, "tier": None, "requests": n, "completed": int(np.count_nonzero(finished)),
                           "met_all": met_count, "attainment": met_count / n}  # fmt: skip
    for key, field in (("attainment_ttft", "ttft_s"), ("attainment_tpot", "tpot_s")):
        defined, met = flags[field]
        count = int(np.count_nonzero(defined))
        row[key] = int(np.count_nonzero(met)) / count if count else None
    rows = [row]
    if steps is None:
        return rows
    for name in METRICS:
        values = metrics[name][finished]
        values = values[~np.isnan(values)]
        row[f"{name}_mean"] = _avg(values)
        row[f"{name}_q"] = _quantiles(values)
    row["span_duration_s"] = _span_duration(requests, steps, arrival, first_token, finish, finished, end_s)
    row["span_num_gpus"] = 1 if num_gpus is None else int(num_gpus)
    if by_tier:
        tiers = requests.column("tier").to_pylist()
        groups: dict[str | None, list[int]] = {}
        for i, tier in enumerate(tiers):
            groups.setdefault(tier, []).append(i)
        met_list = met_all.tolist()
        for tier in sorted(groups, key=lambda t: (t is None, t or "")):  # ORDER BY tier: NULLS LAST
            members = groups[tier]
            rows.append({"by_tier": True, "tier": tier, "attainment": sum(met_list[i] for i in members) / len(members)})
    return rows


def attainment(requests: pa.Table, slo: SloTable | None, end_s: float | None = None) -> float:
    """slo_attainment's overall attainment (the share of the requests arriving by ``end_s`` that meet every SLO);
    raises NotQuick as above."""
    return summary_rows(requests, None, None, slo, by_tier=False, end_s=end_s)[0]["attainment"]


__all__ = ["NotQuick", "summary_rows", "attainment"]
