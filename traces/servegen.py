"""Expand ServeGen client-level data (per-client rate/CV windows + length PMFs) into a request trace.

Each ``chunk-N`` is one API client and becomes tenant ``chunk-N``. Its ``chunk-N-trace.csv`` gives,
per 600 s window, a mean rate, an inter-arrival CV and a gap family (Gamma or Weibull). Arrivals
are one renewal process per client in operational time (each window contributes rate × length
units), so a gap may span windows and a rate-0 window pauses the client instead of restarting it;
the process starts in its stationary state, so the expected count equals Σ rate × window. Lengths
come from ``chunk-N-dataset.json`` (6 h windows of PMFs): the window holding the arrival time, or
the nearest one with data when that one is empty.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from servelab.common.errors import InputError, ServelabError, require_file
from servelab.common.sniff import detects
from servelab.common.textfile import read_text
from servelab.traces import schema
from servelab.traces.arrivals import stationary_first_gap, unit_gaps
from servelab.traces.imported import IMPORTERS, Imported

_CHUNK = re.compile(r"^chunk-(\d+)-trace\.csv$")
_FAMILIES = {"gamma": "gamma", "weibull": "weibull", "": "gamma"}


@dataclass(frozen=True)
class Window:
    start_s: float
    length_s: float
    rate_per_s: float
    cv: float
    process: str


@dataclass(frozen=True)
class Pmf:
    values: np.ndarray
    probs: np.ndarray

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.values[rng.choice(len(self.values), size=n, p=self.probs)]


def _float(path: Path, text: str, column: str, row: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(path, f"not a number: '{text}'", column=column, row=row) from None
    if not math.isfinite(value):
        raise InputError(path, f"not a finite number: '{text}'", column=column, row=row)
    return value


def read_windows(path: Path) -> list[Window]:
    """Parse a headerless chunk-N-trace.csv: window_start_s, rate, iat_cv, pattern, shape, scale."""
    rows = []
    for i, rec in enumerate(csv.reader(read_text(path).splitlines()), start=1):
        if not rec or not "".join(rec).strip():
            continue
        if len(rec) < 4:
            raise InputError(path, f"expected at least 4 fields, got {len(rec)}", row=i)
        start = _float(path, rec[0], "window_start_s", i)
        rate = _float(path, rec[1], "rate", i)
        cv = _float(path, rec[2], "iat_cv", i) if rec[2].strip() else 0.0
        family = rec[3].strip().lower()
        if rate < 0:
            raise InputError(path, "rate must be >= 0", column="rate", row=i)
        if family not in _FAMILIES:
            raise InputError(path, f"unknown pattern '{rec[3]}' (Gamma, Weibull or empty)", column="pattern", row=i)
        if rate > 0 and cv <= 0:
            raise InputError(path, "iat_cv must be > 0 where rate > 0", column="iat_cv", row=i)
        if rows and start <= rows[-1][0]:
            raise InputError(path, "window starts must increase", column="window_start_s", row=i)
        rows.append((start, rate, cv, _FAMILIES[family]))
    if not rows:
        raise InputError(path, "file has no windows")
    starts = [r[0] for r in rows]
    default_len = starts[1] - starts[0] if len(starts) > 1 else 600.0
    lengths = [b - a for a, b in zip(starts, starts[1:])] + [default_len]
    return [Window(s, ln, r, cv, fam) for (s, r, cv, fam), ln in zip(rows, lengths)]


def client_arrivals(windows: list[Window], start_s: float, end_s: float, rng: np.random.Generator) -> np.ndarray:
    """Absolute arrival times in [start_s, end_s) of one client's windowed renewal process."""
    out = []
    carry: float | None = None  # operational time left until the next arrival
    for w in windows:
        lo, hi = max(w.start_s, start_s), min(w.start_s + w.length_s, end_s)
        if hi <= lo or w.rate_per_s <= 0:
            continue
        span = w.rate_per_s * (hi - lo)
        if carry is None:
            carry = stationary_first_gap(w.process, w.cv, rng)
        if carry >= span:
            carry -= span
            continue
        points = [np.array([carry])]
        last = carry
        while last < span:
            m = int(span - last) + 16
            nxt = last + np.cumsum(unit_gaps(w.process, w.cv, m, rng))
            points.append(nxt)
            last = float(nxt[-1])
        u = np.concatenate(points)
        inside = u < span
        carry = float(u[~inside][0]) - span
        out.append(lo + u[inside] / w.rate_per_s)
    return np.concatenate(out) if out else np.zeros(0)


def _parse_pmf(path: Path, window: str, name: str, text: object) -> Pmf | None:
    """A PMF given as a Python-dict string {tokens: prob}; None when it carries no positive mass."""
    try:
        pmf = ast.literal_eval(text) if isinstance(text, str) else text
        if not isinstance(pmf, dict):
            raise ValueError("not a dict")
        values = np.array([float(k) for k in pmf], dtype=np.float64)
        probs = np.array([float(v) for v in pmf.values()], dtype=np.float64)
    except (ValueError, SyntaxError, TypeError) as err:
        raise InputError(path, f"not a {{tokens: probability}} mapping ({err})", column=f"{window}.{name}") from None
    if len(values) and (not np.all(np.isfinite(probs)) or (probs < 0).any() or (values < 0).any()):
        raise InputError(path, "negative or non-finite entry", column=f"{window}.{name}")
    return Pmf(np.rint(values).astype(np.int64), probs) if len(values) else Pmf(np.zeros(0, np.int64), probs)


def _positive(pmf: Pmf) -> Pmf | None:
    """Condition on >= 1 token (zero-token entries are placeholders or failed requests)."""
    keep = (pmf.values >= 1) & (pmf.probs > 0)
    if not keep.any():
        return None
    p = pmf.probs[keep]
    return Pmf(pmf.values[keep], p / p.sum())


@dataclass(frozen=True)
class LengthWindow:
    start_s: float
    prompt_parts: tuple[Pmf, ...]  # summed: text + image + audio + video for multimodal
    output: Pmf
    part_names: tuple[str, ...] = ()  # each part's field (text_tokens, image_tokens, ...), as prompt_parts


def read_length_windows(path: Path) -> list[LengthWindow]:
    """Parse chunk-N-dataset.json into windows that have usable prompt and output PMFs."""
    try:
        data = json.loads(read_text(path))  # a folder or bytes that are not UTF-8: InputError naming the line
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(path, f"not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise InputError(path, "expected an object mapping window start to PMFs")
    windows = []
    for key in sorted(data, key=lambda k: float(k)):
        fields = data[key]
        if "output_tokens" not in fields:
            raise InputError(path, "missing PMF", column=f"{key}.output_tokens")
        names = ["input_tokens"] if "input_tokens" in fields else sorted(
            n for n in fields if n.endswith("_tokens") and n != "output_tokens"
        )
        if not names:
            raise InputError(path, "no input PMF (input_tokens or *_tokens)", column=str(key))
        output = _positive(_parse_pmf(path, key, "output_tokens", fields["output_tokens"]))
        named = [(n, _parse_pmf(path, key, n, fields[n])) for n in names]
        named = [(n, p) for n, p in named if len(p.values)]
        parts = [p for _, p in named]
        if output is None or not parts or not any((p.values >= 1).any() for p in parts):
            continue  # empty window: lengths come from the nearest window with data
        windows.append(LengthWindow(float(key), tuple(parts), output, tuple(n for n, _ in named)))
    if not windows:
        raise InputError(path, "no window has non-empty input and output PMFs")
    return windows


MODALITIES = ("image_tokens", "audio_tokens", "video_tokens")  # the parts a multimodal dataset names


def sample_lengths(windows: list[LengthWindow], times_s: np.ndarray, rng: np.random.Generator,
                   modalities: dict[str, np.ndarray] | None = None):
    """Prompt and output lengths for arrivals at absolute ``times_s``; with ``modalities`` (an empty
    dict), also each multimodal part's tokens per arrival, by field name (the same draws)."""
    starts = np.array([w.start_s for w in windows])
    idx = np.clip(np.searchsorted(starts, times_s, side="right") - 1, 0, len(windows) - 1)
    prompt = np.zeros(len(times_s), np.int64)
    output = np.zeros(len(times_s), np.int64)
    for i in np.unique(idx):
        sel = np.flatnonzero(idx == i)
        w = windows[i]
        for k, part in enumerate(w.prompt_parts):
            drawn = part.sample(len(sel), rng)
            prompt[sel] += drawn
            if modalities is not None and k < len(w.part_names) and w.part_names[k] in MODALITIES:
                modalities.setdefault(w.part_names[k], np.zeros(len(times_s), np.int64))[sel] = drawn
        output[sel] = w.output.sample(len(sel), rng)
    # A multimodal request whose sampled parts are all 0 still sends at least one token.
    return np.maximum(prompt, 1), output


def _clients(path: Path) -> list[tuple[str, int, Path]]:
    if path.is_dir():
        found = []
        for p in path.iterdir():
            m = _CHUNK.match(p.name)
            if m:
                found.append((f"chunk-{m.group(1)}", int(m.group(1)), p))
        if not found:
            raise InputError(path, "no chunk-N-trace.csv files in this folder")
        return sorted(found, key=lambda c: c[1])
    m = _CHUNK.match(path.name)
    if not m:
        raise InputError(path, "expected a ServeGen folder or a chunk-N-trace.csv file")
    require_file(path)
    return [(f"chunk-{m.group(1)}", int(m.group(1)), path)]


@IMPORTERS.register("servegen")
@detects(lambda p: p.path.is_dir() or _CHUNK.match(p.path.name) is not None, order=0)  # (a folder of chunks)
def import_servegen(
    paths: list[Path],
    start_s: float = 0.0,
    duration_s: float = 3600.0,
    seed: int = 0,
    clients: tuple[str, ...] | None = None,
    skip_missing: bool = False,
    modalities: bool = False,
) -> Imported:
    """Sample a multi-tenant trace for [start_s, start_s + duration_s) of the ServeGen day.

    ``skip_missing``: a client whose ``chunk-N-dataset.json`` is absent is left out (its sampled
    requests are dropped and counted) instead of failing the import; ``Imported.warnings`` says which
    clients and what share of the window's requests they had. ``modalities``: a multimodal dataset's
    image, audio and video tokens (still summed into ``prompt_tokens``) also get their own columns
    ``image_tokens``, ``audio_tokens``, ``video_tokens``, for a replay with an encoder.
    """
    if start_s < 0 or not duration_s > 0:
        raise ServelabError(f"need --start >= 0 and --duration > 0 (got {start_s}, {duration_s})")
    end_s = start_s + duration_s
    multi = len(paths) > 1
    times, prompts, outputs, tenants, models = [], [], [], [], []
    parts: list[dict[str, np.ndarray]] = []  # per client with requests: its modalities' tokens (``modalities``)
    skipped: list[tuple[str, int]] = []  # (client, requests it had in the window)
    seen = set()
    for folder_idx, folder in enumerate(paths):
        model = folder.name if folder.is_dir() else folder.parent.name
        for name, chunk_id, trace_csv in _clients(folder):
            if clients is not None and name not in clients:
                continue
            seen.add(name)
            windows = read_windows(trace_csv)
            last = windows[-1].start_s + windows[-1].length_s
            if end_s > last:
                raise ServelabError(f"{trace_csv}: window {start_s}-{end_s} s runs past the data's end ({last} s)")
            # One generator per client, keyed by its chunk id: a client's requests do not change
            # when other clients are added or filtered out.
            rng = np.random.default_rng([seed, chunk_id, folder_idx] if multi else [seed, chunk_id])
            t = client_arrivals(windows, start_s, end_s, rng)
            if len(t) == 0:
                continue
            dataset = trace_csv.with_name(f"{name}-dataset.json")
            if not dataset.exists():
                if skip_missing:
                    skipped.append((f"{model}/{name}" if multi else name, len(t)))
                    continue
                raise InputError(dataset, "file not found (needed beside its trace CSV; "
                                          "--skip-missing leaves out clients without one)")  # fmt: skip
            drawn: dict[str, np.ndarray] | None = {} if modalities else None
            prompt, output = sample_lengths(read_length_windows(dataset), t, rng, drawn)
            if drawn is not None:
                parts.append(drawn)
            times.append(t - start_s)
            prompts.append(prompt)
            outputs.append(output)
            tenants.append(f"{model}/{name}" if multi else name)
            models.append(model)
    if clients is not None and set(clients) - seen:
        raise ServelabError(f"unknown ServeGen client(s): {', '.join(sorted(set(clients) - seen))}")
    if not times and skipped:
        raise ServelabError(f"every ServeGen client with requests in {start_s}-{end_s} s lacks its "
                            f"chunk-N-dataset.json ({_names(skipped)}); nothing left to import")  # fmt: skip
    if not times:
        raise ServelabError(f"no ServeGen client has requests in {start_s}-{end_s} s")
    counts = [len(t) for t in times]
    arrival = np.concatenate(times)
    order = np.argsort(arrival, kind="stable")
    tenant_codes = np.repeat(np.arange(len(tenants), dtype=np.int32), counts)[order]
    model_names = sorted(set(models))
    model_codes = np.repeat(np.array([model_names.index(m) for m in models], np.int32), counts)[order]
    table = pa.table(
        {
            "request_id": pa.array(np.arange(len(arrival), dtype=np.int64)),
            "arrival_s": pa.array(arrival[order]),
            "prompt_tokens": pa.array(np.concatenate(prompts)[order].astype(np.int32)),
            "output_tokens": pa.array(np.concatenate(outputs)[order].astype(np.int32)),
            "tenant": pa.DictionaryArray.from_arrays(pa.array(tenant_codes), pa.array(tenants)),
            "model": pa.DictionaryArray.from_arrays(pa.array(model_codes), pa.array(model_names)),
        }
    )
    for name in MODALITIES if modalities else ():
        if any(name in d for d in parts):
            values = np.concatenate([d.get(name, np.zeros(n, np.int64)) for d, n in zip(parts, counts)])
            table = table.append_column(name, pa.array(values[order].astype(np.int32)))
    schema.validate(table, paths[0], require_sorted=True)
    dropped_requests = sum(n for _, n in skipped)
    warnings = ()
    if skipped:
        total = len(arrival) + dropped_requests
        warnings = (f"skipped {len(skipped)} of {len(skipped) + len(tenants)} clients with requests in the window "
                    f"because their chunk-N-dataset.json is missing ({_names(skipped)}): "
                    f"{dropped_requests:,} of {total:,} requests ({dropped_requests / total:.1%} of the traffic) "
                    f"dropped",)  # fmt: skip
    return Imported(
        table=table,
        source=f"servegen:{','.join(p.name for p in paths)}@{start_s:g}+{duration_s:g}s,seed={seed}",
        prefix_block_tokens=None,
        rows_read=len(tenants) + len(skipped),
        dropped={"requests of clients without a dataset (--skip-missing)": dropped_requests} if skipped else {},
        files=tuple(str(p) for p in paths),
        read_unit="clients",
        warnings=warnings,
    )


def _names(skipped: list[tuple[str, int]], k: int = 6) -> str:
    names = [name for name, _ in skipped]
    return ", ".join(names[:k]) + (f", … (+{len(names) - k})" if len(names) > k else "")
