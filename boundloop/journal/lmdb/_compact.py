"""Compaction: a crash-safe rewrite of a journal into a fresh file."""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from boundloop.errors import (
    JournalCorrupt,
    JournalUnavailable,
)
from boundloop.journal import chain
from boundloop.journal.base import OwnerRecord
from boundloop.journal.lmdb._errors import _guarded
from boundloop.journal.lmdb._pages import check_data_file
from boundloop.journal.lmdb._records import _owner_dec
from boundloop.journal.lmdb._store import _opened, _opened_lock

#: Test hook: seconds to sleep before each step of ``compact`` (so a test can kill it there).
COMPACT_PAUSE_ENV = "BOUNDLOOP_TEST_COMPACT_PAUSE"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pause(step: str) -> None:
    """The test hook: with ``$BOUNDLOOP_TEST_COMPACT_PAUSE`` set, say which step comes next
    (on stderr) and sleep that many seconds first."""
    delay = os.environ.get(COMPACT_PAUSE_ENV)
    if delay:
        print(f"compact: {step}", file=sys.stderr, flush=True)
        time.sleep(float(delay))


#: Entries copied per write transaction of a compaction.
_COPY_CHUNK = 100_000


def _tables(env: Any, txn: Any) -> dict[bytes, Any]:
    """Every named table of ``env`` (the keys of its main table), by name."""
    return {name: env.open_db(name, txn=txn, create=False) for name, _ in txn.cursor()}


def _table_counts(env: Any) -> dict[bytes, int]:
    with env.begin() as txn:
        return {name: int(txn.stat(db)["entries"]) for name, db in _tables(env, txn).items()}


def _rewrite(env: Any, into: Path,
             progress: Callable[[int, int | None], None] | None = None,
             total: int | None = None) -> None:
    """Write every table of ``env`` into a new environment in directory ``into``, in key
    order with MDB_APPEND, so its pages are full: a compacting ``env.copy`` only leaves the
    free pages out, and keeps the half-empty pages that deleting most runs leaves behind."""
    size = (Path(env.path()) / "data.mdb").stat().st_size
    new = lmdb.open(str(into), map_size=max(2 * size, 1 << 26), max_dbs=64, sync=False,
                    lock=False, subdir=True, mode=0o600)
    copied = 0
    try:
        with env.begin() as src:
            for name, db in _tables(env, src).items():
                flags = db.flags(src)
                with new.begin(write=True) as txn:
                    out = new.open_db(name, txn=txn, **flags)
                items = src.cursor(db=db).iternext()
                while True:
                    chunk = list(itertools.islice(items, _COPY_CHUNK))
                    if not chunk:
                        break
                    with new.begin(write=True) as txn:
                        txn.cursor(db=out).putmulti(chunk, dupdata=flags["dupsort"],
                                                    append=not flags["dupsort"])
                    copied += len(chunk)
                    if progress is not None:
                        progress(copied, total)
        new.sync(True)
    finally:
        new.close()


def compact(path: str | os.PathLike[str],
            alive: Callable[[OwnerRecord], bool], *,
            progress: Callable[[int, int | None], None] | None = None) -> tuple[int, int]:
    """Rewrite the journal in ``path`` without its free pages and return the size of its
    ``data.mdb`` before and after (LMDB files never shrink by themselves).

    A compacting copy (``env.copy(..., compact=True)``) is written into a new directory next
    to the journal (same filesystem), checked, fsynced, and swapped in with ``os.replace``: a
    crash at any moment leaves either the old file or the whole new one, never a mix. A
    leftover copy of a crashed compaction is removed by the next one.

    It runs only when nothing else uses the journal: it takes ``lock.mdb``'s flock
    exclusively, which every open journal holds shared (a runner, a reader such as
    ``boundloop show``; LMDB's reader table would not do, since py-lmdb frees a reader slot at
    the end of each read transaction, so idle openers do not show there), and it refuses while
    a registered runner is ``alive`` (for runners on other machines, where a lock says
    nothing). ``progress``, if given, is told ``(records copied, records)`` as it goes.

    Raises:
        JournalUnavailable: another process has the journal open, a live runner owns it,
            or it is open in this process.
        JournalCorrupt: the journal is damaged (it is not copied).
    """
    where = Path(path)
    data, lock = where / "data.mdb", where / "lock.mdb"
    if not data.exists():
        raise JournalUnavailable(f"{where} holds no journal (no data.mdb); pass the right "
                                 "--journal or set $BOUNDLOOP_JOURNAL")
    check_data_file(data)
    with _opened_lock:
        other = _opened.get(os.path.realpath(where))
        if other is not None and not other.closed and other.pid == os.getpid():
            raise JournalUnavailable(f"the journal at {where} is open in this process; close "
                                     "it before compacting")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    tmp: Path | None = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalUnavailable(
                f"other processes have the journal at {where} open (runners, or commands such "
                "as `boundloop show`); stop them, then compact") from None
        for stale in where.parent.glob(f".{where.name}.compact-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a compaction that crashed
        before = data.stat().st_size
        try:
            env = lmdb.open(str(where), max_dbs=64, readonly=True, subdir=True, create=False)
        except lmdb.Error as exc:
            raise JournalUnavailable(f"cannot open the journal at {where}: {exc}") from None
        try:
            with _guarded("the runner index"), env.begin() as txn:
                owners = txn.get(b"owners")
                records = []
                if owners is not None:
                    db = env.open_db(b"owners", txn=txn, create=False)
                    for key, value in txn.cursor(db=db):
                        body = chain.verified(value)
                        if body is None:
                            raise JournalCorrupt(f"the journal is damaged: the record of "
                                                 f"runner {key.decode(errors='replace')!r} "
                                                 "does not match its checksum")
                        records.append(_owner_dec.decode(body))
            live = [r for r in records if alive(r)]
            if live:
                names = ", ".join(f"{r.owner} (pid {r.pid} on {r.host})" for r in live)
                raise JournalUnavailable(f"the journal at {where} is in use by live runner(s) "
                                         f"{names}; stop them (or wait for their lease to "
                                         "run out), then compact")
            counts = _table_counts(env)
            tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}.compact-", dir=where.parent))
            _pause("copy")
            with _guarded():
                _rewrite(env, tmp, progress, sum(counts.values()))
        finally:
            env.close()
        new = tmp / "data.mdb"
        nfd = os.open(new, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fchmod(nfd, 0o600)
            os.fsync(nfd)
        finally:
            os.close(nfd)
        _pause("check")
        check_data_file(new)
        copy = lmdb.open(str(tmp), max_dbs=64, readonly=True, lock=False, subdir=True,
                         create=False)
        try:
            if _table_counts(copy) != counts:
                raise JournalUnavailable(f"the compacted copy of {where} does not hold what "
                                         "the journal holds; nothing was changed")
        finally:
            copy.close()
        _fsync_path(tmp)
        _pause("swap")
        os.replace(new, data)
        _fsync_path(where)
        _pause("done")
        return before, data.stat().st_size
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)  # releases the flock (no environment of this process is open on it)
