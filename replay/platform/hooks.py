"""Platform features around the engine core: the front door (quotas, retries, queue cap), tier
pausing, policy shedding and replica failures (docs/platform.md).

The engine builds a `Platform` only when one of them is configured and calls its hooks at fixed
points of a request's life; a deployment without platform features pays one ``is None`` test per
point and nothing else. Where a hook wants a request's status, a queue or the serving replicas
changed it returns intents (replay/core/intents.py) that the engine applies (``Engine.enact``):

    arrival        ``arrive(req, now)``                 None: it goes on; else intents (throttled, shed); a
                                                        retry is an arrival event it pushes
    queued         ``hold(replica, req, now) -> bool``  its tier is paused there: held, not queued
    admitted       ``admitted(replica, req)``
    requeued       ``requeued(replica, req)``           preempted back into the waiting queue
    before a step  ``shed(replica, now)``               the policy's drops: intents
                   ``check_pause(replica, now)``        pause (preempt, set aside) or resume: intents, or None
    set aside      ``held(replica, reqs, now)``         a pause took them off the queue (``SetAside``)
    ended          ``ended(req, now)``                  frees its quota
    failure        ``fault(replica, down, now)``        FAULT events: returns the intent
    lost           ``take_held(replica)``               a replica failed or its instance was taken away
                   ``moved(req, now)``, ``lost(...)``   (replay/cluster/fleet.py): the engine moves its requests
                                                        (``Engine.evict``); the platform's part of it
    client abort   ``give_up(replica, req)``            a waiting or held request's client left: the intent
    end of replay  ``strand(requests)``                 nothing left to serve what is still held: intents

What an interrupted request keeps (the journal) is core engine behaviour, not a platform feature:
preemption by recompute follows the same rule.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from servelab.replay.core.batch import NEVER, no_aggregate
from servelab.replay.core.engine import ARRIVAL, FAULT
from servelab.replay.core.engine_config import EngineConfig
from servelab.replay.core.intents import (Enter, FailReplica, Preempt, Refuse, RestoreReplica, Resume, SetAside, Strand,
                                     TakeOff, Unhold)
from servelab.replay.core.journal import Ledger
from servelab.replay.core.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.core.engine import Engine
    from servelab.replay.core.replica import Replica

NOTHING = ()  # ``arrive``: the request does not go on, and there is nothing to apply
NO_FAULTS = {"failures": 0, "requests_moved": 0, "requests_interrupted": 0, "work_lost_s": 0.0,
             "tokens_lost": 0, "tokens_recomputed": 0}  # run.json's faults counters before any failure


class Platform:
    @staticmethod
    def wanted(config: EngineConfig, replicas: list["Replica"]) -> bool:
        return config.has_front_door or config.pause is not None or bool(config.fail) or \
            any(r.policy.sheds for r in replicas)

    def __init__(self, engine: "Engine", config: EngineConfig, reclaims: bool = False):
        self.engine = engine
        self.reclaims = reclaims  # replicas may be taken away (instance types with availability: replay/cluster/fleet.py)
        self.ledger: Ledger = engine.ledger
        self.admission = None
        if config.has_front_door:
            from servelab.replay.platform.admission import Admission  # (its only user; a replay without quotas skips it)

            self.admission = Admission(
                config.quotas, retries=config.retries,
                retry_backoff_s=config.retry_backoff_s, retry_max_backoff_s=config.retry_max_backoff_s,
                retry_jitter=config.retry_jitter, retry_after=config.retry_after, queue_cap=config.queue_cap,
                tier_ranks=config.tier_ranks, seed=config.seed)
        self.pause = config.pause_rule
        self.paused: dict[int, list[Request]] = {}  # paused replica id -> its held requests
        self.pause_waiting = [0] * len(engine.replicas)  # requests of the pausable tier in each waiting queue
        self.pause_start: dict[int, float] = {}
        self.num_pauses = 0
        self.shedding = any(r.policy.sheds for r in engine.replicas)
        self.orphans: list[Request] = []  # routed nowhere: every replica is down
        self.fault_stats = dict(NO_FAULTS)
        self.dropped = 0
        # a prefill/decode handoff (replay/cluster/disagg.py sets it): a lost replica's transfers and KV held
        # for them go with it, and decode replicas never pause (their requests hold KV moved to them)
        self.disagg = None
        for f in config.failures:
            engine.push(f.at_s, FAULT, (engine.replicas[f.replica], True))
            if f.for_s is not None:
                engine.push(f.at_s + f.for_s, FAULT, (engine.replicas[f.replica], False))

    @property
    def walks_running(self) -> bool:
        """Features that read running requests' counters directly (so the batch builder keeps none in aggregate).

        A pause reads none until it fires, and then lets go of the aggregate itself (``check_pause``):
        on waiting requests it reads the queue; on the KV share, ``kv.used``, which the aggregate keeps
        current at every decision (it takes its members' blocks for an iteration when a decision takes
        it, ``DecodeCohort.start``, as the per-request path does; tested with and without it).
        A failure lets go of the failed replica's aggregate when it comes, after the lost iteration is
        cut (``evict``)."""
        return self.shedding or self.reclaims

    @property
    def counts_queue(self) -> bool:
        """A pause rule on the waiting count: under async scheduling it counts requests the policy does not
        see yet, so an arrival cuts a decode stretch at the first boundary after it (not the one after that,
        where the policy would first see it): the pause check there may fire (``Engine._route``)."""
        return self.pause is not None and self.pause.metric == "waiting"

    @property
    def acts_before_schedule(self) -> bool:
        return self.shedding or self.pause is not None

    # -- arrival: quotas, retries, the queue cap ----------------------------------------------
    def arrive(self, req: Request, now: float) -> list | tuple | None:
        """Quotas, retries and the queue cap: None if ``req`` goes on, else the intents instead (it is
        throttled or shed; a request shed for it, then ``req`` going on; none: its client retries later)."""
        adm = self.admission
        if adm is None:
            return None
        if req.status.is_terminal:  # a throttled client's retry, after its client timeout ended it
            return NOTHING
        throttle = adm.check(req, now)
        if throttle is not None:
            retry_s = adm.retry_at(req, self.ledger.retries.get(req.index, 0), throttle, now)
            if retry_s is None:
                return [Refuse(req, Status.THROTTLED, throttle.reason)]
            # The client comes back (its latency still counts from its first arrival): an event, as a timeout's
            # deadline is, not a change to the request (still pending); pushed here, without an intent to build
            # and apply, which cost 7% more instructions in a storm of retries (bench/RESULTS.md, session 15).
            Ledger.add(self.ledger.retries, req.index, 1)
            self.engine.push(retry_s, ARRIVAL, req)
            return NOTHING
        # requests waiting for a replica to come back wait too
        engine = self.engine
        queues = engine.live if not self.orphans else [*engine.live, SimpleNamespace(waiting=self.orphans)]
        victim = adm.shed_victim(req, queues)
        if victim is None:
            return None
        reason = f"shed: {adm.queue_cap} requests already waiting and it ranks lowest (tier {victim.tier})"
        if victim is req:
            return self.drop(None, req, reason)
        if victim in self.orphans:
            self.orphans.remove(victim)
            return [*self.drop(None, victim, reason), Enter(req)]
        return [*self.drop(engine.replicas[victim.replica], victim, reason), Enter(req)]

    def orphan(self, req: Request) -> None:
        """No replica is live: ``req`` waits for one to come back."""
        self.orphans.append(req)

    def forget_orphan(self, req: Request) -> None:
        """``req``'s client gave up before it was routed: if it waited for a live replica, it waits no more."""
        if req in self.orphans:
            self.orphans.remove(req)

    def take_orphans(self) -> list[Request]:
        """The requests that waited for a live replica, in their order, handed to the engine to route
        (``AdoptOrphans``, ``RestoreReplica``); none wait from now."""
        orphans, self.orphans = self.orphans, []
        return orphans

    def drop(self, replica: "Replica | None", req: Request, reason: str) -> list:
        """The intents that refuse ``req`` for good; if it waits on ``replica`` it is taken off first (it holds
        no GPU KV there)."""
        self.dropped += 1
        refuse = Refuse(req, Status.DROPPED, reason)
        return [self._take_off(replica, req), refuse] if replica is not None else [refuse]

    def _take_off(self, replica: "Replica", req: Request) -> TakeOff:
        """``req`` leaves ``replica``'s waiting queue for good (a drop, a client's abort): the intent."""
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] -= 1
        return TakeOff(replica, req)

    def give_up(self, replica: "Replica", req: Request) -> TakeOff | Unhold:
        """``req``'s client gave up while it waited on ``replica``, queued or held (its tier paused there):
        the intent that takes it off for good (replay/platform/abort.py)."""
        held = self.paused.get(replica.id)
        if held is not None and req in held:
            held.remove(req)
            self.pause_start.pop(req.index, None)
            return Unhold(replica, req)
        return self._take_off(replica, req)

    def ended(self, req: Request, now: float) -> None:
        if self.admission is not None:
            self.admission.on_end(req, now)

    # -- pausing: the waiting-queue hooks -----------------------------------------------------
    def hold(self, replica: "Replica", req: Request, now: float) -> bool:
        """``req`` is about to queue on ``replica``: True if its tier is paused there (held instead)."""
        pause = self.pause
        if pause is None or req.tier != pause.tier:
            return False
        if replica.id in self.paused:
            self.paused[replica.id].append(req)
            self.pause_start[req.index] = now
            return True
        self.pause_waiting[replica.id] += 1
        return False

    def admitted(self, replica: "Replica", req: Request) -> None:
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] -= 1

    def requeued(self, replica: "Replica", req: Request) -> None:
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] += 1

    # -- before each decision: shedding, pausing (``Engine._platform_decides``) ---------------------
    def shed(self, replica: "Replica", now: float) -> list:
        """The policy's shedding, before it decides: the intents that drop what it sheds."""
        intents = []
        for req, reason in replica.policy.shed(replica):
            intents += self.drop(replica, req, reason)
        return intents

    def check_pause(self, replica: "Replica", now: float) -> list | None:
        """Pause ``replica``'s pausable tier (its running requests preempted, its waiting ones set aside) or
        resume it (the held requests queue again, in their order): the intents, or None when neither."""
        if self.disagg is not None and replica.id in self.disagg.decode_ids:
            return None  # (decode replicas never pause: their requests hold KV moved to them)
        rule, rid = self.pause, replica.id
        if rule.metric == "waiting":
            load = len(replica.waiting) - self.pause_waiting[rid]
        else:
            load = replica.kv.used / replica.kv.total
        held = self.paused.get(rid)
        if held is not None:
            if load > rule.resume:
                return None
            del self.paused[rid]
            for req in held:
                Ledger.add(self.ledger.paused_s, req.index, now - self.pause_start.pop(req.index))
            self.pause_waiting[rid] += len(held)
            return [Resume(replica, tuple(held))]
        if load <= rule.above:
            return None
        self.num_pauses += 1
        no_aggregate(replica)  # it preempts running requests: every counter current, from now on
        tier = rule.tier
        intents: list = [Preempt(replica, req) for req in replica.running if req.tier == tier]
        intents.append(SetAside(replica, lambda req: req.tier == tier))
        return intents

    def stretch_min_free(self, replica: "Replica") -> int:
        """KV blocks that must stay free at every iteration boundary of the decode stretch being planned on
        ``replica`` for the pause check there (``check_pause``, before each decision) to do nothing, as it did
        at the stretch's start (``Engine._plan_stretch``; called after this decision took its blocks): 0, no
        bound; ``NEVER``, none (one iteration). Inside a stretch the waiting count stays (an arrival cuts it)
        and the blocks in use only grow (nothing finishes before its end), so:

        - a tier paused here resumes inside it only if it would at the first boundary: the decision that
          paused it, or this one's, left the load at or under ``resume`` (the pause's own preemptions freed
          blocks; one check does one thing);
        - a tier not paused here is paused at the first boundary whose load passes ``above``: on the waiting
          count, at the first (this decision resumed it: the requests it held wait again); on the KV share,
          where the decodes' growth takes it past ``above``."""
        rule, rid = self.pause, replica.id
        if self.disagg is not None and rid in self.disagg.decode_ids:
            return 0
        paused = rid in self.paused
        if rule.metric == "waiting":
            load = len(replica.waiting) - self.pause_waiting[rid]
            return NEVER if (load <= rule.resume if paused else load > rule.above) else 0
        kv = replica.kv
        total = kv.total
        if paused:
            return NEVER if kv.used / total <= rule.resume else 0
        most = int(rule.above * total)  # the most blocks in use with used / total <= above, as check_pause divides
        while most < total and (most + 1) / total <= rule.above:
            most += 1
        while most > 0 and most / total > rule.above:
            most -= 1
        return total - most

    def held(self, replica: "Replica", reqs: list[Request], now: float) -> None:
        """A pause took ``reqs`` off ``replica``'s queue (``SetAside``): held here until it resumes."""
        self.paused[replica.id] = reqs
        for req in reqs:
            self.pause_start[req.index] = now
        self.pause_waiting[replica.id] = 0

    # -- failures -----------------------------------------------------------------------------
    def fault(self, replica: "Replica", down: bool, now: float) -> list:
        """A FAULT event: the intent to take ``replica`` down (the engine fails it, then ``Engine.evict`` moves its
        work to live replicas) or to bring it back (it serves again if its pool wants it; back in the
        arrivals' pool, the requests waiting for a replica are routed)."""
        if not down:
            return [RestoreReplica(replica)]
        self.fault_stats["failures"] += 1
        return [FailReplica(replica)]

    def take_held(self, replica: "Replica") -> list[Request]:
        """``replica`` is lost (``Engine.evict``): the requests held off its queue (its tier paused there), in
        their order, for the engine to move with its own; none is held or counted as waiting there from now."""
        self.pause_waiting[replica.id] = 0
        return self.paused.pop(replica.id, [])

    def moved(self, req: Request, now: float) -> None:
        """``req`` moves off a lost replica at ``now``: if it was held there, it was paused until now."""
        start = self.pause_start.pop(req.index, None)
        if start is not None:
            Ledger.add(self.ledger.paused_s, req.index, now - start)

    def lost(self, work_lost_s: float | None, moved: int, interrupted: int, tokens_lost: int,
             tokens_recomputed: int) -> None:
        """What losing a replica cost (``Engine.evict``), for run.json's ``faults``: the seconds of its
        iteration under way (None: it was idle), the requests moved, and the journal's counts for them."""
        stats = self.fault_stats
        if work_lost_s is not None:
            stats["work_lost_s"] += work_lost_s
        stats["requests_moved"] += moved
        stats["requests_interrupted"] += interrupted
        stats["tokens_lost"] += tokens_lost
        stats["tokens_recomputed"] += tokens_recomputed

    def strand(self, requests: list[Request]) -> list:
        """At the end: requests held or routed nowhere had no live replica left to serve them (the intent)."""
        if not (self.orphans or self.paused):
            return []
        return [Strand(requests, "no live replica to serve it")]

    # -- run.json -----------------------------------------------------------------------------
    def meta(self) -> dict:
        adm = self.admission
        return {
            "throttles": adm.num_throttles if adm is not None else 0,
            "dropped": self.dropped,
            "pauses": self.num_pauses,
            "faults": dict(self.fault_stats),
        }


__all__ = ["Platform"]
