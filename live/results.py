"""A live run's records -> the run-directory tables every scoring command reads (docs/results.md, docs/live.md).

requests.parquet has REQUESTS_SCHEMA's columns (so `report`, `query`, `compare`, `plot` work
unchanged) followed by live-only columns (LIVE_COLUMNS). Where the two differ in meaning:

- ``arrival_s`` is when the request was sent (vLLM ``bench serve`` times from the send, too);
  ``scheduled_s`` is when the load shape wanted it sent, ``send_lag_s`` the difference;
- ``output_tokens`` of a finished request is what it really generated (the server's usage count,
  else its text chunks), so ``tpot_s`` = (last chunk - first chunk) / (output tokens - 1) as in
  vLLM; the trace's length is ``trace_output_tokens``. For any other status it is the trace's;
- ``prompt_tokens`` is the server's usage count when given, else the prompt builder's count;
- ``first_scheduled_s`` and ``num_preemptions`` are unknown from outside the server (null / 0);
- ``replica`` is 0 (one endpoint), ``cached_tokens`` the server's usage report or null.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from servelab.live.client import Record
from servelab.replay.core.logs import tokens_schema
from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA

LIVE_COLUMNS = pa.schema(
    [
        ("scheduled_s", pa.float64()),  # when the load shape wanted it sent (closed loop: when its user was ready)
        ("send_lag_s", pa.float64()),  # arrival_s - scheduled_s: the client's own delay
        ("end_s", pa.float64()),  # when its stream ended, however it ended
        ("trace_prompt_tokens", pa.int32()),
        ("trace_output_tokens", pa.int32()),
        ("usage_reported", pa.bool_()),  # the server reported usage (token counts are the server's)
        ("usage_output_tokens", pa.int64()),  # the server's completion count as sent, even one set aside
        ("finish_reason", pa.string()),
        ("saw_done", pa.bool_()),  # the stream ended with data: [DONE]
        ("resent", pa.bool_()),  # sent twice: the first connection dropped before any answer (live/client.py)
    ]
)


def requests_table(records: Sequence[Record], trace: pa.Table, rows: Sequence[int],
                   built_prompt_tokens: Sequence[int]) -> pa.Table:  # fmt: skip
    """One row per sent request, in trace order. ``rows[i]``: the trace row of ``records[i]``."""
    t = trace.select([c for c in ("tenant", "tier", "session_id", "ttft_slo_s", "tpot_slo_s", "prompt_tokens",
                                  "output_tokens") if c in trace.column_names])  # fmt: skip
    col = {name: t.column(name).to_pylist() for name in t.column_names}

    def trace_value(name: str, i: int, default=None):
        values = col.get(name)
        return default if values is None or values[i] is None else values[i]

    out: dict[str, list] = {f.name: [] for f in (*REQUESTS_SCHEMA, *LIVE_COLUMNS)}
    for rec, row, built in zip(records, rows, built_prompt_tokens):
        finished = rec.status == "finished"
        trace_out = trace_value("output_tokens", row)
        generated = rec.output_tokens
        output = generated if finished else trace_out
        first, last = rec.first_token_s, rec.finish_s
        gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
        values = {
            "request_id": rec.request_id,
            "tenant": trace_value("tenant", row, "default"),
            "tier": trace_value("tier", row, "standard"),
            "session_id": trace_value("session_id", row),
            "replica": 0,
            "status": rec.status,
            "reason": rec.reason,
            "arrival_s": rec.send_s,
            "first_scheduled_s": None,
            "first_token_s": first,
            "finish_s": last if finished else None,
            "prompt_tokens": rec.usage_prompt_tokens if rec.usage_prompt_tokens is not None else built,
            "output_tokens": output,
            "generated_tokens": generated,
            "num_preemptions": 0,
            "ttft_s": first - rec.send_s if first is not None else None,
            "tpot_s": ((last - first) / (output - 1) if output > 1 else 0.0) if finished else None,
            "e2e_s": last - rec.send_s if finished else None,
            "max_itl_s": max(gaps) if gaps else None,
            "ttft_slo_s": trace_value("ttft_slo_s", row),
            "tpot_slo_s": trace_value("tpot_slo_s", row),
            "cached_tokens": rec.usage_cached_tokens,
            "scheduled_s": rec.scheduled_s,
            "send_lag_s": rec.send_s - rec.scheduled_s if rec.scheduled_s is not None else None,
            "end_s": rec.end_s,
            "trace_prompt_tokens": trace_value("prompt_tokens", row),
            "trace_output_tokens": trace_out,
            "usage_reported": rec.usage_completion_tokens is not None,
            "usage_output_tokens": rec.usage_completion_tokens if rec.usage_completion_tokens is not None
            else rec.usage_rejected_tokens,
            "finish_reason": rec.finish_reason,
            "saw_done": rec.saw_done,
            "resent": rec.resent,
        }
        for name, value in values.items():
            out[name].append(value)
    schema = pa.schema([*REQUESTS_SCHEMA, *LIVE_COLUMNS])
    return pa.table({f.name: pa.array(out[f.name], type=f.type) for f in schema}, schema=schema)


def tokens_table(records: Sequence[Record]) -> pa.Table:
    """tokens.parquet: one row per text chunk (token) of every request, by request_id then index."""
    rid, idx, times, itl = [], [], [], []
    for rec in sorted(records, key=lambda r: r.request_id):
        prev = None
        for k, t in enumerate(rec.token_times, start=1):
            rid.append(rec.request_id)
            idx.append(k)
            times.append(t)
            itl.append(None if prev is None else t - prev)
            prev = t
    schema = tokens_schema()
    return pa.table({"request_id": pa.array(rid, pa.int64()), "token_index": pa.array(idx, pa.int32()),
                     "time_s": pa.array(times, pa.float64()), "itl_s": pa.array(itl, pa.float64())},
                    schema=schema)  # fmt: skip


def empty_steps() -> pa.Table:
    """A live run has no engine iterations to show: steps.parquet with no rows (the views need the table)."""
    return STEPS_SCHEMA.empty_table()


def sent_trace(requests: pa.Table, trace: pa.Table, rows: Sequence[int], load: dict | None = None) -> pa.Table:
    """The trace as the server received it (trace.arrow of a live run, what ``validate --real``
    replays): the sent requests' trace rows with ``arrival_s`` = the actual send time and the
    lengths of requests.parquet (the server's prompt count; a finished request's real output).

    A run whose client held a concurrency cap (``load``: the closed shape's ``users``, an open
    loop's ``max_in_flight``) sent a request when a slot freed, so its send times depend on the
    server's latencies: its trace gets closed-loop sessions, one per slot, read off the measured
    timeline (fidelity/load_shape.py, as the vLLM-bench and GuideLLM imports do), so a replay keeps
    the feedback and never has more than the cap in flight.

    An uncapped open loop sent every request at its scheduled time, a session's later turns too
    (before the turn ahead ended, and with ``--time-scale`` applied): its trace keeps ``session_id``
    (the sessions' routing and cache affinity) but not the trace's ``think_s``, which would make the
    replay send each turn after the previous one ended (replay/results.py), not when it was sent."""
    import pyarrow.compute as pc

    sent = trace.take(pa.array(rows, pa.int64()))
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):
        column = requests.column(name)
        if name == "arrival_s":  # send times are on the run's clock; a trace starts at >= 0
            column = pc.max_element_wise(column, 0.0)
        sent = sent.set_column(sent.column_names.index(name), name, column.cast(sent.schema.field(name).type))
    if "max_output_tokens" in sent.column_names:
        sent = sent.set_column(sent.column_names.index("max_output_tokens"), "max_output_tokens",
                               pc.max_element_wise(sent.column("max_output_tokens"),
                                                   sent.column("output_tokens")))
    users = (load or {}).get("users") if (load or {}).get("shape") == "closed" else (load or {}).get("max_in_flight")
    if users:
        from servelab.fidelity.load_shape import closed_loop

        sent = sent.take(pc.sort_indices(sent, [("arrival_s", "ascending")]))  # stable: ties keep send order
        sent = closed_loop(sent, requests, int(users))
    elif "think_s" in sent.column_names:
        sent = sent.drop_columns(["think_s"])
    return sent
