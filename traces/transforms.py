"""Reshape traces: time window, rate scaling, first-N, seeded sample, merge, tier assignment.

Every function takes and returns a pyarrow Table in the trace schema. Where a trace has sessions,
window and sample keep or drop whole sessions so closed-loop turns never lose their predecessor; a
cut that would keep a request but drop one it depends on (``depends_on``) is refused, and merge
renumbers ``depends_on`` with the request ids.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from servelab.common.errors import ServelabError
from servelab.common.kernels import call
from servelab.common.lazy import pyarrow_compute as _pc
from servelab.traces import depends, schema

Weights = tuple[tuple[str, float], ...]  # (name, share) pairs, as synth.parse_weights returns


def _session_key(table: pa.Table) -> np.ndarray:
    """Per-row group key: the session id where there is one, else a unique value per row."""
    n = table.num_rows
    if "session_id" not in table.column_names:
        return np.arange(n, dtype=np.int64)
    sid = table.column("session_id")
    ids = _pc().fill_null(sid, -1).to_numpy()
    # Rows without a session are their own group; shift them clear of real session ids.
    lone = ids < 0
    if lone.any():
        ids = ids.copy()
        ids[lone] = ids.max(initial=0) + 1 + np.flatnonzero(lone)
    return ids


def _filter(table: pa.Table, mask: np.ndarray, what: str = "the cut") -> pa.Table:
    _check_parents_kept(table, mask, what)
    return table.filter(pa.array(mask))


def _check_parents_kept(table: pa.Table, mask: np.ndarray, what: str) -> None:
    """Refuse a cut that keeps a request but drops a request it depends on (schema v2 ``depends_on``):
    its replay would wait for a request that no longer exists."""
    if depends.COLUMN not in table.column_names or mask.all():
        return
    child, parent_id = depends.edges(table)
    if not child.size:
        return
    ids = table.column("request_id").to_numpy()
    order = np.argsort(ids, kind="stable")
    parent = order[np.searchsorted(ids[order], parent_id)]
    orphan = np.flatnonzero(mask[child] & ~mask[parent])
    if orphan.size:
        k = orphan[0]
        raise ServelabError(f"{what} keeps request {ids[child[k]]} but drops request {parent_id[k]}, which it depends on "
                            "(depends_on); cut whole tasks instead (--window and --sample keep sessions whole)")


def window(table: pa.Table, start_s: float, end_s: float | None = None) -> pa.Table:
    """Requests (whole sessions, by their first arrival) in [start_s, end_s), re-based to start at 0."""
    if start_s < 0 or (end_s is not None and end_s <= start_s):
        raise ServelabError(f"bad window {start_s}..{end_s} s (need 0 <= start < end)")
    arrival = table.column("arrival_s").to_numpy()
    key = _session_key(table)
    uniq, inverse = np.unique(key, return_inverse=True)
    first = np.full(len(uniq), np.inf)
    np.minimum.at(first, inverse, arrival)
    t0 = first[inverse]
    mask = t0 >= start_s
    if end_s is not None:
        mask &= t0 < end_s
    out = _filter(table, mask, "the window")
    if out.num_rows == 0:
        raise ServelabError(f"no requests in the window {start_s}..{end_s} s")
    rebased = _pc().subtract(out.column("arrival_s"), pa.scalar(float(start_s)))
    return out.set_column(out.column_names.index("arrival_s"), "arrival_s", rebased)


def scale_rate(table: pa.Table, k: float) -> pa.Table:
    """Multiply the arrival rate by ``k`` (arrival times divided by k); think times are unchanged."""
    if not (k > 0 and np.isfinite(k)):  # infinity would put every arrival at 0
        raise ServelabError(f"rate scale must be a finite number > 0 (got {k})")
    scaled = call("divide", table.column("arrival_s"), pa.scalar(float(k)))
    return table.set_column(table.column_names.index("arrival_s"), "arrival_s", scaled)


def head(table: pa.Table, n: int) -> pa.Table:
    """The first ``n`` requests by arrival."""
    if n < 1:
        raise ServelabError(f"head needs n >= 1 (got {n})")
    if n < table.num_rows and depends.COLUMN in table.column_names:
        _check_parents_kept(table, np.arange(table.num_rows) < n, f"head {n}")
    return table.slice(0, n)


def sample(table: pa.Table, seed: int, n: int | None = None, fraction: float | None = None) -> pa.Table:
    """A seeded random subset of requests (of whole sessions where the trace has them), order kept."""
    if (n is None) == (fraction is None):
        raise ServelabError("sample needs exactly one of n and fraction")
    key = _session_key(table)
    uniq, inverse = np.unique(key, return_inverse=True)
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ServelabError(f"sample fraction must be in (0, 1] (got {fraction})")
        n = max(1, round(fraction * len(uniq)))
    if n < 1:
        raise ServelabError(f"sample needs n >= 1 (got {n})")
    if n > len(uniq):
        unit = "sessions" if "session_id" in table.column_names else "requests"
        raise ServelabError(f"cannot sample {n} of {len(uniq)} {unit}")
    chosen = np.zeros(len(uniq), dtype=bool)
    chosen[np.random.default_rng(seed).choice(len(uniq), size=n, replace=False)] = True
    return _filter(table, chosen[inverse], "the sample")


def merge(tables: list[pa.Table], names: list[str] | None = None) -> pa.Table:
    """Overlay traces on one clock; ``names`` tag each trace's tenants (``name`` or ``name/tenant``).

    Request and session ids are renumbered; prefix hashes of the i-th trace get i in their top
    byte so two traces' blocks never look shared.
    """
    if not tables:
        raise ServelabError("merge needs at least one trace")
    if names is not None and len(names) != len(tables):
        raise ServelabError("merge needs one name per trace")
    blocks = {
        (t.schema.metadata or {}).get(schema.META_BLOCK_TOKENS)
        for t in tables
        if "prefix_hashes" in t.column_names
    }
    if len(blocks) > 1:
        raise ServelabError("cannot merge traces whose prefix hashes use different block sizes")
    any_hashes = any("prefix_hashes" in t.column_names for t in tables)
    parts, session_base, row_base = [], 0, 0
    for i, t in enumerate(tables):
        t = schema.with_defaults(t)
        if depends.COLUMN in t.column_names:  # parents' ids -> their rows in the concatenation (ids renumbered below)
            t = _depends_as_rows(t, row_base)
        row_base += t.num_rows
        if any_hashes and "prefix_hashes" not in t.column_names:
            # No hashes means no reusable blocks: an empty list per request, never a null.
            empty = pa.ListArray.from_arrays(pa.array(np.zeros(t.num_rows + 1, np.int32)), pa.array([], pa.int64()))
            t = t.append_column("prefix_hashes", empty)
        if names is not None:
            tenant = t.column("tenant").cast(pa.string())
            tagged = _pc().if_else(
                _pc().equal(tenant, schema.DEFAULT_TENANT),
                pa.scalar(names[i]),
                _pc().binary_join_element_wise(pa.scalar(names[i]), tenant, "/"),
            )
            t = t.set_column(t.column_names.index("tenant"), "tenant", tagged)
        if "session_id" in t.column_names:
            sid = t.column("session_id")
            t = t.set_column(t.column_names.index("session_id"), "session_id", _pc().add(sid, session_base))
            session_base += int(_pc().max(sid).as_py() or 0) + 1
        if "prefix_hashes" in t.column_names and i > 0:
            hashes = file_namespace(t.column("prefix_hashes").combine_chunks(), i)
            t = t.set_column(t.column_names.index("prefix_hashes"), "prefix_hashes", hashes)
        parts.append(schema.canonical(t))
    table = pa.concat_tables(parts, promote_options="default").unify_dictionaries().combine_chunks()
    order = np.argsort(table.column("arrival_s").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    ids = pa.array(np.arange(table.num_rows, dtype=np.int64))
    table = table.set_column(table.column_names.index("request_id"), "request_id", ids)
    if depends.COLUMN in table.column_names:  # concatenation rows -> the new ids
        new_id = np.empty(len(order), dtype=np.int64)
        new_id[order] = np.arange(len(order), dtype=np.int64)
        col = table.column(depends.COLUMN).combine_chunks()
        remapped = pa.ListArray.from_arrays(col.offsets, pa.array(new_id[col.values.to_numpy()]), mask=col.is_null())
        table = table.set_column(table.column_names.index(depends.COLUMN), depends.COLUMN, remapped)
    meta = {schema.META_SOURCE: b"merge"}
    if blocks and None not in blocks:
        meta[schema.META_BLOCK_TOKENS] = blocks.pop()
    return table.replace_schema_metadata(meta)


def file_namespace(hashes: pa.ListArray, i: int) -> pa.ListArray:
    """Block hashes of the ``i``-th of several traces (or source files) with ``i`` in their top byte, so
    that blocks of different files never look shared (trace merge and the Mooncake importers: each
    Mooncake file numbers its ids from 0). The 0-th keeps its hashes."""
    if i == 0:
        return hashes
    values = hashes.values.to_numpy() ^ np.int64(i << 56)
    return pa.ListArray.from_arrays(hashes.offsets, pa.array(values), mask=hashes.is_null())


def _depends_as_rows(table: pa.Table, row_base: int) -> pa.Table:
    """``depends_on`` with each parent's row (plus ``row_base``) instead of its id."""
    col = table.column(depends.COLUMN).combine_chunks()
    ids = table.column("request_id").to_numpy()
    order = np.argsort(ids, kind="stable")
    rows = order[np.searchsorted(ids[order], col.values.to_numpy())] + row_base
    as_rows = pa.ListArray.from_arrays(col.offsets, pa.array(rows.astype(np.int64)), mask=col.is_null())
    return table.set_column(table.column_names.index(depends.COLUMN), depends.COLUMN, as_rows)


def _set_tier(table: pa.Table, tier: pa.Array) -> pa.Table:
    tier = tier.cast(pa.string()).dictionary_encode()
    if "tier" in table.column_names:
        return table.set_column(table.column_names.index("tier"), "tier", tier)
    return table.append_column("tier", tier)


def tier_by_tenant(table: pa.Table, mapping: dict[str, str], default: str | None = None) -> pa.Table:
    """Tier from the tenant: mapped tenants get their tier, others ``default`` (or keep their tier)."""
    table = schema.with_defaults(table)
    tenant = table.column("tenant").cast(pa.string()).to_numpy(zero_copy_only=False)
    unknown = set(mapping) - set(np.unique(tenant))
    if unknown:
        raise ServelabError(f"tier rule names tenant(s) not in the trace: {', '.join(sorted(unknown))}")
    tier = table.column("tier").cast(pa.string()).to_numpy(zero_copy_only=False).astype(object)
    if default is not None:
        tier[:] = default
    for name, value in mapping.items():
        tier[tenant == name] = value
    return _set_tier(table, pa.array(tier, pa.string()))


def tier_by_fraction(table: pa.Table, fractions: Weights, seed: int) -> pa.Table:
    """Random tiers in the given proportions (per session where there are sessions), seeded."""
    if not fractions:
        raise ServelabError("tier fractions are empty")
    key = _session_key(table)
    uniq, inverse = np.unique(key, return_inverse=True)
    names = [n for n, _ in fractions]
    p = np.array([w for _, w in fractions], dtype=np.float64)
    codes = np.random.default_rng(seed).choice(len(names), size=len(uniq), p=p / p.sum())
    tier = pa.DictionaryArray.from_arrays(pa.array(codes[inverse].astype(np.int32)), pa.array(names, pa.string()))
    return _set_tier(table, tier)


def lora_adapters(table: pa.Table, count: int, zipf_s: float = 1.0, base_fraction: float = 0.0,
                  seed: int = 0) -> pa.Table:
    """Assign LoRA adapters ``lora-0`` .. ``lora-{count-1}`` (column ``lora_adapter``) with Zipf popularity:
    adapter k (0-based) is drawn with weight 1 / (k + 1)^``zipf_s``; a ``base_fraction`` share of the
    requests runs the base model (null). A session keeps one adapter for all its turns. Seeded."""
    if count < 1:
        raise ServelabError(f"LoRA adapters: the count must be >= 1 (got {count})")
    if not zipf_s >= 0:
        raise ServelabError(f"LoRA adapters: the Zipf exponent must be >= 0 (got {zipf_s})")
    if not 0 <= base_fraction < 1:
        raise ServelabError(f"LoRA adapters: the base-model fraction must be in [0, 1) (got {base_fraction})")
    key = _session_key(table)
    uniq, inverse = np.unique(key, return_inverse=True)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, count + 1, dtype=np.float64) ** zipf_s
    codes = rng.choice(count, size=len(uniq), p=weights / weights.sum()).astype(np.int32)
    base = rng.random(len(uniq)) < base_fraction
    names = pa.array([f"lora-{k}" for k in range(count)], pa.string())
    column = pa.DictionaryArray.from_arrays(pa.array(codes[inverse], mask=base[inverse]), names)
    if "lora_adapter" in table.column_names:
        return table.set_column(table.column_names.index("lora_adapter"), "lora_adapter", column)
    return table.append_column("lora_adapter", column)
