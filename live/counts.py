"""Check the server's usage counts against what the client saw, before they become a run's token counts.

A server's ``usage`` is trusted as the real token count (a text chunk may carry several tokens), but
not blindly: a completion count below one for a request that streamed text, above the ``max_tokens``
the request asked for (a server may not generate more), or beyond a 32-bit count is not a count of
what was generated. Such a count is set aside (kept in ``usage_output_tokens``) and the streamed
text chunks stand in, so one bad field never throws away a measured run. A prompt count below one or
beyond 32 bits falls back to the prompt builder's count, a cached count outside 0..prompt to none.
Each kind of mismatch becomes one warning line with how many requests it touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from servelab.live.client import Record

INT32_MAX = 2**31 - 1


def completion_usage_ok(usage: int, chunks: int, max_tokens: int | None) -> bool:
    if usage < 1 and chunks > 0:
        return False
    if usage < 0 or usage > INT32_MAX:
        return False
    return max_tokens is None or usage <= max(max_tokens, chunks)


def check_counts(records: Sequence[Record], max_tokens: Sequence[int | None], log: list[str]) -> None:
    """Set aside implausible usage counts in ``records`` (sent requests, ``max_tokens[i]`` asked of
    ``records[i]``) and append a warning per kind of problem to ``log``."""
    rejected: dict[int, int] = {}  # bad completion count -> requests
    differ: dict[tuple[int, int], int] = {}  # (usage, chunks) -> requests
    early: dict[tuple[int, int], int] = {}  # (generated, asked) -> requests
    bad_prompt = bad_cached = 0
    for rec, asked in zip(records, max_tokens):
        chunks = len(rec.token_times)
        usage = rec.usage_completion_tokens
        if usage is not None:
            if not completion_usage_ok(usage, chunks, asked):
                rec.usage_rejected_tokens, rec.usage_completion_tokens = usage, None
                rejected[usage] = rejected.get(usage, 0) + 1
            elif chunks and usage != chunks:
                differ[(usage, chunks)] = differ.get((usage, chunks), 0) + 1
        prompt = rec.usage_prompt_tokens
        if prompt is not None and not 1 <= prompt <= INT32_MAX:
            rec.usage_prompt_tokens = None
            bad_prompt += 1
        cached = rec.usage_cached_tokens
        if cached is not None and not 0 <= cached <= (rec.usage_prompt_tokens or INT32_MAX):
            rec.usage_cached_tokens = None
            bad_cached += 1
        if rec.status == "finished" and asked is not None and rec.output_tokens < asked:
            key = (rec.output_tokens, asked)
            early[key] = early.get(key, 0) + 1
    for usage, n in sorted(rejected.items()):
        log.append(f"{_n(n)}: the server's usage completion_tokens ({usage}) is not a count of what streamed; "
                   "the text chunks streamed stand in (usage_output_tokens keeps the server's)")
    if differ:
        (usage, chunks), n = max(differ.items(), key=lambda kv: kv[1])
        more = f" (and {_n(sum(differ.values()) - n)} with other counts)" if len(differ) > 1 else ""
        log.append(f"{_n(n)}: the server's usage ({usage} tokens) differs from the {chunks} text chunks streamed{more}; "
                   "the server's count is kept")
    if bad_prompt:
        log.append(f"{_n(bad_prompt)}: the server's usage prompt_tokens is not a count; the built prompt's count stands in")
    if bad_cached:
        log.append(f"{_n(bad_cached)}: the server's cached_tokens is outside 0..prompt tokens; left out")
    if early:
        (got, asked), n = max(early.items(), key=lambda kv: kv[1])
        log.append(f"{_n(sum(early.values()))} ended early: fewer output tokens than asked (e.g. {got} of {asked} asked); "
                   "tpot and throughput are over what was generated")


def _n(count: int) -> str:
    return f"{count} request{'s' if count != 1 else ''}"
