"""Shared helpers for the trace tests: fixture and shared-data paths, bad-file writers, error checks."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from servelab.common.errors import InputError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def shared(rel: str) -> Path:
    """A file under shared/traces, or skip the test where the shared data is absent."""
    path = SHARED_TRACES / rel
    if not path.exists():
        pytest.skip(f"shared trace data not available: {path}")
    return path


def write_raw_arrow(table: pa.Table, path: Path) -> Path:
    """Write a table as-is (no validation) to make deliberately bad trace files."""
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def good_table(n: int = 5) -> pa.Table:
    return pa.table(
        {
            "request_id": pa.array(range(n), pa.int64()),
            "arrival_s": pa.array([0.5 * i for i in range(n)], pa.float64()),
            "prompt_tokens": pa.array([100 + i for i in range(n)], pa.int32()),
            "output_tokens": pa.array([10 + i for i in range(n)], pa.int32()),
        }
    )


def assert_input_error(err: pytest.ExceptionInfo, path: object, rule: str, column: str | None = None, row: int | None = None) -> None:
    """The error names the file, the column and the row, and says the rule."""
    e = err.value
    assert isinstance(e, InputError), repr(e)
    assert str(path) in str(e)
    assert rule in e.rule, f"{rule!r} not in {e.rule!r}"
    assert e.column == column, (e.column, column)
    assert e.row == row, (e.row, row)


def no_files_like(folder: Path, name: str) -> bool:
    """Neither the output nor a leftover temporary file of it exists."""
    return not any(p.name == name or p.name.startswith(f".{name}.") for p in folder.iterdir())


def strings(table: pa.Table, name: str) -> list[str]:
    """Column ``name`` of ``table`` as strings (whatever its type)."""
    return table.column(name).cast(pa.string()).to_pylist()
