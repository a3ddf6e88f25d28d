"""Read a small text input (a TOML config or spec, a JSON model) with one-line errors for the wrong kind of file."""

from __future__ import annotations

import os
from pathlib import Path

from servelab.common.errors import InputError


def read_text(path: str | os.PathLike) -> str:
    """The file's text as UTF-8.

    A folder, or bytes that are not UTF-8 (a binary file given by mistake), raise an InputError naming
    the file and the line; a missing file raises FileNotFoundError, which callers word themselves.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a folder, not a file")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InputError(path, f"not a text file: byte 0x{data[err.start]:02x} on line {line} is not UTF-8") from None
