"""Reads of the PostgreSQL journal, each checked against the run's chain and row; owners;
claims; pruning."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from boundloop import events as ev
from boundloop.errors import ConfigError
from boundloop.journal import chain
from boundloop.journal._core import StoredIndex, check_records, prune_runs
from boundloop.journal.base import OwnerRecord, RunInfo, valid_run_id


def _owner(row: Sequence[Any]) -> OwnerRecord:
    return OwnerRecord(row[0], int(row[1]), row[2], float(row[3]), float(row[4]), row[5],
                       row[6])


def _index(row: Sequence[Any]) -> StoredIndex:
    run_id, order, last_seq, created, updated, status, finished, parent, owner, epoch, head \
        = row[:11]
    return StoredIndex(run_id, int(order), last_seq=int(last_seq), created_ts=float(created),
                       updated_ts=float(updated), status=status,
                       finished_ts=None if finished is None else float(finished),
                       parent_run_id=parent, owner=owner, epoch=int(epoch), head=bytes(head))


class _Reads:
    """PostgresJournal's reads, owners and retention (a part of the class)."""

    if TYPE_CHECKING:  # set up by PostgresJournal.__init__
        _lease_given: bool
        _owners_seen: set[str]
        _q: dict[str, str]

        def _usable(self, write: bool = False) -> None: ...
        def _run(self, fn: Callable[[Any], Any], write: bool = False) -> Any: ...
        def _rows(self, key: str, params: Any = ()) -> list[Any]: ...
        def set_lease(self, lease_s: float) -> None: ...

    # -- reading -------------------------------------------------------------------------
    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        """The run's ``(seq, event)`` pairs after ``after``, each checked first (as
        ``LmdbJournal.read``: dense sequence, every link, the head in the run's row).

        Raises:
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        self._usable()
        if not valid_run_id(run_id):
            return iter(())
        return iter(self._read(run_id, max(after, 0))[0])

    def _read(self, run_id: str, after: int) -> tuple[list[tuple[int, ev.Event]], bytes | None]:
        """The checked pairs after ``after`` and the run's head (None: no such run)."""
        rows = self._rows("read", {"rid": run_id, "after": after})
        if not rows or not rows[0][2]:
            found = [r[3] for r in rows if r[3] is not None]
            if found:
                raise chain.ChainError(run_id, int(found[0]),
                                       "records of a run that has no row in the run index")
            return [], None
        last, head = int(rows[0][0]), bytes(rows[0][1])
        if len(head) != chain.LINK_SIZE:
            raise chain.ChainError(run_id, 0, "the run's row holds no chain head")
        after = min(after, last)
        records = [(int(r[3]), bytes(r[4]), bytes(r[5])) for r in rows if r[3] is not None]
        if after == 0:
            prev = chain.seed(run_id)
        else:
            if not records or records[0][0] != after or len(records[0][1]) != chain.LINK_SIZE:
                raise chain.ChainError(run_id, after, "the record is missing or truncated")
            prev = records[0][1]
            records = records[1:]
        return check_records(run_id, after, last, prev, head, records, entry="row"), head

    def _checked_head(self, run_id: str) -> bytes | None:
        self._usable()
        return self._read(run_id, 0)[1]

    def find(self, run_id: str) -> RunInfo | None:
        self._usable()
        if not valid_run_id(run_id):
            return None
        rows = self._rows("find", (run_id,))
        row = rows[0]
        if row[0] is None:
            if row[11] is not None:
                raise chain.ChainError(run_id, int(row[11]),
                                       "records of a run that has no row in the run index")
            return None
        return _index(row)

    def runs(self) -> Iterator[str]:
        return iter([r[0] for r in self._rows("runs")])

    def infos(self) -> list[RunInfo]:
        """Every run's row, oldest first."""
        return [_index(r) for r in self._rows("infos")]

    def indexed_run_ids(self) -> list[str]:
        """Every run id in the run index, oldest first (what ``boundloop verify`` checks)."""
        return list(self.runs())

    def recorded_run_ids(self) -> list[str]:
        """Every run id that records are stored under, sorted (one index probe per run)."""
        return [r[0] for r in self._rows("recorded")]

    def open_runs(self) -> Iterator[str]:
        return iter([r[0] for r in self._rows("open")])

    def open_infos(self) -> list[RunInfo]:
        """The rows of the open runs, oldest first, in one query."""
        return [_index(r) for r in self._rows("open_infos")]

    def claimable(self, limit: int = 100, now: float | None = None,
                  owner: str = "") -> list[RunInfo]:
        """Open runs, oldest first and at most ``limit``, whose owner's lease ran out before
        ``now`` (default: this machine's clock) or who has no owner record, other than
        ``owner``'s own, skipping (``FOR UPDATE SKIP LOCKED``) the runs another worker is
        appending to at this moment, such as its claim. The lease alone decides: the
        process check of ``boundloop.owners`` is not made here. A worker claims a listed run
        with a fenced append of ``OwnerClaimed`` at its ``last_seq`` (as ``Runner.recover``
        does); of two workers claiming one run, the second gets ``SequenceConflict``."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"limit must be a whole number >= 1, got {limit!r}")
        at = time.time() if now is None else now
        return [_index(r) for r in self._run(
            lambda conn: conn.execute(self._q["claimable"], (at, owner, limit)).fetchall(),
            write=True)]

    # -- owners --------------------------------------------------------------------------
    def put_owner(self, record: OwnerRecord) -> None:
        if not self._lease_given and record.owner not in self._owners_seen:
            # A runner's first record: its lease_until is now + its lease_s.
            self._owners_seen.add(record.owner)
            self.set_lease(max(round(record.lease_until - time.time(), 2), 0.1))
        self._run(lambda conn: conn.execute(self._q["put_owner"], (
            record.owner, record.pid, record.host, record.started, record.lease_until,
            record.boot_id, record.pidns)), write=True)

    def remove_owner(self, owner: str) -> None:
        self._run(lambda conn: conn.execute(self._q["remove_owner"], (owner,)), write=True)

    def owners(self) -> dict[str, OwnerRecord]:
        return {r[0]: _owner(r) for r in self._rows("owners")}

    # -- retention -----------------------------------------------------------------------
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        def remove(victims: list[RunInfo]) -> set[str]:
            # Checked again where the rows are deleted: a run resumed since is kept.
            return {r[0] for r in self._run(lambda conn: conn.execute(
                self._q["prune"], ([i.run_id for i in victims], finished_before)).fetchall(),
                write=True)}

        return prune_runs(self.infos(), finished_before, dry_run, keep, progress, remove)
