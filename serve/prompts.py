"""Prompt lengths: a local tokenizer.json (Hugging Face ``tokenizers``), else about four characters a token."""

from __future__ import annotations

from servelab.common.errors import ServelabError

CHARS_PER_TOKEN = 4


class PromptCounter:
    """Counts a prompt's tokens; ``exact`` says whether a real tokenizer does it."""

    def __init__(self, tokenizer_path: str | None = None):
        self.tokenizer = None
        self.path = tokenizer_path
        if tokenizer_path is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError as err:
                raise ServelabError("--tokenizer needs the 'tokenizers' package (pip install 'servelab[tokenizer]')") from err
            try:
                self.tokenizer = Tokenizer.from_file(tokenizer_path)
            except Exception as err:  # the library raises its own exception types for a bad file
                raise ServelabError(f"--tokenizer {tokenizer_path}: not a tokenizer.json ({err})") from err

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    @property
    def description(self) -> str:
        if self.tokenizer is not None:
            return f"tokenizer {self.path}"
        return f"approximate: ceil(characters / {CHARS_PER_TOKEN}), at least 1 (no --tokenizer given)"

    def ids(self, text: str) -> list[int] | None:
        """Token ids of ``text`` (no special tokens), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return max(1, len(self.tokenizer.encode(text).ids))
        return max(1, -(-len(text) // CHARS_PER_TOKEN))

    def chat(self, messages: list[dict]) -> int:
        """A chat's prompt: its messages' contents, one after another (no chat template)."""
        return self.count("\n".join(_content(m) for m in messages))


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones count
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
