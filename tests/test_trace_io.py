"""Trace schema validation, reading and writing: one test per rule, round trips, atomic writes."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_traces import assert_input_error, good_table, no_files_like, write_raw_arrow

from servelab.common.errors import InputError, ServelabError
from servelab.traces import schema
from servelab.traces.io import read_trace, trace_metadata, trace_sha256, write_trace


def _replace(table: pa.Table, name: str, values, type_=None) -> pa.Table:
    arr = pa.array(values, type_ or table.schema.field(name).type)
    return table.set_column(table.column_names.index(name), name, arr)


# ---- write: every validation rule rejects the table, names file/column/row, leaves no file

BAD_TABLES = [
    # (description, table maker, rule, column, row)
    ("missing column", lambda t: t.drop_columns(["output_tokens"]), "required column is missing", "output_tokens", None),
    ("mistyped column", lambda t: _replace(t, "prompt_tokens", ["1", "2", "3", "4", "5"], pa.string()), "wrong type", "prompt_tokens", None),
    ("zero prompt", lambda t: _replace(t, "prompt_tokens", [5, 5, 0, 5, 5]), "token count must be >= 1", "prompt_tokens", 3),
    ("negative output", lambda t: _replace(t, "output_tokens", [5, 5, 5, -2, 5]), "token count must be >= 1", "output_tokens", 4),
    ("NaN arrival", lambda t: _replace(t, "arrival_s", [0.0, math.nan, 1.0, 2.0, 3.0]), "not a finite number", "arrival_s", 2),
    ("negative arrival", lambda t: _replace(t, "arrival_s", [0.0, 1.0, -1.0, 2.0, 3.0]), "negative arrival time", "arrival_s", 3),
    ("duplicate id", lambda t: _replace(t, "request_id", [0, 1, 2, 1, 4]), "duplicate request_id", "request_id", 4),
    ("null tokens", lambda t: _replace(t, "output_tokens", [1, None, 1, 1, 1]), "missing value", "output_tokens", 2),
    ("cap below output", lambda t: t.append_column("max_output_tokens", pa.array([100, 100, 5, 100, 100], pa.int32())),
     "max_output_tokens < output_tokens", "max_output_tokens", 3),
    ("negative think", lambda t: t.append_column("think_s", pa.array([None, 1.0, -1.0, None, 2.0])), "must be >= 0", "think_s", 3),
    ("NaN SLO", lambda t: t.append_column("ttft_slo_s", pa.array([1.0, 1.0, 1.0, 1.0, math.nan])), "not a finite number", "ttft_slo_s", 5),
    ("null tenant", lambda t: t.append_column("tenant", pa.array(["a", None, "b", "a", "a"])), "missing value", "tenant", 2),
    ("empty", lambda t: t.slice(0, 0), "trace is empty", None, None),
]


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
@pytest.mark.parametrize("desc,make,rule,column,row", BAD_TABLES, ids=[b[0] for b in BAD_TABLES])
def test_write_rejects_bad_tables(tmp_path, suffix, desc, make, rule, column, row):
    out = tmp_path / f"out{suffix}"
    with pytest.raises(InputError) as err:
        write_trace(make(good_table()), out, source="test")
    assert_input_error(err, out, rule, column, row)
    assert no_files_like(tmp_path, out.name)


def test_write_sorts_unsorted_arrivals_stably(tmp_path):
    t = _replace(good_table(), "arrival_s", [3.0, 1.0, 2.0, 1.0, 0.0])
    out = write_trace(t, tmp_path / "t.arrow", source="test")
    got = read_trace(out)
    assert got.column("arrival_s").to_pylist() == [0.0, 1.0, 1.0, 2.0, 3.0]
    assert got.column("request_id").to_pylist() == [4, 1, 3, 2, 0]  # ties keep input order


def test_prefix_hashes_need_block_size(tmp_path):
    t = good_table(2).append_column("prefix_hashes", pa.array([[1, 2], [1]], pa.list_(pa.int64())))
    with pytest.raises(ServelabError, match="prefix_block_tokens"):
        write_trace(t, tmp_path / "t.arrow", source="test")
    assert no_files_like(tmp_path, "t.arrow")
    write_trace(t, tmp_path / "t.arrow", source="test", prefix_block_tokens=16)
    assert trace_metadata(read_trace(tmp_path / "t.arrow"))["prefix_block_tokens"] == "16"


# ---- read: rules that only a load can meet


def test_read_rejects_unsorted(tmp_path):
    path = write_raw_arrow(_replace(good_table(), "arrival_s", [0.0, 1.0, 3.0, 2.0, 4.0]), tmp_path / "u.arrow")
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "arrivals not sorted", "arrival_s", 4)


def test_read_rejects_missing_column_and_wrong_type(tmp_path):
    path = write_raw_arrow(good_table().drop_columns(["arrival_s"]), tmp_path / "m.arrow")
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "required column is missing", "arrival_s")
    path = write_raw_arrow(_replace(good_table(), "request_id", [0.0, 1, 2, 3, 4], pa.float64()), tmp_path / "f.arrow")
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "wrong type", "request_id")


def test_read_rejects_empty_file_and_garbage(tmp_path):
    path = write_raw_arrow(good_table().slice(0, 0), tmp_path / "e.arrow")
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "trace is empty")
    junk = tmp_path / "junk.arrow"
    junk.write_bytes(b"not arrow at all")
    with pytest.raises(InputError) as err:
        read_trace(junk)
    assert_input_error(err, junk, "not a readable arrow file")
    with pytest.raises(InputError) as err:
        read_trace(tmp_path / "absent.parquet")
    assert_input_error(err, tmp_path / "absent.parquet", "file not found")
    with pytest.raises(InputError, match="unknown trace file type"):
        read_trace(tmp_path / "t.csv")


def test_read_rejects_other_schema_version(tmp_path):
    t = good_table().replace_schema_metadata({"servelab.schema_version": "3"})
    path = write_raw_arrow(t, tmp_path / "v3.arrow")
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert_input_error(err, path, "schema version 3 is not supported")


# ---- round trips and defaults


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_round_trip_fills_defaults(tmp_path, suffix):
    out = write_trace(good_table(), tmp_path / f"t{suffix}", source="unit")
    got = read_trace(out)
    assert got.column_names[:7] == [
        "request_id", "arrival_s", "prompt_tokens", "output_tokens", "max_output_tokens", "tenant", "tier"
    ]
    assert got.column("max_output_tokens").to_pylist() == got.column("output_tokens").to_pylist()
    assert set(got.column("tenant").cast(pa.string()).to_pylist()) == {schema.DEFAULT_TENANT}
    assert set(got.column("tier").cast(pa.string()).to_pylist()) == {schema.DEFAULT_TIER}
    meta = trace_metadata(got)
    assert meta["servelab.schema_version"] == "1" and meta["source"] == "unit"


def test_arrow_file_is_zstd_and_deterministic(tmp_path):
    t = good_table(200).append_column("tenant", pa.array(["a", "b"] * 100))
    a = write_trace(t, tmp_path / "a.arrow", source="s")
    b = write_trace(t, tmp_path / "b.arrow", source="s")
    assert trace_sha256(a) == trace_sha256(b)
    assert len(trace_sha256(a)) == 64
    import pyarrow.ipc as ipc

    with pa.memory_map(str(a)) as src:
        reader = ipc.open_file(src)
        assert reader.schema.field("tenant").type == pa.dictionary(pa.int32(), pa.string())


def test_parquet_keeps_optional_columns(tmp_path):
    t = good_table(3)
    t = t.append_column("session_id", pa.array([7, 7, None], pa.int64()))
    t = t.append_column("think_s", pa.array([None, 2.5, None]))
    t = t.append_column("model", pa.array(["m", "m", "m"]))
    out = write_trace(t, tmp_path / "t.parquet", source="s")
    assert pq.read_metadata(out).num_rows == 3
    got = read_trace(out)
    assert got.column("think_s").to_pylist() == [None, 2.5, None]
    assert got.column("session_id").to_pylist() == [7, 7, None]


def test_canonical_casts_narrow_and_wide_ints():
    t = _replace(good_table(), "prompt_tokens", np.arange(1, 6, dtype=np.int64), pa.int64())
    schema.validate(t, "mem")
    assert schema.canonical(t).schema.field("prompt_tokens").type == pa.int32()
