"""Appends: group commit by whichever thread leads, the writer thread, map growth, the
write-lock waits and each append's checks inside its transaction."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from boundloop.errors import (
    JournalCorrupt,
    JournalUnavailable,
)
from boundloop.journal import chain
from boundloop.journal._core import GroupCommit, plan_append, write_failure
from boundloop.journal.base import (
    OwnerRecord,
    about_to_sync,
    answer,
    batches,
    drain,
)
from boundloop.journal.lmdb import _lock
from boundloop.journal.lmdb._errors import _lmdb_error
from boundloop.journal.lmdb._lock import (
    LOCK_MIN_WAIT_S,
    LOCK_SLICE_S,
    _Gate,
    _LockTimeout,
    _WriteLock,
)
from boundloop.journal.lmdb._records import (
    _SEP,
    MAX_BATCH,
    _decode_index,
    _info_enc,
    _owner_dec,
    _Request,
)


class _Writes(GroupCommit):
    """LmdbJournal's appends (a part of the class)."""

    if TYPE_CHECKING:  # set up by LmdbJournal.__init__
        path: Path
        _env: lmdb.Environment
        _events: Any
        _runs: Any
        _order: Any
        _open: Any
        _owners: Any
        _meta: Any
        _closed: bool
        _commits: int
        _lock: threading.Lock
        _commit_lock: threading.Lock
        _queue: queue.SimpleQueue[_Request | None]
        _direct: queue.SimpleQueue[_Request | None]
        _gate: _Gate
        _write_lock: _WriteLock
        _max_map_size: int
        _wait_limits: dict[str, float]

        def _check_lock(self) -> None: ...
        def _usable(self, write: bool = False) -> None: ...

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

    # -- map size ------------------------------------------------------------------------
    def _used_fraction(self) -> float:
        # Under the gate, like a transaction: a thread holding it alone may be remapping
        # the environment (a fork, see _fork._before_fork; a grow), and py-lmdb's info()
        # and stat() fail with EINVAL meanwhile: a commit failed so as a pool forked.
        gate = self._gate
        gate.enter_shared()
        try:
            info = self._env.info()
            return float((info["last_pgno"] + 1) * self._env.stat()["psize"]) \
                / info["map_size"]
        finally:
            gate.leave_shared()

    def _grow(self) -> bool:
        """Double the map (up to max_map_size); False when it cannot grow. Waits for this
        process's readers to finish, as LMDB requires."""
        with self._gate.exclusive():  # the size is read there too (see _used_fraction)
            size = self._env.info()["map_size"]
            if size >= self._max_map_size:
                return False
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
                    lock.acquire(time.monotonic() + _lock.LOCK_WAIT_S if until is None else until)
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
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any bad append
            outcomes = [write_failure(exc)] * len(batch)
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
            run_limit = self._wait_limits.get(req.run_id, first + _lock.LOCK_WAIT_S)
            noted = limit_of[id(req)] = (req, max(min(run_limit, first + _lock.LOCK_WAIT_S),
                                                  first + LOCK_MIN_WAIT_S))
        return noted[1]

    def _append_in(self, txn: Any, req: _Request) -> BaseException | None:
        rid = req.run_id.encode()
        raw = txn.get(rid, db=self._runs)
        try:
            info = None if raw is None else _decode_index(req.run_id, raw)
        except JournalCorrupt as exc:
            return exc

        def owner_of(owner: str) -> OwnerRecord | None:
            raw_owner = txn.get(owner.encode(), db=self._owners)
            body = None if raw_owner is None else chain.verified(raw_owner)
            return None if body is None else _owner_dec.decode(body)

        plan = plan_append(req, info, time.time(), owner_of)
        if isinstance(plan, BaseException):
            return plan
        new = plan.info
        if plan.new:
            counter = txn.get(b"order", db=self._meta)
            new.order = int.from_bytes(counter, "big") + 1 if counter else 1
            txn.put(b"order", new.order.to_bytes(8, "big"), db=self._meta)
            txn.put(new.order.to_bytes(8, "big"), rid, db=self._order)
        prefix = rid + _SEP
        for seq, link, data in plan.records:
            key, value = prefix + seq.to_bytes(8, "big"), link + data  # _ekey, inline
            # Appending past the table's last key fills whole pages instead of splitting
            # them in half (time-ordered run ids make that the usual case); any other key
            # is refused by append and put in its place.
            if not txn.put(key, value, db=self._events, append=True):
                txn.put(key, value, db=self._events)
        txn.put(rid, chain.checksum(_info_enc.encode(new)), db=self._runs)
        if plan.opened:
            txn.put(rid, b"", db=self._open)
        elif plan.opened is not None:
            txn.delete(rid, db=self._open)
        return None

    # -- reading -----------------------------------------------------------------------
