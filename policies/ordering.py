"""Ordering pieces the platform policies share: tier ranks, tenant weights, within-class keys, predictions.

Each piece is a plain function of parameters and requests, so a policy composes them: ``tiers``
orders by tier rank then by a ``within`` key, ``vtc``/``drr`` order tenants by service and requests
of one tenant by the same ``within`` key. Parsing errors name the policy and the parameter.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable

import numpy as np

from servelab.common.errors import ServelabError
from servelab.common.coerce import NamedFloats, Names  # noqa: F401 (re-exported: the Params' field kinds)
from servelab.common.tiers import DEFAULT_TIERS, tier_ranker  # noqa: F401 (re-exported)
from servelab.replay.core.request import Request

WITHIN = ("fcfs", "sjf", "srpt")


def ranks_of(names: tuple[str, ...]) -> dict[str, int]:
    """Typed, checked ``Names`` -> {name: rank}, the first ranked 0."""
    return {name: rank for rank, name in enumerate(names)}


def check_names(names: Any, owner: str, param: str) -> dict[str, int]:
    """Typed ``Names`` (common/coerce.py: a config types ``"a,b"`` once) -> {name: rank}, rank 0 first; a
    name listed twice is an error. Nothing is parsed: a string here is a caller's mistake."""
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise ServelabError(f"{owner}: {param} {names!r} are not typed names (a tuple of strings; "
                            "a config types \"a,b\" or an array once, when it is made)")
    if len(set(names)) != len(names):
        raise ServelabError(f"{owner}: {param} {', '.join(names)!r} names a tier twice")
    return ranks_of(names)


def check_named_floats(pairs: Any, owner: str, param: str, *, positive: bool = True,
                       upper: float | None = None) -> dict[str, float]:
    """Typed ``NamedFloats`` (common/coerce.py) -> {name: value}, every value checked (> 0, or >= 0, and
    <= upper). Nothing is parsed: a string here is a caller's mistake."""
    if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                               and type(p[1]) is float for p in pairs):
        raise ServelabError(f"{owner}: {param} {pairs!r} are not typed NAME=NUMBER pairs (a tuple of (str, float); "
                            "a config types \"a=2,b=1\" or a table once, when it is made)")
    out = dict(pairs)
    for name, value in pairs:
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ServelabError(f"{owner}: {param}: '{name}' must be {'> 0' if positive else '>= 0'}, got {value:g}")
        if upper is not None and value > upper:
            raise ServelabError(f"{owner}: {param}: '{name}' must be <= {upper:g}, got {value:g}")
    if len(out) != len(pairs):
        raise ServelabError(f"{owner}: {param}: a name given twice")
    return out


def check_within(value: str, owner: str) -> None:
    if value not in WITHIN:
        raise ServelabError(f"{owner}: within must be one of {', '.join(WITHIN)}; got '{value}'")


def predicted_output(req: Request, seed: int, noise_sigma: float) -> float:
    """The output length a scheduler believes in: the same predictor as ``srpt``/``sjf``.

    True length times ``exp(N(0, sigma))`` drawn from (seed, request id), so every policy given the
    same seed and sigma predicts the same length for the same request.
    """
    predicted = float(req.output_tokens)
    if noise_sigma > 0:
        rng = np.random.default_rng([seed, req.request_id & 0xFFFFFFFF, 0x5EED])
        predicted *= math.exp(rng.normal(0.0, noise_sigma))
    return max(1.0, predicted)


def within_key(kind: str) -> Callable[[Request, float], tuple]:
    """Order of requests inside one class, given each request's predicted output length.

    fcfs: arrival order (trace row); sjf: predicted total output; srpt: predicted remaining output.
    """
    if kind == "fcfs":
        return lambda req, predicted: (req.arrival_s, req.index)
    if kind == "sjf":
        return lambda req, predicted: (predicted, req.index)
    return lambda req, predicted: (max(predicted - req.num_generated_tokens, 0.0), req.index)


def step_tokens(req: Request, token_budget: int, chunk_cap: int | None = None) -> int:
    """Tokens ``req`` would compute next iteration under a token budget (its decode token or a chunk)."""
    n = req.num_tokens - req.num_computed_tokens
    if chunk_cap is not None and n > chunk_cap:
        n = chunk_cap
    return min(n, token_budget)


class Slot:
    """A platform policy's per-request state (``req.policy_data``): class, prediction, queue entry."""

    __slots__ = ("cls", "rank", "predicted", "entry", "epoch", "charged_in", "charged_out", "deadline_s")

    def __init__(self, cls, rank: int, predicted: float, epoch: int):
        self.cls = cls  # queue key while waiting (a rank, or (rank, tenant))
        self.rank = rank  # tier rank (-1 once promoted past a starvation bound)
        self.predicted = predicted  # predicted output length
        self.entry: list | None = None  # the live heap entry while waiting, else None
        self.epoch = epoch  # which arrival on this policy instance this state belongs to
        self.charged_in = 0  # prompt tokens already counted as service (fair policies)
        self.charged_out = 0  # output tokens already counted as service
        self.deadline_s = math.inf  # TTFT deadline (edf)


class ClassQueues:
    """Waiting requests grouped by class, each group a heap in its within-order; deletion is lazy.

    Invariant: a request is live in at most one heap (``slot.entry`` is its entry), and the live
    entries are exactly the waiting requests the policy was told about and has not admitted.
    """

    __slots__ = ("heaps", "live", "seq")

    def __init__(self) -> None:
        self.heaps: dict = {}
        self.live: dict = {}  # class -> live entries in it
        self.seq = 0

    def push(self, req: Request, cls, key: tuple) -> None:
        slot: Slot = req.policy_data
        if slot.entry is not None:
            self.remove(req)
        self.seq += 1
        entry = [key, self.seq, req]
        slot.cls = cls
        slot.entry = entry
        heap = self.heaps.get(cls)
        if heap is None:
            heap = self.heaps[cls] = []
        heapq.heappush(heap, entry)
        self.live[cls] = self.live.get(cls, 0) + 1
        self._compact(cls)

    def remove(self, req: Request) -> None:
        slot: Slot = req.policy_data
        entry = slot.entry
        if entry is None:
            return
        entry[2] = None  # dead: skipped when reached
        slot.entry = None
        self.live[slot.cls] -= 1
        self._compact(slot.cls)

    def _compact(self, cls) -> None:
        """Drop the dead entries once they outnumber the live ones: a walk in order (``in_order``)
        steps over every dead entry above the live ones it yields, so requeued and admitted
        requests must not pile up in the heap."""
        heap = self.heaps[cls]
        if len(heap) > 2 * self.live[cls] + 64:
            heap[:] = [e for e in heap if e[2] is not None]
            heapq.heapify(heap)

    def classes(self) -> list:
        """Classes with live entries, sorted."""
        return sorted(c for c, n in self.live.items() if n > 0)

    def head(self, cls) -> Request | None:
        heap = self.heaps.get(cls)
        if not heap:
            return None
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def in_order(self, cls):
        """Live requests of ``cls`` in key order, lazily (O(k log k) for the first k)."""
        return heap_in_order(self.heaps.get(cls))

    def __len__(self) -> int:
        return sum(self.live.values())


def heap_in_order(heap: list | None):
    """The live requests of a heap of ``[key, seq, req]`` entries (``req`` None once dead) in key
    order, lazily: the first k cost O(k log k), not a sort of the whole heap."""
    if not heap:
        return
    while heap and heap[0][2] is None:
        heapq.heappop(heap)
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, i = heapq.heappop(frontier)
        if entry[2] is not None:
            yield entry[2]
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))


class WaitingQueue:
    """One replica's waiting requests in a policy's order, kept incrementally (a heap with lazy
    deletion) instead of sorted at every decision: once a queue builds up, re-sorting it costs
    O(queue) per event. The policy pushes a request when it joins the waiting queue (arrival,
    preemption) with its key, which must not change while it waits, and removes it when it leaves
    (admitted, dropped, paused, moved)."""

    __slots__ = ("heap", "entries", "seq")

    def __init__(self) -> None:
        self.heap: list = []
        self.entries: dict = {}  # request -> its live entry
        self.seq = 0

    def push(self, req: Request, key) -> None:
        self.remove(req)
        self.seq += 1
        entry = [key, self.seq, req]
        self.entries[req] = entry
        heapq.heappush(self.heap, entry)
        if len(self.heap) > 2 * len(self.entries) + 64:  # mostly dead entries: rebuild
            self.heap = [e for e in self.heap if e[2] is not None]
            heapq.heapify(self.heap)

    def remove(self, req: Request) -> None:
        entry = self.entries.pop(req, None)
        if entry is not None:
            entry[2] = None

    def in_order(self):
        return heap_in_order(self.heap)

    def __len__(self) -> int:
        return len(self.entries)


class KeyedWaiting:
    """Mixin (before PolicyBase in the bases) for a policy that admits waiting requests in the order
    of ``waiting_key(req)``, a key fixed while the request waits: the policy hooks keep that order in
    a WaitingQueue, so no decision sorts the whole queue. The policy walks ``waiting_in_order`` and
    calls ``forget_admitted`` on its builder afterwards."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue = WaitingQueue()

    def waiting_key(self, req: Request):
        raise NotImplementedError

    def on_arrival(self, req: Request, replica) -> None:
        self.queue.push(req, self.waiting_key(req))

    def on_requeue(self, req: Request, replica) -> None:
        self.queue.push(req, self.waiting_key(req))

    def on_leave(self, req: Request, replica) -> None:
        self.queue.remove(req)

    def waiting_in_order(self, replica):
        """``replica.waiting`` in key order."""
        return self.queue.in_order()

    def forget_admitted(self, builder) -> None:
        for req in builder.summary.admit:
            self.queue.remove(req)
