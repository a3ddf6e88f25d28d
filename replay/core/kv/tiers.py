"""KV offload tiers below GPU memory: host DRAM, local SSD (per replica), a remote store (shared).

A tier keeps prefix-cache entries (replay/core/kv/prefix_cache.py: one trace hash block's engine blocks) as
a bit mask of the blocks it holds, least recently used first, up to its capacity in blocks. Blocks
reach the first tier when the GPU evicts them (write-back, the default) or as soon as they are
computed (write-through); a tier that overflows moves its least recently used entry to the next
tier (write-back between tiers; the last one drops it). Writes run in the background: they count
bytes but delay nothing. A prefix-cache lookup that stops in GPU memory continues through the tiers
in order; the blocks it finds there are loaded into GPU memory before the request's prefill
continues, at ``bytes / read bandwidth + latency`` per tier read from, added to the iteration that
admits it (as a swap-in is). A lower-tier hit is never free. With ``preemption = swap`` and a first
tier of the replica's own (host DRAM), swapped-out requests' blocks go there instead of a separate
host pool, beside the cached entries (evicting them if needed), at that tier's bandwidths and latency.

Spec (``EngineConfig.kv_tiers``, one string per tier, top first)::

    NAME:capacity_gb=G[,read_gbps=R][,write_gbps=W][,latency_ms=L][,shared=0|1]

NAME dram, ssd or remote give the defaults below (remote is shared by the cluster's replicas);
any other name needs every field.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from servelab.common.errors import ServelabError

# name -> (read GB/s, write GB/s, latency ms, shared): PCIe 5 x16 host memory, an NVMe drive, a 100 Gb/s network store
DEFAULTS = {
    "dram": (25.0, 25.0, 0.01, False),
    "ssd": (6.0, 3.0, 0.1, False),
    "remote": (12.5, 12.5, 1.0, True),
}


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One KV tier below the GPU: its size, bandwidths, latency and whether replicas share it."""

    name: str
    capacity_gb: float
    read_gbps: float
    write_gbps: float
    latency_ms: float
    shared: bool

    @classmethod
    def parse(cls, spec: str, where: str = "kv_tiers") -> "TierSpec":
        name, _, rest = str(spec).partition(":")
        name = name.strip()
        if not name:
            raise ServelabError(f"{where}: '{spec}' has no tier name (e.g. dram:capacity_gb=64)")
        if not name.replace("_", "").isalnum() or not name.isascii() or name == "gpu":
            raise ServelabError(f"{where}: tier name '{name}' must be letters, digits and _ (and not gpu): "
                                "it names the cached_tokens_<tier> column")
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ServelabError(f"{where}: '{part}' in '{spec}' is not KEY=VALUE")
            values[key.strip()] = value.strip()
        known = ("capacity_gb", "read_gbps", "write_gbps", "latency_ms", "shared")
        for key in values:
            if key not in known:
                raise ServelabError(f"{where}: unknown field '{key}' in '{spec}' (fields: {', '.join(known)})")
        read, write, latency, shared = DEFAULTS.get(name, (None, None, None, False))
        try:
            capacity = float(values["capacity_gb"])
            read = float(values.get("read_gbps", read))
            write = float(values.get("write_gbps", write))
            latency = float(values.get("latency_ms", latency))
        except KeyError:
            raise ServelabError(f"{where}: '{spec}' needs capacity_gb") from None
        except (TypeError, ValueError):
            raise ServelabError(f"{where}: '{spec}': a tier named other than {', '.join(DEFAULTS)} needs "
                                "capacity_gb, read_gbps, write_gbps and latency_ms as numbers") from None
        shared = values.get("shared", "1" if shared else "0") in ("1", "true", "yes")
        if not (capacity >= 0 and read > 0 and write > 0 and latency >= 0):
            raise ServelabError(f"{where}: '{spec}': capacity_gb and latency_ms must be >= 0, bandwidths > 0")
        return cls(name, capacity, read, write, latency, shared)


def parse_tiers(specs: tuple[str, ...], where: str = "kv_tiers") -> tuple[TierSpec, ...]:
    tiers = tuple(TierSpec.parse(spec, where) for spec in specs)
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ServelabError(f"{where}: tier names must differ, got {', '.join(names)}")
    return tiers


class Tier:
    """One store: entry key -> bit mask of the entry's blocks it holds, least recently used first."""

    __slots__ = ("spec", "capacity", "used", "reserved", "store", "bytes_read", "bytes_written")

    def __init__(self, spec: TierSpec, bytes_per_block: int):
        self.spec = spec
        self.capacity = int(spec.capacity_gb * 1e9 // bytes_per_block) if bytes_per_block else 0
        self.used = 0  # blocks held for the prefix cache
        self.reserved = 0  # blocks of requests swapped out to it (the first tier, per replica)
        self.store: OrderedDict = OrderedDict()
        self.bytes_read = 0
        self.bytes_written = 0

    def run_from(self, key, start: int) -> int:
        """How many blocks of entry ``key`` from ``start`` on this tier holds without a gap."""
        mask = self.store.get(key)
        if mask is None:
            return 0
        rest = ~(mask >> start)
        return (rest & -rest).bit_length() - 1

    def put(self, key, mask: int) -> list:
        """Hold the blocks of ``mask`` (most recently used now); returns the entries it evicted to
        make room, least recently used first, as (key, mask)."""
        if self.capacity - self.reserved <= 0:
            return [(key, mask)]
        store = self.store
        old = store.pop(key, 0)
        new = old | mask
        self.used += new.bit_count() - old.bit_count()
        store[key] = new
        return self.make_room()

    def make_room(self) -> list:
        """Evict least recently used entries until what it holds fits; returns them, as (key, mask)."""
        evicted = []
        store = self.store
        while self.used + self.reserved > self.capacity:
            k, m = store.popitem(last=False)
            self.used -= m.bit_count()
            evicted.append((k, m))
        return evicted

    def touch(self, key) -> None:
        # (a swap-out of the same iteration may have evicted it since the batch found it: preemptions
        # come first; the load is still charged here, as if it was read before being overwritten)
        if key in self.store:
            self.store.move_to_end(key)

    def drop(self, key) -> None:
        mask = self.store.pop(key, None)
        if mask is not None:
            self.used -= mask.bit_count()


class TierStack:
    """A replica's tiers, top first (a shared tier is the same ``Tier`` object in every replica's stack)."""

    __slots__ = ("tiers", "bytes_per_block", "write_through", "moved")

    def __init__(self, tiers: list[Tier], bytes_per_block: int, write_through: bool = False):
        self.tiers = tiers
        self.bytes_per_block = bytes_per_block
        self.write_through = write_through
        # bytes this replica's stack copied (written to or read from any of its tiers, a shared one
        # too), ever: the engine logs the difference per step (steps.parquet ``tier_bytes``)
        self.moved = 0

    def write(self, key, lo: int, blocks: int) -> None:
        """Blocks ``[lo, lo + blocks)`` of entry ``key`` go to the first tier (and what it evicts below)."""
        self._write([(key, ((1 << blocks) - 1) << lo)], 0)

    def _write(self, pending: list, level: int) -> None:
        tiers = self.tiers
        while pending and level < len(tiers):
            tier = tiers[level]
            spill = []
            for k, mask in pending:  # (blocks it holds already, e.g. loaded from it, are not written again)
                nbytes = (mask & ~tier.store.get(k, 0)).bit_count() * self.bytes_per_block
                tier.bytes_written += nbytes
                self.moved += nbytes
                spill.extend(tier.put(k, mask))
            pending = spill
            level += 1

    # -- swap preemption: requests' blocks in the first tier (host DRAM), beside the cached ones ---
    def reserve(self, blocks: int) -> bool:
        """Room for a swapped-out request's ``blocks`` in the first tier, evicting cached entries
        (written back below) if needed; False if even an empty tier could not hold them."""
        if not self.has_room(blocks):
            return False
        tier = self.tiers[0]
        tier.reserved += blocks
        self._write(tier.make_room(), 1)
        return True

    def has_room(self, blocks: int) -> bool:
        """Would ``reserve(blocks)`` succeed? Changes nothing."""
        tier = self.tiers[0]
        return tier.reserved + blocks <= tier.capacity

    def unreserve(self, blocks: int) -> None:
        self.tiers[0].reserved -= blocks

    def swap_s(self, blocks: int, out: bool) -> float:
        """Seconds to copy ``blocks`` to (``out``) or from the first tier: bytes / bandwidth + latency."""
        tier = self.tiers[0]
        nbytes = blocks * self.bytes_per_block
        self.moved += nbytes
        if out:
            tier.bytes_written += nbytes
        else:
            tier.bytes_read += nbytes
        return nbytes / ((tier.spec.write_gbps if out else tier.spec.read_gbps) * 1e9) + tier.spec.latency_ms / 1e3

    def find(self, key, start: int, want: int) -> tuple[int, int]:
        """(tier index, blocks) of the first tier holding blocks of entry ``key`` from ``start`` on,
        at most ``want`` of them; (-1, 0) if none does."""
        for level, tier in enumerate(self.tiers):
            n = tier.run_from(key, start)
            if n:
                return level, min(n, want)
        return -1, 0

    def load(self, reads: dict[int, int], keys) -> float:
        """Read ``reads`` (tier index -> blocks) into GPU memory; returns the seconds it takes:
        per tier read from, bytes / read bandwidth + latency (tiers read one after another)."""
        seconds = 0.0
        for level, blocks in reads.items():
            tier = self.tiers[level]
            nbytes = blocks * self.bytes_per_block
            tier.bytes_read += nbytes
            self.moved += nbytes
            seconds += nbytes / (tier.spec.read_gbps * 1e9) + tier.spec.latency_ms / 1e3
        for level, key in keys:
            self.tiers[level].touch(key)
        return seconds

    def drop(self, key) -> None:
        """Forget entry ``key`` in every tier (a purged tenant's blocks)."""
        for tier in self.tiers:
            tier.drop(key)

    def lose_local(self) -> None:
        """The replica failed: its own tiers' contents are gone (a shared store keeps its own)."""
        for tier in self.tiers:
            if not tier.spec.shared:
                tier.store.clear()
                tier.used = tier.reserved = 0


def build_stacks(specs: tuple[TierSpec, ...], replicas: int, bytes_per_block: int,
                 write_through: bool) -> list[TierStack | None]:
    """One stack per replica; a shared tier is one store seen by all of them."""
    if not specs:
        return [None] * replicas
    if not bytes_per_block:
        raise ServelabError("kv_tiers need the KV size per token: use a runner that knows its model "
                            "or set kv_bytes_per_token")
    shared = {s.name: Tier(s, bytes_per_block) for s in specs if s.shared}
    return [TierStack([shared[s.name] if s.shared else Tier(s, bytes_per_block) for s in specs],
                      bytes_per_block, write_through) for _ in range(replicas)]


__all__ = ["DEFAULTS", "Tier", "TierSpec", "TierStack", "build_stacks", "parse_tiers"]
