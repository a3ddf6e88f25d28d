"""A replica's decoding requests kept as one aggregate, so an event costs O(1), not O(batch).

Between events every decoding request of a decode-first policy (sarathi, orca) gains exactly one
token per iteration. The cohort counts those iterations once (``d``) instead of visiting each
member: a member's counters are frozen when it joins (at cohort iteration ``mark``) and read
lazily as ``frozen + (d - mark)``. What the engine and the policy need per iteration comes from
running aggregates:

- decode context ``sum(c + 1)``: ``ctx_base + n * (d + 1)`` with ``ctx_base = sum(c_join - mark)``;
- who finishes first: a heap keyed by the cohort iteration at which each member is done;
- KV blocks: members hold ``ceil(c / block_size)`` blocks, and ``c mod block_size`` shifts by one
  per iteration for all of them, so a histogram of residues gives the blocks any ``j`` more
  iterations add (O(block_size), not O(members));
- the longest inter-token gap: each applied run of iterations logs its largest gap; a member's
  ``max_itl_s`` is the largest logged since it joined (a suffix maximum kept as a monotonic stack).

A member's fields are real again (``materialize``) before anything else reads them: when it
finishes, when its policy preempts it (``remove``, through ``BatchBuilder.preempt``), when the policy
cannot take the whole cohort into a batch (``dissolve``; then the policy walks the requests one by
one as usual), and at the end of the replay. The cohort is an optimisation only: a run with cohorts
and one without are byte-identical (tested).

Who knows it exists: this file and the batch builder (replay/core/batch.py), nothing else. A policy only
promises the builder how it reads running requests (``batch.ReadsRunning``) and sees the members as
``Batch.bulk`` (how many decode besides ``items``, counted per class in ``Batch.bulk_by_class``); the
engine drives ``replica.aggregate`` through an iteration with three calls (``start``, ``apply``,
``after``) and sees the replica's running list, which keeps the cohort's ``outside`` in step
(``Running``); everything else asks batch.py (tests/test_lifecycle_owner.py holds this).

With the token log (``--token-log``) the cohort logs each applied run of iterations once (its
*timeline*: ``TokenLog.advance``) and each member's tokens as one record when its counters are made
real (``TokenLog.membership``): where in the timeline they start and how many; the log expands them
at the end into the rows the per-request path would have written.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from typing import TYPE_CHECKING, Sequence

from servelab.replay.core.progress import emit
from servelab.replay.core.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.core.logs import TokenLog
    from servelab.replay.core.replica import Replica
    from servelab.replay.core.step import Step


class DecodeCohort:
    __slots__ = ("replica", "kv", "token_budget", "seq_budget", "cap", "group", "left", "may_join", "groups", "bs", "reserve", "n", "d", "ctx_base", "heap", "residues",
                 "gap_starts", "gap_max", "last_end_s", "outside", "newest", "tokens", "timeline", "base")

    def __init__(self, replica: "Replica", token_budget: int, seq_budget: int,
                 group=None, left=None, tokens: TokenLog | None = None, may_join=None):
        self.replica = replica
        self.kv = replica.kv
        self.token_budget = token_budget  # the budgets the replica's policy builds every batch from
        self.seq_budget = seq_budget
        self.cap = min(token_budget, seq_budget)  # running requests a decision can give a token each
        self.group = group  # the policy's ReadsRunning.by_class: members are counted per key (None: not counted)
        self.left = left  # its ReadsRunning.settled: told when a member's counters are real again
        self.may_join = may_join  # its ReadsRunning.may_bulk: False keeps a request outside for now
        self.bs = replica.kv.block_size
        self.reserve = replica.kv.reserve  # blocks fixed at admission: decodes never need new ones
        self.outside: list[Request] = []  # running requests not in the cohort, in running order
        self.tokens = tokens  # the token log, or None
        self.timeline = tokens.timeline() if tokens is not None else None  # its number there
        self.base = 0  # iterations run before the last reset (``d`` restarts at 0; timeline positions do not)
        self._reset()

    def _reset(self) -> None:
        self.n = 0
        self.d = 0
        self.ctx_base = 0
        self.heap: list[tuple[int, int, Request]] = []  # (cohort iteration it finishes at, admitted_seq, req)
        self.residues = [0] * self.bs  # members by (c_join - mark) mod block_size
        self.gap_starts: list[int] = []  # monotonic stack: cohort iteration each logged run began at ...
        self.gap_max: list[float] = []  # ... and its largest gap (strictly decreasing bottom to top)
        self.last_end_s = 0.0
        self.groups: dict = {}  # cohort_group key -> members
        self.newest = 0  # the largest admitted_seq any member has had since the reset (it may have left)

    # -- what the engine calls (through ``replica.aggregate``) ---------------------------------
    def start(self, blocks: int) -> None:
        """A decision took the cohort whole (``Batch.bulk``): its members' next token takes ``blocks``
        more KV blocks, now (``BatchSummary.bulk_blocks``)."""
        if blocks:
            self.kv.grow_aggregate(blocks)

    def apply(self, step: "Step", j: int, end_s: float) -> Sequence[Request]:
        """The cohort's share of ``j`` applied iterations of ``step``: one aggregate update; returns the
        members it finished (made real, in admission order) for the engine to finish."""
        replica = self.replica
        if step.k == 1:
            gap = end_s - self.last_end_s
        else:  # as for each request of a stretch: the first gap or the last, whichever is longer
            first_end, last_gap = step.gap_bounds(j)
            gap = max(first_end - self.last_end_s, last_gap)
            more = self.blocks_added(j) - step.batch.summary.bulk_blocks  # (the first's: taken at start)
            if more:
                self.kv.grow_aggregate(more)
        replica.outstanding_tokens -= j * step.batch.bulk
        return self.advance(j, gap, end_s, step)

    def after(self, items, end_s: float) -> None:
        """Requests of ``items`` that emitted a token at ``end_s`` and whose next token is a decode join
        (a recompute chunk can stop just short of a token: that request joins after emitting it), if
        the policy lets them (``may_join``)."""
        running = Status.RUNNING
        may_join = self.may_join
        for req, _ in items:
            if (req.last_token_s == end_s and req.status is running
                    and req.num_computed_tokens == req.prompt_tokens + req.num_generated_tokens - 1
                    and (may_join is None or may_join(req))):
                self.join(req)

    # -- membership ---------------------------------------------------------------------------
    def join(self, req: Request) -> None:
        """``req`` (running, its next token a decode) becomes a member; its counters freeze."""
        self.outside.remove(req)
        d = self.d
        if not self.n:
            self.last_end_s = req.last_token_s
        req.aggregate_mark = d
        self.n += 1
        if req.admitted_seq > self.newest:
            self.newest = req.admitted_seq
        c = req.num_computed_tokens
        self.ctx_base += c - d
        if not self.reserve:
            self.residues[(c - d) % self.bs] += 1
        heapq.heappush(self.heap, (d + req.output_tokens - req.num_generated_tokens, req.admitted_seq, req))
        if self.group is not None:
            key = self.group(req)
            self.groups[key] = self.groups.get(key, 0) + 1

    def materialize(self, req: Request) -> None:
        """Write ``req``'s true counters back; it stays running but is no longer a member."""
        delta = self.d - req.aggregate_mark
        if delta:
            if self.tokens is not None:
                self.tokens.membership(req.request_id, req.num_generated_tokens + 1, delta, self.timeline,
                                       self.base + req.aggregate_mark)
            c = req.num_computed_tokens = req.num_computed_tokens + delta
            i = bisect_left(self.gap_starts, req.aggregate_mark)
            emit(req, delta, self.last_end_s, self.gap_max[i] if i < len(self.gap_max) else None)
            if not self.reserve:
                self.kv.settle(req, -(-c // self.bs))
        req.aggregate_mark = None
        if self.left is not None:
            self.left(req)

    def remove(self, req: Request) -> None:
        """A member leaves before it is done (its policy preempts it; ``BatchBuilder.preempt``): its
        counters are made real and it runs outside the cohort until the engine preempts it. Its heap
        entry stays behind, dead, and is skipped when it comes up (``_live``)."""
        self._leave(req)
        self.outside.append(req)

    def dissolve(self) -> None:
        """Every member back to per-request bookkeeping (the policy must walk them one by one)."""
        if not self.n:
            return
        for entry in self.heap:
            if _live(entry):
                self.materialize(entry[2])
        self.outside = list(self.replica.running)
        self.base += self.d
        self._reset()

    def fits(self) -> bool:
        """Would the policy's decode-first walk of the running requests, starting from its builder's
        budgets, surely give every member its next token, with nothing to preempt? If not, the engine
        dissolves the cohort before the policy decides, and the policy walks its members one by one."""
        outside = self.outside
        if self.n + len(outside) > self.cap:
            return False
        kv = self.kv
        room = kv.total - kv.used - (0 if self.reserve else self.residues[-self.d % self.bs])  # free - next_iteration()[0]
        if not outside:  # the usual case: every running request decodes
            return room >= 0
        tokens = self.token_budget
        blocks_needed = kv.blocks_needed
        for req in outside:  # at most what each can take: then no preemption can follow
            left = req.prompt_tokens + req.num_generated_tokens - req.num_computed_tokens
            room -= blocks_needed(req, left if left < tokens else tokens)
        return room >= 0

    def leads(self, skip) -> bool:
        """Does every member come before every other running request (those in ``skip`` aside) in
        running order (= admission order)? Then a walk of the running requests in that order gives
        the members their tokens before the others theirs, as a decode-first walk does."""
        newest = self.newest
        for req in self.outside:
            if req.admitted_seq < newest and req not in skip:
                return False
        return True

    # -- what the next iterations need -----------------------------------------------------
    def next_iteration(self) -> tuple[int, int, int]:
        """What a decision that takes the cohort whole adds to its batch (asked every iteration): the KV
        blocks the members' next token needs (one for each member whose last block is full), the KV
        tokens their decode reads (sum of c + 1), and the fewest tokens any member still has to
        generate (dead heap entries on top are dropped first)."""
        heap = self.heap
        while not _live(heap[0]):
            heapq.heappop(heap)
        d = self.d
        return (0 if self.reserve else self.residues[-d % self.bs], self.ctx_base + self.n * (d + 1), heap[0][0] - d)

    def blocks_added(self, j: int) -> int:
        """KV blocks the members add over their next ``j`` tokens (on-demand allocation)."""
        if self.reserve or j <= 0:
            return 0
        bs = self.bs
        m, t = divmod(j, bs)
        extra = self.n * m
        if t:
            # A member at residue x = c mod bs crosses a block boundary in its last t tokens iff
            # x == 0 (its next token opens a block) or x > bs - t: x in bs-t+1 .. bs (mod bs), t
            # residues in a row. Members are kept by r = x - d (mod bs): a cyclic run from `first`.
            res = self.residues
            first = (1 - t - self.d) % bs
            end = first + t
            extra += sum(res[first:end]) if end <= bs else sum(res[first:]) + sum(res[:end - bs])
        return extra

    # -- applying iterations -----------------------------------------------------------------
    def advance(self, j: int, max_gap: float, end_s: float, step: Step | None = None) -> Sequence[Request]:
        """The members ran ``j`` more iterations (of ``step``: needed with a token log), the last
        ending at ``end_s``; returns (materialised) the members now done, in admission order."""
        if self.tokens is not None:
            self.tokens.advance(self.timeline, self.base + self.d, j, step, end_s)
        starts, maxima = self.gap_starts, self.gap_max
        while maxima and maxima[-1] <= max_gap:
            maxima.pop()
            starts.pop()
        starts.append(self.d)
        maxima.append(max_gap)
        d = self.d = self.d + j
        self.last_end_s = end_s
        heap = self.heap
        if heap[0][0] > d:
            return ()
        done = []
        while heap and heap[0][0] <= d:
            entry = heapq.heappop(heap)
            if _live(entry):
                done.append(entry[2])
        if not done:
            return ()
        if len(done) > 1:
            done.sort(key=_admitted)
        for req in done:
            self._leave(req)
        return done

    def _leave(self, req: Request) -> None:
        mark = req.aggregate_mark
        self.n -= 1
        c0 = req.num_computed_tokens
        self.ctx_base -= c0 - mark
        if not self.reserve:
            self.residues[(c0 - mark) % self.bs] -= 1
        if self.group is not None:
            self.groups[self.group(req)] -= 1
        self.materialize(req)
        if not self.n:  # empty again: no member can ask for the gap log (nor a dead entry be live)
            self.gap_starts.clear()
            self.gap_max.clear()
            self.heap.clear()


class Running(list):
    """A replica's running list while it has a cohort: appending and removing keep the cohort's
    ``outside`` (the running requests not in it) in step, so the code that moves requests in and out
    of the running set (the engine, the PD handoff, client timeouts) need not know the cohort."""

    __slots__ = ("cohort",)

    def __init__(self, items, cohort: DecodeCohort):
        super().__init__(items)
        self.cohort = cohort

    def append(self, req: Request) -> None:
        list.append(self, req)
        self.cohort.outside.append(req)

    def remove(self, req: Request) -> None:
        """``req`` leaves the running set. It is no member by then: a finishing member left the cohort
        when it finished (``advance``), a victim before its policy preempted it (``BatchBuilder.preempt``),
        an aborted one through ``batch.make_current``."""
        list.remove(self, req)
        outside = self.cohort.outside
        if req in outside:
            outside.remove(req)


def _live(entry: tuple[int, int, Request]) -> bool:
    """Is this heap entry its request's current membership? (A member that was removed and
    admitted again has a new ``admitted_seq``.)"""
    req = entry[2]
    return req.aggregate_mark is not None and req.admitted_seq == entry[1]


def _admitted(req: Request) -> int:
    return req.admitted_seq
