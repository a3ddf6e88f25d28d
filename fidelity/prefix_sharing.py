"""Which prompt sharing an imported run's trace gets, from the most exact thing the run records.

Order: options given on the command line (``PrefixSpec``), the prompts' token ids (vLLM's hash
chain), their text, TraceV2's ``prefix_group``/``prefix_length`` columns, the generator's recorded
settings (``Measured.prefix``), and, only when asked, a shared prefix fitted to the hit rate the
server reported. A reported hit rate with no hashes to explain it is a loud warning, with the
option that would apply a matching prefix, unless the server's log shows the hits began only under
KV pressure (fidelity/vllm_log.py): preempted requests re-finding their own blocks, not shared
prompts; that is a note.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.fidelity.base import Measured
from servelab.traces import prefixes
from servelab.traces.prefixes import PrefixSpec

WARN_HIT_RATE = 0.01  # a reported hit rate above this with no hashes is worth a warning


@dataclass(frozen=True)
class PrefixChoice:
    hashes: list[list[int]] | None  # one list per row of measured.rows; None: no prefix_hashes column
    block_tokens: int
    origin: str  # where the sharing came from, for run.json and validate --real
    ideal_share: float | None  # tokens an unlimited cache would serve / all prompt tokens
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def record(self) -> dict:
        return {"origin": self.origin, "block_tokens": self.block_tokens if self.hashes is not None else None,
                "ideal_hit_share": self.ideal_share}


def choose(measured: Measured, block_tokens: int, option: PrefixSpec | None = None,
           hit_rate: float | None = None, apply_hit_rate: bool = False) -> PrefixChoice:
    rows = measured.rows
    prompt = rows.prompt_tokens
    hashes, origin = None, "none: the run records no prompt content or sharing"
    if option is not None and option.active:
        hashes, origin = prefixes.spec_hashes(prompt, option, block_tokens), f"options: {option.describe()}"
    elif any(t is not None for t in rows.token_ids):
        # at most the prompt's full blocks: ids beyond the counted prompt are not the server's KV
        hashes = [[] if t is None else prefixes.token_hashes(t, block_tokens)[:p // block_tokens]
                  for t, p in zip(rows.token_ids, prompt)]
        origin = "the prompts' token ids (vLLM's block hash chain)"
    elif any(t for t in rows.prompt_text):
        hashes = prefixes.text_hashes(rows.prompt_text, prompt, block_tokens)
        origin = "the prompts' text (blocks at the mean characters per token)"
    elif any(g is not None for g in rows.prefix_group):
        hashes = prefixes.spec_hashes(prompt, PrefixSpec(), block_tokens, groups=rows.prefix_group,
                                      lengths=rows.prefix_length)
        origin = "the source's prefix_group and prefix_length columns"
    elif measured.prefix is not None and measured.prefix.active:
        hashes = prefixes.spec_hashes(prompt, measured.prefix, block_tokens)
        origin = f"generator settings in {measured.prefix.origin}: {measured.prefix.describe()}"
    warnings, notes = [], []
    caching = measured.settings.get("enable_prefix_caching", True) is not False
    pressure = measured.source.get("prefix_cache_hit_rate_pressure")  # the log's hits look like preemption's
    if hashes is None and caching and hit_rate is not None and hit_rate > WARN_HIT_RATE:
        needed = apply_hit_rate or not pressure  # the prefix that reproduces the rate: applied, or advised
        length = prefixes.hit_rate_prefix(_served(rows), hit_rate, block_tokens) if needed else 0
        if pressure:
            said = (f"the server's prefix-cache hit rate {hit_rate:.1%} comes from preemption, not shared prompts "
                    f"({pressure}): vLLM counts each time the scheduler looks a waiting request up, and one "
                    "preempted by recompute finds its own blocks still cached; the replay preempts and "
                    "re-finds its blocks itself")
            (warnings if apply_hit_rate else notes).append(said + (": --prefix-from-hit-rate applied anyway"
                                                                   if apply_hit_rate else ""))
        if apply_hit_rate:
            spec = PrefixSpec(length, 1, 0, origin="the reported hit rate")
            hashes = prefixes.spec_hashes(prompt, spec, block_tokens)
            origin = (f"fitted to the server's prefix-cache hit rate {hit_rate:.1%}: "
                      f"a {length:,}-token prefix shared by every request")
        elif not pressure:
            warnings.append(
                f"the server reported a prefix-cache hit rate of {hit_rate:.1%} but the run records no prompt "
                f"content or sharing: the replay will recompute every prompt (TTFT too high). Pass "
                f"--prefix-from-hit-rate to share a {length:,}-token prefix that reproduces it, or describe "
                f"the generator with --shared-prefix-tokens N [--prefix-groups G] [--prompt-pool K]")
    share = None
    if hashes is not None:  # over the requests the trace keeps, in arrival order (as a replay sees them)
        kept = _kept(rows)
        total = sum(prompt[i] for i in kept)
        share = prefixes.shared_tokens([hashes[i] for i in kept], [prompt[i] for i in kept],
                                       block_tokens) / total if total else None
    return PrefixChoice(hashes, block_tokens, origin, share, tuple(warnings), tuple(notes))


def _kept(rows) -> list[int]:
    """Rows the trace keeps (fidelity/base.py trace_from), in arrival order."""
    order = sorted(range(len(rows)), key=lambda i: rows.arrival_s[i])
    return [i for i in order if rows.ok[i] or (rows.prompt_tokens[i] >= 1 and rows.output_tokens[i] >= 1)]


def _served(rows) -> list[int]:
    """Prompt lengths of the requests the trace keeps, in arrival order (what the hit rate covers)."""
    return [rows.prompt_tokens[i] for i in _kept(rows)]
