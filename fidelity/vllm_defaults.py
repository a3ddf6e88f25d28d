"""vLLM's own defaults for the batch limits, for a run whose files do not record them.

A server started without ``--max-num-seqs`` / ``--max-num-batched-tokens`` ran with the defaults of
its version and GPU, not servelab's: since vLLM 0.9 (engine/arg_utils.py ``get_batch_defaults``,
the OpenAI server's usage context) a GPU of at least 70 GiB that is not an A100 gets 8,192 batched
tokens and 1,024 sequences, any other GPU 2,048 and 256; ``max_num_seqs`` is then capped at
``max_num_batched_tokens``. Applied only where the run records its vLLM version (0.9 or later) and
the setting is not recorded anywhere; each carries that origin into run.json ``config_sources``.
Older versions (V0: chunked prefill off for short contexts, the whole prompt as the batch limit)
are left to the replay's defaults, which validate --real lists as such.

Async scheduling (``fill_async_default``) is vLLM's default since 0.14: a run recording 0.14 or later
and not the setting is replayed with it (docs/engine.md "Async scheduling").

A run that records no version (a benchmark client's file alone: GuideLLM, inference-perf, vllm bench
without the server's log) is replayed with the defaults of vLLM 0.14 and later (``ASSUMED_VERSION``),
the releases of 2026, rather than servelab's own: on 16 such runs (bench/RESULTS.md "Session 24") the
measured TTFT at light load was the three steps of async scheduling, not the one and a half of a
synchronous server. The assumption is said where each setting it gave is listed ("vLLM 0.14+ assumed
(no version recorded): its default ...") and in the import's warnings, with ``--setting
vllm_version=VERSION`` to name the server's release instead. A run whose client talked to another
server (SGLang, LMDeploy, TGI, TensorRT-LLM: its ``backend``, inference-perf's or TraceV2's server
``type``) is assumed nothing.
"""

from __future__ import annotations

import re

FIRST_VERSION = (0, 9)  # the first release with the per-GPU defaults and the A100 exception
LARGE_MIB = 70 * 1024  # 70 GiB of device memory


def version_tuple(text: object) -> tuple[int, ...] | None:
    """``0.11.0`` -> (0, 11, 0); ``v0.10.1.1``, ``0.9.0rc1``, ``0.6.4.post1`` by their leading numbers."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or "").strip())
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def batch_defaults(version: object, gpu: str, whose: str | None = None) -> tuple[dict[str, int], str] | None:
    """(the batch limits vLLM ``version`` chose on GPU preset ``gpu``, where they come from: ``whose``
    default, by default "vLLM VERSION's"), or None where the version is unknown or older than 0.9, or the
    GPU not a preset."""
    from servelab.runners.presets import GPUS

    parsed = version_tuple(version)
    preset = GPUS.get(str(gpu).lower())
    if parsed is None or parsed[:2] < FIRST_VERSION or preset is None:
        return None
    large = preset.memory_mib >= LARGE_MIB and "a100" not in preset.name
    tokens, seqs = (8192, 1024) if large else (2048, 256)
    why = ">= 70 GiB, not an A100" if large else "under 70 GiB or an A100"
    whose = whose or f"vLLM {version}'s"
    where = f"{whose} default on {preset.name} ({why}; vllm/engine/arg_utils.py)"
    return {"max_num_batched_tokens": tokens, "max_num_seqs": min(seqs, tokens)}, where


def recorded_version(source: dict) -> object:
    """The vLLM version a run recorded (``source`` ``vllm_version``, else the engine config line's), or None."""
    return source.get("vllm_version") or source.get("engine_version")


# the oldest release with today's defaults: batch limits per GPU (0.9), async scheduling (0.14)
ASSUMED_VERSION = "0.14"
ASSUMED = f"vLLM {ASSUMED_VERSION}+ assumed (no version recorded)"  # how each setting it gave says so
# a benchmark client's ``backend`` (or TraceV2's server type) naming a server that is not vLLM, whose
# defaults are not vLLM's
OTHER_SERVERS = ("sglang", "lmdeploy", "tgi", "trt", "tensorrt", "llama.cpp", "ollama", "deepspeed")


def version_for_defaults(source: dict) -> tuple[object, str] | None:
    """(the vLLM version whose defaults the run gets, whose they are in an origin's words: "vLLM 0.11.0's")
    — the recorded one, else ``ASSUMED_VERSION`` for a run that names no server other than vLLM; None
    for another server's run."""
    version = recorded_version(source)
    if version is not None:
        return version, f"vLLM {version}'s"
    server = str(source.get("server_type") or source.get("backend") or "").lower()  # (server_type: inference-perf, TraceV2)
    if any(server.startswith(name) for name in OTHER_SERVERS):
        return None
    return ASSUMED_VERSION, f"{ASSUMED}: its"


def fill_batch_defaults(settings: dict, origin: dict[str, str], source: dict) -> None:
    """Add vLLM's defaults for the batch limits ``settings`` lacks (in place): those of the vLLM version
    the run records, else of the version assumed (``version_for_defaults``)."""
    if "gpu" not in settings or {"max_num_seqs", "max_num_batched_tokens"} <= settings.keys():
        return
    known = version_for_defaults(source)
    found = None if known is None else batch_defaults(known[0], str(settings["gpu"]), known[1])
    if found is None:
        return
    values, where = found
    if "max_num_batched_tokens" in settings:  # the cap uses the limit the server ran with
        values["max_num_seqs"] = min(values["max_num_seqs"], int(settings["max_num_batched_tokens"]))
    for key, value in values.items():
        if key not in settings:
            settings[key], origin[key] = value, where


ASYNC_SINCE = (0, 14)  # vLLM 0.14.0's release notes: "Async scheduling is now enabled by default" (#27614)


def fill_async_default(settings: dict, origin: dict[str, str], source: dict) -> None:
    """Turn on async scheduling where the run lacks the setting and its vLLM version, recorded or assumed
    (``version_for_defaults``), is 0.14 or later (where it is vLLM's default), unless the run used pipeline
    parallelism, which 0.14 ran without it."""
    if "async_scheduling" in settings:
        return
    known = version_for_defaults(source)
    parsed = None if known is None else version_tuple(known[0])
    if parsed is None or parsed[:2] < ASYNC_SINCE:
        return
    if int(source.get("pipeline_parallel_size") or 1) > 1:
        return
    settings["async_scheduling"] = True
    origin["async_scheduling"] = f"{known[1]} default (async scheduling, on since 0.14)"


def assumed_warning(settings: dict, origin: dict[str, str], source: dict) -> str | None:
    """The import's warning when a setting came from the assumed version (None when none did)."""
    if recorded_version(source) is not None:
        return None
    assumed = [k for k in ("max_num_batched_tokens", "max_num_seqs", "async_scheduling")
               if k in settings and origin.get(k, "").startswith(ASSUMED)]
    if not assumed:
        return None
    values = ", ".join(f"{k} {settings[k]}" for k in assumed)
    return (f"the run records no vLLM version: replayed with vLLM {ASSUMED_VERSION}+'s defaults ({values}); "
            f"for an older server pass --setting vllm_version=VERSION (or each setting)")
