"""`torch`: the real runner — executes each iteration's batch on a Llama-family model and returns its measured time.

The engine assigns KV block ids (``needs_block_tables = True``: every request carries
``block_table``) and the runner reads and writes exactly those blocks. ``step_time`` runs the
plan's items as one forward pass and returns device seconds (CUDA events on a GPU, wall time on
CPU); host-side preparation is measured apart, in ``last_stats`` / ``stats``.

This module imports torch only when a runner is built, so registering it costs nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from servelab.common.errors import ServelabError
from servelab.runners.base import RUNNERS, RunnerBase, StepPlan, picker
from servelab.runners.paged_kv import ATTENTION_KINDS, StepLayout, build_layout

DEFAULT_CPU_KV_TOKENS = 65536  # CPU pool size when num_blocks is not given (tiny model: 32 MiB)
DEFAULT_ACTIVATION_RESERVE_GIB = 6.0  # GPU memory kept free for activations, logits and the allocator
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's timings in seconds: ``device_s`` is what ``step_time`` returned."""

    device_s: float
    prepare_s: float  # host: plan -> index arrays (numpy)
    launch_s: float  # host: from the first copy to the last kernel enqueued (GPU), or the whole forward (CPU)
    wall_s: float  # host: prepare + launch + waiting for the device
    tokens: int
    seqs: int


@dataclass
class RunnerTotals:
    steps: int = 0
    device_s: float = 0.0
    prepare_s: float = 0.0
    launch_s: float = 0.0
    wall_s: float = 0.0
    tokens: int = 0


@dataclass
class TorchRunner(RunnerBase):
    """Build with ``make_runner("torch:model=...,device=...")`` or directly; see docs/gpu_runner.md."""

    model_name: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    weights: str | None = None
    seed: int = 0
    num_blocks: int | None = None  # default: from free GPU memory at first use (cuda) or 64Ki tokens (cpu)
    block_size: int = 16
    attention: str = "auto"  # auto | sdpa | paged | gather
    activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB
    warmup: bool = True
    threads: int | None = None  # CPU: torch's intra-op threads (process-wide); tiny models run best on 1
    varlen_kernel: Any = None  # replaces FlashAttention varlen (tests run the GPU paths on CPU with a reference)
    cuda_graphs: bool = False  # replay pure-decode steps from CUDA graphs (CPU: the same padded path, uncaptured)
    graph_max_batch: int = 256  # larger decode batches run eagerly (launch overhead no longer matters there)
    # tokens per entry of the trace's prefix_hashes (api.replay sets it): prompt tokens the hashes cover
    # derive from them, so requests with equal hashes have equal tokens and may share cached KV blocks
    hash_block_tokens: int | None = None
    name: str = field(default="torch", init=False)
    needs_block_tables: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        try:
            import torch
        except ModuleNotFoundError:
            raise ServelabError("runner 'torch' needs PyTorch: pip install 'servelab[torch]'") from None
        from servelab.runners.torch_model import ModelArgs, Transformer, load_hf_config

        self._torch = torch
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ServelabError(f"runner 'torch': device '{self.device}' requested but CUDA is not available")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ServelabError(f"runner 'torch': device must be cpu or cuda[:N], got '{self.device}'")
        if self.threads is not None:
            if self.threads < 1:
                raise ServelabError(f"runner 'torch': threads must be >= 1, got {self.threads}")
            torch.set_num_threads(self.threads)
        self.dtype = self.dtype or ("bfloat16" if self.is_cuda else "float32")
        if self.dtype not in DTYPES:
            raise ServelabError(f"runner 'torch': dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        if self.block_size < 1:
            raise ServelabError(f"runner 'torch': block_size must be >= 1, got {self.block_size}")
        hf_config = load_hf_config(self.weights) if self.weights else None
        if self.model_name in ("", "hf"):
            if not self.weights:
                raise ServelabError("runner 'torch': model=hf needs weights=<folder with config.json and safetensors>")
            if hf_config is None:
                raise ServelabError(f"runner 'torch': {self.weights} has no config.json beside it; pass model=<preset>")
            self.args = ModelArgs.from_hf_config(hf_config, name=os.path.basename(os.path.normpath(self.weights)))
        else:
            self.args = ModelArgs.from_name(self.model_name)
        self._torch_dtype = getattr(torch, self.dtype)
        self.attention = self._pick_attention()
        self._check_fits()
        self.model = Transformer.build(self.args, device=self.device, dtype=self._torch_dtype, seed=self.seed,
                                       weights=self.weights)
        if self.varlen_kernel is not None:
            self.model.varlen_kernel = self.varlen_kernel
        self._kv = None
        self._graphs = DecodeGraphs(self, self.graph_max_batch) if self.cuda_graphs else None
        self.last_stats: StepStats | None = None
        self.last_tokens: np.ndarray | None = None  # greedy samples of the last step, one per sample row
        self.stats = RunnerTotals()
        if self.num_blocks is not None:
            self._allocate_pool(self.num_blocks)

    # ---- Runner protocol ----------------------------------------------------------------------

    def step_time(self, plan: StepPlan) -> float:
        if not plan.items:
            return 0.0
        torch = self._torch
        kv = self._pool()
        t0 = time.perf_counter()
        graphed = self._graphs.prepare(plan) if self._graphs is not None else None
        layout = self.layout(plan) if graphed is None else None
        t1 = time.perf_counter()
        capture_s = self._graphs.take_capture_s() if self._graphs is not None else 0.0
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if graphed is not None:
            tokens, sample_rows, rows = graphed()
        else:
            step = layout.to(self.device)
            tokens, sample_rows, rows = self._sample(self.model.forward(step, kv), step), None, layout.num_rows
        if self.is_cuda:
            end.record()
            t2 = time.perf_counter()
            host_tokens = tokens.cpu().numpy()
            end.synchronize()
            device_s = start.elapsed_time(end) / 1e3
        else:
            t2 = time.perf_counter()
            host_tokens = tokens.numpy()
            device_s = t2 - t1
        self.last_tokens = host_tokens if sample_rows is None else host_tokens[sample_rows]
        t3 = time.perf_counter()
        self._record(StepStats(device_s, t1 - t0 - capture_s, t2 - t1, t3 - t0 - capture_s, rows, len(plan.items)))
        return device_s

    def decode_affine(self, num_seqs: int) -> None:
        return None  # a real device promises no formula: every iteration is executed

    def describe(self) -> dict:
        torch = self._torch
        out = {
            "runner": self.name,
            "model": asdict(self.args),
            "num_params": self.args.num_params,
            "device": self.device,
            "device_name": torch.cuda.get_device_name(self.device) if self.is_cuda else "cpu",
            "dtype": self.dtype,
            "weights": self.weights or f"random (seed {self.seed})",
            "attention": self.attention,
            "varlen_probe": self.varlen_probe,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "cuda_graphs": None if self._graphs is None else self._graphs.describe(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "torch_version": torch.__version__,
            "totals": asdict(self.stats),
        }
        return out

    # ---- KV sizing ----------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        return self.args.kv_bytes_per_token(self._torch_dtype.itemsize)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Tokens the KV pool holds. The first call sizes the pool (GPU: from free memory after the
        weights; CPU: a fixed 64Ki tokens) unless ``num_blocks`` was given; later calls report it."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ServelabError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self._pool(gpu_memory_utilization)
        return self.num_blocks * self.block_size

    @property
    def total_blocks(self) -> int:
        """Blocks in the pool (sizing it at 0.9 utilisation if nothing sized it yet): the engine's allocator size."""
        self._pool()
        return self.num_blocks

    def make_allocator(self, replica: int, num_blocks: int):
        """The engine's block allocator for ``replica``: ``num_blocks`` ids of this runner's pool.

        Replicas replayed on one runner get disjoint id ranges of the same pool.
        """
        from servelab.runners.paged_kv import BlockAllocator

        self._pool()
        pool = self.num_blocks
        if replica < 0 or (replica + 1) * num_blocks > pool:
            raise ServelabError(
                f"runner 'torch': replica {replica} wants KV blocks {replica * num_blocks}..{(replica + 1) * num_blocks - 1} "
                f"but the pool has {pool} blocks of {self.block_size} tokens (is the engine's block_size "
                f"{self.block_size}? set num_gpu_blocks / num_blocks to fit)"
            )
        return BlockAllocator(num_blocks, first_id=replica * num_blocks)

    # ---- internals ----------------------------------------------------------------------------

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _pick_attention(self) -> str:
        """auto: paged FlashAttention where it exists and blocks are multiples of 256, else the packed
        gather, else padded SDPA. The FlashAttention paths are probed on the device first."""
        self.varlen_probe = self._probe()
        works = {name for name, err in self.varlen_probe.items() if err is None}
        if self.attention == "auto":
            if "paged" in works and self.block_size % 256 == 0:
                return "paged"
            return "gather" if "packed" in works else "sdpa"
        if self.attention not in ATTENTION_KINDS:
            raise ServelabError(
                f"runner 'torch': attention must be auto or one of {', '.join(ATTENTION_KINDS)}, got '{self.attention}'"
            )
        if self.attention == "paged" and self.block_size % 256:
            raise ServelabError(f"runner 'torch': attention=paged needs block_size a multiple of 256, got {self.block_size}")
        need = {"paged": "paged", "gather": "packed"}.get(self.attention)
        if need is not None and need not in works:
            raise ServelabError(f"runner 'torch': attention={self.attention} is unavailable on {self.device} with torch "
                                f"{self._torch.__version__} ({self.varlen_probe[need]}); use attention=sdpa")
        return self.attention

    def _probe(self) -> dict[str, str | None]:
        from servelab.runners.torch_model import probe_varlen

        if self.varlen_kernel is not None:  # tests: a reference kernel stands in for FlashAttention
            return {"packed": None, "paged": None}
        if not self.is_cuda:
            return {"packed": "FlashAttention needs CUDA", "paged": "FlashAttention needs CUDA"}
        return probe_varlen(self.args, self._torch_dtype, self.device)

    def _check_fits(self) -> None:
        need = self.args.num_params * self._torch_dtype.itemsize
        if self.is_cuda:
            free, _total = self._torch.cuda.mem_get_info(self.device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free:
            raise ServelabError(
                f"runner 'torch': model '{self.args.name}' needs {need / 2**30:.1f} GiB of weights, "
                f"{self.device} has {free / 2**30:.1f} GiB free (try model=tiny on a CPU)"
            )

    def _pool(self, gpu_memory_utilization: float = 0.9):
        if self._kv is None:
            self._allocate_pool(self._blocks_from_memory(gpu_memory_utilization))
        return self._kv

    def _blocks_from_memory(self, gpu_memory_utilization: float) -> int:
        block_bytes = self.kv_bytes_per_token * self.block_size
        if not self.is_cuda:
            return max(1, DEFAULT_CPU_KV_TOKENS // self.block_size)
        torch = self._torch
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * gpu_memory_utilization - (total - free) - self.activation_reserve_gib * 2**30
        blocks = int(budget // block_bytes) - 1  # minus the scratch block
        if blocks < 1:
            raise ServelabError(
                f"runner 'torch': no GPU memory left for KV at gpu_memory_utilization={gpu_memory_utilization} "
                f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB after weights)"
            )
        return blocks

    def _allocate_pool(self, num_blocks: int) -> None:
        from servelab.runners.paged_kv import PagedKVCache

        if num_blocks < 1:
            raise ServelabError(f"runner 'torch': num_blocks must be >= 1, got {num_blocks}")
        a = self.args
        # one block more than the engine may use: padded rows of graphed decode steps write there
        self._kv = PagedKVCache(a.num_layers, num_blocks + 1, self.block_size, a.num_kv_heads, a.head_dim,
                                self._torch_dtype, self.device)
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        if self.warmup:
            self._warm_up()

    def _warm_up(self) -> None:
        """Run a prefill and a decode once so library initialisation never lands in a measured step.

        Uses blocks from id 0; their contents are overwritten before any request reads them (a
        request only reads positions it wrote).
        """
        from types import SimpleNamespace

        from servelab.runners.base import StepItem, StepShape

        tokens = min(2 * self.block_size, self._kv.num_blocks * self.block_size - 1)
        if tokens < 2:
            return
        req = SimpleNamespace(request_id=-1, prompt_tokens=tokens - 1,
                              block_table=list(range(-(-tokens // self.block_size))))
        saved = (self.last_stats, self.last_tokens, RunnerTotals(**asdict(self.stats)))
        for item in (StepItem(req, 0, tokens - 1), StepItem(req, tokens - 1, 1)):
            self.step_time(StepPlan(StepShape(), (item,)))
        self.last_stats, self.last_tokens, self.stats = saved

    def layout(self, plan: StepPlan, kind: str | None = None) -> StepLayout:
        items = plan.items
        return build_layout(
            [it.request.request_id for it in items],
            [it.request.prompt_tokens for it in items],
            [it.start for it in items],
            [it.num_tokens for it in items],
            [it.request.block_table for it in items],
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            vocab_size=self.args.vocab_size,
            kind=kind or self.attention,
            prefix_hashes=[getattr(it.request, "prefix_hashes", None) for it in items] if self.hash_block_tokens else None,
            hash_block_tokens=self.hash_block_tokens,
        )

    def execute(self, plan: StepPlan, all_logits: bool = False):
        """Run ``plan`` (untimed) and return logits: one row per new token in plan order if
        ``all_logits``, else one per sampled row (items that complete their known tokens)."""
        kv = self._pool()
        step = self.layout(plan).to(self.device)
        hidden = self.model.forward(step, kv)
        return self.model.logits(hidden if all_logits else hidden[step.sample_rows])

    def _sample(self, hidden, step: StepLayout):
        # Only rows that emit a token need the vocabulary projection (the costly part at 128k vocab).
        return self.model.logits(hidden[step.sample_rows]).argmax(dim=-1)

    def _record(self, s: StepStats) -> None:
        self.last_stats = s
        t = self.stats
        t.steps += 1
        t.device_s += s.device_s
        t.prepare_s += s.prepare_s
        t.launch_s += s.launch_s
        t.wall_s += s.wall_s
        t.tokens += s.tokens


@RUNNERS.register("torch")
@dataclass(frozen=True, slots=True)
class TorchParams:
    """``torch:model=llama-3.1-8b,device=cuda,block_size=256``; typed and checked without torch (it is
    imported when the runner is built). A field left None takes the replay's value (``model``, the
    engine's ``block_size``, ...) where it has one, else the default: spec values win."""

    model: str | None = None  # a preset, or hf with weights (default: the replay's model, llama-3.1-8b)
    device: str | None = None  # cpu | cuda[:N] (default: cuda when available)
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    weights: str | None = None  # a safetensors file or a folder with config.json
    seed: int | None = None  # (default 0)
    num_blocks: int | None = None
    block_size: int | None = None  # (default: the engine's, else 16)
    attention: str = "auto"
    activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB
    warmup: bool = True
    threads: int | None = None
    cuda_graphs: bool = False
    graph_max_batch: int | None = None  # (default 256)

    def __post_init__(self) -> None:
        if self.device and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ServelabError(f"device must be cpu or cuda[:N], got '{self.device}'")
        if self.dtype and self.dtype not in DTYPES:
            raise ServelabError(f"dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        if self.attention not in ("auto", *ATTENTION_KINDS):
            raise ServelabError(f"attention must be auto or one of {', '.join(ATTENTION_KINDS)}, got '{self.attention}'")

    def build(self, **context) -> TorchRunner:
        """Context keys used: ``model`` (a preset name), ``block_size`` (the engine's KV block size),
        and ``device``, ``seed``, ``num_blocks``, ``threads``, ``graph_max_batch`` where a caller has them."""
        pick = picker(self, context)
        device = pick("device", "")
        if not device:
            try:
                import torch
            except ModuleNotFoundError:
                raise ServelabError("runner 'torch' needs PyTorch: pip install 'servelab[torch]'") from None
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # with local weights, their config.json decides the shape unless model= is given explicitly
        model = self.model or (None if self.weights else context.get("model")) or ("hf" if self.weights else "llama-3.1-8b")
        return TorchRunner(
            model_name=str(model),
            device=device,
            dtype=self.dtype,
            weights=self.weights,
            seed=pick("seed", 0),
            num_blocks=pick("num_blocks", None),
            block_size=pick("block_size", 16),
            attention=self.attention,
            activation_reserve_gib=self.activation_reserve_gib,
            warmup=self.warmup,
            threads=pick("threads", None),
            cuda_graphs=self.cuda_graphs,
            graph_max_batch=pick("graph_max_batch", 256),
        )


# Batch sizes a graphed decode step is padded up to (vLLM-like: dense at small sizes).
GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Pure-decode steps replayed from CUDA graphs, one per (batch bucket, block-table width bucket).

    Eager PyTorch spends several microseconds of host time per kernel, some 600 kernels a step for
    an 8B model: more than the device needs for a small decode batch, so the GPU would idle. A graph
    launches them in one call. Inputs live in static buffers refilled by one copy per dtype; rows
    past the real batch decode a dummy token into the runner's scratch block, which no engine
    allocator hands out, so padding never touches real KV. Attention is ``paged`` where the runner
    uses it, else the padded ``sdpa`` decode (the packed ``gather`` path has data-dependent shapes).
    On CPU the same padded static layout runs eagerly (no capture): that is what the tests check.
    A failed capture disables graphs (``describe()`` says why) and steps run eagerly.
    """

    def __init__(self, runner: TorchRunner, max_batch: int):
        torch = runner._torch
        self.runner = runner
        self.kind = "paged" if runner.attention == "paged" else "sdpa"
        self.max_batch = min(max_batch, GRAPH_BATCH_BUCKETS[-1])
        self.capture = runner.is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.entries: dict[tuple[int, int], dict] = {}
        self.disabled: str | None = None
        self.total_capture_s = 0.0
        self._pending_capture_s = 0.0
        self.last_entry: dict | None = None

    def describe(self) -> dict:
        return {"attention": self.kind, "max_batch": self.max_batch, "graphs": sorted(self.entries),
                "capture_s": round(self.total_capture_s, 3), "disabled": self.disabled}

    def take_capture_s(self) -> float:
        s, self._pending_capture_s = self._pending_capture_s, 0.0
        return s

    def prepare(self, plan: StepPlan):
        """A launcher for ``plan`` (capturing its bucket first if new), or None to run it eagerly."""
        items = plan.items
        if self.disabled or len(items) > self.max_batch or any(it.num_tokens != 1 for it in items):
            return None
        layout = self.runner.layout(plan, kind="paged")  # token ids, slots, tables, checks: kind-independent here
        n, nb = len(items), layout.block_table.shape[1]
        bb = next(b for b in GRAPH_BATCH_BUCKETS if b >= n)
        nbb = 1 << (nb - 1).bit_length()
        entry = self.entries.get((bb, nbb))
        if entry is None:
            t = time.perf_counter()
            try:
                entry = self._build(bb, nbb)
            except Exception as err:  # a capture failure must not stop a replay: run eagerly from now on
                self.disabled = f"{type(err).__name__}: {err}"
                return None
            self.entries[(bb, nbb)] = entry
            self._pending_capture_s += time.perf_counter() - t
            self.total_capture_s += time.perf_counter() - t
        self._fill(entry, layout, n, nb)
        self.last_entry = entry

        def launch():
            outputs = self._launch(entry)
            return outputs[1][:n], layout.sample_rows, n

        return launch

    def _build(self, bb: int, nbb: int) -> dict:
        from servelab.runners.paged_kv import StepLayout

        torch, runner = self.runner._torch, self.runner
        dev, paged = runner.device, self.kind == "paged"
        n64 = 3 * bb + (0 if paged else bb * nbb + bb)
        n32 = (2 * bb + 1 + bb * nbb) if paged else 0  # ctx_lens, cu_k, block table
        dev64 = torch.zeros(n64, dtype=torch.int64, device=dev)
        dev32 = torch.zeros(max(n32, 1), dtype=torch.int32, device=dev)
        tail64 = dev64[3 * bb:]
        layout = StepLayout(
            kind=self.kind, token_ids=dev64[:bb], positions=dev64[bb:2 * bb], slots=dev64[2 * bb:3 * bb],
            sample_rows=torch.arange(bb, device=dev), cu_q=torch.arange(bb + 1, dtype=torch.int32, device=dev),
            ctx_lens=dev32[:bb] if paged else torch.ones(bb, dtype=torch.int32, device=dev),
            max_q=1, max_k=nbb * runner.block_size,
            block_table=dev32[2 * bb + 1:].view(bb, nbb) if paged else None,
            cu_k=dev32[bb:2 * bb + 1] if paged else None,
            dec_rows=None if paged else torch.arange(bb, device=dev),
            dec_table=None if paged else tail64[:bb * nbb].view(bb, nbb),
            dec_ctx=None if paged else tail64[bb * nbb:],
            num_rows=bb,
        )
        entry = {"bb": bb, "nbb": nbb, "dev64": dev64, "dev32": dev32, "layout": layout,
                 "host64": np.zeros(n64, dtype=np.int64), "host32": np.zeros(n32, dtype=np.int32), "graph": None}
        self._fill(entry, None, 0, 0)  # all rows padding: warm-up and capture touch the scratch block only
        self._copy(entry)
        model, kv = runner.model, runner._kv
        model._rope(layout.positions, layout.max_k)  # grow RoPE tables now: never inside a capture

        def run():
            hidden = model.forward(layout, kv)
            logits = model.logits(hidden)
            return logits, logits.argmax(dim=-1)

        entry["run"] = run
        if self.capture:
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                entry["outputs"] = run()
            entry["graph"] = graph
        return entry

    def _fill(self, entry: dict, layout, n: int, nb: int) -> None:
        bb, nbb = entry["bb"], entry["nbb"]
        scratch, bs = self.runner.scratch_block, self.runner.block_size
        h64 = entry["host64"]
        tokens, positions, slots = h64[:bb], h64[bb:2 * bb], h64[2 * bb:3 * bb]
        tokens[:] = 0
        positions[:] = 0
        slots[:] = scratch * bs
        ctx = np.ones(bb, dtype=np.int64)
        table = np.full((bb, nbb), scratch, dtype=np.int64)
        if layout is not None:
            tokens[:n], positions[:n], slots[:n] = layout.token_ids, layout.positions, layout.slots
            ctx[:n] = layout.ctx_lens
            table[:n, :nb] = layout.block_table
        if self.kind == "paged":
            h32 = entry["host32"]
            h32[:bb] = ctx
            h32[bb] = 0
            np.cumsum(ctx, out=h32[bb + 1:2 * bb + 1])
            h32[2 * bb + 1:] = table.reshape(-1)
        else:
            h64[3 * bb:3 * bb + bb * nbb] = table.reshape(-1)
            h64[3 * bb + bb * nbb:] = ctx

    def _copy(self, entry: dict) -> None:
        torch = self.runner._torch
        entry["dev64"].copy_(torch.from_numpy(entry["host64"]))
        if entry["host32"].size:
            entry["dev32"][: entry["host32"].size].copy_(torch.from_numpy(entry["host32"]))

    def _launch(self, entry: dict):
        self._copy(entry)
        if entry["graph"] is not None:
            entry["graph"].replay()
            return entry["outputs"]
        entry["outputs"] = entry["run"]()
        return entry["outputs"]
