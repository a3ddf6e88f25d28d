"""Prefix caching (vLLM v1 semantics), counted in blocks: which free blocks still hold reusable KV.

Every block not referenced by a running request is in one **free queue**, least recently freed
first. Allocating takes blocks from its head — evicting whatever cached KV they held — and freeing
appends to its tail, a request's blocks in reverse order so that its tail blocks are evicted first
(vLLM's ``FreeKVCacheBlockQueue``). A block holds reusable KV when it is *full* and has a key:

- **hashed blocks** — full blocks of a prompt covered by the trace's ``prefix_hashes``. Engine
  block ``j`` (tokens ``[j*bs, (j+1)*bs)``) is keyed by the trace hash of the trace block holding
  its last token, and ``j``: two requests share it only if their prompts agree through that trace
  block. When the trace's block (``prefix_block_tokens``, Mooncake: 512) is a multiple of the
  engine's, this is exact; otherwise a block straddling two trace blocks needs both to match.
  Hashed blocks are cached as soon as they are computed, reference-counted while running
  requests share them, and evictable once no running request holds them.
- **output blocks** — with a trace of dependent requests (schema v2, ``keep_outputs``), hashes past
  a request's prompt key its generated tokens' blocks the same way, so that a dependent request
  whose hashes continue the chain (its parent's prompt and output, then new tokens) reuses them.
- **a request's own blocks** — its other full blocks (tokens not covered by hashes, and generated
  tokens), keyed by the request itself: only that request can hit them, when it is admitted again
  after a preemption by recompute. They are queued as one *segment* per released request (the
  queue keeps runs of blocks, so a replay whose trace has no hashes pays O(1) per release).

A request that is admitted with no computed tokens reuses the longest cached prefix: its hashed
blocks in order while each is cached, then (if all of them hit) its own segment. At least its last
token is always computed, since the iteration that computes it emits the next token (vLLM v1
recomputes the whole last block to keep computed tokens block-aligned; we recompute one token,
as SGLang does). The runner is charged for the tokens computed; attention still reads the context.

**Cost per run of hash blocks, not per engine block.** The engine blocks whose last token lies in one
trace block (``prefix_block_tokens / block_size`` of them when aligned: 32 for Mooncake's 512) share
that block's hash, and with aligned trace blocks the consecutive hash blocks a request computes are
kept together too: one ``Entry`` holds a run of keys (every key an item of the map, pointing to it),
and a request's new hash blocks extend the entry it holds to its end, so a prompt nobody shares is
one entry, one release run and one eviction, whatever its length. Running requests hold a prefix of
each entry (their chains are prefixes), so per-block reference counts are implied by how many blocks
each holder holds (``Entry.held``: blocks held -> holders; no dict while one holds it); the blocks
past the largest holding that are still cached sit in the free queue as *runs* (contiguous, the
highest block first, as the per-block queue would have them). Claiming a hit takes runs from
below, eviction eats a run from the top: the same blocks, in the same order, as one queue entry
per block. An entry is cut in two (``_split``) only where a request's keys meet it after its first
key (a trace whose hashes are not chained: equal hashes after unequal ones); a holder past the cut goes on in the
upper part (``Entry.next``). A key slice of an entry with no cached block keeps its key and behaves
as a missing key. tests/test_prefix_records.py checks all of this against entries of one key each.
The queue is a deque
(queued at the tail, evicted from the head, both O(1) without a dict's bookkeeping); a segment that
leaves from its middle (a claimed run, a reused own segment) is left there GONE, with no blocks,
dropped when it reaches the head or when GONE segments are most of the queue (``_gone``).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.replay.core.request import Request
    from servelab.replay.core.kv.tiers import TierStack

FRESH, DEAD, OWN, RUN, GONE = 0, 1, 2, 3, 4  # kinds of a queued segment: never used, holds nothing reusable, a
# request's own, a run of an entry's cached blocks; GONE: taken out of the queue's middle (claimed), left in place
# with no blocks (a deque cannot delete there) and dropped when it reaches the head


class Entry:
    """The cached engine blocks of a run of consecutive trace blocks: blocks ``[lo, lo + size)`` of every
    prompt whose chain has these ``keys`` (one per trace block, in order; every key maps to the entry in
    the cache's dict). With aligned trace blocks key ``j`` covers offsets ``[j * per, (j + 1) * per)``;
    otherwise an entry has one key. A request's new hash blocks extend the entry it holds to its end
    (``PrefixCache.register``), so a prompt nobody shares is one entry, one release run, one eviction.
    Offsets below are relative to ``lo``. ``top``: the most blocks any running request holds (all
    blocks below it are cached, with a reference count > 0); ``held``: blocks held -> how many
    running requests hold that many (each holds a prefix), or None: then one request holds ``top``
    blocks (none if ``top`` is 0). It becomes a dict when a second holder comes, and None again when
    the last one lets go; ``runs``: the queued (cached, unheld) blocks above ``top``, as free-queue
    segments ``[RUN, blocks, entry, start, id]``, by start. A key slice with no cached block keeps
    its key while the entry holds anything (it behaves as a missing key: nothing to hit, and a request
    that computes it holds it). ``next``: the entry cut off above this one (``PrefixCache._split``,
    when a request's keys meet the entry's after its first), where a holder past ``size`` goes on."""

    __slots__ = ("keys", "lo", "size", "held", "top", "runs", "ids", "next")

    def __init__(self, keys: list, lo: int, size: int, count: int = 0):
        self.keys = keys
        self.lo = lo
        self.size = size
        self.held: dict[int, int] | None = None
        self.top = count  # (``count``: held so by its first holder)
        self.runs: list[list] = []
        self.ids: list | None = None  # with real block ids (replay/core/kv/block_names.py): each cached block's id
        self.next: Entry | None = None

    @property
    def key(self):
        """Its first key (for messages)."""
        return self.keys[0]

    def holdings(self) -> dict[int, int]:
        """Blocks held -> how many running requests hold that many."""
        if self.held is None:
            return {self.top: 1} if self.top else {}
        return self.held

    def reach(self, start: int = 0) -> int:
        """Up to which offset the blocks from ``start`` on are cached without a gap."""
        reach = self.top if self.top > start else start
        for run in self.runs:
            if run[3] > reach:
                break
            end = run[3] + run[1]
            if end > reach:
                reach = end
        return reach

    def hold(self, count: int) -> None:
        held = self.held
        if held is None:
            if not self.top:  # the first holder
                self.top = count
                return
            held = self.held = {self.top: 1}
        held[count] = held.get(count, 0) + 1
        if count > self.top:
            self.top = count

    def unhold(self, count: int) -> None:
        held = self.held
        if held is None:  # its only holder
            self.top = 0
            return
        left = held[count] - 1
        if left:
            held[count] = left
        else:
            del held[count]
            if not held:
                self.held = None
                self.top = 0
            elif count == self.top:
                self.top = max(held)

    def others_max(self, count: int) -> int:
        """The most blocks held by a holder other than one holding ``count``."""
        held = self.held
        if held is None:  # (it is the only holder)
            return 0
        if self.top > count or held[count] > 1:
            return self.top
        return max((c for c in held if c != count), default=0)


class Chain:
    """The hashed blocks a running request holds: its first ``blocks`` blocks, ``entries`` in order,
    each from its first block up to the next one's ``lo`` (the last: up to ``blocks``). An entry cut
    since (``Entry.next``) is held on past its ``size``: ``counts`` follows it, and the cache
    rewrites the list (``PrefixCache._normalize``) when its ``splits`` count is past ``epoch``."""

    __slots__ = ("entries", "blocks", "epoch", "cap")

    def __init__(self, epoch: int = 0):
        self.entries: list[Entry] = []
        self.blocks = 0
        self.epoch = epoch
        self.cap: int | None = None  # its request's hashed blocks (``PrefixCache.hashed_blocks``), once known

    def counts(self):
        """(entry, blocks of it held), in order."""
        entries = self.entries
        n = len(entries)
        for i, e in enumerate(entries):
            end = entries[i + 1].lo if i + 1 < n else self.blocks
            while end - e.lo > e.size:  # (cut since: it goes on in the entry above)
                yield e, e.size
                e = e.next
            yield e, end - e.lo


class Hit:
    """What an admission reuses: ``keys`` ((entry, first offset, end offset) of the blocks it reuses of
    each entry, in order: the first offset is 0 unless its keys meet the entry after its first;
    ``shared`` hashed blocks in all), ``own`` blocks of its segment; ``blocks`` = ``shared + own``, the GPU blocks it takes
    over. With offload tiers, the ``loaded`` hashed blocks after the shared ones come from lower
    tiers (``reads``: tier index -> blocks; ``touched``: (tier index, key) read): they count in
    ``tokens`` but need new GPU blocks, like computed ones."""

    __slots__ = ("keys", "shared", "own", "blocks", "tokens", "claimed", "loaded", "reads", "touched")

    def __init__(self, keys: list, shared: int, own: int, tokens: int, claimed: int,
                 loaded: int = 0, reads: dict | None = None, touched: list | None = None):
        self.keys = keys
        self.shared = shared
        self.own = own
        self.blocks = shared + own
        self.tokens = tokens  # prompt (+ generated) tokens it need not compute
        self.claimed = claimed  # of its blocks, how many leave the free queue (were not held by anyone)
        self.loaded = loaded
        self.reads = reads
        self.touched = touched


class PrefixCache:
    __slots__ = ("block_size", "trace_block", "per_tenant", "queue", "entries", "segments", "seq", "queued", "gone",
                 "tiers", "purge", "names", "keep_outputs", "countable", "per", "splits", "plain")

    def __init__(self, total_blocks: int, block_size: int, trace_block: int | None, per_tenant: bool = False,
                 tiers: "TierStack | None" = None, purge: frozenset = frozenset()):
        self.block_size = block_size
        self.trace_block = trace_block  # tokens per prefix_hashes entry (None: the trace has no hashes)
        # engine blocks per trace block when the trace block is a multiple of the engine's (the usual
        # case: Mooncake's 512 tokens are 32 blocks of 16), else 0: entry i is then blocks
        # [i * per, (i + 1) * per), and register, lookup and release take their aligned paths
        self.per = trace_block // block_size if trace_block and trace_block % block_size == 0 else 0
        self.per_tenant = per_tenant  # a tenant's requests hit only its own blocks (vLLM's cache salt)
        self.tiers = tiers  # offload tiers below GPU memory (replay/core/kv/tiers.py), or None
        self.purge = purge  # tenants whose blocks are dropped from every tier when their requests end
        # The free queue, head first: segments [kind, blocks, owner] (owner: the request of an OWN segment;
        # an OWN segment also has its id, a RUN its entry as owner, its start and its id: [kind, blocks,
        # owner, start, id]). A deque: a segment is queued at the tail and evicted from the head, each
        # once per hash block of every released prompt; one leaving from the middle is left GONE.
        self.queue: deque = deque()
        self.entries: dict = {}  # key -> Entry holding at least one cached block
        self.segments: dict[int, list] = {}  # request index -> its own segment in the queue
        self.seq = 0
        self.queued = 0  # blocks in the queue
        self.gone = 0  # GONE segments in the queue
        # A trace without hashes whose blocks are not named (the KV manager clears this when it names
        # them) caches nothing but own segments. While it has none queued, which free block is taken
        # first changes nothing: taking and freeing only count (``queued``; the queue's segments go
        # stale), and the queue is rebuilt as one DEAD segment when an own segment is pushed
        # (``_settle``). Such a trace, its requests not preempted by recompute, so costs a counter per
        # KV growth and release; a trace with hashes pays one test per take and push.
        self.countable = trace_block is None
        # real block ids (replay/core/kv/block_names.py), only when the runner executes batches: set by the KV manager
        self.names = None
        # a trace whose requests depend on others (schema v2): a request's hashes may go on past its
        # prompt over its output, the context its dependents continue; those blocks are cached too
        self.keep_outputs = False
        # register's first path applies: aligned trace blocks, unsalted keys (no tenant scope), no tier
        self.plain = bool(self.per) and tiers is None and not per_tenant
        self.splits = 0  # entries cut in two so far (``_split``): chains older than this are rewritten
        self._fresh(total_blocks)

    # -- keys -----------------------------------------------------------------------------------
    def hashed_blocks(self, req: "Request") -> int:
        """How many of ``req``'s leading full blocks the trace's hashes identify."""
        hashes = req.prefix_hashes
        if not hashes or self.trace_block is None:
            return 0
        tokens = req.prompt_tokens + req.output_tokens if self.keep_outputs else req.prompt_tokens
        covered = min(tokens, len(hashes) * self.trace_block)
        return covered // self.block_size

    def groups(self, req: "Request", start: int, stop: int, hashes: list | None = None):
        """(key, lo, hi) of the trace blocks whose engine blocks ``[lo, hi)`` (those whose last token
        lies in the trace block) meet ``[start, stop)``; trace blocks holding no block's last token
        are skipped. The key: the trace block's hash and its index (the tenant first when the
        cache is per tenant; with a LoRA adapter, the adapter and that tenant or None first). ``hashes``:
        instead of ``req.prefix_hashes`` (KV retention). When the trace block is a multiple of the
        engine's (``per``, the usual case), trace block ``i`` is engine blocks ``[i * per, (i + 1) * per)``
        and the keys come from one generator expression (register and lookup walk every hash block)."""
        if hashes is None:
            hashes = req.prefix_hashes
        salt = req.tenant if self.per_tenant else None
        if req.lora_adapter is not None:  # KV computed under an adapter is that adapter's (vLLM's block hash)
            salt = ("lora", req.lora_adapter, salt)
        per = self.per
        if per:
            first, last = start // per, -(-stop // per)
            if salt is None:
                return (((hashes[i], i), i * per, i * per + per) for i in range(first, last))
            return (((salt, hashes[i], i), i * per, i * per + per) for i in range(first, last))
        return self._groups(hashes, salt, start, stop)

    def _groups(self, hashes: list, salt, start: int, stop: int):
        """``groups`` when trace blocks do not align with engine blocks."""
        bs, tb = self.block_size, self.trace_block
        j = start
        while j < stop:
            i = ((j + 1) * bs - 1) // tb
            lo, hi = (i * tb) // bs, ((i + 1) * tb) // bs
            yield ((hashes[i], i) if salt is None else (salt, hashes[i], i)), lo, hi
            j = hi

    # -- the free queue -------------------------------------------------------------------------
    def _fresh(self, total_blocks: int) -> None:
        """The queue of a cache that holds nothing yet: every block, never used (a real segment, which
        the block names, set after this, read)."""
        self.queue.clear()
        self.gone = 0
        self.queued = total_blocks
        if total_blocks > 0:
            self.seq += 1
            self.queue.append([FRESH, total_blocks, None])

    def _settle(self) -> None:
        """The queue was only counted (``countable``, no own segment): make it one DEAD segment."""
        self.queue.clear()
        self.gone = 0
        if self.queued:
            self.seq += 1
            self.queue.append([DEAD, self.queued, None])

    def _push_segment(self, kind: int, blocks: int, owner: int | None) -> None:
        if blocks <= 0:
            return
        if self.countable and not self.segments:
            if kind != OWN:  # nothing of value queued: only the count matters
                self.queued += blocks
                return
            self._settle()
        self.queued += blocks
        if kind != OWN and self.queue:  # merge with a tail segment of no value
            tail = self.queue[-1]
            if tail[0] < OWN:
                tail[1] += blocks
                return
        self.seq += 1
        if kind == OWN:
            seg = self.segments[owner] = [OWN, blocks, owner, 0, self.seq]
            self.queue.append(seg)
        else:
            self.queue.append([kind, blocks, owner])

    def _push_run(self, e: Entry, start: int, blocks: int) -> None:
        """Queue blocks ``[start, start + blocks)`` of ``e`` (cached, unheld) at the tail."""
        self.queued += blocks
        self.seq += 1
        run = [RUN, blocks, e, start, self.seq]
        self.queue.append(run)
        runs = e.runs
        k = len(runs)
        while k and runs[k - 1][3] > start:
            k -= 1
        runs.insert(k, run)

    def _gone(self, seg: list) -> None:
        """``seg`` leaves the queue's middle: left there GONE, with no blocks; the queue is compacted when
        most of it is GONE (a replay of many hits and few evictions would otherwise keep them all)."""
        seg[0], seg[1], seg[2] = GONE, 0, None
        self.gone += 1
        if self.gone > 64 and 2 * self.gone > len(self.queue):
            queue = self.queue
            live = [s for s in queue if s[0] != GONE]
            queue.clear()
            queue.extend(live)
            self.gone = 0

    def spare(self) -> int:
        """Blocks ``take`` gives up before the first that caches something a lookup could reuse (an own
        segment's or an entry's run): taking no more than this changes no request's hit."""
        if self.countable and not self.segments:  # (the queue is only counted: it caches nothing)
            return self.queued
        spare = 0
        for segment in self.queue:
            kind = segment[0]
            if kind == OWN or kind == RUN:
                break
            if kind != GONE:
                spare += segment[1]
        return spare

    def take(self, n: int) -> None:
        """Take ``n`` blocks from the head of the free queue, evicting what they cached."""
        self.queued -= n
        if self.countable and not self.segments:  # nothing of value to evict: only counted
            return
        queue = self.queue
        names = self.names
        entry = queue[0]
        if entry[1] > n and names is None and (entry[0] != RUN or self.tiers is None):  # (the usual case)
            entry[1] -= n
            return
        write_back = self.tiers is not None and not self.tiers.write_through
        while n > 0:
            entry = queue[0]
            if entry[1] > n:  # a run of blocks: its tail blocks go first, so its prefix stays cached
                entry[1] -= n  # (it stays at the head)
                if write_back and entry[0] == RUN:
                    self._write(entry[2], entry[3] + entry[1], n, True)
                if names is not None:
                    names.evicted(entry[4] if len(entry) > 3 else None, entry, entry[1], entry[1] + n)
                return
            queue.popleft()
            kind = entry[0]
            if kind == GONE:
                self.gone -= 1
                continue
            n -= entry[1]
            if names is not None:
                names.evicted(entry[4] if len(entry) > 3 else None, entry, 0, entry[1])
            if kind == RUN:
                e = entry[2]
                if write_back:
                    self._write(e, entry[3], entry[1], True)
                runs = e.runs
                if runs[0] is entry:  # (usually its lowest run: list.remove compares the others first)
                    del runs[0]
                else:
                    runs.remove(entry)
                if not runs and not e.top:
                    entries = self.entries
                    for key in e.keys:
                        del entries[key]
            elif kind == OWN:
                del self.segments[entry[2]]

    def _write(self, e: Entry, start: int, count: int, down: bool = False) -> None:
        """Write ``e``'s blocks ``[start, start + count)`` to the first lower tier, key by key (``down``:
        the highest first, as an eviction meets them)."""
        per = self.per
        if len(e.keys) == 1:
            self.tiers.write(e.keys[0], start, count)
            return
        stop = start + count
        slices = range(start // per, -(-stop // per))
        for j in reversed(slices) if down else slices:
            a = j * per
            lo = start if start > a else a
            hi = stop if stop < a + per else a + per
            self.tiers.write(e.keys[j], lo - a, hi - lo)

    def _drop(self, e: Entry) -> None:
        """``e`` caches nothing any more: its keys leave the map."""
        entries = self.entries
        for key in e.keys:
            del entries[key]

    def _split(self, e: Entry, a: int) -> Entry:
        """Cut ``e`` at offset ``a`` (a key boundary, 0 < a < size): ``e`` keeps the blocks below, a new
        entry (returned, its keys pointing to it) takes the rest, holdings and queued runs split between
        them (a run across the cut becomes two queue items in its place, the upper first, as the
        per-key runs were). Holders past ``a`` go on into the new one (``Entry.next``). An entry left
        with nothing cached leaves the map. Rare: only where a request's keys meet an entry after its
        first (a trace whose hashes are not chained)."""
        k = a // self.per
        f = Entry(e.keys[k:], e.lo + a, e.size - a)
        del e.keys[k:]
        e.size = a
        f.next, e.next = e.next, f
        if e.held is None:
            if e.top > a:
                f.top, e.top = e.top - a, a
        else:
            lower: dict[int, int] = {}
            upper: dict[int, int] = {}
            for count, holders in e.held.items():
                low = count if count < a else a
                lower[low] = lower.get(low, 0) + holders
                if count > a:
                    upper[count - a] = holders
            e.held, e.top = lower, max(lower)
            if upper:
                f.held, f.top = upper, max(upper)
        keep = []
        for run in e.runs:
            start, blocks = run[3], run[1]
            if start >= a:
                run[2], run[3] = f, start - a
                f.runs.append(run)
                continue
            keep.append(run)
            if start + blocks > a:  # across the cut
                self.seq += 1
                upper_run = [RUN, start + blocks - a, f, 0, self.seq]
                run[1] = a - start
                f.runs.append(upper_run)
                queue = self.queue
                for i, seg in enumerate(queue):
                    if seg is run:
                        queue.insert(i, upper_run)
                        break
        e.runs = keep
        if e.ids is not None:
            f.ids = e.ids[a:]
            del e.ids[a:]
        entries = self.entries
        for key in f.keys:
            entries[key] = f
        if not e.top and not e.runs:
            self._drop(e)
        if not f.top and not f.runs:
            self._drop(f)
        self.splits += 1
        return f

    def _normalize(self, chain: Chain) -> None:
        """Rewrite ``chain``'s entries after cuts (``_split``): each cut entry it holds past is followed
        by the one above it."""
        chain.entries = [e for e, _ in chain.counts()]
        chain.epoch = self.splits

    # -- admission ------------------------------------------------------------------------------
    def lookup(self, req: "Request") -> Hit | None:
        """The longest cached prefix ``req`` (admitted with nothing computed) can reuse, or None."""
        if self.trace_block is None and req.index not in self.segments:  # no hashes, no own segment
            return None
        hashes = req.prefix_hashes
        if (self.plain and hashes and req.lora_adapter is None and (hashes[0], 0) not in self.entries
                and req.index not in self.segments):  # its first key is not cached (most admissions)
            return None
        bs = self.block_size
        limit = req.num_tokens - 1  # the last token is always computed
        hashed_all = self.hashed_blocks(req)
        hashed = min(hashed_all, -(-limit // bs))
        keys = []
        claimed = shared = 0
        if hashed:
            get = self.entries.get
            cur = None  # the entry the previous key was in
            for key, lo, hi in self.groups(req, 0, hashed):
                e = get(key)
                if e is None:
                    break
                want = (hi if hi < hashed else hashed) - lo
                a = lo - e.lo  # (its key's first block in the entry)
                top = e.top - a
                if top < want:
                    got = e.reach(a) - a
                    if got > want:
                        got = want
                    if got <= 0:
                        break
                    claimed += got - top if top > 0 else got
                else:
                    got = want
                if e is cur:
                    keys[-1] = (e, keys[-1][1], a + got)
                else:
                    keys.append((e, a, a + got))
                    cur = e
                shared = lo + got
                if got < want:
                    break
        loaded, reads, touched = 0, None, None
        if self.tiers is not None and shared < hashed:  # the rest of the prefix may be in a lower tier
            reads, touched = {}, []
            pos = shared
            for key, lo, hi in self.groups(req, shared, hashed):
                start = pos - lo
                want = (hi if hi < hashed else hashed) - pos
                level, n = self.tiers.find(key, start, want)
                if not n:
                    break
                reads[level] = reads.get(level, 0) + n
                touched.append((level, key))
                pos += n
                if n < want:
                    break
            loaded = pos - shared
        own = 0
        seg = self.segments.get(req.index)
        if seg is not None and shared + loaded == hashed_all:
            own = min(seg[1], -(-limit // bs) - shared - loaded)
            claimed += own
        blocks = shared + loaded + own
        if not blocks:
            return None
        if loaded:
            return Hit(keys, shared, own, min(blocks * bs, limit), claimed, loaded, reads, touched)
        return Hit(keys, shared, own, min(blocks * bs, limit), claimed)

    def _held_parts(self, keys: list) -> list:
        """A hit's (entry, first, end) as (entry, blocks) a chain holds: an entry its keys meet after
        its first is cut there, and one cut since the lookup goes on in the entry above."""
        parts = []
        for e, start, end in keys:
            while start >= e.size:  # (cut since the lookup below where it starts)
                start -= e.size
                end -= e.size
                e = e.next
            if start:
                e = self._split(e, start)
                end -= start
            while end > e.size:
                parts.append((e, e.size))
                end -= e.size
                e = e.next
            parts.append((e, end))
        return parts

    def claim(self, req: "Request", hit: Hit) -> int:
        """Give ``req`` the blocks of ``hit`` (its first ``hit.blocks`` blocks); returns how many of
        them left the free queue (a block another request of the same batch claimed first does
        not: ``hit.claimed``, counted when the batch was built, is then an overestimate)."""
        claimed = hit.own
        chain = None
        parts = ()
        if hit.keys:
            parts = self._held_parts(hit.keys)
            chain = Chain(self.splits)
            for e, got in parts:
                if got > e.top:  # its blocks [top, got) leave the runs at the bottom of the entry's queued blocks
                    runs = e.runs
                    while runs and runs[0][3] < got:
                        run = runs[0]
                        end = run[3] + run[1]
                        if end <= got:
                            claimed += run[1]
                            runs.pop(0)
                            self._gone(run)
                        else:
                            claimed += got - run[3]
                            run[1] = end - got
                            run[3] = got
                            break
                e.hold(got)
                chain.entries.append(e)
            chain.blocks = hit.shared
        self.queued -= claimed - hit.own
        req.cached_keys = chain
        seg = self.segments.pop(req.index, None)
        if self.names is not None:
            req.block_table = self.names.table(parts, hit.own, seg[4] if seg is not None else None)
        if seg is not None:  # what it does not reuse now is stale: plain free blocks, in place
            self.queued -= hit.own
            if hit.own >= seg[1]:
                self._gone(seg)
            else:
                seg[0], seg[1], seg[2] = DEAD, seg[1] - hit.own, None
        return claimed

    # -- while running ----------------------------------------------------------------------------
    def register(self, req: "Request", hashes: list | None = None) -> None:
        """``req`` computed more of its prompt: its newly full hashed blocks become cached (shared),
        up to the first that is cached already (computed twice at once: both requests were admitted
        before either had it; this copy stays private, as vLLM too caches one of the two).

        ``hashes`` (KV retention, replay/core/kv/retention.py): a finished request's context continues in
        its session's next call, whose hashes cover this request's prompt and generated tokens; its
        full blocks past its own hashed ones become cached under those keys.

        It runs once per prefill chunk, over every new hash block of a prompt (most of a Mooncake
        replay's caching cost): a new key extends the entry the request holds to its end (one dict
        item per key, no object), and ``hashed_blocks``, ``Entry.unhold`` / ``hold`` are inline."""
        chain = req.cached_keys
        if hashes is None and chain is not None and chain.cap is not None and self.plain and self.names is None:
            # the usual case, first: it alone holds the entry its chain ends in, to within its last key,
            # and caches its next blocks there (unsalted keys, no tier, no block ids)
            full = req.num_computed_tokens // self.block_size
            if full > chain.cap:
                full = chain.cap
            lo = chain.blocks
            if full <= lo:
                return
            entries = chain.entries
            if entries and chain.epoch == self.splits and req.lora_adapter is None:
                e = entries[-1]
                end = e.lo + e.size
                if e.held is None and end - lo < self.per and not e.runs and e.next is None:
                    if full <= end:  # within its last key
                        e.top = full - e.lo
                        chain.blocks = full
                        return
                    per = self.per
                    i = end // per
                    stop = -(-full // per)
                    keys = list(zip(req.prefix_hashes[i:stop], range(i, stop)))
                    cache = self.entries
                    if cache.keys().isdisjoint(keys):  # new keys: e takes them
                        cache.update(dict.fromkeys(keys, e))
                        e.keys += keys
                        e.size += len(keys) * per
                        e.top = full - e.lo
                        chain.blocks = full
                        return
        bs = self.block_size
        if hashes is None:
            hashes = req.prefix_hashes
            if not hashes:
                return
            if chain is None:
                chain = req.cached_keys = Chain(self.splits)
            full = req.num_computed_tokens // bs
            cap = chain.cap  # (its hashed blocks: fixed for the request, worked out once)
            if cap is None:
                cap = chain.cap = self.hashed_blocks(req)
            if cap < full:
                full = cap
        else:
            if chain is None:
                chain = req.cached_keys = Chain(self.splits)
            full = min(req.num_computed_tokens, len(hashes) * self.trace_block) // bs
        lo = chain.blocks
        if full <= lo:
            return
        if chain.epoch != self.splits:
            self._normalize(chain)
        tiers = self.tiers
        through = tiers is not None and tiers.write_through  # each block it caches is written to the tier
        entries = chain.entries
        e = entries[-1] if entries else None  # the entry its chain ends in
        cache = self.entries
        salt = req.tenant if self.per_tenant else None
        if req.lora_adapter is not None:  # (as in groups)
            salt = ("lora", req.lora_adapter, salt)
        tb, per = self.trace_block, self.per
        while lo < full:  # from block ``lo`` on, key by key (trace block i: engine blocks [klo, khi))
            if per and e is not None and lo == e.lo + e.size and e.next is None:
                # it holds e to its end: e takes its keys from here on while none is cached yet (one dict
                # item each: most of a Mooncake replay's hash blocks are only ever this)
                i = lo // per
                stop = -(-full // per)
                keys = list(zip(hashes[i:stop], range(i, stop)) if salt is None else
                            zip(repeat(salt), hashes[i:stop], range(i, stop)))
                if cache.keys().isdisjoint(keys):  # (the usual case: none is cached yet)
                    new = len(keys)
                    cache.update(dict.fromkeys(keys, e))
                else:
                    put = cache.setdefault
                    new = 0
                    for key in keys:
                        if put(key, e) is not e:  # (cached already: the general path below)
                            break
                        new += 1
                if new:
                    if new < len(keys):
                        del keys[new:]
                    e.keys += keys
                    e.size += new * per
                    if e.ids is not None:
                        e.ids.extend([None] * (new * per))
                    end = (i + new) * per
                    if end > full:
                        end = full
                    if e.held is None:  # its only holder
                        e.top = end - e.lo
                    else:
                        e.unhold(lo - e.lo)
                        e.hold(end - e.lo)
                    chain.blocks = end
                    if through:
                        for key in keys:
                            got = (end if end < key[-1] * per + per else key[-1] * per + per) - key[-1] * per
                            tiers.write(key, 0, got)
                    lo = end
                    continue
            if per:
                i = lo // per
                klo = i * per
                khi = klo + per
            else:
                i = ((lo + 1) * bs - 1) // tb
                klo, khi = (i * tb) // bs, ((i + 1) * tb) // bs
            key = (hashes[i], i) if salt is None else (salt, hashes[i], i)
            want = (khi if khi < full else full) - lo
            if e is not None and lo < e.lo + e.size and e.keys[(klo - e.lo) // per if per else 0] == key:
                held = lo - e.lo  # it goes on in the entry it holds: up to the first block cached already
                runs = e.runs
                if held < e.top or (runs and runs[0][3] == held):
                    return
                got = want if not runs or runs[0][3] >= held + want else runs[0][3] - held
                if e.held is None:  # its only holder
                    e.top = held + got
                else:
                    e.unhold(held)
                    e.hold(held + got)
            else:
                f = cache.get(key)
                if f is not None and f.lo != klo:  # its keys meet the entry after its first
                    f = self._split(f, klo - f.lo)
                    if not f.top and not f.runs:  # (it cached nothing from there on)
                        f = None
                if f is None:  # born held
                    got = want
                    e = cache[key] = Entry([key], klo, khi - klo, want)
                    entries.append(e)
                else:  # (an entry holds a cached block: if not its first, the blocks below the first run)
                    runs = f.runs
                    if f.top or runs[0][3] == 0:
                        return
                    got = runs[0][3] if runs[0][3] < want else want
                    f.hold(got)
                    e = f
                    entries.append(e)
            chain.blocks = lo + got
            if through:
                tiers.write(key, lo - klo, got)
            if got < want:
                return
            lo += got

    # -- release --------------------------------------------------------------------------------
    def release(self, req: "Request", blocks: int, may_return: bool, keep_chain: bool = False) -> int:
        """``req`` gives back its ``blocks`` blocks; returns how many no running request holds any
        more. Full blocks keep their KV, cached; a request that ``may_return`` (preempted by
        recompute) keeps its own blocks as a segment only it can hit. ``keep_chain`` (KV retention):
        its hashed blocks stay held, by its chain (``req.cached_keys``, which the caller takes over
        and gives back with ``unpin``)."""
        chain = req.cached_keys
        if chain is None and self.countable and not self.purge:
            # a trace without hashes: only a preempted request's own blocks may be reused (as below)
            full = min(req.num_computed_tokens // self.block_size, blocks)
            if may_return and full > 0:
                self._push_segment(DEAD, blocks - full, None)
                self._push_segment(OWN, full, req.index)
            else:
                self._push_segment(DEAD, blocks, None)
            return blocks
        shared = chain.blocks if chain is not None else 0
        full = max(min(req.num_computed_tokens // self.block_size, blocks), shared)
        hashed = self.hashed_blocks(req)
        if self.purge and req.tenant in self.purge and req.status.is_terminal:
            return self._purge(req, blocks, full, hashed)
        names = self.names
        # freed in reverse block order: the partial last block, own blocks, private hashed blocks, shared ones
        self._push_segment(DEAD, blocks - full, None)
        if names is not None:
            names.free(req.block_table[full:blocks])
        own = full - max(hashed, shared)
        if own > 0:
            self._push_segment(OWN if may_return else DEAD, own, req.index)
            if names is not None:
                names.released_own(self.seq if may_return else None, req.block_table[full - own:full])
        private = min(full, hashed)
        if private > shared:
            self._release_private(req, shared, private)
        freed = blocks - shared
        if keep_chain:
            return freed
        if chain is not None:
            freed += self._let_go(chain)
            req.cached_keys = None
        return freed

    def _let_go(self, chain: Chain) -> int:
        """``chain``'s holder lets go of its entries, the last first: the blocks no one else holds are
        queued as runs, highest first (``unhold`` and ``_push_run`` inline: once per entry of every
        released prompt); returns how many."""
        if chain.epoch != self.splits:
            self._normalize(chain)
        queue = self.queue
        seq = self.seq
        freed = 0
        end = chain.blocks
        for e in reversed(chain.entries):
            count = end - e.lo
            end = e.lo
            if e.held is None:  # its only holder
                top = e.top = 0
            else:
                e.unhold(count)
                top = e.top
            if count > top:  # the blocks only it held: queued, highest first
                n = count - top
                seq += 1
                run = [RUN, n, e, top, seq]
                queue.append(run)
                runs = e.runs
                if runs:  # (queued runs lie above every holding: this one goes first)
                    k = len(runs)
                    while k and runs[k - 1][3] > top:
                        k -= 1
                    runs.insert(k, run)
                else:
                    runs.append(run)
                freed += n
        self.seq = seq
        self.queued += freed
        return freed

    def unpin(self, chain: Chain) -> int:
        """A chain that ``release(keep_chain=True)`` kept held lets go (KV retention); returns how
        many blocks no holder holds any more (queued, cached, as a release queues them)."""
        return self._let_go(chain)

    def offload(self, req: "Request", blocks: int) -> int:
        """``req`` ended and its hashed blocks go to the first lower tier rather than stay cached in
        GPU memory (KV retention ``offload``): they are written there, and the blocks no running
        request holds become plain free blocks at the head of the free queue, the first reused.
        Returns how many blocks no running request holds any more."""
        chain = req.cached_keys
        counts = list(chain.counts()) if chain is not None else []
        for e, count in counts:
            self._write(e, 0, count)
        freed = self.release(req, blocks, False)
        queue = self.queue
        for e, count in counts:  # the runs this release queued: those below what it held
            for run in [run for run in e.runs if run[3] < count]:  # (each moved to the head, in turn)
                e.runs.remove(run)
                queue.appendleft([DEAD, run[1], None])
                self._gone(run)
            if not e.top and not e.runs and self.entries.get(e.keys[0]) is e:
                self._drop(e)
        return freed

    def _one_key(self, e: Entry, lo: int, hi: int) -> Entry | None:
        """The entry of the key whose blocks are ``[lo, hi)``, cut out of ``e`` (the entry its key maps
        to) so that it holds that key alone; None if that part caches nothing."""
        if e.lo < lo:
            e = self._split(e, lo - e.lo)
            if not e.top and not e.runs:
                return None
        if e.lo + e.size > hi:
            self._split(e, hi - e.lo)
        return e if e.top or e.runs else None

    def _purge(self, req: "Request", blocks: int, full: int, hashed: int) -> int:
        """A purged tenant's request ended: none of its blocks stays cached, and every entry of its
        prompt is forgotten by the lower tiers and, where no running request holds it, by the GPU."""
        chain = req.cached_keys
        names = self.names
        freed = blocks - (chain.blocks if chain is not None else 0)
        if names is not None and blocks:
            names.free(req.block_table[blocks - freed:blocks])
        if chain is not None:
            for e, count in reversed(list(chain.counts())):
                e.unhold(count)
                if count > e.top:
                    freed += count - e.top
                    if names is not None:
                        names.free_cached(e, e.top, count)
            req.cached_keys = None
        self._push_segment(DEAD, freed, None)
        seg = self.segments.pop(req.index, None)
        if seg is not None:  # its own blocks of an earlier preemption
            seg[0], seg[2] = DEAD, None
            if names is not None:
                names.evicted(seg[4], (OWN,), 0, 0)
        cache = self.entries
        for key, lo, hi in self.groups(req, 0, min(full, hashed)) if hashed else ():
            if self.tiers is not None:
                self.tiers.drop(key)
            e = cache.get(key)
            if e is None:
                continue
            if len(e.keys) > 1:
                e = self._one_key(e, lo, hi)
                if e is None:
                    continue
            for run in e.runs:  # its queued blocks: plain free blocks, in place
                if names is not None:
                    names.free_cached(e, run[3], run[3] + run[1])
                run[0], run[2] = DEAD, None
            e.runs = []
            if not e.top:
                del cache[key]
        return freed

    def forget(self, req: "Request") -> None:
        """A purged tenant's request ended while waiting (dropped after a preemption, say): it holds
        no GPU block, but what it cached before stays cached unless purged here: its own segment,
        and every entry of its prompt, from the lower tiers and (where no running request holds it)
        the GPU."""
        hashed = self.hashed_blocks(req)
        self._purge(req, 0, hashed, hashed)

    def _release_private(self, req: "Request", start: int, stop: int) -> None:
        """Blocks ``[start, stop)`` it computed but did not share: each becomes the cached copy
        unless one is cached already (then it is plainly free), in reverse block order."""
        cache = self.entries
        names = self.names
        for key, lo, hi in reversed(list(self.groups(req, start, stop))):
            e = cache.get(key)
            if e is None:
                e = cache[key] = Entry([key], lo, hi - lo)
            k = lo - e.lo  # (its key's first block in the entry)
            a, b = max(start, lo) - e.lo, min(stop, hi) - e.lo
            if names is not None:  # the gaps it caches keep their ids; its copies of cached blocks are freed
                names.release_private(e, req.block_table, a, b)
            cached = [(0, e.top)] + [(run[3], run[3] + run[1]) for run in e.runs]
            gaps = []
            pos = b
            for c_lo, c_hi in reversed(cached):  # walk down from b: gaps become runs, cached parts dead
                if c_hi <= a:
                    break
                if c_hi < pos:
                    gaps.append((c_hi, pos))
                    self._push_run(e, c_hi, pos - c_hi)
                    pos = c_hi
                low = max(c_lo, a)
                if low < pos:
                    self._push_segment(DEAD, pos - low, None)
                    pos = low
            if pos > a:
                gaps.append((a, pos))
                self._push_run(e, a, pos - a)
            if self.tiers is not None and self.tiers.write_through:  # the copies it caches now
                for g_lo, g_hi in gaps:
                    self.tiers.write(key, g_lo - k, g_hi - g_lo)

    # -- questions from the KV manager and the batch builder ----------------------------------
    def shared_blocks(self, req: "Request") -> int:
        """Of ``req``'s hashed blocks, how many other running requests hold too."""
        chain = req.cached_keys
        if chain is None:
            return 0
        total = 0
        for e, count in chain.counts():
            other = e.others_max(count)
            total += count if other >= count else other
        return total

    def sole_blocks(self, req: "Request", into: dict) -> None:
        """Record in ``into`` (entry -> (start, end)) the hashed blocks only ``req`` holds."""
        chain = req.cached_keys
        if chain is None:
            return
        for e, count in chain.counts():
            other = e.others_max(count)
            if other < count:
                into[e] = (other, count)

    @staticmethod
    def covered(hits, sole: dict) -> int:
        """How many blocks of ``sole`` (entry -> (start, end): blocks preempted or preemptable requests alone
        hold) at least one of ``hits`` (admissions of the batch being built) reuses, each block once: a
        hit taking them does not find them free, and a victim whose blocks a hit reuses does not free them."""
        spans: dict = {}
        for hit in hits:
            for e, start, got in hit.keys:
                if e in sole:
                    spans.setdefault(e, []).append((start, got))
        total = 0
        for e, parts in spans.items():
            lo, hi = sole[e]
            reach = lo  # blocks below it counted already
            for start, got in sorted(parts):
                a = start if start > reach else reach
                b = got if got < hi else hi
                if b > a:
                    total += b - a
                    reach = b
        return total

    def records(self) -> list:
        """Every entry once (the map has one item per key)."""
        return list(dict.fromkeys(self.entries.values()))  # (an Entry hashes by identity)

    def check(self, total_blocks: int, used: int, running, chains: list | None = None) -> None:
        """The free queue holds exactly the blocks no running request holds; holdings add up
        (``chains``: each running request's ``cached_keys.counts()`` as a list, or None, if read already).

        Tests call it after every event of their replays, so it is written for speed (whole-object
        comparisons, one pass per structure); tests/test_kv_check.py corrupts each structure it reads
        and sees it fail."""
        queue = self.queue
        entries = self.entries
        assert self.queued == total_blocks - used, (self.queued, total_blocks, used)
        queued = set(map(id, queue))
        assert not self.countable or (not entries and self.names is None)
        if not self.countable or self.segments:  # (else only counted: the segments are stale)
            assert self.queued == sum(map(itemgetter(1), queue))
            assert self.gone == list(map(itemgetter(0), queue)).count(GONE)
        held: dict = {}  # entry -> {blocks held: how many running requests hold that many}
        running = list(running)
        if chains is None:
            chains = [None if req.cached_keys is None else list(req.cached_keys.counts()) for req in running]
        for req, pairs in zip(running, chains, strict=True):
            chain = req.cached_keys
            if chain is None:
                continue
            assert not pairs or pairs[-1][0].lo < chain.blocks <= pairs[-1][0].lo + pairs[-1][0].size, chain.blocks
            for e, count in pairs:
                assert 0 < count <= e.size
                mine = held.get(e)
                if mine is None:
                    held[e] = {count: 1}
                else:
                    mine[count] = mine.get(count, 0) + 1
        records = self.records()
        # every key maps to the one entry that lists it, and every entry's keys are in the map
        mapped: dict = {}
        for e in records:
            mapped.update(zip(e.keys, repeat(e)))
        assert mapped == entries and sum(map(len, map(attrgetter("keys"), records))) == len(entries), \
            sorted(set(mapped.items()) ^ set(entries.items()), key=repr)[:4]
        per = self.per
        for e in records:
            key = e.keys[0]
            if per:
                assert e.lo == key[-1] * per and e.size == len(e.keys) * per, (key, e.lo, e.size)
            else:
                assert len(e.keys) == 1
            counts = held.pop(e, None)
            if counts is None:  # no running request holds it: it only has queued runs
                assert e.held is None and not e.top and e.runs, (key, e.held, e.top, e.runs)
            else:
                assert e.held is None or e.held, key  # (a dict only while someone holds it)
                holdings = e.holdings()
                assert holdings == counts, (key, holdings, counts)
                assert e.top == max(counts)
            below = e.top
            for run in e.runs:  # runs: queued, disjoint, above every holding, within the entry
                assert id(run) in queued and run[0] == RUN and run[1] > 0 and run[2] is e
                assert below <= run[3] and run[3] + run[1] <= e.size, (below, run)
                below = run[3] + run[1]
        assert not held, held  # every held entry is in the map
        for seg in queue:
            kind = seg[0]
            if kind == RUN:
                e = seg[2]
                assert entries.get(e.keys[0]) is e and seg in e.runs
            assert seg[1] > 0 or kind == GONE, seg
        for owner, seg in self.segments.items():
            assert id(seg) in queued and seg[0] == OWN and seg[2] == owner
        for tier in self.tiers.tiers if self.tiers is not None else ():
            assert tier.used == sum(m.bit_count() for m in tier.store.values()) <= max(tier.capacity, 0)
            assert all(tier.store.values())

    def clear(self, total_blocks: int) -> None:
        """Everything lost (the replica failed), its own lower tiers too."""
        if self.tiers is not None:
            self.tiers.lose_local()
        if self.names is not None:
            self.names.clear(self)
        self.queue.clear()
        self.entries.clear()
        self.segments.clear()
        self.queued = 0
        self._fresh(total_blocks)
