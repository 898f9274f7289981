"""LMDB's files checked before they are mapped: meta pages and a walk of every B-tree
page, so a truncated or damaged file is JournalCorrupt, never a SIGBUS."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from boundloop.errors import (
    JournalCorrupt,
    JournalUnavailable,
)
from boundloop.journal.lmdb._errors import _bad_file

# -- LMDB's own metadata (lmdb.h/mdb.c 0.9, 64-bit little-endian): read before mapping ------
_MDB_MAGIC = 0xBEEFC0DE
_P_INVALID = (1 << 64) - 1
#: After the 16-byte page header: mm_magic u32, mm_version u32, mm_address, mm_mapsize, then
#: two MDB_db of 48 bytes (md_pad u32 (the page size, in the first), md_flags u16, md_depth
#: u16, four counters, md_root), then mm_last_pg and mm_txnid.
_META = struct.Struct("<16xII8x8xI2x2x32xQ4x2x2x32xQQQ")
_META_SIZE = _META.size


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
