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
# fallback without renameat2, a registry's package listing), and pyarrow.parquet, whose filesystem
# lookup loads pyarrow.fs's cloud filesystems and ssl (~48M; the files are written as it writes them).
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
    "pyarrow.parquet",  # (and pyarrow.fs, ssl: written through pyarrow._parquet, common/parquet_out.py)
    "pyarrow.fs",
    "ssl",
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
    assert (run / "steps.parquet").is_file() and "pyarrow._parquet" in seen["exit"]
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


def _run_console(code: str, env_extra: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


# The console command's entry, then numpy imported as a command would: the value OpenBLAS read and the
# threads the process has (Linux: /proc/self/task)
_CONSOLE = """
import os, sys
sys.argv = ["servelab", "policies"]
from servelab.cli.main import main
main()
import numpy
print(os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1)
"""


def test_the_console_command_runs_numpy_on_one_blas_thread():
    value, threads = _run_console(_CONSOLE, {}).splitlines()[-1].split()
    assert value == "1"
    if int(threads) >= 0:  # no OpenBLAS thread pool beside the main thread (one per core before)
        assert int(threads) == 1


def test_a_blas_thread_count_the_user_set_is_kept():
    assert _run_console(_CONSOLE, {"OPENBLAS_NUM_THREADS": "3"}).splitlines()[-1].split()[0] == "3"


def test_main_called_in_process_leaves_the_environment_alone(monkeypatch):
    import os

    from servelab.cli.main import main

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    try:
        main(["policies"])
    except SystemExit:
        pass
    assert "OPENBLAS_NUM_THREADS" not in os.environ
