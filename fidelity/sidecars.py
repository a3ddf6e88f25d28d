"""Engine settings from the files a run leaves beside its per-request output.

Looked for in each source's folder (and, for a report in a ``results/`` folder or LLMServingSim's
``vllm/`` folder, the folder above it): ``meta.json`` (``engine_kwargs``, ``num_gpu_blocks``, the GPU,
the resolved ``kv_cache``: block size, memory utilisation, prefix caching),
``exp-config.yaml`` (inference-sim experiments: ``model``, ``tensor_parallelism``, ...),
``profile.yaml`` (a GuideLLM profile: its ``data`` settings give the prompt sharing), a Hugging Face
``config.json`` (the model's shapes, used when the recorded model id is no preset) or LLMServingSim's
simulator ``config.json`` (the GPU and model of the instance it simulates),
``vllm_logging.json`` (vLLM's logging config: names the server log file), ``vllm.log`` and a
``/metrics`` scrape taken after the run (``metrics.txt``, ``metrics.prom``: the prefix-cache hit and
query counters give the run's hit rate over the server's life, preferred to the log's last window).
Each setting remembers the file it came from; the server log wins over the other files, since it
is what the server actually ran.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.common.errors import InputError, ServelabError
from servelab.fidelity.base import read_yaml
from servelab.fidelity.kv_offload import from_args as offload_from_args
from servelab.fidelity.vllm_defaults import recorded_version
from servelab.traces.prefixes import PrefixSpec, spec_from_generator

# meta.json engine_kwargs / exp-config.yaml keys -> run.json config keys
KWARG_KEYS = {"model": "model", "tensor_parallel_size": "tp", "tensor_parallelism": "tp", "tp": "tp",
              "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
              "block_size": "block_size", "gpu_memory_utilization": "gpu_memory_utilization",
              "enable_prefix_caching": "enable_prefix_caching", "num_gpu_blocks": "num_gpu_blocks",
              "num_gpu_blocks_override": "num_gpu_blocks", "data_parallel_size": "replicas",
              "async_scheduling": "async_scheduling"}
GPU_KEYS = ("gpu", "gpu_name", "gpu_model", "gpu_type", "device_name", "accelerator", "hardware", "hardware_name")
# recorded GPU names (as nvidia-smi and NVML print them) -> presets (runners/presets.py GPUS), first match
# wins. Each pattern names one card: a sibling with other memory, bandwidth or links (GH200, H100 NVL,
# H200 NVL, A100 PCIe, an A10G, a laptop part) matches none, and the import asks which preset to use
_GPU_PATTERNS = (("rtx-4090", r"\brtx ?4090$|\brtx ?4090 \(?24 ?gb"), ("rtx-pro-6000", r"pro ?6000"),
                 ("h100-nvl", r"\bh100 nvl\b"), ("h100-pcie", r"\bh100\b.*pcie"), ("gh200", r"\bgh200 480 ?gb\b"),
                 ("h200", r"\bh200\b(?!.*\bnvl\b)"), ("h100-80gb", r"\bh100\b.*\b80 ?gb\b|\bh100[ -]sxm"),
                 ("b200", r"\bb200\b"), ("l40s", r"\bl40s\b"), ("a100-40gb", r"\ba100\b(?!.*pcie).*\b40 ?gb\b"),
                 ("a100-80gb", r"\ba100\b(?!.*pcie).*\b80 ?gb\b"), ("a40", r"\ba40\b"), ("mi300x", r"\bmi300x\b"),
                 ("l4", r"\bl4\b"), ("a10", r"\ba10\b"), ("rtx-a6000", r"\ba6000\b"), ("rtx-6000-ada", r"\b6000 ada\b"))
_OTHER_PARTS = r"\b(laptop|mobile|max-q)\b"  # a notebook or lower-power variant of a preset's card
# A bare family name, without memory size or form factor (LLMServingSim's meta.json "hardware": "H100", a
# user's "A100"), is the family's usual data-centre part; the import notes the reading (bare_gpu_note)
_BARE_FAMILIES = {"h100": "h100-80gb", "a100": "a100-80gb", "gh200": "gh200"}


@dataclass(frozen=True)
class Conflict:
    """Two of a run's files that record a setting differently: ``first`` (file, where, value) and the
    later ``second``, which won."""

    key: str
    first: tuple[Path, str, Any]
    second: tuple[Path, str, Any]

    def says(self) -> str:
        (a, where_a, va), (b, where_b, vb) = self.first, self.second
        return f"{self.key} {va!r} in {a.parent / where_a} but {vb!r} in {b.parent / where_b}"


@dataclass
class Found:
    settings: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    prefix: PrefixSpec | None = None
    log: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)  # setting -> the file that recorded it
    conflicts: list[Conflict] = field(default_factory=list)  # files of the run that disagree

    def put(self, key: str, value: Any, where: str, path: Path) -> None:
        """``value`` of ``key`` as ``path`` records it (``where``: the file and line); a value another
        file recorded differently is replaced, and the disagreement kept (``conflicts``)."""
        if value is None:
            return
        if key in self.settings and self.files[key] != path and not same_setting(key, self.settings[key], value):
            self.conflicts.append(Conflict(key, (self.files[key], self.origin[key], self.settings[key]),
                                           (path, where, value)))
        self.settings[key] = value
        self.origin[key] = where
        self.files[key] = path


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Do two files record the same value? A model by its name without the folder it was loaded from
    (``/models/Llama-3.1-8B`` is ``meta-llama/Llama-3.1-8B``), case aside, or by the preset both names
    mean (``-Instruct`` beside the base: the same shapes); a local folder name no preset knows cannot be
    told apart from the other name, so it is not a disagreement. Numbers and flags as values."""
    if key == "gpu":  # device names as recorded (NVIDIA RTX PRO 6000 Blackwell ..., RTXPRO6000): their presets
        preset_a, preset_b = gpu_preset(str(a)), gpu_preset(str(b))
        if preset_a is not None and preset_b is not None:
            return preset_a == preset_b
    if key == "model":
        if str(a).rstrip("/").split("/")[-1].lower() == str(b).rstrip("/").split("/")[-1].lower():
            return True
        preset_a, preset_b = _model_preset(a), _model_preset(b)
        return preset_a is None or preset_b is None or preset_a == preset_b
    from servelab.fidelity.base import check_settings

    try:
        return check_settings({key: a}, None) == check_settings({key: b}, None)
    except ServelabError:
        return str(a) == str(b)


def _model_preset(name: Any) -> str | None:
    from servelab.runners.presets import find_model

    try:
        return find_model(str(name)).name
    except ServelabError:
        return None


def gpu_preset(name: str) -> str | None:
    """The GPU preset a recorded device name means (``NVIDIA GeForce RTX 4090`` -> ``rtx-4090``)."""
    from servelab.runners.presets import GPUS

    text = str(name).strip().lower()
    if text in GPUS:
        return text
    if re.search(_OTHER_PARTS, text):
        return None
    if (bare := _bare_family(text)) is not None:
        return _BARE_FAMILIES[bare]
    for preset, pattern in _GPU_PATTERNS:
        if re.search(pattern, text):
            return preset
    return None


def _bare_family(text: str) -> str | None:
    bare = re.sub(r"\b(nvidia|tesla)\b|[\s_-]", "", text.lower())
    return bare if bare in _BARE_FAMILIES else None


def bare_gpu_note(name: str) -> str | None:
    """What reading a bare family name assumed, for run.json's notes (None for a full device name)."""
    bare = _bare_family(str(name))
    if bare is None:
        return None
    from servelab.runners.presets import GPUS

    siblings = [g for g in GPUS if g.startswith(bare) and g != _BARE_FAMILIES[bare]]
    other = f"; --setting gpu={' or '.join(siblings)} if it was another" if siblings else ""
    return f"the recorded GPU '{name}' names no variant: read as {_BARE_FAMILIES[bare]}{other}"


def _gpu_in(obj: Any) -> str | None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if str(key).lower() in GPU_KEYS:
                if isinstance(value, str) and value.strip():
                    return value
                if isinstance(value, dict):
                    inner = _gpu_in(value) or value.get("name") or value.get("model")
                    if isinstance(inner, str):
                        return inner
        for value in obj.values():
            if isinstance(value, dict) and (hit := _gpu_in(value)):
                return hit
    return None


def _simulated_instance(data: Any) -> dict | None:
    """The serving instance of an LLMServingSim config (``nodes[].instances[]``, ``hardware`` and
    ``model_name`` each), when it describes one kind (the vLLM run it was set up to match)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        return None
    instances = [i for node in data["nodes"] if isinstance(node, dict)
                 for i in (node.get("instances") or []) if isinstance(i, dict) and i.get("hardware")]
    kinds = {(i.get("hardware"), i.get("model_name")) for i in instances}
    return instances[0] if len(kinds) == 1 else None


def _blocks_in(obj: Any) -> int | None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "num_gpu_blocks" and isinstance(value, int):
                return value
            if isinstance(value, dict) and (hit := _blocks_in(value)) is not None:
                return hit
    return None


def _kwargs(found: Found, kwargs: dict, path: Path) -> None:
    for key, value in kwargs.items():
        if key in KWARG_KEYS and not isinstance(value, (dict, list)):
            found.put(KWARG_KEYS[key], value, path.name, path)
    if (offload := offload_from_args(kwargs)) is not None:  # CPU KV offloading (fidelity/kv_offload.py)
        found.source["kv_offload"], sizes = offload
        for key, value in sizes.items():
            found.put(key, value, path.name, path)
    if kwargs.get("enable_expert_parallel"):
        found.source["enable_expert_parallel"] = True
    if kwargs.get("data_parallel_size"):
        found.source["data_parallel_size"] = kwargs["data_parallel_size"]
    for key in ("pipeline_parallel_size", "quantization", "kv_cache_dtype"):  # what validate --real prices
        if str(kwargs.get(key)).lower() not in ("none", "auto", "1"):
            found.source[key] = kwargs[key]


METRICS_FILES = ("metrics.txt", "metrics.prom", "vllm_metrics.txt")
_COUNTER = re.compile(r"^(vllm:(?:gpu_)?prefix_cache_(hits|queries)(?:_total)?|vllm:gpu_prefix_cache_hit_rate)"
                      r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def hit_rate_from_metrics(path: Path) -> float | None:
    """The prefix-cache hit rate a Prometheus text scrape of vLLM's ``/metrics`` reports: hits over
    queries summed over engines (V1 counters), else V0's ``gpu_prefix_cache_hit_rate`` gauge."""
    hits = queries = 0.0
    gauge = None
    for line in path.read_text(errors="replace").splitlines():
        m = _COUNTER.match(line.strip())
        if not m:
            continue
        value = float(m.group(3))
        if m.group(2) == "hits":
            hits += value
        elif m.group(2) == "queries":
            queries += value
        else:
            gauge = value
    if queries > 0:
        return hits / queries
    return gauge


def discover(paths: list[Path], log: Path | None = None, metrics: Path | None = None) -> Found:
    """Settings from the run's own files beside ``paths`` (and ``log``, the server log, and
    ``metrics``, a /metrics scrape, if given). Sources in other folders are one run's files only
    when their folders' files agree: sources whose files record a setting or the vLLM version
    differently are two runs, an error naming both."""
    runs: dict[tuple[Path, ...], Path] = {}  # the folders looked in -> the first source they serve
    for p in paths:
        folder = p if p.is_dir() else p.parent
        # a benchmark that writes its report into a results/ folder (inference-perf), or LLMServingSim's
        # vLLM runs in <GPU>/<model>/vllm/ beside the simulator's config.json, leave the setup's files one
        # level up: that folder is looked in after the report's own
        runs.setdefault((folder, folder.parent) if folder.name in ("results", "vllm") else (folder,), p)
    found = None
    for folders, source in runs.items():
        one = _discover_run(list(folders), log, metrics)
        if found is None:
            found, first = one, source
            continue
        _same_run(found, first, one, source)
        for key, value in one.settings.items():
            if key not in found.settings:
                found.put(key, value, one.origin[key], one.files[key])
        found.source = {**one.source, **found.source}
        found.prefix = found.prefix or one.prefix
        found.conflicts += one.conflicts
    return found


def _same_run(a: Found, source_a: Path, b: Found, source_b: Path) -> None:
    facts = {"vllm_version": "vLLM version"}
    for key in sorted(a.settings.keys() & b.settings.keys()):
        if not same_setting(key, a.settings[key], b.settings[key]):
            raise ServelabError(f"{source_a} and {source_b} are not one run's files: "
                                f"{Conflict(key, (a.files[key], a.origin[key], a.settings[key]), (b.files[key], b.origin[key], b.settings[key])).says()}; "
                                "import each run on its own")
    for key, name in facts.items():
        if key in a.source and key in b.source and str(a.source[key]) != str(b.source[key]):
            raise ServelabError(f"{source_a} and {source_b} are not one run's files: their folders record "
                                f"{name} {a.source[key]} and {b.source[key]}; import each run on its own")


def _discover_run(folders: list[Path], log: Path | None, metrics: Path | None) -> Found:
    """The settings the files in ``folders`` (one run's) and ``log`` and ``metrics`` record."""
    found = Found()
    for folder in folders:
        exp = folder / "exp-config.yaml"
        if exp.is_file():
            data = read_yaml(exp) or {}
            if isinstance(data, dict):
                _kwargs(found, data, exp)
                if (gpu := _gpu_in(data)):
                    found.put("gpu", gpu, exp.name, exp)
        meta = folder / "meta.json"
        if meta.is_file():
            data = _read_json(meta)
            if isinstance(data, dict):
                found.put("model", data.get("model"), meta.name, meta)
                _kwargs(found, data.get("engine_kwargs") or {}, meta)
                found.put("num_gpu_blocks", _blocks_in(data), meta.name, meta)
                cache = data.get("kv_cache")  # the engine's resolved cache: block size, utilisation, caching
                if isinstance(cache, dict):
                    keys = ("block_size", "gpu_memory_utilization", "enable_prefix_caching")
                    _kwargs(found, {k: v for k, v in cache.items() if k in keys and v is not None}, meta)
                if (gpu := _gpu_in(data)):
                    found.put("gpu", gpu, meta.name, meta)
                found.source.update({k: data[k] for k in ("vllm_version", "started_at", "finished_at", "dataset_path")
                                     if k in data})
                found.source["meta_json"] = str(meta)
        hf = folder / "config.json"  # the model's Hugging Face config, or LLMServingSim's simulator config
        if hf.is_file() and "hf_config" not in found.source:
            data = _read_json(hf)
            if isinstance(data, dict) and "hidden_size" in data and ("architectures" in data or "model_type" in data):
                found.source["hf_config"] = str(hf.resolve())
            elif (instance := _simulated_instance(data)) is not None:
                where = f"{hf.name} (LLMServingSim's config of the run)"
                found.put("gpu", instance.get("hardware"), where, hf)
                found.put("model", instance.get("model_name"), where, hf)
        profile = folder / "profile.yaml"
        if profile.is_file() and found.prefix is None:
            data = read_yaml(profile)
            if isinstance(data, dict):
                found.prefix = spec_from_generator(data.get("data") or {}, origin=profile.name)
                found.source["generator_data"] = data.get("data")
        if log is None:
            log = _log_in(folder)
        if metrics is None:
            metrics = next((folder / n for n in METRICS_FILES if (folder / n).is_file()), None)
    if log is not None:
        from servelab.fidelity.vllm_log import read_log

        settings, source, origin = read_log(log)
        for key, value in settings.items():
            found.put(key, value, origin.get(key, log.name), log)
        version = recorded_version(source)
        if "meta_json" in found.source and found.source.get("vllm_version") not in (None, version) and version:
            found.conflicts.append(Conflict("vllm_version", (Path(found.source["meta_json"]), "meta.json",
                                                             found.source["vllm_version"]), (log, log.name, version)))
        if not settings and source.keys() <= {"vllm_log"}:  # not a vLLM log, or not one this reader knows
            found.source["vllm_log_unread"] = True
        found.source.update(source)
        found.log = log
    if metrics is not None:
        if not metrics.is_file():
            raise InputError(metrics, "file not found")
        rate = hit_rate_from_metrics(metrics)
        if rate is not None:
            found.source.update(prefix_cache_hit_rate=rate, prefix_cache_hit_rate_from=metrics.name)
    return found


def _log_in(folder: Path) -> Path | None:
    """``vllm.log`` in the folder, or the file ``vllm_logging.json``'s handler writes to (by name, here)."""
    config = folder / "vllm_logging.json"
    if config.is_file():
        data = _read_json(config)
        for handler in ((data or {}).get("handlers") or {}).values() if isinstance(data, dict) else ():
            name = handler.get("filename") if isinstance(handler, dict) else None
            if name and (folder / Path(name).name).is_file():
                return folder / Path(name).name
    plain = folder / "vllm.log"
    if plain.is_file():
        return plain
    for path in sorted(folder.glob("*.log")):  # server.log, vllm_server.log, ...: one that vLLM wrote
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if b"non-default args" in head or b"args: Namespace(" in head:
                return path
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(path, f"not valid JSON ({getattr(err, 'msg', err)})") from None
