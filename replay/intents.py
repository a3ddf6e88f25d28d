"""What the layers above the engine core want done, as data: intents the engine applies (``Engine.enact``).

The cluster and the platform features (the prefill/decode handoff, autoscalers, fleets of instance
types, failures, the encode pool) observe the engine — its step listeners, their own timed events,
failures — and *return* what they want: a replica pool's serving set, a request handed off, landed,
rejected or routed, a replica failed, restored or taken away. ``Engine.enact`` is the one place that
turns these into changes of a request's status, of the replicas' queues and of which replicas serve,
in the order given; a component never changes them itself.

Each intent is a small immutable record (a named tuple: one is built per handoff and per landing, and a
frozen dataclass costs twice as much to build) naming what it acts on; the time is the one ``enact`` is
called with (the event being handled). The engine tells them apart by their type, never by value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from servelab.replay.replica import Replica
    from servelab.replay.request import Request


class Serve(NamedTuple):
    """Pool ``pool``'s controller (an autoscaler, a fleet, the handoff) wants ``replicas`` serving from now
    on; a replica serves when its pool wants it and it is up (``Engine.publish``)."""
    pool: str
    replicas: tuple[Replica, ...]


class AdoptOrphans(NamedTuple):
    """The arrivals' pool may have a serving replica again: route the requests that waited for one."""


class RemoveReplica(NamedTuple):
    """``replica`` stops serving for good at once (its instance reclaimed; its pool already stopped wanting
    it): its in-flight step is truncated and its requests lose their KV and are routed again."""
    replica: Replica


class FailReplica(NamedTuple):
    """``replica`` fails: it takes no new work until restored, its pool's controller hears it, then its
    requests move as for ``RemoveReplica``."""
    replica: Replica


class RestoreReplica(NamedTuple):
    """``replica`` is back from a failure: it serves again if its pool still wants it."""
    replica: Replica


class HandOff(NamedTuple):
    """``req`` (its first token made) leaves prefill replica ``replica`` for a decode replica; its KV stays."""
    replica: Replica
    req: Request


class Reject(NamedTuple):
    """``req`` can never be served: it ends ``rejected`` with ``reason``."""
    req: Request
    reason: str


class Land(NamedTuple):
    """``req``'s KV is on decode replica ``replica``: it joins its running set as if admitted now, and the
    replica is woken (``Wake``)."""
    replica: Replica
    req: Request


class Wake(NamedTuple):
    """``replica`` has new work: a busy one ends its decode stretch at the next iteration boundary, an idle
    one decides after every other event of this instant."""
    replica: Replica


class Route(NamedTuple):
    """``reqs`` arrive at the arrivals' pool now (e.g. their embeddings landed from an encode pool); each
    replica decides once, seeing all of them."""
    reqs: tuple[Request, ...]


Intent = Serve | AdoptOrphans | RemoveReplica | FailReplica | RestoreReplica | HandOff | Reject | Land | Wake | Route

__all__ = ["AdoptOrphans", "FailReplica", "HandOff", "Intent", "Land", "Reject", "RemoveReplica", "RestoreReplica",
           "Route", "Serve", "Wake"]
