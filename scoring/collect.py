"""Materialise runs into one DuckDB database file (tables requests, steps, runs, slo_table plus the views), atomically."""

from __future__ import annotations

import os
from pathlib import Path

from servelab.common.atomic import atomic_path
from servelab.common.errors import ServelabError
from servelab.scoring.db import new_connection, set_slo
from servelab.scoring.slo import SloTable
from servelab.scoring.sources import find_runs, register_sources
from servelab.scoring.views import create_views


def collect(run_dirs: list[str | os.PathLike], out: str | os.PathLike, slo: SloTable | None = None) -> int:
    """Write ``out`` (replacing it only when complete); returns the number of runs collected."""
    out = Path(out)
    if out.exists() and not out.is_file():
        raise ServelabError(f"{out}: exists and is not a file")
    runs = find_runs(run_dirs)
    with atomic_path(out) as tmp:
        tmp.unlink()  # DuckDB creates the file itself; an empty file is not a database
        con = new_connection(str(tmp))
        try:
            register_sources(con, runs, materialize=True)
            con.execute("DROP TABLE IF EXISTS _run_files")
            set_slo(con, slo)
            create_views(con)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        wal = Path(str(tmp) + ".wal")
        if wal.exists():
            raise ServelabError(f"{out}: DuckDB left a write-ahead log; not replacing the target")
    return len(runs)
