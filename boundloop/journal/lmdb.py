"""The LMDB journal: events under (run id, dense sequence), indexes, group commit.

One writer thread owns every write transaction. Appends queued while it commits are
batched into its next transaction, so concurrent runs share one fsync (group commit).
Readers use their own read transactions from any thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import msgspec

from boundloop import events as ev
from boundloop.errors import (
    ConfigError,
    JournalCorrupt,
    JournalError,
    JournalUnavailable,
    LeaseLost,
    SequenceConflict,
)
from boundloop.journal import codec
from boundloop.journal.base import (
    Done,
    Fence,
    Journal,
    OwnerRecord,
    RunInfo,
    check_run_id,
    valid_run_id,
)

_SEP = b"\x00"
_info_enc = msgspec.msgpack.Encoder()
_info_dec = msgspec.msgpack.Decoder(RunInfo)
_owner_dec = msgspec.msgpack.Decoder(OwnerRecord)
KEY_FILE = "redaction.key"
#: The files a journal directory holds; only these are given mode 0600.
OWN_FILES = ("data.mdb", "lock.mdb", KEY_FILE)
#: Largest number of queued appends folded into one transaction.
MAX_BATCH = 4096


class _Gate:
    """Many holders share it; one may hold it alone (to resize the map)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
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


class _Request(msgspec.Struct):
    run_id: str
    expected_seq: int
    events: Sequence[ev.Event]
    encoded: list[bytes]
    done: Done
    fence: Fence | None = None


class LmdbJournal(Journal):
    """A journal in an LMDB environment in directory ``path`` (created ``0700`` if absent).

    Args:
        path: the journal directory.
        sync: fsync every commit (the default; False trades durability for speed).
        map_size: the initial map size in bytes; it doubles when the data nears it.
        max_map_size: the map never grows past this; a full journal fails closed.
        max_readers: concurrent read transactions across every process sharing the journal.
        create: create the directory when it does not exist.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True,
                 map_size: int = 1 << 30, max_map_size: int = 1 << 40,
                 max_readers: int = 1024, create: bool = True, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        data = self.path / "data.mdb"
        if not self.path.exists():
            if not create or readonly:
                raise JournalUnavailable(f"no journal at {self.path}; run a command that "
                                         "creates one, or pass the right --journal")
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Parents made on the way are private too, whatever the umask.
            os.chmod(self.path, 0o700)
        elif not self.path.is_dir():
            raise ConfigError(f"{self.path} is not a directory; a journal is a directory")
        if data.exists() and data.stat().st_size == 0:
            raise JournalCorrupt(f"{data} is empty: this is not a journal (a damaged or "
                                 "truncated copy?); restore it from a backup or point "
                                 "--journal at another directory")
        if not data.exists():
            if not create or readonly:
                raise JournalUnavailable(f"{self.path} holds no journal (no data.mdb); pass "
                                         "the right --journal or set $BOUNDLOOP_JOURNAL")
            # A new journal: its directory becomes private, whatever the umask. An existing
            # journal's directory is left as its owner set it.
            os.chmod(self.path, 0o700)
        self._key = self._read_key() if readonly else self._load_key()
        self.pid = os.getpid()
        self._closed = False
        self._real = os.path.realpath(self.path)
        with _opened_lock:
            other = _opened.get(self._real)
            if other is not None and not other.closed and other.pid == os.getpid():
                raise JournalUnavailable(
                    f"the journal at {self.path} is already open in this process (LMDB allows "
                    "one environment per process): use that one, e.g. runner.journal, or "
                    "boundloop.journal.lmdb.acquire()")
            _opened[self._real] = self
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
            self._open_dbs()
        except (lmdb.Error, OSError) as exc:
            with _opened_lock:
                _opened.pop(self._real, None)
            self._closed = True
            if getattr(self, "_env", None) is not None:
                self._env.close()
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise JournalUnavailable(f"cannot open the journal at {self.path}: {what}") from None
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
                dbs = [self._env.open_db(name, create=not self.readonly)
                       for name in (b"events", b"runs", b"order", b"open", b"owners", b"meta")]
                break
            except lmdb.MapResizedError:
                # Another process grew the map meanwhile: adopt its size and try again.
                if attempt == 2:
                    raise
                self._env.set_mapsize(0)
            except lmdb.NotFoundError:
                raise JournalCorrupt(f"{self.path} is an LMDB environment but not a boundloop "
                                     "journal (its tables are missing)") from None
        self._events, self._runs, self._order, self._open, self._owners, self._meta = dbs

    # -- keys and lifecycle ------------------------------------------------------------
    def _read_key(self) -> bytes:
        path = self.path / KEY_FILE
        try:
            return path.read_bytes()
        except OSError:
            return b""  # a reader never digests anything

    def _load_key(self) -> bytes:
        path = self.path / KEY_FILE
        if not path.exists():
            # Write it whole under a private name, then link it into place: a process
            # opening the journal at the same moment never reads a half-written key.
            tmp = self.path / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        key = path.read_bytes()
        if len(key) != 32:
            raise JournalCorrupt(f"{path} is not a 32-byte key; restore it from a backup "
                                 "(redacted digests depend on it)")
        return key

    @property
    def secret_key(self) -> bytes:
        return self._key

    @property
    def closed(self) -> bool:
        return self._closed

    def _usable(self, write: bool = False) -> None:
        if write and self.readonly:
            raise JournalUnavailable(f"the journal at {self.path} was opened read-only")
        if self._closed:
            raise JournalUnavailable(f"the journal at {self.path} is closed; open it again")
        if os.getpid() != self.pid:
            raise JournalUnavailable("this journal was opened before fork(), and LMDB cannot "
                                     "be used or reopened across fork(): open the journal only "
                                     "in the process that uses it (start children with "
                                     "'spawn', or open it after forking)")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join()  # its last commit ends before the environment does
        with self._gate.exclusive():  # and so does every read in flight
            self._env.close()
        with _opened_lock:
            if _opened.get(self._real) is self:
                del _opened[self._real]

    # -- writing -----------------------------------------------------------------------
    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
               done: Done, fence: Fence | None = None) -> None:
        try:
            check_run_id(run_id)
            events = list(events)
            # Encoded here, in the caller's thread: the writer only writes, and an event
            # that cannot be stored fails its own append, never the writer.
            try:
                encoded = [codec.encode(e) for e in events]
            except (TypeError, ValueError, OverflowError) as exc:
                raise JournalError(f"an event of run {run_id!r} cannot be stored "
                                   f"({type(exc).__name__}: {exc})") from None
            request = _Request(run_id, expected_seq, events, encoded, done, fence)
            # Under the lock, so close() cannot slip in between the check and the put: a
            # request queued before close's sentinel is always answered by the writer.
            with self._lock:
                self._usable(write=True)
                self._queue.put(request)
        except Exception as exc:
            done(exc)

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                break
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
    def _txn(self, db: Any = None, write: bool = False) -> Iterator[Any]:
        """A transaction under the shared gate (so a map resize waits for it), adopting a
        map grown by another process first if LMDB asks."""
        for _ in range(2):
            with self._gate.shared():
                if self._closed:
                    raise JournalUnavailable(f"the journal at {self.path} is closed")
                try:
                    txn = self._env.begin(db=db, write=write)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            self._adopt_map_size()
        raise JournalUnavailable(f"the journal at {self.path} keeps changing size; retry")

    def _adopt_map_size(self) -> None:
        """Another process grew the map: take its size (LMDB wants no transaction of this
        process open meanwhile, hence the exclusive gate)."""
        with self._gate.exclusive():
            self._env.set_mapsize(0)

    def _commit(self, batch: list[_Request]) -> None:
        outcomes: list[BaseException | None] = []
        try:
            if self._closed:
                raise JournalUnavailable(f"the journal at {self.path} is closed")
            self._commits += 1
            # Checking the fill level costs two LMDB calls: every 64th commit is enough.
            if self._commits % 64 == 1 and self._used_fraction() > 0.8:
                self._grow()  # before it is full, so a full map is the rare path
            for tries in range(8):
                outcomes = []
                try:
                    with self._txn(write=True) as txn:
                        for req in batch:
                            outcomes.append(self._append_in(txn, req))
                    break
                except lmdb.MapFullError:
                    if tries == 7 or not self._grow():
                        raise
        except lmdb.MapFullError:
            err: BaseException = JournalUnavailable(
                f"the journal at {self.path} is full; prune finished runs "
                "(`boundloop prune`) or open it with a larger map_size")
            outcomes = [err] * len(batch)
        except lmdb.Error as exc:
            outcomes = [JournalUnavailable(f"journal write failed: {exc}")] * len(batch)
        except JournalUnavailable as exc:
            outcomes = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any bad append
            outcomes = [JournalUnavailable(f"journal write failed: {type(exc).__name__}: "
                                           f"{exc}")] * len(batch)
        for req, outcome in zip(batch, outcomes, strict=True):
            try:
                req.done(outcome)
            except Exception:  # noqa: BLE001 - a callback must not stop the writer
                pass

    def _append_in(self, txn: Any, req: _Request) -> BaseException | None:
        raw = txn.get(req.run_id.encode(), db=self._runs)
        info = _info_dec.decode(raw) if raw is not None else None
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
        now = time.time()
        if info is None:
            counter = txn.get(b"order", db=self._meta)
            order = int.from_bytes(counter, "big") + 1 if counter else 1
            txn.put(b"order", order.to_bytes(8, "big"), db=self._meta)
            txn.put(order.to_bytes(8, "big"), req.run_id.encode(), db=self._order)
            info = RunInfo(req.run_id, order, created_ts=now)
            txn.put(req.run_id.encode(), b"", db=self._open)
        seq = last
        for event, data in zip(req.events, req.encoded, strict=True):
            seq += 1
            txn.put(_ekey(req.run_id, seq), data, db=self._events)
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
                case _:
                    pass
            if isinstance(event, ev.RunFinished):
                info.status, info.finished_ts = event.status, event.ts or now
                txn.delete(req.run_id.encode(), db=self._open)
            elif isinstance(event, ev.RunResumed):
                info.status, info.finished_ts = None, None
                txn.put(req.run_id.encode(), b"", db=self._open)
        info.last_seq, info.updated_ts = seq, now
        txn.put(req.run_id.encode(), _info_enc.encode(info), db=self._runs)
        return None

    # -- reading -----------------------------------------------------------------------
    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        self._usable()
        prefix = run_id.encode() + _SEP
        out: list[tuple[int, ev.Event]] = []
        with self._txn(self._events) as txn:
            cur = txn.cursor()
            if cur.set_range(_ekey(run_id, after + 1)):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    out.append((int.from_bytes(key[len(prefix):], "big"), codec.decode(value)))
        return iter(out)

    def find(self, run_id: str) -> RunInfo | None:
        self._usable()
        if not valid_run_id(run_id):
            return None
        with self._txn(self._runs) as txn:
            raw = txn.get(run_id.encode())
        return None if raw is None else _info_dec.decode(raw)

    def runs(self) -> Iterator[str]:
        self._usable()
        with self._txn(self._order) as txn:
            ids = [v.decode() for _, v in txn.cursor()]
        return iter(ids)

    def infos(self) -> list[RunInfo]:
        """Every run's index entry, oldest first."""
        self._usable()
        with self._txn() as txn:
            out = []
            for _, rid in txn.cursor(db=self._order):
                raw = txn.get(rid, db=self._runs)
                if raw is not None:
                    out.append(_info_dec.decode(raw))
        return out

    def open_runs(self) -> Iterator[str]:
        self._usable()
        with self._txn(self._open) as txn:
            ids = [k.decode() for k, _ in txn.cursor()]
        return iter(ids)

    # -- owners ------------------------------------------------------------------------

    def _write(self, fn: Any) -> Any:
        """Run ``fn(txn)`` in its own durable write transaction (rare, small writes).

        LMDB serialises write transactions, so this simply waits for the writer thread's.
        """
        self._usable(write=True)
        try:
            with self._txn(write=True) as txn:
                return fn(txn)
        except lmdb.Error as exc:
            raise JournalUnavailable(f"journal write failed: {exc}") from None

    def put_owner(self, record: OwnerRecord) -> None:
        self._write(lambda txn: txn.put(record.owner.encode(), _info_enc.encode(record),
                                        db=self._owners))

    def remove_owner(self, owner: str) -> None:
        self._write(lambda txn: txn.delete(owner.encode(), db=self._owners))

    def owners(self) -> dict[str, OwnerRecord]:
        self._usable()
        with self._txn(self._owners) as txn:
            return {k.decode(): _owner_dec.decode(v) for k, v in txn.cursor()}

    # -- retention ---------------------------------------------------------------------
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None) -> list[str]:
        victims = [i for i in self.infos()
                   if i.finished_ts is not None and i.finished_ts < finished_before
                   and not (keep is not None and keep(i))]
        if dry_run or not victims:
            return [i.run_id for i in victims]

        def delete(txn: Any) -> None:
            for info in victims:
                prefix = info.run_id.encode() + _SEP
                cur = txn.cursor(db=self._events)
                if cur.set_range(prefix):
                    while cur.key().startswith(prefix):
                        if not cur.delete():
                            break
                txn.delete(info.run_id.encode(), db=self._runs)
                txn.delete(info.order.to_bytes(8, "big"), db=self._order)

        self._write(delete)
        return [i.run_id for i in victims]


#: Every journal open in this process, by real path (LMDB allows one environment each).
_opened: weakref.WeakValueDictionary[str, LmdbJournal] = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()
_shared: dict[str, list[Any]] = {}
_shared_lock = threading.Lock()


def acquire(path: str | os.PathLike[str], *, sync: bool = True) -> LmdbJournal:
    """The process's journal in ``path``, opened once and shared by every Runner on it
    (LMDB allows one environment per data file per process). ``release`` it when done.

    Raises:
        ConfigError: it is already open here with another ``sync`` setting.
    """
    key = os.path.realpath(path)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0].closed or entry[0].pid != os.getpid():
            journal = LmdbJournal(path, sync=sync)
            _shared[key] = [journal, 1]
            return journal
        if entry[0].sync != sync:
            raise ConfigError(f"the journal at {path} is already open in this process with "
                              f"sync={entry[0].sync}")
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
