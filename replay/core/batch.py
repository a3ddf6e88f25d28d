"""A policy's decision for one iteration (`Batch`) and the budget keeper policies build it with.

`BatchBuilder` is admission, separate from ordering: a policy walks requests in its own order and
asks the builder to add them; the builder enforces the token budget, the sequence cap and KV fit,
and preempts victims (chosen by the policy's ``victim_key``) when a running request needs blocks.

The builder may keep a replica's decoding requests in aggregate across decisions (the decode cohort,
replay/core/cohort.py), so that an iteration costs O(1) rather than O(running requests): for a policy that
promises how it reads running requests (``ReadsRunning``), and where the engine allows it
(``aggregate_decodes``). Nothing outside this file and cohort.py sees the cohort: a policy sees
``Batch.bulk``, the engine ``replica.aggregate`` through a few calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from servelab.replay.core.cohort import DecodeCohort, Running
from servelab.replay.core.request import Request, Status

if TYPE_CHECKING:
    from servelab.replay.core.logs import TokenLog
    from servelab.replay.core.replica import Replica


class Batch(NamedTuple):  # a tuple: immutable, and cheap to build once per iteration
    """Immutable decision: preempt these, then compute ``n`` tokens for each ``(request, n)``.

    ``repeat`` bounds how many identical iterations the engine may run before asking again when
    the batch is pure decode (None: until the next event). ``wake_s`` asks to be consulted again
    at that time even if nothing else happens (time-based policies: quanta, starvation bounds).
    ``bulk``: how many running requests decode in it besides ``items`` (one token each per
    iteration), requests the builder keeps in aggregate for a policy that reads running requests only
    through it (``ReadsRunning``); ``bulk_by_class``: those counted per the policy's
    ``ReadsRunning.by_class`` (None without one).
    """

    items: tuple[tuple[Request, int], ...] = ()
    preempt: tuple[Request, ...] = ()
    repeat: int | None = None
    wake_s: float | None = None
    summary: "BatchSummary | None" = None  # filled by BatchBuilder; the engine recomputes it if absent
    bulk: int = 0
    bulk_by_class: dict | None = None


class BatchSummary:
    """Counts the builder gathered while adding items, so the engine need not walk them again.

    ``grow``: (request, blocks it must hold) for items needing new KV blocks; ``admit``: items
    that were waiting; ``min_decode_left``: fewest tokens any decode item still has to generate;
    ``bulk_blocks``: new KV blocks the ``Batch.bulk`` requests need for this iteration;
    ``min_free``: the decision is taken again, the same, at the next iteration boundaries only while
    at least this many KV blocks are free there (0: whatever is free; ``NEVER``: it is not), so a
    decode stretch stops growing before fewer are (see ``BatchBuilder.preempt_to_admit`` and
    ``admit_waiting``). A batch that admits a request in the shape of a decode (a readmission onto a
    fully cached prompt computes one token; a swapped-out request resumes) is never repeated: the
    next decision sees that request running, and may decide otherwise for it.
    """

    __slots__ = ("prefill_tokens", "prefill_reqs", "prefill_ctx", "pairs", "decode_reqs", "decode_ctx",
                 "min_decode_left", "grow", "admit", "bulk_blocks", "hits", "min_free")

    def __init__(self) -> None:
        self.prefill_tokens = self.prefill_reqs = self.prefill_ctx = self.pairs = 0
        self.decode_reqs = self.decode_ctx = self.bulk_blocks = 0
        self.min_decode_left = 1 << 62
        self.grow: list[tuple[Request, int]] = []
        self.admit: list[Request] = []
        self.hits: dict | None = None  # admitted request -> the prefix-cache Hit it reuses
        self.min_free = 0

    def account(self, req: Request, n: int, need: int, hit=None, target: int = 0) -> None:
        """Count ``(req, n)`` needing ``need`` more free blocks; ``hit``: it is admitted onto a cached
        prefix of ``hit.tokens`` tokens and will hold ``target`` blocks."""
        c = req.num_computed_tokens if hit is None else hit.tokens
        g = req.num_generated_tokens
        if n == 1 and g and c == req.prompt_tokens + g - 1:
            self.decode_reqs += 1
            self.decode_ctx += c + 1
            left = req.output_tokens - g
            if left < self.min_decode_left:
                self.min_decode_left = left
            if hit is not None or req.status is Status.WAITING:  # admitted in the shape of a decode
                self.min_free = NEVER  # (not repeated: see the class's docstring)
        else:
            self.prefill_reqs += 1
            self.prefill_tokens += n
            self.prefill_ctx += c + n
            self.pairs += n * c + n * (n + 1) // 2
        if hit is None:
            if need:
                self.grow.append((req, req.kv_blocks + need))
            if req.status is Status.WAITING:
                self.admit.append(req)
            return
        if target > hit.blocks:
            self.grow.append((req, target))
        self.admit.append(req)
        if self.hits is None:
            self.hits = {}
        self.hits[req] = hit


EMPTY = Batch()
UNLIMITED = 1 << 62  # the token budget of a policy without one (orca, static)
NEVER = 1 << 62  # BatchSummary.min_free of a decision not to repeat: more KV blocks than any replica has


@dataclass(frozen=True, slots=True)
class ReadsRunning:
    """A policy's promise to its builder (``Policy.reads_running``): it reads running requests only
    through ``schedule_running(replica.running, decodes_first=True)`` (its first use of the builder;
    before it, it may ``preempt`` requests it tracks, reading their progress with ``generated`` and
    ``kv_blocks``), or through ``running()``, and ignores the counters of ``on_step``'s items. The
    builder may then keep decoding requests in aggregate: they decode as ``Batch.bulk``.

    ``by_class``: a function of a running request whose values such requests are counted by
    (``Batch.bulk_by_class``: a policy that charges service per class, e.g. per tenant), or None;
    ``settled(req)``, with it: ``req``'s counters are written back (its tokens since it joined the
    aggregate were in ``bulk_by_class``); ``may_bulk(req)``: False keeps a decoding request out of the
    aggregate for now (asked again after each token it makes outside), None: any may join.
    """

    by_class: Callable[[Request], Any] | None = None
    settled: Callable[[Request], None] | None = None
    may_bulk: Callable[[Request], bool] | None = None


def aggregate_decodes(replica: "Replica", tokens: "TokenLog | None") -> None:
    """Let the builder keep ``replica``'s decoding requests in aggregate from now on, if its policy
    promises ``reads_running`` (the engine asks this only when nothing else reads running requests'
    counters: a runner that needs block tables, or the platform's failures and pausing, do)."""
    contract = replica.policy.reads_running
    if contract is None:
        return
    cohort = DecodeCohort(replica, *initial_budgets(replica), contract.by_class, contract.settled, tokens,
                          contract.may_bulk)
    replica.aggregate = cohort
    replica.running = Running(replica.running, cohort)


def no_aggregate(replica: "Replica") -> None:
    """From now on the builder keeps nothing of ``replica``'s in aggregate (after ``settle``, if it did)."""
    settle(replica)
    if replica.aggregate is not None:
        replica.aggregate = None
        replica.running = list(replica.running)


def settle(replica: "Replica") -> None:
    """Write back every counter the builder keeps in aggregate on ``replica`` (the replay's end)."""
    if replica.aggregate is not None:
        replica.aggregate.dissolve()


def make_current(replica: "Replica", req: Request) -> None:
    """``req`` (running on ``replica``) leaves outside a decision (its client gave up): its counters
    and KV blocks are made its own again if the builder kept them in aggregate."""
    if req.aggregate_mark is not None:
        replica.aggregate.remove(req)


def in_batch(batch: Batch, req: Request) -> bool:
    """Does ``batch`` compute tokens for running request ``req``?"""
    if req.aggregate_mark is not None:
        return bool(batch.bulk)
    return any(item is req for item, _ in batch.items)


def blocks_to_grow(replica: "Replica", batch: Batch, j: int) -> int:
    """KV blocks ``batch``'s requests take beyond those they hold to compute ``j`` more tokens each (a
    decode stretch of ``j`` iterations grows their KV by this at its end), those the builder kept in
    aggregate included (their blocks for the first iteration were taken when it started)."""
    bs = replica.kv.block_size
    extra = sum(-(-(req.num_computed_tokens + j) // bs) - req.kv_blocks for req, _ in batch.items)
    if batch.bulk:
        extra += replica.aggregate.blocks_added(j) - batch.summary.bulk_blocks
    return extra


def initial_budgets(replica: "Replica") -> tuple[int, int]:
    """(tokens, sequences) a policy's builder starts every iteration with (``PolicyBase.builder``)."""
    cfg = replica.config
    tokens = cfg.max_num_batched_tokens if replica.policy.uses_token_budget else UNLIMITED
    return tokens, cfg.max_num_seqs


class BatchBuilder:
    """What a policy builds its batch with. Policies read ``token_budget``, ``seq_budget``,
    ``free_blocks``, ``items`` (``(request, n)`` added so far), ``preempted`` and ``skip_blocked`` (the
    head-of-line rule) and change the batch only through the methods: the two walks most policies
    share (``schedule_running``, ``admit_waiting``), one request at a time (``admit``, ``has``), and
    the two preemption rules (``preempt_to_admit``, ``keep_only``)."""

    __slots__ = ("replica", "kv", "token_budget", "seq_budget", "free_blocks", "items", "preempted",
                 "_chosen", "_synced", "victim_key", "skip_blocked", "summary", "bulk", "bulk_by_class", "_released",
                 "loras")

    def __init__(self, replica: "Replica", victim_key: Callable[[Request], object],
                 token_budget: int | None = None, seq_budget: int | None = None):
        cfg = replica.config
        self.replica = replica
        self.kv = kv = replica.kv
        self.token_budget = cfg.max_num_batched_tokens if token_budget is None else token_budget
        self.seq_budget = cfg.max_num_seqs if seq_budget is None else seq_budget
        self.free_blocks = kv.total - kv.used  # (kv.free, without the property call: once per decision)
        self.items: list[tuple[Request, int]] = []
        self.preempted: list[Request] = []
        self._chosen: set[Request] = set()  # requests in items or preempted (items synced lazily)
        self._synced = 0
        self.victim_key = victim_key
        self.skip_blocked = cfg.head_of_line == "skip"
        self.summary = BatchSummary()
        self.bulk = 0  # members of the replica's decode cohort taken whole into this batch
        self.bulk_by_class = None
        self._released = None  # prefix-cache blocks the preempted requests free (a hit on one takes it back)
        cohort = replica.aggregate
        if cohort is not None and cohort.n and not cohort.fits():
            cohort.dissolve()  # the policy must walk its members one by one this time
        # multi-LoRA (replay/core/lora.py): the distinct adapters of the running requests and of those this
        # batch admits, never more than max_loras (None: LoRA off)
        self.loras = None if replica.lora is None else replica.lora.in_use(replica.running)

    def seen(self, waiting: Iterable[Request]) -> Iterable[Request]:
        """``waiting`` less the requests this decision does not know of yet (async scheduling: they joined
        the queue during the iteration that just ended, ``Replica.visible_s``), lazily; ``waiting`` itself
        when there are none. A policy walking waiting requests by itself (one ``admit`` at a time, or to
        preempt for them) walks these: one not seen neither blocks the next nor takes a running one's place."""
        replica = self.replica
        if not replica.holding:
            return waiting
        visible_s = replica.visible_s
        return (req for req in waiting if req.queued_s <= visible_s)

    def has(self, req: Request) -> bool:
        """Is ``req`` already in this batch, or preempted by it?"""
        return req in self.chosen

    @property
    def chosen(self) -> set[Request]:
        """Requests already in this batch or preempted by it."""
        items = self.items
        if self._synced < len(items):
            self._chosen.update(req for req, _ in items[self._synced:])
            self._synced = len(items)
        return self._chosen

    # -- primitives -------------------------------------------------------------------------
    def add(self, req: Request, n: int, need: int | None = None, hit=None, target: int = 0) -> None:
        """Put ``(req, n)`` in the batch; ``need`` = its extra KV blocks if the caller computed them
        (``hit``, ``target``: admitted onto a cached prefix, see ``BatchSummary.account``)."""
        if need is None:
            need = self.kv.blocks_needed(req, n)
        self.free_blocks -= need
        self.token_budget -= n
        self.seq_budget -= 1
        self.items.append((req, n))
        self.summary.account(req, n, need, hit, target)

    def generated(self, req: Request) -> int:
        """Output tokens ``req`` has produced so far, current even while the engine keeps it in the
        replica's decode cohort (whose members' counters are written back lazily)."""
        mark = req.aggregate_mark
        return req.num_generated_tokens if mark is None else req.num_generated_tokens + self.replica.aggregate.d - mark

    def kv_blocks(self, req: Request) -> int:
        """GPU blocks ``req`` holds, current even while it is a decode-cohort member (a member's
        blocks are settled when it leaves: ``DecodeCohort.materialize``)."""
        mark = req.aggregate_mark
        if mark is None or self.kv.reserve:
            return req.kv_blocks
        return -(-(req.num_computed_tokens + self.replica.aggregate.d - mark) // self.kv.block_size)

    def preempt(self, req: Request) -> None:
        if req.aggregate_mark is not None:  # a decode-cohort member: it leaves the aggregate first
            if self.bulk:
                raise RuntimeError("a policy that promises reads_running preempts running requests before "
                                   "schedule_running, not after")
            self.replica.aggregate.remove(req)
        freed = self.kv.releasable(req)
        if req.cached_keys is not None:
            sole: dict = {}
            self.kv.cache.sole_blocks(req, sole)
            if self.summary.hits:  # requests this batch admitted onto blocks only ``req`` holds keep them in use
                freed -= self.kv.cache.covered(self.summary.hits.values(), sole)
            if self._released is None:
                self._released = sole
            else:
                self._released.update(sole)
        self.free_blocks += freed
        self.preempted.append(req)
        self._chosen.add(req)

    def pick_victim(self) -> Request | None:
        """The running request not yet in this batch that the policy ranks lowest."""
        candidates = [r for r in self.replica.running if r not in self.chosen]
        return max(candidates, key=self.victim_key) if candidates else None

    def add_running(self, req: Request, n: int) -> bool:
        """Schedule a running request, preempting victims until its KV fits (maybe itself)."""
        need = self.kv.blocks_needed(req, n)
        while need > self.free_blocks:
            victim = self.pick_victim()
            if victim is None or victim is req:
                self.preempt(req)
                return False
            self.preempt(victim)
        self.add(req, n, need)
        return True

    def build(self, repeat: int | None = None, wake_s: float | None = None) -> Batch:
        if not self.items and not self.preempted and wake_s is None and not self.bulk:
            return EMPTY
        return Batch(tuple(self.items), tuple(self.preempted), repeat, wake_s, self.summary, self.bulk,
                     self.bulk_by_class)

    # -- the two loops most policies share -----------------------------------------------------
    def schedule_running(self, order: Iterable[Request], chunk_cap: int | None = None,
                         decodes_first: bool = False) -> None:
        """Give each running request its next tokens (a decode token, or its next prefill chunk).

        ``decodes_first``: every decode before any prefill chunk (Sarathi-Serve), each group in
        ``order``. A policy that promises ``reads_running`` makes this call with ``replica.running``
        (or with ``self.running()``, see there) and reads running requests' counters only after it
        (``generated`` aside): the replica's decoding requests may then be one aggregate that this
        call takes whole (the engine dissolved it beforehand if it would not fit). Without
        ``decodes_first`` it takes it whole only when the members come first in ``order`` anyway.
        """
        cohort = self.replica.aggregate
        if cohort is not None and cohort.n:
            if order is not self.replica.running:
                raise RuntimeError("a policy that promises reads_running walks replica.running through "
                                   "schedule_running(replica.running, ...), or the list running() returns")
            if decodes_first or cohort.leads(self.chosen):
                order = self._take_cohort(cohort)
            else:  # the walk's order would give some members their token after others' chunks
                cohort.dissolve()
        if not decodes_first:
            self._walk(order, chunk_cap, None)
            return
        if not order:  # the cohort was everyone
            return
        prefills: list[Request] = []
        self._walk(order, chunk_cap, prefills)
        if prefills:
            self._walk(prefills, chunk_cap, None)

    def running(self, for_good: bool = False) -> list[Request]:
        """The replica's running requests with every counter current, for a policy that orders them
        itself this time (the builder then keeps no aggregate for this decision, or ``for_good``: for
        the rest of the replay, when the policy can no longer keep its ``reads_running`` promise)."""
        replica = self.replica
        cohort = replica.aggregate
        if cohort is not None:
            if for_good:
                no_aggregate(replica)
            elif cohort.n:
                cohort.dissolve()
        return replica.running

    def _take_cohort(self, cohort) -> list[Request]:
        """Add every cohort member's decode token at once (``__init__`` checked with ``cohort.fits``
        that the walk would give each one its token); returns the running requests left to walk."""
        n = cohort.n
        need, ctx, left = cohort.next_iteration()
        self.token_budget -= n
        self.seq_budget -= n
        self.free_blocks -= need
        summary = self.summary
        summary.decode_reqs += n
        summary.decode_ctx += ctx
        if left < summary.min_decode_left:
            summary.min_decode_left = left
        summary.bulk_blocks = need
        self.bulk = n
        if cohort.group is not None:
            self.bulk_by_class = {key: count for key, count in cohort.groups.items() if count}
        return cohort.outside

    def _walk(self, order: Iterable[Request], chunk_cap: int | None, prefills: list[Request] | None) -> None:
        """One pass of ``schedule_running``; with ``prefills``, non-decodes are set aside there."""
        # The hot loop of every policy: budgets and counts live in locals, and the common case
        # (its KV fits) is inlined; the slow path (preemption) syncs them back to the builder.
        chosen, items, summary = self.chosen, self.items, self.summary
        bs, reserve = self.kv.block_size, self.kv.reserve
        layout = self.kv.layout  # a hybrid model's layer groups (replay/core/kv/kv_groups.py), else None
        waiting = Status.WAITING
        tokens, seqs, free = self.token_budget, self.seq_budget, self.free_blocks
        n_dec, dec_ctx, min_left = summary.decode_reqs, summary.decode_ctx, summary.min_decode_left
        grow = summary.grow
        for req in order:
            if req in chosen:
                continue
            if tokens <= 0 or seqs <= 0:
                break
            c = req.num_computed_tokens
            g = req.num_generated_tokens
            n = req.prompt_tokens + g - c
            if n == 1 and g:  # a decode: one token, the KV of all earlier ones in place
                need = (-(-(c + 1) // bs) if layout is None else layout.held(c, 1)) - req.kv_blocks if not reserve else 0
                if need > free:
                    self.token_budget, self.seq_budget, self.free_blocks = tokens, seqs, free
                    summary.decode_reqs, summary.decode_ctx, summary.min_decode_left = n_dec, dec_ctx, min_left
                    self.add_running(req, 1)
                    tokens, seqs, free = self.token_budget, self.seq_budget, self.free_blocks
                    n_dec, dec_ctx, min_left = summary.decode_reqs, summary.decode_ctx, summary.min_decode_left
                    continue
                if need > 0:
                    free -= need
                    grow.append((req, req.kv_blocks + need))
                tokens -= 1
                seqs -= 1
                items.append((req, 1))  # `chosen` picks it up lazily: `order` has no repeats
                n_dec += 1
                dec_ctx += c + 1
                if req.output_tokens - g < min_left:
                    min_left = req.output_tokens - g
                if req.status is waiting:
                    summary.admit.append(req)
                    summary.min_free = NEVER  # (a batch that admits a decode is not repeated: BatchSummary)
                continue
            if prefills is not None:
                prefills.append(req)
                continue
            if chunk_cap is not None and n > chunk_cap:
                n = chunk_cap
            if n > tokens:
                n = tokens
            self.token_budget, self.seq_budget, self.free_blocks = tokens, seqs, free
            summary.decode_reqs, summary.decode_ctx, summary.min_decode_left = n_dec, dec_ctx, min_left
            self.add_running(req, n)  # a prefill chunk (or recompute): the general path
            tokens, seqs, free = self.token_budget, self.seq_budget, self.free_blocks
            n_dec, dec_ctx, min_left = summary.decode_reqs, summary.decode_ctx, summary.min_decode_left
        self.token_budget, self.seq_budget, self.free_blocks = tokens, seqs, free
        summary.decode_reqs, summary.decode_ctx, summary.min_decode_left = n_dec, dec_ctx, min_left

    def admit(self, req: Request, chunk_cap: int | None = None) -> int:
        """Admit one waiting request with a prefill chunk if budgets and KV allow; returns the tokens
        it was given (0: it did not fit)."""
        before = len(self.items)
        self.admit_waiting((req,), chunked=True, chunk_cap=chunk_cap)
        return self.items[-1][1] if len(self.items) > before else 0

    # -- preemption rules ---------------------------------------------------------------------
    def preempt_to_admit(self, waiting: Iterable[Request], may_preempt: Callable[[Request, Request], bool],
                         victims: Iterable[Request] | None = None) -> None:
        """Make room for waiting requests, in the policy's order, by preempting running ones.

        For each waiting request that lacks a batch slot or KV for its next chunk, running requests
        are preempted in the policy's victim order (``victims``; default: largest ``victim_key``
        first — a policy that knows that order without sorting passes it lazily) while
        ``may_preempt(waiting_request, victim)`` says so. Stops at the first waiting request that
        cannot be given room (or could never fit), so a later one never jumps an earlier one.

        The walk counts free KV blocks, which a decode stretch's growth lessens: a request given room
        here may lack it at a later iteration boundary and preempt there. When it preempts nothing,
        the walk says how many blocks must stay free for the next decisions to preempt nothing either
        (``BatchSummary.min_free``): the blocks of the requests given room, up to the last of them
        that would preempt the first victim if it lacked room.
        """
        replica = self.replica
        if not replica.running:
            return
        if victims is None:
            victims = sorted(replica.running, key=self.victim_key, reverse=True)
        victims = iter(victims)
        first = next(victims, None)  # the victim a request lacking room meets first
        if first is None:
            return
        victims = chain((first,), victims)
        kv = self.kv
        free_slots = replica.config.max_num_seqs - len(replica.running)
        free_blocks = kv.free
        budget = replica.config.max_num_batched_tokens
        taken = floor = 0
        for req in self.seen(waiting):  # (not for a request this decision does not know of)
            n = req.num_tokens - req.num_computed_tokens
            need = kv.blocks_needed(req, n if n < budget else budget)
            if need > kv.total:
                break
            while free_slots < 1 or free_blocks < need:
                victim = next(victims, None)
                if victim is None or not may_preempt(req, victim):
                    break
                self.preempt(victim)
                free_slots += 1
                free_blocks += kv.releasable(victim)
            else:  # it has room
                free_slots -= 1
                free_blocks -= need
                taken += need
                if may_preempt(req, first):  # with fewer than ``taken`` blocks free, it or one before lacks room
                    floor = taken
                continue
            break
        if floor > self.summary.min_free:
            self.summary.min_free = floor

    def keep_only(self, keep: Iterable[Request]) -> None:
        """Preempt every running request not in ``keep`` (a policy re-ranking the whole batch)."""
        keep = keep if isinstance(keep, (set, frozenset)) else set(keep)
        for req in self.replica.running:
            if req not in keep:
                self.preempt(req)

    def admit_waiting(self, order: Iterable[Request], chunked: bool, chunk_cap: int | None = None) -> None:
        """Admit waiting requests in ``order`` while budgets and KV allow (head-of-line rule applies)."""
        kv = self.kv
        lookup = kv.lookup if kv.cache is not None else None
        loras = self.loras
        # async scheduling: later arrivals wait for the next decision (``seen``'s test, inline: a call per decision
        # cost more here than a comparison per request walked)
        visible_s = self.replica.visible_s
        for req in order:
            if self.seq_budget <= 0 or self.token_budget <= 0:
                break
            if req.queued_s > visible_s:
                continue
            if loras is not None and not self._lora_fits(req):
                continue  # its adapter would be one too many in the batch: vLLM passes over it
            hit = lookup(req) if lookup is not None else None
            computed = req.num_computed_tokens if hit is None else hit.tokens
            n = req.num_tokens - computed
            if chunked:
                if chunk_cap is not None and n > chunk_cap:
                    n = chunk_cap
                if n > self.token_budget:
                    n = self.token_budget
            # Without chunking, a prompt larger than the whole budget runs alone rather than never.
            too_big = n > self.token_budget and (chunked or bool(self.items))
            if hit is None:
                need, target = kv.blocks_needed(req, n), 0
            else:  # new blocks past the cached prefix, and the cached blocks nobody holds (they leave the free pool)
                target = -(-(computed + n) // kv.block_size) if kv.layout is None else kv.layout.held(computed, n)
                need = target - hit.blocks + hit.claimed
                if self._released:  # blocks a victim of this batch frees, counted free above: taken back
                    need += kv.cache.covered((hit,), self._released)
            if too_big or need > self.free_blocks:
                if hit is not None and hit.claimed and chunked:
                    self._keep_cached(req, hit, chunk_cap)
                if self.skip_blocked:
                    continue
                break
            self.add(req, n, need, hit, target)
            if loras is not None and req.lora_adapter is not None:
                loras.add(req.lora_adapter)

    def _keep_cached(self, req: Request, hit, chunk_cap: int | None) -> None:
        """``req`` did not fit, looked up onto ``hit``, cached blocks some of which nobody holds. A decode
        stretch's growth takes free blocks from the head of the prefix cache's queue, evicting what they
        cached, so at a later boundary its hit may be smaller. Its need is then no smaller (the blocks
        of its whole prompt less those other requests hold, which only drop out of a shorter hit)
        unless its chunk is capped without the hit: it then computes fewer tokens, in fewer blocks, and
        may fit. In that case, unless it surely never fits in the stretch, the same decision holds while
        the growth since this one takes only blocks that cache nothing reusable (``PrefixCache.spare``).

        It never fits when even its capped chunk alone needs more blocks than are free now (fewer at
        every later boundary), less those other requests hold for it; and when the hit is its own
        blocks alone (a preempted request's), evicted from their end: with ``e`` of its ``o`` gone, at
        least ``e`` blocks were taken, and it needs its ``o - e`` back plus its chunk's, more than are
        free if the chunk's are more than the blocks free besides its own now."""
        whole = req.num_tokens - req.num_computed_tokens
        cap = self.token_budget if chunk_cap is None or chunk_cap > self.token_budget else chunk_cap
        if whole <= cap:
            return
        kv = self.kv
        if kv.layout is None:
            bs = kv.block_size
            if -(-cap // bs) - (hit.blocks - hit.claimed) > self.free_blocks:
                return
            if not hit.shared and not hit.loaded:
                chunk = whole - (hit.own - 1) * bs  # its tokens past its own blocks once one is gone
                if -(-(chunk if chunk < cap else cap) // bs) > kv.total - kv.used - hit.own:
                    return
        floor = kv.total - kv.used - kv.cache.spare()
        if floor > self.summary.min_free:
            self.summary.min_free = floor

    def _lora_fits(self, req: Request) -> bool:
        """May ``req`` join without more than ``max_loras`` distinct adapters among the running requests?"""
        adapter = req.lora_adapter
        return adapter is None or adapter in self.loras or len(self.loras) < self.replica.lora.max_loras
