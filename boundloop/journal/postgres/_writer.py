"""Appends to the PostgreSQL journal: the writer thread, group commit in pipeline mode,
the slow path one append at a time, and a commit whose answer was lost."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from boundloop import events as ev
from boundloop.errors import JournalError, JournalUnavailable, SequenceConflict
from boundloop.journal import chain
from boundloop.journal._core import GroupCommit, Request, StoredIndex, plan_append, write_failure
from boundloop.journal.base import (
    Done,
    Fence,
    OwnerRecord,
    about_to_sync,
    answer,
    batches,
    is_claim,
    unforced_claim,
)
from boundloop.journal.postgres._conn import _lost, psycopg
from boundloop.journal.postgres._reads import _index, _owner
from boundloop.journal.postgres._sql import MAX_BATCH

#: A queued append (the name tests and older callers know).
_Request = Request


def _tag(event: ev.Event) -> str:
    return str(type(event).__struct_config__.tag)


class _Outcome(msgspec.Struct):
    """What one pass over a batch decided, before its commit."""

    errors: list[BaseException | None]
    #: Per accepted append with events: (index in the batch, run id, last seq, last link).
    proofs: list[tuple[int, str, int, bytes]]


class _Writes(GroupCommit):
    """PostgresJournal's appends (a part of the class)."""

    if TYPE_CHECKING:  # set up by PostgresJournal.__init__
        name: str
        commits: int
        appended: int
        connect_timeout: float
        transaction_hook: Callable[[Any], None] | None
        locked_hook: Callable[[Any], None] | None
        _writer_conn: Any
        _begin_sql: str
        _q: dict[str, str]

        def _connect(self, autocommit: bool) -> Any: ...
        def _error(self, exc: BaseException) -> JournalError: ...

    # -- writing -------------------------------------------------------------------------
    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
               done: Done, fence: Fence | None = None) -> None:
        request = self._prepare(run_id, expected_seq, events, done, fence)
        if request is not None:
            self._enqueue(self._queue, request)

    def _write_loop(self) -> None:
        try:
            for batch in batches(self._queue, MAX_BATCH):
                self._commit(batch)
        finally:
            self._fail_pending()
            self._drop_writer()

    def _writer_connection(self) -> Any:
        if _lost(self._writer_conn):
            self._drop_writer()
            self._writer_conn = self._connect(autocommit=False)
        return self._writer_conn

    def _drop_writer(self) -> None:
        conn, self._writer_conn = self._writer_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _commit(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        try:
            if self._closed:
                raise JournalUnavailable(f"the journal in {self.name} is closed")
            outcomes = self._commit_batch(batch)
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any bad append
            outcomes = [write_failure(exc)] * len(batch)
        answer(batch, outcomes, started, self.on_commit)

    def _begin(self, cur: Any) -> None:
        # Every statement whose rows are fetched has a cursor of its own: in pipeline mode a
        # cursor's earlier result can arrive after its next execute and be taken for it.
        cur.connection.execute(self._begin_sql)
        hook = self.transaction_hook
        if hook is not None:
            hook(cur.connection.cursor())

    def _commit_batch(self, batch: list[Request]) -> list[BaseException | None]:
        """The fast path: the whole batch in one transaction, in pipeline mode (its writes
        and COMMIT go to the server together: two round trips for a batch of any size)."""
        for attempt in range(2):
            conn = self._writer_connection()
            outcome: _Outcome | None = None
            committing = False
            backend = conn.info.backend_pid
            try:
                with conn.pipeline() as pipeline, conn.cursor() as cur:
                    self._begin(cur)
                    outcome = self._apply(cur, batch, pipeline)
                    if any(e is None for e in outcome.errors):
                        committing = True
                        about_to_sync(self.before_sync)
                        conn.commit()
                    else:
                        conn.rollback()
                        return outcome.errors
            except psycopg.Error as exc:
                if _lost(conn):
                    self._drop_writer()
                    if committing and outcome is not None:
                        return self._resolve(batch, outcome, backend, exc)
                    # Lost before COMMIT was sent: nothing was stored; once more on a new
                    # connection (the server may have restarted since the last batch).
                    if attempt == 0 and not self._closed:
                        continue
                    raise self._error(exc) from None
                # A statement (or the COMMIT) failed: nothing of the batch was stored.
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
                return self._commit_one_by_one(batch)
            self.commits += 1
            self.appended += sum(1 for e in outcome.errors if e is None)
            return outcome.errors
        raise AssertionError("unreachable")

    def _commit_one_by_one(self, batch: list[Request]) -> list[BaseException | None]:
        """The slow path, after a statement failed: each append under its own SAVEPOINT, so
        the one that fails is the only one refused."""
        conn = self._writer_connection()
        outcome = _Outcome([], [])
        try:
            with conn.cursor() as cur:
                self._begin(cur)
                for i, req in enumerate(batch):
                    cur.execute("SAVEPOINT boundloop_append")
                    try:
                        one = self._apply(cur, [req])
                    except psycopg.Error as exc:
                        if _lost(conn):
                            raise
                        cur.execute("ROLLBACK TO SAVEPOINT boundloop_append")
                        outcome.errors.append(self._statement_error(req, exc))
                        continue
                    cur.execute("RELEASE SAVEPOINT boundloop_append")
                    outcome.errors.extend(one.errors)
                    outcome.proofs.extend((i, *p[1:]) for p in one.proofs)
        except psycopg.Error as exc:
            if _lost(conn):
                self._drop_writer()
            else:
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            raise self._error(exc) from None
        return self._finish(conn, batch, outcome)

    def _statement_error(self, req: Request, exc: BaseException) -> JournalError:
        if isinstance(exc, psycopg.errors.LockNotAvailable) and is_claim(req.events):
            return SequenceConflict(f"run {req.run_id!r} is being appended to (claimed?) by "
                                    "another worker right now; this claim was not made")
        if isinstance(exc, psycopg.errors.UniqueViolation):
            return chain.ChainError(req.run_id, req.expected_seq + 1,
                                    "a record past the run's last is already stored")
        return self._error(exc)

    def _finish(self, conn: Any, batch: list[Request],
                outcome: _Outcome) -> list[BaseException | None]:
        errors = outcome.errors
        accepted = sum(1 for e in errors if e is None)
        if not accepted:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            return errors
        backend = conn.info.backend_pid
        try:
            conn.commit()
        except psycopg.Error as exc:
            if _lost(conn):
                self._drop_writer()
                return self._resolve(batch, outcome, backend, exc)
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            refused = self._error(exc)
            return [refused if e is None else e for e in errors]
        self.commits += 1
        self.appended += accepted
        return errors

    def _resolve(self, batch: list[Request], outcome: _Outcome, backend: int,
                 exc: BaseException) -> list[BaseException | None]:
        """The connection was lost during COMMIT: find out whether it committed, from the
        links it wrote, once the server process that ran it is gone."""
        unknown = JournalUnavailable(
            f"the connection to {self.name} was lost while committing ({exc}); whether the "
            "append was stored is unknown: read the run to find out")
        errors = list(outcome.errors)
        try:
            conn = self._writer_connection()
            deadline = time.monotonic() + max(self.connect_timeout, 1.0)
            while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                               (backend,)).fetchone() is not None:
                conn.rollback()
                if time.monotonic() > deadline:
                    raise TimeoutError("the old server process is still there")
                time.sleep(0.05)
            rows = conn.execute(self._q["proof"], ([p[1] for p in outcome.proofs],
                                                   [p[2] for p in outcome.proofs])).fetchall()
            conn.rollback()
        except Exception:  # noqa: BLE001 - then the outcome stays unknown
            self._drop_writer()
            return [unknown if e is None else e for e in errors]
        stored = {(rid, int(seq)): bytes(link) for rid, seq, link in rows}
        proven = {i for i, rid, seq, link in outcome.proofs if stored.get((rid, seq)) == link}
        lost = JournalUnavailable(f"the connection to {self.name} was lost while committing "
                                  f"({exc}); the append was not stored")
        with_events = {p[0] for p in outcome.proofs}
        for i, err in enumerate(errors):
            if err is None:
                errors[i] = None if i in proven else (lost if i in with_events else unknown)
        if proven:
            self.commits += 1
            self.appended += len(proven)
        return errors

    @staticmethod
    def _fetch(conn: Any, pipeline: Any, sql: str, params: Any) -> list[Any]:
        """The rows of one statement, on a cursor of its own. In pipeline mode its results
        are fetched with a Sync, not a flush request: the server then knows the session is
        idle in its transaction, and its idle_in_transaction_session_timeout applies (a
        client frozen while it holds its runs' rows loses them, not the others their runs)."""
        cur = conn.execute(sql, params)
        if pipeline is not None:
            pipeline.sync()
        return cur.fetchall()  # type: ignore[no-any-return]

    def _apply(self, cur: Any, reqs: Sequence[Request], pipeline: Any = None) -> _Outcome:
        """Check and write ``reqs`` in the open transaction (not committed): every append is
        checked, in order, before anything of it is written (see the module's docstring)."""
        now = time.time()
        ids = sorted({r.run_id for r in reqs})
        conn = cur.connection  # a new cursor for each statement whose rows are fetched
        lock = self._q["lock_nowait"] if reqs and all(is_claim(r.events) for r in reqs) \
            else self._q["lock"]
        rows: dict[str, StoredIndex] = {
            row[0]: _index(row) for row in self._fetch(conn, pipeline, lock, (ids,))}
        hook = self.locked_hook
        if hook is not None:
            hook(conn)
        create = [rid for rid in ids if rid not in rows
                  and any(r.run_id == rid and r.expected_seq == 0 for r in reqs)]
        fresh: set[str] = set()
        if create:
            made = {rid: int(order) for rid, order in self._fetch(conn, pipeline, self._q[
                "create"], (create, [now] * len(create), [now] * len(create),
                            [chain.seed(rid) for rid in create]))}
            for rid, order in made.items():
                rows[rid] = StoredIndex(rid, order, created_ts=now, updated_ts=now,
                                        head=chain.seed(rid))
                fresh.add(rid)
            late = [rid for rid in create if rid not in made]
            if late:  # created by another writer meanwhile (and committed)
                rows.update((row[0], _index(row))
                            for row in self._fetch(conn, pipeline, self._q["lock"], (late,)))
        # An unforced claim of a run another owner holds is checked here, in the claim's
        # transaction, against that owner's record as it is now (the claimer judged it
        # gone on a record it read earlier: the owner may have renewed its lease since).
        claimed = {r.run_id for r in reqs if r.run_id in rows
                   and unforced_claim(r.fence, r.events, rows[r.run_id].owner)}
        alive: dict[str, OwnerRecord] = {}
        if claimed:
            previous = sorted({rows[rid].owner for rid in claimed})
            alive = {row[0]: _owner(row) for row in self._fetch(
                conn, pipeline, self._q["claim_owners"], (previous,))}
        used: set[str] = set()
        errors: list[BaseException | None] = []
        proofs: list[tuple[int, str, int, bytes]] = []
        e_run: list[str] = []
        e_seq: list[int] = []
        e_epoch: list[int] = []
        e_kind: list[str] = []
        e_body: list[bytes] = []
        e_link: list[bytes] = []
        for i, req in enumerate(reqs):
            rid = req.run_id
            row = rows.get(rid)
            # A row this transaction created is the run's only once an append used it.
            exists = row is not None and (rid not in fresh or rid in used)
            plan = plan_append(req, row if exists else None, now, alive.get, entry="row")
            if isinstance(plan, BaseException):
                errors.append(plan)
                continue
            new = plan.info
            if plan.new:
                assert row is not None  # a missing run with expected_seq 0 was created above
                new.order = row.order
            for event, (seq, link, data), epoch in zip(req.events, plan.records, plan.epochs,
                                                       strict=True):
                e_run.append(rid)
                e_seq.append(seq)
                e_epoch.append(epoch)
                e_kind.append(_tag(event))
                e_body.append(data)
                e_link.append(link)
            rows[rid] = new
            used.add(rid)
            errors.append(None)
            if plan.records:
                proofs.append((i, rid, new.last_seq, new.head))
        unused = sorted(fresh - used)
        if unused:
            cur.execute(self._q["unuse"], (unused,))
        if e_run:
            cur.execute(self._q["insert"], (e_run, e_seq, e_epoch, e_kind, e_body, e_link))
        if used:
            dirty = [rows[rid] for rid in sorted(used)]
            cur.execute(self._q["update"], (
                [r.run_id for r in dirty], [r.owner for r in dirty], [r.epoch for r in dirty],
                [r.last_seq for r in dirty], [r.status for r in dirty],
                [r.parent_run_id for r in dirty], [r.updated_ts for r in dirty],
                [r.finished_ts for r in dirty], [r.head for r in dirty]))
        return _Outcome(errors, proofs)

