"""Is a process (by pid and start time) still alive? Used to recognise what killed processes left
behind: temporaries of atomic writes, trials of search workers."""

from __future__ import annotations

import os


def start_token(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (so a recycled pid is not taken for the process we mean);
    None when it cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, token: str | None) -> bool:
    """``pid`` runs and is the process that had start ``token`` (None: unknown, any process will do).
    A zombie (killed, not yet reaped) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    current = start_token(pid)
    return token is None or current is None or current == token


__all__ = ["alive", "start_token"]
