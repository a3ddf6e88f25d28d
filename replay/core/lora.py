"""Multi-LoRA serving (vLLM's --enable-lora): which adapters a replica holds and what loading one costs.

A replica has ``max_loras`` adapter slots in GPU memory and an LRU cache of ``max_cpu_loras`` adapters
in host memory, as vLLM's ``LRUCacheWorkerLoRAManager``. A request naming an adapter (trace column
``lora_adapter``) that is not in a GPU slot when it is admitted loads it first: from host memory when
cached there (``lora_host_gbps``), else from disk (``lora_disk_gbps``); the load is part of the
admitting iteration, so it appears in the request's TTFT. The batch builder never admits a request
whose adapter would make more than ``max_loras`` distinct adapters among the running requests (vLLM's
scheduler: ``len(scheduled_loras) == max_loras`` skips the request), so a slot not in use always
exists for the adapter to load into. An adapter's size is ``rank x params_per_rank x dtype bytes``,
``params_per_rank`` being what the runner's model adds per unit of rank (``Runner.lora_params_per_rank``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from servelab.common.errors import ServelabError

if TYPE_CHECKING:
    from servelab.replay.core.request import Request

# (the configs below are EngineConfigs, not imported: replay/core/engine_config.py checks lora_ranks with parse_ranks)


def parse_ranks(specs: tuple[str, ...]) -> dict[str, int]:
    """``("support=64", "sql=8")`` -> ``{"support": 64, "sql": 8}`` (config key ``lora_ranks``)."""
    ranks: dict[str, int] = {}
    for spec in specs:
        name, eq, value = spec.rpartition("=")
        if not eq or not name:
            raise ServelabError(f"lora_ranks: '{spec}' is not NAME=RANK")
        try:
            rank = int(value)
        except ValueError:
            raise ServelabError(f"lora_ranks: '{spec}': the rank '{value}' is not an integer") from None
        if rank < 1:
            raise ServelabError(f"lora_ranks: '{spec}': the rank must be >= 1")
        ranks[name] = rank
    return ranks


class AdapterSlots:
    """One replica's adapters: GPU slots and the host cache, both least recently used first.

    Invariant: the adapters of running requests are in GPU slots (an adapter is evicted only when no
    running request uses it), and there are at most ``max_loras`` of them.
    """

    __slots__ = ("max_loras", "max_cpu_loras", "default_rank", "ranks", "bytes_per_rank", "host_bytes_per_s",
                 "disk_bytes_per_s", "gpu", "cpu", "loads", "load_s")

    def __init__(self, config: Any, params_per_rank: int, dtype_bytes: int):
        self.max_loras = config.max_loras
        self.max_cpu_loras = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
        self.default_rank = config.lora_rank
        self.ranks = parse_ranks(config.lora_ranks)
        self.bytes_per_rank = params_per_rank * dtype_bytes
        self.host_bytes_per_s = config.lora_host_gbps * 1e9
        self.disk_bytes_per_s = config.lora_disk_gbps * 1e9
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.loads = [0, 0]  # adapters loaded from host memory, from disk
        self.load_s = 0.0  # seconds spent loading adapters

    def rank(self, adapter: str) -> int:
        return self.ranks.get(adapter, self.default_rank)

    def adapter_bytes(self, adapter: str) -> int:
        return self.rank(adapter) * self.bytes_per_rank

    def slot_bytes(self) -> int:
        """GPU memory the slots reserve: ``max_loras`` adapters of the largest rank (vLLM sizes its
        stacked LoRA tensors for ``max_lora_rank``)."""
        return self.max_loras * max([self.default_rank, *self.ranks.values()]) * self.bytes_per_rank

    def resident(self, adapter: str) -> bool:
        return adapter in self.gpu

    @staticmethod
    def in_use(running: list["Request"]) -> set[str]:
        """The distinct adapters of ``running``."""
        return {r.lora_adapter for r in running if r.lora_adapter is not None}

    def activate(self, adapter: str, running: list["Request"]) -> float:
        """``adapter`` is needed by a request being admitted (already in ``running``): returns the
        seconds to load it into a GPU slot (0 when it is there)."""
        gpu = self.gpu
        if adapter in gpu:
            gpu.move_to_end(adapter)
            return 0.0
        if len(gpu) >= self.max_loras:
            used = self.in_use(running)
            victim = next((a for a in gpu if a not in used), None)
            if victim is None:  # the builder's cap makes this impossible
                raise RuntimeError(f"no free LoRA slot for '{adapter}': {len(used)} adapters in use, "
                                   f"max_loras = {self.max_loras}")
            del gpu[victim]
        gpu[adapter] = None
        size = self.adapter_bytes(adapter)
        if adapter in self.cpu:
            self.cpu.move_to_end(adapter)
            self.loads[0] += 1
            seconds = size / self.host_bytes_per_s
        else:  # read from disk into the host cache, then copied to the GPU
            if self.max_cpu_loras:
                if len(self.cpu) >= self.max_cpu_loras:
                    self.cpu.popitem(last=False)
                self.cpu[adapter] = None
            self.loads[1] += 1
            seconds = size / self.disk_bytes_per_s + size / self.host_bytes_per_s
        self.load_s += seconds
        return seconds

    def batch_work(self, items) -> tuple[int, list[int]]:
        """For a batch's ``(request, tokens)`` items: the sum of tokens x rank over items with an adapter,
        and the rank of each distinct adapter (the weights the shrink/expand kernels read)."""
        rank_tokens = 0
        seen: dict[str, int] = {}
        for req, n in items:
            adapter = req.lora_adapter
            if adapter is not None:
                r = seen.get(adapter)
                if r is None:
                    r = seen[adapter] = self.rank(adapter)
                rank_tokens += n * r
        return rank_tokens, list(seen.values())

    def meta(self) -> dict:
        return {"loads_from_host": self.loads[0], "loads_from_disk": self.loads[1], "load_s": self.load_s}


def make_slots(config: Any, runner) -> AdapterSlots | None:
    """A replica's adapter slots, or None when LoRA is off (``max_loras`` = 0)."""
    if not config.max_loras:
        return None
    if runner.lora_params_per_rank is None or runner.needs_block_tables:
        raise ServelabError(f"max_loras = {config.max_loras}: runner '{runner.name}' cannot serve LoRA adapters "
                            "(the adapters' size comes from the runner's model: use the roofline runner)")
    return AdapterSlots(config, runner.lora_params_per_rank, runner.lora_dtype_bytes)


def reserved_tokens(config: Any, runner, kv_bytes_per_token: int) -> int:
    """KV tokens a replica gives up to its adapter slots' GPU memory (0 when LoRA is off)."""
    slots = make_slots(config, runner)
    if slots is None or not kv_bytes_per_token:
        return 0
    return -(-slots.slot_bytes() // kv_bytes_per_token)


def check_trace_adapters(adapters: list, config: Any) -> None:
    """A trace naming adapters needs LoRA serving on (vLLM answers 404 for an unknown model name)."""
    if config.max_loras:
        return
    row = next((i for i, a in enumerate(adapters) if a is not None), None)
    if row is not None:
        raise ServelabError(f"trace column lora_adapter, row {row + 1}: request names adapter '{adapters[row]}' "
                            "but LoRA serving is off: set max_loras (--max-loras N)")


def lora_meta(replicas) -> dict:
    """run.json's ``lora`` section: adapter loads summed over the replicas."""
    slots = [r.lora for r in replicas if r.lora is not None]
    return {"loads_from_host": sum(s.loads[0] for s in slots), "loads_from_disk": sum(s.loads[1] for s in slots),
            "load_s": sum(s.load_s for s in slots)}


__all__ = ["AdapterSlots", "check_trace_adapters", "lora_meta", "make_slots", "parse_ranks", "reserved_tokens"]
