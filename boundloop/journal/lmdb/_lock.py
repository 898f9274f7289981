"""The journal's own write lock in lock.mdb, the in-use bytes, and the gate that lets one
thread hold the journal idle (a fork, a grow of the map)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from boundloop.errors import JournalUnavailable

#: The longest a write waits for the journal's write lock while another process holds it,
#: unless the run it is for must end sooner (see ``LmdbJournal.wait_limits``).
LOCK_WAIT_S = 10.0
#: How long any write may wait for the lock, whatever its run's deadline: a run past its
#: deadline still records how it ended while another process is merely committing.
LOCK_MIN_WAIT_S = 0.1
#: How often a write waiting for the lock looks at what else waits (and may wait no longer).
LOCK_SLICE_S = 0.05
#: The byte of lock.mdb that boundloop's own write lock is on (LMDB's locks are elsewhere).
_WRITE_LOCK_BYTE = 1 << 40
#: Where, in data.mdb (which LMDB never locks), each writer holds a read lock on the byte
#: ``_IN_USE_BASE + the inode of its lock.mdb``: writers of one lock file share a byte, so a
#: lock on any other byte of the span is a live process whose lock file is not this one.
_IN_USE_BASE = 1 << 61
_IN_USE_SPAN = 1 << 61


class _LockTimeout(JournalUnavailable):
    """The journal's write lock was not free by the time allowed."""


class _WriteLock:
    """One write transaction at a time across every process of a journal, waited for with a
    time limit. LMDB's own writer mutex cannot be waited for with one: a process paused
    (SIGSTOP) or stuck inside a write transaction would hold every other writer for ever,
    past any run's deadline (SPEC 1). So each writer takes this lock first: an OFD lock (per
    open file, dropped by the kernel when its process dies) on a byte of lock.mdb that no LMDB
    lock uses, tried again and again until the time allowed; a mutex does the same between
    this process's threads, which share the open file (an OFD lock does not exclude them)."""

    def __init__(self, fd: int, where: Path) -> None:
        self._fd = fd
        self._where = where
        self._mutex = threading.Lock()

    def _set(self, kind: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK,
                    struct.pack("hhqqi4x", kind, os.SEEK_SET, _WRITE_LOCK_BYTE, 1, 0))

    def acquire(self, until: float) -> None:
        """Take the lock (``until`` a ``time.monotonic()``: give up then); ``release()``
        gives it back.

        Raises:
            _LockTimeout: it was not free by ``until``.
        """
        started = time.monotonic()
        if not self._mutex.acquire(timeout=max(until - started, 0.0)):
            raise self.late(started, "a thread of this process")
        try:
            pause = 50e-6
            while True:
                try:
                    self._set(fcntl.F_WRLCK)
                    return
                except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held
                    left = until - time.monotonic()
                    if left <= 0:
                        raise self.late(started, "another process") from None
                    time.sleep(min(pause, left))
                    # At most 0.5 ms between tries: a busy peer's lock is free only in the
                    # gaps between its commits (a fraction of a millisecond), and polling
                    # every 2 ms missed them for 0.1 s on end (seen in CI); ~2,000 cheap
                    # fcntl calls a second while waiting is the price.
                    pause = min(pause * 2, 5e-4)
        except BaseException:
            self._mutex.release()
            raise

    def release(self) -> None:
        """Give back the lock ``acquire`` took."""
        try:
            self._set(fcntl.F_UNLCK)
        finally:
            self._mutex.release()

    @contextlib.contextmanager
    def held(self, until: float) -> Iterator[None]:
        """``acquire(until)`` for the ``with`` body."""
        self.acquire(until)
        try:
            yield
        finally:
            self.release()

    def late(self, started: float, who: str) -> _LockTimeout:
        """The error of a write that waited for the lock since ``started`` in vain."""
        return _LockTimeout(
            f"{who} held the write lock of the journal at {self._where} for "
            f"{time.monotonic() - started:.1f} s (a paused or stuck runner or command?); "
            "this write was not made (fail closed): find and resume or stop that process")


class _Gate:
    """Many holders share it; one may hold it alone (to resize the map)."""

    def __init__(self) -> None:
        # A plain lock under the condition: the shared side (every transaction) only takes
        # the lock, and notifies only when a resize waits for it (measured: ~30 Python
        # calls of a W1 round less than a Condition taken and notified each time).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False

    def enter_shared(self) -> None:
        """Hold the gate with others (``leave_shared()`` to let go)."""
        with self._lock:
            if self._exclusive:
                self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1

    def leave_shared(self) -> None:
        """Let go of what ``enter_shared`` held."""
        with self._lock:
            self._shared -= 1
            if self._exclusive and self._shared == 0:
                self._cond.notify_all()

    def hold(self, until: float) -> bool:
        """Hold the gate alone until ``let_go()``, waiting for its holders until ``until`` (a
        ``time.monotonic()``); False, holding nothing, when they were not all out by then."""
        with self._cond:
            if self._cond.wait_for(lambda: not self._exclusive,
                                   max(until - time.monotonic(), 0.0)):
                self._exclusive = True
                if self._cond.wait_for(lambda: self._shared == 0,
                                       max(until - time.monotonic(), 0.0)):
                    return True
                self._exclusive = False
                self._cond.notify_all()
            return False

    def let_go(self) -> None:
        """Let go of what ``hold`` held."""
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            self._cond.wait_for(lambda: self._shared == 0)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()




#: How long fork() waits for the journals of the forking process to be idle (every
#: transaction in flight ended: a commit waits at most ``LOCK_WAIT_S`` for the write lock).
FORK_WAIT_S = LOCK_WAIT_S + 2.0
