"""The discrete-event replay loop: arrivals and iteration completions on a simulated clock.

Events live in one heap of ``(time_s, kind, seq, payload)``, merged with the trace's arrivals
(already sorted, so they never enter the heap); ``seq`` breaks the remaining ties so payloads
never need comparing. At equal times arrivals (kind 0) come before step completions (1), which
come before scheduling decisions (2), and replica failures/recoveries (3) come last: a policy
deciding at time t sees every request that arrived at t and every token produced at t. A streamed
trace (replay/stream.py) refills the arrivals through one more kind (REFILL, first at its instant).

Cost grows with events, not tokens: when a batch is pure decode, the engine runs it as a
*stretch* of ``k`` identical iterations priced in closed form by the runner's affine decode cost
(step i of n requests reading C0 + i*n KV tokens takes a + b*(C0 + i*n) seconds). ``k`` ends at
the first completion, the last iteration whose KV blocks surely fit, the policy's ``repeat``, or the
last boundary at which the decision surely holds as free blocks dwindle (``BatchSummary.min_free``, a
pause rule's ``stretch_min_free``);
an arrival routed to the replica cuts the stretch at the first iteration boundary after it.
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache

from servelab.common.errors import ServelabError
from servelab.replay.core.batch import (Batch, BatchSummary, aggregate_decodes, blocks_to_grow, make_current,
                                         no_aggregate, settle)
from servelab.replay.core.engine_config import EngineConfig
from servelab.replay.core.intents import (AdoptOrphans, Decide, Enter, FailReplica, HandOff, Land, LeaveAtBoundary, LetGo,
                                     Preempt, Refuse, Reject, RemoveReplica, RestoreReplica, Resume, Route, Send, Serve,
                                     SetAside, Skip, Strand, TakeOff, Unhold, Wake)
from servelab.replay.core.journal import Journal, Ledger
from servelab.replay.core.kv.manager import KVManager
from servelab.replay.core.logs import StepLog, TokenLog
from servelab.replay.core.progress import apply_iteration, apply_stretch
from servelab.replay.core.protocols import Router, Runner, StepItem, StepPlan, StepShape
from servelab.replay.core.replica import Replica, owed
from servelab.replay.core.request import Request, Status
from servelab.replay.core.speculative import SpecDecode
from servelab.replay.core.step import Step

ARRIVAL, STEP_DONE, SCHEDULE = 0, 1, 2
# A component's own timed event (payload: a function of the time), after the completions at its
# instant and before the decisions: KV transfers landing on a decode replica (replay/cluster/disagg.py).
TIMER = 1.5
# After every decision at its instant (payload: a function of the time): DP ranks stepping together close
# the round they formed at that instant (replay/core/lockstep.py).
AFTER_DECISIONS = 2.5
FAULT = 3  # a replica failing or coming back (payload: (replica, down)), after everything else at its instant
# A streamed trace's next arrivals (replay/stream.py; payload: a function of the time), before everything
# else at its instant: set at the arrival time of the batch's last request, held back from ``arrivals``,
# so that every look ahead at the next arrival sees what an unstreamed replay would.
REFILL = -1
ENTRY, DECODE = "entry", "decode"  # the pools a router picks from: arrivals', and prefill/decode handoffs'
PROGRESS_STEPS = 4096  # completed steps between two progress reports (besides every 8192 arrivals)


class Engine:
    """The event loop. Reading order: ``run`` (events), ``_route`` (an arrival joins a replica),
    ``_start`` (a policy decision becomes an iteration), ``apply`` (finished iterations become request
    progress), ``_finish`` / ``ended`` (a request leaves). KV state is the replicas' `KVManager`s,
    request progress `replay.core.progress`, platform features `replay.platform.hooks` (hooks, off by default).

    The engine is the one owner of a request's status (``_route``, ``_admit``, ``preempt``,
    ``_finish``, and for the layers above ``end``, ``interrupt``, ``strand``, ``truncate``) and of
    which replicas serve (``publish``, ``fail``, ``restore``): the cluster and the platform ask, mostly by
    returning intents (replay/core/intents.py) that ``enact`` applies."""

    ARRIVAL = ARRIVAL
    # A cluster's encode pool (replay/cluster/encode_pool.py), set on the instance when there is one: multimodal
    # arrivals go there first. A class default, not set in __init__: a 30th instance attribute cost
    # Engine.run 2.4% more instructions (likely CPython's compact attribute layout ending near 30 keys).
    encode = None
    # Likewise a class default (an instance attribute from the first swap that falls back to recompute).
    # Under CPython 3.11 a class default read through the instance is not specialised, so the hooks read
    # on the hot path (depends, retention, spec) stay instance attributes; to stay at 29, the runner (not
    # read after __init__) and its cached decode line (a local) are not kept: 32 attributes cost 3.6%.
    num_swap_fallbacks = 0
    TIMER = TIMER

    def __init__(self, requests: list[Request], replicas: list[Replica], router: Router, runner: Runner,
                 config: EngineConfig, followers: dict[int, Request] | None = None, token_log: bool = False,
                 platform=None):
        self.requests = requests
        self.replicas = replicas
        # Replica membership, owned here: which replicas take new work. A pool's controller (an
        # autoscaler, a fleet of instance types) says which of its replicas it wants serving
        # (``publish``), a failure takes one down and back (``fail``, ``restore``); a replica serves
        # when its pool wants it and it is up. ``live`` is the arrivals' pool's (the routers' list).
        self.live = replicas
        self.wanted: dict[str, list[Replica]] = {ENTRY: replicas}
        self.down: set[int] = set()  # ids of failed replicas not back yet
        self.role: dict[int, str] = {}  # replica id -> its pool (ENTRY when absent)
        self.on_serving = {}  # pool -> called with (live, grew) when its serving replicas change (not ENTRY's)
        self.on_failed: list = []  # called with (replica, now) when a replica fails (its pool's controller)
        self.router = router
        self.config = config
        self.followers = followers or {}  # request index -> next closed-loop turn of its session
        self.tokens = TokenLog() if token_log else None
        # (a runner that prices each request's context, not only the batch's counts: a hybrid layout's)
        self.needs_items = runner.needs_block_tables or getattr(runner, "prices_items", False)
        self.heap: list[tuple] = []
        self.seq = 0
        self.admissions = 0
        self.now_s = 0.0
        self.steps = StepLog()
        # What a request keeps when it loses its KV (preemption by recompute, a failure), and the
        # per-request counters the results report.
        self.ledger = Ledger()
        self.journal = Journal(config.journal, self.ledger)
        # The runner's pure-decode cost line per batch size: a pure function, so cached per engine.
        # A replica may bring its own runner (a cluster's pools: replay/cluster/config.py).
        affines = {id(runner): lru_cache(maxsize=None)(runner.decode_affine)}
        for replica in replicas:
            if replica.runner is None:
                replica.runner = runner
            own = replica.runner
            if id(own) not in affines:
                affines[id(own)] = lru_cache(maxsize=None)(own.decode_affine)
            replica.decode_affine = affines[id(own)]
        for replica in replicas:
            if replica.group is not None:  # DP ranks stepping together (replay/core/lockstep.py)
                replica.group.engine = self
        if not self.needs_items and any(getattr(r.runner, "prices_items", False) for r in replicas):
            self.needs_items = True  # a cluster pool's runner prices each request's context (hybrid attention)
        # Components called with (replica, step, end_s) after each applied step, in order: the
        # prefill/decode handoff (replay/cluster/disagg.py), then the pools' autoscalers (replay/cluster/autoscale.py).
        self.step_listeners: list = []
        self.aborts = None  # client timeouts (replay/platform/abort.py), when any request has one
        self.depends = None  # requests that wait for others (replay/core/depends.py), when the trace has any
        self.retention = None  # KV retention across sessions' tool waits (replay/core/kv/retention.py), when on
        # Trace arrivals are already sorted: they are merged with the heap instead of filling it,
        # so the heap holds only step completions and closed-loop turns (a few per replica).
        self.arrivals = [r for r in requests if r.status is Status.PENDING and r.arrival_s is not None]
        self.next_arrival = 0
        self._check_sorted()
        # The platform's hooks (replay/platform/hooks.py: quotas, pausing, shedding, failures), built on this
        # engine by ``platform(engine)`` when the assembly wants them (servelab.api), else None.
        self.platform = platform(self) if platform is not None else None
        # Speculative decoding (replay/core/speculative.py): a decode advances by a drawn number of tokens per
        # step, so steps are priced and applied one by one (no decode stretch, nothing kept in aggregate).
        self.spec = SpecDecode(config, requests) if config.spec_method is not None else None
        if self.spec is not None:
            for replica in replicas:
                replica.decode_affine = _no_affine
        self._before_schedule = self._platform_decides \
            if self.platform is not None and self.platform.acts_before_schedule else None
        # The batch builder may keep running requests in aggregate across decisions (replay/core/batch.py),
        # unless something reads every running request's counters: runners that need block tables and
        # the platform features that walk running requests.
        if not self.needs_items and (self.platform is None or not self.platform.walks_running) and self.spec is None:
            for replica in replicas:
                if replica.lora is None:  # (LoRA prices each batch's adapters: no decodes in aggregate)
                    aggregate_decodes(replica, self.tokens)

    def _check_sorted(self) -> None:
        prev = -math.inf
        for req in self.arrivals:
            if req.arrival_s < prev:
                raise ServelabError(f"trace is not sorted by arrival_s at request {req.request_id}")
            prev = req.arrival_s

    # -- event plumbing -----------------------------------------------------------------------
    def push(self, time_s: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time_s, kind, self.seq, payload))

    def run(self, progress=None) -> float:
        """Process events until drained or past the horizon; returns the simulated end time.

        ``progress(now_s, ended, total)`` (for a progress bar) is called every 8192 arrivals, every
        ``PROGRESS_STEPS`` completed steps and once at the end: the simulated time reached, the
        requests that reached a terminal state so far, and all requests.
        """
        heap, arrivals = self.heap, self.arrivals
        if progress is not None:
            report = self._count_progress(progress)
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
                    report(req.arrival_s)
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
                self.enact(self.platform.fault(payload[0], payload[1], time_s), time_s)
            elif kind == TIMER:
                intents = payload(time_s)  # (a component's own event: it may return intents)
                if intents:
                    self.enact(intents, time_s)
            elif kind == REFILL:  # (streaming) the arrivals list was refilled in place
                payload(time_s)
                num_arrivals = len(arrivals)
            elif kind == AFTER_DECISIONS:
                payload(time_s)
            else:
                payload.schedule_pending = False
                if not payload.busy:
                    self._start(payload, time_s)
        if self.config.until_s is not None:
            self.now_s = until
            self._stop_at_horizon(until)
        elif self.platform is not None:
            self.enact(self.platform.strand(self.requests), self.now_s)
        for replica in self.replicas:
            settle(replica)
        if progress is not None:
            del self._complete, self.ended  # the class's methods again
            report(self.now_s)
        return self.now_s

    def advance(self, until_s: float) -> None:
        """Online mode (replay/platform/online.py): process the heap's events at or before ``until_s`` and stop,
        leaving later ones (and the in-flight steps) for the next call; no horizon, nothing settled.
        Requests come by ``send_at`` (no trace arrivals list). ``run`` is the offline loop."""
        heap = self.heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until_s:
            time_s, kind, _, payload = pop(heap)
            self.now_s = time_s
            if kind == STEP_DONE:
                replica, token = payload
                if token == replica.step_token:
                    self._complete(replica, time_s)
            elif kind == ARRIVAL:
                self._arrive(payload, time_s)
            elif kind == FAULT:
                self.enact(self.platform.fault(payload[0], payload[1], time_s), time_s)
            elif kind == TIMER:
                intents = payload(time_s)  # (a component's own event: it may return intents)
                if intents:
                    self.enact(intents, time_s)
            elif kind == AFTER_DECISIONS:
                payload(time_s)
            else:
                payload.schedule_pending = False
                if not payload.busy:
                    self._start(payload, time_s)

    def _count_progress(self, progress):
        """Count ended requests and completed steps for ``progress`` through wrappers set on this
        engine only while ``run`` reports (so that without a callback the loop pays nothing), and
        return ``report(now_s)``, which calls ``progress(now_s, ended, total)``."""
        total = len(self.requests)
        counts = [0, 0]  # requests ended, steps completed since the last report
        ended, complete = self.ended, self._complete

        def counted_ended(req: Request, now: float) -> None:
            counts[0] += 1
            ended(req, now)

        def counted_complete(replica: Replica, now: float) -> None:
            complete(replica, now)
            counts[1] += 1
            if counts[1] >= PROGRESS_STEPS:
                counts[1] = 0
                progress(now, counts[0], total)

        self.ended, self._complete = counted_ended, counted_complete
        return lambda now: progress(now, counts[0], total)

    def _request_schedule(self, replica: Replica, time_s: float) -> None:
        """Consult the policy at ``time_s`` once every arrival and completion at that time is in."""
        if replica.schedule_pending:
            return
        heap, i = self.heap, self.next_arrival
        if (not heap or heap[0][0] > time_s) and (i >= len(self.arrivals) or self.arrivals[i].arrival_s > time_s):
            self._start(replica, time_s)  # nothing else happens at this instant: decide now
        else:
            replica.schedule_pending = True
            self.push(time_s, SCHEDULE, replica)

    # -- arrivals -------------------------------------------------------------------------------
    def _arrive(self, req: Request, now: float) -> None:
        # arrival_s is already the arrival (trace, closed-loop turn, or the original one of a retry)
        if self.platform is not None:
            intents = self.platform.arrive(req, now)  # None: it goes on; else what the front door wants instead
            if intents is not None:
                if intents:  # (empty: it comes back later, or its client already gave up)
                    self.enact(intents, now)
                return
        if req.mm is not None and self.encode is not None:  # encoded first, routed when its embeddings land
            self.encode.arrive(req, now)
            return
        self._route(req, now)

    def _enter(self, req: Request, now: float) -> None:
        """``Enter``: ``req`` goes on past the front door (``_arrive``'s path after the platform's check)."""
        if req.mm is not None and self.encode is not None:
            self.encode.arrive(req, now)
            return
        self._route(req, now)

    def _route(self, req: Request, now: float) -> None:
        live = self.live
        if not live:
            self.platform.orphan(req)
            return
        router = self.router
        if len(live) == 1 or not router.reads_progress:
            replica = router.route(req, live)
        else:  # (its look at the replicas' progress as one iteration at a time has it)
            replica = route_at(router, req, live, now)
        req.replica = replica.id
        if self.retention is not None:
            self.retention.routed(replica, req)
        kv = replica.kv
        context = replica.config.max_model_len
        if context is not None and req.prompt_tokens + req.max_output_tokens > context:
            reason = (f"prompt {req.prompt_tokens} + max output {req.max_output_tokens} tokens exceed max_model_len "
                      f"{context} (vLLM answers 400)")
        elif not kv.can_ever_fit(req):
            reason = f"needs {kv.blocks_to_finish(req)} KV blocks for prompt + max output; a replica has {kv.total}"
        else:
            reason = replica.policy.reject_reason(req)
        if reason is not None:
            self.end(req, Status.REJECTED, reason, now)
            return
        req.status = Status.WAITING
        replica.owe(req)
        if self.platform is not None and self.platform.hold(replica, req, now):
            return
        replica.waiting.append(req)
        replica.policy.on_arrival(req, replica)
        later = 0
        if replica.config.async_scheduling:  # (read from the replica: one more engine attribute slows them all)
            # the scheduler learns of it now, not at arrival_s: a retry or an encoded request comes later; the step
            # after the one under way is already picked, so the decision that can take it is the one after that
            req.queued_s = replica.last_arrival_s = now
            later = 1
            if self.platform is not None and self.platform.counts_queue:
                later = 0  # a pause rule counts the queue before each decision, requests not seen yet included
        if replica.busy:
            self._cut_stretch(replica, now, later)
        else:
            self._request_schedule(replica, now)

    def route_all(self, reqs: list[Request], now: float) -> None:
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

    def after_decisions(self, time_s: float, fn) -> None:
        """Call ``fn(time_s)`` once every decision at ``time_s`` is taken (replay/core/lockstep.py)."""
        self.push(time_s, AFTER_DECISIONS, fn)

    def retime(self, replica: Replica, end_s: float) -> None:
        """``replica``'s step in flight now ends at ``end_s`` (its ``end_s`` already set): its earlier
        completion event goes stale."""
        replica.step_token += 1
        self.push(end_s, STEP_DONE, (replica, replica.step_token))

    def schedule_at(self, replica: Replica, time_s: float) -> None:
        """Consult ``replica``'s policy at ``time_s`` (later than now)."""
        if not replica.schedule_pending:
            replica.schedule_pending = True
            self.push(time_s, SCHEDULE, replica)

    def _cut_stretch(self, replica: Replica, now: float, later: int = 0) -> None:
        """End the in-flight decode stretch at the first iteration boundary at or after ``now`` (``later``
        boundaries after that one)."""
        step = replica.inflight
        if step.k == 1 or now >= step.end_s:
            return
        j = step._first_boundary_at_or_after(now) + later
        if j < step.k:
            step.end_s = step.start_s + step.elapsed(j)
            step.k = j
            replica.step_token += 1
            self.push(step.end_s, STEP_DONE, (replica, replica.step_token))

    # -- starting an iteration ----------------------------------------------------------------
    def _platform_decides(self, replica: Replica, now: float) -> float:
        """The platform's shedding, then its pausing, before ``replica``'s policy decides: each one's intents
        applied before the next looks (a pause counts the queue after the drops). Returns the swap-out
        seconds of the requests a pause preempted."""
        platform = self.platform
        if platform.shedding and replica.policy.sheds:
            self.enact(platform.shed(replica, now), now)
        if platform.pause is not None:
            intents = platform.check_pause(replica, now)
            if intents:
                return self.enact(intents, now)
        return 0.0

    def _start(self, replica: Replica, now: float) -> None:
        group = replica.group
        if group is not None and group.holds(replica, now):  # its DP ranks' step is in flight: decide at its end
            return
        replica.now_s = now
        swap_s = self._before_schedule(replica, now) if self._before_schedule is not None else 0.0
        if not replica.running and not replica.waiting:  # nothing to decide: it idles until work comes
            return
        if self.retention is not None:
            self.retention.before_schedule(replica)
        batch = self._decide_async(replica, now) if replica.config.async_scheduling else replica.policy.schedule(replica)
        for victim in batch.preempt:
            swap_s += self.preempt(replica, victim)
        if batch.wake_s is not None and batch.wake_s > now:
            replica.wake_s = batch.wake_s
        if not batch.items and not batch.bulk:
            replica.busy = False
            if batch.wake_s is not None and batch.wake_s > now:
                self.push(batch.wake_s, SCHEDULE, replica)
            elif batch.preempt and replica.waiting:
                self._request_schedule(replica, now)
            elif self.retention is not None and replica.waiting and not replica.running \
                    and self.retention.unstall(replica):
                self._request_schedule(replica, now)
            return
        kv = replica.kv
        items = [] if self.needs_items else None
        summary = batch.summary
        if summary is None or items is not None:
            summary = self._summarise(kv, batch, items)
        hits = summary.hits
        for req in summary.admit:
            swap_s += self._admit(replica, req, now, hits.get(req) if hits is not None else None)
        if summary.grow:
            kv.grow_all(summary.grow)
        if batch.bulk:
            replica.aggregate.start(summary.bulk_blocks)
        prefill_tokens, prefill_reqs = summary.prefill_tokens, summary.prefill_reqs
        prefill_ctx, pairs = summary.prefill_ctx, summary.pairs
        decode_reqs, decode_ctx = summary.decode_reqs, summary.decode_ctx
        all_decode = not batch.preempt and not prefill_reqs
        affine = replica.decode_affine(decode_reqs) if all_decode and items is None else None
        if replica.lora is not None:  # the adapters' shrink/expand kernels, the same in every iteration of a stretch
            lora_s = replica.runner.lora_step_s(*replica.lora.batch_work(batch.items))
            if affine is not None:
                affine = (affine[0] + lora_s, affine[1])
        if affine is not None:  # a pure-decode iteration: the runner promised a + b * C
            compute = affine[0] + affine[1] * decode_ctx
        else:
            shape = StepShape(prefill_tokens, prefill_reqs, prefill_ctx, pairs, decode_reqs, decode_ctx)
            if self.spec is not None:  # the drafts its decodes verify
                shape = self.spec.shape(shape, summary)
            compute = replica.runner.step_time(StepPlan(shape, tuple(items) if items else ()))
            if replica.lora is not None:
                compute += lora_s
        if kv.pending_load_s:  # KV loads from lower tiers overlapped layer by layer with this compute
            swap_s += kv.overlap_extra(compute)
        duration = compute + swap_s
        if not 0.0 < duration < math.inf:  # (nan fails both)
            raise ServelabError(f"runner {replica.runner.name} priced a step at {duration} s; steps must take > 0 s")
        step = Step(batch, now, now + duration, 1, prefill_tokens, prefill_reqs, decode_reqs,
                    len(replica.waiting), kv.used)
        if affine is not None and swap_s == 0.0 and group is None and not replica.holding:
            self._plan_stretch(replica, step, summary, affine)  # (not while a request waits to be seen)
        if replica.wake_s is not None and replica.wake_s > now:
            j = step._first_boundary_at_or_after(replica.wake_s)
            if j < step.k:
                step.end_s = now + step.elapsed(j)
                step.k = j
        replica.busy = True
        replica.inflight = step
        replica.step_token += 1
        self.seq += 1  # (self.push, inline: once per decision)
        heapq.heappush(self.heap, (step.end_s, STEP_DONE, self.seq, (replica, replica.step_token)))
        if group is not None:
            group.joined(replica, step, now)

    @staticmethod
    def _decide_async(replica: Replica, now: float) -> Batch:
        """The policy's decision under async scheduling: vLLM picked this step while the last one ran, so
        requests that came during that one's last iteration (waiting, or running with their KV landed then)
        wait for the next decision, unless nothing is running (then it decides at once)."""
        replica.visible_s = visible_s = replica.iter_start_s if replica.running and now == replica.step_end_s \
            else math.inf
        replica.holding = holding = visible_s < replica.last_arrival_s
        landed = None
        if holding and replica.landed_s > visible_s:  # out of the running set for this decision only
            landed = [req for req in replica.running if req.queued_s > visible_s]
            for req in landed:
                replica.running.remove(req)
        batch = replica.policy.schedule(replica)
        if landed:
            for req in landed:
                replica.running.append(req)
        if holding and not batch.items and not batch.bulk and not batch.preempt:
            replica.visible_s, replica.holding = math.inf, False  # nothing to run without them: taken now
            batch = replica.policy.schedule(replica)
        return batch

    @staticmethod
    def _summarise(kv: KVManager, batch: Batch, items: list | None) -> BatchSummary:
        """Count a batch that was built without BatchBuilder (or whose runner needs the items)."""
        summary = BatchSummary()
        for req, n in batch.items:
            hit = kv.lookup(req) if req.status is Status.WAITING else None
            start = req.num_computed_tokens
            if hit is not None and hit.tokens + n <= req.num_tokens:  # admitted onto a cached prefix
                target = -(-(hit.tokens + n) // kv.block_size) if kv.layout is None else kv.layout.held(hit.tokens, n)
                summary.account(req, n, target - hit.blocks + hit.claimed, hit, target)
                start = hit.tokens
            else:
                summary.account(req, n, kv.blocks_needed(req, n))
            if items is not None:
                items.append(StepItem(req, start, n))
        return summary

    def _plan_stretch(self, replica: Replica, step: Step, summary: BatchSummary, affine: tuple[float, float]) -> None:
        """Make ``step`` (a pure-decode iteration) a stretch of as many identical iterations as surely hold."""
        k = summary.min_decode_left
        if step.batch.repeat is not None:
            k = min(k, step.batch.repeat)
        if k <= 1:
            return
        kv = replica.kv
        if not kv.reserve and kv.total - kv.used < step.decode_requests * (k // kv.block_size + 2):
            # not surely enough free blocks for k more tokens each: find how many iterations fit
            k = self._kv_safe_iterations(replica, step.batch, k, kv.total - kv.used)
            if k <= 1:
                return
        min_free = summary.min_free
        if self.platform is not None and self.platform.pause is not None:  # (a KV-share pause rule: its bound)
            min_free = max(min_free, self.platform.stretch_min_free(replica))
        if min_free:  # the decisions inside it are this one only while that many blocks stay free
            room = kv.total - kv.used - min_free
            if room < 0:
                return
            if not kv.reserve and room < step.decode_requests * ((k - 1) // kv.block_size + 2):
                k = 1 + self._kv_safe_iterations(replica, step.batch, k - 1, room)
        step.a, step.b = affine
        step.ctx0 = summary.decode_ctx
        step.k = k
        step.end_s = step.start_s + step.elapsed(k)

    @staticmethod
    def _kv_safe_iterations(replica: Replica, batch: Batch, k: int, free: int) -> int:
        """Largest j <= k such that every request's next j tokens take at most ``free`` more blocks."""
        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks_to_grow(replica, batch, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _admit(self, replica: Replica, req: Request, now: float, hit) -> float:
        """``req`` leaves the waiting queue for the running set (onto a cached prefix: ``hit``);
        returns its swap-in seconds."""
        replica.waiting.remove(req)
        req.status = Status.RUNNING
        if self.platform is not None:
            self.platform.admitted(replica, req)
        self.admissions += 1
        req.admitted_seq = self.admissions
        replica.running.append(req)
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now
        load_s = 0.0
        if hit is not None:  # the cached prefix counts as computed (loaded first from lower tiers, if there)
            load_s = replica.kv.claim(req, hit)
            req.num_computed_tokens = hit.tokens
            req.num_cached_tokens += hit.tokens
        if req.lora_adapter is not None and replica.lora is not None:  # its adapter into a GPU slot, if not there
            load_s += replica.lora.activate(req.lora_adapter, replica.running)
        if req.mm is not None and replica.encoder is not None:  # its images, video, audio through the encoder
            load_s += replica.encoder.admit(req)
        if self.retention is not None:
            self.retention.admitted(req)
        if req.swapped:  # bring the KV back from host memory
            return load_s + replica.kv.swap_in(req)
        return load_s

    def preempt(self, replica: Replica, req: Request) -> float:
        """Take ``req`` off the GPU; returns the swap-out time it adds to this iteration."""
        kv = replica.kv
        cost = kv.swap_out(req)
        if cost is None:  # recompute: its KV is gone (but may stay cached for its return)
            if kv.swap:
                self.num_swap_fallbacks += 1
            kv.release(req, may_return=True)
            before = owed(req)
            self.journal.interrupt(req)  # keeps its generated tokens, or it starts over
            replica.outstanding_tokens += owed(req) - before
            cost = 0.0
        req.status = Status.WAITING
        req.num_preemptions += 1
        replica.running.remove(req)
        replica.waiting.appendleft(req)
        if self.platform is not None:
            self.platform.requeued(replica, req)
        replica.policy.on_requeue(req, replica)
        return cost

    # -- completing an iteration --------------------------------------------------------------
    def _complete(self, replica: Replica, now: float) -> None:
        step = replica.inflight
        if replica.config.async_scheduling:
            replica.iter_start_s = step.start_s + step.elapsed(step.k - 1)
            replica.step_end_s = now
        self.apply(replica, step, step.k, now)
        replica.busy = False
        replica.inflight = None
        if replica.wake_s is not None and replica.wake_s <= now:
            replica.wake_s = None
        self._request_schedule(replica, now)

    def apply(self, replica: Replica, step: Step, j: int, end_s: float) -> None:
        """Apply ``j`` completed iterations of ``step`` ending at ``end_s``."""
        batch = step.batch
        items = batch.items
        finished = ()
        if batch.bulk:  # the requests the builder kept in aggregate: one update, then its finishers
            finished = replica.aggregate.apply(step, j, end_s)
            for req in finished:
                self._finish(replica, req, end_s)
        if items:
            if step.k == 1:
                if self.spec is None:
                    produced, done = apply_iteration(items, end_s, self.tokens, replica.kv.register)
                else:  # decodes advance by their accepted drafts too
                    produced, done = self.spec.apply(items, batch.summary, end_s, self.tokens, replica.kv.register)
                if replica.kv.layout is not None:  # sliding-window groups free what left the window
                    replica.kv.slide(items)
            else:  # a decode stretch: every item produced j tokens
                produced, done = j * len(items), apply_stretch(items, step, j, end_s, replica.kv, self.tokens)
            replica.outstanding_tokens -= produced
            for req in done:
                self._finish(replica, req, end_s)
            if replica.aggregate is not None:
                replica.aggregate.after(items, end_s)
            if done:
                finished = [*finished, *done]
        policy = replica.policy
        policy.on_step(batch, j)
        for req in finished:
            policy.on_finish(req, replica)
        self.steps.append((
            replica.id, step.start_s, end_s - step.start_s, j, step.prefill_tokens, step.prefill_requests,
            step.decode_requests, len(items) + batch.bulk, step.kv_used, replica.kv.total, step.waiting,
            len(batch.preempt), replica.kv.tier_bytes() if replica.kv.tier_stack is not None else None,
        ))
        for listener in self.step_listeners:
            intents = listener(replica, step, end_s)
            if intents:
                self.enact(intents, end_s)

    def _finish(self, replica: Replica, req: Request, now: float) -> None:
        if req.status is Status.ABORTED:  # its client gave up while this step ran: it leaves, unfinished
            self.enact(self.aborts.release(replica, req, now, finished=True), now)
            return
        req.status = Status.FINISHED
        req.finish_s = now
        if self.retention is None or not self.retention.finish(replica, req, now):
            replica.kv.release(req)
        replica.running.remove(req)
        self.ended(req, now)

    # -- the request lifecycle: with the verbs above (_route, _admit, preempt, _finish), the only code
    # -- that changes a request's status; the cluster and the platform ask these -------------------
    def end(self, req: Request, status: Status, reason: str, now: float) -> None:
        """``req`` leaves unserved for good at ``now``: ``status`` is REJECTED (it can never be served),
        THROTTLED (its quota refused it and its retries ran out), DROPPED (shed), ABORTED (its
        client gave up: replay/platform/abort.py) or SKIPPED (never sent: a request it depends on ended
        unserved, replay/core/depends.py). A request that waited on a replica has been taken off it first."""
        req.status = status
        req.reason = reason
        self.ended(req, now)

    def send_at(self, req: Request, arrival_s: float) -> None:
        """``req``, whose arrival the replay decides (a closed-loop turn, a dependent request), arrives at
        ``arrival_s``; its client's timeout runs from then."""
        req.arrival_s = arrival_s
        self.push(arrival_s, ARRIVAL, req)
        if self.aborts is not None:
            self.aborts.arm(req)

    def interrupt(self, req: Request) -> None:
        """``req`` lost its KV with its replica (a failure, a reclaimed instance, KV in transfer lost):
        the journal's rule applies (it keeps its generated tokens, or starts over) and it is routed
        again, as if not arrived yet."""
        self.journal.interrupt(req)
        req.status = Status.PENDING

    def strand(self, reqs, reason: str | None = None) -> None:
        """The replay ends with ``reqs`` not served: those not terminal are ``unfinished`` (``reason``:
        why, when it is not the horizon)."""
        for req in reqs:
            if not req.status.is_terminal:
                req.status = Status.UNFINISHED
                if reason is not None:
                    req.reason = reason

    def truncate(self, replica: Replica, now: float) -> float:
        """Stop ``replica``'s in-flight step at ``now`` (the horizon, or the replica lost): iterations of
        a decode stretch finished by ``now`` are applied, the one under way is not. Returns the
        seconds of work lost (``now`` minus the end of the last finished iteration; 0 when idle)."""
        step = replica.inflight
        if step is None:
            return 0.0
        j = step.iterations_done_by(now)
        done_s = step.start_s + step.elapsed(j)
        if j:
            step.k = j
            self.apply(replica, step, j, done_s)
        replica.inflight = None
        replica.busy = False
        replica.step_token += 1  # (its completion event, still in the heap, is stale)
        return now - done_s

    # -- queue moves: with _route, _admit, preempt and _finish, the only code that moves a request in or
    # -- out of a replica's queues; the cluster and the platform ask these -------------------------
    def take_off(self, replica: Replica, req: Request) -> None:
        """``TakeOff``: ``req`` leaves ``replica``'s waiting queue for good without the policy's decision (a
        drop, a client's abort), owing and holding nothing there; the policy hears it (``on_leave``)."""
        replica.waiting.remove(req)
        replica.policy.on_leave(req, replica)
        replica.forgive(req)
        if req.swapped:
            replica.kv.drop_host(req)
        replica.kv.forget(req)  # (a purged tenant's cached blocks)

    def let_go(self, replica: Replica, req: Request) -> None:
        """``req`` leaves ``replica``'s running set outside an iteration (its client gave up): what it
        still owes is forgiven and its blocks are freed, as for a finishing request (``_finish``)."""
        make_current(replica, req)  # its counters and blocks its own, if the builder kept them in aggregate
        replica.forgive(req)
        replica.kv.release(req)
        replica.running.remove(req)

    def hand_off(self, replica: Replica, req: Request) -> None:
        """``req`` (its first token made) leaves prefill replica ``replica`` for a decode replica, its
        KV held there until sent (replay/cluster/disagg.py); the policy hears it (``on_leave``)."""
        replica.running.remove(req)
        replica.forgive(req)
        replica.policy.on_leave(req, replica)

    def land(self, target: Replica, req: Request) -> None:
        """``req``'s KV has landed on decode replica ``target``: it joins the running set as if admitted
        now. The policy sets up its own per-request state (``on_arrival``) and takes it straight back
        out of its waiting order (``on_leave``): the request runs without queueing."""
        req.replica = target.id
        self.admissions += 1
        req.admitted_seq = self.admissions
        policy = target.policy
        policy.on_arrival(req, target)
        policy.on_leave(req, target)
        target.running.append(req)
        if target.config.async_scheduling:  # news to a scheduler that picked the next step already: it runs
            req.queued_s = target.last_arrival_s = target.landed_s = self.now_s  # in the one after (_decide_async)

    def set_aside(self, replica: Replica, which) -> list[Request]:
        """Take the waiting requests for which ``which(req)`` holds off ``replica``'s queue, in their order
        (a paused tier: replay/platform/hooks.py); the policy hears each (``on_leave``). Returns them."""
        held: list[Request] = []
        keep = []
        for req in replica.waiting:
            if which(req):
                replica.policy.on_leave(req, replica)
                held.append(req)
            else:
                keep.append(req)
        replica.waiting.clear()
        replica.waiting.extend(keep)
        return held

    def resume(self, replica: Replica, req: Request) -> None:
        """A request set aside queues again on ``replica``, at the back; the policy hears it (``on_arrival``)."""
        replica.waiting.append(req)
        replica.policy.on_arrival(req, replica)

    def evict(self, replica: Replica, now: float) -> None:
        """``replica`` has stopped serving at ``now`` (failed: ``fail``; or its instance reclaimed: its fleet
        no longer wants it): the iteration under way is lost and every request on it (running, waiting, or
        held by the platform while its tier is paused) loses its KV and is routed again (the journal's rule).

        With prefill/decode pools (the platform's ``disagg``) the requests whose KV it held for a transfer,
        or that were landing on it, lose that KV too (``Disaggregation.lose``), and every one goes to the
        prefill pool's router (the live replicas): it re-prefills and is handed off again."""
        platform = self.platform
        disagg = platform.disagg
        if disagg is not None:
            disagg.stop(replica)
        # iterations finished by now count; the one under way is lost
        work_lost_s = self.truncate(replica, now) if replica.inflight is not None else None
        no_aggregate(replica)  # every counter of what it held current before it moves, and from now on
        moved = list(replica.running) + list(replica.waiting) + platform.take_held(replica)
        lost = disagg.lose(replica, now) if disagg is not None else ()
        self.empty(replica)  # GPU blocks and the host swap pool alike; its queues emptied
        replica.outstanding_tokens = 0
        replica.wake_s = None
        journal = self.journal
        before = (journal.requests_interrupted, journal.tokens_lost, journal.tokens_recomputed)
        if self.aborts is not None:  # aborted inside the lost iteration: it ended at its deadline, stays ended
            for req in [r for r in moved if r.status.is_terminal]:
                replica.policy.on_leave(req, replica)
                moved.remove(req)
        for req in moved:
            replica.policy.on_leave(req, replica)
            platform.moved(req, now)
            self.interrupt(req)
        if disagg is not None:
            disagg.lost_running(replica, moved)
            for req in lost:  # (they had left their prefill replica's policy when handed off)
                self.interrupt(req)
            moved += lost
        platform.lost(work_lost_s, len(moved), journal.requests_interrupted - before[0],
                      journal.tokens_lost - before[1], journal.tokens_recomputed - before[2])
        self.route_all(moved, now)
        if disagg is not None:
            disagg.place_pending(now)  # (landing blocks freed on decode replicas)

    def empty(self, replica: Replica) -> None:
        """``replica`` stopped serving (failed, reclaimed): its GPU and host KV are gone and its queues
        are emptied (``evict`` moved what they held)."""
        replica.kv.fail(replica.running)  # GPU blocks and the host swap pool alike
        replica.running = []
        replica.waiting.clear()

    # -- replica membership: the only code that changes which replicas take work -------------------
    def add_pool(self, role: str, replicas: list[Replica], on_serving) -> None:
        """``replicas`` form the pool ``role`` (not the arrivals'), all wanted at first; ``on_serving(live,
        grew)`` hears when its serving replicas change (``grew``: some may have joined)."""
        self.wanted[role] = list(replicas)
        self.on_serving[role] = on_serving
        for r in replicas:
            self.role[r.id] = role

    def publish(self, role: str, replicas: list[Replica]) -> None:
        """The replicas of pool ``role`` its controller wants serving from now on."""
        self.wanted[role] = replicas
        self._serve(role, grew=True)

    def fail(self, replica: Replica, now: float) -> None:
        """``replica`` goes down at ``now``: it takes no new work until ``restore``, and its pool's
        controller hears it (an autoscaler counts it out, a fleet refills) before the platform moves
        what it held (``evict``), so that the moved requests can land on a replacement."""
        self.down.add(replica.id)
        self._serve(self.role.get(replica.id, ENTRY), grew=False)
        for listener in self.on_failed:
            intents = listener(replica, now)
            if intents:
                self.enact(intents, now)

    def restore(self, replica: Replica) -> str:
        """``replica`` is back: it serves again if its pool still wants it. Returns its pool."""
        self.down.discard(replica.id)
        role = self.role.get(replica.id, ENTRY)
        self._serve(role, grew=True)
        return role

    def _serve(self, role: str, grew: bool) -> None:
        down = self.down
        live = [r for r in self.wanted[role] if r.id not in down] if down else list(self.wanted[role])
        if role == ENTRY:
            self.live = live
        else:
            self.on_serving[role](live, grew)

    # -- intents: what the cluster and the platform want (replay/core/intents.py), applied here only -------
    def enact(self, intents, now: float) -> float:
        """Apply ``intents`` at ``now``, in their order: the one way the handoff, autoscalers, fleets, failures,
        the encode pool, the platform's front door, shedding and pausing, and client timeouts change a
        request's status, the replicas' queues or which replicas serve (they return what they want from the
        engine's calls: step listeners, hooks, timed events, failures). Returns the swap-out seconds of the
        requests preempted (``Preempt``: a pause before a decision), which that decision's iteration adds."""
        swap_s = 0.0
        for intent in intents:
            kind = type(intent)
            if kind is HandOff:
                self.hand_off(intent.replica, intent.req)
            elif kind is Land:
                self.land(intent.replica, intent.req)
                self._wake(intent.replica, now, 1 if intent.replica.config.async_scheduling else 0)
            elif kind is Wake:
                self._wake(intent.replica, now)
            elif kind is Enter:
                self._enter(intent.req, now)
            elif kind is Refuse:
                self.ledger.refused_s[intent.req.index] = now
                self.end(intent.req, intent.status, intent.reason, now)
            elif kind is TakeOff:
                self.take_off(intent.replica, intent.req)
            elif kind is LetGo:
                self.let_go(intent.replica, intent.req)
                if intent.tell_policy:
                    intent.replica.policy.on_finish(intent.req, intent.replica)
                if intent.first_token_unseen:
                    intent.req.first_token_s = None
            elif kind is LeaveAtBoundary:
                self._leave_at_boundary(intent.replica, intent.req, now)
            elif kind is Decide:
                replica = intent.replica
                if not replica.busy and (replica.waiting or replica.running):
                    self._request_schedule(replica, now)
            elif kind is Unhold:
                intent.replica.forgive(intent.req)
            elif kind is Preempt:
                swap_s += self.preempt(intent.replica, intent.req)
            elif kind is SetAside:
                self.platform.held(intent.replica, self.set_aside(intent.replica, intent.which), now)
            elif kind is Resume:
                for req in intent.reqs:
                    self.resume(intent.replica, req)
            elif kind is Strand:
                self.strand(intent.reqs, intent.reason)
            elif kind is Send:
                self.send_at(intent.req, intent.arrival_s)
            elif kind is Skip:
                self.end(intent.req, Status.SKIPPED, intent.reason, now)
            elif kind is Serve:
                self.publish(intent.pool, list(intent.replicas))
            elif kind is Reject:
                self.end(intent.req, Status.REJECTED, intent.reason, now)
            elif kind is Route:
                self.route_all(list(intent.reqs), now)
            elif kind is AdoptOrphans:
                if self.platform is not None and self.platform.orphans and self.live:
                    self.route_all(self.platform.take_orphans(), now)
            elif kind is FailReplica:
                self.fail(intent.replica, now)  # (its pool's controller counts it out before its requests move)
                self.evict(intent.replica, now)
            elif kind is RemoveReplica:
                self.evict(intent.replica, now)
            elif kind is RestoreReplica:
                if self.restore(intent.replica) == ENTRY:  # (a decode replica's return routes no orphans)
                    self.route_all(self.platform.take_orphans(), now)
            else:
                raise ServelabError(f"the engine cannot enact {intent!r}")
        return swap_s

    def _leave_at_boundary(self, replica: Replica, req: Request, now: float) -> None:
        """``LeaveAtBoundary``: cut ``replica``'s stretch at the first boundary at or after ``now``; the client
        timeouts let ``req`` go at its end (a timed event after that step's completion at the same time)."""
        self._cut_stretch(replica, now)
        aborts = self.aborts
        self.push(replica.inflight.end_s, TIMER, lambda t: aborts.release(replica, req, t))

    def _wake(self, replica: Replica, now: float, later: int = 0) -> None:
        """``replica`` has new work at ``now``: a busy one stops its stretch at the next iteration boundary (``later``
        boundaries after it), an idle one decides after every other event of this instant (a SCHEDULE event comes
        after the TIMERs)."""
        if replica.busy:
            self._cut_stretch(replica, now, later)
        elif not replica.schedule_pending:
            replica.schedule_pending = True
            self.push(now, SCHEDULE, replica)

    def ended(self, req: Request, now: float) -> None:
        """A request reached a terminal state: release its session's next turn, if any, and its dependents."""
        if self.platform is not None:
            self.platform.ended(req, now)
        if self.depends is not None:
            intents = self.depends.ended(req, now)
            if intents:
                self.enact(intents, now)
        if self.retention is not None:
            self.retention.ended(req)
        follower = self.followers.get(req.index)
        if follower is not None:
            follower.arrival_s = now + (follower.think_s or 0.0)
            self.push(follower.arrival_s, ARRIVAL, follower)
            if self.aborts is not None:
                self.aborts.arm(follower)

    # -- horizon --------------------------------------------------------------------------------
    def _stop_at_horizon(self, until: float) -> None:
        for replica in self.replicas:
            self.truncate(replica, until)  # (a decode stretch partly done by the horizon counts so far)
        self.strand(self.requests)


def route_at(router: Router, req: Request, replicas: list[Replica], now: float) -> Replica:
    """``router``'s pick for ``req`` among ``replicas`` at ``now``, each replica's outstanding tokens (and, for
    a router that reads KV use, its used KV blocks) as one iteration at a time would have them. A decode
    stretch subtracts what it produced, and grows its requests' KV, when it completes; for the iterations of
    one in flight that ended before ``now`` (an arrival at a boundary comes before that iteration's
    completion) the tokens are taken off, and the blocks the next iteration's decision would hold put on,
    for the router's look and undone after."""
    lent = None
    kv_too = router.reads_kv
    for replica in replicas:
        step = replica.inflight
        if step is not None and step.k > 1:
            done = step._first_boundary_at_or_after(now) - 1
            if done > 0:
                if lent is None:
                    lent = []
                produced = done * step.decode_requests
                grown = max(blocks_to_grow(replica, step.batch, done + 1), 0) \
                    if kv_too and not replica.kv.reserve else 0
                replica.outstanding_tokens -= produced
                replica.kv.used += grown
                lent.append((replica, produced, grown))
    if lent is None:
        return router.route(req, replicas)
    try:
        return router.route(req, replicas)
    finally:
        for replica, produced, grown in lent:
            replica.outstanding_tokens += produced
            replica.kv.used -= grown


def _no_affine(num_seqs: int) -> None:
    """A replica's decode cost line under speculative decoding: none (every step is priced alone)."""
    return None
