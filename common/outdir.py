"""The rule for commands that write a result directory (`replay -o`, `demo -o`, `sweep -o`): check before any work.

A missing or empty directory is written; one holding a result of the same kind is replaced only
with ``--force``; anything else (a file, a directory holding other things) is never replaced.
"""

from __future__ import annotations

import os
from pathlib import Path

from servelab.common.errors import ServelabError


def check_output_dir(path: str | os.PathLike, force: bool, what: str, markers: tuple[str, ...],
                     may_replace: bool = False) -> None:  # fmt: skip
    """Raise a one-line ServelabError unless writing ``path`` is allowed.

    ``markers``: file names of which one marks a directory as a ``what`` (e.g. run.json for a run
    directory). ``may_replace``: replace such a directory without ``force`` (the demo's own output).
    """
    p = Path(path)
    for folder in p.parents:  # a file where a parent folder should be: say so before any work
        if os.path.lexists(folder):
            if not folder.is_dir():
                raise ServelabError(f"{p}: cannot write it: {folder} is a file, not a folder")
            break
    if not os.path.lexists(p):
        return
    if not p.is_dir():
        raise ServelabError(f"{p}: exists and is not a directory; choose another output directory")
    try:
        empty = next(p.iterdir(), None) is None
    except OSError as err:
        raise ServelabError(f"{p}: cannot read it ({err.strerror})") from None
    if empty:
        return
    if not any((p / m).is_file() for m in markers):
        raise ServelabError(f"{p}: exists and is not a {what} (it holds other files); not replacing it, "
                            f"choose another output directory")  # fmt: skip
    if not (force or may_replace):
        raise ServelabError(f"{p}: a {what} is already there; add --force to replace it")
