"""The discrete-event replay loop: arrivals and iteration completions on a simulated clock.

Events live in one heap of ``(time_s, kind, seq, payload)``, merged with the trace's arrivals
(already sorted, so they never enter the heap); ``seq`` breaks the remaining ties so payloads
never need comparing. At equal times arrivals (kind 0) come before step completions (1), which
come before scheduling decisions (2), and replica failures/recoveries (3) come last: a policy
deciding at time t sees every request that arrived at t and every token produced at t.

Cost grows with events, not tokens: when a batch is pure decode, the engine runs it as a
*stretch* of ``k`` identical iterations priced in closed form by the runner's affine decode cost
(step i of n requests reading C0 + i*n KV tokens takes a + b*(C0 + i*n) seconds). ``k`` ends at
the first completion, the last iteration whose KV blocks surely fit, or the policy's ``repeat``;
an arrival routed to the replica cuts the stretch at the first iteration boundary after it.
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache

from servelab.common.errors import ServelabError
from servelab.replay.admission import Admission, Ledger, PauseRule, Quota
from servelab.replay.batch import Batch, BatchSummary
from servelab.replay.cohort import DecodeCohort
from servelab.replay.config import EngineConfig
from servelab.replay.faults import Failure, Journal
from servelab.replay.kv import KVCache, blocks_for
from servelab.replay.logs import StepLog, TokenLog
from servelab.replay.replica import Replica
from servelab.replay.request import Request, Status
from servelab.replay.step import Step
from servelab.runners.base import StepItem, StepPlan, StepShape

ARRIVAL, STEP_DONE, SCHEDULE, FAULT = 0, 1, 2, 3


class Engine:
    def __init__(self, requests: list[Request], replicas: list[Replica], router, runner, config: EngineConfig,
                 followers: dict[int, Request] | None = None,
                 token_log: bool = False):
        self.requests = requests
        self.replicas = replicas
        self.router = router
        self.runner = runner
        self.config = config
        self.followers = followers or {}  # request index -> next closed-loop turn of its session
        self.tokens = TokenLog() if token_log else None
        self.needs_items = bool(getattr(runner, "needs_block_tables", False))
        self.kv_bytes_per_block = _kv_bytes_per_token(runner, config) * config.block_size
        self.swap_bytes_per_s = config.swap_bandwidth_gbps * 1e9
        self.heap: list[tuple] = []
        self.seq = 0
        self.admissions = 0
        self.now_s = 0.0
        self.steps = StepLog()
        self.num_swap_fallbacks = 0
        # The runner's pure-decode cost line per batch size: a pure function, so cached per engine.
        self._decode_affine = lru_cache(maxsize=None)(runner.decode_affine)
        # Trace arrivals are already sorted: they are merged with the heap instead of filling it,
        # so the heap holds only step completions and closed-loop turns (a few per replica).
        self.arrivals = [r for r in requests if r.status is Status.PENDING and r.arrival_s is not None]
        self.next_arrival = 0
        self._check_sorted()
        self._init_platform(config)
        # Decode cohorts (replay/cohort.py) for policies that take decodes first and read running
        # requests only through BatchBuilder; per-request views (token log, block tables) and the
        # platform features that walk running requests keep every request's counters current.
        if self.tokens is None and not self.needs_items and not self.before_schedule and not config.fail:
            for replica in replicas:
                if getattr(replica.policy, "decode_cohort", False):
                    replica.cohort = DecodeCohort(replica)

    def _init_platform(self, config: EngineConfig) -> None:
        """Quotas, pausing, policy shedding, failures and the journal (docs/platform.md); all off by default."""
        self.ledger = Ledger()
        self.journal = Journal(config.journal, self.ledger)
        self.admission = None
        if config.has_front_door:
            ranks = {t.strip(): i for i, t in enumerate(config.tier_order.split(",")) if t.strip()}
            self.admission = Admission(
                tuple(Quota.parse(q) for q in config.quota), retries=config.retries,
                retry_backoff_s=config.retry_backoff_s, retry_max_backoff_s=config.retry_max_backoff_s,
                retry_jitter=config.retry_jitter, retry_after=config.retry_after, queue_cap=config.queue_cap,
                tier_ranks=ranks, seed=config.seed)
        self.pause = PauseRule.parse(config.pause) if config.pause else None
        self.paused: dict[int, list[Request]] = {}  # paused replica id -> its held requests
        self.pause_waiting = [0] * len(self.replicas)  # requests of the pausable tier in each waiting queue
        self.pause_start: dict[int, float] = {}
        self.num_pauses = 0
        self.shedding = any(getattr(r.policy, "sheds", False) for r in self.replicas)
        self.before_schedule = self.shedding or self.pause is not None
        self.live = self.replicas  # replicas taking work (a new list only while one is down)
        self.orphans: list[Request] = []  # routed nowhere: every replica is down
        self.fault_stats = {"failures": 0, "requests_moved": 0, "requests_interrupted": 0, "work_lost_s": 0.0,
                            "tokens_lost": 0, "tokens_recomputed": 0}
        self.dropped = 0
        for spec in config.fail:
            f = Failure.parse(spec)
            self._push(f.at_s, FAULT, (self.replicas[f.replica], True))
            if f.for_s is not None:
                self._push(f.at_s + f.for_s, FAULT, (self.replicas[f.replica], False))

    def _check_sorted(self) -> None:
        prev = -math.inf
        for req in self.arrivals:
            if req.arrival_s < prev:
                raise ServelabError(f"trace is not sorted by arrival_s at request {req.request_id}")
            prev = req.arrival_s

    # -- event plumbing -----------------------------------------------------------------------
    def _push(self, time_s: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time_s, kind, self.seq, payload))

    def run(self, progress=None) -> float:
        """Process events until drained or past the horizon; returns the simulated end time.

        ``progress(arrived, total)`` is called every 8192 arrivals (for a progress bar).
        """
        heap, arrivals = self.heap, self.arrivals
        until = math.inf if self.config.until_s is None else self.config.until_s
        pop = heapq.heappop
        num_arrivals = len(arrivals)
        while True:
            i = self.next_arrival
            if i < num_arrivals and (not heap or arrivals[i].arrival_s <= heap[0][0]):
                req = arrivals[i]
                if req.arrival_s > until:
                    break
                self.next_arrival = i + 1
                if progress is not None and not i & 8191:
                    progress(i, num_arrivals)
                self.now_s = req.arrival_s
                self._arrive(req, req.arrival_s)
                continue
            if not heap or heap[0][0] > until:
                break
            time_s, kind, _, payload = pop(heap)
            self.now_s = time_s
            if kind == STEP_DONE:
                replica, token = payload
                if token == replica.step_token:
                    self._complete(replica, time_s)
            elif kind == ARRIVAL:
                self._arrive(payload, time_s)
            elif kind == FAULT:
                self._fault(payload[0], payload[1], time_s)
            else:
                payload.schedule_pending = False
                if not payload.busy:
                    self._start(payload, time_s)
        if self.config.until_s is not None:
            self.now_s = until
            self._stop_at_horizon(until)
        elif self.orphans or self.paused:
            for req in self.requests:  # stranded: every replica went down for good
                if not req.status.is_terminal:
                    req.status = Status.UNFINISHED
                    req.reason = "no live replica to serve it"
        self._dissolve_cohorts()
        return self.now_s

    def _dissolve_cohorts(self) -> None:
        for replica in self.replicas:
            if replica.cohort is not None:
                replica.cohort.dissolve()

    def _request_schedule(self, replica: Replica, time_s: float) -> None:
        """Consult the policy at ``time_s`` once every arrival and completion at that time is in."""
        if replica.schedule_pending:
            return
        heap, i = self.heap, self.next_arrival
        if (not heap or heap[0][0] > time_s) and (i >= len(self.arrivals) or self.arrivals[i].arrival_s > time_s):
            self._start(replica, time_s)  # nothing else happens at this instant: decide now
        else:
            replica.schedule_pending = True
            self._push(time_s, SCHEDULE, replica)

    # -- arrivals -------------------------------------------------------------------------------
    def _arrive(self, req: Request, now: float) -> None:
        # arrival_s is already the arrival (trace, closed-loop turn, or the original one of a retry)
        if self.admission is not None and not self._through_door(req, now):
            return
        self._route(req, now)

    def _route(self, req: Request, now: float) -> None:
        live = self.live
        if not live:
            self.orphans.append(req)
            return
        replica = self.router.route(req, live)
        req.replica = replica.id
        reason = None
        if not replica.kv.can_ever_fit(req):
            need = blocks_for(req.prompt_tokens + req.max_output_tokens, replica.kv.block_size)
            reason = f"needs {need} KV blocks for prompt + max output; a replica has {replica.kv.total}"
        else:
            reason = replica.policy.reject_reason(req)
        if reason is not None:
            req.status = Status.REJECTED
            req.reason = reason
            self._ended(req, now)
            return
        req.status = Status.WAITING
        replica.outstanding_tokens += (req.prompt_tokens if req.first_token_s is None else 0) + \
            req.output_tokens - req.num_generated_tokens
        if self.pause is not None and req.tier == self.pause.tier:
            if replica.id in self.paused:  # its tier is paused here: held until resumed
                self.paused[replica.id].append(req)
                self.pause_start[req.index] = now
                return
            self.pause_waiting[replica.id] += 1
        replica.waiting.append(req)
        replica.policy.on_arrival(req, replica)
        if replica.busy:
            self._cut_stretch(replica, now)
        else:
            self._request_schedule(replica, now)

    def _cut_stretch(self, replica: Replica, now: float) -> None:
        """End the in-flight decode stretch at the first iteration boundary at or after ``now``."""
        step = replica.inflight
        if step.k == 1 or now >= step.end_s:
            return
        j = step._first_boundary_at_or_after(now)
        if j < step.k:
            step.end_s = step.start_s + step.elapsed(j)
            step.k = j
            replica.step_token += 1
            self._push(step.end_s, STEP_DONE, (replica, replica.step_token))

    # -- starting an iteration ----------------------------------------------------------------
    def _start(self, replica: Replica, now: float) -> None:
        replica.now_s = now
        swap_s = self._before_schedule(replica, now) if self.before_schedule else 0.0
        batch = replica.policy.schedule(replica)
        for victim in batch.preempt:
            swap_s += self._preempt(replica, victim)
        if batch.wake_s is not None and batch.wake_s > now:
            replica.wake_s = batch.wake_s
        if not batch.items and not batch.cohort:
            replica.busy = False
            if batch.wake_s is not None and batch.wake_s > now:
                self._push(batch.wake_s, SCHEDULE, replica)
            elif batch.preempt and replica.waiting:
                self._request_schedule(replica, now)
            return
        kv = replica.kv
        items = [] if self.needs_items else None
        summary = batch.summary
        if summary is None or items is not None:
            summary = self._summarise(kv, batch, items)
        for req in summary.admit:
            swap_s += self._admit(replica, req, now)
        for req, target in summary.grow:
            kv.grow(req, target)
        if summary.cohort_blocks:
            kv.used += summary.cohort_blocks
            if kv.used > kv.total:
                raise AssertionError(f"KV over-committed: {kv.used} > {kv.total} blocks")
        prefill_tokens, prefill_reqs = summary.prefill_tokens, summary.prefill_reqs
        prefill_ctx, pairs = summary.prefill_ctx, summary.pairs
        decode_reqs, decode_ctx = summary.decode_reqs, summary.decode_ctx
        all_decode = not batch.preempt and not prefill_reqs
        affine = self._decode_affine(decode_reqs) if all_decode and items is None else None
        if affine is not None:  # a pure-decode iteration: the runner promised a + b * C
            duration = affine[0] + affine[1] * decode_ctx + swap_s
        else:
            shape = StepShape(prefill_tokens, prefill_reqs, prefill_ctx, pairs, decode_reqs, decode_ctx)
            duration = self.runner.step_time(StepPlan(shape, tuple(items) if items else ())) + swap_s
        if not (duration > 0 and math.isfinite(duration)):
            raise ServelabError(f"runner {self.runner.name} priced a step at {duration} s; steps must take > 0 s")
        step = Step(batch, now, now + duration, 1, prefill_tokens, prefill_reqs, decode_reqs,
                    len(replica.waiting), kv.used)
        if affine is not None and swap_s == 0.0:
            self._plan_stretch(replica, step, summary, affine)
        if replica.wake_s is not None and replica.wake_s > now:
            j = step._first_boundary_at_or_after(replica.wake_s)
            if j < step.k:
                step.end_s = now + step.elapsed(j)
                step.k = j
        replica.busy = True
        replica.inflight = step
        replica.step_token += 1
        self._push(step.end_s, STEP_DONE, (replica, replica.step_token))

    @staticmethod
    def _summarise(kv: KVCache, batch: Batch, items: list | None) -> BatchSummary:
        """Count a batch that was built without BatchBuilder (or whose runner needs the items)."""
        summary = BatchSummary()
        for req, n in batch.items:
            summary.account(req, n, kv.blocks_needed(req, n))
            if items is not None:
                items.append(StepItem(req, req.num_computed_tokens, n))
        return summary

    def _plan_stretch(self, replica: Replica, step: Step, summary: BatchSummary, affine: tuple[float, float]) -> None:
        """Make ``step`` (a pure-decode iteration) a stretch of as many identical iterations as surely hold."""
        k = summary.min_decode_left
        if step.batch.repeat is not None:
            k = min(k, step.batch.repeat)
        if k <= 1:
            return
        kv = replica.kv
        if not kv.reserve and kv.free < step.decode_requests * (k // kv.block_size + 2):
            # not surely enough free blocks for k more tokens each: find how many iterations fit
            cohort = replica.cohort if step.batch.cohort else None
            k = self._kv_safe_iterations(kv, step.batch.items, k, cohort, summary.cohort_blocks)
            if k <= 1:
                return
        step.a, step.b = affine
        step.ctx0 = summary.decode_ctx
        step.k = k
        step.end_s = step.start_s + step.elapsed(k)

    @staticmethod
    def _kv_safe_iterations(kv: KVCache, items, k: int, cohort: DecodeCohort | None, first: int) -> int:
        """Largest j <= k such that every request's next j tokens fit in the free blocks (``first``:
        the cohort's blocks for its first token, already taken when the iteration started)."""
        bs, free = kv.block_size, kv.free

        def extra(j: int) -> int:  # blocks needed beyond those held, to compute j more tokens each
            held = sum(blocks_for(req.num_computed_tokens + j, bs) - req.kv_blocks for req, _ in items)
            return held + (cohort.blocks_added(j) - first if cohort is not None else 0)

        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _admit(self, replica: Replica, req: Request, now: float) -> float:
        waiting = replica.waiting
        if waiting and waiting[0] is req:
            waiting.popleft()
        else:
            waiting.remove(req)
        req.status = Status.RUNNING
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] -= 1
        self.admissions += 1
        req.admitted_seq = self.admissions
        replica.running.append(req)
        if replica.cohort is not None:
            replica.cohort.outside.append(req)
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now
        if req.swapped:  # bring the KV back from host memory
            blocks = blocks_for(req.num_computed_tokens, replica.kv.block_size)
            replica.kv.host_used -= blocks
            req.swapped = False
            return blocks * self.kv_bytes_per_block / self.swap_bytes_per_s
        return 0.0

    def _preempt(self, replica: Replica, req: Request) -> float:
        """Take ``req`` off the GPU; returns the swap-out time it adds to this iteration."""
        kv = replica.kv
        blocks = req.kv_blocks
        cost = 0.0
        if self.config.preemption == "swap" and kv.host_used + blocks <= kv.host_total and not kv.reserve:
            kv.host_used += blocks
            req.swapped = True
            cost = blocks * self.kv_bytes_per_block / self.swap_bytes_per_s
        else:
            if self.config.preemption == "swap":
                self.num_swap_fallbacks += 1
            self._lose_kv(replica, req)
        kv.release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        replica.running.remove(req)
        if replica.cohort is not None:  # the walk that chose it dissolved the cohort first
            replica.cohort.outside.remove(req)
        replica.waiting.appendleft(req)
        if self.pause is not None and req.tier == self.pause.tier:
            self.pause_waiting[replica.id] += 1
        replica.policy.on_requeue(req, replica)
        return cost

    def _lose_kv(self, replica: Replica, req: Request) -> None:
        """``req``'s KV is gone: the journal keeps its generated tokens, or it starts over."""
        generated, had_first = req.num_generated_tokens, req.first_token_s is not None
        self.journal.interrupt(req)
        if req.num_generated_tokens != generated:  # restarted: those tokens are owed again
            replica.outstanding_tokens += generated + (req.prompt_tokens if had_first else 0)

    # -- completing an iteration --------------------------------------------------------------
    def _complete(self, replica: Replica, now: float) -> None:
        step = replica.inflight
        self._apply(replica, step, step.k, now)
        replica.busy = False
        replica.inflight = None
        if replica.wake_s is not None and replica.wake_s <= now:
            replica.wake_s = None
        self._request_schedule(replica, now)

    def _apply(self, replica: Replica, step: Step, j: int, end_s: float) -> None:
        """Apply ``j`` completed iterations of ``step`` ending at ``end_s``."""
        kv = replica.kv
        tokens = self.tokens
        batch = step.batch
        if batch.cohort:
            self._apply_cohort(replica, step, j, end_s)
        if batch.items and step.k == 1:  # (no items: the cohort was the whole batch)
            for req, n in batch.items:
                c = req.num_computed_tokens = req.num_computed_tokens + n
                if c != req.prompt_tokens + req.num_generated_tokens:
                    continue  # a prefill chunk that did not reach the end of the prompt
                if tokens is not None:
                    tokens.single(req.request_id, req.num_generated_tokens + 1, end_s)
                if req.last_token_s is None:  # the prompt is done: first token
                    self._first_token(replica, req, end_s)
                    continue
                gap = end_s - req.last_token_s
                if req.max_itl_s is None or gap > req.max_itl_s:
                    req.max_itl_s = gap
                req.last_token_s = end_s
                g = req.num_generated_tokens = req.num_generated_tokens + 1
                replica.outstanding_tokens -= 1
                if g >= req.output_tokens:
                    self._finish(replica, req, end_s)
        elif batch.items:
            # A decode stretch: every item is past its first token and produced j tokens, the
            # last at end_s; the longest gap is the first (since its previous token) or the last.
            first_end, last_gap = step.gap_bounds(j)
            bs = kv.block_size
            direct = kv.allocator is None  # plain counting: grow inline, check the total once below
            if tokens is not None:
                for req, _ in step.batch.items:
                    tokens.stretch(req.request_id, req.num_generated_tokens + 1, j, step)
            for req, _ in step.batch.items:
                c = req.num_computed_tokens = req.num_computed_tokens + j
                target = -(-c // bs)
                if target > req.kv_blocks:
                    if direct:
                        kv.used += target - req.kv_blocks
                        req.kv_blocks = target
                    else:
                        kv.grow(req, target)
                gap = first_end - req.last_token_s
                if last_gap > gap:
                    gap = last_gap
                if req.max_itl_s is None or gap > req.max_itl_s:
                    req.max_itl_s = gap
                req.last_token_s = end_s
                g = req.num_generated_tokens = req.num_generated_tokens + j
                if g >= req.output_tokens:
                    self._finish(replica, req, end_s)
            replica.outstanding_tokens -= j * len(step.batch.items)
            if kv.used > kv.total:
                raise AssertionError(f"KV over-committed: {kv.used} > {kv.total} blocks")
        cohort = replica.cohort
        if cohort is not None and batch.items:
            self._join_cohort(cohort, batch.items, end_s)
        replica.policy.on_step(batch, j)
        self.steps.append((
            replica.id, step.start_s, end_s - step.start_s, j, step.prefill_tokens, step.prefill_requests,
            step.decode_requests, len(batch.items) + batch.cohort, step.kv_used, kv.total, step.waiting,
            len(batch.preempt),
        ))

    def _apply_cohort(self, replica: Replica, step: Step, j: int, end_s: float) -> None:
        """The cohort's share of ``j`` applied iterations: one aggregate update, then its finishers."""
        cohort = replica.cohort
        if step.k == 1:
            gap = end_s - cohort.last_end_s
        else:  # as for each request of a stretch in _apply: the first gap or the last, whichever is longer
            first_end, last_gap = step.gap_bounds(j)
            gap = max(first_end - cohort.last_end_s, last_gap)
            kv = replica.kv
            kv.used += cohort.blocks_added(j) - step.batch.summary.cohort_blocks  # the first token's: taken at start
            if kv.used > kv.total:
                raise AssertionError(f"KV over-committed: {kv.used} > {kv.total} blocks")
        replica.outstanding_tokens -= j * step.batch.cohort
        for req in cohort.advance(j, gap, end_s):
            self._finish(replica, req, end_s)

    @staticmethod
    def _join_cohort(cohort: DecodeCohort, items, end_s: float) -> None:
        """Requests that emitted a token at ``end_s`` and whose next token is a decode join the cohort
        (a recompute chunk can stop just short of a token: that request joins after emitting it)."""
        running = Status.RUNNING
        for req, _ in items:
            if (req.last_token_s == end_s and req.status is running
                    and req.num_computed_tokens == req.prompt_tokens + req.num_generated_tokens - 1):
                cohort.join(req)

    def _first_token(self, replica: Replica, req: Request, now: float) -> None:
        """``req``'s prompt is done and its first token out at ``now`` (which may finish it)."""
        req.first_token_s = req.last_token_s = now
        req.num_generated_tokens += 1
        replica.outstanding_tokens -= req.prompt_tokens + 1
        if req.num_generated_tokens >= req.output_tokens:
            self._finish(replica, req, now)

    def _finish(self, replica: Replica, req: Request, now: float) -> None:
        req.status = Status.FINISHED
        req.finish_s = now
        replica.kv.release(req)
        replica.running.remove(req)
        cohort = replica.cohort
        if cohort is not None and req in cohort.outside:  # (a finishing member comes from the cohort)
            cohort.outside.remove(req)
        self._ended(req, now)

    def _ended(self, req: Request, now: float) -> None:
        """A request reached a terminal state: release its session's next turn, if any."""
        if self.admission is not None:
            self.admission.on_end(req, now)
        follower = self.followers.get(req.index)
        if follower is not None:
            follower.arrival_s = now + (follower.think_s or 0.0)
            self._push(follower.arrival_s, ARRIVAL, follower)

    # -- platform: front door, shedding, pausing, faults (docs/platform.md) ---------------------
    def _through_door(self, req: Request, now: float) -> bool:
        """Quotas, retries and the queue cap; False if ``req`` does not go on (yet)."""
        adm = self.admission
        throttle = adm.check(req, now)
        if throttle is not None:
            retry_s = adm.retry_at(req, self.ledger.retries.get(req.index, 0), throttle, now)
            if retry_s is None:
                req.status = Status.THROTTLED
                req.reason = throttle.reason
                self.ledger.refused_s[req.index] = now
                self._ended(req, now)
            else:  # the client comes back; its latency still counts from its first arrival
                Ledger.add(self.ledger.retries, req.index, 1)
                self._push(retry_s, ARRIVAL, req)
            return False
        victim = adm.shed_victim(req, self.live)
        if victim is not None:
            reason = f"shed: {adm.queue_cap} requests already waiting and it ranks lowest (tier {victim.tier})"
            if victim is req:
                self._drop(None, req, reason, now)
                return False
            self._drop(self.replicas[victim.replica], victim, reason, now)
        return True

    def _drop(self, replica: Replica | None, req: Request, reason: str, now: float) -> None:
        """Refuse ``req`` for good; if it waits on ``replica`` take it off (it holds no GPU KV there)."""
        if replica is not None:
            replica.waiting.remove(req)
            self._policy_leave(replica, req)
            replica.outstanding_tokens -= (req.prompt_tokens if req.first_token_s is None else 0) + \
                req.output_tokens - req.num_generated_tokens
            if self.pause is not None and req.tier == self.pause.tier:
                self.pause_waiting[replica.id] -= 1
            if req.swapped:
                replica.kv.host_used -= blocks_for(req.num_computed_tokens, replica.kv.block_size)
                req.swapped = False
        req.status = Status.DROPPED
        req.reason = reason
        self.ledger.refused_s[req.index] = now
        self.dropped += 1
        self._ended(req, now)

    @staticmethod
    def _policy_leave(replica: Replica, req: Request) -> None:
        """Tell the policy ``req`` left its replica without its decision (drop, pause, failure)."""
        replica.policy.on_leave(req, replica)

    def _before_schedule(self, replica: Replica, now: float) -> float:
        """Policy shedding and pausing, before the policy decides; returns swap-out seconds."""
        if self.shedding and getattr(replica.policy, "sheds", False):
            for req, reason in replica.policy.shed(replica):
                self._drop(replica, req, reason, now)
        if self.pause is not None:
            return self._check_pause(replica, now)
        return 0.0

    def _check_pause(self, replica: Replica, now: float) -> float:
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
                    replica.waiting.append(req)
                    replica.policy.on_arrival(req, replica)
                self.pause_waiting[rid] += len(held)
            return 0.0
        if load <= rule.above:
            return 0.0
        self.num_pauses += 1
        swap_s = 0.0
        for req in [r for r in replica.running if r.tier == rule.tier]:
            swap_s += self._preempt(replica, req)
        held = self.paused[rid] = []
        keep = []
        for req in replica.waiting:
            if req.tier == rule.tier:
                self._policy_leave(replica, req)
                held.append(req)
                self.pause_start[req.index] = now
            else:
                keep.append(req)
        replica.waiting.clear()
        replica.waiting.extend(keep)
        self.pause_waiting[rid] = 0
        return swap_s

    def _fault(self, replica: Replica, down: bool, now: float) -> None:
        """Take ``replica`` down (its work moves to live replicas) or bring it back."""
        if not down:
            self.live = [r for r in self.replicas if r is replica or r in self.live]
            orphans, self.orphans = self.orphans, []
            self._route_all(orphans, now)
            return
        stats = self.fault_stats
        stats["failures"] += 1
        self.live = [r for r in self.live if r is not replica]
        step = replica.inflight
        if step is not None:  # iterations finished by now count; the one under way is lost
            j = step.iterations_done_by(now)
            done_s = step.start_s + step.elapsed(j)
            if j:
                step.k = j
                self._apply(replica, step, j, done_s)
            stats["work_lost_s"] += now - done_s
            replica.inflight = None
            replica.busy = False
            replica.step_token += 1
        moved = list(replica.running) + list(replica.waiting) + self.paused.pop(replica.id, [])
        for req in replica.running:
            replica.kv.release(req)
        replica.kv.host_used = 0  # the host swap pool went down with it
        replica.running = []
        replica.waiting.clear()
        replica.outstanding_tokens = 0
        replica.wake_s = None
        self.pause_waiting[replica.id] = 0
        stats["requests_moved"] += len(moved)
        journal = self.journal
        before = (journal.requests_interrupted, journal.tokens_lost, journal.tokens_recomputed)
        for req in moved:
            self._policy_leave(replica, req)
            start = self.pause_start.pop(req.index, None)
            if start is not None:  # held on the failed replica: it was paused until now
                Ledger.add(self.ledger.paused_s, req.index, now - start)
            req.swapped = False
            journal.interrupt(req)
            req.status = Status.PENDING
        stats["requests_interrupted"] += journal.requests_interrupted - before[0]
        stats["tokens_lost"] += journal.tokens_lost - before[1]
        stats["tokens_recomputed"] += journal.tokens_recomputed - before[2]
        self._route_all(moved, now)

    def _route_all(self, reqs: list[Request], now: float) -> None:
        """Route several requests at one instant; each replica decides once, seeing all of them."""
        live = [r for r in self.live if not r.schedule_pending]
        for r in live:
            r.schedule_pending = True
        for req in reqs:
            self._route(req, now)
        for r in live:
            r.schedule_pending = False
            if not r.busy and (r.waiting or r.running):
                self._request_schedule(r, now)

    # -- horizon --------------------------------------------------------------------------------
    def _stop_at_horizon(self, until: float) -> None:
        for replica in self.replicas:
            step = replica.inflight
            if step is not None:
                j = step.iterations_done_by(until)
                if j:  # a decode stretch partly done by the horizon
                    end = step.start_s + step.elapsed(j)
                    step.k = j
                    self._apply(replica, step, j, end)
                replica.inflight = None
                replica.busy = False
        for req in self.requests:
            if not req.status.is_terminal:
                req.status = Status.UNFINISHED


def _kv_bytes_per_token(runner, config: EngineConfig) -> int:
    value = getattr(runner, "kv_bytes_per_token", None)
    if value is None:
        value = config.kv_bytes_per_token
    if value is None:
        if config.preemption == "swap":
            raise ServelabError(
                f"preemption 'swap' needs the KV size per token: runner '{runner.name}' does not know its "
                "model, so set kv_bytes_per_token (e.g. --kv-bytes-per-token 131072 for Llama-3.1-8B)"
            )
        return 0
    return int(value)
