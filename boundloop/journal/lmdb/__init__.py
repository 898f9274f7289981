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

The package, by job: ``_store`` (LmdbJournal: opening, tables, format, lock file, key),
``_writer`` (appends and group commit), ``_reads`` (checked reads, owners, pruning),
``_records`` (keys and index entries), ``_lock`` (the write lock and the gate), ``_pages``
(checks of data.mdb before it is mapped), ``_errors``, ``_fork`` (fork safety, ``acquire``
and ``release``), ``_compact``.
"""

from __future__ import annotations

from boundloop.journal.lmdb import _lock as _lock
from boundloop.journal.lmdb._compact import COMPACT_PAUSE_ENV as COMPACT_PAUSE_ENV
from boundloop.journal.lmdb._compact import compact as compact
from boundloop.journal.lmdb._fork import acquire as acquire
from boundloop.journal.lmdb._fork import release as release
from boundloop.journal.lmdb._lock import FORK_WAIT_S as FORK_WAIT_S
from boundloop.journal.lmdb._lock import LOCK_MIN_WAIT_S as LOCK_MIN_WAIT_S
from boundloop.journal.lmdb._lock import LOCK_SLICE_S as LOCK_SLICE_S
from boundloop.journal.lmdb._lock import LOCK_WAIT_S as LOCK_WAIT_S
from boundloop.journal.lmdb._pages import check_data_file as check_data_file
from boundloop.journal.lmdb._pages import check_pages as check_pages
from boundloop.journal.lmdb._records import KEY_FILE as KEY_FILE
from boundloop.journal.lmdb._records import MAX_BATCH as MAX_BATCH
from boundloop.journal.lmdb._records import OWN_FILES as OWN_FILES
from boundloop.journal.lmdb._store import LmdbJournal as LmdbJournal
