"""The LMDB journal: opening the environment, its tables, format and lock file, the key."""

from __future__ import annotations

import fcntl
import os
import queue
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb

from boundloop import events as ev
from boundloop import keys
from boundloop.errors import (
    ConfigError,
    JournalCorrupt,
    JournalError,
    JournalUnavailable,
)
from boundloop.journal import chain
from boundloop.journal._core import KeyBinding, format_bytes, stamp_wanted
from boundloop.journal.base import Chained, Done, Fence, Submission
from boundloop.journal.lmdb import _lock
from boundloop.journal.lmdb._errors import (
    _DAMAGE,
    _bad_file,
    _make_private_dirs,
)
from boundloop.journal.lmdb._lock import (
    _IN_USE_BASE,
    _IN_USE_SPAN,
    _Gate,
    _WriteLock,
)
from boundloop.journal.lmdb._pages import (
    _P_INVALID,
    check_data_file,
    check_pages,
)
from boundloop.journal.lmdb._reads import _Reads
from boundloop.journal.lmdb._records import (
    _FORMAT_KEY,
    _TABLES,
    OWN_FILES,
    _Request,
)
from boundloop.journal.lmdb._writer import _Writes


class LmdbJournal(_Writes, _Reads, KeyBinding, Chained):
    """A journal in an LMDB environment in directory ``path`` (created ``0700`` if absent).

    Args:
        path: the journal directory.
        sync: fsync every commit (the default; False trades durability for speed).
        compress: store events compressed (``codec.pack``: about half the pages of a plain
            journal; the journal becomes record format 3, which versions of boundloop
            without ``compress`` refuse, and its files no longer hold each event's msgpack
            bytes as they are).
        map_size: the initial map size in bytes; it doubles when the data nears it.
        max_map_size: the map never grows past this; a full journal fails closed.
        max_readers: concurrent read transactions across every process sharing the journal.
        create: create the directory when it does not exist.
        readonly: never write, create or chmod anything, never take the write lock.
        walk: check every B-tree page when opening (``walk_pages``: about 20 µs a page),
            so that a damaged page is JournalCorrupt, never a crash of the process; only
            a reader that reads in a process of its own (``boundloop verify``) skips it.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True,
                 compress: bool = False, map_size: int = 1 << 30, max_map_size: int = 1 << 40,
                 max_readers: int = 1024, create: bool = True, readonly: bool = False,
                 walk: bool = True) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.compress = compress
        self._format = chain.COMPRESSED if compress else chain.FORMAT
        self._walk = walk
        data = self.path / "data.mdb"
        if not self.path.exists():
            if not create or readonly:
                raise JournalUnavailable(f"no journal at {self.path}; run a command that "
                                         "creates one, or pass the right --journal")
            # The directory and every parent made on the way are private, whatever the umask.
            _make_private_dirs(self.path)
        elif not self.path.is_dir():
            raise ConfigError(f"{self.path} is not a directory; a journal is a directory")
        # Before LMDB maps it: a file shorter than its own metadata says would be a SIGBUS.
        check_data_file(data)
        if not data.exists():
            if not create or readonly:
                raise JournalUnavailable(f"{self.path} holds no journal (no data.mdb); pass "
                                         "the right --journal or set $BOUNDLOOP_JOURNAL")
            # A new journal: its directory becomes private, whatever the umask. An existing
            # journal's directory is left as its owner set it.
            os.chmod(self.path, 0o700)
        self._key: bytes | None = None  # resolved on first use (secret_key, bind_key)
        self.pid = os.getpid()
        self._closed = False
        self._real = os.path.realpath(self.path)
        if self._real in _stuck:
            self._closed = True
            raise JournalUnavailable(
                f"this process was forked while the journal at {self.path} was busy in its "
                f"parent (a transaction stayed open for {_lock.FORK_WAIT_S:g} s), so LMDB cannot "
                "open it again here: start the process with the 'spawn' or 'forkserver' "
                "method, or fork while the parent's journal is idle")
        with _opened_lock:
            other = _opened.get(self._real)
            if other is not None and not other.closed and other.pid == os.getpid():
                raise JournalUnavailable(
                    f"the journal at {self.path} is already open in this process (LMDB allows "
                    "one environment per process): use that one, e.g. runner.journal, or "
                    "boundloop.journal.lmdb.acquire()")
            _opened[self._real] = self
        self._lock_fd = -1
        self._data_fd = -1
        self._lock_id: tuple[int, int] | None = None
        self._lock_lost = ""
        try:
            if readonly:
                # Never a write transaction, never a new file: reader slots in a lock file
                # that already exists are all a reader touches (none without one).
                self._env = lmdb.open(str(self.path), max_dbs=8, readonly=True,
                                      lock=(self.path / "lock.mdb").exists(),
                                      max_readers=max_readers, subdir=True, create=False)
            else:
                self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=8,
                                      sync=sync, max_readers=max_readers, mode=0o600,
                                      subdir=True)
            self._hold_lock_file()
            self._write_lock = _WriteLock(self._lock_fd, self.path)
            if readonly:
                self._open_dbs()
            else:  # opening the tables may write (a new journal's, its format)
                with self._write_lock.held(time.monotonic() + _lock.LOCK_WAIT_S):
                    self._open_dbs()
        except BaseException as exc:
            with _opened_lock:
                if _opened.get(self._real) is self:
                    del _opened[self._real]
            self._closed = True
            if getattr(self, "_env", None) is not None:
                self._env.close()
            self._release_lock_file()
            if isinstance(exc, JournalError):
                raise
            if isinstance(exc, lmdb.Error | OSError):
                what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                if isinstance(exc, lmdb.InvalidError):  # its first page, the header, is gone
                    raise _bad_file(self.path / "data.mdb",
                                    f"is not an LMDB file any more ({what})") from None
                cls = JournalCorrupt if isinstance(exc, _DAMAGE) else JournalUnavailable
                raise cls(f"cannot open the journal at {self.path}: {what}") from None
            raise
        if not readonly:
            for name in OWN_FILES:
                if (self.path / name).exists():
                    os.chmod(self.path / name, 0o600)
        self.sync = sync
        self._max_map_size = max(max_map_size, map_size)
        self._gate = _Gate()
        self._commits = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        # What submit_many queued for whichever thread commits next (see _lead).
        self._direct: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._commit_lock = threading.Lock()  # one commit at a time, writer or caller
        self._wait_limits: dict[str, float] = {}
        #: True from a leader's handing a batch to the writer (the lock was busy) until the
        #: writer has nothing handed over left (under the commit lock, both)
        self._contended = False
        self._writer = threading.Thread(target=self._write_loop, name="boundloop-journal",
                                        daemon=True)
        if not readonly:
            self._writer.start()

    def _open_dbs(self) -> None:
        for attempt in range(3):
            try:
                if not self.readonly:
                    # Readers left behind by processes that died would pin old pages.
                    self._env.reader_check()
                if self._walk:
                    self.walk_pages()
                self._check_roots()
                self._check_tables()
                dbs = [self._env.open_db(name, create=not self.readonly) for name in _TABLES]
                self._events, self._runs, self._order, self._open, self._owners, \
                    self._meta = dbs
                self._check_format()
                break
            except lmdb.MapResizedError:
                # Another process grew the map meanwhile: adopt its size and try again.
                if attempt == 2:
                    raise
                self._env.set_mapsize(0)
            except lmdb.NotFoundError:
                raise JournalCorrupt(f"{self.path} is an LMDB environment but not a boundloop "
                                     "journal (its tables are missing)") from None

    def walk_pages(self) -> None:
        """``check_pages`` on this journal's file (opening does it, unless ``walk=False``):
        every B-tree page is checked before anything reads through LMDB's map.

        Raises:
            JournalCorrupt: a page is damaged.
        """
        # Under the gate once the journal is open: a fork waits for the walk (_before_fork).
        gate: _Gate | None = getattr(self, "_gate", None)
        if gate is not None:
            gate.enter_shared()
        try:
            with self._env.begin():  # a reader: no writer reuses the pages walked meanwhile
                check_pages(self.path / "data.mdb")
        finally:
            if gate is not None:
                gate.leave_shared()

    def _check_tables(self) -> None:
        """An existing journal's table names must be boundloop's: a damaged name would make
        a writer create an empty table in its place and go on as if its runs never were."""
        with self._env.begin() as txn:
            present = {bytes(name) for name, _ in txn.cursor()}
        if not present:
            return  # a new journal: its tables are made next
        unknown = present - set(_TABLES)
        missing = {b"events", b"runs", b"meta"} - present
        if unknown or missing:
            what = ", ".join(sorted(n.decode(errors="replace") for n in unknown | missing))
            raise JournalCorrupt(f"the journal at {self.path} is damaged: its table names are "
                                 f"not boundloop's ({what}); restore it from a backup")

    def _check_roots(self) -> None:
        """Each table's B-tree root must lie inside the file LMDB says it has: a damaged
        table record would otherwise send LMDB to read outside the file."""
        data = self.path / "data.mdb"
        with self._env.begin() as txn:
            # Both read after the snapshot is taken (they only grow): read before it, a
            # commit in between would make the snapshot's roots look past the end.
            last = self._env.info()["last_pgno"]
            pages = data.stat().st_size // self._env.stat()["psize"]
            for name in _TABLES:
                raw = txn.get(name)
                if raw is None:
                    continue
                root = int.from_bytes(raw[40:48], "little") if len(raw) == 48 else -1
                if root < 0 or (root != _P_INVALID and root > last):
                    raise _bad_file(data, f"has a damaged record of its {name.decode()!r} "
                                          "table")
                if root != _P_INVALID and root >= pages:
                    raise _bad_file(data, f"is {pages} pages long, but its {name.decode()!r} "
                                          f"table starts at page {root}")

    def _check_format(self) -> None:
        """The journal's record format must be one this version reads (``chain.READS``); a
        new journal is stamped with its format (``chain.COMPRESSED`` when this journal
        compresses, else ``chain.FORMAT``), and a format 2 one opened to compress becomes 3.

        A journal written before the hash chain (format 1: no ``format`` key, records
        without links) is refused, not read as legacy: its records cannot be checked, and
        reading them unchecked is what the chain exists to prevent."""
        with self._env.begin() as txn:
            raw = txn.get(_FORMAT_KEY, db=self._meta)
            empty = not txn.stat(self._events)["entries"] and not txn.stat(self._runs)["entries"]
        if raw is None and empty and not self.readonly:
            self._check_lock()
            with self._env.begin(write=True) as txn:
                raw = txn.get(_FORMAT_KEY, db=self._meta)
                if raw is None and not txn.stat(self._events)["entries"]:
                    txn.put(_FORMAT_KEY, format_bytes(self._format), db=self._meta)
                    return
        if raw is None:
            if empty:
                return  # a read-only look at a journal nothing was ever written to
            raise JournalUnavailable(
                f"the journal at {self.path} was written by an older boundloop (record format "
                "1, without the hash chain this version checks on every read), so this "
                "version cannot read it: read or export its runs with the version that wrote "
                "it (`boundloop export RUN_ID`), then move the directory aside and start a new "
                "journal")
        if len(raw) != 4:
            raise _bad_file(self.path / "data.mdb", "has a damaged format record")
        if stamp_wanted(int.from_bytes(raw, "big"), f"the journal at {self.path}",
                        self._format, self.readonly):
            self._check_lock()
            with self._env.begin(write=True) as txn:
                txn.put(_FORMAT_KEY, format_bytes(self._format), db=self._meta)

    def _hold_lock_file(self) -> None:
        """Hold a shared ``flock`` on ``lock.mdb`` while open, and note which file it is.

        ``boundloop compact`` takes it exclusively, so it runs only when no other process
        (runner or command) has the journal open. flock is independent of the fcntl locks
        LMDB takes on the same file; the descriptor stays open until the environment is
        closed, since closing any descriptor of the file would drop this process's fcntl
        locks on it."""
        lock = self.path / "lock.mdb"
        self._lock_file = str(lock)  # a str: _check_lock stats it before every write
        if self.readonly and not self._env.flags()["lock"]:
            return  # no lock file: nothing to hold, and a reader never writes
        # Read-write for a writer: its write lock (_WriteLock) is a write lock on this file.
        self._lock_fd = os.open(lock, (os.O_RDONLY if self.readonly else os.O_RDWR)
                                | os.O_CLOEXEC)
        st = os.fstat(self._lock_fd)
        self._lock_id = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalUnavailable(f"the journal at {self.path} is being compacted "
                                     "(`boundloop compact`); retry when that has finished") \
                from None
        if not self.readonly:
            self._claim_data_file(st.st_ino)

    def _claim_data_file(self, lock_ino: int) -> None:
        """Refuse a journal that a live process uses through another ``lock.mdb``.

        A lock file removed or replaced while in use is not seen by whoever opens the
        journal next: LMDB makes a new one, and that writer and the old one would no longer
        exclude each other (SPEC 6). So every writer takes a read lock on its lock file's
        byte of data.mdb (an OFD lock: per open file, dropped by the kernel when the
        process dies), then looks for a lock on any other byte: one there is a live writer
        whose lock file is gone or replaced, and this journal is refused before it writes
        anything. Two writers racing to open with different lock files both lock before
        they look, so at least one of them sees the other."""
        self._data_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
        mine = _IN_USE_BASE + lock_ino % _IN_USE_SPAN

        def lock(kind: int, start: int, length: int, cmd: int) -> int:
            raw = fcntl.fcntl(self._data_fd, cmd,
                              struct.pack("hhqqi4x", kind, os.SEEK_SET, start, length, 0))
            return int(struct.unpack("hhqqi4x", raw)[0])

        lock(fcntl.F_RDLCK, mine, 1, fcntl.F_OFD_SETLK)
        end = _IN_USE_BASE + _IN_USE_SPAN
        for start, stop in ((_IN_USE_BASE, mine), (mine + 1, end)):
            # A write lock is what is asked about: any other process's read lock conflicts
            # (a length of 0 would mean "to the end of the file and beyond": skipped).
            if stop > start and lock(fcntl.F_WRLCK, start, stop - start,
                                     fcntl.F_OFD_GETLK) != fcntl.F_UNLCK:
                raise JournalUnavailable(
                    f"the journal at {self.path} is in use by another process whose lock.mdb "
                    "was removed or replaced while it was open; this process and that one "
                    "would write without excluding each other, so nothing is written here: "
                    "stop every runner on this journal, then reopen it")

    def _release_lock_file(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._data_fd >= 0:
            os.close(self._data_fd)  # and with it the read lock of _claim_data_file
            self._data_fd = -1

    def _check_lock(self) -> None:
        """Before a write transaction: ``lock.mdb`` must still be the file this environment
        opened. Once it was removed or replaced, writers no longer exclude each other, so
        this journal refuses every later write (it fails closed)."""
        if not self._lock_lost:
            try:
                st = os.stat(self._lock_file)
                same = (st.st_dev, st.st_ino) == self._lock_id
            except FileNotFoundError:
                same = False
            except OSError:
                same = True  # unreadable directory: nothing says the lock file changed
            if not same:
                self._lock_lost = (
                    f"lock.mdb of the journal at {self.path} was removed or replaced while "
                    "the journal was open; another process may be writing without "
                    "coordination, so nothing more is written here: stop every runner on "
                    "this journal, then reopen it")
        if self._lock_lost:
            raise JournalUnavailable(self._lock_lost)

    # -- the redaction key (KeyBinding; the meta table keeps the journal's id and the
    # key's fingerprint) ------------------------------------------------------------------
    _key_lock = threading.Lock()
    #: A damaged or unreadable meta table leaves a reader with a random key.
    _key_read_errors = (JournalCorrupt, lmdb.Error)

    def _meta_get(self) -> tuple[bytes | None, bytes | None]:
        with self._txn(self._meta) as txn:
            return (txn.get(keys.META_JOURNAL_ID, db=self._meta),
                    txn.get(keys.META_FINGERPRINT, db=self._meta))

    def _meta_add(self, name: bytes, value: bytes) -> tuple[bytes | None, bytes | None, bool]:
        def add(txn: Any) -> tuple[bytes | None, bytes | None, bool]:
            if txn.get(name, db=self._meta) is None:
                txn.put(name, value, db=self._meta)
            return (txn.get(keys.META_JOURNAL_ID, db=self._meta),
                    txn.get(keys.META_FINGERPRINT, db=self._meta),
                    txn.get(b"order", db=self._meta) is not None)

        return self._write(add)  # type: ignore[no-any-return]

    def _key_place(self) -> tuple[Path | None, str]:
        return self.path, str(self.path)

    def _label(self) -> str:
        return f"the journal at {self.path}"

    def _forked(self) -> str:
        return (f"this journal was opened by process {self.pid}, the parent of this forked "
                "process, and an LMDB journal cannot be used across fork(): open it again in "
                "this process (bl.Runner(path), or boundloop.journal.lmdb.acquire(path))")

    def close(self) -> None:
        if os.getpid() != self.pid:
            # The parent's journal, in a forked child: its writer thread and its gate's
            # holders stayed in the parent, and its environment is the parent's (``_forked``
            # closed this copy, or leaves it): nothing here to wait for or to close.
            self._closed = True
            return
        if not self._stop_writer():  # its last commit ends before the environment does
            return
        with self._gate.exclusive():  # and so does every commit and read in flight
            self._env.close()
            self._release_lock_file()  # after the environment: see _hold_lock_file
        self._lead()  # anything submit_many queued meanwhile fails: the journal is closed
        with _opened_lock:
            if _opened.get(self._real) is self:
                del _opened[self._real]

    # -- writing -----------------------------------------------------------------------
    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
               done: Done, fence: Fence | None = None) -> None:
        request = self._prepare(run_id, expected_seq, events, done, fence)
        if request is not None:
            self._enqueue(self._queue, request)

    def submit_many(self, requests: Sequence[Submission]) -> None:
        """Commit ``requests`` in the calling thread, in one transaction with every other
        request waiting for the caller, unless another thread is committing: then that
        thread takes them into its next transaction. ``done`` callbacks run on whichever
        thread committed."""
        if type(self).submit is not LmdbJournal.submit:
            super().submit_many(requests)  # a subclass that sees every append keeps seeing it
            return
        for run_id, expected_seq, events, done, fence in requests:
            request = self._prepare(run_id, expected_seq, events, done, fence)
            if request is not None:
                self._enqueue(self._direct, request)
        self._lead()


#: Every journal open in this process, by real path (LMDB allows one environment each).
_opened: weakref.WeakValueDictionary[str, LmdbJournal] = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()

#: Real paths of journals a forked child could not let go of (busy when it was forked).
_stuck: set[str] = set()
