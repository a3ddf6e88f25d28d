"""Requests that wait for other requests (trace schema v2 ``depends_on``): an agent's next call after
its tool ran, the aggregator of a fan-out, a chat's next turn.

A dependent request has no arrival in the replay until the last of its parents finishes; it then
arrives ``think_s`` later (the tool or user time; 0 when null), so its arrival is the latest parent
finish plus its delay. A parent that ends any other way (rejected, throttled, dropped, aborted by its
client's timeout, or itself skipped) means the call is never made: the request and everything that
waits on it, transitively, end ``skipped`` at that moment, with the reason naming the parent. Parents
still unfinished at the horizon leave their dependents unsent (``unfinished``).

The tracker only hears ``Engine.ended`` and returns what it wants done as intents (``Send``, ``Skip``:
replay/core/intents.py) that the engine applies; a replay whose trace has no dependencies has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.replay.core.intents import Send, Skip
from servelab.replay.core.request import Request, Status

if TYPE_CHECKING:
    import pyarrow as pa


class Dependencies:
    """Counts each dependent request's unfinished parents and releases or skips it."""

    def __init__(self, requests: list[Request], parents: dict[int, list[int]]):
        self.requests = requests
        self.left = {child: len(ps) for child, ps in parents.items()}  # child index -> parents not finished yet
        self.children: dict[int, list[int]] = {}  # parent index -> its children's indices, in row order
        for child in sorted(parents):
            for parent in parents[child]:
                self.children.setdefault(parent, []).append(child)
        self.released = 0
        self.skipped = 0

    def ended(self, req: Request, now: float) -> list[Send | Skip]:
        """``req`` reached a terminal state at ``now`` (``Engine.ended``): the children it releases (``Send``,
        each at ``now`` plus its delay) or, when it ended any other way than finished, its descendants
        never sent (``Skip``, breadth-first: a deep chain needs no deep recursion), in row order."""
        kids = self.children.get(req.index)
        if kids is None or req.status is Status.SKIPPED:  # (a skipped one's descendants are in its cascade's list)
            return []
        requests = self.requests
        if req.status is Status.FINISHED:
            left = self.left
            sends = []
            for c in kids:
                n = left[c] = left[c] - 1
                child = requests[c]
                if not n and child.status is Status.PENDING:  # (not skipped by another parent meanwhile)
                    sends.append(Send(child, now + (child.think_s or 0.0)))
            self.released += len(sends)
            return sends
        skips = []
        skipping: set[int] = set()
        todo = [(req, req.status.name.lower(), kids)]
        while todo:
            parent, how, kids = todo.pop(0)
            reason = f"request {parent.request_id} it depends on ended {how}"
            for c in kids:
                child = requests[c]
                if child.status is Status.PENDING and child.arrival_s is None and c not in skipping:
                    skipping.add(c)
                    skips.append(Skip(child, reason))
                    grand = self.children.get(c)
                    if grand is not None:
                        todo.append((child, "skipped", grand))
        self.skipped += len(skips)
        return skips

    def meta(self) -> dict:
        return {"dependent_requests": len(self.left), "released": self.released, "skipped": self.skipped}


def parents_of(trace: "pa.Table") -> dict[int, list[int]]:
    """Row index -> the row indices of its parents, for the rows of ``trace`` (validated) that have any."""
    if "depends_on" not in trace.column_names or trace.column("depends_on").null_count == trace.num_rows:
        return {}
    from servelab.traces.depends import edges

    child, parent_id = edges(trace)
    if not child.size:
        return {}
    row_of = {rid: i for i, rid in enumerate(trace.column("request_id").to_pylist())}
    parents: dict[int, list[int]] = {}
    for c, p in zip(child.tolist(), parent_id.tolist()):
        parents.setdefault(c, []).append(row_of[p])
    return parents


__all__ = ["Dependencies", "parents_of"]
