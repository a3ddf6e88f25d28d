"""Prompt text with the trace's prompt length in the server's own tokens, sharing the trace's prefixes.

Text is a sequence of *words*, each one token with its leading space (`` the``, `` a``, ...): a
byte-level BPE (GPT-2, Llama 3, Qwen) or SentencePiece tokenizer never merges across the space
before a word, so N such words are N tokens and the count is additive. The words are chosen once
per run by asking the tokenizer (a word is kept when one and two copies of it differ by exactly one
token); the fixed overhead (a BOS token, a chat template) is measured the same way.

A request with ``prefix_hashes`` (one id per ``prefix_block_tokens``-token block) gets, for each
block, words drawn from a generator seeded by (seed, block id): requests sharing leading ids share
the same leading text, so the server's prefix cache sees the trace's sharing. The rest of a prompt
is drawn from (seed, request_id). Overhead tokens come first and are the same for every request,
so they never break the sharing.

With a tokenizer (the server's ``/tokenize``), every prompt is then counted and its unshared tail
adjusted until it has exactly the trace's length. Without one (``Approximate``), each word is
assumed to be one token and the overhead one token (a BOS); the real count is recorded from the
server's usage report.

A tokenizer with fewer than MIN_WORDS single-token words among the candidates (a byte or character
level one, a tokenizer trained on another language) cannot be driven with words. For
``/v1/completions`` the prompt is then a list of token ids (vLLM and the OpenAI completions API
take one): ids drawn from those the tokenizer gives the candidate words (without special tokens),
by the same seeded generators, so prefix sharing holds too and every length is exact by
construction (``token_id_vocabulary``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Candidate words: short, frequent English words and letters; which of them are one token is measured.
CANDIDATES = ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "as", "with", "be", "by", "at", "this", "are", "or", "from", "an", "was", "not", "but", "all", "can", "has", "one", "have", "had", "you", "we", "will", "more", "so", "if", "no", "up", "out", "do", "any", "may", "new", "time", "two", "use", "way", "its", "see", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r", "s", "t", "u", "v", "w", "x", "y", "z"]
MIN_WORDS = 8  # fewer single-token words than this: the tokenizer is not one this module can drive
FIX_ROUNDS = 4  # count-and-adjust rounds per prompt


class Tokenizer(Protocol):
    """Counts tokens the way the server will (prompt text for completions, one user message for chat).
    An exact tokenizer may also give a text's token ids without special tokens (``ids``)."""

    async def count(self, text: str) -> int: ...


class FewWords(RuntimeError):
    """The tokenizer has fewer than MIN_WORDS single-token candidate words."""


class Approximate:
    """No tokenizer: every candidate word counts one token, plus one overhead token."""

    async def count(self, text: str) -> int:
        return len(text.split()) + 1


@dataclass(frozen=True, slots=True)
class Vocabulary:
    words: tuple  # each one token with its leading space (token ids: ``token_id_vocabulary``)
    overhead: int  # tokens a prompt has besides its words (BOS, chat template)
    exact: bool  # measured with the server's tokenizer (False: the approximation)


async def measure_vocabulary(tokenizer: Tokenizer, exact: bool) -> Vocabulary:
    if not exact:
        return Vocabulary(tuple(" " + w for w in CANDIDATES), 1, False)
    words = [" " + w for w in CANDIDATES]
    ones = await asyncio.gather(*(tokenizer.count(w) for w in words))
    twos = await asyncio.gather(*(tokenizer.count(w + w) for w in words))
    keep = [(w, one) for w, one, two in zip(words, ones, twos) if two - one == 1]
    if len(keep) < MIN_WORDS:
        raise FewWords(f"the server's tokenizer has only {len(keep)} single-token words among "
                           f"{len(words)} candidates (need {MIN_WORDS})")  # fmt: skip
    overheads = {one - 1 for _, one in keep}
    if len(overheads) != 1:
        raise RuntimeError(f"the server's tokenizer adds a varying number of tokens ({sorted(overheads)})")
    return Vocabulary(tuple(w for w, _ in keep), overheads.pop(), True)


async def token_id_vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    """Token-id "words" for a tokenizer without enough single-token words: the ids of the candidate
    words' text, less any id every text gets (a BOS the server adds anyway), no overhead: a prompt
    of N ids is N tokens."""
    ids_of = getattr(tokenizer, "ids", None)
    if ids_of is None:
        raise FewWords("the tokenizer gives no token ids")
    texts = [" " + " ".join(CANDIDATES), " the", " of", " x"]
    got = await asyncio.gather(*(ids_of(t) for t in texts))
    always = set(got[1]) & set(got[2]) & set(got[3])
    pool = sorted(set(got[0]) - always)
    if len(pool) < 2:
        raise FewWords(f"the tokenizer gives only {len(pool)} distinct token ids for the candidate words")
    return Vocabulary(tuple(pool), 0, True)


def id_prompt(vocab: Vocabulary, seed: int, request_id: int, prompt_tokens: int,
              prefix_hashes: Sequence[int] | None = None, block_tokens: int | None = None) -> tuple[list[int], int]:  # fmt: skip
    """(token ids, their count) of ``token_id_vocabulary``: exactly ``prompt_tokens`` (at least one)."""
    ids, _ = draft(vocab, seed, request_id, prompt_tokens, prefix_hashes, block_tokens)
    return [int(i) for i in ids], len(ids)


def _words(rng: np.random.Generator, vocab: Vocabulary, n: int) -> list[str]:
    if n <= 0:
        return []
    return [vocab.words[i] for i in rng.integers(0, len(vocab.words), size=n)]


def _rng(seed: int, key: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, salt, key & 0xFFFFFFFFFFFFFFFF])


def draft(vocab: Vocabulary, seed: int, request_id: int, prompt_tokens: int,
          prefix_hashes: Sequence[int] | None, block_tokens: int | None) -> tuple[list[str], int]:  # fmt: skip
    """The prompt's words and how many of them are shared blocks (the rest may be adjusted)."""
    need = max(1, prompt_tokens - vocab.overhead)
    words: list[str] = []
    if prefix_hashes and block_tokens:
        for h in prefix_hashes:
            take = min(block_tokens, need - len(words))
            if take <= 0:
                break
            words += _words(_rng(seed, int(h), 1), vocab, block_tokens)[:take]
    shared = len(words)
    words += _words(_rng(seed, int(request_id), 2), vocab, need - len(words))
    return words, shared


async def build_prompt(tokenizer: Tokenizer, vocab: Vocabulary, seed: int, request_id: int, prompt_tokens: int,
                       prefix_hashes: Sequence[int] | None = None, block_tokens: int | None = None) -> tuple[str, int]:  # fmt: skip
    """(text, token count): exactly ``prompt_tokens`` when the tokenizer is exact and the length is
    reachable (at least the overhead plus one word); otherwise the nearest, counted."""
    words, shared = draft(vocab, seed, request_id, prompt_tokens, prefix_hashes, block_tokens)
    text = "".join(words)
    if not vocab.exact:
        return text, len(words) + vocab.overhead
    tail_rng = _rng(seed, int(request_id), 3)
    count = await tokenizer.count(text)
    for _ in range(FIX_ROUNDS):
        diff = prompt_tokens - count
        if diff == 0:
            break
        if diff > 0:
            words += _words(tail_rng, vocab, diff)
        else:
            floor = shared if len(words) - shared >= -diff else 1  # cut into shared blocks only if needed
            cut = min(-diff, len(words) - max(1, floor))
            if cut <= 0:
                break
            del words[len(words) - cut:]
        text = "".join(words)
        count = await tokenizer.count(text)
    return text, count
