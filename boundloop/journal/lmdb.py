"""The LMDB journal: events under (run id, dense sequence), indexes, group commit.

One writer thread owns every write transaction. Appends queued while it commits are
batched into its next transaction, so concurrent runs share one fsync (group commit).
Readers use their own read transactions from any thread.

Integrity (SPEC 6). Tables: ``events`` (key ``run id || NUL || seq`` as a big-endian u64,
value ``link || stored event``, its msgpack bytes or their compressed form: see
``boundloop.journal.chain`` and ``codec``), ``runs`` (a run's index
entry: its RunInfo and the head of its chain, behind a checksum), ``order``, ``open``,
``owners`` (checksummed too) and ``meta`` (``format``: the record format, 2, or 3 once a
writer with ``compress=True`` opened it). Every read
checks a run's sequence, chain and head before returning anything, and raises
``JournalCorrupt`` (a ``chain.ChainError`` naming the run and seq) on any mismatch; no LMDB or
msgspec error escapes raw. A journal of format 1 (before the chain) is refused with what to
do, not read unchecked. Before LMDB maps ``data.mdb``, the file is checked against LMDB's own
meta pages (``check_data_file``), so a truncated file is an error, never a SIGBUS; LMDB has
no checksums of its own B-tree pages, though, so damage inside them can still crash it
(``ops.verify_journal`` reads in a child process for that reason). Before each write
transaction, ``lock.mdb`` must still be the file the environment opened: once it was removed
or replaced, this journal writes nothing more (writers would no longer exclude each other).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import queue
import secrets
import shutil
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import lmdb
import msgspec

from boundloop import events as ev
from boundloop import keys
from boundloop.errors import (
    ConfigError,
    JournalCorrupt,
    JournalError,
    JournalUnavailable,
    LeaseLost,
    SequenceConflict,
    UnknownRun,
)
from boundloop.journal import chain, codec
from boundloop.journal.base import (
    Done,
    Fence,
    Journal,
    OwnerRecord,
    RunInfo,
    Submission,
    about_to_sync,
    answer,
    batches,
    check_run_id,
    drain,
    unforced_claim,
    valid_run_id,
)
from boundloop.owners import owner_alive

_SEP = b"\x00"


class _Index(RunInfo):
    """A run's index entry as stored: its RunInfo and the head of its hash chain."""

    #: The link of the run's last record (``chain.seed(run_id)`` before the first).
    head: bytes = b""


_info_enc = msgspec.msgpack.Encoder()
_info_dec = msgspec.msgpack.Decoder(_Index)
_owner_dec = msgspec.msgpack.Decoder(OwnerRecord)
#: Meta key of the record format (``chain.FORMAT``), a big-endian u32.
_FORMAT_KEY = b"format"
_TABLES = (b"events", b"runs", b"order", b"open", b"owners", b"meta")

# -- LMDB's own metadata (lmdb.h/mdb.c 0.9, 64-bit little-endian): read before mapping ------
_MDB_MAGIC = 0xBEEFC0DE
_P_INVALID = (1 << 64) - 1
#: After the 16-byte page header: mm_magic u32, mm_version u32, mm_address, mm_mapsize, then
#: two MDB_db of 48 bytes (md_pad u32 (the page size, in the first), md_flags u16, md_depth
#: u16, four counters, md_root), then mm_last_pg and mm_txnid.
_META = struct.Struct("<16xII8x8xI2x2x32xQ4x2x2x32xQQQ")
_META_SIZE = _META.size


#: LMDB errors that mean the file is damaged (the others: it cannot be used right now).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadChecksumError)


def _lmdb_error(exc: lmdb.Error) -> JournalError:
    """What an LMDB error escaping a journal operation is to the caller."""
    if isinstance(exc, (*_DAMAGE, lmdb.InvalidError, lmdb.BadValsizeError)):
        return JournalCorrupt(f"the journal is damaged: LMDB reports {type(exc).__name__}: "
                              f"{exc}; restore it from a backup (`boundloop verify` lists "
                              "damaged runs)")
    if isinstance(exc, lmdb.MapFullError):
        return JournalUnavailable("the journal is full; prune finished runs (`boundloop "
                                  "prune`) or open it with a larger map_size")
    return JournalUnavailable(f"journal error: LMDB reports {type(exc).__name__}: {exc}; "
                              "close and reopen the journal")


@contextlib.contextmanager
def _guarded(what: str = "") -> Iterator[None]:
    """Map what can escape a journal operation on damaged or unusable storage to the
    journal's own errors: LMDB errors, and index entries that do not decode."""
    try:
        yield
    except JournalError:
        raise
    except lmdb.Error as exc:
        raise _lmdb_error(exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        where = f" ({what})" if what else ""
        raise JournalCorrupt(f"the journal is damaged{where}: an index entry does not decode "
                             f"({exc}); restore it from a backup (`boundloop verify` lists "
                             "damaged runs)") from None


def _make_private_dirs(path: Path) -> None:
    """Make ``path`` and each missing parent, each ``0700`` whatever the umask."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)
    os.chmod(path, 0o700)


def _bad_file(data: Path, what: str) -> JournalCorrupt:
    return JournalCorrupt(f"{data} {what} (truncated, damaged, or an incomplete copy?); "
                          "restore the journal from a backup, or move the directory aside "
                          "and start a new journal")


def check_data_file(data: Path) -> int | None:
    """Check ``data.mdb`` against LMDB's own metadata before anything maps it, so a short file
    is an error instead of a SIGBUS; return the page size (None when the file does not carry
    LMDB's magic at all: LMDB itself then refuses it without mapping anything).

    A failed check is made again twice, 10 ms apart, before it is believed: a meta page being
    written by another process's commit at that moment can be read torn.

    Both meta pages (at offset 0 and at the page size) are read with ``pread``; the one with
    the larger txnid is LMDB's current state, and the file must hold its last page
    (``(mm_last_pg + 1) * page size`` bytes) and both its B-tree roots.

    Raises:
        JournalCorrupt: the file is empty, shorter than its metadata says, or its meta
            pages are damaged.
        JournalUnavailable: the file cannot be read.
    """
    for attempt in range(3):
        try:
            return _check_data_file(data)
        except JournalCorrupt:
            if attempt == 2:
                raise
            time.sleep(0.01)
    raise AssertionError("unreachable")


def _check_data_file(data: Path) -> int | None:
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalUnavailable(f"cannot read {data}: {exc.strerror or exc}") from None
    try:
        return _check_open_data_file(data, fd)
    except OSError as exc:
        raise JournalUnavailable(f"cannot read {data}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _check_open_data_file(data: Path, fd: int) -> int | None:
    size = os.fstat(fd).st_size
    if size == 0:
        raise JournalCorrupt(f"{data} is empty: this is not a journal (a damaged or "
                             "truncated copy?); restore it from a backup or point "
                             "--journal at another directory")
    first = os.pread(fd, _META_SIZE, 0)
    if len(first) < 20 or int.from_bytes(first[16:20], "little") != _MDB_MAGIC:
        return None
    if len(first) < _META_SIZE:
        raise _bad_file(data, f"is {size} bytes, shorter than LMDB's meta page")
    psize = _META.unpack(first)[2]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise _bad_file(data, f"has a damaged meta page (page size {psize})")
    second = os.pread(fd, _META_SIZE, psize)
    if len(second) < _META_SIZE:
        raise _bad_file(data, f"is {size} bytes and ends inside its second meta page")
    metas = [_META.unpack(first), _META.unpack(second)]
    if any(meta[0] != _MDB_MAGIC for meta in metas):
        raise _bad_file(data, "has a damaged meta page (no LMDB magic)")
    # LMDB writes transaction T's meta into page T % 2, so the pages hold consecutive txnids
    # of their own parity (both 0 before the first commit): else a damaged txnid would make
    # LMDB take an older snapshot for the current one, silently.
    t0, t1 = metas[0][6], metas[1][6]
    if not (t0 == t1 == 0 or (t0 % 2 == 0 and t1 % 2 == 1 and abs(t0 - t1) == 1)):
        raise _bad_file(data, f"has damaged meta pages (transaction ids {t0} and {t1})")
    # LMDB's choice: the larger txnid, the first page on a tie.
    current = metas[1] if metas[1][6] > metas[0][6] else metas[0]
    _, _, _, free_root, main_root, last_pg, _ = current
    if last_pg >= (1 << 48):
        raise _bad_file(data, f"has a damaged meta page (last page {last_pg})")
    pages = size // psize
    short = _bad_file(data, f"is {size} bytes, but its own metadata says the journal needs "
                            f"{(last_pg + 1) * psize}")
    for root in (free_root, main_root):
        if root != _P_INVALID and root > last_pg:
            raise _bad_file(data, f"has a damaged meta page (a B-tree root at page {root}, "
                                  f"past its last page {last_pg})")
        if root != _P_INVALID and root >= pages:
            raise short
    if pages <= last_pg:
        # Legitimate only when every page past the end is free: LMDB does not write pages a
        # transaction allocated and freed again (its "loose" pages), even at the end.
        free = _free_pages(fd, psize, free_root, pages)
        if free is None or any(pg not in free for pg in range(pages, last_pg + 1)):
            raise short
    return int(psize)


_F_BIGDATA = 0x01
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04


def _free_pages(fd: int, psize: int, root: int, pages: int) -> set[int] | None:
    """The page numbers LMDB's free table lists (read with pread, never mapped), or None when
    that table cannot be read within the file's ``pages`` pages."""
    free: set[int] = set()
    todo, seen = [root], set[int]()
    while todo:
        pgno = todo.pop()
        if pgno == _P_INVALID:
            continue
        if pgno in seen or pgno >= pages or len(seen) > pages:
            return None
        seen.add(pgno)
        page = os.pread(fd, psize, pgno * psize)
        flags, lower = int.from_bytes(page[10:12], "little"), int.from_bytes(page[12:14],
                                                                               "little")
        if len(page) < psize or not flags & (_P_BRANCH | _P_LEAF) or not 16 <= lower <= psize:
            return None
        for n in range((lower - 16) // 2):
            at = int.from_bytes(page[16 + 2 * n:18 + 2 * n], "little")
            node = page[at:at + 8]
            if len(node) < 8:
                return None
            lo_hi, nflags = int.from_bytes(node[0:4], "little"), int.from_bytes(node[4:6],
                                                                                 "little")
            ksize = int.from_bytes(node[6:8], "little")
            if flags & _P_BRANCH:
                todo.append(lo_hi | nflags << 32)
                continue
            body = at + 8 + ksize
            if nflags & _F_BIGDATA:
                over = int.from_bytes(page[body:body + 8], "little")
                count = -(-(lo_hi + 16) // psize)
                if over + count > pages:
                    return None
                value = os.pread(fd, lo_hi, over * psize + 16)
            else:
                value = page[body:body + lo_hi]
            ids = [int.from_bytes(value[i:i + 8], "little") for i in range(0, len(value), 8)]
            if not ids or ids[0] > len(ids) - 1:
                return None
            free.update(ids[1:1 + ids[0]])
    return free


_F_SUBDATA, _F_DUPDATA = 0x02, 0x04
_P_LEAF2 = 0x20
_HEADER = struct.Struct("<QHHHH")  # mp_pgno, pad, flags, lower, upper
_NODE = struct.Struct("<IHH")  # lo|hi (data size or child page, low bits), flags, key size
_DB = struct.Struct("<IHHQQQQQ")  # an MDB_db: pad, flags, depth, pages x3, entries, root
#: Where the free pages' and the main table's MDB_db are in a meta page, and its txnid.
_FREE_DB_AT, _MAIN_DB_AT, _TXNID_AT = 40, 88, 144


def check_pages(data: Path) -> None:
    """Walk every B-tree page of every table with ``pread`` (never through LMDB's map), so
    a damaged page is an error instead of a SIGBUS or an LMDB assertion (SIGABRT) in
    whatever reads it later: each page must hold its own page number, the kind its depth
    calls for, node offsets and sizes inside the page, and children and overflow pages
    inside the file. Call it inside a read transaction, which keeps writers from reusing
    the pages walked. A page seen twice (a cycle) is damage too.

    Raises:
        JournalCorrupt: a page is damaged.
        JournalUnavailable: the file cannot be read.
    """
    for attempt in range(3):  # a meta page being written at that moment can be read torn
        try:
            fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalUnavailable(f"cannot read {data}: {exc.strerror or exc}") from None
        try:
            _Walk(fd, data).run()
            return
        except JournalCorrupt:
            if attempt == 2:
                raise
            time.sleep(0.01)
        except OSError as exc:
            raise JournalUnavailable(f"cannot read {data}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)


class _Walk:
    """One walk of ``check_pages`` over the current snapshot."""

    def __init__(self, fd: int, data: Path) -> None:
        self.fd, self.data = fd, data
        self.seen: set[int] = set()

    def bad(self, pgno: int, what: str) -> JournalCorrupt:
        return _bad_file(self.data, f"has a damaged B-tree page {pgno} ({what})")

    def run(self) -> None:
        first = os.pread(self.fd, _META_SIZE, 0)
        if len(first) < _META_SIZE or int.from_bytes(first[16:20], "little") != _MDB_MAGIC:
            return  # not LMDB's: LMDB refuses it without reading pages
        self.psize = _META.unpack(first)[2]
        second = os.pread(self.fd, _META_SIZE, self.psize)
        meta = second if int.from_bytes(second[_TXNID_AT:_TXNID_AT + 8], "little") > \
            int.from_bytes(first[_TXNID_AT:_TXNID_AT + 8], "little") else first
        self.last = _META.unpack(meta)[5]
        self.pages = min(os.fstat(self.fd).st_size // self.psize, self.last + 1)
        _, _, depth, _, _, _, _, root = _DB.unpack_from(meta, _FREE_DB_AT)
        self.tree(root, depth)  # LMDB reads its free pages' table in every write
        _, _, depth, _, _, _, _, root = _DB.unpack_from(meta, _MAIN_DB_AT)
        self.tree(root, depth, subtables=True)

    def page(self, pgno: int) -> bytes:
        if pgno in self.seen:
            raise self.bad(pgno, "reached twice")
        if not 2 <= pgno < self.pages:
            raise self.bad(pgno, f"outside the file's {self.pages} pages")
        self.seen.add(pgno)
        page = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(page) < self.psize:
            raise self.bad(pgno, "cut short")
        return page

    def tree(self, root: int, depth: int, subtables: bool = False) -> None:
        if root == _P_INVALID:
            return
        if not 1 <= depth <= 64:
            raise self.bad(root, f"a table of depth {depth}")
        todo = [(root, 1)]
        while todo:
            pgno, level = todo.pop()
            page = self.page(pgno)
            own, _, flags, lower, upper = _HEADER.unpack_from(page)
            kind = _P_LEAF if level == depth else _P_BRANCH
            if own != pgno:
                raise self.bad(pgno, f"it says it is page {own}")
            if flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW) != kind or flags & _P_LEAF2:
                raise self.bad(pgno, f"flags {flags:#x} where a "
                                     f"{'leaf' if kind == _P_LEAF else 'branch'} belongs")
            if not 16 <= lower <= upper <= self.psize or lower & 1:
                raise self.bad(pgno, f"bounds {lower}..{upper}")
            count = (lower - 16) // 2
            offsets = struct.unpack_from(f"<{count}H", page, 16)
            if count and not upper <= min(offsets) <= max(offsets) <= self.psize - 8:
                raise self.bad(pgno, "a node outside the page")
            unpack = _NODE.unpack_from
            for n, at in enumerate(offsets):
                size, nflags, ksize = unpack(page, at)
                end = at + 8 + ksize
                if kind == _P_BRANCH:
                    if end > self.psize:
                        raise self.bad(pgno, f"node {n} runs past the page")
                    todo.append((size | nflags << 32, level + 1))
                    continue
                if nflags & _F_BIGDATA:
                    if end + 8 > self.psize:
                        raise self.bad(pgno, f"node {n} runs past the page")
                    self.overflow(int.from_bytes(page[end:end + 8], "little"), size, pgno)
                    continue
                if end + size > self.psize or nflags & _F_DUPDATA:
                    raise self.bad(pgno, f"node {n} runs past the page")
                if subtables and nflags & _F_SUBDATA:
                    if size != _DB.size:
                        raise self.bad(pgno, f"a table record of {size} bytes")
                    _, _, sub_depth, _, _, _, _, sub_root = _DB.unpack_from(page, end)
                    self.tree(sub_root, sub_depth)

    def overflow(self, pgno: int, size: int, parent: int) -> None:
        count = -(-(size + 16) // self.psize)
        if pgno + count > self.pages:
            raise self.bad(parent, f"a value on pages {pgno}..{pgno + count - 1}, past the "
                                   "file's end")
        page = self.page(pgno)
        own, _, flags = _HEADER.unpack_from(page)[:3]
        pages = int.from_bytes(page[12:16], "little")
        if own != pgno or not flags & _P_OVERFLOW or pages != count:
            raise self.bad(pgno, "not the overflow page its value needs")


#: The key file older versions kept here (boundloop.keys decides what becomes of it; it is
#: not chmod-ed here, so its mode still says whether someone else could have written it).
KEY_FILE = "redaction.key"
#: The files a journal directory holds; only these are given mode 0600.
OWN_FILES = ("data.mdb", "lock.mdb")
#: Largest number of queued appends folded into one transaction.
MAX_BATCH = 4096
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


def _ekey(run_id: str, seq: int) -> bytes:
    return run_id.encode() + _SEP + seq.to_bytes(8, "big")


def _seq_of(key: bytes, prefix: bytes) -> int:
    """The sequence number in an event key (-1 when the key is not one)."""
    return int.from_bytes(key[len(prefix):], "big") if len(key) == len(prefix) + 8 else -1


def _names(ids: list[bytes]) -> list[str]:
    """Run ids as text, each once, in order."""
    seen: set[bytes] = set()
    out = []
    for rid in ids:
        if rid not in seen:
            seen.add(rid)
            name = rid.decode(errors="backslashreplace")
            if not name.isprintable():  # a damaged key: never control codes on a terminal
                name = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name)
            out.append(name)
    return out


def _decode_index(run_id: str, raw: bytes) -> _Index:
    """A run's stored index entry, checked.

    Raises:
        JournalCorrupt: (a ``chain.ChainError``) it does not match its checksum or run.
    """
    body = chain.verified(raw)
    if body is None:
        raise chain.ChainError(run_id, 0, "the run's index entry does not match its checksum")
    try:
        info = _info_dec.decode(body)
    except msgspec.DecodeError:
        raise chain.ChainError(run_id, 0, "the run's index entry does not decode") from None
    if info.run_id != run_id:
        raise chain.ChainError(run_id, 0, f"the run's index entry names run {info.run_id!r}")
    return info


class _Request(msgspec.Struct):
    run_id: str
    expected_seq: int
    events: Sequence[ev.Event]
    encoded: list[bytes]
    done: Done
    fence: Fence | None = None


class LmdbJournal(keys.KeyedJournal, Journal):
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
                f"parent (a transaction stayed open for {FORK_WAIT_S:g} s), so LMDB cannot "
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
                with self._write_lock.held(time.monotonic() + LOCK_WAIT_S):
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
                    txn.put(_FORMAT_KEY, self._format.to_bytes(4, "big"), db=self._meta)
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
        version = int.from_bytes(raw, "big")
        if version not in chain.READS:
            raise JournalUnavailable(
                f"the journal at {self.path} has record format {version}, and this boundloop "
                f"reads formats {', '.join(map(str, chain.READS))} only: "
                + ("upgrade boundloop to read it" if version > chain.COMPRESSED else
                   "it was written by an older boundloop; read it with that version"))
        if version < self._format and not self.readonly:
            self._check_lock()
            with self._env.begin(write=True) as txn:
                txn.put(_FORMAT_KEY, self._format.to_bytes(4, "big"), db=self._meta)

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

    # -- keys and lifecycle ------------------------------------------------------------
    # -- the redaction key (boundloop.keys finds and keeps it; the journal keeps only its
    # fingerprint and its own id, in the meta table) ------------------------------------
    _key_lock = threading.Lock()

    def _key_meta(self, txn: Any) -> tuple[str | None, str | None]:
        where = str(self.path)
        return (keys.journal_id_of(txn.get(keys.META_JOURNAL_ID, db=self._meta), where),
                keys.fingerprint_of(txn.get(keys.META_FINGERPRINT, db=self._meta), where))

    def _read_key(self) -> bytes:
        """A read-only open's key: the journal's when it can be found (``keys.find``), else
        a random key of this open's own, so nothing it digests (an export) can be confirmed
        by anyone or matches the journal's digests. Creates and writes nothing."""
        try:
            with self._txn(self._meta) as txn:
                journal_id, recorded = self._key_meta(txn)
        except (JournalCorrupt, lmdb.Error):
            journal_id = recorded = None
        found = keys.find(journal_id, recorded)
        return found if found is not None else secrets.token_bytes(keys.MIN_KEY_BYTES)

    def _load_key(self, source: keys.KeySource | None = None) -> bytes:
        """A writer's key (``keys.resolve``): the journal gets an id at its first key, and
        the key's fingerprint is recorded once; a key with another fingerprint is refused."""
        if self.readonly:
            given = keys.given_key(source, self.path)
            if given is None:
                return self._read_key()
            with self._txn(self._meta) as txn:
                journal_id, recorded = self._key_meta(txn)
            keys.check_fingerprint(given[0], recorded, given[1], str(self.path), journal_id)
            return given[0]

        def ids(txn: Any) -> tuple[str, str | None, bool]:
            journal_id, recorded = self._key_meta(txn)
            if journal_id is None:
                journal_id = keys.new_journal_id()
                txn.put(keys.META_JOURNAL_ID, journal_id.encode(), db=self._meta)
            # A run was ever appended (an older version's journal may have its key inside).
            return journal_id, recorded, txn.get(b"order", db=self._meta) is not None

        journal_id, recorded, has_runs = self._write(ids)
        key = keys.resolve(source, journal_id=journal_id, recorded=recorded,
                           journal_dir=self.path, has_runs=has_runs)
        if recorded is None:
            def record(txn: Any) -> str | None:
                first = self._key_meta(txn)[1]
                if first is None:
                    txn.put(keys.META_FINGERPRINT, keys.fingerprint(key).encode(),
                            db=self._meta)
                return first

            # Another process may have recorded its key meanwhile: then it must be this one.
            raced = self._write(record)
            keys.check_fingerprint(key, raced, "this runner", str(self.path), journal_id)
        return key

    def _key_place(self) -> tuple[Path | None, str]:
        return self.path, str(self.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def _usable(self, write: bool = False) -> None:
        if write and self.readonly:
            raise JournalUnavailable(f"the journal at {self.path} was opened read-only")
        if self._closed:
            raise JournalUnavailable(f"the journal at {self.path} is closed; open it again")
        if os.getpid() != self.pid:
            raise JournalUnavailable(
                f"this journal was opened by process {self.pid}, the parent of this forked "
                "process, and an LMDB journal cannot be used across fork(): open it again in "
                "this process (bl.Runner(path), or boundloop.journal.lmdb.acquire(path))")

    def close(self) -> None:
        if os.getpid() != self.pid:
            # The parent's journal, in a forked child: its writer thread and its gate's
            # holders stayed in the parent, and its environment is the parent's (``_forked``
            # closed this copy, or leaves it): nothing here to wait for or to close.
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join()  # its last commit ends before the environment does
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

    def _prepare(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
                 done: Done, fence: Fence | None) -> _Request | None:
        try:
            check_run_id(run_id)
            events = list(events)
            # Encoded here, in the caller's thread: the writer only writes, and an event
            # that cannot be stored fails its own append, never the writer.
            encoded = codec.stored(events, run_id, self.compress)
            return _Request(run_id, expected_seq, events, encoded, done, fence)
        except Exception as exc:
            with contextlib.suppress(Exception):  # a callback must not stop the others
                done(exc)
            return None

    def _enqueue(self, into: queue.SimpleQueue[_Request | None], request: _Request) -> None:
        try:
            # Under the lock, so close() cannot slip in between the check and the put: a
            # request queued before close's sentinel is always answered.
            with self._lock:
                self._usable(write=True)
                into.put(request)
        except lmdb.Error as exc:
            with contextlib.suppress(Exception):
                request.done(_lmdb_error(exc))
        except Exception as exc:
            with contextlib.suppress(Exception):
                request.done(exc)

    def _lead(self) -> None:
        """Commit what ``submit_many`` queued, unless another thread is committing: it
        looks again once it lets go of the commit lock, so nothing is left behind."""
        while not self._direct.empty():
            if not self._commit_lock.acquire(blocking=False):
                return
            try:
                batch: list[_Request] = []
                while len(batch) < MAX_BATCH:
                    try:
                        request = self._direct.get_nowait()
                    except queue.Empty:
                        break
                    if request is not None:
                        batch.append(request)
                if batch and self._contended:
                    # Appends wait for the writer thread: none may overtake them (a run's
                    # next append would find its sequence not yet there).
                    for request in batch:
                        self._enqueue(self._queue, request)
                elif batch:
                    self._commit(batch, wait=False)
            finally:
                self._commit_lock.release()

    def _write_loop(self) -> None:
        for batch in batches(self._queue, MAX_BATCH):
            with self._commit_lock:
                self._commit(batch)
                if self._queue.empty():
                    self._contended = False  # nothing handed over waits any more
            self._lead()
        self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                req.done(JournalUnavailable("the journal was closed before this append"))

    # -- map size ------------------------------------------------------------------------
    def _used_fraction(self) -> float:
        info = self._env.info()
        return float((info["last_pgno"] + 1) * self._env.stat()["psize"]) / info["map_size"]

    def _grow(self) -> bool:
        """Double the map (up to max_map_size); False when it cannot grow. Waits for this
        process's readers to finish, as LMDB requires."""
        size = self._env.info()["map_size"]
        if size >= self._max_map_size:
            return False
        with self._gate.exclusive():
            self._env.set_mapsize(min(size * 2, self._max_map_size))
        return True

    @contextlib.contextmanager
    def _txn(self, db: Any = None, write: bool = False,
             until: float | None = None) -> Iterator[Any]:
        """A transaction under the shared gate (so a map resize waits for it), adopting a
        map grown by another process first if LMDB asks. A write transaction holds the
        write lock (``_WriteLock``), waiting for it until ``until`` (a ``time.monotonic()``;
        default: ``LOCK_WAIT_S`` from now)."""
        gate, lock = self._gate, self._write_lock
        for _ in range(2):
            # The gate and the lock by hand, not as context managers: this runs for every
            # transaction (3 of a W1 round).
            gate.enter_shared()
            try:
                if self._closed:
                    raise JournalUnavailable(f"the journal at {self.path} is closed")
                if write:
                    self._check_lock()
                    lock.acquire(time.monotonic() + LOCK_WAIT_S if until is None else until)
                try:
                    try:
                        txn = self._env.begin(db=db, write=write)
                    except lmdb.MapResizedError:
                        txn = None
                    if txn is not None:
                        with txn:
                            yield txn
                        return
                finally:
                    if write:
                        lock.release()
            finally:
                gate.leave_shared()
            self._adopt_map_size()
        raise JournalUnavailable(f"the journal at {self.path} keeps changing size; retry")

    def _adopt_map_size(self) -> None:
        """Another process grew the map: take its size (LMDB wants no transaction of this
        process open meanwhile, hence the exclusive gate)."""
        with self._gate.exclusive():
            self._env.set_mapsize(0)

    #: Called by the writer after each durable commit: ``(latency_s, appends)`` (telemetry).
    on_commit: Callable[[float, int], None] | None = None
    #: Called by the writer as a commit's sync is about to start (telemetry, see
    #: ``journal.base.before_sync``).
    before_sync: Callable[[], None] | None = None

    @property
    def wait_limits(self) -> dict[str, float]:
        """Run id -> the ``time.monotonic()`` by which that run's appends must be written or
        fail: how long they may wait for the write lock while another process holds it
        (default ``LOCK_WAIT_S``). The runner sets it for a run with a deadline, so a paused
        or stuck process holding the lock cannot keep the run past its deadline's grace."""
        return self._wait_limits

    def _commit(self, batch: list[_Request], wait: bool = True) -> None:
        """Append ``batch`` in one transaction and answer each request. Without ``wait`` (a
        caller's thread leading a group commit) the write lock is only tried: if another
        process holds it, the batch goes to the writer thread, which waits for it (within
        ``wait_limits``), so the caller (a supervisor) goes on serving its other runs."""
        outcomes: list[BaseException | None] = []
        started = time.perf_counter()
        try:
            if self._closed:
                raise JournalUnavailable(f"the journal at {self.path} is closed")
            self._commits += 1
            # Checking the fill level costs two LMDB calls: every 64th commit is enough.
            if self._commits % 64 == 1 and self._used_fraction() > 0.8:
                self._grow()  # before it is full, so a full map is the rare path
            tries, waited = 0, time.monotonic()
            # id(request) -> (the request, kept so its id is not reused; when it may wait no
            # longer)
            limit_of: dict[int, tuple[_Request, float]] = {}
            while True:
                outcomes = []
                until = 0.0  # not waiting: only a try
                if wait:
                    until = min(self._limit(r, limit_of) for r in batch)
                    until = min(until, time.monotonic() + LOCK_SLICE_S)
                try:
                    with self._txn(write=True, until=until) as txn:
                        for req in batch:
                            outcomes.append(self._append_in(txn, req))
                        about_to_sync(self.before_sync)
                    break
                except lmdb.MapFullError:
                    tries += 1
                    if tries == 8 or not self._grow():
                        raise
                except _LockTimeout:
                    if not wait:
                        # Under the commit lock: every later leader sees it and queues
                        # behind (see _lead), so a run's appends stay in order.
                        self._contended = True
                        for req in batch:
                            self._enqueue(self._queue, req)
                        return
                    # What was queued meanwhile waits with this batch (the commit lock held
                    # here keeps every other thread from committing it); what may wait no
                    # longer fails, the rest waits on.
                    self._take_waiting(batch)
                    now = time.monotonic()
                    late = [r for r in batch if self._limit(r, limit_of) <= now]
                    if late:
                        exc = self._write_lock.late(waited, "another process")
                        answer(late, [exc] * len(late), started, None)
                        batch = [r for r in batch if r not in late]
                        if not batch:
                            return
        except lmdb.MapFullError:
            err: BaseException = JournalUnavailable(
                f"the journal at {self.path} is full; prune finished runs "
                "(`boundloop prune`) or open it with a larger map_size")
            outcomes = [err] * len(batch)
        except lmdb.Error as exc:
            outcomes = [_lmdb_error(exc)] * len(batch)
        except JournalError as exc:
            outcomes = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any bad append
            outcomes = [JournalUnavailable(f"journal write failed: {type(exc).__name__}: "
                                           f"{exc}")] * len(batch)
        answer(batch, outcomes, started, self.on_commit)

    def _take_waiting(self, batch: list[_Request]) -> None:
        """Add to ``batch`` (the writer's, waiting for the lock) what was queued since, in
        order: handed over by leaders first, then submitted directly."""
        closing = drain(self._queue, batch, MAX_BATCH)  # only close() queues a None
        drain(self._direct, batch, MAX_BATCH)
        if closing:
            self._queue.put(None)  # close() waits for it: the write loop ends after this

    def _limit(self, req: _Request, limit_of: dict[int, tuple[_Request, float]]) -> float:
        """When ``req`` may wait for the write lock no longer: its run's ``wait_limits``
        entry, but at most ``LOCK_WAIT_S`` and at least ``LOCK_MIN_WAIT_S`` after it was
        first made to wait (a run past its deadline may still record how it ended, if the
        lock is only busy)."""
        noted = limit_of.get(id(req))
        if noted is None:
            first = time.monotonic()
            run_limit = self._wait_limits.get(req.run_id, first + LOCK_WAIT_S)
            noted = limit_of[id(req)] = (req, max(min(run_limit, first + LOCK_WAIT_S),
                                                  first + LOCK_MIN_WAIT_S))
        return noted[1]

    def _append_in(self, txn: Any, req: _Request) -> BaseException | None:
        rid = req.run_id.encode()
        raw = txn.get(rid, db=self._runs)
        try:
            info = None if raw is None else _decode_index(req.run_id, raw)
        except JournalCorrupt as exc:
            return exc
        last = info.last_seq if info is not None else 0
        fence = req.fence
        if fence is not None and info is not None and (
                info.owner != fence.owner or info.epoch != fence.epoch):
            # Checked where the rows are written: a runner that lost the run stores nothing.
            return LeaseLost(f"run {req.run_id!r} is owned by {info.owner!r} at epoch "
                             f"{info.epoch}, not by {fence.owner!r} at epoch {fence.epoch}; "
                             "this runner stopped driving it")
        if last != req.expected_seq:
            return SequenceConflict(f"run {req.run_id!r} is at sequence {last}, not "
                                    f"{req.expected_seq}; another writer appended first")
        if info is not None and unforced_claim(fence, req.events, info.owner):
            # Judged once more here, on the owner's record as it is now (see unforced_claim).
            raw_owner = txn.get(info.owner.encode(), db=self._owners)
            body = None if raw_owner is None else chain.verified(raw_owner)
            if owner_alive(None if body is None else _owner_dec.decode(body)):
                return SequenceConflict(
                    f"run {req.run_id!r} is owned by {info.owner!r}, which is alive (it "
                    "renewed its lease after it was judged gone); the claim is refused")
        now = time.time()
        new = info is None
        if info is None:
            info = _Index(req.run_id, 0, created_ts=now, head=chain.seed(req.run_id))
        elif len(info.head) != chain.LINK_SIZE:
            return chain.ChainError(req.run_id, last, "the run's index entry holds no chain head")
        # Everything is checked before anything is written: a refused append stores nothing.
        is_open: bool | None = True if new else None
        for event in req.events:
            match event:
                case ev.RunAdmitted():
                    info.parent_run_id = event.parent_run_id
                    info.owner, info.epoch = event.owner, 1
                case ev.OwnerClaimed():
                    epoch = event.epoch or info.epoch + 1
                    if epoch != info.epoch + 1:
                        return SequenceConflict(f"run {req.run_id!r} is at epoch {info.epoch}; "
                                                f"a claim of epoch {epoch} came too late")
                    info.owner, info.epoch = event.owner, epoch
                case ev.RunFinished():
                    info.status, info.finished_ts = event.status, event.ts or now
                    is_open = False
                case ev.RunResumed() | ev.RunRequeued():
                    info.status, info.finished_ts = None, None
                    is_open = True
                case _:
                    pass
        if new:
            counter = txn.get(b"order", db=self._meta)
            info.order = int.from_bytes(counter, "big") + 1 if counter else 1
            txn.put(b"order", info.order.to_bytes(8, "big"), db=self._meta)
            txn.put(info.order.to_bytes(8, "big"), rid, db=self._order)
        head, seq, prefix = info.head, last, rid + _SEP
        for data in req.encoded:
            seq += 1
            head = chain.link(head, data)
            key, value = prefix + seq.to_bytes(8, "big"), head + data  # _ekey, inline
            # Appending past the table's last key fills whole pages instead of splitting
            # them in half (time-ordered run ids make that the usual case); any other key
            # is refused by append and put in its place.
            if not txn.put(key, value, db=self._events, append=True):
                txn.put(key, value, db=self._events)
        info.head, info.last_seq, info.updated_ts = head, seq, now
        txn.put(rid, chain.checksum(_info_enc.encode(info)), db=self._runs)
        if is_open:
            txn.put(rid, b"", db=self._open)
        elif is_open is not None:
            txn.delete(rid, db=self._open)
        return None

    # -- reading -----------------------------------------------------------------------
    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        """The run's ``(seq, event)`` pairs after ``after``, each checked first: the sequence
        is dense up to the index's last, every record matches its chain link, and the chain
        ends at the head kept in the run's index. Nothing is returned unless all of it holds
        (records before ``after`` are not read: the link of record ``after`` starts the check).

        Raises:
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        self._usable()
        if not valid_run_id(run_id):
            return iter(())
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            return iter(self._read_in(txn, run_id, max(after, 0)))

    def _read_in(self, txn: Any, run_id: str, after: int) -> list[tuple[int, ev.Event]]:
        rid = run_id.encode()
        prefix = rid + _SEP
        raw = txn.get(rid, db=self._runs)
        cur = txn.cursor(db=self._events)
        if raw is None:
            if cur.set_range(prefix) and cur.key().startswith(prefix):
                raise chain.ChainError(run_id, _seq_of(cur.key(), prefix),
                                       "records of a run that has no index entry")
            return []
        info = _decode_index(run_id, raw)
        last = info.last_seq
        if len(info.head) != chain.LINK_SIZE:
            raise chain.ChainError(run_id, 0, "the run's index entry holds no chain head")
        after = min(after, last)
        if after == 0:
            prev = chain.seed(run_id)
        else:
            start = txn.get(_ekey(run_id, after), db=self._events)
            if start is None or len(start) <= chain.LINK_SIZE:
                raise chain.ChainError(run_id, after, "the record is missing or truncated")
            prev = start[:chain.LINK_SIZE]
        out: list[tuple[int, ev.Event]] = []
        expected = after + 1
        # The per-record checks of _seq_of and chain.unseal, inlined: this loop is most of
        # a replay's time (measured: ~25 % faster than calling them per record).
        size, blake2b, decode = chain.LINK_SIZE, hashlib.blake2b, codec.decode
        if cur.set_range(_ekey(run_id, expected)):
            for key, value in cur:
                if key != prefix + expected.to_bytes(8, "big"):
                    if not key.startswith(prefix):
                        break
                    seq = _seq_of(key, prefix)
                    what = (f"the record is missing (the next one stored is seq {seq})"
                            if seq > expected else "a record's key is damaged")
                    raise chain.ChainError(run_id, expected, what)
                link = value[:size]
                body = value[size:]
                if len(value) <= size or \
                        blake2b(prev + body, digest_size=size).digest() != link:
                    chain.unseal(run_id, expected, prev, value)  # raises, saying what
                prev = link
                try:
                    event = decode(body, run_id)
                except JournalCorrupt as exc:
                    raise chain.ChainError(run_id, expected,
                                           f"the record does not decode: {exc}") from None
                out.append((expected, event))
                expected += 1
        if expected - 1 < last:
            raise chain.ChainError(run_id, expected, f"the record is missing (the run's index "
                                                     f"says it has {last})")
        if expected - 1 > last:
            raise chain.ChainError(run_id, last + 1, f"a record past the run's last (the "
                                                     f"index says it has {last})")
        if prev != info.head:
            raise chain.ChainError(run_id, last, "the chain does not end at the head kept in "
                                                 "the run's index (its last record was "
                                                 "altered or replaced)")
        return out

    def chain_head(self, run_id: str) -> bytes:
        """Check the whole of run ``run_id`` (as ``read`` does) and return its chain head,
        the link of its last record: an auditor who keeps it can later show the run's
        records unchanged (``boundloop verify`` prints it in hex).

        Raises:
            UnknownRun: no run has that id.
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        self._usable()
        if not valid_run_id(run_id):
            raise UnknownRun(f"{run_id!r} cannot name a run")
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            self._read_in(txn, run_id, 0)
            raw = txn.get(run_id.encode(), db=self._runs)
            if raw is None:
                raise UnknownRun(f"no run {run_id!r} in this journal; `boundloop runs` lists "
                                 "them")
            return _decode_index(run_id, raw).head

    def indexed_run_ids(self) -> list[str]:
        """Every run id in the indexes (the order index's, oldest first, then any other run
        with an index entry), whatever state they are in: what ``boundloop verify`` checks.
        An id that is not valid UTF-8 (a damaged key) is named with backslash escapes."""
        self._usable()
        with _guarded("the run index"), self._txn() as txn:
            ordered = [v for _, v in txn.cursor(db=self._order)]
            entries = sorted(k for k, _ in txn.cursor(db=self._runs))
        return _names(ordered + entries)

    def recorded_run_ids(self) -> list[str]:
        """Every run id that records are stored under, sorted (one key read per run)."""
        self._usable()
        found: list[bytes] = []
        with _guarded("the records"), self._txn() as txn:
            cur = txn.cursor(db=self._events)
            more = cur.first()
            while more:
                rid = cur.key().split(_SEP, 1)[0]
                if found and rid <= found[-1]:
                    # Keys out of order: the walk would go round for ever.
                    raise JournalCorrupt(f"the journal at {self.path} is damaged: its "
                                         "records are out of order; restore it from a "
                                         "backup")
                found.append(rid)
                more = cur.set_range(rid + b"\x01")  # past every key of that run
        return _names(found)

    def stored_head(self, run_id: str) -> bytes | None:
        """The chain head the run's index entry keeps (unchecked), None when unreadable."""
        try:
            info = self.find(run_id)
        except JournalCorrupt:
            return None
        return None if info is None else cast(_Index, info).head

    def find(self, run_id: str) -> RunInfo | None:
        self._usable()
        if not valid_run_id(run_id):
            return None
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            raw = txn.get(run_id.encode(), db=self._runs)
            if raw is not None:
                return _decode_index(run_id, raw)
            prefix = run_id.encode() + _SEP
            cur = txn.cursor(db=self._events)
            if cur.set_range(prefix) and cur.key().startswith(prefix):
                # Records without an index entry: a damaged index, not an unknown run.
                raise chain.ChainError(run_id, _seq_of(cur.key(), prefix),
                                       "records of a run that has no index entry")
            return None

    def runs(self) -> Iterator[str]:
        return iter([i.run_id for i in self.infos()])

    def infos(self) -> list[RunInfo]:
        """Every run's index entry, oldest first (each checked against the order index)."""
        self._usable()
        out: list[RunInfo] = []
        with _guarded("the run index"), self._txn() as txn:
            for key, rid in txn.cursor(db=self._order):
                run_id = rid.decode()
                raw = txn.get(rid, db=self._runs)
                info = None if raw is None else _decode_index(run_id, raw)
                if info is None or info.order.to_bytes(8, "big") != key:
                    raise chain.ChainError(run_id, 0, "the order index does not match the "
                                                      "run's index entry")
                out.append(info)
        return out

    def open_runs(self) -> Iterator[str]:
        return iter([info.run_id for info in self.open_infos()])

    def open_infos(self) -> list[RunInfo]:
        """The index entries of the open runs (each checked against the run index), in one
        read transaction."""
        self._usable()
        infos: list[RunInfo] = []
        with _guarded("the index of open runs"), self._txn() as txn:
            for key, _ in txn.cursor(db=self._open):
                run_id = key.decode()
                raw = txn.get(key, db=self._runs)
                info = None if raw is None else _decode_index(run_id, raw)
                if info is None or info.status is not None:
                    raise chain.ChainError(run_id, 0, "the index of open runs does not match "
                                                      "the run's index entry")
                infos.append(info)
        return infos

    # -- owners ------------------------------------------------------------------------

    def _write(self, fn: Any) -> Any:
        """Run ``fn(txn)`` in its own durable write transaction (rare, small writes).

        LMDB serialises write transactions, so this simply waits for the writer thread's.
        """
        self._usable(write=True)
        with _guarded(), self._txn(write=True) as txn:
            return fn(txn)

    def put_owner(self, record: OwnerRecord) -> None:
        self._write(lambda txn: txn.put(record.owner.encode(),
                                        chain.checksum(_info_enc.encode(record)),
                                        db=self._owners))

    def remove_owner(self, owner: str) -> None:
        self._write(lambda txn: txn.delete(owner.encode(), db=self._owners))

    def owners(self) -> dict[str, OwnerRecord]:
        self._usable()
        out: dict[str, OwnerRecord] = {}
        with _guarded("the runner index"), self._txn(self._owners) as txn:
            for key, value in txn.cursor():
                owner = key.decode()
                body = chain.verified(value)
                record = None if body is None else _owner_dec.decode(body)
                if record is None or record.owner != owner:
                    raise JournalCorrupt(f"the journal is damaged: the record of runner "
                                         f"{owner!r} does not match its checksum; restore the "
                                         "journal from a backup")
                out[owner] = record
        return out

    # -- retention ---------------------------------------------------------------------
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        victims = [i for i in self.infos()
                   if i.finished_ts is not None and i.finished_ts < finished_before
                   and not (keep is not None and keep(i))]
        if dry_run or not victims:
            return [i.run_id for i in victims]

        def delete(txn: Any) -> None:
            for n, info in enumerate(victims):
                if progress is not None and n % 256 == 0:
                    progress(n, len(victims))
                prefix = info.run_id.encode() + _SEP
                cur = txn.cursor(db=self._events)
                if cur.set_range(prefix):
                    while cur.key().startswith(prefix):
                        if not cur.delete():
                            break
                txn.delete(info.run_id.encode(), db=self._runs)
                txn.delete(info.order.to_bytes(8, "big"), db=self._order)

        self._write(delete)
        if progress is not None:
            progress(len(victims), len(victims))
        return [i.run_id for i in victims]


#: Every journal open in this process, by real path (LMDB allows one environment each).
_opened: weakref.WeakValueDictionary[str, LmdbJournal] = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()


#: How long fork() waits for the journals of the forking process to be idle (every
#: transaction in flight ended: a commit waits at most ``LOCK_WAIT_S`` for the write lock).
FORK_WAIT_S = LOCK_WAIT_S + 2.0
#: The journals held idle across the fork in progress (``_before_fork``).
_idle: list[LmdbJournal] = []
#: The module's locks ``_before_fork`` took (given back on both sides of the fork).
_taken: list[Any] = []
#: Real paths of journals a forked child could not let go of (busy when it was forked).
_stuck: set[str] = set()


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
    until = time.monotonic() + FORK_WAIT_S
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
