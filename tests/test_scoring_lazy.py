"""`servelab.scoring` loads DuckDB and the report's renderer only when a name that needs them is used."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded(code: str) -> str:
    probe = code + "\nimport sys; print(sorted(m for m in ('duckdb', 'rich', 'optuna') if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.strip()


def test_a_search_worker_and_the_slo_types_load_no_duckdb():
    assert _loaded("import servelab.scoring.slo") == "[]"
    # what a pool worker imports to run trials (search/pool.py's preload), scoring small traces in memory
    assert _loaded("import servelab.assembly, servelab.search.space, servelab.search.objective, servelab.search.pool\n"
                   "from servelab.replay import write_run") == "[]"  # fmt: skip


def test_every_exported_name_resolves_and_an_unknown_one_is_an_attribute_error():
    import servelab.scoring as scoring
    from servelab.scoring.db import connect
    from servelab.scoring.slo import SloTable

    assert scoring.connect is connect and scoring.SloTable is SloTable
    for name in scoring.__all__:
        assert getattr(scoring, name) is not None
    assert set(scoring.__all__) <= set(dir(scoring))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        scoring.nope  # noqa: B018
