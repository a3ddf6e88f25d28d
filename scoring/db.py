"""Open a DuckDB connection with the run tables and every scoring view registered; query helpers.

``connect(["runs/a", "study/trials/*"], slo=SloTable.parse_cli(["ttft=0.5"]))`` gives a connection on
which ``SELECT * FROM slo_attainment`` works. A collected ``.duckdb`` file can be opened the same way.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import duckdb
import pyarrow as pa

from servelab.common.errors import ServelabError
from servelab.scoring.slo import SloTable
from servelab.scoring.sources import find_runs, register_sources
from servelab.scoring.views import create_views

VIEW_NAMES = (
    "requests", "steps", "runs", "slo_table", "run_span", "offered_requests",
    "request_metrics", "request_metrics_guidellm", "request_metrics_distserve",
    "slo_attainment", "latency_summary", "goodput", "tenant_summary", "fairness",
    "resource_summary", "replica_balance", "attainment_vs_rate", "pools", "cost", "tasks", "task_summary",
)  # fmt: skip


# Optimizers switched off on every connection servelab opens. DuckDB 2.0.0 and 2.0.1 shrink a
# materialized integer aggregate to a narrower type using wrong statistics when the plan holds a
# LEFT JOIN (every scoring view does): `sum(num_preemptions) ... ORDER BY` came back wrapped at 256
# (`preemptions -78` for 10674) or failed with "INT128 ... can't be cast ... INT8". Widening the
# summed column does not help (the sum itself gets the bad statistics); switching the
# compressed_materialization optimizer off does, for the views and for ad-hoc queries alike. It
# only saves memory in big sorts, so it costs nothing measurable here. See docs/results.md.
DISABLED_OPTIMIZERS = ("compressed_materialization",)


def new_connection(database: str = ":memory:", threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with servelab's settings (``DISABLED_OPTIMIZERS``); every scoring connection comes from here."""
    con = duckdb.connect(database, config={"threads": threads} if threads else {})
    try:
        con.execute(f"SET disabled_optimizers = '{','.join(DISABLED_OPTIMIZERS)}'")
    except duckdb.Error:  # an optimizer this DuckDB does not know of cannot misbehave in it
        pass
    return con


# What a read-only connection turns off, after its views over the run files exist: reading or
# writing any other file (COPY ... TO, read_csv('/etc/...'), ATTACH), the network (http/s3 URLs),
# installing or loading extensions; and then any later SET that would turn them back on.
READ_ONLY_SETTINGS = (
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET enable_external_access = false",
    "SET lock_configuration = true",
)


@dataclass(frozen=True, slots=True)
class QueryLimits:
    """What SQL someone else wrote may use (`servelab query --read-only`): DuckDB's own limits, set
    before the configuration is locked, and a wall-clock limit servelab enforces (DuckDB has none).

    Defaults suit a shared machine; DuckDB's own would be 80% of RAM, every core and temporary files
    up to 90% of the free disk. Each is an option of `query` (docs/results.md).
    """

    memory_limit: str = "2GB"  # DuckDB memory_limit: beyond it a query spills to temporary files, then fails
    max_temp_directory_size: str = "4GB"  # DuckDB max_temp_directory_size: the spill's disk
    threads: int = 2  # DuckDB threads
    timeout_s: float | None = 60.0  # the query is interrupted after this long (None: no limit)


def restrict(con: duckdb.DuckDBPyConnection, allowed_paths: Iterable[str | os.PathLike] = (),
             limits: QueryLimits | None = None) -> None:  # fmt: skip
    """Make ``con`` read-only towards the outside: only ``allowed_paths`` (the run files its views read) stay readable.

    Call it last: tables registered from Python, ATTACH and views are made before; once locked, the
    settings cannot be changed back from SQL. ``limits`` caps memory, temporary disk and threads.
    """
    paths = sorted({str(p) for p in allowed_paths})
    if limits is not None:
        for option, setting, value in (("--memory-limit", "memory_limit", limits.memory_limit),
                                       ("--max-temp-size", "max_temp_directory_size", limits.max_temp_directory_size),
                                       ("--threads", "threads", limits.threads)):  # fmt: skip
            try:
                con.execute(f"SET {setting} = ?", [value])
            except duckdb.Error as err:
                raise ServelabError(f"{option} {value}: {str(err).splitlines()[0]}") from None
    try:
        if paths:
            listed = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
            con.execute(f"SET allowed_paths = [{listed}]")
        for statement in READ_ONLY_SETTINGS:
            con.execute(statement)
    except duckdb.Error as err:  # a DuckDB too old for these settings must not pass as read-only
        raise ServelabError(f"this DuckDB ({duckdb.__version__}) cannot open a read-only connection: {err}") from None


def _as_list(run_dirs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    if isinstance(run_dirs, (str, os.PathLike)):
        return [str(run_dirs)]
    return [str(d) for d in run_dirs]


def set_slo(con: duckdb.DuckDBPyConnection, slo: SloTable | None) -> None:
    """(Re)define `slo_table`; the derived views read it at query time, so they follow at once."""
    con.register("_slo_arrow", (slo or SloTable()).rows())
    con.execute("CREATE OR REPLACE TABLE slo_table AS SELECT * FROM _slo_arrow")
    con.unregister("_slo_arrow")


def connect(
    run_dirs: str | os.PathLike | Iterable[str | os.PathLike],
    slo: SloTable | None = None,
    threads: int | None = None,
    read_only: bool = False,
    limits: QueryLimits | None = None,
) -> duckdb.DuckDBPyConnection:
    """An in-memory connection over run directories (paths or globs), or a collected .duckdb file.

    ``read_only=True`` then locks it (``restrict``): SQL on it can read the runs and nothing else,
    write no file, reach no network and install no extension (`servelab report`/`compare`, and
    `servelab query --read-only`); ``limits`` also caps what its queries use.
    """
    paths = _as_list(run_dirs)
    if len(paths) == 1 and paths[0].endswith(".duckdb") and Path(paths[0]).is_file():
        con = open_collected(paths[0], slo)
        if read_only:
            restrict(con, limits=limits)
        return con
    runs = find_runs(paths)
    con = new_connection(threads=threads)
    register_sources(con, runs)
    set_slo(con, slo)
    create_views(con)
    if read_only:
        restrict(con, [f for r in runs for f in (r.requests_path, r.steps_path, r.tokens_path, r.metrics_path) if f.exists()],
                 limits)  # fmt: skip
    return con


def open_collected(path: str, slo: SloTable | None = None) -> duckdb.DuckDBPyConnection:
    """Attach a file made by `servelab runs collect` read-only; views are rebuilt in memory over it.

    With ``slo`` the SLO table is replaced (in memory only); without, the one stored at collect time is used.
    """
    con = new_connection()
    try:
        con.execute(f"ATTACH '{path.replace(chr(39), chr(39) * 2)}' AS collected (READ_ONLY)")
    except duckdb.Error as err:
        raise ServelabError(f"{path}: not a DuckDB database ({err})") from None
    tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = 'collected'").fetchall()}
    for name in ("requests", "steps", "runs"):
        if name not in tables:
            raise ServelabError(f"{path}: table '{name}' missing (not made by `servelab runs collect`)")
        extra = ""
        if name == "runs":  # collected before the views read these: NULL
            from servelab.scoring.sources import RUNS_VIEW_COLUMNS

            have = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE database_name = "
                                              "'collected' AND table_name = 'runs'").fetchall()}  # fmt: skip
            extra = "".join(f", CAST(NULL AS {t}) AS {c}" for c, t in RUNS_VIEW_COLUMNS if c not in have)
        con.execute(f"CREATE VIEW {name} AS SELECT *{extra} FROM collected.{name}")
    if "pools" in tables:
        con.execute("CREATE VIEW pools AS SELECT * FROM collected.pools")
    else:  # collected before clusters: its runs' pools are not known here
        from servelab.scoring.sources import POOLS_SCHEMA

        con.register("_pools_arrow", POOLS_SCHEMA.empty_table())
        con.execute("CREATE TABLE pools AS SELECT * FROM _pools_arrow")
        con.unregister("_pools_arrow")
    if slo is not None or "slo_table" not in tables:
        set_slo(con, slo)
    else:  # (collected before task deadlines: no task_s column)
        have = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE database_name = "
                                          "'collected' AND table_name = 'slo_table'").fetchall()}  # fmt: skip
        extra = "".join(f", CAST(NULL AS DOUBLE) AS {c}" for c in ("task_s",) if c not in have)
        con.execute(f"CREATE TABLE slo_table AS SELECT *{extra} FROM collected.slo_table")
    create_views(con)
    return con


def query_arrow(con: duckdb.DuckDBPyConnection, sql: str, timeout_s: float | None = None) -> pa.Table:
    """Run ``sql``; with ``timeout_s``, interrupt it after that many seconds (a one-line error)."""
    timer = threading.Timer(timeout_s, con.interrupt) if timeout_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        rel = con.sql(sql)
        return rel.to_arrow_table() if rel is not None else pa.table({})
    except duckdb.InterruptException:
        if timer is not None and not timer.is_alive():
            raise ServelabError(f"query stopped after {timeout_s:g} s (--timeout-s)") from None
        raise KeyboardInterrupt from None
    except duckdb.Error as err:
        raise ServelabError(f"query failed: {err}") from None
    finally:
        if timer is not None:
            timer.cancel()


def query_polars(con: duckdb.DuckDBPyConnection, sql: str):
    import polars as pl

    return pl.from_arrow(query_arrow(con, sql))


def query(run_dirs, sql: str, slo: SloTable | None = None) -> pa.Table:
    """One-shot: open, run ``sql``, return an Arrow table."""
    con = connect(run_dirs, slo)
    try:
        return query_arrow(con, sql)
    finally:
        con.close()
