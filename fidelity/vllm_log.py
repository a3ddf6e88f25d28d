"""Engine settings from a vLLM server log: the arguments, the engine config, the KV cache and the hit rate.

Reads, for the last server start in the log (a log often holds several restarts; the last
``non-default args: {...}`` line, or before vLLM 0.10 the ``args: Namespace(...)`` line, begins the
one that served the run): the server's arguments, the ``Initializing a V1 LLM engine (vX) with
config: ...`` line (V0: ``Initializing an LLM engine``; ``tensor_parallel_size``,
``data_parallel_size``, ``enable_prefix_caching``, ``served_model_name``), the batch-token limit
the scheduler ran with (``Chunked prefill is enabled with max_num_batched_tokens=N``, defaults
included), the KV cache vLLM
allocated (``num_gpu_blocks is: N``; V0 ``# GPU blocks: N`` or, from 0.6, ``# cuda blocks: N``;
else V1's ``GPU KV cache size: N tokens`` divided by the block size; else, rounded,
``Maximum concurrency for N tokens per request: Xx`` times N over the block size), the version
(``vLLM API server version X``, or the banner's ``version X`` of newer releases), whether
``Asynchronous scheduling is enabled`` (the setting the server resolved), the last ``Prefix cache hit
rate: X%`` (V0: ``Prefix cache hit rate: GPU: X%, CPU: Y%``) the metrics logger printed while prompts
were served, whether the custom all-reduce found the GPUs without peer-to-peer access (validate
--real then prices the link through host memory), the CPU KV offloading its arguments set
(fidelity/kv_offload.py) or LMCache's workers logged (``Creating LMCacheEngine with config: {...}``), and
the ``External prefix cache hit rate`` of such a connector. Each setting remembers the line it came from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from servelab.common.errors import InputError
from servelab.fidelity.kv_offload import from_args as offload_from_args

_ARGS = re.compile(r"non-default args: (\{.*\})\s*$")
_NAMESPACE = re.compile(r"\bargs: Namespace\((.*)\)\s*$")  # vLLM < 0.10: every argument, defaults included
# V1's metrics logger; V0 "# GPU blocks: N, # CPU blocks: M" (0.6+: the device name, "# cuda blocks: N")
_BLOCKS = re.compile(r"num_gpu_blocks is: (\d+)|# (?:GPU|cuda|rocm|xpu|hpu|tpu|npu) blocks: (\d+)")
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_VERSION = re.compile(r"vLLM (?:API server )?version (\S+)")
_BANNER_VERSION = re.compile(r"[\u2580\u2584\u2588]\s+version\s+(\S+)")  # the ASCII-art banner of newer vLLM
_ASYNC = re.compile(r"Asynchronous scheduling is (enabled|disabled)")  # the resolved setting (newer vLLM)
_ENGINE = re.compile(r"Initializing an? (?:V1 )?LLM engine \(v?([^)]*)\) with config: (.*)$")
# the limit the scheduler ran with, defaults included (V0 and V1, whenever chunked prefill is on)
_CHUNKED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_HIT = re.compile(r"Prefix cache hit rate: (?:GPU: )?([\d.]+)%")
# LMCache's own configuration, logged by each worker: its CPU (and disk) store per worker, in GB
_LMCACHE = re.compile(r"Creating LMCacheEngine with config:")
_LMCACHE_SIZE = re.compile(r"'(local_cpu|max_local_cpu_size|max_local_disk_size|local_disk)': ('[^']*'|[\w.]+)")
_EXTERNAL_HIT = re.compile(r"External prefix cache hit rate: ([\d.]+)%")  # a KV connector's (CPU offload, LMCache)
_ENGINE_TAG = re.compile(r"Engine (\d+):")  # V1 data parallel: each engine logs its own metrics
# vLLM's custom all-reduce found no peer-to-peer access between the GPUs: NCCL goes through host memory
_NO_P2P = re.compile(r"Custom allreduce is disabled because your platform lacks GPU P2P capability")
_PROMPT_TPUT = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s")
_WAITING = re.compile(r"(?:Waiting|Pending): (\d+) reqs")
_KV_USAGE = re.compile(r"(?:GPU )?KV cache usage: ([\d.]+)%")
_DICT_ITEM = re.compile(r"\s*'([^']*)'\s*:\s*(.*)$", re.S)  # one 'key': value of the non-default args
_CALL = re.compile(r"^\w+\((.*)\)$", re.S)  # a dataclass repr: Name(field=value, ...)
PRESSURE_KV = 0.8  # a KV cache at least this full, with requests waiting: preemption territory
ARG_KEYS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
            "tensor_parallel_size": "tp", "block_size": "block_size",
            "gpu_memory_utilization": "gpu_memory_utilization", "enable_prefix_caching": "enable_prefix_caching",
            "num_gpu_blocks_override": "num_gpu_blocks", "data_parallel_size": "replicas",
            "async_scheduling": "async_scheduling"}
# fields of the engine config line: key=value up to the next ", key="
_ENGINE_FIELD = re.compile(r"(?:^|, )(\w+)=(.*?)(?=, \w+=|$)")
ENGINE_KEYS = {"tensor_parallel_size": "tp", "enable_prefix_caching": "enable_prefix_caching",
               "served_model_name": "model", "async_scheduling": "async_scheduling"}
SOURCE_KEYS = {"data_parallel_size": "data_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
               "dtype": "dtype", "max_seq_len": "max_model_len", "kv_cache_dtype": "kv_cache_dtype",
               "quantization": "quantization"}


def read_log(path: Path) -> tuple[dict, dict, dict[str, str]]:
    """(settings for run.json's config, facts for its source, setting -> 'file line N')."""
    if not path.is_file():
        raise InputError(path, "file not found")
    settings: dict = {}
    origin: dict[str, str] = {}
    source: dict = {"vllm_log": str(path)}
    kv_tokens = concurrency = None
    hits: dict[str, tuple[float, int]] = {}  # engine -> (its last hit rate while busy, line)
    external: dict[str, tuple[float, int]] = {}  # engine -> its last KV connector hit rate, the same lines
    lmcache = None  # (LMCache's logged sizes, line)
    first_hits: dict[str, str | None] = {}  # engine -> why its first hits look like preemption's, or None

    def put(key: str, value, lineno: int) -> None:
        settings[key] = value
        origin[key] = f"{path.name} line {lineno}"

    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = _ARGS.search(line)
        n = None if m else _NAMESPACE.search(line)
        if m or n:
            try:
                args = dict_args(m.group(1)) if m else namespace_args(n.group(1))
            except (ValueError, SyntaxError):
                raise InputError(path, f"cannot read the server's {'non-default args' if m else 'args'}",
                                 row=lineno) from None
            args = {k: v for k, v in args.items() if v is not None}  # Namespace: None is "vLLM decides"
            settings, origin, kv_tokens, concurrency = {}, {}, None, None  # a new server start: forget the last
            hits, first_hits, external, lmcache = {}, {}, {}, None
            for k in ("kv_cache_tokens", "prefix_cache_hit_rate", "prefix_cache_hit_rate_from", "engine_version",
                      "prefix_cache_hit_rate_pressure", "gpu_p2p", "gpu_p2p_from", "kv_offload", "model_path",
                      "external_prefix_cache_hit_rate"):
                source.pop(k, None)
            for k, v in args.items():
                if k in ARG_KEYS:
                    put(ARG_KEYS[k], v, lineno)
            served = args.get("served_model_name")
            model = (served[0] if isinstance(served, list) and served else served) or args.get("model_tag") \
                or args.get("model")
            if model:
                put("model", model, lineno)
                loaded = args.get("model_tag") or args.get("model")
                if loaded and loaded != model:  # served under another name: what it loaded, for run import
                    source["model_path"] = loaded
            if (offload := offload_from_args(args)) is not None:  # CPU KV offloading (fidelity/kv_offload.py)
                source["kv_offload"], sizes = offload
                for k, v in sizes.items():
                    put(k, v, lineno)
            if args.get("data_parallel_size"):
                source["data_parallel_size"] = args["data_parallel_size"]
            if args.get("enable_expert_parallel"):
                source["enable_expert_parallel"] = True
        elif (m := _ENGINE.search(line)):
            source["engine_version"] = m.group(1)
            for key, raw in _ENGINE_FIELD.findall(m.group(2)):
                value = _literal(raw)
                if key in ENGINE_KEYS and key not in ("served_model_name",) and ENGINE_KEYS[key] not in settings:
                    put(ENGINE_KEYS[key], value, lineno)
                elif key == "served_model_name" and "model" not in settings and value not in (None, "None"):
                    put("model", value, lineno)
                elif key in SOURCE_KEYS:
                    source[SOURCE_KEYS[key]] = value
        elif (m := _BLOCKS.search(line)):
            put("num_gpu_blocks", int(m.group(1) or m.group(2)), lineno)
        elif (m := _KV_TOKENS.search(line)):
            kv_tokens = (int(m.group(1).replace(",", "")), lineno)
            source["kv_cache_tokens"] = kv_tokens[0]
        elif (m := _CHUNKED.search(line)):
            put("max_num_batched_tokens", int(m.group(1)), lineno)
        elif (m := _CONCURRENCY.search(line)):
            concurrency = (int(m.group(1).replace(",", "")), float(m.group(2)), lineno)
        elif (m := _VERSION.search(line) or _BANNER_VERSION.search(line)):
            source["vllm_version"] = m.group(1)
        elif (m := _ASYNC.search(line)):
            put("async_scheduling", m.group(1) == "enabled", lineno)
        elif _NO_P2P.search(line):
            source["gpu_p2p"] = False
            source["gpu_p2p_from"] = f"{path.name} line {lineno}"
        if _LMCACHE.search(line):
            lmcache = ({k: _literal(v) for k, v in _LMCACHE_SIZE.findall(line)}, lineno)
        if (m := _HIT.search(line)) and _busy(line):
            tag = _ENGINE_TAG.search(line)
            engine = tag.group(1) if tag else ""
            rate = float(m.group(1)) / 100
            if engine not in first_hits and rate > 0:  # (hits in its first busy window: not after none)
                first_hits[engine] = _pressure(line, lineno) if engine in hits else None
            hits[engine] = (rate, lineno)
            if (ext := _EXTERNAL_HIT.search(line)):
                external[engine] = (float(ext.group(1)) / 100, lineno)
    if hits:  # one engine: its last rate; data-parallel engines: the mean of each one's last
        lines = sorted(n for _, n in hits.values())
        source["prefix_cache_hit_rate"] = sum(r for r, _ in hits.values()) / len(hits)
        source["prefix_cache_hit_rate_from"] = (f"{path.name} line {lines[0]}" if len(lines) == 1 else
                                                f"{path.name} lines {', '.join(map(str, lines))} (mean over "
                                                f"{len(lines)} engines)")
        why = [first_hits.get(e) for e, (rate, _) in hits.items() if rate > 0]  # each engine with hits
        if why and all(why):
            source["prefix_cache_hit_rate_pressure"] = f"{path.name} {why[0]}"
    if lmcache is not None and "kv_offload_gb" not in settings:
        _lmcache_sizes(lmcache, int(settings.get("tp") or 1), path, settings, origin, source)
    if external:  # the same windows as the GPU cache's rate: one engine's last, or the engines' mean
        source["external_prefix_cache_hit_rate"] = sum(r for r, _ in external.values()) / len(external)
    if "num_gpu_blocks" not in settings and kv_tokens is not None:
        # vLLM's token figure is blocks x block size (16 unless the log says otherwise)
        settings["num_gpu_blocks"] = kv_tokens[0] // int(settings.get("block_size") or 16)
        origin["num_gpu_blocks"] = f"{path.name} line {kv_tokens[1]} (KV cache tokens / block size)"
    elif "num_gpu_blocks" not in settings and concurrency is not None and concurrency[1] > 0:
        # "Maximum concurrency for N tokens per request: Xx" is KV tokens / N, printed to 2 decimals
        tokens, times, lineno = concurrency
        settings["num_gpu_blocks"] = round(times * tokens / int(settings.get("block_size") or 16))
        origin["num_gpu_blocks"] = (f"{path.name} line {lineno} (maximum concurrency x tokens per request / "
                                    "block size, rounded)")
    return settings, source, origin


def _lmcache_sizes(found: tuple[dict, int], tp: int, path: Path, settings: dict, origin: dict, source: dict) -> None:
    """LMCache's CPU store (``local_cpu``, on by default; ``max_local_cpu_size`` GB a worker, each worker
    holding its rank's shard: the replica's store is tp times that) and disk store (``local_disk``,
    ``max_local_disk_size``) as the offload sizes of the replay's dram and ssd tiers (GB of 2^30 bytes, as
    LMCache counts them)."""
    sizes, lineno = found
    where = f"{path.name} line {lineno}"

    def size(key: str) -> float | None:
        try:
            return float(sizes[key])
        except (KeyError, TypeError, ValueError):
            return None

    cpu = size("max_local_cpu_size")
    if sizes.get("local_cpu", True) is not False and isinstance(cpu, (int, float)) and cpu > 0:
        settings["kv_offload_gb"] = round(cpu * tp * 2**30 / 1e9, 6)
        origin["kv_offload_gb"] = f"{where} (LMCache: max_local_cpu_size {cpu:g} GB x {tp} workers)"
        source["kv_offload"] = f"LMCache's CPU store, {cpu:g} GB a worker"
    disk = size("max_local_disk_size")
    if sizes.get("local_disk") not in (None, "None", "") and isinstance(disk, (int, float)) and disk > 0:
        settings["kv_offload_disk_gb"] = round(disk * tp * 2**30 / 1e9, 6)
        origin["kv_offload_disk_gb"] = f"{where} (LMCache: max_local_disk_size {disk:g} GB x {tp} workers)"


def dict_args(text: str) -> dict:
    """The ``non-default args: {...}`` dict: a Python literal, except where an argument's value is an
    object vLLM parsed it into (``KVTransferConfig(kv_connector='...', ...)``: its fields as a dict) or
    has no literal repr (``<CompilationMode.VLLM_COMPILE: 3>``: its text)."""
    try:
        args = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        args = None
    if isinstance(args, dict):
        return args
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(text)
    out: dict = {}
    for part in _top_level_split(body[1:-1]):
        m = _DICT_ITEM.match(part)
        if m is None:
            raise ValueError(part)
        raw = m.group(2).strip()
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            call = _CALL.match(raw)
            value = raw if call is None else namespace_args(call.group(1))
        out[m.group(1)] = value
    return out


def namespace_args(text: str) -> dict:
    """The fields of an ``argparse.Namespace`` repr (``host=None, port=8000, model='m', ...``), each a
    Python literal where it is one, else its text (``dispatch_function=<function ... at 0x...>``)."""
    out: dict = {}
    last = None
    for part in _top_level_split(text):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            if last is None:
                raise ValueError(part)
            out[last] = f"{out[last]},{part}"  # a repr with a bare comma in it: the previous value's text
            continue
        last = key
        raw = raw.strip()
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _busy(line: str) -> bool:
    """A metrics line logged while prompts were being served (idle lines repeat the last window)."""
    m = _PROMPT_TPUT.search(line)
    return m is None or float(m.group(1)) > 0


def _pressure(line: str, lineno: int) -> str | None:
    """Why an engine's first prefix-cache hits, after windows of prompts with none, are preemption's: its
    KV cache nearly full with requests waiting. vLLM V1 counts a query each time the scheduler looks a
    waiting request up, and a request preempted by recompute finds its own blocks still cached: under
    that pressure the rate grows with retries, not with prompts shared."""
    waiting, usage = _WAITING.search(line), _KV_USAGE.search(line)
    if waiting is None or usage is None:
        return None
    w, kv = int(waiting.group(1)), float(usage.group(1)) / 100
    if w > 0 and kv >= PRESSURE_KV:
        return (f"line {lineno}: the first hits, after prompts served with none, while {w} requests waited on a "
                f"{kv:.0%} full KV cache")
    return None


def _literal(raw: str):
    raw = raw.strip()
    if raw in ("True", "False"):
        return raw == "True"
    try:
        return int(raw)
    except ValueError:
        return raw.strip("'\"")


def settings_from_log(path: Path) -> tuple[dict, dict]:
    """(settings for run.json's config, facts for run.json's source)."""
    settings, source, _ = read_log(path)
    return settings, source
