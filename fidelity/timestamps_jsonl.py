"""Per-request engine timestamps as JSON lines (vLLM ``RequestStateStats`` per finished request).

Each line: ``input_toks``, ``output_toks``, ``queued_ts``, ``scheduled_ts``, ``first_token_ts``,
``last_token_ts`` (seconds on the engine core's monotonic clock), optionally ``request_id`` and
``arrival_time`` (the frontend's wall clock: another clock, so it is kept only to order requests
that share a queued time). The arrival used is ``queued_ts``, when the engine received the
request; tokenisation and IPC before it are not what the simulator models. A line without a first
or last token time (the request was aborted, or the file was cut while writing) is a failed
request, with a warning; a cut last line that is not JSON is left out, with a warning.

The prompts' token ids, for prefix hashes, come from the line (``prompt_token_ids``,
``input_tok_ids``) or from ``workload.jsonl`` beside the file (the requests sent, one per line,
``input_tok_ids``; line N is request ``...-N``, else the N-th request). Engine settings come from
the files beside it (fidelity/sidecars.py: ``meta.json``, the server log).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured, Rows

REQUIRED = ("input_toks", "output_toks", "queued_ts")
TIMES = ("first_token_ts", "last_token_ts")
TOKEN_KEYS = ("prompt_token_ids", "input_tok_ids", "input_token_ids")
WORKLOAD = "workload.jsonl"


@IMPORTERS.register("timestamps-jsonl")
@detects(lambda p: '"queued_ts"' in p.line or '"first_token_ts"' in p.line, order=20)
def import_timestamps(paths: list[Path]) -> Measured:
    rows = Rows(paths[0])
    notes = []
    for path in paths:
        rows.path = path
        lines = path.read_text().splitlines()
        last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
        workload = _workload(path.parent / WORKLOAD)
        mismatched = 0
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                if lineno == last:
                    rows.warnings.append(f"{path.name} line {lineno}: cut short (not valid JSON); left out")
                    continue
                raise InputError(path, f"not valid JSON ({err.msg})", row=lineno) from None
            if not isinstance(rec, dict):
                raise InputError(path, "each line must be a JSON object", row=lineno)
            for key in REQUIRED:
                if not isinstance(rec.get(key), (int, float)):
                    raise InputError(path, "missing or not a number", column=key, row=lineno)
            for key in (*TIMES, "scheduled_ts"):
                if rec.get(key) is not None and not isinstance(rec[key], (int, float)):
                    raise InputError(path, "not a number", column=key, row=lineno)
            # without its own id, a line is its number (in its file's name when several files make the run)
            request_id = rec.get("request_id", lineno if len(paths) == 1 else f"{path.name} line {lineno}")
            ids = next((rec[k] for k in TOKEN_KEYS if isinstance(rec.get(k), list)), None)
            if ids is None and workload is not None:
                ids = workload.get(_index(request_id, len(rows)))
                if ids is not None and len(ids) != int(rec["input_toks"]):
                    mismatched += 1  # not the prompt this request sent: no hashes rather than wrong ones
                    ids = None
            missing = [k for k in TIMES if rec.get(k) is None]
            if missing:
                rows.warnings.append(f"{path.name} line {lineno}: no {' or '.join(missing)} (aborted or cut short); "
                                     "kept as a failed request")
            scheduled = rec.get("scheduled_ts")
            rows.add(lineno, request_id, float(rec["queued_ts"]), int(rec["input_toks"]), int(rec["output_toks"]),
                     first_token_s=None if rec.get("first_token_ts") is None else float(rec["first_token_ts"]),
                     finish_s=None if rec.get("last_token_ts") is None else float(rec["last_token_ts"]),
                     first_scheduled_s=None if scheduled is None else float(scheduled), ok=not missing,
                     reason=f"no {missing[0]} recorded" if missing else None, token_ids=ids)
        if workload is not None:
            notes.append(f"prompt token ids from {path.parent / WORKLOAD}")
        if mismatched:
            rows.warnings.append(f"{mismatched} request(s) of {path.name} have another prompt length than their "
                                 f"{WORKLOAD} line: no prefix hashes for them")
    return Measured(rows, clock="server", source={}, notes=tuple(notes))


def _index(request_id: object, position: int) -> int:
    """Which workload line a request sent: the number ending its id (``bench-17``), else its position."""
    m = re.search(r"(\d+)$", str(request_id))
    return int(m.group(1)) if m and not isinstance(request_id, int) else position


def _workload(path: Path) -> dict[int, list[int]] | None:
    if not path.is_file():
        return None
    out = {}
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg})", row=i + 1) from None
        ids = next((rec[k] for k in TOKEN_KEYS if isinstance(rec, dict) and isinstance(rec.get(k), list)), None)
        if ids is not None:
            out[i] = ids
    return out or None
