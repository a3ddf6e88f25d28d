"""Write files and directories so that a failure never leaves a half-written result behind.

A result is written into a hidden temporary beside its destination, ``.NAME.<owner>.<random>.tmp``
(``<owner>`` names the host and process), and moved onto ``NAME`` only when complete. A directory
that already exists is swapped with the new one in a single step (Linux ``renameat2`` with
``RENAME_EXCHANGE``); where that is not available the old one is first renamed aside
(``.NAME.<owner>.<random>.old.tmp``), the new one moved in, and the old one deleted. A kill at any
moment therefore leaves either the old or the new result at ``NAME`` (or, in the fallback's window
between its two renames, the old one aside, which the next write to ``NAME`` moves back).

Temporaries of processes that died (kill -9, power loss) are removed the next time anything is
written to the same destination, with what a writer kept beside its temporary (DuckDB's ``.wal``);
those of live processes are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator

from servelab.common.errors import ServelabError
from servelab.common.processes import alive, start_token

# Temporaries from versions before the owner tag (``.NAME.<8 random>.tmp``) count as stale once
# untouched this long: their owner cannot be known.
LEGACY_STALE_S = 3600.0

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _start_token(pid: int) -> str:
    """The process's start time as it appears in temporaries' names ("0": unknown)."""
    return start_token(pid) or "0"


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"h{_host_tag()}p{pid}s{_start_token(pid)}"


# What follows ".<dest name>." in a temporary's name. Compiled once: a pattern per destination name
# cost ~1 ms a write (every name is new to re's cache), a search's whole per-trial write is ~7 ms.
_TEMP_SUFFIX = re.compile(
    r"(?:h(?P<host>[0-9a-f]{8})p(?P<pid>\d+)s(?P<token>\d+)\.[A-Za-z0-9_]+(?P<old>\.old)?"
    r"|(?P<legacy>[a-z0-9_]{8}))\.tmp(?:\.wal)?$"  # (.wal: DuckDB's write-ahead log beside a database temporary)
)


def _temp_match(dest_name: str, entry_name: str) -> re.Match | None:
    """The temporary-name match of ``entry_name`` for destination ``dest_name`` (None: not one of its temporaries)."""
    prefix = f".{dest_name}."
    if not entry_name.startswith(prefix):
        return None
    return _TEMP_SUFFIX.match(entry_name, len(prefix))


def _pid_alive(pid: int, token: str) -> bool:
    return alive(pid, None if token == "0" else token)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale_temps(dest: str | os.PathLike) -> list[Path]:
    """Delete the temporaries beside ``dest`` left by dead processes; returns what was removed.

    A renamed-aside old result whose owner died before moving the new one in is moved back onto
    ``dest`` when ``dest`` is missing (so a kill there loses nothing).
    """
    dest = Path(dest)
    parent = dest.parent
    if not parent.is_dir():
        return []
    host = _host_tag()
    removed = []
    candidates = []
    for entry in os.scandir(parent):
        m = _temp_match(dest.name, entry.name)
        if m is None:
            continue
        path = Path(entry.path)
        if m["legacy"]:
            try:
                stale = time.time() - path.lstat().st_mtime > LEGACY_STALE_S
            except FileNotFoundError:
                continue
        else:
            stale = m["host"] == host and not _pid_alive(int(m["pid"]), m["token"])
        if stale:
            candidates.append((bool(m["old"]), path))
    for is_old, path in sorted(candidates, key=lambda c: not c[0]):  # asides first: one may be restored
        if is_old and not os.path.lexists(dest):
            with contextlib.suppress(OSError):
                os.rename(path, dest)
                continue
        _remove(path)
        removed.append(path)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where not supported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.ENOENT):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move directory ``src`` onto ``dest``, replacing what is there; a kill at any point keeps one of them at ``dest``.

    ``src`` ends up holding the old result (or gone); the caller deletes it.
    """
    src, dest = Path(src), Path(dest)
    if not os.path.lexists(dest):
        os.replace(src, dest)
        return
    if dest.is_dir() and not dest.is_symlink() and _exchange(src, dest):
        return
    import secrets  # (only this fallback, without renameat2's exchange, needs a random name)

    aside = dest.parent / f".{dest.name}.{owner_tag()}.{secrets.token_hex(4)}.old.tmp"
    os.rename(dest, aside)
    os.rename(src, dest)
    _remove(aside)


def cannot_write(dest: str | os.PathLike, err: OSError) -> ServelabError:
    """A one-line error for an output that cannot be written: names ``dest`` and why, never the temporary."""
    dest = Path(dest)
    for folder in dest.parents:
        if os.path.lexists(folder):
            if not folder.is_dir():
                return ServelabError(f"{dest}: cannot write it: {folder} is a file, not a folder")
            break
    if dest.is_dir() and not isinstance(err, PermissionError):
        return ServelabError(f"{dest}: cannot write it: a folder is in the way")
    why = err.strerror or type(err).__name__
    return ServelabError(f"{dest}: cannot write it ({why}); choose another output path")


@contextlib.contextmanager
def _writing(dest: Path, tmp: Path | None = None) -> Iterator[None]:
    """Turn an OSError about the output (its folder, its temporary, the final rename) into ``cannot_write``.

    Inside the caller's block (``tmp`` given) only an OSError naming the temporary or ``dest`` is
    converted; one about another file (an input the block reads) or naming none passes through.
    """
    try:
        yield
    except OSError as err:
        names = [str(n) for n in (err.filename, getattr(err, "filename2", None)) if n]
        ours = tmp is None or any(n.startswith(str(tmp)) or n == str(dest) for n in names)
        if not ours:
            raise
        raise cannot_write(dest, err) from err


def _prepare(dest: Path, make: Callable[..., object]) -> Path:
    with _writing(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(dest)
        made = make(prefix=f".{dest.name}.{owner_tag()}.", suffix=".tmp", dir=dest.parent)
    if isinstance(made, tuple):  # mkstemp: (fd, path)
        os.close(made[0])
        made = made[1]
    return Path(made)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; rename it onto ``dest`` only if the block succeeds.

    An output that cannot be written (its folder is a file, unwritable, or not a real folder such as
    ``/proc``) raises a one-line ``ServelabError`` naming ``dest``.
    """
    dest = Path(dest)
    tmp_path = _prepare(dest, tempfile.mkstemp)
    try:
        with _writing(dest, tmp_path):
            yield tmp_path
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; results are ordinary files
            os.replace(tmp_path, dest)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``dest``; it replaces ``dest`` only if the block succeeds."""
    dest = Path(dest)
    tmp = _prepare(dest, tempfile.mkdtemp)
    try:
        with _writing(dest, tmp):
            yield tmp
            os.chmod(tmp, 0o777 & ~_umask())
            replace_dir(tmp, dest)  # tmp now holds the old result, if there was one
    finally:
        if os.path.lexists(tmp):
            _remove(tmp)
