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
"""

from __future__ import annotations

import re

FIRST_VERSION = (0, 9)  # the first release with the per-GPU defaults and the A100 exception
LARGE_MIB = 70 * 1024  # 70 GiB of device memory


def version_tuple(text: object) -> tuple[int, ...] | None:
    """``0.11.0`` -> (0, 11, 0); ``v0.10.1.1``, ``0.9.0rc1``, ``0.6.4.post1`` by their leading numbers."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or "").strip())
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def batch_defaults(version: object, gpu: str) -> tuple[dict[str, int], str] | None:
    """(the batch limits vLLM ``version`` chose on GPU preset ``gpu``, where they come from), or None
    where the version is unknown or older than 0.9, or the GPU not a preset."""
    from servelab.runners.presets import GPUS

    parsed = version_tuple(version)
    preset = GPUS.get(str(gpu).lower())
    if parsed is None or parsed[:2] < FIRST_VERSION or preset is None:
        return None
    large = preset.memory_mib >= LARGE_MIB and "a100" not in preset.name
    tokens, seqs = (8192, 1024) if large else (2048, 256)
    where = (f"vLLM {version}'s default on {preset.name} ({'>= 70 GiB, not an A100' if large else 'under 70 GiB or an A100'}; "
             "vllm/engine/arg_utils.py)")
    return {"max_num_batched_tokens": tokens, "max_num_seqs": min(seqs, tokens)}, where


def recorded_version(source: dict) -> object:
    """The vLLM version a run recorded (``source`` ``vllm_version``, else the engine config line's), or None."""
    return source.get("vllm_version") or source.get("engine_version")


def fill_batch_defaults(settings: dict, origin: dict[str, str], source: dict) -> None:
    """Add vLLM's defaults for the batch limits ``settings`` lacks (in place), when the run records its
    vLLM version (``source`` ``vllm_version``, else the engine config line's)."""
    if "gpu" not in settings or {"max_num_seqs", "max_num_batched_tokens"} <= settings.keys():
        return
    version = recorded_version(source)
    found = batch_defaults(version, str(settings["gpu"]))
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
    """Turn on async scheduling where the run lacks the setting and records a vLLM version of 0.14 or later
    (where it is vLLM's default), unless the run used pipeline parallelism, which 0.14 ran without it."""
    if "async_scheduling" in settings:
        return
    version = recorded_version(source)
    parsed = version_tuple(version)
    if parsed is None or parsed[:2] < ASYNC_SINCE:
        return
    if int(source.get("pipeline_parallel_size") or 1) > 1:
        return
    settings["async_scheduling"] = True
    origin["async_scheduling"] = f"vLLM {version}'s default (async scheduling, on since 0.14)"
