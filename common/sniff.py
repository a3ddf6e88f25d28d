"""Telling a source's format from its first file, for the registries of importers (trace formats, run
import formats): each importer may carry a test of that file (``@detects``), and ``detect`` asks the
registered ones in their order. An importer and its test are one file: nothing lists the formats."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Callable

from servelab.common.errors import InputError
from servelab.common.registry import Registry


class Probe:
    """The first source file as the tests see it: its path and, read once when a test first asks, its
    first ``size`` bytes as text (a byte-order mark dropped) and first non-blank line. Asking for the
    text of a path that is not a file is the error (``folder_hint`` follows a folder's)."""

    def __init__(self, path: Path, size: int, folder_hint: str = ""):
        self.path = Path(path)
        self.size = size
        self.folder_hint = folder_hint

    @cached_property
    def raw(self) -> bytes:
        if self.path.is_dir():
            raise InputError(self.path, f"is a folder, not a file{self.folder_hint}")
        if not self.path.is_file():
            raise InputError(self.path, "file not found")
        with open(self.path, "rb") as f:
            raw = f.read(self.size)
        if raw[:2] == b"\x1f\x8b":  # gzip: the tests see the text inside, as the importers read it
            import gzip
            import zlib

            try:
                return gzip.GzipFile(self.path).read(self.size)
            except (OSError, EOFError, zlib.error):
                return raw
        return raw

    @cached_property
    def head(self) -> str:
        return self.raw.decode("utf-8", errors="replace").lstrip("\ufeff")

    @cached_property
    def line(self) -> str:
        return next((x for x in self.head.splitlines() if x.strip()), "")

    @property
    def json_line(self) -> bool:
        """Does the first line open a JSON object or array?"""
        return self.line.lstrip().startswith(("{", "["))

    @cached_property
    def columns(self) -> set[str]:
        """A CSV header's names, lower case (none for a JSON line)."""
        if self.json_line:
            return set()
        return {c.strip().strip('"').strip().lower() for c in self.line.split(",")}


Test = Callable[[Probe], bool]


def detects(test: Test, order: int) -> Callable:
    """Mark an importer as the format of the sources whose first file passes ``test``; lower ``order``
    is asked first (a format whose files would also pass a later test goes before it)."""
    def mark(importer):
        importer.detects, importer.detect_order = test, order
        return importer

    return mark


def detect(registry: Registry, paths: list[Path], size: int, unknown: str, folder_hint: str = "") -> str:
    """The name of the first importer of ``registry`` (by order) whose test passes the first of
    ``paths``; none: an `InputError` on it saying ``unknown``."""
    probe = Probe(paths[0], size, folder_hint)
    tests = sorted((importer.detect_order, name, importer.detects) for name in registry.names()
                   if hasattr(importer := registry.get(name), "detects"))
    if probe.path.is_file() and not probe.head.strip():  # nothing to tell a format by: say so, not that the format is unknown
        raise InputError(probe.path, "is empty" if not probe.raw else "holds only blank lines")
    for _, name, test in tests:
        if test(probe):
            return name
    raise InputError(probe.path, unknown)


__all__ = ["Probe", "detect", "detects"]
