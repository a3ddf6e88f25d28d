"""A study's Optuna storage: the journal file in its directory (torn records repaired) or an RDB URL
(PostgreSQL, SQLite) with heartbeats, and the study attributes that tie a storage to its spec.

Apart from the study runner (search/study.py) so that reading a study's trials (search/trials.py)
opens its storage without importing the runner.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from servelab.common.errors import ServelabError
from servelab.search.spec import SearchSpec

SPEC_ATTR = "servelab_spec"
HASH_ATTR = "servelab_spec_hash"
SLO_ATTR = "servelab_slo"  # the spec's SLO as [slo] data (SloTable.to_dict): `search best` writes it into best.toml
TRACE_SHA_ATTR = "servelab_trace_sha256"  # the spec's trace file when the study began: a resume must replay the same
LOCK_GRACE_S = 3
HEARTBEAT_S = 20  # RDB storages: workers on other machines are declared dead after 3 missed beats


def journal_storage(path: Path, repair: bool = False):
    """A journal file; its lock is held for milliseconds, so one older than LOCK_GRACE_S was left by a killed worker.

    ``repair`` (for a process that will append): first cut a torn last record, see `repair_journal`.
    """
    from optuna.storages.journal import JournalFileSymlinkLock, JournalStorage

    from servelab.search.journal_file import CachedJournalFileBackend

    lock = JournalFileSymlinkLock(str(path), grace_period=LOCK_GRACE_S)
    if repair:
        repair_journal(Path(path), lock)
    try:
        # no fsync per record (a dozen a trial), one when the worker is done: search/journal_file.py
        return JournalStorage(CachedJournalFileBackend(str(path), lock_obj=lock))
    except ValueError as err:  # (json.JSONDecodeError too) a record broken in the middle of the file
        raise ServelabError(f"{path}: {journal_damage(Path(path)) or err}; it cannot be read as a study journal") from None


def sync_storage(study) -> None:
    """fsync a journal study's file once (its appends skip it: search/journal_file.py); a database needs nothing."""
    from servelab.search.journal_file import CachedJournalFileBackend

    backend = getattr(study._storage, "_backend", None)  # (a database's cache wrapper has one too)
    if isinstance(backend, CachedJournalFileBackend):
        backend.sync()


def batched_writes(study):
    """A context in which a journal study's records are written in one append at its end (search/journal_file.py);
    a database storage writes as it goes."""
    import contextlib

    from servelab.search.journal_file import CachedJournalFileBackend

    backend = getattr(study._storage, "_backend", None)
    return backend.batched() if isinstance(backend, CachedJournalFileBackend) else contextlib.nullcontext()


def repair_journal(path: Path, lock) -> int:
    """Cut a torn last record (a worker killed mid-write) so nothing is appended behind it; returns the bytes cut.

    Optuna's JournalFileBackend skips a last line without its newline when it reads (it may be a write
    in progress), but appends after it, which glues the next record onto the fragment: from then on
    the journal cannot be read. Under the journal's lock no write is in progress (Optuna appends
    holding it), so a torn tail then is a dead writer's and is cut.
    """
    if not path.is_file():
        return 0
    lock.acquire()
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            end = size
            while end > 0:  # back to the last newline, a block at a time
                start = max(0, end - (1 << 16))
                f.seek(start)
                block = f.read(end - start)
                at = block.rfind(b"\n")
                if at >= 0:
                    end = start + at + 1
                    break
                end = start
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
            return size - end
    finally:
        lock.release()


def journal_damage(path: Path) -> str | None:
    """Where a journal is broken: the first record (1-based line) that is not JSON before the last line."""
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError:
        return None
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)
        try:
            json.loads(line)
        except ValueError:
            if not (last and not line.endswith(b"\n")):
                return f"line {number} is not a whole record (a torn write with more appended behind it)"
    return None


def make_storage(spec: SearchSpec, study_dir: Path, url: str | None = None):
    url = url or spec.storage
    if url is None:
        Path(study_dir).mkdir(parents=True, exist_ok=True)
        return journal_storage(Path(study_dir) / "study.journal", repair=True)
    return rdb_storage(url, heartbeat=True)


def sqlalchemy_url(url: str) -> str:
    """``postgresql://`` names SQLAlchemy's psycopg (3) driver; use psycopg2 when only that one is installed."""
    import importlib.util

    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix) and importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2"):
            return "postgresql+psycopg2://" + url[len(prefix):]
    return url


def rdb_storage(url: str, heartbeat: bool = False):
    import optuna

    kwargs = {}
    if heartbeat and not url.startswith("sqlite"):
        kwargs = {"heartbeat_interval": HEARTBEAT_S, "grace_period": 3 * HEARTBEAT_S, "engine_kwargs": {"pool_pre_ping": True}}
    for attempt in range(5):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna
                warnings.simplefilter("ignore")
                return optuna.storages.RDBStorage(sqlalchemy_url(url), **kwargs)
        except Exception as err:  # SQLAlchemy/driver errors: one line for the CLI
            # workers starting together on an empty database race to create its tables: the loser retries
            if "IntegrityError" in type(err).__name__ or "already exists" in str(err):
                if attempt < 4:
                    time.sleep(0.2 * (attempt + 1))
                    continue
            raise ServelabError(f"cannot open storage {redact(url)}: {type(err).__name__}: {err}") from None


def redact(url: str) -> str:
    """The URL without its password (study.json and messages never hold one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


__all__ = ["batched_writes", "HASH_ATTR", "SLO_ATTR", "SPEC_ATTR", "TRACE_SHA_ATTR", "journal_damage", "journal_storage", "make_storage",
           "rdb_storage", "redact", "repair_journal", "sqlalchemy_url", "sync_storage"]
