"""Shared test fixtures, in one place: where the shared traces live, a factory for small trace tables,
a small trace file, the search tests' grid trace folder, and a free local port. Plain helpers (no
fixture) live in helpers_*.py by subject."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pyarrow as pa
import pytest
import sampled_suites
import skip_summary
from sampled_suites import pytest_collection_modifyitems  # noqa: F401  (the sampled long suites)

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist gives its workers COLUMNS=80; the tests expect a plain run's width rules (COLUMNS
    # unset: no terminal, reports at their default width), the same with or without -n
    os.environ.pop("COLUMNS", None)
SHARED = REPO.parent / "shared"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Before pytest's closing line: why tests were skipped, and whether the long suites were sampled."""
    skip_summary.pytest_terminal_summary(terminalreporter, exitstatus, config)
    sampled_suites.pytest_terminal_summary(terminalreporter, exitstatus, config)


@pytest.fixture
def shared_dir() -> Path:
    """The shared/ folder next to the checkout (CI has it; a laptop clone may not)."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (CI provides it)")
    return SHARED


def make_trace(arrivals, prompts, outputs, **extra) -> pa.Table:
    """A trace table with ids 0..n-1 and optional extra columns (tenant=[...], tier=[...], ...)."""
    n = len(arrivals)
    cols = {
        "request_id": pa.array(range(n), pa.int64()),
        "arrival_s": pa.array([float(a) for a in arrivals], pa.float64()),
        "prompt_tokens": pa.array(prompts, pa.int32()),
        "output_tokens": pa.array(outputs, pa.int32()),
    }
    for name, values in extra.items():
        cols[name] = pa.array(values)
    return pa.table(cols)


@pytest.fixture
def trace_factory():
    return make_trace


@pytest.fixture
def small_trace_file(tmp_path) -> Path:
    """20 requests 0.1 s apart, 50 prompt and 10 output tokens each, as ``tmp_path/t.arrow``."""
    from helpers_cli import write_small_trace

    return write_small_trace(tmp_path)


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory) -> Path:
    """A folder holding the search tests' 200-request trace (helpers_search), once per test module."""
    from helpers_search import write_trace_file

    folder = tmp_path_factory.mktemp("grid")
    write_trace_file(folder)
    return folder


@pytest.fixture
def free_port() -> int:
    """A local TCP port nothing listens on (bound once and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
