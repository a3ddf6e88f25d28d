"""Streaming replay: the trace read in record batches, the results written in row groups as requests end.

A streamed replay holds the requests in flight, not the trace: ``TraceFile`` reads a trace file (or a
table) a batch at a time, validating each batch as ``read_trace`` validates the whole file (rows
numbered from the file's first); ``TraceStream`` feeds the engine its arrivals a batch at a time and
hands the requests that ended, in trace order, to the requests table's writer; ``RowGroupWriter``
writes a results file a row group at a time with the settings of the in-memory writer.

The engine asks for more arrivals through one event (``REFILL``, replay/core/engine.py): a batch's last
request is held back from the arrivals list, and the event, at that request's arrival time, comes
before everything else at its instant, so every look ahead at the next arrival sees what a replay of
the whole table sees, and the results are the same. The requests table is built in chunks of
``CHUNK`` trace rows, aligned as the in-memory table's are; a file of up to ``CHUNK`` rows is the same
bytes as the in-memory one, a longer file the same rows in row groups of ``group_rows`` (the same
bytes too with ``group_rows`` = 1 << 20, pyarrow's default, at the cost of holding that many rows).

What a streamed replay does not do (a cluster, the platform, closed-loop sessions, ...) is refused
up front with its reason (``trace_reason`` here, ``servelab.assembly.not_streamed`` for the config),
and the caller replays in memory instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from servelab.common.errors import InputError
from servelab.replay.core.encoder import MM_COLUMNS
from servelab.replay.core.engine import REFILL, Engine
from servelab.replay.core.journal import Ledger
from servelab.replay.core.request import Status
from servelab.replay.results import (
    STATUS_NAMES, parquet_options, requests_from_table, requests_table_from, tier_columns, with_platform_columns,
)

CHUNK = 65536  # trace rows converted to the requests table at once (as requests_table_from's chunks)
BATCH_ROWS = 16384  # trace rows read and turned into requests at once
FINISHED = Status.FINISHED  # a status at or above it is terminal


class TraceFile:
    """A trace file (.arrow, .parquet) or an already validated table, read a batch at a time."""

    def __init__(self, trace: str | Path | pa.Table):
        from servelab.traces.io import _kind

        self.table = trace if isinstance(trace, pa.Table) else None
        self.path = None if self.table is not None else Path(trace)
        self._kind = None if self.path is None else _kind(self.path)
        self._source = None
        if self.table is not None:
            self.schema = self.table.schema
        else:
            from servelab.common.errors import require_file

            require_file(self.path, "trace file")
            try:
                self.schema = self._open_schema()
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as err:
                raise InputError(self.path, f"not a readable {self._kind} file ({err})") from None
        self.names = set(self.schema.names)
        self.rows = 0  # rows in all, and the trace's last arrival: from ``scan``
        self.last_arrival_s = 0.0

    def _open_schema(self) -> pa.Schema:
        if self._kind == "arrow":
            import pyarrow.ipc as ipc

            # read, not memory-mapped: a mapped file's pages stay resident as it is read (the whole
            # file by the end), an ordinary read's buffers go with each batch
            self._source = pa.OSFile(str(self.path), "rb")
            self._reader = ipc.open_file(self._source)
            return self._reader.schema
        import pyarrow.parquet as pq

        self._reader = pq.ParquetFile(self.path)
        return self._reader.schema_arrow

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def raw_batches(self, columns: list[str] | None = None, rows: int = CHUNK) -> Iterator[pa.Table]:
        """The file's rows as tables of at most ``rows`` rows (with the file's schema and metadata)."""
        if self.table is not None:
            table = self.table if columns is None else self.table.select(columns)
            for batch in table.to_batches(max_chunksize=rows):
                yield pa.Table.from_batches([batch], schema=table.schema)
            return
        schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns],
                                                                metadata=self.schema.metadata)
        if self._kind == "arrow":
            for i in range(self._reader.num_record_batches):
                batch = self._reader.get_batch(i)
                if columns is not None:
                    batch = batch.select(columns)
                for start in range(0, batch.num_rows, rows):
                    yield pa.Table.from_batches([batch.slice(start, rows)], schema=schema)
        else:
            for batch in self._reader.iter_batches(batch_size=rows, columns=columns, use_threads=False):
                yield pa.Table.from_batches([batch], schema=schema)

    def scan(self) -> str | None:
        """One pass over the columns that decide whether the trace can be streamed and that must be
        checked across batches (request ids unique, arrivals sorted); sets ``rows`` and
        ``last_arrival_s``. Returns why the trace cannot be streamed, or None."""
        from servelab.traces import schema as trace_schema

        if self.path is not None:
            version = (self.schema.metadata or {}).get(trace_schema.META_VERSION)
            if version is not None and version not in [str(v).encode() for v in trace_schema.READ_VERSIONS]:
                raise InputError(self.path, f"schema version {version.decode()} is not supported "
                                            f"(this servelab reads {trace_schema.SCHEMA_VERSION})")
        reason = static_reason(self.names)
        if reason is not None:
            return reason
        for name in trace_schema.REQUIRED:
            if name not in self.names:
                raise InputError(self.where, "required column is missing", column=name)
        wanted = [c for c in ("request_id", "arrival_s", "session_id", "think_s", "depends_on", "timeout_s")
                  if c in self.names]
        last_id, increasing = None, True
        for part in self.raw_batches(wanted):
            n = part.num_rows
            if not n:
                continue
            if "depends_on" in wanted and _any_list(part.column("depends_on")):
                return "the trace has depends_on (requests that wait for others)"
            if "timeout_s" in wanted and part.column("timeout_s").null_count < n:
                return "the trace has client timeouts (timeout_s)"
            if "think_s" in wanted and "session_id" in wanted and _both_set(part.column("session_id"), part.column("think_s")):
                return "the trace has closed-loop sessions (session_id with think_s)"
            column = part.column("request_id")
            if increasing and column.null_count == 0:  # (nulls: reported by the batch's own validation)
                values = column.to_numpy()
                if np.any(values[1:] <= values[:-1]) or (last_id is not None and values[0] <= last_id):
                    increasing = False  # (duplicates within a batch: its own validation)
                last_id = int(values[-1])
            self.rows += n
            arrival = part.column("arrival_s")
            if arrival.null_count < n:
                self.last_arrival_s = max(self.last_arrival_s, float(np.nanmax(arrival.to_numpy(zero_copy_only=False))))
        if not self.rows:
            raise InputError(self.where, "trace is empty (no requests)")
        if not increasing:
            self._check_unique_ids()
        return None

    @property
    def where(self) -> object:
        return self.path if self.path is not None else "trace"

    def _check_unique_ids(self) -> None:
        """Request ids not increasing across the file: look for a repeated one over all of them (the
        ids only, 8 bytes a request, for this one check)."""
        parts = [p.column("request_id") for p in self.raw_batches(["request_id"])]
        if any(p.null_count for p in parts):
            return  # (the batch holding the null reports it)
        ids = np.concatenate([p.to_numpy() for p in parts])
        order = np.argsort(ids, kind="stable")
        same = ids[order][1:] == ids[order][:-1]
        if same.any():
            row = int(np.min(order[1:][same])) + 1
            raise InputError(self.where, "duplicate request_id", column="request_id", row=row)

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[tuple[int, pa.Table]]:
        """(first row, table) per batch: validated as ``read_trace`` validates a file (a row number in
        an error counts from the file's first row), with the defaults filled in."""
        from servelab.traces import schema as trace_schema
        from servelab.traces.io import _block_tokens

        if self.path is not None and "prefix_hashes" in self.names:
            _block_tokens((self.schema.metadata or {}).get(trace_schema.META_BLOCK_TOKENS), self.path)
        start, last = 0, None
        for part in self.raw_batches(rows=rows):
            if not part.num_rows:
                continue
            if self.path is not None:
                try:
                    trace_schema.validate(part, self.path, require_sorted=True)
                except InputError as err:
                    raise InputError(err.path, err.rule, err.column,
                                     None if err.row is None else err.row + start) from None
                first = part.column("arrival_s")[0].as_py()
                if last is not None and first < last:
                    raise InputError(self.path, "arrivals not sorted (earlier than the previous row)",
                                     column="arrival_s", row=start + 1)
                last = part.column("arrival_s")[-1].as_py()
                part = trace_schema.with_defaults(part)
            yield start, part
            start += part.num_rows


def trace_span(path: str | Path) -> float:
    """A trace file's last arrival (its ``arrival_s`` column read a batch at a time), 0 when unreadable."""
    try:
        trace = TraceFile(path)
    except InputError:
        return 0.0
    try:
        last = 0.0
        for part in trace.raw_batches(["arrival_s"]):
            if part.num_rows and part.column("arrival_s").null_count < part.num_rows:
                last = max(last, float(np.nanmax(part.column("arrival_s").to_numpy(zero_copy_only=False))))
        return last
    except (KeyError, pa.ArrowInvalid):
        return 0.0
    finally:
        trace.close()


def static_reason(names: set[str]) -> str | None:
    """Why a trace with these columns cannot be streamed (columns alone decide), or None."""
    if "lora_adapter" in names:
        return "the trace has LoRA adapters (lora_adapter)"
    if names & set(MM_COLUMNS):
        return "the trace is multimodal"
    return None


def _any_list(column: pa.ChunkedArray) -> bool:
    import pyarrow.compute as pc

    return bool(pc.any(pc.greater(pc.fill_null(pc.list_value_length(column), 0), 0)).as_py())


def _both_set(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    if a.null_count == len(a) or b.null_count == len(b):
        return False
    import pyarrow.compute as pc

    return bool(pc.any(pc.and_(pc.is_valid(a), pc.is_valid(b))).as_py())


class RowGroupWriter:
    """One results file written ``group_rows`` rows at a time (the last group shorter), with the
    settings of the in-memory writer (``parquet_options``); a file of no rows is what
    ``pq.write_table`` writes for an empty table."""

    def __init__(self, path: Path, schema: pa.Schema, group_rows: int = CHUNK):
        from servelab.common import parquet_out

        self.path, self.schema, self.group_rows = path, schema, group_rows
        self.writer = parquet_out.writer(path, schema, **parquet_options(schema))
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.rows = 0

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        for part in batch.to_batches() if isinstance(batch, pa.Table) else (batch,):
            self.pending.append(part)
            self.pending_rows += part.num_rows
        while self.pending_rows >= self.group_rows:
            self._write(self.group_rows)

    def _write(self, rows: int) -> None:
        table = pa.Table.from_batches(self.pending, schema=self.schema)
        self.writer.write_table(table.slice(0, rows), row_group_size=self.group_rows)
        rest = table.slice(rows)
        self.pending = rest.to_batches() if rest.num_rows else []
        self.pending_rows = rest.num_rows
        self.rows += rows

    def close(self) -> None:
        if self.pending_rows or not self.rows:
            self._write(self.pending_rows)
        self.writer.close()


class _LedgerRows:
    """The ledger's entries of trace rows ``start .. start + n``, renumbered from 0 and taken out of
    it (what ``with_platform_columns`` reads for one chunk of the requests table)."""

    def __init__(self, ledger: Ledger, start: int, n: int):
        end = start + n
        for name in Ledger.__slots__:
            values: dict = getattr(ledger, name)
            mine = {}
            for i in [i for i in values if start <= i < end]:
                mine[i - start] = values.pop(i)
            setattr(self, name, mine)


def requests_schema(tier_names: list[str] | None = None) -> pa.Schema:
    """The requests table's schema, as an in-memory replay writes it (with offload tiers: their columns)."""
    table = with_platform_columns(requests_table_from([]), Ledger())
    for f, column in tier_columns([], tier_names or []) if tier_names else ():
        table = table.append_column(f, column)
    return table.schema


class TraceStream:
    """Feeds ``engine`` the trace's requests a batch at a time and writes the requests that ended, in
    trace order, a chunk of ``CHUNK`` rows at a time, once every request of the chunk has ended."""

    def __init__(self, trace: TraceFile, writer: RowGroupWriter, batch_rows: int = BATCH_ROWS,
                 tier_names: list[str] | None = None):
        self.trace, self.writer = trace, writer
        self.tier_names = tier_names  # with offload tiers: their columns follow the platform's
        self._batches = trace.batches(batch_rows)
        self.window: deque = deque()  # requests read and not written yet, in trace order
        self.first = 0  # the trace row of window[0]
        self.ended = 0  # leading requests of the window known to have ended
        self.held = None  # the last request read, held back from the arrivals list until REFILL
        self.engine: Engine | None = None
        self.counts = {s.name.lower(): 0 for s in (Status.FINISHED, Status.UNFINISHED, Status.REJECTED)}

    def start(self, engine: Engine) -> None:
        self.engine = engine
        self._read()

    def refill(self, now: float) -> None:
        """REFILL: the held request and the next batch join the arrivals (those arrived are dropped)."""
        engine = self.engine
        arrivals = engine.arrivals
        del arrivals[:engine.next_arrival]
        engine.next_arrival = 0
        arrivals.append(self.held)
        self.held = None
        self._read()
        self._write_ended()

    def _read(self) -> None:
        batch = next(self._batches, None)
        if batch is None:
            return
        first, table = batch
        requests, _ = requests_from_table(table, first_index=first)
        self.window.extend(requests)
        self.held = requests.pop()
        self.engine.arrivals.extend(requests)
        self.engine.push(self.held.arrival_s, REFILL, self.refill)

    def _write_ended(self, final: bool = False) -> None:
        window = self.window
        while True:
            ended = self.ended
            n = len(window)
            while ended < n and window[ended].status >= FINISHED:
                ended += 1
            self.ended = ended
            if ended >= CHUNK or (final and ended):
                self._write_chunk(min(ended, CHUNK))
            else:
                return

    def _write_chunk(self, n: int) -> None:
        window, counts = self.window, self.counts
        chunk = [window.popleft() for _ in range(n)]
        for req in chunk:
            name = STATUS_NAMES[req.status]
            counts[name] = counts.get(name, 0) + 1
        table = with_platform_columns(requests_table_from(chunk, chunk=CHUNK),
                                      _LedgerRows(self.engine.ledger, self.first, n))
        if self.tier_names:
            for f, column in tier_columns(chunk, self.tier_names):
                table = table.append_column(f, column)
        self.writer.write(table)
        self.first += n
        self.ended -= n

    def finish(self, horizon: bool = False) -> None:
        """After the run, write the rest. Without a horizon every request has ended; with one, those
        that have not (the trace's rows not read yet too) are ``unfinished``, as ``Engine.strand``
        leaves them in memory."""
        if horizon:
            self.engine.strand(self.window)
            for first, table in self._batches:
                requests, _ = requests_from_table(table, first_index=first)
                self.engine.strand(requests)
                self.window.extend(requests)
                self._write_ended()
        elif self.held is not None or next(self._batches, None) is not None:
            raise AssertionError("streamed replay ended before its trace was read")
        self.held = None
        self._write_ended(final=True)
        if self.window:
            raise AssertionError(f"streamed replay: request {self.window[0].request_id} did not end")
