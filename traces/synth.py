"""Generate seeded synthetic traces: arrivals, lengths, tenants, tiers, sessions and prefix hashes.

The whole recipe is one frozen ``SynthConfig``; ``generate(config)`` returns a schema-valid Arrow
table and ``synth_trace(**kwargs)`` is the keyword shortcut tests and other modules use. Each
aspect draws from its own child of ``SeedSequence(seed)``, so changing the length distribution
does not move the arrivals, and the same config always gives the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from servelab.common.errors import ServelabError
from servelab.traces import schema
from servelab.traces.arrivals import MAX_REQUESTS, ArrivalConfig, arrival_times
from servelab.traces.lengths import LengthDist, parse_length

Weights = tuple[tuple[str, float], ...]


def parse_weights(spec: str | dict | Weights | None, what: str = "tenants") -> Weights:
    """``a=3,b=1`` (or a dict) -> (("a", 3.0), ("b", 1.0)); weights need not sum to 1."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            name, sep, weight = part.partition("=")
            if not sep or not name.strip():
                raise ServelabError(f"bad {what} spec '{spec}' (use name=weight,name=weight)")
            try:
                items.append((name.strip(), float(weight)))
            except ValueError:
                raise ServelabError(f"bad {what} spec '{spec}': '{weight}' is not a number") from None
    else:
        items = [(str(n), float(w)) for n, w in spec]
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ServelabError(f"{what} names repeat in '{spec}'")
    if any(not (w >= 0 and math.isfinite(w)) for _, w in items) or sum(w for _, w in items) <= 0:
        raise ServelabError(f"{what} weights must be >= 0 and not all 0 (got '{spec}')")
    return tuple((n, float(w)) for n, w in items)


def parse_fractions(spec: str | None, option: str) -> Weights:
    """``priority=0.1,standard=0.9`` given as fractions (a CLI option says so): each in [0, 1], summing to 1.

    ``parse_weights`` takes any weights and normalises them; an option documented as fractions must
    not quietly turn ``priority=2`` into 100%.
    """
    weights = parse_weights(spec, option)
    for name, share in weights:
        if share > 1:
            raise ServelabError(f"{option}: the fraction of '{name}' is {share:g}; fractions are in [0, 1]")
    total = sum(w for _, w in weights)
    if weights and abs(total - 1.0) > 1e-6:
        raise ServelabError(f"{option}: fractions sum to {total:g}, not 1 (in '{spec}')")
    return weights


def zipf_tenants(count: int, exponent: float = 0.0) -> Weights:
    """``count`` tenants ``tenant-0..`` with weights 1/(rank+1)^exponent (0 = equal shares)."""
    if count < 1:
        raise ServelabError(f"tenant count must be >= 1 (got {count})")
    return tuple((f"tenant-{i}", 1.0 / (i + 1) ** exponent) for i in range(count))


@dataclass(frozen=True)
class SynthConfig:
    """Everything a synthetic trace depends on. Exactly one of ``n`` and ``duration_s`` is set.

    With sessions (``turns`` > 1) the arrival process gives session starts; each session has a
    geometric number of turns with mean ``turns``, exponential think times with mean ``think_s``,
    and, when ``session_context`` is on, each turn's prompt carries the whole conversation so far.
    ``prefix_block_tokens`` adds prefix_hashes (full blocks only; a tenant's shared system prompt
    of ``shared_prefix_tokens`` and a session's earlier turns hash equally across requests).
    """

    n: int | None = 1000
    duration_s: float | None = None
    arrival: str = "poisson"
    rate: float = 1.0
    cv: float = 1.0
    profile: str = "flat"
    schedule: tuple[tuple[float, float], ...] = ()
    diurnal_amplitude: float = 0.5
    diurnal_period_s: float = 86400.0
    burst_on_s: float = 10.0
    burst_off_s: float = 50.0
    prompt: LengthDist = LengthDist("fixed", 512)
    output: LengthDist = LengthDist("fixed", 128)
    lengths_from: str | None = None  # resample (prompt, output) pairs jointly from this file
    tenants: Weights = ()
    tiers: Weights = ()
    turns: float = 1.0
    think_s: float = 0.0
    session_context: bool = True
    shared_prefix_tokens: int = 0
    prefix_groups: int = 0  # > 0: the shared prefix belongs to group i mod G, not to the tenant
    prompt_pool: int = 0  # > 0: request i sends pool prompt i mod K (the same text, the same length)
    prefix_block_tokens: int | None = None
    model: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.n is None) == (self.duration_s is None):
            raise ServelabError("give exactly one of n (requests) and duration_s")
        if self.n is not None and self.n < 1:
            raise ServelabError(f"n must be >= 1 (got {self.n})")
        if self.n is not None and self.n > MAX_REQUESTS:
            raise ServelabError(f"n = {self.n:,} requests is more than one trace holds here (at most {MAX_REQUESTS:,})")
        if not self.turns >= 1:
            raise ServelabError(f"turns (mean per session) must be >= 1 (got {self.turns})")
        if not self.think_s >= 0:
            raise ServelabError(f"think time must be >= 0 s (got {self.think_s})")
        if self.shared_prefix_tokens < 0:
            raise ServelabError("shared prefix tokens must be >= 0")
        if self.prefix_block_tokens is not None and self.prefix_block_tokens < 1:
            raise ServelabError("prefix block tokens must be >= 1")
        if self.prefix_groups < 0 or self.prompt_pool < 0:
            raise ServelabError("prefix groups and prompt pool must be >= 0")
        if self.prefix_groups and not self.shared_prefix_tokens:  # groups of nothing: empty hashes for every request
            raise ServelabError("prefix groups need shared prefix tokens (--prefix-groups needs --shared-prefix-tokens)")
        if (self.prefix_groups or self.prompt_pool) and self.turns > 1:
            raise ServelabError("prefix groups and a prompt pool describe single-turn generators; use turns = 1")
        self.arrival_config  # validates the arrival fields now, not at generation time

    @property
    def arrival_config(self) -> ArrivalConfig:
        return ArrivalConfig(
            process=self.arrival,
            rate_per_s=self.rate,
            cv=self.cv,
            profile=self.profile,
            schedule=self.schedule,
            diurnal_amplitude=self.diurnal_amplitude,
            diurnal_period_s=self.diurnal_period_s,
            burst_on_s=self.burst_on_s,
            burst_off_s=self.burst_off_s,
        )

    @property
    def source(self) -> str:
        """A one-line description stored in the file's ``source`` metadata."""
        size = f"n={self.n}" if self.n is not None else f"duration={self.duration_s:g}s"
        if self.profile == "piecewise":  # the schedule's rates, not `rate`, which piecewise arrivals ignore
            rates = ";".join(f"{start:g}:{rate:g}" for start, rate in self.schedule)
            return f"synth:{self.arrival}@[{rates}]/s,cv={self.cv:g},piecewise,{size},seed={self.seed}"
        return f"synth:{self.arrival}@{self.rate:g}/s,cv={self.cv:g},{self.profile},{size},seed={self.seed}"


_NAMES = {f.name for f in fields(SynthConfig)}


def make_config(**kwargs) -> SynthConfig:
    """Build a SynthConfig from loose keyword values (length specs, weight strings, tenant counts)."""
    unknown = set(kwargs) - _NAMES - {"tenant_zipf"}
    if unknown:
        raise ServelabError(f"unknown synth option(s): {', '.join(sorted(unknown))}")
    for name in ("prompt", "output"):
        if name in kwargs:
            kwargs[name] = parse_length(kwargs[name])
    if kwargs.get("duration_s") is not None and "n" not in kwargs:
        kwargs["n"] = None
    zipf = kwargs.pop("tenant_zipf", None)
    tenants = kwargs.get("tenants")
    if isinstance(tenants, (int, np.integer)):
        kwargs["tenants"] = zipf_tenants(int(tenants), zipf or 0.0)
    elif tenants is not None:
        kwargs["tenants"] = parse_weights(tenants, "tenants")
    if "tiers" in kwargs:
        kwargs["tiers"] = parse_weights(kwargs["tiers"], "tiers")
    if "schedule" in kwargs:
        kwargs["schedule"] = tuple((float(s), float(r)) for s, r in kwargs["schedule"])
    if kwargs.get("lengths_from") is not None:
        kwargs["lengths_from"] = str(kwargs["lengths_from"])
    return SynthConfig(**kwargs)


def synth_trace(**kwargs) -> pa.Table:
    """Keyword shortcut: ``synth_trace(n=10_000, rate=5, arrival="gamma", cv=2, prompt="lognormal:600:1", seed=1)``."""
    return generate(make_config(**kwargs))


def _pick(weights: Weights, k: int, rng: np.random.Generator) -> pa.DictionaryArray:
    names = [n for n, _ in weights]
    p = np.array([w for _, w in weights], dtype=np.float64)
    codes = rng.choice(len(names), size=k, p=p / p.sum()).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(names, pa.string()))


def _turn_counts(config: SynthConfig, rng: np.random.Generator, sessions: int | None) -> np.ndarray:
    """Turns per session: geometric with mean ``turns`` (1 when turns == 1)."""
    if config.turns <= 1:
        return np.ones(sessions if sessions is not None else config.n, dtype=np.int64)
    p = 1.0 / config.turns
    if sessions is not None:
        return rng.geometric(p, sessions)
    counts = rng.geometric(p, int(config.n / config.turns) + 16)
    while counts.sum() < config.n:
        counts = np.concatenate([counts, rng.geometric(p, int(config.n / config.turns) + 16)])
    k = int(np.searchsorted(np.cumsum(counts), config.n)) + 1
    counts = counts[:k].copy()
    counts[-1] -= counts.sum() - config.n  # the last session is cut to hit n requests exactly
    return counts


def _lengths(config: SynthConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    if config.lengths_from is not None:
        from servelab.traces.importers import read_length_pairs

        prompt, output = read_length_pairs(Path(config.lengths_from))
        idx = rng.integers(0, len(prompt), n)
        return prompt[idx].astype(np.int64), output[idx].astype(np.int64)
    return config.prompt.sample(n, rng).astype(np.int64), config.output.sample(n, rng).astype(np.int64)


def generate(config: SynthConfig) -> pa.Table:
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(5)]
    arrival_rng, length_rng, tenant_rng, tier_rng, session_rng = streams
    sessions_on = config.turns > 1
    if config.duration_s is not None:
        starts = arrival_times(config.arrival_config, arrival_rng, duration_s=config.duration_s)
        if len(starts) == 0:
            raise ServelabError(f"no arrival fell within {config.duration_s} s; raise the rate or duration")
        turns = _turn_counts(config, session_rng, len(starts))
    else:
        turns = _turn_counts(config, session_rng, None)
        starts = arrival_times(config.arrival_config, arrival_rng, n=len(turns))
    k, n = len(turns), int(turns.sum())
    session = np.repeat(np.arange(k, dtype=np.int64), turns)
    first_row = np.concatenate([[0], np.cumsum(turns)[:-1]])
    turn_idx = np.arange(n) - np.repeat(first_row, turns)

    new_prompt, output = _lengths(config, length_rng, n)
    if config.prompt_pool:
        new_prompt = new_prompt[np.arange(n) % config.prompt_pool]  # the first K draws are the pool's prompts
    think = session_rng.exponential(config.think_s, n) if config.think_s > 0 else np.zeros(n)
    think[turn_idx == 0] = 0.0
    # Later turns arrive after their predecessor finishes; arrival_s only orders them, so use the
    # earliest possible time (start + think times so far) to keep each session in order.
    arrival = np.repeat(starts, turns) + _session_cumsum(think, first_row, turns)

    prompt = new_prompt + config.shared_prefix_tokens
    if sessions_on and config.session_context:
        # Turn j sees the system prompt, every earlier turn's prompt text and output, then its own.
        prompt = prompt + _session_cumsum(new_prompt + output, first_row, turns, exclusive=True)
    if (prompt > np.iinfo(np.int32).max).any():
        raise ServelabError("a generated prompt exceeds 2^31 tokens; lower turns or lengths")

    cols: dict[str, pa.Array] = {
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "arrival_s": pa.array(arrival),
        "prompt_tokens": pa.array(prompt.astype(np.int32)),
        "output_tokens": pa.array(output.astype(np.int32)),
    }
    if config.tenants:
        cols["tenant"] = _pick(config.tenants, k, tenant_rng).take(pa.array(session))
    if config.tiers:
        cols["tier"] = _pick(config.tiers, k, tier_rng).take(pa.array(session))
    if sessions_on:
        cols["session_id"] = pa.array(session)
        cols["think_s"] = pa.array(think, mask=turn_idx == 0)
    block_tokens = config.prefix_block_tokens
    if config.prefix_groups or config.prompt_pool:
        from servelab.traces.prefixes import DEFAULT_BLOCK_TOKENS, PrefixSpec, hashes_column, spec_hashes

        block_tokens = block_tokens or DEFAULT_BLOCK_TOKENS
        spec = PrefixSpec(config.shared_prefix_tokens, max(1, config.prefix_groups), config.prompt_pool)
        cols["prefix_hashes"] = hashes_column(spec_hashes(prompt, spec, block_tokens))
    elif config.prefix_block_tokens is not None:
        # Without carried context, turns of one session share only the system prompt.
        owner = session if sessions_on and config.session_context else np.arange(n, dtype=np.int64)
        cols["prefix_hashes"] = _prefix_hashes(config, prompt, owner, cols.get("tenant"))
    if config.model is not None:
        cols["model"] = schema.constant_dict(config.model, n)
    table = pa.table(cols)
    order = np.argsort(arrival, kind="stable")
    if not np.array_equal(order, np.arange(n)):
        table = table.take(pa.array(order))
        table = table.set_column(0, "request_id", pa.array(np.arange(n, dtype=np.int64)))
    meta = {schema.META_SOURCE: config.source.encode()}
    if block_tokens is not None:
        meta[schema.META_BLOCK_TOKENS] = str(block_tokens).encode()
    return table.replace_schema_metadata(meta)


def _session_cumsum(values: np.ndarray, first_row: np.ndarray, turns: np.ndarray, exclusive: bool = False) -> np.ndarray:
    """Running sum of ``values`` within each session (rows are grouped by session, in turn order)."""
    total = np.cumsum(values)
    before = np.repeat(total[first_row] - values[first_row], turns)
    run = total - before
    return run - values if exclusive else run


def _prefix_hashes(config: SynthConfig, prompt: np.ndarray, session: np.ndarray, tenant) -> pa.ListArray:
    """Block ids: a tenant's system-prompt blocks, then the session's conversation blocks.

    Each session's token stream (system prompt, then turns) gets ids ``session_base + block``;
    blocks wholly inside the system prompt use the tenant's ids instead, so equal prefixes hash
    equally. A trailing partial block gets a fresh id (partial blocks are never reused).
    """
    b = config.prefix_block_tokens
    n = len(prompt)
    nblocks = -(-prompt // b)
    full = prompt // b
    offsets = np.concatenate([[0], np.cumsum(nblocks)])
    total = int(offsets[-1])
    if total >= 2**31:
        raise ServelabError("too many prefix blocks for one trace; raise prefix_block_tokens")
    row = np.repeat(np.arange(n), nblocks)
    pos = np.arange(total) - offsets[row]
    shared_blocks = config.shared_prefix_tokens // b
    tenant_codes = (
        np.asarray(tenant.indices.to_numpy(zero_copy_only=False), dtype=np.int64) if tenant is not None else np.zeros(n, np.int64)
    )
    n_tenants = int(tenant_codes.max()) + 1 if n else 1
    stride = int(prompt.max()) // b + 2 if n else 1
    # id ranges: tenants' system prompts first, then one range per session, then fresh partial blocks.
    tenant_ids = tenant_codes[row] * stride + pos
    session_ids = n_tenants * stride + session[row] * stride + pos
    ids = np.where(pos < shared_blocks, tenant_ids, session_ids)
    partial = pos >= full[row]
    fresh_base = n_tenants * stride + (int(session.max()) + 1) * stride
    ids[partial] = fresh_base + row[partial]
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids.astype(np.int64)))
