"""A pool whose replicas are of several instance types, each available in a count that changes over
time (docs/cluster.md "Heterogeneous and capacity-aware pools").

The pool's replicas are built up front, type by type in order of preference (so replica ids follow
the preference). The pool wants ``replicas`` of them serving (or, autoscaled, the count its
autoscaler last asked for) and fills that count from the most preferred type that has room: a type
has room while the pool holds (active, starting or draining) fewer replicas of it than its
availability at that instant. Replicas of a less preferred type keep serving when a preferred one
becomes available again; scale-in drains the highest ids, the least preferred types, first.

When a type's availability drops below what the pool holds of it, the surplus is **reclaimed** at
that instant: starting replicas first, then draining, then active ones, highest id first. A reclaimed
replica stops as a failed one does (`Platform.evict`: the iteration under way is lost, its requests
lose their KV and are routed again under the journal's rule). The pool first refills from the types
that have room — at once for a pool of fixed size, after the autoscaler's ``startup_s`` for an
autoscaled one — so the moved requests can land on the replacements. With no replica live, requests
wait for one (the platform's orphans; the front door's ``queue_cap`` counts them) and are routed
when one starts; still waiting at the end they are ``unfinished``.

With ``rebalance`` a pool also moves back to a preferred type when it has room again: at each
availability change, for each active replica of a less preferred type (the least preferred, highest
id first) a replica of the most preferred type with room starts (at once for a pool of fixed size,
after ``startup_s`` for an autoscaled one); once it serves, the fallback replica it replaces drains
(no new requests; those on it finish there, nothing is moved).

The state machine (off, starting, active, draining), the timeline and the GPU time are the
autoscaler's (`Autoscaler`); a pool of fixed size is one whose autoscaler never ticks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.replay.cluster.autoscale import AutoscaleConfig, Autoscaler, held_seconds
from servelab.replay.core.engine import TIMER
from servelab.replay.cluster.instances import InstanceType
from servelab.replay.core.intents import AdoptOrphans, RemoveReplica

if TYPE_CHECKING:
    from servelab.replay.cluster.disagg import Disaggregation
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica


class Fleet(Autoscaler):
    """``replicas`` of ``types`` (``kinds``: each replica's index into ``types``), ``initial`` wanted;
    ``config`` None: a pool of fixed size."""

    def __init__(self, engine: Engine, replicas: list[Replica], types: tuple[InstanceType, ...],
                 kinds: list[int], config: AutoscaleConfig | None, initial: int, disagg: Disaggregation | None = None,
                 rebalance: bool = False):
        self.types = types
        self.kind = {r.id: k for r, k in zip(replicas, kinds)}
        self.fixed = config is None
        self.due: dict[int, float] = {}  # replica id -> when its start-up ends
        self.reclaimed = [0] * len(types)
        self.type_timeline: list[list[tuple[float, int, int, int]]] = [[] for _ in types]
        self.changes = sorted({t for ty in types for t in ty.change_times() if t > 0})
        self.next_change = 0
        self.rebalance = rebalance
        self.replacing: dict[int, int] = {}  # a starting replica of a preferred type -> the fallback it replaces
        super().__init__(engine, replicas, config or AutoscaleConfig(min=initial, max=initial), 0,
                         ticks=not self.fixed, disagg=disagg)
        self.wanted = initial
        engine.enact(self._fill(0.0, at_once=True), engine.now_s)
        self._push_change()

    # -- availability --------------------------------------------------------------------------
    def _held(self, k: int) -> int:
        return sum(1 for rid, s in self.state.items() if s != "off" and self.kind[rid] == k)

    def _push_change(self) -> None:
        if self.next_change < len(self.changes):
            self.engine.push(self.changes[self.next_change], TIMER, self._availability_changed)
            self.next_change += 1

    def _availability_changed(self, now: float) -> None:
        """A timed event: the types' availability changes at ``now``. The surplus is reclaimed (each a
        ``RemoveReplica`` intent, after the pool's new serving set and its refill: the moved requests may
        land on a replacement); enacted before the timeline row of ``now`` and the next change are set."""
        if super()._done() and not self.engine.platform.orphans:
            return  # the replay is over: nothing to serve, nothing to reclaim
        victims = []
        for k, ty in enumerate(self.types):
            surplus = self._held(k) - ty.count_at(now)
            if surplus > 0:
                held = [r for r in reversed(self.replicas) if self.kind[r.id] == k and self.state[r.id] != "off"]
                order = {"starting": 0, "draining": 1, "active": 2}
                held.sort(key=lambda r: order[self.state[r.id]])  # (stable: highest id first within a state)
                for r in held[:surplus]:
                    victims.append((r, self.state[r.id]))
                    self.state[r.id] = "off"
                    self.reclaimed[k] += 1
        out = []
        if victims:
            out += self._live()  # (before any request moves: none may land on another replica being reclaimed)
            for r, _ in victims:
                self.replacing.pop(r.id, None)
        out += self._fill(now, at_once=self.fixed)
        if self.rebalance:
            out += self._rebalance(now)
        out += [RemoveReplica(r) for r, was in victims if was != "starting"]  # (a starting one has no requests yet)
        self.engine.enact(out, now)
        self._record(now)
        self._push_change()

    def _fill(self, now: float, at_once: bool) -> list:
        """Bring active + starting up to ``wanted``: draining replicas back first, then the most
        preferred types with room. Returns the intents (empty: nothing changed)."""
        state = self.state
        have = self._count("active") + self._count("starting")
        changed = False
        for r in self.replicas:
            if have < self.wanted and state[r.id] == "draining":
                state[r.id] = "active"
                have += 1
                changed = True
        for r in self.replicas:
            if have >= self.wanted:
                break
            k = self.kind[r.id]
            if state[r.id] == "off" and r.id not in self.engine.down and self._held(k) < self.types[k].count_at(now):
                have += 1
                changed = True
                startup = 0.0 if at_once else self.config.startup_s
                if startup == 0.0:
                    state[r.id] = "active"
                else:
                    state[r.id] = "starting"
                    self.due[r.id] = now + startup
                    self.push(now + startup, lambda t, r=r: self._started(r, t))
        if changed:
            self._record(now)
            return self._live()
        return []

    def _rebalance(self, now: float) -> list:
        """Replace active replicas of less preferred types by replicas of a preferred type with room."""
        state, kind = self.state, self.kind
        replaced = set(self.replacing.values())
        changed = False
        for r in reversed(self.replicas):  # (ids follow the preference: the least preferred first)
            k = kind[r.id]
            if state[r.id] != "active" or r.id in replaced:
                continue
            new = next((s for s in self.replicas if kind[s.id] < k and state[s.id] == "off"
                        and s.id not in self.engine.down
                        and self._held(kind[s.id]) < self.types[kind[s.id]].count_at(now)), None)
            if new is None:
                continue
            changed = True
            replaced.add(r.id)
            if self.fixed or self.config.startup_s == 0.0:
                state[new.id] = "active"
                self._drain(r)
            else:
                state[new.id] = "starting"
                self.replacing[new.id] = r.id
                self.due[new.id] = now + self.config.startup_s
                self.push(now + self.config.startup_s, lambda t, s=new: self._started(s, t))
        if changed:
            self._record(now)
            return self._live()
        return []

    def failed(self, replica: Replica, now: float) -> list:
        """A replica of the pool failed: the pool refills from the types with room (at once for a pool
        of fixed size, after ``startup_s`` for an autoscaled one), as after a reclaim. Returns the intents."""
        out = super().failed(replica, now)
        if not out:
            return out
        self.replacing.pop(replica.id, None)
        return out + self._fill(now, at_once=self.fixed)

    def _drain(self, replica: Replica) -> None:
        if self.state[replica.id] == "active":
            self.state[replica.id] = "draining"
            self._stop_if_drained(replica)

    # -- the autoscaler's actions, through the availability --------------------------------------
    def _scale_out(self, n: int, now: float) -> list:
        self.wanted = self._count("active") + self._count("starting") + n
        out = self._fill(now, at_once=False)
        if out:
            self.last_action_s = now  # (nothing to start: no action, no cooldown)
        return out

    def _scale_in(self, n: int, now: float) -> list:
        self.wanted = self._count("active") - n
        return super()._scale_in(n, now)

    def _started(self, replica: Replica, now: float) -> list:
        if self.due.get(replica.id) == now:  # (not a start-up cut short by a reclaim)
            old = self.replacing.pop(replica.id, None)
            if old is not None and self.state[replica.id] == "starting":  # it serves: the fallback it replaces drains
                self._drain(next(r for r in self.replicas if r.id == old))
            return super()._started(replica, now)
        return []

    def _live(self) -> list:
        """The pool's serving set, then (the arrivals' pool) the requests that waited for a live replica are
        routed if one serves now (``AdoptOrphans``: the engine checks when it enacts it)."""
        out = super()._live()
        if self.disagg is not None and self.disagg.prefill_scaler is not self:
            return out  # a decode pool: arrivals (and the requests waiting for a replica) are the prefill pool's
        out.append(AdoptOrphans())
        return out

    def _done(self) -> bool:
        """Nothing can happen any more (requests waiting for a replica count while availability may
        still change)."""
        waiting = self.engine.platform.orphans and self.next_change < len(self.changes)
        return super()._done() and not waiting

    def _record(self, now: float) -> None:
        super()._record(now)
        for k, rows in enumerate(self.type_timeline):
            counts = [0, 0, 0]
            for rid, s in self.state.items():
                if self.kind[rid] == k and s != "off":
                    counts[("active", "starting", "draining").index(s)] += 1
            row = (now, *counts)
            if rows and rows[-1][1:] == row[1:]:
                continue
            if rows and rows[-1][0] == now:
                rows[-1] = row
            else:
                rows.append(row)

    # -- results -----------------------------------------------------------------------------------
    def type_replica_seconds(self, k: int, start_s: float, end_s: float) -> float:
        """Replicas of type ``k`` held, integrated over [start_s, end_s]."""
        return held_seconds(self.type_timeline[k], start_s, end_s)

    def instance_of(self, replica_id: int) -> str:
        return self.types[self.kind[replica_id]].gpu

    def type_meta(self, k: int, start_s: float, end_s: float) -> dict:
        """run.json's figures of type ``k``: GPU time's replica-seconds over [start_s, end_s], its
        timeline ``[t_s, active, starting, draining]`` and the replicas reclaimed."""
        return {"replica_seconds": self.type_replica_seconds(k, start_s, end_s),
                "timeline": [list(row) for row in self.type_timeline[k]], "reclaimed": self.reclaimed[k]}


__all__ = ["Fleet"]
