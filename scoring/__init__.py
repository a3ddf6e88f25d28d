"""Score replay results: DuckDB views over run directories, SLOs, reports, comparisons, sweeps and plots.

    from servelab.scoring import connect, SloTable
    con = connect(["runs/a", "runs/b"], slo=SloTable.parse_cli(["ttft=0.5,tpot=0.05"]))
    con.sql("SELECT * FROM slo_attainment").pl()

The names below are imported when first used (PEP 562): a module that needs only the SLO types
(a replay, a search worker scoring in memory) does not load DuckDB and the report's renderer.
"""

from importlib import import_module

_HOMES = {"connect": "db", "query": "db", "query_arrow": "db", "query_polars": "db", "report_data": "report",
          "report_text": "report", "Slo": "slo", "SloTable": "slo"}

__all__ = ["Slo", "SloTable", "connect", "query", "query_arrow", "query_polars", "report_data", "report_text"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: the next use is a plain global
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
