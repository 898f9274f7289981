"""Fork safety and the process's shared journals (acquire, release)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import lmdb

from boundloop.errors import ConfigError
from boundloop.journal.lmdb import _lock
from boundloop.journal.lmdb._store import LmdbJournal, _opened, _opened_lock, _stuck

#: How long fork() waits for the journals of the forking process to be idle (every
#: transaction in flight ended: a commit waits at most ``LOCK_WAIT_S`` for the write lock).
#: The journals held idle across the fork in progress (``_before_fork``).
_idle: list[LmdbJournal] = []
#: The module's locks ``_before_fork`` took (given back on both sides of the fork).
_taken: list[Any] = []


def _before_fork() -> None:
    """Before fork() without exec: hold every journal of this process idle, so the child can
    close its copy of each LMDB environment and open the journal afresh.

    py-lmdb refuses a second environment on the same files while one is open in a process,
    and closing the copy a child inherited ends every transaction it holds, clearing the
    parent's reader slots in the shared lock file (the parent's snapshots would lose their
    protection from writers): measured with py-lmdb 3.0. So no transaction may be open, nor
    cached (py-lmdb keeps a finished read transaction for reuse; resetting the map size
    drops it), when the process forks. Each gate is held until the fork is done; a journal
    still busy after ``FORK_WAIT_S`` is not held, and the child cannot open it again."""
    until = time.monotonic() + _lock.FORK_WAIT_S
    # No journal half opened by ``acquire`` (its environment open, its gate not made yet).
    if _shared_lock.acquire(timeout=max(until - time.monotonic(), 0.0)):
        _taken.append(_shared_lock)
    pid = os.getpid()
    for journal in list(_opened.values()):
        gate = getattr(journal, "_gate", None)
        if gate is None or journal.closed or journal.pid != pid or not gate.hold(until):
            continue
        try:
            journal._env.set_mapsize(0)  # drops py-lmdb's cached read transaction
        except lmdb.Error:
            gate.let_go()
            continue
        _idle.append(journal)
    if _opened_lock.acquire(timeout=max(until - time.monotonic(), 0.1)):
        _taken.append(_opened_lock)


def _forked_parent() -> None:
    """After fork(), in the parent: the journals serve again."""
    for journal in _idle:
        journal._gate.let_go()
    _idle.clear()
    while _taken:
        _taken.pop().release()


def _forked() -> None:
    """In a child made by fork() without exec: let go of every journal the parent had open,
    so the child may open its own (``acquire``, a Runner); the parent's stay unusable here
    (``_usable``).

    Each journal's lock.mdb descriptor is closed: it shares the parent's open file, and with
    it the parent's write lock and compaction flock, which a child that outlived a killed
    parent would hold (LMDB's own locks are not inherited). The copy of each environment
    held idle by ``_before_fork`` is closed (no transaction of it is open, so this leaves
    the parent's reader slots alone); one that was busy stays open, and opening its journal
    here is refused (``_stuck``)."""
    idle = {id(j) for j in _idle}
    for journal in list(_opened.values()):
        # data.mdb's descriptor holds the in-use lock of ``_claim_data_file``: let it go too.
        for name in ("_lock_fd", "_data_fd"):
            fd = getattr(journal, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(journal, name, -1)
        if id(journal) in idle:
            with contextlib.suppress(lmdb.Error):
                journal._env.close()
        elif not journal.closed:
            _stuck.add(journal._real)
    _idle.clear()
    _opened.clear()
    _shared.clear()
    while _taken:
        _taken.pop().release()
    # Locks another thread of the parent may have held at the fork (no thread of the child
    # holds them): the child starts with its own.
    LmdbJournal._key_lock = threading.Lock()


_shared: dict[str, list[Any]] = {}
_shared_lock = threading.Lock()

os.register_at_fork(before=_before_fork, after_in_parent=_forked_parent,
                    after_in_child=_forked)


def acquire(path: str | os.PathLike[str], *, sync: bool = True,
            compress: bool = False) -> LmdbJournal:
    """The process's journal in ``path``, opened once and shared by every Runner on it
    (LMDB allows one environment per data file per process). ``release`` it when done.

    Raises:
        ConfigError: it is already open here with another ``sync`` or ``compress`` setting.
    """
    key = os.path.realpath(path)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0].closed or entry[0].pid != os.getpid():
            journal = LmdbJournal(path, sync=sync, compress=compress)
            _shared[key] = [journal, 1]
            return journal
        for name, value in (("sync", sync), ("compress", compress)):
            if getattr(entry[0], name) != value:
                raise ConfigError(f"the journal at {path} is already open in this process "
                                  f"with {name}={getattr(entry[0], name)}")
        entry[1] += 1
        return entry[0]  # type: ignore[no-any-return]


def release(journal: LmdbJournal) -> None:
    """Give back a journal from ``acquire``; the last user closes it."""
    with _shared_lock:
        for key, entry in list(_shared.items()):
            if entry[0] is journal:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _shared[key]
                break
    journal.close()


# -- compaction ------------------------------------------------------------------------------
