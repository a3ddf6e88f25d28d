"""common/parquet_out.py writes Parquet without importing pyarrow.parquet (a replay's start-up, issue
#31 item 4): every file must be the bytes pyarrow.parquet writes with the same settings, through each
kind of sink, or the fallback to the public writer when the private one is not there."""

from __future__ import annotations

import io
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servelab.common import parquet_out
from servelab.replay.results import parquet_options


def _tables() -> dict[str, pa.Table]:
    n = 2_500
    rng = np.random.default_rng(7)
    status = pa.array(rng.choice(["finished", "aborted", "unfinished"], n)).dictionary_encode()
    return {
        "results": pa.table({
            "request_id": pa.array(np.arange(n), pa.int64()),
            "tenant": pa.array([f"t{i % 7}" for i in range(n)]),
            "status": status,
            "ttft_s": pa.array(rng.random(n), mask=rng.random(n) < 0.1),
            "tokens": pa.array(rng.integers(1, 4000, n).astype(np.int32)),
        }),
        "empty": pa.table({"a": pa.array([], pa.float64()), "b": pa.array([], pa.string())}),
        "nested": pa.table({"hashes": pa.array([[1, 2], [], None, [3]], pa.list_(pa.int64()))}),
    }


def _public(table: pa.Table, row_group_size: int | None, **options) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size, **options)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["results", "empty", "nested"])
@pytest.mark.parametrize("sink", ["path", "arrow-stream", "file-object"])
@pytest.mark.parametrize("row_group_size", [None, 1000])
def test_the_bytes_are_pyarrow_parquet_s(tmp_path, name, sink, row_group_size):
    table = _tables()[name]
    for options in (parquet_options(table.schema), {}, {"compression": "zstd", "use_dictionary": False}):
        expected = _public(table, row_group_size, **options)
        path = tmp_path / "out.parquet"
        if sink == "path":
            parquet_out.write_table(table, path, row_group_size=row_group_size, **options)
            got = path.read_bytes()
        elif sink == "arrow-stream":
            with pa.BufferedOutputStream(pa.OSFile(str(path), "wb"), buffer_size=1 << 16) as out:
                parquet_out.write_table(table, out, row_group_size=row_group_size, **options)
            got = path.read_bytes()
        else:
            buf = io.BytesIO()
            parquet_out.write_table(table, buf, row_group_size=row_group_size, **options)
            got = buf.getvalue()
        assert got == expected, (name, sink, options)


def test_a_writer_fed_in_pieces_writes_what_the_public_writer_writes(tmp_path):
    table = _tables()["results"]
    options = parquet_options(table.schema)
    ours, theirs = tmp_path / "ours.parquet", tmp_path / "theirs.parquet"
    w = parquet_out.writer(ours, table.schema, **options)
    p = pq.ParquetWriter(theirs, table.schema, **options)
    for start in range(0, table.num_rows, 700):
        w.write_table(table.slice(start, 700), row_group_size=700)
        p.write_table(table.slice(start, 700), row_group_size=700)
    w.close()
    p.close()
    assert ours.read_bytes() == theirs.read_bytes()
    assert pq.read_table(ours).equals(table)


def test_a_table_of_another_schema_is_refused(tmp_path):
    table = _tables()["results"]
    w = parquet_out.writer(tmp_path / "x.parquet", table.schema)
    with pytest.raises(ValueError, match="schema does not match"):
        w.write_table(_tables()["empty"])
    w.close()


def test_a_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "bad.parquet"
    with pytest.raises(Exception):
        parquet_out.write_table(_tables()["results"], path, compression="no-such-codec")
    assert not path.exists()


def test_without_the_private_writer_the_public_one_writes_the_same(tmp_path, monkeypatch):
    table = _tables()["results"]
    expected = _public(table, None, **parquet_options(table.schema))
    monkeypatch.setitem(sys.modules, "pyarrow._parquet", None)  # (its import now fails)
    buf = io.BytesIO()
    parquet_out.write_table(table, buf, **parquet_options(table.schema))
    assert buf.getvalue() == expected
