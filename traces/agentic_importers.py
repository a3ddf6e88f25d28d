"""Importers for agentic and multi-turn sources: each source task becomes requests linked by ``depends_on``.

Formats (docs/traces.md "Agentic and multi-turn imports"):

- ``llmservingsim``: LLMServingSim's workload JSON lines (casys-kaist/LLMServingSim,
  docs/docs/workloads/jsonl-format.md). A session line (``session_id``, ``arrival_time_ns``,
  ``sub_requests`` of ``input_toks``/``output_toks``/``tool_duration_ns``) becomes a chain: call k+1
  waits for call k and then call k's tool time. A flat line (``input_toks``, ``output_toks``,
  ``arrival_time_ns``) is a task of one request. ``input_tok_ids`` give prefix hashes.
- ``mooncake-chains``: Mooncake's JSON lines (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``; the conversation and tool-agent traces of FAST'25) as chains: a request whose prompt
  starts with an earlier request's whole prompt (its hash_ids) follows it, or, where the records
  carry one, requests of the same session field follow each other in time order.
- ``sharegpt``: chat datasets with turns (ShareGPT's ``conversations`` of ``from``/``value``, or
  ``messages``/``conversation`` of ``role``/``content``; a JSON array or JSON lines). Turn k's prompt is
  the conversation so far; its output is the reply; turn k+1 waits for turn k plus a user think time.

Every importer numbers tasks (``session_id``) from 0 in source order, sorts requests by the earliest
time each could arrive (a dependent request: its parents' plus its think time), keeps parents before
children, and renumbers request ids from 0. Bad records raise InputError naming file, field and row
(the 1-based record: a line of JSON lines, an element of a JSON array).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from servelab.common.errors import InputError, ServelabError, require_file
from servelab.common.sniff import detects
from servelab.traces.arrivals import ArrivalConfig, arrival_times
from servelab.traces.imported import IMPORTERS, Imported
from servelab.traces.prefixes import chain, token_hashes


MAX_TOKENS = int(np.iinfo(np.int32).max)  # token counts are int32 in the trace schema


@dataclass
class _Rows:
    """Requests as they are read (build order: a parent before its children), before sorting."""

    arrival: list[float] = field(default_factory=list)  # a root's arrival; for a dependent one, filled in later
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    task: list[int] = field(default_factory=list)
    think: list[float | None] = field(default_factory=list)  # None for a root
    parents: list[list[int]] = field(default_factory=list)  # build-order indexes
    hashes: list[list[int]] = field(default_factory=list)

    def add(self, task: int, prompt: int, output: int, arrival: float | None = None,
            parents: list[int] | None = None, think: float | None = None, hashes: list[int] | None = None) -> int:
        self.arrival.append(arrival if arrival is not None else math.nan)
        self.prompt.append(prompt)
        self.output.append(output)
        self.task.append(task)
        self.think.append(think)
        self.parents.append(parents or [])
        self.hashes.append(hashes or [])
        return len(self.prompt) - 1

    def __len__(self) -> int:
        return len(self.prompt)


def _table(rows: _Rows, path: Path, with_hashes: bool, deadline_s: float | None) -> pa.Table:
    """Sort by earliest possible arrival (ties: build order, so parents stay first), rebase to 0,
    renumber ids and map ``depends_on`` to them."""
    if not len(rows):
        raise InputError(path, "no requests to import (no task has a complete call)")
    n = len(rows)
    earliest = np.array(rows.arrival, dtype=np.float64)
    for i in range(n):  # build order is topological: parents are final before a child
        if rows.parents[i]:
            earliest[i] = max(earliest[p] for p in rows.parents[i]) + (rows.think[i] or 0.0)
    earliest -= earliest.min()
    order = np.lexsort((np.arange(n), earliest))
    new_id = np.empty(n, dtype=np.int64)
    new_id[order] = np.arange(n, dtype=np.int64)
    depends = [sorted(int(new_id[p]) for p in rows.parents[i]) for i in order]
    cols: dict[str, pa.Array] = {
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "arrival_s": pa.array(earliest[order]),
        "prompt_tokens": pa.array(np.asarray(rows.prompt, dtype=np.int32)[order]),
        "output_tokens": pa.array(np.asarray(rows.output, dtype=np.int32)[order]),
        "session_id": pa.array(np.asarray(rows.task, dtype=np.int64)[order]),
        "think_s": pa.array([rows.think[i] for i in order], pa.float64()),
    }
    if with_hashes:
        cols["prefix_hashes"] = pa.array([rows.hashes[i] for i in order], pa.list_(pa.int64()))
    cols["depends_on"] = pa.array(depends, pa.list_(pa.int64()))
    if deadline_s is not None:
        cols["task_deadline_s"] = pa.array(np.full(n, deadline_s))
    return pa.table(cols)


def _merge(tables: list[pa.Table], source: str, block_tokens: int | None, rows_read: int, dropped: dict,
           paths: list[Path], unit: str) -> Imported:
    """Several files: tasks and ids of each later file continue after the earlier ones' (times rebased per file)."""
    out, next_id, next_task = [], 0, 0
    for t in tables:
        ids = t.column("request_id").to_numpy() + next_id
        deps = t.column("depends_on").combine_chunks()
        values = deps.values.to_numpy(zero_copy_only=False) + next_id
        deps = pa.ListArray.from_arrays(deps.offsets, pa.array(values, pa.int64()))
        t = t.set_column(0, "request_id", pa.array(ids))
        t = t.set_column(t.column_names.index("session_id"), "session_id",
                         pa.array(t.column("session_id").to_numpy() + next_task))
        t = t.set_column(t.column_names.index("depends_on"), "depends_on", deps)
        next_id += t.num_rows
        next_task = int(t.column("session_id").to_numpy().max()) + 1
        out.append(t)
    table = pa.concat_tables(out, promote_options="default").combine_chunks() if len(out) > 1 else out[0]
    if len(out) > 1:  # one timeline: sort all files' requests together (stable: parents stay first)
        arrival = table.column("arrival_s").to_numpy()
        order = np.lexsort((np.arange(table.num_rows), arrival))
        new_id = np.empty(len(order), dtype=np.int64)
        new_id[order] = np.arange(len(order))
        table = table.take(pa.array(order))
        deps = table.column("depends_on").combine_chunks()
        remapped = pa.ListArray.from_arrays(deps.offsets, pa.array(new_id[deps.values.to_numpy(zero_copy_only=False)]))
        table = table.set_column(0, "request_id", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        table = table.set_column(table.column_names.index("depends_on"), "depends_on", remapped)
    return Imported(table=table, source=source, prefix_block_tokens=block_tokens, rows_read=rows_read,
                    dropped=dropped, files=tuple(str(p) for p in paths), read_unit=unit)


# ---------------------------------------------------------------- reading records


def _records(path: Path):
    """``(row, record)`` for each record of a JSON lines file or a JSON array (row: 1-based record number)."""
    require_file(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as err:
        raise InputError(path, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    if not text.strip():
        raise InputError(path, "file is empty")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg}, line {err.lineno})") from None
        yield from enumerate(data, start=1)
        return
    row = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        row += 1
        try:
            yield row, json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg})", row=row) from None


def _object(path: Path, row: int, rec: Any) -> dict:
    if not isinstance(rec, dict):
        raise InputError(path, "record is not a JSON object", row=row)
    return rec


def _number(path: Path, row: int, rec: dict, name: str, where: str | None = None, required: bool = True,
            integer: bool = False, minimum: float = 0.0) -> float | None:
    """A finite number >= ``minimum`` (an integer if asked); the field named ``where`` (default ``name``) in errors."""
    where = where or name
    value = rec.get(name)
    if value is None:
        if required:
            raise InputError(path, "missing value", column=where, row=row)
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(path, f"not a number: {value!r}", column=where, row=row)
    if integer and not float(value).is_integer():
        raise InputError(path, f"not an integer: {value!r}", column=where, row=row)
    if value < minimum:
        raise InputError(path, f"must be >= {minimum:g} (got {value!r})", column=where, row=row)
    return value


def _tokens(path: Path, row: int, rec: dict, name: str, where: str) -> int:
    value = int(_number(path, row, rec, name, where, integer=True, minimum=1))
    if value > MAX_TOKENS:
        raise InputError(path, f"token count too large (got {value}, at most {MAX_TOKENS:,})", column=where, row=row)
    return value


def _check_common(block_tokens: int, deadline_s: float | None) -> None:
    if block_tokens < 1:
        raise ServelabError(f"--block-tokens must be >= 1 (got {block_tokens})")
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ServelabError(f"--task-deadline-s must be a positive number of seconds (got {deadline_s})")


# ---------------------------------------------------------------- LLMServingSim


def _token_ids(path: Path, row: int, sub: dict, count: int, where: str, block_tokens: int) -> list[int] | None:
    ids = _ids(path, row, sub, count, where)
    return None if ids is None else token_hashes(ids, block_tokens)


def _ids(path: Path, row: int, sub: dict, count: int, where: str) -> list[int] | None:
    ids = sub.get("input_tok_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(path, "must be a list of integer token ids", column=f"{where}input_tok_ids", row=row)
    if len(ids) != count:
        raise InputError(path, f"holds {len(ids)} ids but input_toks is {count}", column=f"{where}input_tok_ids", row=row)
    if any(not -(2**63) <= t < 2**63 for t in ids):
        raise InputError(path, "token id does not fit in 64 bits", column=f"{where}input_tok_ids", row=row)
    return ids


@IMPORTERS.register("llmservingsim")
@detects(lambda p: p.json_line and ('"sub_requests"' in p.head or '"input_toks"' in p.line), order=10)
def import_llmservingsim(paths: list[Path], block_tokens: int = 16, task_deadline_s: float | None = None) -> Imported:
    """LLMServingSim workload JSON lines: agentic sessions (chains with tool waits) and flat requests."""
    _check_common(block_tokens, task_deadline_s)
    tables, read, dropped = [], 0, {}
    any_ids = False
    for path in paths:
        rows, task = _Rows(), 0
        for row, rec in _records(path):
            rec = _object(path, row, rec)
            read += 1
            arrival = _number(path, row, rec, "arrival_time_ns") / 1e9
            if "sub_requests" not in rec:  # a flat request: a task of one
                prompt = _tokens(path, row, rec, "input_toks", "input_toks")
                hashes = _token_ids(path, row, rec, prompt, "", block_tokens)
                any_ids |= hashes is not None
                rows.add(task, prompt, _tokens(path, row, rec, "output_toks", "output_toks"), arrival, hashes=hashes)
                task += 1
                continue
            subs = rec["sub_requests"]
            if not isinstance(subs, list) or not subs:
                raise InputError(path, "must be a non-empty list of calls", column="sub_requests", row=row)
            calls = []  # (prompt, output, token ids or None, tool wait), every call checked first
            for k, sub in enumerate(subs):
                where = f"sub_requests[{k}]."
                if not isinstance(sub, dict):
                    raise InputError(path, "call is not a JSON object", column=f"sub_requests[{k}]", row=row)
                prompt = _tokens(path, row, sub, "input_toks", where + "input_toks")
                output = _tokens(path, row, sub, "output_toks", where + "output_toks")
                ids = _ids(path, row, sub, prompt, where)
                any_ids |= ids is not None
                # the tool runs after this call; LLMServingSim ignores the last call's (nothing follows)
                tool = _number(path, row, sub, "tool_duration_ns", where + "tool_duration_ns", required=False)
                calls.append((prompt, output, ids, (tool or 0) / 1e9))
            prev, wait = None, None
            for k, (prompt, output, ids, tool) in enumerate(calls):
                hashes = None
                if ids is not None:
                    # the next call's ids that go on past this prompt hold this call's answer first: hash
                    # them too, as far as prompt + output, so that the replay caches the answer's blocks
                    # under the hashes the next call continues (replay/core/kv/prefix_cache.py, output blocks)
                    nxt = calls[k + 1][2] if k + 1 < len(calls) else None
                    context = nxt[:prompt + output] if nxt is not None and nxt[:prompt] == ids else ids
                    hashes = token_hashes(context, block_tokens)
                if prev is None:
                    prev = rows.add(task, prompt, output, arrival, hashes=hashes)
                else:
                    prev = rows.add(task, prompt, output, parents=[prev], think=wait, hashes=hashes)
                wait = tool
            task += 1
        tables.append(rows)
    built = [_table(r, p, any_ids, task_deadline_s) for r, p in zip(tables, paths)]
    return _merge(built, "llmservingsim", block_tokens if any_ids else None, read, dropped, list(paths), "records")


# ---------------------------------------------------------------- Mooncake as chains

SESSION_FIELDS = ("session_id", "conversation_id", "chat_id", "session")


@IMPORTERS.register("mooncake-chains")
def import_mooncake_chains(paths: list[Path], block_tokens: int = 512, think_s: float | None = None,
                           task_deadline_s: float | None = None) -> Imported:
    """Mooncake JSON lines as chains of dependent requests.

    A record's parent is the session's previous record when the records carry a session field
    (one of ``SESSION_FIELDS``), else the latest earlier record whose whole ``hash_ids`` list starts
    this one's (its prompt continues that prompt). ``think_s``: the wait after the parent finishes;
    None takes the recorded gap between the two arrivals (which also holds the parent's own service
    time, so a replayed task runs at most as fast as the source's).
    """
    _check_common(block_tokens, task_deadline_s)
    if think_s is not None and not (math.isfinite(think_s) and think_s >= 0):
        raise ServelabError(f"--think-s must be >= 0 (got {think_s})")
    from servelab.traces.importers import check_block_count

    tables, read, warnings = [], 0, []
    for index, path in enumerate(paths):
        recs = []
        for row, rec in _records(path):
            rec = _object(path, row, rec)
            t = _number(path, row, rec, "timestamp", minimum=0.0) / 1000.0
            prompt = _tokens(path, row, rec, "input_length", "input_length")
            output = _tokens(path, row, rec, "output_length", "output_length")
            hashes = rec.get("hash_ids")
            if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise InputError(path, "must be a list of integers", column="hash_ids", row=row)
            if any(not -(2**63) <= h < 2**63 for h in hashes):
                raise InputError(path, "block id is outside the signed 64-bit range (-2^63 .. 2^63 - 1)",
                                 column="hash_ids", row=row)
            if index:  # each file numbers its ids from 0: another file's equal id is another block (trace merge)
                hashes = [h ^ (index << 56) for h in hashes]
            key = next((f for f in SESSION_FIELDS if f in rec), None)
            session = rec[key] if key else None
            if key and (session is None or isinstance(session, (dict, list, bool))):
                raise InputError(path, f"session id must be a string or a number (got {session!r})", column=key, row=row)
            recs.append((t, row, prompt, output, hashes, None if session is None else (key, str(session))))
        read += len(recs)
        # the block size against each record's ids, as the mooncake format checks it (file order)
        warning = check_block_count(path, np.array([r[2] for r in recs], dtype=np.int64),
                                    np.array([len(r[4]) for r in recs], dtype=np.int64), block_tokens)
        if warning:
            warnings.append(warning)
        recs.sort(key=lambda r: (r[0], r[1]))  # time order (file order breaks ties)
        rows = _Rows()
        last_of_session: dict[tuple[str, str], int] = {}
        by_prompt: dict[tuple[int, int], list[int]] = {}  # (block count, last block id) -> indexes
        times, tasks = [], 0
        for t, row, prompt, output, hashes, session in recs:
            parent = None
            if session is not None:
                parent = last_of_session.get(session)
            else:
                for length in range(len(hashes) - 1, 0, -1):  # the longest earlier prompt this one extends
                    for j in reversed(by_prompt.get((length, hashes[length - 1]), ())):
                        if rows.hashes[j] == hashes[:length]:
                            parent = j
                            break
                    if parent is not None:
                        break
            if parent is None:
                i = rows.add(tasks, prompt, output, t, hashes=hashes)
                tasks += 1
            else:
                wait = think_s if think_s is not None else t - times[parent]
                i = rows.add(rows.task[parent], prompt, output, parents=[parent], think=wait, hashes=hashes)
            times.append(t)
            if session is not None:
                last_of_session[session] = i
            if hashes:
                by_prompt.setdefault((len(hashes), hashes[-1]), []).append(i)
        tables.append((rows, path))
    built = [_table(r, p, True, task_deadline_s) for r, p in tables]
    result = _merge(built, "mooncake-chains", block_tokens, read, {}, list(paths), "rows")
    return replace(result, warnings=(*result.warnings, *warnings)) if warnings else result



# ---------------------------------------------------------------- ShareGPT-style chats

_TURN_KEYS = ("conversations", "conversation", "messages")
_ROLE_KEYS = ("from", "role")
_TEXT_KEYS = ("value", "content", "text")
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
SYSTEM_ROLES = frozenset({"system"})


def _messages(path: Path, row: int, rec: dict) -> list[tuple[str, str]]:
    """``(kind, text)`` per message, kind in user/assistant/system; a message of another role is an error."""
    key = next((k for k in _TURN_KEYS if k in rec), None)
    if key is None:
        raise InputError(path, f"no turns (expected one of {', '.join(_TURN_KEYS)})", row=row)
    turns = rec[key]
    if not isinstance(turns, list):
        raise InputError(path, "must be a list of messages", column=key, row=row)
    out = []
    for k, msg in enumerate(turns):
        where = f"{key}[{k}]"
        if not isinstance(msg, dict):
            raise InputError(path, "message is not a JSON object", column=where, row=row)
        role_key = next((r for r in _ROLE_KEYS if r in msg), None)
        text_key = next((t for t in _TEXT_KEYS if t in msg), None)
        if role_key is None:
            raise InputError(path, f"no role (expected {' or '.join(_ROLE_KEYS)})", column=where, row=row)
        if text_key is None:
            raise InputError(path, f"no text (expected one of {', '.join(_TEXT_KEYS)})", column=where, row=row)
        role, text = msg[role_key], msg[text_key]
        role = role.lower() if isinstance(role, str) else role
        if role in USER_ROLES:
            kind = "user"
        elif role in ASSISTANT_ROLES:
            kind = "assistant"
        elif role in SYSTEM_ROLES:
            kind = "system"
        else:
            raise InputError(path, f"unknown role {msg[role_key]!r} (user: {', '.join(sorted(USER_ROLES))}; assistant: "
                             f"{', '.join(sorted(ASSISTANT_ROLES))}; system)", column=f"{where}.{role_key}", row=row)
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise InputError(path, f"must be a string (got {type(text).__name__})", column=f"{where}.{text_key}", row=row)
        out.append((kind, text))
    return out


def _count(text: str, chars_per_token: float) -> int:
    return math.ceil(len(text) / chars_per_token)


def _text_hashes(text: str, prompt: int, block_tokens: int, chars_per_token: float) -> list[int]:
    """Hashes of the full blocks of ``text`` (``prompt`` tokens), each ``block_tokens * chars_per_token``
    characters of the conversation so far: a later turn, whose prompt starts with this text, shares them."""
    per_block = block_tokens * chars_per_token
    full = min(prompt // block_tokens, int(len(text) // per_block))
    cuts = [round(j * per_block) for j in range(full + 1)]
    return chain([text[cuts[j]:cuts[j + 1]].encode() for j in range(full)], root=2)


@IMPORTERS.register("sharegpt")
@detects(lambda p: p.json_line and any(f'"{k}"' in p.head for k in ("conversations", "conversation", "messages")),
         order=20)
def import_sharegpt(
    paths: list[Path],
    arrival: ArrivalConfig = ArrivalConfig(),
    seed: int = 0,
    limit: int | None = None,
    think_s: float = 0.0,
    think: str = "fixed",
    chars_per_token: float = 4.0,
    block_tokens: int = 16,
    task_deadline_s: float | None = None,
) -> Imported:
    """Chat conversations as multi-turn chains: each user message answered by an assistant message is one
    request whose prompt is the conversation so far (system, earlier turns and replies, the message) and whose
    output is the reply. Conversations start at times from ``arrival`` (seeded); turn k+1 waits for turn k
    and then the user's think time: ``think_s`` each (``think='fixed'``) or exponential with that mean
    (``think='exponential'``, seeded). Token counts are characters / ``chars_per_token`` (rounded up); the
    source has no tokenizer's counts. ``limit`` keeps the first N conversations (in file order).
    """
    _check_common(block_tokens, task_deadline_s)
    if not (math.isfinite(chars_per_token) and chars_per_token > 0):
        raise ServelabError(f"--chars-per-token must be > 0 (got {chars_per_token})")
    if not (math.isfinite(think_s) and think_s >= 0):
        raise ServelabError(f"--think-s must be >= 0 (got {think_s})")
    if think not in ("fixed", "exponential"):
        raise ServelabError(f"--think must be fixed or exponential (got '{think}')")
    if limit is not None and limit < 1:
        raise ServelabError(f"--limit must be >= 1 (got {limit})")
    arrival_rng, think_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    # per conversation: (prompt, output, prompt text and reply: the context a next turn continues, path index)
    convs: list[list[tuple[int, int, str, int]]] = []
    read, dropped = 0, {"conversations without a reply": 0, "unanswered last messages": 0}
    for p_index, path in enumerate(paths):
        for row, rec in _records(path):
            if limit is not None and len(convs) >= limit:
                break
            rec = _object(path, row, rec)
            read += 1
            context, turns, pending = "", [], None
            for kind, text in _messages(path, row, rec):
                if kind == "assistant" and pending is not None:
                    prompt = max(1, _count(pending, chars_per_token))
                    output = max(1, _count(text, chars_per_token))
                    if prompt > MAX_TOKENS or output > MAX_TOKENS:
                        raise InputError(path, "conversation too long for int32 token counts", row=row)
                    turns.append((prompt, output, pending + text, p_index))
                    context, pending = pending + text, None
                elif kind == "user":
                    pending = (pending if pending is not None else context) + text
                else:  # a system prompt, or a reply with no question before it: context only
                    if pending is not None:
                        pending += text
                    else:
                        context += text
            if pending is not None and turns:
                dropped["unanswered last messages"] += 1
            if not turns:
                dropped["conversations without a reply"] += 1
                continue
            convs.append(turns)
    if not convs:
        raise InputError(paths[0], "no conversation has a user message answered by the assistant")
    starts = arrival_times(arrival, arrival_rng, n=len(convs))
    rows = _Rows()
    for task, (turns, start) in enumerate(zip(convs, starts)):
        prev = None
        for prompt, output, text, _ in turns:
            # over the prompt and the reply: the next turn's prompt repeats both, and a replay of dependent
            # requests caches a call's output blocks under the hashes past its prompt (replay/core/kv/prefix_cache.py)
            hashes = _text_hashes(text, prompt + output, block_tokens, chars_per_token)
            if prev is None:
                prev = rows.add(task, prompt, output, float(start), hashes=hashes)
            else:
                wait = float(think_rng.exponential(think_s)) if think == "exponential" and think_s > 0 else think_s
                prev = rows.add(task, prompt, output, parents=[prev], think=wait, hashes=hashes)
    table = _table(rows, paths[0], True, task_deadline_s)
    return Imported(table=table, source=f"sharegpt+{arrival.process}", prefix_block_tokens=block_tokens,
                    rows_read=read, dropped=dropped, files=tuple(str(p) for p in paths), read_unit="conversations")
