"""A replica's waiting queue: requests in queue order, every operation O(1).

Arrivals join at the back and preempted requests at the front (vLLM). A policy that orders the
queue itself (sjf, srpt, fair sharing, tiers, deadlines) admits from the middle; with a deque each
such removal costs the request's position, so a replay whose queue builds up grew with the square
of the backlog. An ordered dict keeps the order and removes in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from servelab.replay.core.request import Request


class RequestQueue(OrderedDict):
    """Requests as keys (values unused): iteration, ``len``, ``in`` and ``reversed`` are the dict's own."""

    __slots__ = ()

    def __init__(self, requests: Iterable["Request"] = ()) -> None:
        super().__init__((req, None) for req in requests)

    def append(self, req: "Request") -> None:
        self[req] = None

    def appendleft(self, req: "Request") -> None:
        self[req] = None
        self.move_to_end(req, last=False)

    def extend(self, reqs: Iterable["Request"]) -> None:
        for req in reqs:
            self[req] = None

    remove = OrderedDict.__delitem__  # (the dict's own: no Python frame per admission)

    def popleft(self) -> "Request":
        return self.popitem(last=False)[0]

    def __repr__(self) -> str:
        return f"RequestQueue({list(self)!r})"


__all__ = ["RequestQueue"]
