"""`servelab run import` as a function: parse the source, gather its settings, choose its prefix sharing.

Settings are merged in this order, each later one winning: what the per-request source records,
the run's files beside it (fidelity/sidecars.py; the server log last among them), then
``--setting``. Every setting remembers where it came from (run.json ``config_sources``). A run
whose model or GPU is neither recorded nor given is refused with the option to pass: a silent
default would replay another model or another GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from servelab.common.errors import InputError, ServelabError
from servelab.fidelity.base import (SETTING_TYPES, Measured, build_run, check_settings, detect_format,
                                    import_measured, sources_in_folders)
from servelab.fidelity.prefix_sharing import PrefixChoice, choose
from servelab.fidelity.vllm_defaults import assumed_warning, fill_async_default, fill_batch_defaults, recorded_version
from servelab.replay.results import RunResult
from servelab.traces.prefixes import DEFAULT_BLOCK_TOKENS, PrefixSpec


@dataclass(frozen=True)
class ImportedRun:
    result: RunResult
    trace: pa.Table
    measured: Measured
    fmt: str
    detected: bool  # the format was detected, not given
    prefix: PrefixChoice
    warnings: tuple[str, ...]


def _is_preset(model: object) -> bool:
    """Does a recorded model name a preset (by name or Hugging Face id)?"""
    from servelab.runners.presets import find_model

    if not isinstance(model, str):
        return False
    try:
        find_model(model)
    except ServelabError:
        return False
    return True


def missing_setting_error(key: str, where: str) -> ServelabError:
    from servelab.runners.presets import GPUS, MODELS

    if key == "model":
        return ServelabError(f"{where} names no model; pass --setting model=MODEL (a Hugging Face id such as "
                             f"meta-llama/Llama-3.1-8B, or a preset: {', '.join(MODELS)})")
    return ServelabError(f"{where} names no GPU; pass --setting gpu=GPU (one of {', '.join(GPUS)})")


def _with_format_hint(err: InputError, fmt: str, sources: list[Path], detected: bool) -> InputError:
    """A file that fails the --format it was given but that detection reads as another format: the
    error says what it looks like (a user's wrong --format, not a broken file)."""
    if detected:
        return err
    try:
        looks = detect_format(sources)
    except ServelabError:
        return err
    if looks == fmt:
        return err
    return InputError(err.path, f"{err.rule} (read as --format {fmt}; the file looks like {looks}: "
                                f"pass --format {looks} or leave --format out)", err.column, err.row)


def import_run(sources: list[Path], fmt: str | None = None, *, options: dict | None = None,
               vllm_log: Path | None = None, vllm_metrics: Path | None = None, given: dict[str, Any] | None = None,
               prefix: PrefixSpec | None = None, prefix_from_hit_rate: bool = False,
               detected: bool | None = None) -> ImportedRun:
    """``detected``: the caller detected ``fmt`` (run.json ``source.format_detected``); by default,
    whether ``fmt`` is None here."""
    from servelab.fidelity.sidecars import bare_gpu_note, discover, gpu_preset

    detected = fmt is None if detected is None else detected
    given = check_settings(given or {}, None, "--setting")  # before anything is read: the option's own error
    sources, in_folders = sources_in_folders(sources)  # (a run's folder: the run's file in it)
    version_given = given.pop("vllm_version", None)  # (the source's fact, not an engine setting)
    if fmt is None:
        fmt = detect_format(sources)
    try:
        measured = import_measured(fmt, sources, **(options or {}))
    except InputError as err:
        raise _with_format_hint(err, fmt, sources, detected) from None
    found = discover(sources, vllm_log, vllm_metrics)
    notes, unread = list(in_folders), []
    # Files that disagree on what identifies the run (the model, the vLLM version), or a --vllm-log that
    # disagrees with the run's files, are another run's: only the user knows which is right. A log found
    # beside the run that disagrees on an engine setting is what the server ran (exp-config.yaml and
    # meta.json say what was asked): it wins, and a note says so.
    decided = {*given, *(["vllm_version"] if version_given else [])}
    strict = [c for c in found.conflicts if c.key not in decided
              and (c.key in ("model", "vllm_version") or (vllm_log is not None and c.second[0] == vllm_log))]
    if strict:
        keys = [c.key for c in strict if c.key in SETTING_TYPES]
        decide = f", or --setting {'=VALUE --setting '.join(keys)}=VALUE to say which is right" if keys else ""
        raise ServelabError(f"the run's files disagree: {'; '.join(c.says() for c in strict)} (one of them from "
                            f"another run?); pass the run's own files{decide}")
    for c in found.conflicts:
        value = version_given if c.key == "vllm_version" else given.get(c.key)
        decides = f"--setting {c.key}={value} decides" if c.key in decided else "the server log's wins"
        notes.append(f"the run's files disagree: {c.says()}; {decides}")
    if found.source.get("vllm_log_unread"):
        unread.append(f"{found.log}: no vLLM line recognised in it (arguments, engine config, KV cache, version): "
                      "no setting comes from it")
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in measured.settings.items():
        if value is not None:
            settings[key], origin[key] = value, f"{sources[0].name} ({fmt})"
    settings.update(found.settings)
    origin.update(found.origin)
    for key, value in given.items():
        settings[key], origin[key] = value, "--setting"
    source = {**measured.source, **found.source}
    if version_given:
        recorded = recorded_version(source)
        if recorded is not None and str(recorded) != version_given and not any(
                c.key == "vllm_version" for c in found.conflicts):
            notes.append(f"the run records vLLM {recorded}; --setting vllm_version={version_given} decides")
        source.pop("engine_version", None)
        source["vllm_version"], source["vllm_version_from"] = version_given, "--setting"
    if "gpu" in settings:  # a device name as nvidia-smi prints it, recorded or given, maps to its preset
        preset = gpu_preset(str(settings["gpu"]))
        if preset is None:
            from servelab.runners.presets import GPUS

            if origin["gpu"] == "--setting":
                raise ServelabError(f"--setting gpu={settings['gpu']}: matches no GPU preset (one of {', '.join(GPUS)})")
            raise ServelabError(f"{sources[0]}: the recorded GPU '{settings['gpu']}' ({origin['gpu']}) matches no "
                                f"GPU preset; pass --setting gpu=GPU (one of {', '.join(GPUS)})")
        if preset != settings["gpu"]:
            if (note := bare_gpu_note(settings["gpu"])) is not None:
                notes.append(note)
            source["gpu_recorded" if origin["gpu"] != "--setting" else "gpu_given"] = settings["gpu"]
            settings["gpu"] = preset
    path = source.get("model_path")  # a server log's model when it served it under another name
    if path and origin.get("model") != "--setting" and not _is_preset(settings.get("model")) and _is_preset(path):
        source["model_recorded"] = settings["model"]
        settings["model"] = path
        origin["model"] = f"{origin['model']} (the model it loaded; its served name is no preset)"
    hf = source.get("hf_config")
    if hf and origin.get("model") != "--setting" and not _is_preset(settings.get("model")):
        # a model no preset has (a private or cut-down checkpoint): its config.json beside the run has the shapes
        if "model" in settings:
            source["model_recorded"] = settings["model"]
        settings["model"], origin["model"] = hf, f"{Path(hf).name} (the model's Hugging Face config)"
    for key in ("model", "gpu"):
        if key not in settings:
            raise missing_setting_error(key, f"{sources[0]}: the run")
    fill_batch_defaults(settings, origin, source)  # the server's own defaults, not the replay's
    fill_async_default(settings, origin, source)
    assumed = assumed_warning(settings, origin, source)
    settings = check_settings(settings, sources[0], origin)
    generator = measured.prefix or found.prefix
    measured = dataclasses.replace(measured, settings=settings, source=source, prefix=generator)
    block = int(settings.get("block_size") or DEFAULT_BLOCK_TOKENS)
    hit_rate = source.get("prefix_cache_hit_rate")
    choice = choose(measured, block, prefix, hit_rate, prefix_from_hit_rate)
    result, trace = build_run(measured, fmt, sources, choice.hashes, block if choice.hashes is not None else None)
    meta = dict(result.meta)
    meta["config_sources"] = {k: origin[k] for k in settings}
    meta["prefix"] = dict(choice.record(), measured_hit_rate=hit_rate,
                          measured_hit_rate_from=source.get("prefix_cache_hit_rate_from"))
    warnings = tuple(meta.get("warnings", [])) + tuple(unread) + ((assumed,) if assumed else ()) + choice.warnings
    meta["notes"] = [*meta.get("notes", []), *notes, *choice.notes]
    meta["warnings"] = list(warnings)
    meta["source"] = dict(meta["source"], format_detected=detected)
    if source.get("enable_expert_parallel"):
        meta["notes"].append("the server ran expert parallel (enable_expert_parallel): validate --real spreads "
                             "the experts over the DP x TP GPUs with all-to-all dispatch and combine "
                             "(docs/runners.md \"Parallelism\")")
    result = dataclasses.replace(result, meta=meta)
    return ImportedRun(result, trace, measured, fmt, detected, choice, warnings)
