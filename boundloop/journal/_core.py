"""The journal's storage-independent core, shared by every backend (DESIGN rule 5).

What an append means and what a read must find does not depend on where the bytes go, so
it is written once here, and a backend keeps only its transactions, tables and pages:

- ``plan_append``: the checks of one append, in order (the fence, the sequence, a claim from
  a live owner, the run's chain head), the run's index entry after it (owner, epoch,
  status, open or not) and its records with their hash-chain links. It writes nothing: a
  backend writes the plan in the transaction it checked it in, or stores nothing.
- ``check_records`` and ``check_chain_end``: a read's chain check (a dense sequence, every
  link, the chain ending at the head the index keeps); LMDB inlines the per-record half.
- ``prune_runs``: which runs a prune removes, around the backend's delete.
- ``stamp_wanted`` and ``format_bytes``: the record format stamp (``chain.FORMAT``,
  ``chain.COMPRESSED``) and which formats this version reads.
- ``KeyBinding``: the redaction key's binding (SPEC 9): the journal's id and the key's
  fingerprint, recorded once, over two small primitives of the backend's meta table.
- ``StoreBase``: refusing use once closed, read-only or inherited across fork(), and
  preparing an append in the caller's thread.
- ``GroupCommit``: the plumbing of a writer thread that commits queued appends in groups
  (queueing a request under the close lock, stopping the writer, failing what is left at
  close); ``write_failure`` is what an error escaping a commit is to its appends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import msgspec

from boundloop import events as ev
from boundloop import keys
from boundloop.errors import (
    JournalCorrupt,
    JournalError,
    JournalUnavailable,
    LeaseLost,
    SequenceConflict,
)
from boundloop.journal import chain, codec
from boundloop.journal.base import (
    Done,
    Fence,
    OwnerRecord,
    RunInfo,
    StoredIndex,
    check_run_id,
    unforced_claim,
)
from boundloop.owners import owner_alive

__all__ = [
    "GroupCommit", "KeyBinding", "Plan", "Request", "StoreBase", "StoredIndex",
    "check_chain_end", "check_records", "format_bytes", "plan_append", "prune_runs",
    "stamp_wanted", "write_failure",
]


class Request(msgspec.Struct):
    """One queued append: its events, already encoded (in the caller's thread, so an event
    that cannot be stored fails its own append, never the writer), and who to tell."""

    run_id: str
    expected_seq: int
    events: Sequence[ev.Event]
    encoded: list[bytes]
    done: Done
    fence: Fence | None = None


class Plan(msgspec.Struct):
    """What an accepted append writes (see ``plan_append``)."""

    #: The run's index entry after the append (a new entry, or a copy of the old one).
    info: StoredIndex
    #: True when the run had no index entry (its ``order`` is the backend's to give).
    new: bool
    #: True: the run is open after the append; False: it finished; None: unchanged.
    opened: bool | None
    #: Per event, the run's epoch once it is applied.
    epochs: list[int]
    #: Per event: (seq, link, stored body).
    records: list[tuple[int, bytes, bytes]]


#: The events that change a run's index entry (owner, epoch, status: ``plan_append``).
_INDEXED = frozenset({ev.RunAdmitted, ev.OwnerClaimed, ev.RunFinished, ev.RunResumed,
                      ev.RunRequeued})


def plan_append(req: Request, info: StoredIndex | None, now: float,
                owner_of: Callable[[str], OwnerRecord | None],
                entry: str = "index entry") -> Plan | JournalError:
    """Check ``req`` against its run's index entry ``info`` (None: no such run yet) and
    plan it, or say why it is refused (nothing of a refused append may be stored).

    The checks, in order: the fence (``LeaseLost``: the run is another owner's, or at
    another epoch), the sequence (``SequenceConflict``), an unforced claim of a run whose
    owner is alive on its record as ``owner_of`` reads it now, in the append's own
    transaction (``SequenceConflict``; see ``base.unforced_claim``), the run's chain head
    (``chain.ChainError``), then each claim's epoch (``SequenceConflict``). ``entry`` names
    the index entry in messages (LMDB's "index entry", PostgreSQL's "row")."""
    run_id = req.run_id
    last = info.last_seq if info is not None else 0
    fence = req.fence
    if fence is not None and info is not None and (
            info.owner != fence.owner or info.epoch != fence.epoch):
        # Checked where the rows are written: a runner that lost the run stores nothing.
        return LeaseLost(f"run {run_id!r} is owned by {info.owner!r} at epoch "
                         f"{info.epoch}, not by {fence.owner!r} at epoch {fence.epoch}; "
                         "this runner stopped driving it")
    if last != req.expected_seq:
        return SequenceConflict(f"run {run_id!r} is at sequence {last}, not "
                                f"{req.expected_seq}; another writer appended first")
    if info is not None and unforced_claim(fence, req.events, info.owner) \
            and owner_alive(owner_of(info.owner)):
        return SequenceConflict(
            f"run {run_id!r} is owned by {info.owner!r}, which is alive (it renewed its "
            "lease after it was judged gone); the claim is refused")
    if info is None:
        new = StoredIndex(run_id, 0, created_ts=now, head=chain.seed(run_id))
    elif len(info.head) != chain.LINK_SIZE:
        return chain.ChainError(run_id, last, f"the run's {entry} holds no chain head")
    else:
        new = msgspec.structs.replace(info)
    opened: bool | None = True if info is None else None
    epochs: list[int] = []
    for event in req.events:
        if type(event) not in _INDEXED:  # most events leave the index entry as it is
            epochs.append(new.epoch)
            continue
        match event:
            case ev.RunAdmitted():
                new.parent_run_id = event.parent_run_id
                new.owner, new.epoch = event.owner, 1
            case ev.OwnerClaimed():
                epoch = event.epoch or new.epoch + 1
                if epoch != new.epoch + 1:
                    return SequenceConflict(f"run {run_id!r} is at epoch {new.epoch}; a "
                                            f"claim of epoch {epoch} came too late")
                new.owner, new.epoch = event.owner, epoch
            case ev.RunFinished():
                new.status, new.finished_ts = event.status, event.ts or now
                opened = False
            case ev.RunResumed() | ev.RunRequeued():
                new.status, new.finished_ts = None, None
                opened = True
            case _:
                pass
        epochs.append(new.epoch)
    head, seq = new.head, last
    records: list[tuple[int, bytes, bytes]] = []
    for data in req.encoded:
        seq += 1
        head = chain.link(head, data)
        records.append((seq, head, data))
    new.head, new.last_seq, new.updated_ts = head, seq, now
    return Plan(new, info is None, opened, epochs, records)


def check_chain_end(run_id: str, expected: int, last: int, prev: bytes, head: bytes,
                    entry: str = "index") -> None:
    """The end of a read's check: the records read stop just before ``expected``, the
    run's index entry says its last is ``last``, the last link read is ``prev`` and the
    entry keeps ``head``. ``entry`` names the entry in messages ("index", "row").

    Raises:
        JournalCorrupt: (a ``chain.ChainError``) a record is missing, one lies past the run's
            last, or the chain does not end at the head.
    """
    if expected - 1 < last:
        raise chain.ChainError(run_id, expected, f"the record is missing (the run's {entry} "
                                                 f"says it has {last})")
    if expected - 1 > last:
        raise chain.ChainError(run_id, last + 1, f"a record past the run's last (its {entry} "
                                                 f"says it has {last})")
    if prev != head:
        raise chain.ChainError(run_id, last, "the chain does not end at the head kept in "
                                             f"the run's {entry} (its last record was "
                                             "altered or replaced)")


def check_records(run_id: str, after: int, last: int, prev: bytes, head: bytes,
                  records: Iterable[tuple[int, bytes, bytes]],
                  entry: str = "index") -> list[tuple[int, ev.Event]]:
    """The events of ``records`` (``(seq, link, body)`` after seq ``after``, whose link is
    ``prev``), each checked: the sequence is dense, every link matches, and the chain ends
    at ``head`` after ``last`` (``check_chain_end``).

    Raises:
        JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
    """
    out: list[tuple[int, ev.Event]] = []
    expected = after + 1
    for seq, link, body in records:
        if seq != expected:
            raise chain.ChainError(run_id, expected, "the record is missing (the next one "
                                                     f"stored is seq {seq})")
        chain.unseal(run_id, seq, prev, link + body)
        prev = link
        try:
            event = codec.decode(body, run_id)
        except JournalCorrupt as exc:
            raise chain.ChainError(run_id, seq, f"the record does not decode: {exc}") from None
        out.append((seq, event))
        expected += 1
    check_chain_end(run_id, expected, last, prev, head, entry)
    return out


# -- the record format stamp -------------------------------------------------------------------
def format_bytes(version: int) -> bytes:
    """How a format stamp is stored (a big-endian u32)."""
    return version.to_bytes(4, "big")


def stamp_wanted(version: int | None, journal: str, wanted: int, readonly: bool) -> bool:
    """Whether a journal stamped ``version`` (None: no readable stamp) must be stamped
    ``wanted`` (``chain.COMPRESSED`` for a writer that compresses a format 2 journal).
    ``journal`` names it in messages ("the journal at PATH").

    Raises:
        JournalUnavailable: this version does not read that format; the message says what
            to do.
    """
    if version not in chain.READS:
        reads = ", ".join(map(str, chain.READS))
        newer = version is not None and version > chain.COMPRESSED
        raise JournalUnavailable(
            f"{journal} has record format {version}, and this boundloop reads formats "
            f"{reads} only: " + ("upgrade boundloop to read it" if newer else
                                 "it was written by an older boundloop; read it with that "
                                 "version"))
    return version < wanted and not readonly


def prune_runs(infos: Iterable[RunInfo], finished_before: float, dry_run: bool,
               keep: Callable[[RunInfo], bool] | None,
               progress: Callable[[int, int | None], None] | None,
               remove: Callable[[list[RunInfo]], Collection[str]]) -> list[str]:
    """``Journal.prune`` over a backend's ``remove`` (which deletes the runs it is given
    and returns the ids it deleted, checking again where it deletes that each finished
    before the cut): the runs of ``infos`` that finished before ``finished_before`` and
    that ``keep`` does not keep, removed unless ``dry_run``; ``progress`` hears of the
    start and the end (``remove`` may tell it more in between)."""
    victims = [i for i in infos
               if i.finished_ts is not None and i.finished_ts < finished_before
               and not (keep is not None and keep(i))]
    if dry_run or not victims:
        return [i.run_id for i in victims]
    if progress is not None:
        progress(0, len(victims))
    gone = remove(victims)
    if progress is not None:
        progress(len(victims), len(victims))
    return [i.run_id for i in victims if i.run_id in gone]


def write_failure(exc: BaseException) -> JournalError:
    """What an error escaping a commit is to the appends it held."""
    if isinstance(exc, JournalError):
        return exc
    return JournalUnavailable(f"journal write failed: {type(exc).__name__}: {exc}")


# -- the redaction key -------------------------------------------------------------------------
class KeyBinding(keys.KeyedJournal):
    """The key half of a backend (``boundloop.keys`` finds and keeps the key; the journal
    keeps only its own id and the key's fingerprint, in its meta table), over two
    primitives of the backend: ``_meta_get`` and ``_meta_add``."""

    #: Errors of a reader's look at the meta table after which it digests under a random
    #: key of its own (``_read_key``).
    _key_read_errors: tuple[type[BaseException], ...] = (JournalError,)

    def _meta_get(self) -> tuple[bytes | None, bytes | None]:
        """The stored journal id and key fingerprint (a read; None where absent)."""
        raise NotImplementedError

    def _meta_add(self, name: bytes, value: bytes) -> tuple[bytes | None, bytes | None, bool]:
        """In one durable write: store meta ``name`` as ``value`` unless it is there, then
        return what ``_meta_get`` would, and whether a run was ever appended (an older
        version's journal may hold its key file)."""
        raise NotImplementedError

    def _key_meta(self, raw: Sequence[bytes | None]) -> tuple[str | None, str | None]:
        where = self._key_place()[1]
        return keys.journal_id_of(raw[0], where), keys.fingerprint_of(raw[1], where)

    def _read_key(self) -> bytes:
        """A read-only open's key: the journal's when it can be found (``keys.find``), else
        a random key of this open's own, so nothing it digests (an export) can be confirmed
        by anyone or matches the journal's digests. Creates and writes nothing."""
        try:
            journal_id, recorded = self._key_meta(self._meta_get())
        except self._key_read_errors:
            journal_id = recorded = None
        found = keys.find(journal_id, recorded)
        return found if found is not None else secrets.token_bytes(keys.MIN_KEY_BYTES)

    def _load_key(self, source: keys.KeySource | None = None) -> bytes:
        """A writer's key (``keys.resolve``): the journal gets an id at its first key, and
        the key's fingerprint is recorded once; a key with another fingerprint is refused."""
        directory, where = self._key_place()
        if self.readonly:
            given = keys.given_key(source, directory)
            if given is None:
                return self._read_key()
            journal_id, recorded = self._key_meta(self._meta_get())
            keys.check_fingerprint(given[0], recorded, given[1], where, journal_id)
            return given[0]
        *ids, has_runs = self._meta_add(keys.META_JOURNAL_ID, keys.new_journal_id().encode())
        journal_id, recorded = self._key_meta(ids)
        assert journal_id is not None  # just stored, unless it was there
        key = keys.resolve(source, journal_id=journal_id, recorded=recorded,
                           journal_dir=directory, journal=where, has_runs=has_runs)
        if recorded is None:
            # Another process may have recorded its key meanwhile: then it must be this one.
            raced = self._key_meta(self._meta_add(keys.META_FINGERPRINT,
                                                  keys.fingerprint(key).encode())[:2])[1]
            keys.check_fingerprint(key, raced, "this runner", where, journal_id)
        return key

    def _key_place(self) -> tuple[Path | None, str]:
        raise NotImplementedError


# -- group commit ------------------------------------------------------------------------------
class StoreBase:
    """What every backend's journal object does alike: refusing use once closed, read-only
    or inherited across fork() (``_usable``, over the backend's ``_label`` and
    ``_forked``), ``closed``, and preparing an append (``_prepare``: checked and encoded
    in the caller's thread). The backend sets ``compress``, ``readonly``, ``pid`` and
    ``_closed``."""

    compress: bool
    readonly: bool
    #: The process that opened the journal: its threads and connections stay there.
    pid: int
    _closed: bool

    def _label(self) -> str:
        """How messages name this journal ("the journal at PATH")."""
        raise NotImplementedError

    def _forked(self) -> str:
        """Why this journal cannot be used in a process forked from the one that opened it,
        and what to do."""
        raise NotImplementedError

    def _usable(self, write: bool = False) -> None:
        """Refuse an operation a closed, read-only (``write``) or inherited journal cannot do.

        Raises:
            JournalUnavailable: saying which, and what to do.
        """
        if write and self.readonly:
            raise JournalUnavailable(f"{self._label()} was opened read-only")
        if self._closed:
            raise JournalUnavailable(f"{self._label()} is closed; open it again")
        if os.getpid() != self.pid:
            raise JournalUnavailable(self._forked())

    @property
    def closed(self) -> bool:
        """True once closed."""
        return self._closed

    def _prepare(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
                 done: Done, fence: Fence | None) -> Request | None:
        """The request of one append, encoded here; None once ``done`` has its error."""
        try:
            check_run_id(run_id)
            events = list(events)
            encoded = codec.stored(events, run_id, self.compress)
            return Request(run_id, expected_seq, events, encoded, done, fence)
        except Exception as exc:
            with contextlib.suppress(Exception):  # a callback must not stop the others
                done(exc)
            return None


class GroupCommit(StoreBase):
    """A backend's writer plumbing: appends are prepared in the caller's thread, queued,
    and committed in groups by one writer thread (``base.batches``), each group answered
    with ``base.answer``. The backend also sets up ``_queue``, ``_lock`` and ``_writer``."""

    on_commit: Callable[[float, int], None] | None  # the values: base.Journal's hooks
    before_sync: Callable[[], None] | None
    _queue: queue.SimpleQueue[Request | None]
    _lock: threading.Lock
    _writer: threading.Thread

    def _enqueue(self, into: queue.SimpleQueue[Request | None], request: Request) -> None:
        try:
            # Under the lock, so close() cannot slip in between the check and the put: a
            # request queued before close's sentinel is always answered.
            with self._lock:
                self._usable(write=True)
                into.put(request)
        except Exception as exc:
            with contextlib.suppress(Exception):
                request.done(exc)

    def _fail_pending(self) -> None:
        """Answer what is still queued: the journal closed before it was committed."""
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                with contextlib.suppress(Exception):
                    req.done(JournalUnavailable("the journal was closed before this append"))

    def _stop_writer(self) -> bool:
        """Close's first half: mark the journal closed and let the writer end after what it
        holds (its last commit ends before this returns). False when already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._queue.put(None)
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join()
        return True
