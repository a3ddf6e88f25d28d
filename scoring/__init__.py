"""Score replay results: DuckDB views over run directories, SLOs, reports, comparisons, sweeps and plots.

    from servelab.scoring import connect, SloTable
    con = connect(["runs/a", "runs/b"], slo=SloTable.parse_cli(["ttft=0.5,tpot=0.05"]))
    con.sql("SELECT * FROM slo_attainment").pl()
"""

from servelab.scoring.db import connect, query, query_arrow, query_polars
from servelab.scoring.report import report_data, report_text
from servelab.scoring.slo import Slo, SloTable

__all__ = ["Slo", "SloTable", "connect", "query", "query_arrow", "query_polars", "report_data", "report_text"]
