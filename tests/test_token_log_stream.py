"""`--token-log` in bounded memory (issue 16, item 10): the log spills sorted runs to anonymous
temporary files and merges them into tokens.parquet, which must equal, byte for byte, the table the
in-memory log built, and a replay that fails or is killed leaves no file behind."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from sampled_suites import size

from servelab.replay.core import logs
from servelab.replay.results import write_parquet


class ReferenceLog(logs.TokenLog):
    """The token log as it was (every row kept, one table at the end), recorded beside the streamed one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.all_singles, self.all_segments = [], []

    def single(self, request_id, index, time_s):
        self.all_singles.append((request_id, index, time_s))
        super().single(request_id, index, time_s)

    def stretch(self, request_id, first_index, j, step):
        self.all_segments.append((request_id, first_index, j, step.start_s, step.a, step.b, step.ctx0,
                                  step.decode_requests))
        super().stretch(request_id, first_index, j, step)

    def reference(self) -> pa.Table:
        rid = [np.array([r[0] for r in self.all_singles], dtype=np.int64)]
        idx = [np.array([r[1] for r in self.all_singles], dtype=np.int64)]
        times = [np.array([r[2] for r in self.all_singles], dtype=np.float64)]
        if self.all_segments:
            seg = list(zip(*self.all_segments))
            s_rid, s_first, s_j = (np.array(seg[k], dtype=np.int64) for k in range(3))
            start, a, b, ctx0, n = (np.array(seg[k], dtype=np.float64) for k in range(3, 8))
            rep = np.repeat(np.arange(len(s_j)), s_j)
            i = np.arange(int(s_j.sum())) - np.repeat(np.cumsum(s_j) - s_j, s_j) + 1.0
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
        return pa.table({"request_id": pa.array(rid_a, pa.int64()),
                         "token_index": pa.array(idx_a.astype(np.int32), pa.int32()),
                         "time_s": pa.array(t_a, pa.float64()), "itl_s": pa.array(itl, pa.float64(), mask=first)})


def parquet_bytes(table: pa.Table) -> bytes:
    out = io.BytesIO()
    write_parquet(table, out)
    return out.getvalue()


def token_file_bytes(tokens: logs.TokenTable, tmp_path: Path) -> bytes:
    tokens.write(tmp_path / "tokens.parquet")
    return (tmp_path / "tokens.parquet").read_bytes()


def test_logging_tokens_holds_a_bounded_buffer():
    """300 k logged tokens (120 k in a developer's run): the old log kept a tuple per token (~40 MB at
    300 k, ~16 MB at 120 k), the streamed one a chunk."""
    n = size(300_000, 120_000)
    log = logs.TokenLog(chunk=4096)
    step = SimpleNamespace(start_s=0.0, a=0.01, b=1e-6, ctx0=100.0, decode_requests=8)
    tracemalloc.start()
    try:
        for k in range(n):
            log.single(k % 5000, k // 5000 + 1, k * 1e-3)
            if k % 100 == 0:
                log.stretch(k % 5000, 10_000 + k, 50, step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8e6, f"token log peaked at {peak / 1e6:.1f} MB of Python allocations"
    tokens = log.finish()
    assert tokens.num_rows == n + n // 100 * 50 == tokens.read().num_rows


@pytest.mark.parametrize("ids", ["ascending", "shuffled"])
def test_streamed_token_file_is_the_in_memory_table_byte_for_byte(tmp_path, monkeypatch, ids):
    """A replay with a tiny chunk, fan-in and buffer (many runs, several merge passes), requests
    that start over after a failure (repeated token indices) and, shuffled, ids unrelated to arrival."""
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    monkeypatch.setattr(logs, "TOKEN_CHUNK", 700)
    monkeypatch.setattr(logs, "MERGE_FAN_IN", 3)
    monkeypatch.setattr(logs, "MERGE_BUFFER", 50)
    monkeypatch.setattr(logs, "ROW_GROUP", 5000)  # several row groups (write_parquet's are 1 Mi rows)
    monkeypatch.setattr(logs, "EXPAND_ROWS", 400)  # records expanded into token rows a few requests at a time
    made = []

    def recording_log(*args, **kwargs):
        made.append(ReferenceLog(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("servelab.replay.core.engine.TokenLog", recording_log)
    # ReferenceLog records single tokens and stretches, not the decode aggregate's timelines, which a
    # replay with failures now keeps until one comes: keep it off here (the same tokens either way:
    # test_a_failure_logs_the_same_tokens_with_and_without_the_aggregate)
    from servelab.replay.platform.hooks import Platform

    monkeypatch.setattr(Platform, "walks_running", property(lambda self: True))
    trace = synth_trace(n=300, rate=30.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=3)
    if ids == "shuffled":
        perm = np.random.default_rng(1).permutation(trace.num_rows) * 7 - 1000
        trace = trace.set_column(0, "request_id", pa.array(perm, pa.int64()))
    config = ReplayConfig(engine=EngineConfig(replicas=2, num_gpu_blocks=300, journal=False,
                                              fail=("replica=1,at=4,for=2",)),
                          runner="linear:base=0.01,prefill_token=1e-4,decode_seq=1e-3,decode_context_token=1e-6")
    result = replay(trace, config, token_log=True, token_dir=str(tmp_path))
    expected = made[0].reference()
    assert made[0].num_singles and made[0].num_segments  # both kinds were logged
    ref = expected.to_pydict()
    pairs = list(zip(ref["request_id"], ref["token_index"]))
    assert len(set(pairs)) < len(pairs)  # some requests started over
    monkeypatch.setattr(logs, "ROW_GROUP", 5000)
    assert isinstance(result.tokens, logs.TokenTable) and result.tokens.num_rows == expected.num_rows > 15_000
    assert result.tokens.read().equals(expected)
    assert result.tokens.to_pydict() == ref  # table methods read the file
    import pyarrow.parquet as pq

    assert pq.ParquetFile(io.BytesIO(token_file_bytes(result.tokens, tmp_path))).metadata.num_row_groups > 1
    monkeypatch.setattr(logs, "ROW_GROUP", 1024 * 1024)
    out = io.BytesIO()
    pq.write_table(expected, out, compression="zstd", use_dictionary=False, row_group_size=5000)
    assert token_file_bytes(result.tokens, tmp_path) == out.getvalue()
    assert sorted(os.listdir(tmp_path)) == ["tokens.parquet"]  # the spill files were anonymous


def test_write_run_writes_the_same_file_as_the_whole_table(tmp_path, monkeypatch):
    from servelab.api import EngineConfig, ReplayConfig, replay, write_run
    from servelab.traces.synth import synth_trace

    monkeypatch.setattr(logs, "TOKEN_CHUNK", 1000)
    trace = synth_trace(n=200, rate=20.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=5)
    result = replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=400)), token_log=True)
    table = result.tokens.read()
    write_run(result, tmp_path / "streamed")
    from servelab.replay.results import RunResult

    write_run(RunResult(result.requests, result.steps, result.meta, table), tmp_path / "table")
    assert (tmp_path / "streamed" / "tokens.parquet").read_bytes() == (tmp_path / "table" / "tokens.parquet").read_bytes()
    assert (tmp_path / "streamed" / "tokens.parquet").read_bytes() == parquet_bytes(table)


def test_no_tokens_gives_an_empty_file_like_before(tmp_path):
    log = logs.TokenLog()
    empty = ReferenceLog().reference()
    assert token_file_bytes(log.finish(), tmp_path) == parquet_bytes(empty)


def test_a_failing_replay_leaves_no_spill_behind(tmp_path, monkeypatch):
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.replay.core.engine import Engine
    from servelab.traces.synth import synth_trace

    monkeypatch.setattr(logs, "TOKEN_CHUNK", 500)
    real = Engine._complete

    def failing(self, replica, time_s):
        if len(self.tokens.runs) >= 2:  # it has spilled
            raise RuntimeError("boom")
        return real(self, replica, time_s)

    monkeypatch.setattr(Engine, "_complete", failing)
    trace = synth_trace(n=400, rate=20.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=5)
    with pytest.raises(RuntimeError, match="boom"):
        replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=400)), token_log=True, token_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_during_a_token_log_replay_leaves_nothing(tmp_path):
    """The CLI spills beside -o (same disk as the result) into files that have no name."""
    from servelab.traces.io import write_trace
    from servelab.traces.synth import synth_trace

    write_trace(synth_trace(n=20_000, rate=40.0, prompt="lognormal:800:1.0", output="lognormal:200:1.0", seed=7),
                tmp_path / "t.arrow", source="test")
    out = tmp_path / "runs" / "r"
    (tmp_path / "runs").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "servelab", "replay", str(tmp_path / "t.arrow"), "-o", str(out),
                             "--token-log", "--no-report", "--replicas", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spill = None
    try:
        deadline = time.monotonic() + 60
        while spill is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                    target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                    if target.startswith(str(tmp_path / "runs")):
                        spill = target
            except OSError:
                pass
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert spill is not None, "no spill file seen beside the run directory"
    assert spill.endswith("(deleted)")  # anonymous: it never had a name, or lost it at once
    assert os.listdir(tmp_path / "runs") == []


def test_a_spill_that_cannot_be_written_is_one_clear_error(tmp_path):
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.common.errors import ServelabError

    trace = make_small_trace()
    with pytest.raises(ServelabError, match="is not a directory"):
        replay(trace, ReplayConfig(engine=EngineConfig(num_gpu_blocks=400)), token_log=True,
               token_dir=str(tmp_path / "missing"))
    log = logs.TokenLog(spill_dir=str(tmp_path / "gone"), chunk=10)
    with pytest.raises(ServelabError, match="--token-log: cannot write its temporary files in .*gone"):
        for k in range(20):
            log.single(1, k + 1, float(k))


def make_small_trace():
    from servelab.traces.synth import synth_trace

    return synth_trace(n=20, rate=20.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=5)


@pytest.mark.parametrize("case", ["unique", "repeated", "wide-ids"])
def test_spill_rows_sort_as_by_the_three_keys(case):
    """``_sorted`` (one combined key when no token index repeats) orders rows as sorting by
    (request_id, token_index, seq) does: repeats and request ids too far apart for the combined key
    take the three-key sort."""
    rng = np.random.default_rng(5)
    n = 5000
    rows = np.empty(n, dtype=logs._spill_dtype())
    rows["rid"] = rng.integers(0, 40, n) * (1 << 33 if case == "wide-ids" else 1) - 7
    rows["idx"] = rng.permutation(n) if case != "repeated" else rng.integers(0, 300, n)
    rows["seq"] = rng.permutation(n) + (logs.SEGMENT_SEQ if case == "repeated" else 0) * (rng.random(n) < 0.5)
    rows["t"] = rng.random(n)
    keys = sorted(zip(rows["rid"].tolist(), rows["idx"].tolist(), rows["seq"].tolist()))  # Python's own sort
    got = logs._sorted(rows)
    assert list(zip(got["rid"].tolist(), got["idx"].tolist(), got["seq"].tolist())) == keys
    assert sorted(got["t"].tolist()) == sorted(rows["t"].tolist())  # whole rows moved together
    by_key = {(r, i, s): t for r, i, s, t in zip(*(rows[k].tolist() for k in ("rid", "idx", "seq", "t")))}
    assert [by_key[k] for k in keys] == got["t"].tolist()


def test_request_ids_beyond_exact_doubles_are_kept_exactly(tmp_path):
    """Records pass through float64 on their way into numpy: ids of 2**53 and more take the exact way."""
    log = logs.TokenLog(chunk=4)
    step = SimpleNamespace(start_s=1.0, a=0.5, b=0.0, ctx0=0.0, decode_requests=1)
    big = (1 << 60) + 1
    log.single(big, 1, 0.25)
    log.stretch(big, 2, 3, step)
    log.single(-big, 1, 0.5)
    log.single(7, 1, 0.75)
    log.single(big + 2, 1, 0.125)
    table = log.finish().read().to_pydict()
    assert table["request_id"] == [-big, 7, big, big, big, big, big + 2]
    assert table["token_index"] == [1, 1, 1, 2, 3, 4, 1]
    assert table["time_s"] == [0.5, 0.75, 0.25, 1.5, 2.0, 2.5, 0.125]  # the stretch: 1 + 0.5 i


@pytest.mark.parametrize("journal", [False, True])
def test_a_failure_logs_the_same_tokens_with_and_without_the_aggregate(tmp_path, monkeypatch, journal):
    # the decode aggregate is kept until a failure comes; the tokens of the iteration it cuts are not logged
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.replay.platform.hooks import Platform
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=300, rate=30.0, prompt="lognormal:200:1.0", output="lognormal:60:1.0", seed=3)
    config = ReplayConfig(engine=EngineConfig(replicas=2, num_gpu_blocks=300, journal=journal,
                                              fail=("replica=0,at=3,for=1", "replica=1,at=5,for=3")),
                          runner="linear:base=0.01,prefill_token=1e-4,decode_seq=1e-3,decode_context_token=1e-6")
    kept = replay(trace, config, token_log=True, token_dir=str(tmp_path))
    assert kept.meta["platform"]["faults"]["requests_moved"] > 0
    monkeypatch.setattr(Platform, "walks_running", property(lambda self: True))
    off = replay(trace, config, token_log=True, token_dir=str(tmp_path))
    assert kept.tokens.num_rows == off.tokens.num_rows > 15_000
    assert kept.tokens.read().equals(off.tokens.read())
