"""Platform features around the engine core: the front door (quotas, retries, queue cap), tier
pausing, policy shedding and replica failures (docs/platform.md).

The engine builds a `Platform` only when one of them is configured and calls its hooks at fixed
points of a request's life; a deployment without platform features pays one ``is None`` test per
point and nothing else:

    arrival        ``arrive(req, now) -> bool``        may throttle, retry later or shed
    queued         ``hold(replica, req, now) -> bool``  its tier is paused there: held, not queued
    admitted       ``admitted(replica, req)``
    requeued       ``requeued(replica, req)``           preempted back into the waiting queue
    before a step  ``before_schedule(replica, now)``    sheds and pauses; returns swap-out seconds
    ended          ``ended(req, now)``                  frees its quota
    failure        ``fault(replica, down, now)``        FAULT events: returns the intent (replay/intents.py)
    lost           ``evict(replica, now)``              failed, or its instance taken away (replay/fleet.py)
    end of replay  ``strand(requests)``                 nothing left to serve what is still held

What an interrupted request keeps (the journal) is core engine behaviour, not a platform feature:
preemption by recompute follows the same rule.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from servelab.common.tiers import parse_tiers
from servelab.replay.admission import Admission, PauseRule, Quota
from servelab.replay.batch import no_aggregate
from servelab.replay.engine import FAULT
from servelab.replay.engine_config import EngineConfig
from servelab.replay.intents import FailReplica, RestoreReplica
from servelab.replay.journal import Ledger
from servelab.replay.specs import Failure
from servelab.replay.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.engine import Engine
    from servelab.replay.replica import Replica

NO_FAULTS = {"failures": 0, "requests_moved": 0, "requests_interrupted": 0, "work_lost_s": 0.0,
             "tokens_lost": 0, "tokens_recomputed": 0}  # run.json's faults counters before any failure


class Platform:
    @staticmethod
    def wanted(config: EngineConfig, replicas: list["Replica"]) -> bool:
        return config.has_front_door or config.pause is not None or bool(config.fail) or \
            any(r.policy.sheds for r in replicas)

    def __init__(self, engine: "Engine", config: EngineConfig, reclaims: bool = False):
        self.engine = engine
        self.reclaims = reclaims  # replicas may be taken away (instance types with availability: replay/fleet.py)
        self.ledger: Ledger = engine.ledger
        self.admission = None
        if config.has_front_door:
            self.admission = Admission(
                tuple(Quota.parse(q) for q in config.quota), retries=config.retries,
                retry_backoff_s=config.retry_backoff_s, retry_max_backoff_s=config.retry_max_backoff_s,
                retry_jitter=config.retry_jitter, retry_after=config.retry_after, queue_cap=config.queue_cap,
                tier_ranks=parse_tiers(config.tier_order, "tier_order"), seed=config.seed)
        self.pause = PauseRule.parse(config.pause) if config.pause else None
        self.paused: dict[int, list[Request]] = {}  # paused replica id -> its held requests
        self.pause_waiting = [0] * len(engine.replicas)  # requests of the pausable tier in each waiting queue
        self.pause_start: dict[int, float] = {}
        self.num_pauses = 0
        self.shedding = any(r.policy.sheds for r in engine.replicas)
        self.orphans: list[Request] = []  # routed nowhere: every replica is down
        self.fault_stats = dict(NO_FAULTS)
        self.dropped = 0
        # a prefill/decode handoff (replay/disagg.py sets it): a lost replica's transfers and KV held
        # for them go with it, and decode replicas never pause (their requests hold KV moved to them)
        self.disagg = None
        for spec in config.fail:
            f = Failure.parse(spec)
            engine.push(f.at_s, FAULT, (engine.replicas[f.replica], True))
            if f.for_s is not None:
                engine.push(f.at_s + f.for_s, FAULT, (engine.replicas[f.replica], False))

    @property
    def walks_running(self) -> bool:
        """Features that read running requests' counters directly (so the batch builder keeps none in aggregate).

        A pause reads none until it fires, and then lets go of the aggregate itself (``_check_pause``):
        on waiting requests it reads the queue; on the KV share, ``kv.used``, which the aggregate keeps
        current at every decision (it takes its members' blocks for an iteration when a decision takes
        it, ``DecodeCohort.start``, as the per-request path does; tested with and without it).
        A failure lets go of the failed replica's aggregate when it comes, after the lost iteration is
        cut (``evict``)."""
        return self.shedding or self.reclaims

    @property
    def acts_before_schedule(self) -> bool:
        return self.shedding or self.pause is not None

    # -- arrival: quotas, retries, the queue cap ----------------------------------------------
    def arrive(self, req: Request, now: float) -> bool:
        """Quotas, retries and the queue cap; False if ``req`` does not go on (yet)."""
        adm = self.admission
        if adm is None:
            return True
        if req.status.is_terminal:  # a throttled client's retry, after its client timeout ended it
            return False
        engine = self.engine
        throttle = adm.check(req, now)
        if throttle is not None:
            retry_s = adm.retry_at(req, self.ledger.retries.get(req.index, 0), throttle, now)
            if retry_s is None:
                self.ledger.refused_s[req.index] = now
                engine.end(req, Status.THROTTLED, throttle.reason, now)
            else:  # the client comes back; its latency still counts from its first arrival
                Ledger.add(self.ledger.retries, req.index, 1)
                engine.push(retry_s, engine.ARRIVAL, req)
            return False
        # requests waiting for a replica to come back wait too
        queues = engine.live if not self.orphans else [*engine.live, SimpleNamespace(waiting=self.orphans)]
        victim = adm.shed_victim(req, queues)
        if victim is not None:
            reason = f"shed: {adm.queue_cap} requests already waiting and it ranks lowest (tier {victim.tier})"
            if victim is req:
                self.drop(None, req, reason, now)
                return False
            if victim in self.orphans:
                self.orphans.remove(victim)
                self.drop(None, victim, reason, now)
            else:
                self.drop(engine.replicas[victim.replica], victim, reason, now)
        return True

    def orphan(self, req: Request) -> None:
        """No replica is live: ``req`` waits for one to come back."""
        self.orphans.append(req)

    def take_orphans(self) -> list[Request]:
        """The requests that waited for a live replica, in their order, handed to the engine to route
        (``AdoptOrphans``, ``RestoreReplica``); none wait from now."""
        orphans, self.orphans = self.orphans, []
        return orphans

    def drop(self, replica: "Replica | None", req: Request, reason: str, now: float) -> None:
        """Refuse ``req`` for good; if it waits on ``replica`` take it off (it holds no GPU KV there)."""
        if replica is not None:
            self.take_off(replica, req)
        self.ledger.refused_s[req.index] = now
        self.dropped += 1
        self.engine.end(req, Status.DROPPED, reason, now)

    def take_off(self, replica: "Replica", req: Request) -> None:
        """Take ``req`` out of ``replica``'s waiting queue for good (a drop, a client's abort)."""
        self.engine.take_off(replica, req)
        replica.forgive(req)
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] -= 1
        if req.swapped:
            replica.kv.drop_host(req)
        replica.kv.forget(req)  # (a purged tenant's cached blocks)

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

    # -- before each decision: shedding, pausing ----------------------------------------------
    def before_schedule(self, replica: "Replica", now: float) -> float:
        """Policy shedding and pausing, before the policy decides; returns swap-out seconds."""
        if self.shedding and replica.policy.sheds:
            for req, reason in replica.policy.shed(replica):
                self.drop(replica, req, reason, now)
        if self.pause is not None and (self.disagg is None or replica.id not in self.disagg.decode_ids):
            return self._check_pause(replica, now)
        return 0.0

    def _check_pause(self, replica: "Replica", now: float) -> float:
        rule, rid = self.pause, replica.id
        if rule.metric == "waiting":
            load = len(replica.waiting) - self.pause_waiting[rid]
        else:
            load = replica.kv.used / replica.kv.total
        held = self.paused.get(rid)
        if held is not None:
            if load <= rule.resume:  # resume: the held requests queue again, in their order
                del self.paused[rid]
                for req in held:
                    Ledger.add(self.ledger.paused_s, req.index, now - self.pause_start.pop(req.index))
                    self.engine.resume(replica, req)
                self.pause_waiting[rid] += len(held)
            return 0.0
        if load <= rule.above:
            return 0.0
        self.num_pauses += 1
        no_aggregate(replica)  # it preempts running requests: every counter current, from now on
        swap_s = 0.0
        for req in [r for r in replica.running if r.tier == rule.tier]:
            swap_s += self.engine.preempt(replica, req)
        tier = rule.tier
        held = self.paused[rid] = self.engine.set_aside(replica, lambda req: req.tier == tier)
        for req in held:
            self.pause_start[req.index] = now
        self.pause_waiting[rid] = 0
        return swap_s

    # -- failures -----------------------------------------------------------------------------
    def fault(self, replica: "Replica", down: bool, now: float) -> list:
        """A FAULT event: the intent to take ``replica`` down (the engine fails it, then ``evict`` moves its
        work to live replicas) or to bring it back (it serves again if its pool wants it; back in the
        arrivals' pool, the requests waiting for a replica are routed)."""
        if not down:
            return [RestoreReplica(replica)]
        self.fault_stats["failures"] += 1
        return [FailReplica(replica)]

    def evict(self, replica: "Replica", now: float) -> None:
        """``replica`` has stopped serving at ``now`` (failed: ``Engine.fail``; or its instance reclaimed:
        its fleet no longer wants it): the iteration under way is lost and every request on it loses
        its KV and is routed again (the journal's rule).

        With prefill/decode pools (``disagg``) the requests whose KV it held for a transfer, or that
        were landing on it, lose that KV too (``Disaggregation.lose``), and every one goes to the
        prefill pool's router (the engine's live replicas): it re-prefills and is handed off again."""
        engine = self.engine
        stats = self.fault_stats
        disagg = self.disagg
        if disagg is not None:
            disagg.stop(replica)
        if replica.inflight is not None:  # iterations finished by now count; the one under way is lost
            stats["work_lost_s"] += engine.truncate(replica, now)
        no_aggregate(replica)  # every counter of what it held current before it moves, and from now on
        moved = list(replica.running) + list(replica.waiting) + self.paused.pop(replica.id, [])
        lost = disagg.lose(replica, now) if disagg is not None else ()
        engine.empty(replica)  # GPU blocks and the host swap pool alike; its queues emptied
        replica.outstanding_tokens = 0
        replica.wake_s = None
        self.pause_waiting[replica.id] = 0
        journal = engine.journal
        before = (journal.requests_interrupted, journal.tokens_lost, journal.tokens_recomputed)
        if engine.aborts is not None:  # aborted inside the lost iteration: it ended at its deadline, stays ended
            for req in [r for r in moved if r.status.is_terminal]:
                replica.policy.on_leave(req, replica)
                moved.remove(req)
        for req in moved:
            replica.policy.on_leave(req, replica)
            start = self.pause_start.pop(req.index, None)
            if start is not None:  # held on the failed replica: it was paused until now
                Ledger.add(self.ledger.paused_s, req.index, now - start)
            engine.interrupt(req)
        if disagg is not None:
            disagg.lost_running(replica, moved)
            for req in lost:  # (they had left their prefill replica's policy when handed off)
                engine.interrupt(req)
            moved += lost
        stats["requests_moved"] += len(moved)
        stats["requests_interrupted"] += journal.requests_interrupted - before[0]
        stats["tokens_lost"] += journal.tokens_lost - before[1]
        stats["tokens_recomputed"] += journal.tokens_recomputed - before[2]
        engine.route_all(moved, now)
        if disagg is not None:
            disagg.place_pending(now)  # (landing blocks freed on decode replicas)

    def strand(self, requests: list[Request]) -> None:
        """At the end: requests held or routed nowhere had no live replica left to serve them."""
        if not (self.orphans or self.paused):
            return
        self.engine.strand(requests, "no live replica to serve it")

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
