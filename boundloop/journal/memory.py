"""A journal in this process's memory: the smallest backend that keeps the whole contract.

``MemoryJournal()`` holds its runs in a dict, for tests, examples and runs that need not
outlive the process. It is written on the storage-independent core that LMDB and PostgreSQL
use (``boundloop.journal._core``): the same fencing, sequence and claim checks, the same
encoded records under the same hash chain (so ``boundloop.ops.verify_chains`` checks it as
it checks theirs), and it passes the same ``boundloop.testing.JournalContract``. What it
lacks is durability: an append is "durable" once it is in the dict.

Opened with a ``name``, the store is shared by every ``MemoryJournal(name)`` of the process
and outlives their closing (a reopen finds the runs, owners and key: what the contract asks
of a reopen); without one, each journal has a store of its own. Its redaction key is random,
made with the store, and never written anywhere.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from boundloop import events as ev
from boundloop import keys
from boundloop.journal import chain
from boundloop.journal._core import (
    Request,
    StoreBase,
    check_records,
    plan_append,
    prune_runs,
)
from boundloop.journal.base import (
    Chained,
    Done,
    Fence,
    OwnerRecord,
    RunInfo,
    StoredIndex,
    answer,
    valid_run_id,
)

__all__ = ["MemoryJournal"]


class _Store:
    """What the journals of one name share: runs (index entries and records), owners, the
    key, and one lock over all of it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.infos: dict[str, StoredIndex] = {}  # in order of admission (dicts keep it)
        #: Per run: its records' stored values (link || body), seq n at index n - 1.
        self.records: dict[str, list[bytes]] = {}
        self.open: set[str] = set()
        self.owners: dict[str, OwnerRecord] = {}
        self.order = 0
        self.key = secrets.token_bytes(keys.MIN_KEY_BYTES)


_stores: dict[str, _Store] = {}
_stores_lock = threading.Lock()


class MemoryJournal(StoreBase, Chained):
    """A journal in memory (see the module's docstring).

    Args:
        name: the store to open, shared by every journal of this name in the process and
            kept when they close; None: a store of this journal's own.
        compress: keep events compressed (``codec.pack``), as LMDB's ``compress`` does.
    """

    def __init__(self, name: str | None = None, *, compress: bool = False) -> None:
        if name is None:
            self._store = _Store()
        else:
            with _stores_lock:
                self._store = _stores.setdefault(name, _Store())
        self.name = name
        self.compress = compress
        self.readonly = False
        self._closed = False
        self.pid = os.getpid()

    @classmethod
    def discard(cls, name: str) -> None:
        """Forget the store ``name``: the next ``MemoryJournal(name)`` starts empty (journals
        open on it now keep using it)."""
        with _stores_lock:
            _stores.pop(name, None)

    def _label(self) -> str:
        return f"the memory journal {self.name!r}" if self.name else "the memory journal"

    def _forked(self) -> str:
        return (f"{self._label()} lives in process {self.pid}, the parent of this forked "
                "process: what a child appends would be seen by nobody; open a journal "
                "in this process")

    def __repr__(self) -> str:
        return f"MemoryJournal({self.name!r})"

    # -- writing -------------------------------------------------------------------------
    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event], done: Done,
               fence: Fence | None = None) -> None:
        """Append at once, in the calling thread, and call ``done`` before returning."""
        request = self._prepare(run_id, expected_seq, events, done, fence)
        if request is None:
            return
        started = time.perf_counter()
        try:
            self._usable(write=True)
            with self._store.lock:
                outcome = self._append(request)
        except Exception as exc:  # noqa: BLE001 - answered, never raised to the submitter
            outcome = exc
        answer([request], [outcome], started, self.on_commit)

    def _append(self, req: Request) -> BaseException | None:
        s = self._store
        plan = plan_append(req, s.infos.get(req.run_id), time.time(), s.owners.get)
        if isinstance(plan, BaseException):
            return plan
        if plan.new:
            s.order += 1
            plan.info.order = s.order
        s.records.setdefault(req.run_id, []).extend(link + body
                                                    for _, link, body in plan.records)
        s.infos[req.run_id] = plan.info
        if plan.opened:
            s.open.add(req.run_id)
        elif plan.opened is not None:
            s.open.discard(req.run_id)
        return None

    # -- reading -------------------------------------------------------------------------
    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        """The run's ``(seq, event)`` pairs after ``after``, each checked against the chain
        (as LMDB's and PostgreSQL's reads are)."""
        self._usable()
        return iter(self._checked(run_id, max(after, 0))[0])

    def _checked(self, run_id: str, after: int) -> tuple[list[tuple[int, ev.Event]],
                                                          StoredIndex | None]:
        with self._store.lock:
            info = self._store.infos.get(run_id)
            values = list(self._store.records.get(run_id, ()))
        if info is None:
            return [], None
        after = min(after, info.last_seq)
        prev = chain.seed(run_id) if after == 0 else values[after - 1][:chain.LINK_SIZE]
        records = ((seq, v[:chain.LINK_SIZE], v[chain.LINK_SIZE:])
                   for seq, v in enumerate(values[after:], start=after + 1))
        return check_records(run_id, after, info.last_seq, prev, info.head, records), info

    def _checked_head(self, run_id: str) -> bytes | None:
        self._usable()
        info = self._checked(run_id, 0)[1]
        return None if info is None else info.head

    def find(self, run_id: str) -> RunInfo | None:
        self._usable()
        if not valid_run_id(run_id):
            return None
        with self._store.lock:
            return self._store.infos.get(run_id)

    def infos(self) -> list[RunInfo]:
        """Every run's index entry, oldest first."""
        self._usable()
        with self._store.lock:
            return list(self._store.infos.values())

    def runs(self) -> Iterator[str]:
        return iter([i.run_id for i in self.infos()])

    def open_runs(self) -> Iterator[str]:
        self._usable()
        with self._store.lock:
            return iter([r for r in self._store.infos if r in self._store.open])

    def indexed_run_ids(self) -> list[str]:
        return list(self.runs())

    def recorded_run_ids(self) -> list[str]:
        self._usable()
        with self._store.lock:
            return sorted(r for r, values in self._store.records.items() if values)

    # -- owners --------------------------------------------------------------------------
    def put_owner(self, record: OwnerRecord) -> None:
        self._usable(write=True)
        with self._store.lock:
            self._store.owners[record.owner] = record

    def owners(self) -> dict[str, OwnerRecord]:
        self._usable()
        with self._store.lock:
            return dict(self._store.owners)

    def remove_owner(self, owner: str) -> None:
        self._usable(write=True)
        with self._store.lock:
            self._store.owners.pop(owner, None)

    # -- retention -----------------------------------------------------------------------
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        def remove(victims: list[RunInfo]) -> list[str]:
            self._usable(write=True)
            gone = []
            with self._store.lock:
                for victim in victims:
                    info = self._store.infos.get(victim.run_id)
                    # Checked again under the lock: a run resumed since is kept.
                    if info is not None and info.finished_ts is not None \
                            and info.finished_ts < finished_before:
                        del self._store.infos[info.run_id]
                        self._store.records.pop(info.run_id, None)
                        self._store.open.discard(info.run_id)
                        gone.append(info.run_id)
            return gone

        return prune_runs(self.infos(), finished_before, dry_run, keep, progress, remove)

    # -- the key and the lifecycle -------------------------------------------------------
    @property
    def secret_key(self) -> bytes:
        """The store's redaction key: random, made with the store, never written."""
        return self._store.key

    def close(self) -> None:
        """Later operations fail with ``JournalUnavailable``; the store stays (for a
        reopen by name)."""
        self._closed = True

