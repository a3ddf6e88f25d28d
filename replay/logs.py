"""Columnar logs a replay produces besides the requests: iteration rows and per-token times."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.replay.step import Step


class StepLog:
    """Step rows, appended as tuples and packed into Arrow record batches every ``chunk`` rows
    (a million-request replay has millions of rows: tuples would cost ~200 bytes each)."""

    def __init__(self, chunk: int = 65536):
        self.chunk = chunk
        self.rows: list[tuple] = []
        self.batches: list = []

    def append(self, row: tuple) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.chunk:
            self._pack()

    def _pack(self) -> None:
        import pyarrow as pa

        from servelab.replay.schema import STEPS_SCHEMA

        import numpy as np

        block = np.array(self.rows, dtype=np.float64)  # every value is exact in a double
        self.batches.append(pa.RecordBatch.from_arrays(
            [pa.array(block[:, k].astype(f.type.to_pandas_dtype())) for k, f in enumerate(STEPS_SCHEMA)],
            schema=STEPS_SCHEMA))
        self.rows = []

    def table(self):
        import pyarrow as pa

        from servelab.replay.schema import STEPS_SCHEMA

        if self.rows:
            self._pack()
        return pa.Table.from_batches(self.batches, schema=STEPS_SCHEMA)


class TokenLog:
    """Every output token's time (``--token-log``), kept compactly: single iterations as rows, decode
    stretches as one segment per request, expanded with numpy only when the table is built."""

    def __init__(self) -> None:
        self.singles: list[tuple[int, int, float]] = []
        self.segments: list[tuple] = []

    def single(self, request_id: int, index: int, time_s: float) -> None:
        self.singles.append((request_id, index, time_s))

    def stretch(self, request_id: int, first_index: int, j: int, step: Step) -> None:
        self.segments.append((request_id, first_index, j, step.start_s, step.a, step.b, step.ctx0,
                              step.decode_requests))

    def table(self):
        import numpy as np
        import pyarrow as pa

        rid = [np.array([r[0] for r in self.singles], dtype=np.int64)]
        idx = [np.array([r[1] for r in self.singles], dtype=np.int64)]
        times = [np.array([r[2] for r in self.singles], dtype=np.float64)]
        if self.segments:
            seg = list(zip(*self.segments))
            s_rid, s_first, s_j = (np.array(seg[k], dtype=np.int64) for k in range(3))
            start, a, b, ctx0, n = (np.array(seg[k], dtype=np.float64) for k in range(3, 8))
            rep = np.repeat(np.arange(len(s_j)), s_j)
            i = np.arange(int(s_j.sum())) - np.repeat(np.cumsum(s_j) - s_j, s_j) + 1.0
            # the i-th iteration of a stretch ends at start + i*a + b*(i*ctx0 + n*i*(i-1)/2)
            times.append(start[rep] + i * a[rep] + b[rep] * (i * ctx0[rep] + n[rep] * i * (i - 1) / 2))
            rid.append(s_rid[rep])
            idx.append(s_first[rep] + i.astype(np.int64) - 1)
        rid_a, idx_a, t_a = np.concatenate(rid), np.concatenate(idx), np.concatenate(times)
        order = np.lexsort((idx_a, rid_a))
        rid_a, idx_a, t_a = rid_a[order], idx_a[order], t_a[order]
        itl = np.empty_like(t_a)
        itl[1:] = t_a[1:] - t_a[:-1]
        first = np.ones(len(t_a), dtype=bool)
        first[1:] = rid_a[1:] != rid_a[:-1]
        return pa.table({
            "request_id": pa.array(rid_a, pa.int64()),
            "token_index": pa.array(idx_a.astype(np.int32), pa.int32()),
            "time_s": pa.array(t_a, pa.float64()),
            "itl_s": pa.array(itl, pa.float64(), mask=first),
        })
