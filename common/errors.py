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
