"""Summary statistics of a trace: size, rate, burstiness, length percentiles, tenants, prefix reuse."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from servelab.traces import schema

PERCENTILES = (50, 90, 99)


def _lengths(values: np.ndarray) -> dict[str, float]:
    pct = np.percentile(values, PERCENTILES)
    out = {"mean": float(values.mean()), "min": int(values.min()), "max": int(values.max())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)})
    return out


def _counts(table: pa.Table, name: str) -> dict[str, int]:
    """Requests per value, most frequent first (ties by name, so the order is stable)."""
    df = pl.from_arrow(table.select([name])).select(pl.col(name).cast(pl.String))
    counts = df.group_by(name).len().sort(["len", name], descending=[True, False])
    return dict(zip(counts[name].to_list(), counts["len"].to_list()))


def prefix_reuse_share(table: pa.Table) -> float | None:
    """Share of prompt tokens in blocks whose hash appeared in an earlier request or block.

    That is what an unlimited prefix cache would serve. A prompt's last block may be partial; it
    counts only the prompt's tokens that fall in it.
    """
    if "prefix_hashes" not in table.column_names:
        return None
    meta = table.schema.metadata or {}
    block = int(meta.get(schema.META_BLOCK_TOKENS, b"0")) or None
    col = table.column("prefix_hashes").combine_chunks()
    if block is None or len(col.values) == 0:
        return None
    values = col.values.to_numpy()
    offsets = col.offsets.to_numpy()
    nblocks = np.diff(offsets)
    prompt = table.column("prompt_tokens").to_numpy().astype(np.int64)
    row = np.repeat(np.arange(len(nblocks)), nblocks)
    pos = np.arange(len(values)) - offsets[:-1][row]
    # Tokens per block: full blocks hold `block` tokens, the last holds the rest of the prompt.
    tokens = np.clip(prompt[row] - pos * block, 0, block)
    _, first = np.unique(values, return_index=True)
    seen_before = np.ones(len(values), dtype=bool)
    seen_before[first] = False
    return float(tokens[seen_before].sum() / prompt.sum())


def peak_1s_rate(arrival: np.ndarray) -> int:
    """Most arrivals in one 1 s bin counted from the first arrival.

    Counted as runs of equal bin numbers, so the memory is the trace's, whatever its span (a bin
    count per second would need 8 bytes per second: 7 TiB for a span of 1e12 s).
    """
    if len(arrival) == 0:
        return 0
    bins = np.floor(arrival - arrival[0])
    if not np.all(bins[1:] >= bins[:-1]):
        bins = np.sort(bins)
    starts = np.flatnonzero(np.diff(bins)) + 1
    return int(np.diff(np.concatenate(([0], starts, [len(bins)]))).max())


def trace_info(table: pa.Table) -> dict:
    """Statistics of a loaded (validated) trace, as plain JSON-ready values."""
    arrival = table.column("arrival_s").to_numpy()
    n = len(arrival)
    span = float(arrival[-1] - arrival[0]) if n else 0.0
    gaps = np.diff(arrival)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else None
    info = {
        "rows": n,
        "span_s": span,
        "mean_rate_per_s": (n - 1) / span if span > 0 else None,
        "interarrival_cv": cv,
        "peak_1s_rate_per_s": peak_1s_rate(arrival),
        "prompt_tokens": _lengths(table.column("prompt_tokens").to_numpy()),
        "output_tokens": _lengths(table.column("output_tokens").to_numpy()),
        "tenants": _counts(table, "tenant") if "tenant" in table.column_names else {schema.DEFAULT_TENANT: n},
        "tiers": _counts(table, "tier") if "tier" in table.column_names else {schema.DEFAULT_TIER: n},
        "sessions": None,
        "prefix_reuse_share": prefix_reuse_share(table),
        "source": (table.schema.metadata or {}).get(schema.META_SOURCE, b"").decode() or None,
    }
    if "session_id" in table.column_names:
        sid = table.column("session_id")
        info["sessions"] = int(pl.from_arrow(sid).drop_nulls().n_unique())
    if "model" in table.column_names:
        info["models"] = _counts(table, "model")
    if "depends_on" in table.column_names:  # schema v2: their arrival_s only orders rows (the replay decides it)
        lengths = table.column("depends_on").combine_chunks().value_lengths().fill_null(0).to_numpy()
        info["dependent_requests"] = int((lengths > 0).sum())
    return info
