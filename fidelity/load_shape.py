"""A real benchmark's load shape made replayable: a concurrency-capped client becomes closed-loop sessions.

A client with a concurrency cap (vLLM ``bench serve --max-concurrency C``, GuideLLM's synchronous
and concurrent profiles, a pool of C workers) sends a request when one of its C slots is free, so
its send times depend on the server's latencies. Replaying those send times as fixed arrivals
breaks that feedback. Instead the trace gets the replay's closed-loop sessions (docs/engine.md,
traces schema ``session_id`` / ``think_s``): C sessions, one per slot, each request a turn that
arrives ``think_s`` after the previous turn of its slot ended.

Which slot a request took is read off the measured timeline as a semaphore hands slots out: a
request sent at ``a`` takes, of the slots free by then, a never-used one, else the one freed first
(the waiting sender woke at that release); its ``think_s`` is ``a`` minus that release (the client's
own delay, and with a request rate on top, the wait for its scheduled send). A slot's first request
keeps its measured send time. Requests left out of the trace (failed before any output) leave
their time in the next turn's ``think_s``.
"""

from __future__ import annotations

import heapq

import pyarrow as pa

from servelab.common.errors import ServelabError


def closed_loop(trace: pa.Table, requests: pa.Table, users: int) -> pa.Table:
    """``trace`` (rows of ``requests`` by ``request_id``, sorted by arrival) with ``session_id`` (the
    slot) and ``think_s`` (null for a slot's first request) for a client of ``users`` slots."""
    if users < 1:
        raise ServelabError(f"a closed loop needs >= 1 user, got {users}")
    ends = {}
    for rid, a, f, e in zip(requests.column("request_id").to_pylist(), requests.column("arrival_s").to_pylist(),
                            requests.column("first_token_s").to_pylist(), requests.column("finish_s").to_pylist()):
        ends[rid] = e if e is not None else (f if f is not None else a)
    # free slots as (release, user): a never-used slot first (-inf: the cap did not hold that send
    # back, so it keeps its measured time), then the earliest release (a semaphore wakes its first
    # waiter at the first release)
    free: list[tuple[float, int]] = [(float("-inf"), u) for u in range(users)]
    busy: list[tuple[float, int]] = []  # (release time, user) of slots taken
    session, think = [], []
    last_release = [None] * users
    for rid, arrival in zip(trace.column("request_id").to_pylist(), trace.column("arrival_s").to_pylist()):
        while busy and busy[0][0] <= arrival + 1e-9:  # released by the time it was sent
            release, user = heapq.heappop(busy)
            heapq.heappush(free, (release, user))
        if free:
            _, user = heapq.heappop(free)
        else:  # clocks disagree by a hair (a release recorded just after the send): the earliest release
            _, user = heapq.heappop(busy)
        session.append(user)
        prev = last_release[user]
        think.append(None if prev is None else max(0.0, arrival - prev))
        last_release[user] = ends[rid]
        heapq.heappush(busy, (ends[rid], user))
    out = trace
    for name, values, type_ in (("session_id", session, pa.int64()), ("think_s", think, pa.float64())):
        if name in out.column_names:
            out = out.drop_columns([name])
        out = out.append_column(pa.field(name, type_), pa.array(values, type_))
    return out


__all__ = ["closed_loop"]
