"""Prefix-block hashes for a trace's ``prefix_hashes`` column, from what a run records about its prompts.

Three sources, most exact first:

- **token ids**: the hash chain vLLM's prefix cache computes: the prompt cut into ``block_tokens``
  chunks, each full block's hash covering its parent's hash and its own token ids (so two prompts
  share block j exactly when their first (j + 1) blocks are equal). Partial last blocks get no hash
  (vLLM never caches them); the engine keys a request's unhashed blocks by the request itself.
- **prompt text** without a tokenizer: the same chain over text chunks of ``block_tokens`` tokens'
  worth of characters, at the trace's mean characters per token (an approximation: equal text
  prefixes give equal blocks; the boundaries are not the tokenizer's).
- **generator settings** (``PrefixSpec``): a shared prefix of N tokens in G groups (request i in
  group i mod G, GuideLLM's round-robin over its prefixes) and/or a pool of K prompts (request i
  sends pool prompt i mod K, whose text follows its group's prefix).

``hit_rate_prefix`` finds the one shared prefix that reproduces a measured prefix-cache hit rate.
The column follows traces/schema.py (list<int64>, file metadata ``prefix_block_tokens``), which
live/prompts.py turns back into prompt text sharing the same blocks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from servelab.common.errors import ServelabError

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default KV block size on GPUs
_MASK = (1 << 63) - 1  # hashes are non-negative int64


def _digest(parent: int, payload: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little") + payload, digest_size=8).digest()
    return int.from_bytes(h, "little") & _MASK


def chain(blocks: Sequence[bytes], root: int = 0) -> list[int]:
    """Each block's hash covers its parent's (vLLM's ``hash_block_tokens`` chaining)."""
    out, parent = [], root
    for payload in blocks:
        parent = _digest(parent, payload)
        out.append(parent)
    return out


def token_hashes(token_ids: Sequence[int] | np.ndarray, block_tokens: int) -> list[int]:
    """Hashes of the full ``block_tokens`` blocks of a prompt's token ids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    full = len(ids) // block_tokens
    return chain([ids[j * block_tokens:(j + 1) * block_tokens].tobytes() for j in range(full)])


def text_hashes(texts: Sequence[str | None], prompt_tokens: Sequence[int], block_tokens: int) -> list[list[int]]:
    """Hashes of text chunks worth ``block_tokens`` tokens each, at the trace's mean characters per
    token; a request has at most ``prompt_tokens // block_tokens`` of them. None: no text, no hashes."""
    chars = sum(len(t) for t in texts if t)
    tokens = sum(p for t, p in zip(texts, prompt_tokens) if t)
    if not chars or not tokens:
        return [[] for _ in texts]
    per_block = block_tokens * chars / tokens
    out = []
    for text, prompt in zip(texts, prompt_tokens):
        if not text:
            out.append([])
            continue
        full = min(int(prompt) // block_tokens, int(len(text) // per_block))
        cuts = [round(j * per_block) for j in range(full + 1)]
        out.append(chain([text[cuts[j]:cuts[j + 1]].encode() for j in range(full)], root=1))
    return out


@dataclass(frozen=True)
class PrefixSpec:
    """How a generator shared prompts: ``prefix_tokens`` shared by the requests of each of
    ``prefix_groups`` groups, and/or a pool of ``prompt_pool`` prompts the requests cycle through."""

    prefix_tokens: int = 0
    prefix_groups: int = 1
    prompt_pool: int = 0
    origin: str = "option"  # where the settings came from (a file, an option, a hit rate)

    def __post_init__(self) -> None:
        if self.prefix_tokens < 0 or self.prefix_groups < 1 or self.prompt_pool < 0:
            raise ServelabError(f"prefix sharing needs prefix tokens >= 0, groups >= 1, pool >= 0 (got "
                                f"{self.prefix_tokens}, {self.prefix_groups}, {self.prompt_pool})")

    @property
    def active(self) -> bool:
        return self.prefix_tokens > 0 or self.prompt_pool > 0

    def describe(self) -> str:
        parts = []
        if self.prefix_tokens:
            parts.append(f"a {self.prefix_tokens:,}-token shared prefix in {self.prefix_groups} group(s)")
        if self.prompt_pool:
            parts.append(f"a pool of {self.prompt_pool:,} prompts")
        return " and ".join(parts) or "no sharing"


def spec_from_options(prefix_tokens: int | None, groups: int | None, pool: int | None) -> PrefixSpec | None:
    """The sharing given by ``--shared-prefix-tokens``, ``--prefix-groups`` and ``--prompt-pool`` (None: none given)."""
    if groups is not None and not prefix_tokens:
        raise ServelabError("--prefix-groups needs --shared-prefix-tokens")
    for option, value, least in (("--shared-prefix-tokens", prefix_tokens, 0), ("--prefix-groups", groups, 1),
                                 ("--prompt-pool", pool, 0)):
        if value is not None and value < least:
            raise ServelabError(f"{option} must be >= {least} (got {value})")
    if prefix_tokens is None and pool is None:
        return None
    return PrefixSpec(prefix_tokens or 0, groups or 1, pool or 0, origin="options")


def spec_hashes(prompt_tokens: Sequence[int], spec: PrefixSpec, block_tokens: int,
                groups: Sequence[int | None] | None = None,
                lengths: Sequence[int | None] | None = None) -> list[list[int]]:
    """Per request: its group's prefix blocks, then (with a pool) its pool prompt's blocks. ``groups``
    and ``lengths`` (per request; TraceV2's ``prefix_group`` and ``prefix_length``) replace the
    round-robin group and the shared length; a request whose group is None shares no prefix."""
    out = []
    for i, prompt in enumerate(prompt_tokens):
        group = groups[i] if groups is not None else i % spec.prefix_groups
        shared = lengths[i] if lengths is not None and lengths[i] is not None else spec.prefix_tokens
        full = int(prompt) // block_tokens
        n_prefix = 0 if group is None else min(int(shared) // block_tokens, full)
        # the prefix's blocks depend on the group only; a pool prompt's continue its group's chain
        blocks = [b"g%d:%d" % (group, j) for j in range(n_prefix)]
        if spec.prompt_pool:
            blocks += [b"p%d:%d" % (i % spec.prompt_pool, j) for j in range(n_prefix, full)]
        out.append(chain(blocks, root=2))
    return out


def hashes_column(hashes: Sequence[Sequence[int]]) -> pa.ListArray:
    return pa.array([list(h) for h in hashes], type=pa.list_(pa.int64()))


def shared_tokens(hashes: Sequence[Sequence[int]], prompt_tokens: Sequence[int], block_tokens: int) -> int:
    """Prompt tokens an unlimited cache would serve, in request order: each request's longest run of
    leading blocks seen before (capped one token short of its prompt: the last token is computed)."""
    seen: set[int] = set()
    total = 0
    for h, prompt in zip(hashes, prompt_tokens):
        hit = 0
        for x in h:
            if x not in seen:
                break
            hit += 1
        total += min(hit * block_tokens, int(prompt) - 1)
        seen.update(h)
    return total


def hit_rate_prefix(prompt_tokens: Sequence[int], hit_rate: float, block_tokens: int) -> int:
    """The shared-prefix length (whole blocks, one group) whose hits over all prompt tokens come
    closest to ``hit_rate`` (0..1): every request but the first hits min(L, its full blocks)."""
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    total = prompt.sum()
    full = prompt // block_tokens * block_tokens
    rest = full[1:]

    def share(length: int) -> float:
        return float(np.minimum(rest, length).sum() / total) if total else 0.0

    lo, hi = 0, int(full.max(initial=0)) // block_tokens
    while lo < hi:  # the share grows with the length: the smallest length reaching the rate
        mid = (lo + hi) // 2
        if share(mid * block_tokens) < hit_rate:
            lo = mid + 1
        else:
            hi = mid
    if lo > 0 and abs(share((lo - 1) * block_tokens) - hit_rate) <= abs(share(lo * block_tokens) - hit_rate):
        lo -= 1
    return lo * block_tokens


# GuideLLM (prefix_tokens, prefix_count), vLLM's bench (random_prefix_len, prefix_repetition_*), ours
_SPEC_KEYS = {"prefix_tokens": "prefix_tokens", "shared_prefix_tokens": "prefix_tokens",
              "system_prompt_tokens": "prefix_tokens", "prefix_len": "prefix_tokens",
              "random_prefix_len": "prefix_tokens", "prefix_repetition_prefix_len": "prefix_tokens",
              "prefix_count": "prefix_groups", "prefix_groups": "prefix_groups", "num_prefixes": "prefix_groups",
              "prefix_repetition_num_prefixes": "prefix_groups",
              "prompt_pool": "prompt_pool", "prompt_pool_size": "prompt_pool", "num_unique_prompts": "prompt_pool"}
_KV = re.compile(r"(\w+)[\"']?\s*[=:]\s*(\d+)")


def spec_from_generator(args: object, origin: str) -> PrefixSpec | None:
    """A PrefixSpec from a generator's recorded settings: any (nested) ``prefix_tokens``,
    ``prefix_count`` (groups), ``prompt_pool`` (or their aliases) in a dict, or ``key=value`` text
    such as GuideLLM's ``--data 'prompt_tokens=512,prefix_tokens=1024,prefix_count=4'``."""
    found: dict[str, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                name = _SPEC_KEYS.get(str(key).lower())
                if name and isinstance(value, (int, float)) and not isinstance(value, bool):
                    found.setdefault(name, int(value))
                else:
                    walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)
        elif isinstance(obj, str):
            for key, value in _KV.findall(obj):
                name = _SPEC_KEYS.get(key.lower())
                if name:
                    found.setdefault(name, int(value))

    walk(args)
    spec = PrefixSpec(found.get("prefix_tokens", 0), max(1, found.get("prefix_groups", 1)),
                      found.get("prompt_pool", 0), origin=origin)
    return spec if spec.active else None


def add_sharing(table: pa.Table, spec: PrefixSpec, block_tokens: int) -> pa.Table:
    """``table`` (a trace in arrival order) with ``prefix_hashes`` built from ``spec``; a trace that
    has hashes already is refused (they record the real sharing)."""
    from servelab.traces import schema

    if block_tokens < 1:
        raise ServelabError(f"prefix block tokens must be >= 1 (got {block_tokens})")
    if "prefix_hashes" in table.column_names:
        raise ServelabError("the trace already has prefix_hashes (the source records its sharing); "
                            "drop --shared-prefix-tokens/--prompt-pool")
    prompt = table.column("prompt_tokens").to_pylist()
    table = table.append_column("prefix_hashes", hashes_column(spec_hashes(prompt, spec, block_tokens)))
    meta = dict(table.schema.metadata or {})
    meta[schema.META_BLOCK_TOKENS] = str(block_tokens).encode()
    return table.replace_schema_metadata(meta)
