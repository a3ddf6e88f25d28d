"""A replica's waiting queue: requests in queue order, every operation O(1).

Arrivals join at the back and preempted requests at the front (vLLM). A policy that orders the
queue itself (sjf, srpt, fair sharing, tiers, deadlines) admits from the middle; with a deque each
such removal costs the request's position, so a replay whose queue builds up grew with the square
of the backlog. An ordered dict keeps the order and removes in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from servelab.replay.request import Request


class RequestQueue:
    __slots__ = ("_order",)

    def __init__(self, requests: Iterable["Request"] = ()) -> None:
        self._order: OrderedDict = OrderedDict.fromkeys(requests)

    def append(self, req: "Request") -> None:
        self._order[req] = None

    def appendleft(self, req: "Request") -> None:
        self._order[req] = None
        self._order.move_to_end(req, last=False)

    def extend(self, reqs: Iterable["Request"]) -> None:
        for req in reqs:
            self._order[req] = None

    def remove(self, req: "Request") -> None:
        del self._order[req]

    def popleft(self) -> "Request":
        return self._order.popitem(last=False)[0]

    def clear(self) -> None:
        self._order.clear()

    def __iter__(self) -> Iterator["Request"]:
        return iter(self._order)

    def __reversed__(self) -> Iterator["Request"]:
        return reversed(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, req: "Request") -> bool:
        return req in self._order

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._order)!r})"


__all__ = ["RequestQueue"]
