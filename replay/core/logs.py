"""Columnar logs a replay produces besides the requests: iteration rows and per-token times."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from itertools import chain, groupby, pairwise
from operator import itemgetter
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from servelab.replay.core.step import Step


class StepLog:
    """Step rows, appended as tuples and packed into Arrow record batches every ``chunk`` rows
    (a million-request replay has millions of rows: tuples would cost ~200 bytes each)."""

    def __init__(self, chunk: int = 65536):
        self.chunk = chunk
        self.rows: list[tuple] = []
        self.batches: list = []
        self.sink = None  # streaming (replay/stream.py): called with each packed batch instead of keeping it

    def append(self, row: tuple) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.chunk:
            self._pack()

    def _pack(self) -> None:
        import numpy as np
        import pyarrow as pa
        from servelab.replay.core.schema import STEPS_SCHEMA, numeric_column

        # Every value is exact in a double (None: NaN). One record per row: numpy converts a list of
        # tuples into records ~1.7x faster than into a 2-d array (a third of the steps table's cost).
        block = np.array(self.rows, dtype=[(f.name, np.float64) for f in STEPS_SCHEMA])
        columns = []
        for f in STEPS_SCHEMA:
            values = block[f.name]
            if f.name == "tier_bytes":  # null without offload tiers
                null = np.isnan(values)
                columns.append(numeric_column(np.where(null, 0, values).astype(np.int64), null if null.any() else None))
            else:
                columns.append(numeric_column(values.astype(f.type.to_pandas_dtype())))
        batch = pa.RecordBatch.from_arrays(columns, schema=STEPS_SCHEMA)
        if self.sink is not None:
            self.sink(batch)
        else:
            self.batches.append(batch)
        self.rows = []

    def flush(self) -> None:
        """Pack the rows not packed yet (a last, shorter batch): to the sink, when streaming."""
        if self.rows:
            self._pack()

    def table(self):
        import pyarrow as pa
        from servelab.replay.core.schema import STEPS_SCHEMA

        if self.rows:
            self._pack()
        return pa.Table.from_batches(self.batches, schema=STEPS_SCHEMA)


# --token-log ------------------------------------------------------------------------------------
#
# Tokens are produced in time order but tokens.parquet lists them by request: an external sort.
# While replaying, the log keeps *records*, not token rows: a single iteration's token is one record,
# a decode stretch one record per request (its tokens follow in closed form from the step's pricing),
# and a request the batch builder kept in aggregate (replay/core/batch.py) one record per membership:
# its tokens follow from the aggregate's *timeline*, its applied advances (one iteration's end time, or a
# stretch's pricing), logged once per advance for all members. Every ``chunk`` records are sorted by request
# and appended to an anonymous spill file as one sorted *run*; the timeline is spilled every
# ``TIMELINE_CHUNK`` advances to a second one. At the end the runs are merged and expanded into
# tokens.parquet, a membership's tokens looked up in the spilled timeline. All files are anonymous
# temporaries (unlinked at creation): a failed or killed replay leaves nothing behind. Memory is
# bounded by the chunks, the merge's read buffers, the expansion's pieces, the timeline pieces read
# back and one Parquet row group, not by the token or step count.

SPILL_DTYPE = None  # numpy dtype of a spilled record (set on first use: numpy is imported lazily)
SEGMENT_SEQ = 1 << 62  # tie order: tokens of single iterations first, then those of stretches
ROW_GROUP = 1024 * 1024  # pq.write_table's default: tokens.parquet's bytes stay what they were
TOKEN_CHUNK = 65536  # records (a single token, or a stretch's tokens of one request) held before a spill
MERGE_FAN_IN = 64  # most runs read at once (each through a buffer of MERGE_BUFFER records)
MERGE_BUFFER = 4096
EXPAND_ROWS = 1 << 16  # token rows expanded from records at once (more when one request has more)
TIMELINE_CHUNK = 4096  # timeline advances (all timelines) held before a spill
TIMELINE_CACHE = 16  # spilled timeline pieces kept in memory (and joined at once) while tokens.parquet is written
WHOLE_TIMELINE_BYTES = 8 << 20  # a spilled timeline up to this size is read back whole (~150 k advances) ...
POSITION_TABLE_BYTES = 16 << 20  # ... with position tables of up to this size in all (4 bytes an iteration)


def tokens_schema():
    import pyarrow as pa

    return pa.schema([("request_id", pa.int64()), ("token_index", pa.int32()), ("time_s", pa.float64()),
                      ("itl_s", pa.float64())])


def _spill_dtype():
    """A spilled record: request id, first token index, tie-break sequence number and ``j``: 0 for a
    single iteration's one token, at ``t``; else j tokens: of a decode stretch (``timeline`` -1), its
    step starting at ``t`` with ``m`` decode requests, its first i iterations ending at ``t + i*a +
    b*(i*ctx0 + m*i*(i-1)/2)`` (``Step.elapsed``); or of a membership, the tokens of
    timeline ``timeline``'s iterations ``at + 1 .. at + j`` (``_Timeline``)."""
    global SPILL_DTYPE
    if SPILL_DTYPE is None:
        import numpy as np

        SPILL_DTYPE = np.dtype([("rid", "<i8"), ("idx", "<i8"), ("seq", "<i8"), ("j", "<i8"), ("t", "<f8"),
                                ("a", "<f8"), ("b", "<f8"), ("ctx0", "<f8"), ("m", "<f8"), ("timeline", "<i8"),
                                ("at", "<i8")])
    return SPILL_DTYPE


def _advance_dtype():
    """A spilled timeline advance: ``j`` iterations after the timeline's ``at``-th; a single iteration
    (``m`` 0) ends at ``t``, a stretch's i-th iteration (``m`` decode requests) as in a stretch record."""
    import numpy as np

    return np.dtype([("at", "<i8"), ("j", "<i8"), ("t", "<f8"), ("a", "<f8"), ("b", "<f8"), ("ctx0", "<f8"),
                     ("m", "<f8")])


class TokenLog:
    """Every output token's time (``--token-log``), streamed to disk in bounded memory.

    A single iteration's token is logged as ``(request_id, index, 0, time)``, a decode stretch as
    ``(request_id, first_index, j, step number)`` per request, the step's pricing kept once per step,
    and the tokens of a request kept in aggregate as ``(request_id, first_index, -count, membership
    number)`` when its counters are made real, its timeline and first iteration kept per membership
    (the aggregate logs its advances once each: ``timeline``, ``advance``, ``membership``); every
    ``chunk`` records they are sorted by request and spilled. ``finish()`` merges the spilled runs,
    expands each record into its token rows with numpy and writes tokens.parquet (a ``TokenTable``).
    Rows come out ordered by (request_id, token_index), ties (a request that started over) in logging
    order, singles before stretches: the order of the in-memory table this replaces, so the file is
    the same. A membership takes the place of the records its member's iterations would have logged
    one by one: its tokens tie as singles or stretch tokens as their iterations were, in its logging
    position (after the request's earlier records, before its later ones), so a replay that keeps
    requests in aggregate writes the same file as one that does not.
    """

    def __init__(self, spill_dir: str | os.PathLike | None = None, chunk: int | None = None):
        self.spill_dir = spill_dir  # where the anonymous spill files go (None: the system temp folder)
        self.chunk = TOKEN_CHUNK if chunk is None else chunk
        self.pending: list[tuple] = []  # records logged since the last spill
        self.steps: list[tuple] = []  # (start_s, a, b, ctx0, decode_requests) of the pending stretches' steps
        self._step = None  # the step of steps[-1] (a stretch logs its requests one after another)
        self._step_no = 0  # its position in steps
        self.logged = 0  # records converted so far (their tie-break sequence numbers)
        self.num_singles = 0  # records logged, by kind
        self.num_segments = 0
        self.num_memberships = 0
        self.runs: list[tuple[int, int, int, int]] = []  # (first record, records, min request_id, max request_id)
        self.rows = 0  # records in the spill file
        self._spill: BinaryIO | None = None
        self.memberships: list[tuple[int, int]] = []  # (timeline, first position) of the pending memberships
        self.num_timelines = 0
        self.advances: list[tuple] = []  # (timeline, at, j, t, a, b, ctx0, m) logged since the last timeline spill
        self.pieces: list[tuple[int, int, int, int]] = []  # spilled timeline pieces: (timeline, first at, row, advances)
        self.timeline_rows = 0  # advances in the timeline spill file
        self._timeline: BinaryIO | None = None

    def single(self, request_id: int, index: int, time_s: float) -> None:
        pending = self.pending
        pending.append((request_id, index, 0, time_s))
        if len(pending) >= self.chunk:
            self._flush()

    def stretch(self, request_id: int, first_index: int, j: int, step: Step) -> None:
        # A step's start and pricing are fixed when it starts; only its end moves (a cut stretch).
        if step is not self._step:
            self._step, self._step_no = step, len(self.steps)
            self.steps.append((step.start_s, step.a, step.b, step.ctx0, step.decode_requests))
        pending = self.pending
        pending.append((request_id, first_index, j, self._step_no))
        if len(pending) >= self.chunk:
            self._flush()

    # -- timelines: requests the batch builder keeps in aggregate advance together -----------------
    def timeline(self) -> int:
        """A new timeline: the number an aggregate logs its advances and memberships under."""
        self.num_timelines += 1
        return self.num_timelines - 1

    def advance(self, timeline: int, at: int, j: int, step: Step, end_s: float) -> None:
        """An aggregate ran ``j`` iterations of ``step`` after its ``at``-th (counted from its start,
        never reset), the last ending at ``end_s``: what its members' tokens of those iterations
        need, logged once for all of them (as ``single`` or ``stretch`` would log each one's)."""
        if step.k == 1:
            self.advances.append((timeline, at, j, end_s, 0.0, 0.0, 0.0, 0.0))
        else:
            self.advances.append((timeline, at, j, step.start_s, step.a, step.b, step.ctx0, step.decode_requests))
        if len(self.advances) >= TIMELINE_CHUNK:
            self._flush_timeline()

    def membership(self, request_id: int, first_index: int, count: int, timeline: int, at: int) -> None:
        """A request kept in aggregate produced tokens ``first_index ..`` (``count`` of them) in its timeline's
        iterations ``at + 1 .. at + count``; logged when its counters are made real."""
        self.memberships.append((timeline, at))
        pending = self.pending
        pending.append((request_id, first_index, -count, len(self.memberships) - 1))
        if len(pending) >= self.chunk:
            self._flush()

    def _flush_timeline(self) -> None:
        """Spill the logged advances, each timeline's as one piece (in position order: the order logged)."""
        import numpy as np

        n = len(self.advances)
        if not n:
            return
        flat = np.fromiter(chain.from_iterable(self.advances), dtype=np.float64, count=8 * n).reshape(n, 8)
        timeline = flat[:, 0].astype(np.int64)
        order = np.argsort(timeline, kind="stable")
        flat, timeline = flat[order], timeline[order]
        block = np.zeros(n, dtype=_advance_dtype())
        block["at"], block["j"] = flat[:, 1].astype(np.int64), flat[:, 2].astype(np.int64)
        for k, name in enumerate(("t", "a", "b", "ctx0", "m"), start=3):
            block[name] = flat[:, k]
        self._timeline = self._append(self._timeline, block)
        for lo, hi in _spans(timeline):
            self.pieces.append((int(timeline[lo]), int(block["at"][lo]), self.timeline_rows + lo, hi - lo))
        self.timeline_rows += n
        self.advances = []

    def _records(self):
        """The pending records as one structured array sorted by (request_id, first index, seq)."""
        import numpy as np

        pending, n = self.pending, len(self.pending)
        # (request id, index, j, time or step number) per record: one flat float64 array is numpy's
        # fastest way in from tuples; exact while request ids stay below 2**53 (else a slower way)
        flat = np.fromiter(chain.from_iterable(pending), dtype=np.float64, count=4 * n).reshape(n, 4)
        rid = flat[:, 0].astype(np.int64)
        if n and np.abs(flat[:, 0]).max() >= 2.0 ** 53:
            rid = np.array([r[0] for r in pending], dtype=np.int64)
        idx, j, x = flat[:, 1].astype(np.int64), flat[:, 2].astype(np.int64), flat[:, 3]
        stretch = j > 0
        seq = np.arange(self.logged, self.logged + n, dtype=np.int64)
        seq[stretch] += SEGMENT_SEQ  # (a membership's stretch tokens get it when expanded: ``_expand``)
        order = _order(rid, idx, seq)
        out = np.zeros(n, dtype=_spill_dtype())
        out["rid"], out["idx"], out["seq"], out["j"], out["t"] = (np.take(c, order) for c in (rid, idx, seq, j, x))
        out["timeline"] = -1
        num_segments = int(np.count_nonzero(stretch))
        if num_segments:
            stretch = np.take(stretch, order)
            params = np.array(self.steps, dtype=np.float64).reshape(-1, 5)[out["t"][stretch].astype(np.int64)]
            for k, name in enumerate(("t", "a", "b", "ctx0", "m")):
                out[name][stretch] = params[:, k]
        num_memberships = len(self.memberships)
        if num_memberships:
            member = out["j"] < 0
            where = np.array(self.memberships, dtype=np.int64).reshape(-1, 2)[out["t"][member].astype(np.int64)]
            out["timeline"][member], out["at"][member] = where[:, 0], where[:, 1]
            out["j"][member] *= -1
            out["t"][member] = 0.0
        self.logged += n
        self.num_segments += num_segments
        self.num_memberships += num_memberships
        self.num_singles += n - num_segments - num_memberships
        self.pending, self.steps, self._step, self.memberships = [], [], None, []
        return out

    def _temporary(self) -> BinaryIO:
        try:
            return tempfile.TemporaryFile(dir=self.spill_dir, prefix=".servelab-tokens.")
        except OSError as err:
            raise self._error(err) from None

    def _error(self, err: OSError):
        from servelab.common.errors import ServelabError

        where = self.spill_dir if self.spill_dir is not None else tempfile.gettempdir()
        return ServelabError(f"--token-log: cannot write its temporary files in {where}: {err.strerror or err}")

    def _append(self, spill: BinaryIO | None, block) -> BinaryIO:
        """Write ``block`` (a numpy array) at the end of ``spill``, a new anonymous temporary if None;
        returns the file."""
        if spill is None:
            spill = self._temporary()
        try:
            block.tofile(spill)
        except OSError as err:  # the disk is full
            raise self._error(err) from None
        return spill

    def _flush(self) -> None:
        if not self.pending:
            return
        records = self._records()
        self._spill = self._append(self._spill, records)
        self.runs.append((self.rows, len(records), int(records["rid"][0]), int(records["rid"][-1])))
        self.rows += len(records)

    def finish(self) -> TokenTable:
        """Merge everything logged into tokens.parquet (an anonymous temporary) and free the spill."""
        out = self._temporary()
        try:
            timeline = self._timeline_reader()
            if self._spill is None:  # it all fit in one chunk: no spill
                records = self._records() if self.pending else None
                num_rows = _write_tokens(_expanded(iter([] if records is None else [records]), timeline), out)
            else:
                self._flush()
                spill, runs = self._spill, self.runs
                while _overlap(runs) > MERGE_FAN_IN:  # merge groups of runs until few overlap
                    merged = self._temporary()
                    new_runs: list[tuple[int, int, int, int]] = []
                    for g in range(0, len(runs), MERGE_FAN_IN):
                        group = runs[g:g + MERGE_FAN_IN]
                        first = sum(r[1] for r in new_runs)
                        for piece in _merge(spill, group):
                            piece.tofile(merged)
                        new_runs.append((first, sum(r[1] for r in group), min(r[2] for r in group),
                                         max(r[3] for r in group)))
                    spill.close()
                    spill, runs = merged, new_runs
                try:
                    num_rows = _write_tokens(_expanded(_merge(spill, runs), timeline), out)
                finally:
                    spill.close()
                    self._spill, self.runs = None, []
        except OSError as err:
            out.close()
            raise self._error(err) from None
        except BaseException:
            out.close()
            raise
        finally:
            if self._timeline is not None:
                self._timeline.close()
                self._timeline, self.pieces = None, []
        return TokenTable(out, num_rows)

    def _timeline_reader(self) -> _Timeline | None:
        """The timelines, spilled, to read back (None: no aggregate logged an advance)."""
        self._flush_timeline()
        return _Timeline(self._timeline, self.pieces) if self._timeline is not None else None

    def table(self):
        """The token table in memory (``finish().read()``)."""
        return self.finish().read()


def _expanded(pieces: Iterator, timeline: _Timeline | None = None) -> Iterator:
    """Token rows ``(request_id, token_index, time_s)`` (three arrays) of sorted record pieces, each
    piece holding all the records of its requests, in tokens.parquet's order, at most about
    ``EXPAND_ROWS`` rows at a time (cut between requests). ``timeline``: the aggregates' advances, which
    time the tokens of memberships."""
    import numpy as np

    for records in pieces:
        counts = np.maximum(records["j"], 1)
        ends = np.cumsum(counts)
        rid = records["rid"]
        cuts = np.flatnonzero(rid[1:] != rid[:-1]) + 1  # where a request's records begin
        lo = 0
        while lo < len(records):
            done = int(ends[lo - 1]) if lo else 0
            hi = int(np.searchsorted(ends, done + EXPAND_ROWS, "right"))
            if hi < len(records):  # move the cut to the next request's first record
                at = int(np.searchsorted(cuts, max(hi, lo + 1), "left"))
                hi = int(cuts[at]) if at < len(cuts) else len(records)
            yield _expand(records[lo:hi], counts[lo:hi], timeline)
            lo = hi


def _expand(records, counts, timeline: _Timeline | None = None):
    """The token rows of whole requests' sorted records. The i-th token of a stretch ends at
    ``start + i*a + b*(i*ctx0 + m*i*(i-1)/2)`` (its first i iterations, ``Step.elapsed``); a
    membership's are looked up in ``timeline``."""
    import numpy as np

    total = int(counts.sum())
    rep = np.repeat(np.arange(len(records)), counts)
    i = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + 1.0
    members = bool((records["timeline"] >= 0).any())
    member = (records["timeline"] >= 0)[rep] if members else None
    plain = np.flatnonzero(~member) if members else slice(None)  # rows of singles and stretches
    t = np.empty(total, dtype=np.float64)
    r = rep[plain]
    t[plain] = _stretch_times(records["t"][r], records["a"][r], records["b"][r], records["ctx0"][r], records["m"][r],
                              i[plain], (records["j"] == 0)[r])
    stretched = np.zeros(total, dtype=bool)  # membership rows of stretch iterations (their ties: as stretches)
    if members:
        rows = np.flatnonzero(member)
        r = rep[rows]
        t[rows], stretched[rows] = timeline.times(records["timeline"][r], records["at"][r] + i[rows].astype(np.int64))
    rid = records["rid"][rep]
    idx = records["idx"][rep] + i.astype(np.int64) - 1
    # Sorted records give sorted, distinct rows unless a request's records overlap (it started over)
    same = records["rid"][1:] == records["rid"][:-1]
    if (same & (records["idx"][1:] < records["idx"][:-1] + counts[:-1])).any():
        seq = records["seq"][rep]
        seq[stretched] += SEGMENT_SEQ  # tie as the stretch records a membership stands for
        rows = np.empty(total, dtype=[("rid", "<i8"), ("idx", "<i8"), ("seq", "<i8"), ("t", "<f8")])
        rows["rid"], rows["idx"], rows["seq"], rows["t"] = rid, idx, seq, t
        rows = _sorted(rows)
        return rows["rid"], rows["idx"], rows["t"]
    return rid, idx, t


def _stretch_times(start, a, b, ctx0, m, i, single):
    """Token times, elementwise: the i-th iteration of a stretch (``Step.elapsed``), or ``start``
    where ``single``. One expression for stretch records and timeline advances: the same values give
    the same bits."""
    import numpy as np

    t = start + i * a + b * (i * ctx0 + m * i * (i - 1) / 2)
    np.copyto(t, start, where=single)  # a single iteration's token: its time as logged
    return t


def _spans(*keys) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of each run of rows equal in every one of ``keys`` (arrays of one length)."""
    import numpy as np

    if not len(keys[0]):
        return iter(())
    change = np.zeros(len(keys[0]) - 1, dtype=bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    return pairwise([0, *(np.flatnonzero(change) + 1).tolist(), len(keys[0])])


class _Timeline:
    """The timelines' spilled advances, read back to time their members' tokens: each spilled
    piece is one timeline's advances in position order. Up to ``WHOLE_TIMELINE_BYTES`` they are read
    back at once (with position tables); beyond, ``TIMELINE_CACHE`` pieces stay in memory
    (memberships of requests with nearby ids mostly fall in the same pieces)."""

    def __init__(self, spill: BinaryIO, pieces: list[tuple[int, int, int, int]]):
        import numpy as np

        self.spill = spill
        self.starts = {}  # timeline -> (first position of each piece, its row in spill, its advances)
        for timeline, own in groupby(sorted(pieces), key=itemgetter(0)):  # by timeline, then position
            own = list(own)
            self.starts[timeline] = tuple(np.array([p[k] for p in own], dtype=np.int64) for k in (1, 2, 3))
        self.cache: dict[tuple[int, int], object] = {}
        # A small timeline (most replays': a few MB) is read back once, each timeline's advances as one
        # array in position order: no piece windows, no re-reads.
        self.whole: dict[int, object] | None = None
        size = sum(p[3] for p in pieces) * _advance_dtype().itemsize
        if size <= WHOLE_TIMELINE_BYTES:
            self.whole = {}
            table_room = POSITION_TABLE_BYTES // 4  # positions all timelines' tables may hold together
            for c in self.starts:
                adv = np.concatenate([self._read(c, k) for k in range(len(self.starts[c][0]))])
                fields = {name: np.ascontiguousarray(adv[name]) for name in adv.dtype.names}
                # the advance holding each iteration, by position (an advance holds at + 1 .. at + j)
                at, j = fields["at"], fields["j"]
                first, last = int(at[0]), int(at[-1] + j[-1])
                if last - first <= table_room and np.array_equal(at[1:], at[:-1] + j[:-1]):
                    fields["holder"] = np.repeat(np.arange(len(adv), dtype=np.int32), fields["j"])
                    fields["first"] = first
                    table_room -= last - first
                self.whole[c] = fields

    def times(self, timeline, at):
        """End times of iterations ``at`` (each of its ``timeline``, both arrays), and which were in a
        stretch. Per timeline (rows are masked, not sorted: a piece of records is ~EXPAND_ROWS rows),
        from the timeline read whole, or from the pieces its rows fall in, joined and searched at once,
        at most ``TIMELINE_CACHE`` pieces at a time."""
        import numpy as np

        t = np.empty(len(at), dtype=np.float64)
        stretch = np.empty(len(at), dtype=bool)
        several = len(self.starts) > 1
        present = np.flatnonzero(np.bincount(timeline)).tolist() if several else self.starts
        for c in present:
            rows = np.flatnonzero(timeline == c) if several else slice(None)
            self._fill(c, at[rows], rows, t, stretch)
        return t, stretch

    def _fill(self, timeline: int, at, rows, t, stretch) -> None:
        """``t[rows]`` and ``stretch[rows]`` for iterations ``at`` of ``timeline``."""
        import numpy as np

        if self.whole is not None:
            fields = self.whole[timeline]
            holder = fields.get("holder")  # the position table, where there was room for it
            _time(fields, at, rows, t, stretch, None if holder is None else holder[at - (fields["first"] + 1)])
            return
        firsts = self.starts[timeline][0]  # a piece holds its timeline's iterations (firsts[k], firsts[k + 1]]
        lo = int(np.searchsorted(firsts, at.min(), "left")) - 1
        hi = int(np.searchsorted(firsts, at.max(), "left"))  # pieces lo .. hi - 1 hold them all
        for k0 in range(lo, hi, TIMELINE_CACHE):
            k1 = min(k0 + TIMELINE_CACHE, hi)
            if (k0, k1) == (lo, hi):
                sel, where = at, rows
            else:  # a window of the pieces: its rows only
                inside = at > firsts[k0]
                if k1 < len(firsts):
                    inside &= at <= firsts[k1]
                sel = at[inside]
                where = np.flatnonzero(inside) if isinstance(rows, slice) else rows[inside]
                if not len(sel):
                    continue
            pieces = [self._piece(timeline, k) for k in range(k0, k1)]
            _time(np.concatenate(pieces) if len(pieces) > 1 else pieces[0], sel, where, t, stretch)

    def _piece(self, timeline: int, k: int):
        """Spilled piece ``k`` of ``timeline``, from the cache (least recently used dropped) or read."""
        key = (timeline, k)
        advances = self.cache.pop(key, None)
        if advances is None:
            advances = self._read(timeline, k)
            if len(self.cache) >= TIMELINE_CACHE:
                del self.cache[next(iter(self.cache))]
        self.cache[key] = advances  # (re)inserted last: the most recently used
        return advances

    def _read(self, timeline: int, k: int):
        import numpy as np

        _, rows, counts = self.starts[timeline]
        dtype = _advance_dtype()
        self.spill.seek(int(rows[k]) * dtype.itemsize)
        return np.frombuffer(self.spill.read(int(counts[k]) * dtype.itemsize), dtype=dtype)


def _time(adv, at, rows, t, stretch, e=None) -> None:
    """``t[rows]``, ``stretch[rows]``: the end times of iterations ``at`` of the advances ``adv`` (one
    timeline's, in position order, holding them all: a record array, or its fields by name), and
    whether each was in a stretch. ``e``: the advance holding each iteration, if known."""
    import numpy as np

    if e is None:
        e = np.searchsorted(adv["at"], at, "left") - 1
    m = adv["m"][e]
    single = m == 0
    i = (at - adv["at"][e]).astype(np.float64)
    t[rows] = _stretch_times(adv["t"][e], adv["a"][e], adv["b"][e], adv["ctx0"][e], m, i, single)
    stretch[rows] = ~single


def _sorted(rows):
    """Spill rows (or records) ordered by (request_id, token_index, seq). ``np.take``, not
    ``rows[order]``: numpy indexes an array of records ~20x faster through ``take``."""
    import numpy as np

    return np.take(rows, _order(rows["rid"], rows["idx"], rows["seq"]))


def _order(rid, idx, seq):
    """The permutation that sorts by (rid, idx, seq). A request's token indices repeat only where it
    started over (its seq orders those): without a repeat, one sort of a key combining request id
    and token index gives the same order as sorting by the three columns, ~3x faster."""
    import numpy as np

    if len(rid) > 1:
        low = int(rid.min())
        if int(rid.max()) - low < (1 << 31) and int(idx.min()) >= 0 and int(idx.max()) < (1 << 32):
            key = ((rid - low) << 32) | idx
            order = np.argsort(key)
            ordered = key[order]
            if not (ordered[1:] == ordered[:-1]).any():
                return order
    return np.lexsort((seq, idx, rid))


def _overlap(runs: list[tuple[int, int, int, int]]) -> int:
    """Most runs whose request-id ranges share one id (how many a merge reads at once)."""
    events = sorted([(r[2], 0) for r in runs] + [(r[3], 1) for r in runs])
    depth = most = 0
    for _, end in events:
        depth += -1 if end else 1
        most = max(most, depth)
    return most


class _Cursor:
    """A sorted run of the spill file, read ``MERGE_BUFFER`` rows at a time."""

    def __init__(self, spill: BinaryIO, first: int, rows: int):
        import numpy as np

        self.spill, self.pos, self.end = spill, first, first + rows
        self.buf = np.empty(0, dtype=_spill_dtype())

    @property
    def unread(self) -> bool:
        return self.pos < self.end

    def fill(self, rows: int) -> None:
        import numpy as np

        dtype = _spill_dtype()
        k = min(rows, self.end - self.pos)
        self.spill.seek(self.pos * dtype.itemsize)
        new = np.frombuffer(self.spill.read(k * dtype.itemsize), dtype=dtype)
        self.buf = np.concatenate([self.buf, new]) if len(self.buf) else new
        self.pos += k


def _merge(spill: BinaryIO, runs: list[tuple[int, int, int, int]]) -> Iterator:
    """Rows of the sorted ``runs`` of ``spill`` in (request_id, token_index, seq) order, in pieces.

    Each round emits every row whose request id is below a bound that no unread row can be under:
    a request's rows always leave together, so sorting each piece sorts the whole.
    """
    import numpy as np

    pending = deque(sorted(runs, key=lambda r: r[2]))  # not yet opened, by smallest request id
    active: list[_Cursor] = []
    while active or pending:
        bound = None  # rows with a request id below it are all in the buffers (None: no limit)

        def lower(value: int) -> None:
            nonlocal bound
            if bound is None or value < bound:
                bound = value

        for c in active:
            if c.unread:
                lower(int(c.buf["rid"][-1]) if len(c.buf) else -(1 << 63))
        while pending and (bound is None or pending[0][2] < bound):
            run = pending.popleft()
            c = _Cursor(spill, run[0], run[1])
            c.fill(MERGE_BUFFER)
            active.append(c)
            if c.unread:
                lower(int(c.buf["rid"][-1]))
        if pending:
            lower(pending[0][2])
        pieces = []
        for c in active:
            k = len(c.buf) if bound is None else int(np.searchsorted(c.buf["rid"], bound, "left"))
            if k:
                pieces.append(c.buf[:k])
                c.buf = c.buf[k:]
        if pieces:
            rows = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
            yield _sorted(rows)
        for c in active:  # refill what ran low; a run stuck on one request reads on past it
            if c.unread and (len(c.buf) < MERGE_BUFFER // 2 or (not pieces and int(c.buf["rid"][-1]) <= bound)):
                c.fill(MERGE_BUFFER)
        if not pieces and pending and pending[0][2] <= bound:
            run = pending.popleft()
            c = _Cursor(spill, run[0], run[1])
            c.fill(MERGE_BUFFER)
            active.append(c)
        active = [c for c in active if len(c.buf) or c.unread]


def _write_tokens(pieces: Iterator, out: BinaryIO) -> int:
    """Write sorted token rows (``(request_id, token_index, time_s)`` arrays, piece by piece) as
    tokens.parquet: the columns and row groups ``write_parquet`` gives the whole table (so the bytes
    are the same), one row group in memory at a time."""
    import numpy as np
    import pyarrow as pa

    from servelab.common import parquet_out

    schema = tokens_schema()
    writer = parquet_out.writer(out, schema, compression="zstd", use_dictionary=False)
    rid = np.empty(ROW_GROUP, dtype=np.int64)  # one row group's columns, filled piece by piece
    idx = np.empty(ROW_GROUP, dtype=np.int32)
    t = np.empty(ROW_GROUP, dtype=np.float64)
    itl = np.empty(ROW_GROUP, dtype=np.float64)
    first = np.empty(ROW_GROUP, dtype=bool)
    prev_rid, prev_t = None, 0.0
    fill = total = 0

    def write(n: int) -> None:
        nonlocal prev_rid, prev_t
        np.subtract(t[1:n], t[:n - 1], out=itl[1:n])
        itl[0] = t[0] - prev_t
        np.not_equal(rid[1:n], rid[:n - 1], out=first[1:n])
        first[0] = prev_rid is None or rid[0] != prev_rid
        writer.write_table(pa.table({
            "request_id": pa.array(rid[:n], pa.int64()),
            "token_index": pa.array(idx[:n], pa.int32()),
            "time_s": pa.array(t[:n], pa.float64()),
            "itl_s": pa.array(itl[:n], pa.float64(), mask=first[:n]),
        }, schema=schema), row_group_size=ROW_GROUP)
        prev_rid, prev_t = int(rid[n - 1]), float(t[n - 1])

    try:
        for p_rid, p_idx, p_t in pieces:
            total += len(p_rid)
            at = 0
            while at < len(p_rid):
                k = min(ROW_GROUP - fill, len(p_rid) - at)
                rid[fill:fill + k] = p_rid[at:at + k]
                idx[fill:fill + k] = p_idx[at:at + k]
                t[fill:fill + k] = p_t[at:at + k]
                fill += k
                at += k
                if fill == ROW_GROUP:
                    write(fill)
                    fill = 0
        if fill:
            write(fill)
        elif not total:  # no tokens: one empty row group, as pq.write_table writes an empty table
            writer.write_table(schema.empty_table())
    finally:
        writer.close()
    out.flush()
    return total


class TokenTable:
    """tokens.parquet of a replay (``RunResult.tokens``), kept in an anonymous temporary file.

    ``read()`` gives the ``pyarrow.Table``; other table attributes (``to_pydict``, ``column``,
    ``to_pandas``, ...) read it too, each time. ``write(path)`` copies the file (``write_run`` does).
    """

    def __init__(self, fh: BinaryIO, num_rows: int):
        self._fh = fh
        self.num_rows = num_rows

    @property
    def schema(self):
        return tokens_schema()

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return f"TokenTable({self.num_rows:,} rows)"

    def read(self):
        import pyarrow.parquet as pq

        with os.fdopen(os.dup(self._fh.fileno()), "rb") as fh:
            fh.seek(0)
            return pq.read_table(fh)

    def write(self, path: str | os.PathLike) -> None:
        self._fh.seek(0)
        with open(path, "wb") as out:
            shutil.copyfileobj(self._fh, out, 1 << 20)

    def close(self) -> None:
        self._fh.close()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.read(), name)
