"""Tokenizers for exact prompt lengths: the server's over HTTP (vLLM's ``POST /tokenize``, also SGLang's),
or a local ``tokenizer.json`` (Hugging Face ``tokenizers``, the optional extra ``servelab[tokenizer]``)."""

from __future__ import annotations

import aiohttp
from servelab.live.client import Target


class ServerTokenizer:
    """Counts tokens with the server's ``/tokenize``: the prompt for completions, one user message
    (with the chat template and generation prompt) for chat."""

    def __init__(self, http: aiohttp.ClientSession, target: Target):
        self.http = http
        self.target = target

    def _body(self, text: str) -> dict:
        if self.target.api == "chat":
            return {"model": self.target.model, "messages": [{"role": "user", "content": text}],
                    "add_generation_prompt": True}  # fmt: skip
        return {"model": self.target.model, "prompt": text}

    async def ids(self, text: str) -> list[int]:
        """The prompt's token ids without special tokens (vLLM: add_special_tokens false)."""
        body = dict(self._body(text), add_special_tokens=False)
        async with self.http.post(f"{self.target.root}/tokenize", json=body, headers=self.target.headers(),
                                  timeout=self.target.setup_timeout(), raise_for_status=True) as response:  # fmt: skip
            data = await response.json(content_type=None)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RuntimeError(f"{self.target.root}/tokenize gave no token ids")
        return tokens

    async def count(self, text: str) -> int:
        async with self.http.post(f"{self.target.root}/tokenize", json=self._body(text), headers=self.target.headers(),
                                  timeout=self.target.setup_timeout()) as response:  # fmt: skip
            if response.status in (404, 405):
                raise Unusable(f"{self.target.root} has no /tokenize (HTTP {response.status})")
            if response.status != 200:
                raise Unusable(f"{self.target.root}/tokenize answered HTTP {response.status}")
            data = await response.json(content_type=None)
        if isinstance(data, dict) and isinstance(data.get("count"), int):
            return data["count"]
        if isinstance(data, dict) and isinstance(data.get("tokens"), list):
            return len(data["tokens"])
        raise Unusable(f"{self.target.root}/tokenize answered without a token count (no count, no tokens)")


class Unusable(RuntimeError):
    """The server's /tokenize cannot size prompts; the message says why."""


async def server_tokenizer(http: aiohttp.ClientSession, target: Target) -> tuple[ServerTokenizer | None, str | None]:
    """The server's tokenizer when its ``/tokenize`` counts word by word, else None and why not.

    Prompts are built of words that are one token each (live/prompts.py), so one more word must add a
    token: a server whose /tokenize approximates (``servelab serve`` without ``--tokenizer`` counts
    characters / 4) answers, but cannot size them."""
    tok = ServerTokenizer(http, target)
    try:
        one, two = await tok.count(" a"), await tok.count(" a a")
    except Unusable as err:
        return None, str(err)
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        return None, f"{target.root}/tokenize did not answer ({type(err).__name__}: {err})"
    if two > one:
        return tok, None
    return None, (f"{target.root}/tokenize counts ' a' and ' a a' as {one} and {two} tokens: not a tokenizer's "
                  "counts, which add a token per word (servelab serve without --tokenizer approximates "
                  "characters / 4; give it --tokenizer)")


class LocalTokenizer:
    """A ``tokenizer.json`` file, counted with its special tokens (BOS) as the server would add them.
    For ``--api completions`` only: a chat prompt's template is the server's."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RuntimeError("a local tokenizer.json needs the `tokenizers` package "
                               "(pip install 'servelab[tokenizer]')") from None  # fmt: skip
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 -- tokenizers raises a bare Exception for any unreadable file
            raise RuntimeError(f"{path}: not a readable tokenizer.json ({err})") from None

    async def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    async def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
