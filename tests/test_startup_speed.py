"""Issue #31, start-up: a 10-request slice of the bundled trace (which has max_output_tokens and
prefix_hashes columns) replays without importing pyarrow.compute at all (~30 ms of a small replay)."""

from __future__ import annotations

from conftest import REPO
from test_replay_startup import _modules_of
from servelab.traces import transforms
from servelab.traces.io import read_trace, write_trace


def test_a_max_output_tokens_column_without_nulls_needs_no_pyarrow_compute(tmp_path):
    table = transforms.head(read_trace(REPO / "data" / "azure_conv_2023.arrow"), 10)
    assert "max_output_tokens" in table.column_names and table.column("max_output_tokens").null_count == 0
    trace = write_trace(table, tmp_path / "t10.arrow", "head 10")
    seen = _modules_of(["replay", trace, "-o", tmp_path / "run", "--no-report"], tmp_path)
    assert (tmp_path / "run" / "requests.parquet").is_file()
    assert "servelab.replay.core.engine" in seen["first-event"]
    assert "pyarrow.compute" not in seen["first-event"]
    assert "pyarrow.compute" not in seen["exit"]  # nor for the ideal-reuse check after the replay
