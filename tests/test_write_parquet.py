"""replay/results.py's write_parquet: a results file goes to the kernel through one buffer, in the bytes
pyarrow writes unbuffered (its local file sent each page header, page and position query on its own)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

import servelab.replay.results as results
from servelab.api import ReplayConfig, replay
from servelab.traces.synth import synth_trace


def test_a_run_file_is_written_through_one_buffer_in_the_same_bytes(tmp_path, monkeypatch):
    trace = synth_trace(n=300, rate=40.0, prompt="uniform:16:1024", output="uniform:1:80", seed=3)
    run = replay(trace, ReplayConfig.from_dict({"runner": "linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002",
                                                "max_num_seqs": 8, "num_gpu_blocks": 4000}))  # fmt: skip
    buffers = []
    real = pa.BufferedOutputStream

    def spy(raw, buffer_size, **kwargs):
        buffers.append(buffer_size)
        return real(raw, buffer_size, **kwargs)

    monkeypatch.setattr(pa, "BufferedOutputStream", spy)
    for name, table in (("requests", run.requests), ("steps", run.steps)):
        path = tmp_path / f"{name}.parquet"
        results.write_parquet(table, path)
        unbuffered = io.BytesIO()
        pq.write_table(table, unbuffered, **results.parquet_options(table.schema))
        assert path.read_bytes() == unbuffered.getvalue()
        assert pq.read_table(path).equals(table)
    assert buffers == [results.WRITE_BUFFER_BYTES] * 2
    # a file object is written as given (tests and callers that keep the bytes in memory)
    out = io.BytesIO()
    results.write_parquet(run.steps, out)
    assert out.getvalue() == (tmp_path / "steps.parquet").read_bytes() and len(buffers) == 2
