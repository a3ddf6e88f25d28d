"""What the layers above the engine core want done, as data: intents the engine applies (``Engine.enact``).

The cluster and the platform features (the prefill/decode handoff, autoscalers, fleets of instance
types, failures, the encode pool, the front door, shedding, tier pausing, client timeouts) and the
tracker of requests that wait for others (replay/core/depends.py) observe the engine — its step
listeners and hooks, their own timed events, failures, requests ending — and *return* what they want:
a replica pool's serving set, a request handed off, landed, rejected, refused, routed, sent or
skipped, taken off a queue, preempted, set aside or resumed, a replica failed, restored or taken away. ``Engine.enact`` is the one place that
turns these into changes of a request's status, of the replicas' queues and of which replicas serve,
in the order given; a component never changes them itself.

Each intent is a small immutable record (a named tuple: one is built per handoff and per landing, and a
frozen dataclass costs twice as much to build) naming what it acts on; the time is the one ``enact`` is
called with (the event being handled). The engine tells them apart by their type, never by value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable

    from servelab.replay.core.replica import Replica
    from servelab.replay.core.request import Request, Status


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


# -- the platform's front door, shedding and pausing (replay/platform/hooks.py), client timeouts (replay/platform/abort.py)
class Enter(NamedTuple):
    """``req`` goes on past the front door (the platform shed another request for it): it is encoded
    first or routed, as any arrival."""
    req: Request


class Refuse(NamedTuple):
    """``req`` leaves unserved for good with ``status`` (THROTTLED: its retries ran out; DROPPED: shed;
    ABORTED: its client gave up) and ``reason``; its client saw the refusal now (``refused_s``). One that
    waited on a replica is taken off first (``TakeOff``, ``Unhold``, ``LetGo``)."""
    req: Request
    status: Status
    reason: str


class TakeOff(NamedTuple):
    """``req`` leaves ``replica``'s waiting queue for good (shed, or its client gave up): the policy hears it,
    what it owed the replica is forgiven, and its host-swapped KV and cached-block claims go."""
    replica: Replica
    req: Request


class Unhold(NamedTuple):
    """``req``, held off ``replica``'s queue while its tier is paused there, leaves for good (its client gave
    up): what it owed the replica is forgiven."""
    replica: Replica
    req: Request


class LetGo(NamedTuple):
    """``req`` leaves ``replica``'s running set outside an iteration (its client gave up): its blocks are
    freed; the policy hears it as a finish (``on_finish``) when ``tell_policy`` (not when the iteration
    that just ended gave it its last token: the engine tells the policy of those itself). When
    ``first_token_unseen`` (it made its first token after its client left), that token's time is cleared
    once it is let go: no first token was seen."""
    replica: Replica
    req: Request
    tell_policy: bool
    first_token_unseen: bool = False


class LeaveAtBoundary(NamedTuple):
    """``req`` (its client gave up) is inside ``replica``'s iteration under way: the decode stretch is cut at
    the first iteration boundary at or after now, and at that boundary the client timeouts let it go
    (``Aborts.release``)."""
    replica: Replica
    req: Request


class Decide(NamedTuple):
    """Blocks or queue places were freed on ``replica`` outside an iteration: if it is idle with work, its
    policy decides again (now, unless more happens at this instant)."""
    replica: Replica


class Preempt(NamedTuple):
    """``req`` is taken off ``replica``'s GPU before its policy decides (its tier is being paused); the
    swap-out seconds add to the iteration about to be decided (``Engine.enact`` returns them)."""
    replica: Replica
    req: Request


class SetAside(NamedTuple):
    """The waiting requests of ``replica`` for which ``which(req)`` holds leave its queue, in their order,
    held by the platform until resumed (``Platform.held`` hears which)."""
    replica: Replica
    which: Callable[[Request], bool]


class Resume(NamedTuple):
    """``reqs``, set aside, queue again on ``replica``, at the back, in their order."""
    replica: Replica
    reqs: tuple[Request, ...]


# -- requests that wait for others (replay/core/depends.py)
class Send(NamedTuple):
    """``req``, whose arrival the replay decides (its parents finished), arrives at ``arrival_s``."""
    req: Request
    arrival_s: float


class Skip(NamedTuple):
    """``req`` is never sent (a request it depends on ended unserved): it ends ``skipped`` with ``reason``."""
    req: Request
    reason: str


class Strand(NamedTuple):
    """The replay ends with ``reqs`` not served: those not terminal end ``unfinished`` with ``reason``."""
    reqs: list[Request]
    reason: str


Intent = (Serve | AdoptOrphans | RemoveReplica | FailReplica | RestoreReplica | HandOff | Reject | Land | Wake | Route
          | Enter | Refuse | TakeOff | Unhold | LetGo | LeaveAtBoundary | Decide | Preempt | SetAside | Resume
          | Send | Skip | Strand)

__all__ = ["AdoptOrphans", "Decide", "Enter", "FailReplica", "HandOff", "Intent", "Land", "LeaveAtBoundary", "LetGo",
           "Preempt", "Refuse", "Reject", "RemoveReplica", "RestoreReplica", "Resume", "Route", "Send", "Serve",
           "SetAside", "Skip", "Strand", "TakeOff", "Unhold", "Wake"]
