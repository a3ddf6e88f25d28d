"""The one exception type the CLI turns into a clean message."""

from __future__ import annotations


class ServelabError(Exception):
    """A user-facing error: bad input, bad option, impossible configuration.

    The CLI prints ``str(err)`` and exits non-zero (a traceback only with ``--debug``).
    """


class InputError(ServelabError):
    """Bad input data; names the file, the column/field, the first offending row and the rule."""

    def __init__(self, path: object, rule: str, column: str | None = None, row: int | None = None):
        self.path = str(path)
        self.column = column
        self.row = row
        self.rule = rule
        where = self.path
        if column is not None:
            where += f", column '{column}'"
        if row is not None:
            where += f", row {row}"
        super().__init__(f"{where}: {rule}")


def require_distinct(paths) -> None:
    """Raise InputError when one source file is given twice (by the same or another path): its requests
    would be read twice, at double the load."""
    seen: dict = {}
    for p in paths:
        key = p.resolve()
        if key in seen:
            raise InputError(p, f"given twice (also as {seen[key]}): each source file once")
        seen[key] = p


def require_file(path: object, what: str = "file") -> None:
    """Raise InputError unless ``path`` is an existing file: 'file not found', or 'is a folder, not a {what}'."""
    import os

    p = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if os.path.isdir(p):
        raise InputError(path, f"is a folder, not a {what}")
    if not os.path.exists(p):
        raise InputError(path, "file not found")
    if not os.access(p, os.R_OK):
        raise InputError(path, "cannot read it (permission denied)")
