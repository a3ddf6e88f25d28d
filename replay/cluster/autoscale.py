"""Autoscaling a pool by target tracking (docs/cluster.md "Autoscaling").

Every ``interval_s`` the autoscaler reads a signal summed over the pool's active replicas and wants
``ceil(sum / target)`` replicas, within ``[min, max]`` (AWS-style target tracking: the signal per
replica is brought to the target). When that differs from the capacity it has (active plus
starting replicas) and ``cooldown_s`` has passed since its last action:

- **scale out**: draining replicas are taken back first (at once), then stopped ones start: each
  serves ``startup_s`` later (boot plus loading weights), when it joins the router's replicas;
- **scale in**: the highest-numbered active replicas drain: the router stops sending them requests,
  they finish everything queued and running on them, then stop.

Requests are never moved or dropped by scaling: a request routed to a replica is served there.
Signals, per active replica: ``queue_depth`` (waiting requests), ``running`` (running requests),
``pending_prompt_tokens`` (prompt tokens of waiting requests not yet computed), ``kv_use`` (KV
blocks used / total), ``request_rate`` (trace arrivals in the last interval / interval_s, summed
over the pool: one number for all replicas), ``handoffs_waiting`` (a decode pool's: requests
handed off by the prefill pool and waiting for a decode replica with room; one number for the pool).

In a disaggregated cluster (``disagg``: replay/cluster/disagg.py) the prefill and the decode pool each have
their own autoscaler, each telling the engine its pool's active replicas (a ``Serve`` intent: replay/core/intents.py),
the engine owning who serves
(arrivals go to the active prefill replicas, handoffs to the active decode ones); the engine calls
``after_step`` after the handoff's own work; a replica also holds work while KV moves: a prefill replica until the KV of the requests it handed
off has landed, a decode replica while transfers to it are under way (``Disaggregation.holding``).
A draining replica stops once that is done too.

A replica that fails (``failed``: the engine's ``fail``) is counted out at once, before its requests
move; a later tick may start another, or this one once it is back (a failed one is never started).

The timeline (``timeline``: one row per change, ``(t_s, active, starting, draining)``) goes to
run.json, and the pool's GPU time integrates it (``replica_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servelab.common.coerce import coerce
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.replay.core.engine import DECODE, ENTRY, TIMER
from servelab.replay.core.intents import Serve

if TYPE_CHECKING:
    from servelab.replay.cluster.disagg import Disaggregation
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica

SIGNALS = ("queue_depth", "running", "pending_prompt_tokens", "kv_use", "request_rate", "handoffs_waiting")



def held_seconds(timeline, start_s: float, end_s: float) -> float:
    """Replicas held (active + starting + draining) integrated over [start_s, end_s], from a
    timeline of ``(t_s, active, starting, draining)`` rows, each in force until the next."""
    total = 0.0
    for i, (t, active, starting, draining) in enumerate(timeline):
        t_next = timeline[i + 1][0] if i + 1 < len(timeline) else math.inf
        lo, hi = max(t, start_s), min(t_next, end_s)
        if hi > lo:
            total += (active + starting + draining) * (hi - lo)
    return total

@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    min: int = 1
    max: int = 1
    signal: str = "queue_depth"
    target: float = 1.0  # the signal per replica the autoscaler aims for
    interval_s: float = 10.0  # how often it looks
    cooldown_s: float = 60.0  # least time between two actions
    startup_s: float = 0.0  # boot + weights: a started replica serves this much later

    def check(self, where: str) -> None:
        if not 1 <= self.min <= self.max:
            raise ServelabError(f"{where}: autoscale needs 1 <= min <= max, got min {self.min}, max {self.max}")
        if self.signal not in SIGNALS:
            raise ServelabError(f"{where}: autoscale signal must be one of {', '.join(SIGNALS)}; got "
                                f"'{self.signal}'{did_you_mean(self.signal, SIGNALS)}")
        if not (0 < self.target < math.inf) or not (0 < self.interval_s < math.inf):
            raise ServelabError(f"{where}: autoscale target and interval_s must be > 0")
        if not (0 <= self.cooldown_s < math.inf) or not (0 <= self.startup_s < math.inf):
            raise ServelabError(f"{where}: autoscale cooldown_s and startup_s must be >= 0")

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "AutoscaleConfig":
        if not isinstance(raw, dict):
            raise ServelabError(f"{where}.autoscale must be a table")
        known = {"min": "int", "max": "int", "signal": "str", "target": "float", "interval_s": "float",
                 "cooldown_s": "float", "startup_s": "float"}
        values = {}
        for key, value in raw.items():
            if key not in known:
                raise ServelabError(f"{where}.autoscale: unknown key '{key}'{did_you_mean(key, known)}")
            values[key] = coerce(value, known[key], f"{where}.autoscale.{key}")
        config = cls(**values)
        config.check(where)
        return config

    def to_dict(self) -> dict[str, Any]:
        return {"min": self.min, "max": self.max, "signal": self.signal, "target": self.target,
                "interval_s": self.interval_s, "cooldown_s": self.cooldown_s, "startup_s": self.startup_s}


class Autoscaler:
    """Scales ``replicas`` (the pool's, all built; the first ``initial`` start active) by ``config``."""

    def __init__(self, engine: "Engine", replicas: list["Replica"], config: AutoscaleConfig, initial: int,
                 ticks: bool = True, disagg: "Disaggregation | None" = None):
        self.push = lambda t, fn: engine.push(t, TIMER, fn)
        self.engine = engine
        self.replicas = replicas
        self.config = config
        self.disagg = disagg  # a prefill or decode pool's: the handoff publishes its replicas and calls it
        self.siblings: list[Autoscaler] = []  # the cluster's other autoscalers (their ticks are not work)
        self.ticking = ticks  # a tick of this autoscaler is pending
        self.state = {r.id: "active" if i < initial else "off" for i, r in enumerate(replicas)}
        self.last_action_s = -math.inf
        self.arrivals_seen = 0
        self.timeline: list[tuple[float, int, int, int]] = []
        self.pool = DECODE if disagg is not None and replicas[0].id in disagg.decode_ids else ENTRY
        engine.step_listeners.append(self.after_step)
        engine.on_failed.append(self.failed)
        if disagg is not None:
            disagg.scaled_by(self)
        engine.enact(self._live(), engine.now_s)
        self._record(0.0)
        if ticks:  # (a pool of fixed size whose replicas change only with availability: replay/cluster/fleet.py)
            self.push(config.interval_s, self.tick)

    def _count(self, state: str) -> int:
        return sum(1 for s in self.state.values() if s == state)

    def _record(self, now: float) -> None:
        row = (now, self._count("active"), self._count("starting"), self._count("draining"))
        if self.timeline and self.timeline[-1][1:] == row[1:]:
            return
        if self.timeline and self.timeline[-1][0] == now:
            self.timeline[-1] = row  # several changes at one instant: the last counts
        else:
            self.timeline.append(row)

    def _live(self) -> list:
        """The intents telling the engine which replicas of the pool are wanted serving (the active ones)."""
        return [Serve(self.pool, tuple(r for r in self.replicas if self.state[r.id] == "active"))]

    def _holding(self, replica: "Replica") -> bool:
        """``replica`` still holds KV that is moving (a disaggregated pool's)."""
        return self.disagg is not None and self.disagg.holding(replica)

    # -- the signal --------------------------------------------------------------------------------
    def signal(self, active: list["Replica"]) -> float:
        name = self.config.signal
        if name == "queue_depth":
            return float(sum(len(r.waiting) for r in active))
        if name == "running":
            return float(sum(len(r.running) for r in active))
        if name == "pending_prompt_tokens":
            return float(sum(req.prompt_tokens - min(req.num_computed_tokens, req.prompt_tokens)
                             for r in active for req in r.waiting if req.first_token_s is None))
        if name == "kv_use":
            return sum(r.kv.used / r.kv.total for r in active)
        if name == "handoffs_waiting":
            return float(len(self.disagg.pending))
        arrived = self.engine.next_arrival - self.arrivals_seen  # request_rate
        self.arrivals_seen = self.engine.next_arrival
        return arrived / self.config.interval_s

    # -- events ------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        cfg = self.config
        active = [r for r in self.replicas if self.state[r.id] == "active"]
        desired = min(cfg.max, max(cfg.min, math.ceil(self.signal(active) / cfg.target - 1e-9)))
        if now - self.last_action_s >= cfg.cooldown_s:
            have = len(active) + self._count("starting")
            if desired > have:
                self.engine.enact(self._scale_out(desired - have, now), now)
            elif desired < len(active):
                self.engine.enact(self._scale_in(len(active) - desired, now), now)
        if self._done():  # (after the intents: a handoff they place is work pending)
            self.ticking = False
        else:
            self.push(now + cfg.interval_s, self.tick)

    def _done(self) -> bool:
        """Nothing can happen any more: the trace is in, no event is pending but the other autoscalers'
        ticks, every replica is idle. (KV in transfer has its link's event pending; a handoff still
        waiting then can never be placed, and the replay ends with it unfinished.)"""
        engine = self.engine
        ticks = sum(1 for s in self.siblings if s.ticking)
        return engine.next_arrival >= len(engine.arrivals) and len(engine.heap) <= ticks and \
            all(not r.busy and not r.running and not r.waiting for r in self.replicas)

    def _scale_out(self, n: int, now: float) -> list:
        self.last_action_s = now
        for r in self.replicas:  # draining ones come back first, at once
            if n and self.state[r.id] == "draining":
                self.state[r.id] = "active"
                n -= 1
        down = self.engine.down
        for r in self.replicas:
            if n and self.state[r.id] == "off" and r.id not in down:  # (a failed machine does not start)
                self.state[r.id] = "starting"
                self.push(now + self.config.startup_s, lambda t, r=r: self._started(r, t))
                n -= 1
        self._record(now)
        return self._live()

    def _started(self, replica: "Replica", now: float) -> list:
        """A timed event: ``replica``'s start-up is over; returns the intents (the engine enacts them)."""
        if self.state[replica.id] == "starting":
            self.state[replica.id] = "active"
            self._record(now)
            return self._live()
        return []

    def _scale_in(self, n: int, now: float) -> list:
        self.last_action_s = now
        for r in reversed(self.replicas):
            if n and self.state[r.id] == "active":
                self.state[r.id] = "draining"
                n -= 1
                self._stop_if_drained(r)
        self._record(now)
        return self._live()

    def _stop_if_drained(self, replica: "Replica") -> bool:
        if self.state[replica.id] == "draining" and not replica.busy and not replica.running and not replica.waiting \
                and not self._holding(replica):
            self.state[replica.id] = "off"
            return True
        return False

    def after_step(self, replica: "Replica", step, end_s: float) -> None:
        if self.state.get(replica.id) == "draining" and not replica.running and not replica.waiting \
                and not self._holding(replica):
            self.state[replica.id] = "off"  # (its step is applied: it is idle from end_s)
            self._record(end_s)

    def failed(self, replica: "Replica", now: float) -> list:
        """A replica of the pool failed: it is gone (no longer counted or held); the next tick may start
        another in its stead, or this one once it is back. Returns the intents (empty: not the pool's)."""
        if self.state.get(replica.id, "off") == "off":
            return []
        self.state[replica.id] = "off"
        self._record(now)
        return self._live()

    def released(self, replica: "Replica", now: float) -> None:
        """KV ``replica`` held for a transfer has landed elsewhere: a drained one stops now."""
        if self._stop_if_drained(replica):
            self._record(now)

    # -- results -----------------------------------------------------------------------------------
    def replica_seconds(self, start_s: float, end_s: float) -> float:
        """Replicas held (active, starting or draining) integrated over [start_s, end_s]."""
        return held_seconds(self.timeline, start_s, end_s)

    def meta(self) -> dict:
        return {"config": self.config.to_dict(), "timeline": [list(row) for row in self.timeline]}


__all__ = ["SIGNALS", "AutoscaleConfig", "Autoscaler"]
