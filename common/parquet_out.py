"""Parquet files written without importing ``pyarrow.parquet``.

``import pyarrow.parquet`` costs ~48 M instructions (~15 ms, 9% of a 10-request replay's whole
process above its import floor): it imports ``pyarrow.fs`` for its filesystem lookup, which loads the
S3, GCS, Azure and HDFS extension modules and ``ssl``. Writing a file needs none of that: the
public ``ParquetWriter`` resolves its sink and then hands every setting to the writer of its home
module, ``pyarrow._parquet`` (~2.5 M). ``writer`` builds that writer directly with the public
class's defaults spelled out, so a file's bytes are the ones ``pyarrow.parquet`` writes
(tests/test_parquet_out.py compares them for every kind of results file); a pyarrow whose private
writer has moved or changed its arguments gets the public class, at its import's cost.
Reading a Parquet file still imports ``pyarrow.parquet`` where it reads.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

# pyarrow.parquet.ParquetWriter's defaults for what it passes on, where the private writer's own differ
# (None for most: the C++ defaults) or were not always the same
_PUBLIC_DEFAULTS = {
    "use_dictionary": True,
    "compression": "snappy",
    "version": "2.6",
    "write_statistics": True,
    "use_deprecated_int96_timestamps": False,
    "writer_engine_version": "V2",
    "data_page_version": "1.0",
    "use_compliant_nested_type": True,
    "store_schema": True,
}


class _Writer:
    """What callers use of ``pyarrow.parquet.ParquetWriter``: ``write_table`` and ``close``."""

    __slots__ = ("_inner", "schema")

    def __init__(self, inner: Any, schema: pa.Schema):
        self._inner, self.schema = inner, schema

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        if not table.schema.equals(self.schema, check_metadata=False):
            raise ValueError(f"table schema does not match the file's:\n{table.schema}\nvs\n{self.schema}")
        self._inner.write_table(table, row_group_size=row_group_size)

    def close(self) -> None:
        self._inner.close()


def writer(where: str | os.PathLike | pa.NativeOutputStream | Any, schema: pa.Schema, **options: Any):
    """A Parquet writer of ``schema`` to ``where`` (a path, an Arrow output stream or a binary file
    object), with ``pyarrow.parquet.ParquetWriter``'s settings and keyword options."""
    sink = os.fspath(where) if isinstance(where, os.PathLike) else where
    try:
        from pyarrow._parquet import ParquetWriter
    except ImportError:
        ParquetWriter = None
    if ParquetWriter is not None:
        try:
            return _Writer(ParquetWriter(sink, schema, **{**_PUBLIC_DEFAULTS, **options}), schema)
        except TypeError:  # (arguments this pyarrow's private writer does not take)
            pass
    import pyarrow.parquet as pq

    return pq.ParquetWriter(where, schema, **options)


def write_table(table: pa.Table, where: str | os.PathLike | Any, row_group_size: int | None = None,
                **options: Any) -> None:
    """``pyarrow.parquet.write_table(table, where, row_group_size, **options)``: the same bytes; a path
    whose writing fails is removed, as there."""
    try:
        w = writer(where, table.schema, **options)
        try:
            w.write_table(table, row_group_size=row_group_size)
        finally:
            w.close()
    except Exception:
        if isinstance(where, (str, os.PathLike)):
            try:
                os.remove(where)
            except OSError:
                pass
        raise


__all__ = ["writer", "write_table"]
