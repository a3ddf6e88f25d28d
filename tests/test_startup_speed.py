"""Issue #31, start-up: a 10-request slice of the bundled trace (which has max_output_tokens and
prefix_hashes columns) replays without importing pyarrow.compute at all (~30 ms of a small replay), nor
the modules only other replays use (item 4: a 10-request replay under 0.25 s, bench/RESULTS.md Session 18)."""

from __future__ import annotations

import pytest
from conftest import REPO
from test_replay_startup import _modules_of
from servelab.traces import transforms
from servelab.traces.io import read_trace, write_trace

# What a flat replay (one pool, no autoscaling, quotas, encoders or instance types) never uses, each
# loaded where it is built or used instead: numpy.ma (``pa.array`` of an ndarray checks for a masked
# array, ~50M instructions), the cluster's autoscaling, instance types, prefill/decode handoff and encode
# pool, the encoders' pricing, the front door's admission, and secrets and pkgutil (atomic_dir's
# fallback without renameat2, a registry's package listing).
NOT_LOADED = (
    "numpy.ma",
    "servelab.replay.cluster.autoscale",
    "servelab.replay.cluster.instances",
    "servelab.replay.cluster.fleet",
    "servelab.replay.cluster.disagg",
    "servelab.replay.cluster.encode_pool",
    "servelab.runners.encoders",
    "servelab.replay.platform.admission",
    "secrets",
    "pkgutil",
)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """The modules of one ``servelab replay`` of the bundled trace's first 10 rows, and its run directory."""
    tmp = tmp_path_factory.mktemp("t10")
    table = transforms.head(read_trace(REPO / "data" / "azure_conv_2023.arrow"), 10)
    assert "max_output_tokens" in table.column_names and table.column("max_output_tokens").null_count == 0
    trace = write_trace(table, tmp / "t10.arrow", "head 10")
    return _modules_of(["replay", trace, "-o", tmp / "run", "--no-report"], tmp), tmp / "run"


def test_a_max_output_tokens_column_without_nulls_needs_no_pyarrow_compute(replayed):
    seen, run = replayed
    assert (run / "requests.parquet").is_file()
    assert "servelab.replay.core.engine" in seen["first-event"]
    assert "pyarrow.compute" not in seen["first-event"]
    assert "pyarrow.compute" not in seen["exit"]  # nor for the ideal-reuse check after the replay


def test_the_replay_that_loads_nothing_below_did_write_its_tables(replayed):
    seen, run = replayed
    assert (run / "steps.parquet").is_file() and "pyarrow.parquet" in seen["exit"]
    assert "servelab.replay.cluster.config" in seen["exit"]  # (one pool of the config's replicas)


@pytest.mark.parametrize("module", NOT_LOADED)
def test_a_flat_replay_does_not_load(replayed, module):
    seen, _ = replayed
    assert module not in seen["exit"]


@pytest.mark.parametrize("dtype", ["int32", "int64", "float64"])
def test_a_numeric_column_is_the_array_pa_array_makes(dtype):
    import numpy as np
    import pyarrow as pa
    from servelab.replay.core.schema import numeric_column

    values = (np.arange(21) * 1.5).astype(dtype)
    null = np.arange(21) % 3 == 1
    for mask in (None, null, np.zeros(21, bool)):
        made, expected = numeric_column(values, mask), pa.array(values, mask=mask)
        assert made.type == expected.type and made.null_count == expected.null_count and made.equals(expected)
    strided = values[::2]  # (a column of a record array is strided: made contiguous first)
    assert numeric_column(strided).equals(pa.array(strided))
