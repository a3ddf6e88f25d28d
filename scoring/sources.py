"""Find run directories and register their Parquet files and run.json as the base tables `requests`, `steps`, `runs`.

Every request and step row carries its ``run_id``; columns a run lacks (older or newer engines,
optional platform columns) are filled with NULL so the derived views work on any mix of runs.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import pyarrow as pa

from servelab.common.errors import InputError, ServelabError
from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA
from servelab.scoring.gpus import num_gpus, pool_rows  # (their home: scoring/gpus.py)

if TYPE_CHECKING:  # (DuckDB only for its type: registering a run imports it where it runs)
    import duckdb

# Columns a run's requests.parquet may lack (every replay writes num_retries and paused_s; the others are
# added by later engines/policies, imports or agentic traces); views see NULL where a run lacks them.
OPTIONAL_REQUEST_COLUMNS = pa.schema(
    [
        ("num_retries", pa.int32()),
        ("paused_s", pa.float64()),
        ("e2e_slo_s", pa.float64()),
        ("max_stall_slo_s", pa.float64()),
        ("source_request_id", pa.string()),  # imported runs: the source's own id of the request
        ("depends_on", pa.list_(pa.int64())),  # agentic traces: request ids it waited for (scoring/tasks.py)
        ("think_s", pa.float64()),  # its wait after the parents finished (tool or think time)
        ("task_deadline_s", pa.float64()),  # its task's deadline from the trace
    ]
)
# `runs` columns the views read that runs_table adds for every run, with their DuckDB types: a file
# collected before they existed gets them as NULL (scoring/db.py open_collected).
RUNS_VIEW_COLUMNS = (("source_duration_s", "DOUBLE"), ("stopped_by", "VARCHAR"), ("not_sent", "BIGINT"))
# Without these a requests.parquet cannot be scored at all.
REQUIRED_REQUEST_COLUMNS = ("request_id", "status", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens")
REQUIRED_STEP_COLUMNS = ("start_s", "duration_s")


@dataclass(frozen=True, slots=True)
class RunDir:
    run_id: str
    path: Path
    meta: dict  # run.json (empty if the run has none)

    @property
    def requests_path(self) -> Path:
        return self.path / "requests.parquet"

    @property
    def steps_path(self) -> Path:
        return self.path / "steps.parquet"

    @property
    def tokens_path(self) -> Path:
        return self.path / "tokens.parquet"  # only with `servelab replay --token-log`

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.parquet"  # only in live runs (`servelab bench`): the server's /metrics


def find_runs(patterns: Iterable[str | os.PathLike]) -> list[RunDir]:
    """Expand paths/globs to run directories (a directory holding requests.parquet), in a stable order.

    A directory without requests.parquet is searched one and two levels down, so a sweep or search
    directory (``SWEEP/rate_*``, ``study/trials/*``) can be given whole.
    """
    dirs: list[Path] = []
    for pattern in patterns:
        text = str(pattern)
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not matches:
            raise ServelabError(f"{text}: no run directory matches")
        for match in matches:
            p = Path(match)
            if not p.exists():
                raise InputError(p, "no such run directory")
            if p.is_file() and p.name == "requests.parquet":
                p = p.parent
            if (p / "requests.parquet").is_file():
                dirs.append(p)
                continue
            if not p.is_dir():
                raise InputError(p, "not a run directory (expected a directory with requests.parquet)")
            found = [*p.glob("*/requests.parquet"), *p.glob("*/*/requests.parquet")]
            # skip hidden folders: atomic writes in progress (.name.xxx.tmp) live there
            nested = sorted({q.parent for q in found if not any(part.startswith(".") for part in q.relative_to(p).parts)})
            if not nested:
                raise InputError(p, "not a run directory: no requests.parquet in it or below it")
            dirs.extend(nested)
    seen: set[Path] = set()
    unique = []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(r)
    metas = [read_meta(d) for d in unique]
    ids = _unique_ids([str(m.get("run_id") or d.name) for d, m in zip(unique, metas)], unique)
    return [RunDir(i, d, m) for i, d, m in zip(ids, unique, metas)]


def read_meta(d: Path) -> dict:
    path = d / "run.json"
    if not path.exists():  # every writer writes run.json with the tables, all or nothing: this folder is a
        # leftover or hand-made, and reading it would default its GPUs (to 1), duration and settings
        raise InputError(path, "missing: an incomplete run folder (its GPUs, duration and settings are unknown)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(path, f"not valid JSON: {err.msg}", row=err.lineno) from None
    if not isinstance(meta, dict):
        raise InputError(path, "must hold a JSON object")
    return meta


def _unique_ids(ids: list[str], paths: list[Path]) -> list[str]:
    """Keep run ids as given; where two runs share one, prefix parent folder names until they differ."""
    out = list(ids)
    for depth in range(1, 8):
        counts: dict[str, int] = {}
        for i in out:
            counts[i] = counts.get(i, 0) + 1
        clashes = [k for k, i in enumerate(out) if counts[i] > 1]
        if not clashes:
            return out
        for k in clashes:
            parents = paths[k].parts[-1 - depth : -1]
            out[k] = "/".join([*parents, ids[k]])
    return [str(p) for p in paths]


_NOT_SQL_NAME = re.compile(r"[^0-9A-Za-z_]")


def flatten_meta(meta: dict) -> dict:
    """run.json -> one flat row: ``policy.params.x`` -> ``policy_x``, ``engine.max_num_seqs`` -> ``engine_max_num_seqs``.

    Column names are plain SQL identifiers: any character other than a letter, digit or ``_`` becomes
    ``_`` (``runner.kv_capacity_tokens_at_0.9`` -> ``runner_kv_capacity_tokens_at_0_9``), so no
    column needs quoting.
    """
    flat: dict[str, object] = {}

    def put(key: str, value: object) -> None:
        key = _NOT_SQL_NAME.sub("_", key)
        if isinstance(value, dict):
            for k, v in value.items():
                # the "params" level is dropped: policy.params.chunk -> policy_chunk
                put(key if k == "params" else f"{key}_{k}", v)
        elif isinstance(value, (list, tuple)):
            flat.setdefault(key, json.dumps(value, sort_keys=True))
        elif key in flat:  # a param named like a top-level field keeps its params_ prefix
            flat[key.replace("_", "_params_", 1)] = value
        else:
            flat[key] = value

    for k, v in meta.items():
        if k == "run_id":
            continue
        if isinstance(v, dict):
            # top-level scalars of the section first, so params never shadow them
            for kk, vv in v.items():
                if not isinstance(vv, dict) and kk != "params":
                    put(f"{k}_{kk}", vv)
            for kk, vv in v.items():
                if isinstance(vv, dict):
                    put(f"{k}" if kk == "params" else f"{k}_{kk}", vv)
        else:
            put(k, v)
    return flat


POOLS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("pool", pa.string()), ("role", pa.string()), ("gpu", pa.string()),
    ("tp", pa.int64()), ("replicas", pa.int64()), ("gpus", pa.int64()), ("price_per_gpu_hour", pa.float64()),
    ("gpu_s", pa.float64()),  # an autoscaled pool's GPU time (replica-seconds x TP); null: gpus x duration
])


def pools_table(runs: list[RunDir]) -> pa.Table:
    """One row per pool of every run: its GPU type, TP, replicas, GPUs and price (the cost view's input)."""
    rows = [dict(p, run_id=r.run_id) for r in runs for p in pool_rows(r.meta)]
    return pa.Table.from_pylist(rows, schema=POOLS_SCHEMA)


def runs_table(runs: list[RunDir]) -> pa.Table:
    """One row per run: id, path, GPUs and every run.json field flattened (mixed-type fields become strings)."""
    rows = []
    for r in runs:
        row = {"run_id": r.run_id, "run_path": str(r.path), "num_gpus": num_gpus(r.meta)}
        row.update(flatten_meta(r.meta))
        span = row.get("simulated_span_s")  # the views read it; always a float column
        row["simulated_span_s"] = float(span) if isinstance(span, (int, float)) and not isinstance(span, bool) else None
        # an imported run's own benchmark duration (run.json source.duration_s), the duration of its throughput
        source = r.meta.get("source") if isinstance(r.meta.get("source"), dict) else {}
        dur = source.get("duration_s")
        row["source_duration_s"] = float(dur) if isinstance(dur, (int, float)) and not isinstance(dur, bool) and dur > 0 else None
        # a live run stopped early (stopped_by: interrupt, duration) and the requests it never sent
        row["stopped_by"] = str(r.meta["stopped_by"]) if r.meta.get("stopped_by") is not None else None
        not_sent = (r.meta.get("counts") or {}).get("not_sent") if isinstance(r.meta.get("counts"), dict) else None
        row["not_sent"] = int(not_sent) if isinstance(not_sent, int) and not isinstance(not_sent, bool) else 0
        rows.append(row)
    keys: list[str] = []
    for row in rows:
        for k in row:
            if k not in keys:
                keys.append(k)
    cols = {}
    for k in keys:
        values = [row.get(k) for row in rows]
        try:
            arr = pa.array(values, {"simulated_span_s": pa.float64(), "source_duration_s": pa.float64(),
                                    "stopped_by": pa.string(),
                                    "not_sent": pa.int64()}.get(k))
            if pa.types.is_null(arr.type):
                arr = arr.cast(pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arr = pa.array([None if v is None else (json.dumps(v) if not isinstance(v, str) else v) for v in values])
        cols[k] = arr
    if not cols:
        cols = {"run_id": pa.array([], pa.string()), "run_path": pa.array([], pa.string()), "num_gpus": pa.array([], pa.int64())}
    return pa.table(cols)


def _duck_type(t: pa.DataType) -> str:
    return {
        pa.int64(): "BIGINT",
        pa.int32(): "INTEGER",
        pa.float64(): "DOUBLE",
        pa.string(): "VARCHAR",
        pa.bool_(): "BOOLEAN",
        pa.list_(pa.int64()): "BIGINT[]",
    }[t]


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _file_columns(files: list[str], required: tuple[str, ...]) -> tuple[list[str], int]:
    """Union of the files' column names and their total rows (footer reads only).

    A file lacking a required column is an error naming it.
    """
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    rows = 0
    for f in files:
        try:
            meta = pq.read_metadata(f)
        except (pa.ArrowInvalid, OSError) as err:
            raise InputError(f, f"not a readable Parquet file ({err})") from None
        present = meta.schema.to_arrow_schema().names
        for col in required:
            if col not in present:
                raise InputError(f, "missing required column", column=col)
        names.update(dict.fromkeys(present))
        rows += meta.num_rows
    return list(names), rows


def _select_list(present: list[str], schemas: list[pa.Schema]) -> str:
    """Every schema column, NULL-typed where absent; extra columns in the files pass through too."""
    known = []
    items = []
    for schema in schemas:
        for field in schema:
            known.append(field.name)
            if field.name in present:
                items.append(f"CAST(t.\"{field.name}\" AS {_duck_type(field.type)}) AS \"{field.name}\"")
            else:
                items.append(f"CAST(NULL AS {_duck_type(field.type)}) AS \"{field.name}\"")
    items += [f't."{c}"' for c in present if c not in known and c not in ("filename", "run_id")]
    return ", ".join(items)


# Below this many request rows the Parquet files are loaded into memory once: every view then
# reads a table instead of re-opening (and re-binding) the files, which dominates for many runs.
MATERIALIZE_MAX_ROWS = 5_000_000


def register_sources(con: duckdb.DuckDBPyConnection, runs: list[RunDir], materialize: bool | None = None) -> None:
    """Create `runs`, `requests`, `steps`: tables, or views over the Parquet files for very large inputs.

    ``materialize=None`` decides by size (``MATERIALIZE_MAX_ROWS``); the SQL results are the same.
    """
    if not runs:
        raise ServelabError("no run directories given")
    con.register("_runs_arrow", runs_table(runs))
    con.execute("CREATE OR REPLACE TABLE runs AS SELECT * FROM _runs_arrow")
    con.unregister("_runs_arrow")
    con.register("_pools_arrow", pools_table(runs))
    con.execute("CREATE OR REPLACE TABLE pools AS SELECT * FROM _pools_arrow")
    con.unregister("_pools_arrow")
    files = pa.table(
        {
            "run_id": [r.run_id for r in runs],
            "requests_file": [str(r.requests_path) for r in runs],
            "steps_file": [str(r.steps_path) if r.steps_path.exists() else None for r in runs],
        }
    )
    con.register("_files_arrow", files)
    con.execute("CREATE OR REPLACE TABLE _run_files AS SELECT * FROM _files_arrow")
    con.unregister("_files_arrow")

    req_files = [str(r.requests_path) for r in runs]
    present, num_rows = _file_columns(req_files, REQUIRED_REQUEST_COLUMNS)
    if materialize is None:
        materialize = num_rows <= MATERIALIZE_MAX_ROWS
    kind = "TABLE" if materialize else "VIEW"
    select = _select_list(present, [REQUESTS_SCHEMA, OPTIONAL_REQUEST_COLUMNS])
    con.execute(
        f"CREATE OR REPLACE {kind} requests AS SELECT f.run_id, {select} "
        f"FROM read_parquet([{', '.join(map(_sql_str, req_files))}], union_by_name=true, filename=true) t "
        f"JOIN _run_files f ON f.requests_file = t.filename"
    )

    token_runs = [r for r in runs if r.tokens_path.exists()]
    if token_runs:  # per-token rows can be hundreds of millions: always a view over the files
        token_ids = ", ".join(f"({_sql_str(str(r.tokens_path))}, {_sql_str(r.run_id)})" for r in token_runs)
        con.execute(
            "CREATE OR REPLACE VIEW tokens AS SELECT f.run_id, t.request_id, t.token_index, t.time_s, t.itl_s "
            f"FROM read_parquet([{', '.join(_sql_str(str(r.tokens_path)) for r in token_runs)}], filename=true) t "
            f"JOIN (VALUES {token_ids}) f(file, run_id) ON f.file = t.filename"
        )
        con.execute(
            "CREATE OR REPLACE VIEW itl_summary AS SELECT run_id, count(itl_s) AS gaps, avg(itl_s) AS mean_itl_s, "
            "quantile_cont(itl_s, 0.5) AS p50_itl_s, quantile_cont(itl_s, 0.9) AS p90_itl_s, "
            "quantile_cont(itl_s, 0.99) AS p99_itl_s, max(itl_s) AS max_itl_s "
            "FROM tokens WHERE itl_s IS NOT NULL GROUP BY run_id"
        )

    metric_runs = [r for r in runs if r.metrics_path.exists()]
    if metric_runs:  # live runs: the server's Prometheus samples (docs/live.md)
        metric_ids = ", ".join(f"({_sql_str(str(r.metrics_path))}, {_sql_str(r.run_id)})" for r in metric_runs)
        con.execute(
            "CREATE OR REPLACE VIEW server_metrics AS SELECT f.run_id, t.time_s, t.metric, t.labels, t.value "
            f"FROM read_parquet([{', '.join(_sql_str(str(r.metrics_path)) for r in metric_runs)}], filename=true) t "
            f"JOIN (VALUES {metric_ids}) f(file, run_id) ON f.file = t.filename"
        )

    step_files = [str(r.steps_path) for r in runs if r.steps_path.exists()]
    if step_files:
        present, _ = _file_columns(step_files, REQUIRED_STEP_COLUMNS)
        select = _select_list(present, [STEPS_SCHEMA])
        con.execute(
            f"CREATE OR REPLACE {kind} steps AS SELECT f.run_id, {select} "
            f"FROM read_parquet([{', '.join(map(_sql_str, step_files))}], union_by_name=true, filename=true) t "
            f"JOIN _run_files f ON f.steps_file = t.filename"
        )
    else:
        empty = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS \"{f.name}\"" for f in STEPS_SCHEMA)
        con.execute(f"CREATE OR REPLACE {kind} steps AS SELECT CAST(NULL AS VARCHAR) AS run_id, {empty} WHERE false")
