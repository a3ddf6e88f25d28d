"""A real benchmark's per-request timings as a run directory in servelab's result schema.

Each format's importer (one file per format, registered in ``IMPORTERS``) parses its source into
a ``Measured``: one row per request with absolute times on one clock (any origin), the engine
settings the source records, and which side took the times (``server`` or ``client``).
``build_run`` rebases the times to the first arrival and derives ttft/tpot/e2e exactly as a replay
does (replay/results.py), so ``report``, ``query``, ``compare`` and ``plot`` read it unchanged;
``trace_from`` derives the trace (arrivals, lengths, tenants, prefix hashes when given) that
``validate --real`` replays; ``detect_format`` tells the format from the files. Settings from the
run's other files and the prompt sharing are gathered by run_import.py, sidecars.py and
prefix_sharing.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from servelab.common.errors import InputError, ServelabError, require_distinct
from servelab.common.registry import Registry
from servelab.common.sniff import detect
from servelab.replay.results import RunResult
from servelab.replay.core.schema import REQUESTS_SCHEMA, STEPS_SCHEMA
from servelab.traces.prefixes import PrefixSpec

# format name -> importer(paths: list[Path]) -> Measured
IMPORTERS: Registry[Callable[..., Measured]] = Registry("run import format", package="servelab.fidelity")

# Engine settings an importer may find in its source, with the type each must have (run.json "config").
SETTING_TYPES = {
    "model": str, "gpu": str, "tp": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "block_size": int, "num_gpu_blocks": int, "gpu_memory_utilization": float, "enable_prefix_caching": bool,
    "async_scheduling": bool,  # vLLM's --async-scheduling (its default since 0.14: vllm_defaults.py)
    "replicas": int,  # vLLM's data_parallel_size: engines with a KV cache each
    # vLLM's CPU KV offloading: the host-memory tier's size in GB, or in tokens (fidelity/kv_offload.py)
    "kv_offload_gb": float, "kv_offload_tokens": int, "kv_offload_disk_gb": float,
    # the benchmark client's own timeout, and what it waits for ("finish" or "first_token": replay/platform/abort.py)
    "client_timeout_s": float, "client_timeout_until": str,
    # the server's vLLM release, for a run that does not record it: its defaults (fidelity/vllm_defaults.py);
    # not an engine setting itself, so run import keeps it with what the source records
    "vllm_version": str,
}


@dataclass
class Rows:
    """Column lists an importer fills row by row (``add``), checked as they come."""

    path: Path
    request_id: list[str] = field(default_factory=list)
    tenant: list[str | None] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)
    first_scheduled_s: list[float | None] = field(default_factory=list)
    first_token_s: list[float | None] = field(default_factory=list)
    finish_s: list[float | None] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    reason: list[str | None] = field(default_factory=list)
    max_itl_s: list[float | None] = field(default_factory=list)
    itls_s: list[list[float] | None] = field(default_factory=list)  # the source's gaps between streamed chunks
    # what the source says about each prompt's content, for prefix hashes (traces/prefixes.py)
    token_ids: list[Any] = field(default_factory=list)  # the prompt's token ids, or None
    prompt_text: list[str | None] = field(default_factory=list)
    prefix_group: list[int | None] = field(default_factory=list)  # TraceV2 prefix_group (as an index)
    prefix_length: list[int | None] = field(default_factory=list)  # TraceV2 prefix_length
    warnings: list[str] = field(default_factory=list)  # rows kept as failed requests, and why
    source_file: list[Path] = field(default_factory=list)  # the file each row came from (``path`` when added)
    source_row: list[int] = field(default_factory=list)  # and its row there, as errors name it

    def add(self, row: int, request_id: object, arrival_s: float, prompt_tokens: int, output_tokens: int, *,
            first_token_s: float | None = None, finish_s: float | None = None,
            first_scheduled_s: float | None = None, ok: bool = True, reason: str | None = None,
            tenant: str | None = None, max_itl_s: float | None = None, token_ids: Any = None,
            prompt_text: str | None = None, prefix_group: int | None = None,
            prefix_length: int | None = None, itls_s: list[float] | None = None) -> None:
        """One request; ``row`` (1-based) names it in errors. A successful request needs a first token
        and a finish no earlier than its arrival, in that order. One the source calls successful that
        lacks its first token or finish time, or produced no token, did not complete: it is kept as a
        failed request, with a warning (never a request finishing at time 0)."""
        def bad(column: str, rule: str) -> InputError:
            return InputError(self.path, rule, column=column, row=row)

        for name, value in (("arrival", arrival_s), ("first token", first_token_s), ("finish", finish_s),
                            ("first scheduled", first_scheduled_s)):
            if value is not None and not math.isfinite(value):
                raise bad(name, "not a finite time")
        if prompt_tokens is None or prompt_tokens < 0:
            raise bad("prompt tokens", f"needs a token count >= 0, got {prompt_tokens}")
        if output_tokens is None or output_tokens < 0:
            raise bad("output tokens", f"needs a token count >= 0, got {output_tokens}")
        if ok:
            missing = [name for name, value in (("first token", first_token_s), ("finish", finish_s),
                                                ("prompt token", prompt_tokens or None),
                                                ("output token", output_tokens or None)) if value is None]
            if missing:
                where = f"{self.path.name} row {row}"
                what = f"reported successful but has no {' or '.join(missing)}"
                self.warnings.append(f"{where}: {what} (did not complete); kept as a failed request")
                ok, reason = False, f"not completed: {what}"
        if ok:
            if first_token_s < arrival_s - 1e-6 or finish_s < first_token_s - 1e-6:
                raise bad("first token" if first_token_s < arrival_s - 1e-6 else "finish",
                          f"times out of order (arrival {arrival_s}, first token {first_token_s}, finish {finish_s})")
        self.request_id.append(str(request_id))
        self.source_file.append(self.path)
        self.source_row.append(row)
        self.tenant.append(tenant)
        self.arrival_s.append(float(arrival_s))
        self.first_scheduled_s.append(first_scheduled_s)
        self.first_token_s.append(first_token_s)
        self.finish_s.append(finish_s if ok else None)
        self.prompt_tokens.append(int(prompt_tokens))
        self.output_tokens.append(int(output_tokens))
        self.ok.append(bool(ok))
        self.reason.append(None if ok else (reason or "failed"))
        if itls_s is not None:
            for k, gap in enumerate(itls_s):
                if not math.isfinite(gap) or gap < 0:
                    raise bad("itls", f"gap {k} is not a time >= 0: {gap}")
            if max_itl_s is None and itls_s:
                max_itl_s = max(itls_s)
        self.max_itl_s.append(max_itl_s)
        self.itls_s.append(itls_s)
        self.token_ids.append(token_ids)
        self.prompt_text.append(prompt_text)
        self.prefix_group.append(prefix_group)
        self.prefix_length.append(prefix_length)

    def __len__(self) -> int:
        return len(self.arrival_s)


@dataclass(frozen=True)
class Measured:
    rows: Rows
    clock: str  # "server": engine-side timestamps; "client": the benchmark client's
    settings: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)  # anything else worth keeping (versions, rates)
    notes: tuple[str, ...] = ()  # what the importer left out or assumed, printed and kept in run.json
    prefix: PrefixSpec | None = None  # the generator's prompt sharing, where the source records it
    # how the client sent (run.json "load"): {"shape": "open"|"closed", "users": C, "request_rate": r, ...};
    # a closed loop's trace gets sessions (fidelity/load_shape.py)
    load: dict[str, Any] = field(default_factory=dict)


# what each numeric setting must be: a count of at least one, a share of the GPU's memory, a time
_COUNT = (lambda v: v >= 1, "must be at least 1")
SETTING_RULES = {"tp": _COUNT, "max_num_seqs": _COUNT, "max_num_batched_tokens": _COUNT, "block_size": _COUNT,
                 "num_gpu_blocks": _COUNT, "replicas": _COUNT, "kv_offload_tokens": _COUNT,
                 "kv_offload_gb": (lambda v: v > 0, "must be above 0"),
                 "kv_offload_disk_gb": (lambda v: v > 0, "must be above 0"),
                 "gpu_memory_utilization": (lambda v: 0 < v <= 1, "must be above 0 and at most 1"),
                 "client_timeout_s": (lambda v: v > 0, "must be above 0"),
                 "vllm_version": (lambda v: re.match(r"v?\d+\.\d+", v.strip()) is not None,
                                  "must be a vLLM release such as 0.14 or 0.11.0")}


def check_settings(settings: dict[str, Any], path: Path | None, origin: dict[str, str] | str | None = None
                   ) -> dict[str, Any]:
    """``settings`` as their types (SETTING_TYPES), each checked to be in its range. A bad one is an
    error naming where it came from (``origin``: per setting, or one for all): ``--setting KEY``, or the
    file (``path``) and the file that recorded it."""
    out = {}
    for key, value in settings.items():
        if value is None:
            continue
        want = SETTING_TYPES[key]
        where = origin.get(key) if isinstance(origin, dict) else origin
        try:
            if want is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            out[key] = want(value) if want is not bool else _as_bool(value)
        except (TypeError, ValueError):
            kind = {int: "a whole number", float: "a number", bool: "true or false"}.get(want, f"a {want.__name__}")
            raise _setting_error(key, value, f"is not {kind}", where, path) from None
        test, rule = SETTING_RULES.get(key, (None, ""))
        if test is not None and not test(out[key]):
            raise _setting_error(key, value, rule, where, path)
    return out


def _setting_error(key: str, value: Any, rule: str, where: str | None, path: Path | None) -> ServelabError:
    if where == "--setting" or path is None:
        return ServelabError(f"--setting {key}={value}: {rule}")
    return InputError(path, f"setting '{key}' {rule}, got {value!r}" + (f" (from {where})" if where else ""),
                      column=key)


def _as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(value)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text (expected JSON)") from None
    except json.JSONDecodeError as err:
        raise InputError(path, f"not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None


def optional_json_object(path: Path, what: str) -> dict:
    """A JSON object file that may sit beside a source (a summary, a config): {} when it is not there, a
    one-line error naming it when it is not an object (``what``: the file's kind, for that error)."""
    if not path.is_file():
        return {}
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise InputError(path, f"not {what} (expected a JSON object)")
    return doc


def read_yaml(path: Path) -> Any:
    """A YAML file's document (PyYAML imported on first use), or a one-line error naming the file."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise InputError(path, f"not valid YAML ({str(err).splitlines()[0]})") from None


def one_json(paths: list[Path], takes: str, kind: type, expected: str) -> tuple[Path, Any]:
    """The single JSON source of an importer that reads one file (``takes``: the error on a second
    file), parsed and checked to be a ``kind`` (``expected``: the error otherwise)."""
    if len(paths) != 1:
        raise InputError(paths[1], takes)
    doc = read_json(paths[0])
    if not isinstance(doc, kind):
        raise InputError(paths[0], expected)
    return paths[0], doc


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def detect_format(paths: list[Path]) -> str:
    """The import format of ``paths``: the first importer (by its ``@detects`` order) whose test of the
    first one's name and first bytes passes (common/sniff.py), or an error naming the first file (and,
    for a tool's summary report, the per-request file to import instead)."""
    try:
        return detect(IMPORTERS, list(paths), 1 << 16, "cannot tell the format (not an OTel, GuideLLM, "
                      "inference-perf, vllm bench, SGLang bench_serving, genai-perf, AIPerf, timestamps JSONL or "
                      "TraceV2 file); pass --format",
                      folder_hint=" (a TraceV2 folder holds trace.yaml and trace.csv)")
    except InputError:
        hint = summary_only(Path(paths[0]))
        if hint:
            raise InputError(Path(paths[0]), hint) from None
        raise


# A tool's report of aggregates only (name pattern, tool, the per-request file it writes when asked): servelab
# compares request by request, so such a run is named for what it is, with the option that keeps its requests.
SUMMARY_REPORTS = (
    ("*_lifecycle_metrics.json", "inference-perf", "per_request_lifecycle_metrics.json, written with "
     "`report: request_lifecycle: per_request: true` in its config"),
    ("profile_export_aiperf.json", "AIPerf", "profile_export.jsonl, which AIPerf writes beside it"),
    ("profile_export_aiperf.csv", "AIPerf", "profile_export.jsonl, which AIPerf writes beside it"),
    ("*genai_perf.json", "genai-perf", "profile_export.json, which genai-perf writes beside it"),
    ("*genai_perf.csv", "genai-perf", "profile_export.json, which genai-perf writes beside it"),
)


def summary_only(path: Path) -> str | None:
    """What ``path`` (a file, or a folder's files) is when it is a benchmark tool's summary report and no
    run file: the message naming the per-request report to import instead; else None."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for pattern, tool, instead in SUMMARY_REPORTS:
        hits = [p for p in files if p.match(pattern) and not p.name.startswith("per_request")]
        if hits:
            shown = ", ".join(str(p.relative_to(path)) if path.is_dir() else p.name for p in hits[:3])
            more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
            return (f"holds {tool}'s summary report ({shown}{more}): aggregates only, no request's times, and "
                    f"servelab compares a run request by request; import {instead}")
    return None


# formats whose one run may be several files (an exporter's rotated or split files); the others read one
SPLIT_FORMATS = ("otel", "timestamps-jsonl")


def sources_in_folders(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """``paths`` with each folder given (other than a TraceV2 folder, itself the source) replaced by the
    run's file in it: the files of the folder, else of its subfolders (inference-perf's ``results/``), that
    a format's detection recognises, TraceV2's loose ``.yaml``/``.csv`` aside (a sidecar such as
    exp-config.yaml is not a trace). One format's files: those (an OTel exporter's rotated files),
    or the one file of a single-file format; anything else is an error listing what it found. Also the
    notes saying which file each folder gave."""
    out: list[Path] = []
    notes: list[str] = []
    for path in paths:
        path = Path(path)
        if not path.is_dir() or (path / "trace.yaml").is_file() or (path / "trace.csv").is_file():
            out.append(path)
            continue
        found = _run_files(_visible(path, Path.is_file))
        if not found:
            found = _run_files(sorted(p for sub in _visible(path, Path.is_dir) for p in _visible(sub, Path.is_file)))
        if not found:
            hint = summary_only(path)
            raise InputError(path, f"is a folder with no run file in it that a format recognises; it {hint}" if hint
                             else "is a folder with no run file in it that a format recognises (a TraceV2 folder "
                                  "holds trace.yaml and trace.csv); pass the run's file")
        formats = sorted({fmt for _, fmt in found})
        if len(formats) > 1 or (len(found) > 1 and formats[0] not in SPLIT_FORMATS):
            listed = ", ".join(f"{p.relative_to(path)} ({fmt})" for p, fmt in found)
            raise InputError(path, f"is a folder with several runs' files or several kinds of file: {listed}; "
                                   "pass the one to import")
        files = [p for p, _ in found]
        out.extend(files)
        notes.append(f"{path}: a folder; its run {'files' if len(files) > 1 else 'file'} "
                     f"{', '.join(str(p.relative_to(path)) for p in files)} ({formats[0]})")
    return out, notes


def _visible(folder: Path, kind: Callable[[Path], bool]) -> list[Path]:
    """The entries of ``folder`` of a ``kind`` (files, folders), hidden ones aside, by name."""
    return sorted(p for p in folder.iterdir() if kind(p) and not p.name.startswith("."))


def _run_files(candidates: list[Path]) -> list[tuple[Path, str]]:
    """(file, format) for each of ``candidates`` a format's detection recognises (not TraceV2's loose
    YAML/CSV test, nor a file detection cannot read)."""
    found = []
    for p in candidates:
        try:
            fmt = detect_format([p])
        except InputError:
            continue
        if fmt != "blis":
            found.append((p, fmt))
    return found


def import_measured(fmt: str, paths: list[Path], **options) -> Measured:
    importer = IMPORTERS.get(fmt)
    for p in paths:
        if p.is_dir() and fmt != "blis":
            raise InputError(p, "is a folder, not a file")
        if not p.exists():
            raise InputError(p, "file not found")
    require_distinct(paths)
    measured = importer(paths, **options)
    if len(measured.rows) == 0:
        raise InputError(paths[0], "no requests found")
    unique_ids(measured.rows)
    return measured


def unique_ids(rows: Rows) -> None:
    """Each request's source id once. An id in two source files means they are not the parts of one
    run (two runs, or one run's file twice): an error naming both. An id repeated within one file
    (a client that reuses ids) keeps each request, the repeats as ``ID#2``, ``ID#3``, with a warning."""
    first: dict[str, int] = {}
    repeats: dict[Path, list[int]] = {}
    for i, rid in enumerate(rows.request_id):
        j = first.setdefault(rid, i)
        if j == i:
            continue
        if rows.source_file[j] != rows.source_file[i]:
            raise InputError(rows.source_file[i], f"request id '{rid}' is also {rows.source_file[j]}'s row "
                             f"{rows.source_row[j]}: the sources are not the files of one run (two runs, or one "
                             "file twice); import each run on its own", column="request_id", row=rows.source_row[i])
        repeats.setdefault(rows.source_file[i], []).append(i)
    for path, repeated in repeats.items():
        ids = [rows.request_id[i] for i in repeated]
        for i in repeated:
            rid, k = rows.request_id[i], 2
            while f"{rid}#{k}" in first:
                k += 1
            first[f"{rid}#{k}"] = i
            rows.request_id[i] = f"{rid}#{k}"
        rows.warnings.append(f"{path.name}: {len(set(ids))} request id(s) used more than once (first '{ids[0]}', rows "
                             f"{rows.source_row[first[ids[0]]]} and {rows.source_row[repeated[0]]}); each request is "
                             f"kept, a repeat's id followed by #2, #3, ...")


def _order(rows: Rows) -> np.ndarray:
    # arrival first, then the source's order: a stable sort keeps the result deterministic
    return np.argsort(np.asarray(rows.arrival_s, dtype=np.float64), kind="stable")


def build_run(measured: Measured, fmt: str, paths: list[Path], prefix_hashes: list[list[int]] | None = None,
              prefix_block_tokens: int | None = None) -> tuple[RunResult, pa.Table]:
    """The requests table (REQUESTS_SCHEMA, times since the first arrival), run.json, and the trace
    (with ``prefix_hashes``, one list per row of ``measured.rows``, when given)."""
    rows = measured.rows
    order = _order(rows)
    n = len(order)
    t0 = float(np.asarray(rows.arrival_s, dtype=np.float64)[order[0]])

    def rebased(values: list[float | None]) -> list[float | None]:
        return [None if values[i] is None else values[i] - t0 for i in order]

    arrival = rebased(rows.arrival_s)
    first_token = rebased(rows.first_token_s)
    finish = rebased(rows.finish_s)
    scheduled = rebased(rows.first_scheduled_s)
    prompt = [rows.prompt_tokens[i] for i in order]
    output = [rows.output_tokens[i] for i in order]
    ok = [rows.ok[i] for i in order]
    ttft, tpot, e2e = [], [], []
    for a, f, e, o, good in zip(arrival, first_token, finish, output, ok):
        ttft.append(f - a if f is not None else None)
        if good:
            e2e.append(e - a)
            tpot.append((e - f) / (o - 1) if o > 1 else 0.0)
        else:
            e2e.append(None)
            tpot.append(None)
    tenants = [rows.tenant[i] or "default" for i in order]
    columns = {
        "request_id": list(range(n)),
        "tenant": tenants,
        "tier": ["standard"] * n,
        "session_id": [None] * n,
        "replica": [0] * n,
        "status": [failure_status(good, rows.reason[i]) for good, i in zip(ok, order)],
        "reason": [rows.reason[i] for i in order],
        "arrival_s": arrival,
        "first_scheduled_s": scheduled,
        "first_token_s": first_token,
        "finish_s": finish,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "generated_tokens": [o if good else 0 for o, good in zip(output, ok)],
        "num_preemptions": [None] * n,  # not recorded by any of the formats
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "max_itl_s": [rows.max_itl_s[i] for i in order],
        "ttft_slo_s": [None] * n,
        "tpot_slo_s": [None] * n,
        "cached_tokens": [None] * n,
    }
    requests = pa.Table.from_arrays([pa.array(columns[f.name], type=f.type) for f in REQUESTS_SCHEMA],
                                    schema=REQUESTS_SCHEMA)
    # the source's own request id (a GuideLLM UUID, a span's gen_ai.request.id, a vLLM-bench list
    # index), so a row can be matched back to its source without relying on order
    requests = requests.append_column(pa.field("source_request_id", pa.string()),
                                      pa.array([rows.request_id[i] for i in order], pa.string()))
    hashes = None if prefix_hashes is None else [prefix_hashes[i] for i in order]
    trace = trace_from(requests, source_ids=[rows.request_id[i] for i in order], prefix_hashes=hashes,
                       prefix_block_tokens=prefix_block_tokens)
    if measured.load.get("shape") == "closed":
        from servelab.fidelity.load_shape import closed_loop

        trace = closed_loop(trace, requests, int(measured.load["users"]))
    tokens = _token_gaps(rows, order, first_token)
    from servelab import __version__

    settings = check_settings(measured.settings, paths[0])
    meta = {
        "servelab_version": __version__,
        "measured": True,
        "clock": measured.clock,
        "source": dict(measured.source, format=fmt,
                       files=[{"path": str(p), "sha256": sha256(p)} for p in _files(paths)]),
        "notes": list(measured.notes),
        "warnings": list(rows.warnings),
        **({"load": dict(measured.load)} if measured.load else {}),
        "trace": {"name": paths[0].name, "rows": trace.num_rows, "path": "trace.arrow"},
        "policy": {"name": "measured", "params": {}},
        "runner": {"name": "measured", "spec": None, "params": {}},
        "engine": {k: v for k, v in settings.items() if k not in ("model", "gpu", "tp")},
        "config": settings,
        "counts": _counts(requests),
        "measured_span_s": max((e for e in finish if e is not None), default=0.0),
    }
    steps = STEPS_SCHEMA.empty_table()
    return RunResult(requests, steps, meta, tokens=tokens), trace


def _token_gaps(rows: Rows, order: np.ndarray, first_token: list[float | None]) -> pa.Table | None:
    """tokens.parquet of a source that records the gaps between streamed chunks (vLLM bench's
    ``itls``): one row per chunk, the first at the request's first token, each ``itl_s`` the
    source's own gap (not a difference of rebased times), so ITL percentiles are the source's."""
    if not any(g for g in rows.itls_s):
        return None
    from servelab.replay.core.logs import tokens_schema

    rid, index, times, itl = [], [], [], []
    for new_id, i in enumerate(order):
        gaps, t = rows.itls_s[i], first_token[new_id]
        if gaps is None or t is None or not rows.ok[i]:
            continue
        rid.append(new_id)
        index.append(1)
        times.append(t)
        itl.append(None)
        for k, gap in enumerate(gaps, start=2):
            t += gap
            rid.append(new_id)
            index.append(k)
            times.append(t)
            itl.append(float(gap))
    schema = tokens_schema()
    return pa.table({"request_id": pa.array(rid, pa.int64()), "token_index": pa.array(index, pa.int32()),
                     "time_s": pa.array(times, pa.float64()), "itl_s": pa.array(itl, pa.float64())}, schema=schema)


def failure_status(ok: bool, reason: str | None) -> str:
    """A request's status as its client recorded it, in the live runs' words (docs/live.md): ``finished``;
    ``timeout`` where the error says it timed out; ``cancelled`` for a request still in flight when the
    benchmark stopped (GuideLLM's ``incomplete``); otherwise ``failed``."""
    if ok:
        return "finished"
    text = (reason or "").lower()
    if "timeout" in text or "timed out" in text:
        return "timeout"
    if "incomplete" in text or "cancel" in text:
        return "cancelled"
    return "failed"


def _counts(requests: pa.Table) -> dict[str, int]:
    counts = {"finished": 0, "unfinished": 0}
    for status in requests.column("status").to_pylist():
        counts[status] = counts.get(status, 0) + 1
    return counts


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        out.extend(sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p])
    return out


def trace_from(requests: pa.Table, source_ids: list[str] | None = None, prefix_hashes: list[list[int]] | None = None,
               prefix_block_tokens: int | None = None) -> pa.Table:
    """The trace a measured run replays: every request the server saw (arrival, prompt and output
    lengths, tenant), in the run's request ids. Requests that failed before producing a token
    (client errors, no output) are left out: the server may never have seen them."""
    status = requests.column("status").to_pylist()
    prompt = requests.column("prompt_tokens").to_pylist()
    output = requests.column("output_tokens").to_pylist()
    keep = [i for i, (s, p, o) in enumerate(zip(status, prompt, output)) if s == "finished" or (p >= 1 and o >= 1)]
    if not keep:
        raise ServelabError("the imported run has no request with a prompt and an output to replay")
    idx = pa.array(keep, type=pa.int64())
    columns = {
        "request_id": requests.column("request_id").take(idx),
        "arrival_s": requests.column("arrival_s").take(idx),
        "prompt_tokens": requests.column("prompt_tokens").take(idx),
        "output_tokens": requests.column("output_tokens").take(idx),
        "tenant": requests.column("tenant").take(idx),
    }
    if prefix_hashes is not None:
        from servelab.traces.prefixes import hashes_column

        columns["prefix_hashes"] = hashes_column([prefix_hashes[i] for i in keep])
    from servelab.traces.io import prepare

    return prepare(pa.table(columns), "imported run", source="measured run",
                   prefix_block_tokens=prefix_block_tokens if prefix_hashes is not None else None)


def write_measured_run(result: RunResult, trace: pa.Table, run_dir: Path, trace_out: Path | None = None) -> None:
    """requests.parquet, steps.parquet (empty: no per-step data), run.json and trace.arrow, all or nothing."""
    from servelab.common.atomic import atomic_dir
    from servelab.replay.results import write_parquet
    from servelab.traces.io import write_trace

    meta = dict(result.meta, run_id=run_dir.name)
    raw = (trace.schema.metadata or {}).get(b"prefix_block_tokens")
    block_tokens = int(raw) if raw else None
    with atomic_dir(run_dir) as tmp:
        write_parquet(result.requests, tmp / "requests.parquet")
        write_parquet(result.steps, tmp / "steps.parquet")
        write_trace(trace, tmp / "trace.arrow", source="measured run", prefix_block_tokens=block_tokens)
        if isinstance(result.tokens, pa.Table):
            write_parquet(result.tokens, tmp / "tokens.parquet")
        (tmp / "run.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if trace_out is not None:
        write_trace(trace, trace_out, source=f"measured run {run_dir.name}", prefix_block_tokens=block_tokens)
