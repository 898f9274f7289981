"""The PostgreSQL journal (SPEC 12): the LMDB journal's contract, shared by many machines.

``PostgresJournal("postgresql://user@host/db")`` keeps the journal in PostgreSQL (psycopg 3;
extra ``boundloop[postgres]``), so workers on many machines share runs.
It keeps the contract of ``boundloop.journal.base.Journal`` exactly as ``LmdbJournal`` does
(the same contract suite runs on both): the same events (their msgpack bytes, from
``boundloop.journal.codec``), the same hash chain per run (``boundloop.journal.chain``),
the same fencing and the same errors.

**Schema.** boundloop creates and migrates its own tables the first time a writer opens the
journal (under an advisory lock, so workers starting together do not race), in the schema
given by ``schema=`` (created when absent) or else the connection's ``current_schema()`` (the
first existing schema of its ``search_path``). ``boundloop_schema_version`` holds one row per
migration applied (``version``, ``applied_ts``); this version of boundloop writes and reads
schema version ``SCHEMA_VERSION``, refuses a newer one, and applies the missing migrations
to an older one. Tables (every one revoked from PUBLIC, whatever default privileges say):

- ``boundloop_runs``: one row per run, its index entry: ``run_id`` (text, ``COLLATE "C"``,
  primary key), ``run_order`` (bigserial: runs oldest first), ``owner`` and ``epoch`` (who
  may append, SPEC 6), ``last_seq``, ``status`` (NULL while the run is open), ``parent_run_id``,
  ``created_ts``, ``updated_ts``, ``finished_ts`` and ``head`` (the link of its last record).
  Partial indexes: open runs (``WHERE status IS NULL``) and retention (``finished_ts``).
- ``boundloop_events``: one row per event: ``(run_id, seq)`` primary key, ``epoch`` (the run's
  epoch once the event is applied), ``kind`` (the event's tag), ``body`` (its msgpack bytes,
  or their compressed form when opened with ``compress=True``: see ``boundloop.journal.codec``)
  and ``link`` (its hash-chain link: ``BLAKE2b-256(previous link || body)``).
- ``boundloop_owners``: runners and their leases (``owner`` primary key, ``lease_until``
  indexed, and the rest of an ``OwnerRecord``).
- ``boundloop_meta``: ``journal_id`` and ``key_fingerprint`` (the redaction key, see
  ``boundloop.keys``: the key itself is never stored here) and ``format`` (the record format:
  ``chain.FORMAT``, or ``chain.COMPRESSED`` once a writer with ``compress=True`` opened it).

**Appends** go through one writer thread and one connection. Each transaction first makes
its commit durable whatever the server's default (``synchronous_commit`` is set to ``on``
for the transaction, or kept at ``remote_apply``, which is stronger; ``sync=False`` sets it
``off`` instead, trading the last commits before a server crash for speed, as LMDB's
``sync=False`` does), then locks the rows of the runs it appends to (``SELECT ... FOR UPDATE``,
in run-id order so two writers cannot deadlock), checks each append in order (the fence:
owner and epoch, else ``LeaseLost``; then the sequence, else ``SequenceConflict``), writes
the events with their links and the runs' new rows, and commits. Every append queued while a
transaction commits goes into the next one (group commit: one WAL flush for all), and an
append that is refused stores nothing and fails alone: appends are checked before anything
is written, and should a statement fail anyway, the batch is redone one append at a time,
each under its own SAVEPOINT. A new run's row is inserted with ``ON CONFLICT DO NOTHING``, so
two workers creating one run id cannot both succeed either.

When the connection is lost during COMMIT, the outcome is unknown to the client; the writer
then reconnects, waits for the old server process to be gone, and reads back the links it
wrote: an append whose last link is there is reported stored, any other fails with
``JournalUnavailable``. A connection lost before COMMIT is retried once on a new connection
(nothing was stored; the retry is checked afresh, fence included). Reads and small writes
retry once on a new connection too. Nothing waits for a server that is down: connections are
made when needed (never retried in the background with a backoff), a refused connection is
``JournalUnavailable`` at once, and the journal is usable again at the first operation after
the server is back (a server restart fails the appends in flight closed, and no more).

**A frozen client** (a worker paused or partitioned in the middle of a transaction) must not
hold the rows of its runs: every transaction sets ``idle_in_transaction_session_timeout`` to
half the lease (at least 200 ms), so the server ends such a session, and frees its row locks,
before the client's lease has run out and its runs may be claimed; ``lock_timeout`` (the
lease, at least 1 s) bounds any other wait for a row, and TCP keepalives (and
``tcp_user_timeout``) bound a wait on a server that vanished, unless the URL sets its own.
The lease is ``lease_s=`` when given, else learned from the first owner record a runner
registers through the journal (its ``lease_until``; ``set_lease`` changes it), else 30 s.

**Reads** are one statement each (one snapshot) and check the chain as LMDB's do: the
sequence is dense, every record matches its link, the chain ends at the row's head; any
mismatch raises ``JournalCorrupt`` (a ``chain.ChainError`` naming the run and seq).

**Claims across machines.** ``open_runs`` and ``owners`` are what ``Runner.recover`` uses (with
the owner checks of ``boundloop.owners``); ``claimable(limit)`` lists open runs whose owner's
lease has expired (judged by the lease alone, since the owner may be on another machine;
leases are wall-clock times written by each runner, so the workers' clocks must agree to well
within ``lease_s``), skipping with ``FOR UPDATE SKIP LOCKED`` runs that another worker is
appending to (claiming) right now. The claim itself is an append at the run's last sequence,
fenced as every append is: of two workers claiming one run, one gets ``SequenceConflict``.
The claim's transaction judges the run's owner once more, on its owner record as it is then,
by the rules of ``boundloop.owners.owner_alive`` (this machine's process check, else the
lease): a claim decided on a record read earlier, from an owner that has renewed its lease
since (a worker that woke up and went on with its own runs), is refused with
``SequenceConflict``, so it never lands while that owner starts attempts. A forced resolve
(``CallResolved.forced``) claims from a live owner on purpose and is not checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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
    about_to_sync,
    answer,
    batches,
    check_run_id,
    is_claim,
    unforced_claim,
    valid_run_id,
)
from boundloop.owners import owner_alive

try:
    import psycopg
    from psycopg import conninfo as _conninfo
except ImportError:  # pragma: no cover - reported when a journal is opened
    psycopg = None  # type: ignore[assignment]

__all__ = ["PostgresJournal", "SCHEMA_VERSION", "SCHEMES", "is_url", "open_url", "url_scheme"]

#: The schema version this boundloop writes and reads (``boundloop_schema_version``).
SCHEMA_VERSION = 1
#: URL schemes that name a PostgreSQL journal.
SCHEMES = ("postgresql", "postgres")
#: Largest number of queued appends folded into one transaction.
MAX_BATCH = 1024


def is_url(value: object) -> bool:
    """True when ``value`` is a ``postgresql://`` or ``postgres://`` URL."""
    return url_scheme(value) in SCHEMES


def url_scheme(value: object) -> str | None:
    """The scheme of ``value`` when it is a URL (``scheme://...``), else None (a path)."""
    if not isinstance(value, str):
        return None
    head, sep, _ = value.partition("://")
    if not sep or not head or not head[0].isalpha() \
            or not all(c.isalnum() or c in "+.-" for c in head):
        return None
    return head.lower()


def open_url(url: str, *, sync: bool = True, readonly: bool = False,
             create: bool = True, lease_s: float | None = None,
             compress: bool = False) -> PostgresJournal:
    """The journal a URL names (``bl.Runner(url)``, ``--journal URL``); ``lease_s`` is the
    lease of the runner that opens it (the session timeouts follow it; default: learned
    from the runner's first owner record).

    Raises:
        ConfigError: the URL's scheme names no journal backend (the message names those
            that exist), or psycopg is not installed.
        JournalUnavailable: the server cannot be reached.
    """
    scheme = url_scheme(url)
    if scheme not in SCHEMES:
        raise ConfigError(f"a journal URL of scheme {scheme or url!r} names no journal "
                          "backend: use postgresql://user@host/db (or postgres://) for "
                          "PostgreSQL, or a directory path for LMDB")
    return PostgresJournal(url, sync=sync, readonly=readonly, create=create, lease_s=lease_s,
                           compress=compress)


class _Index(RunInfo):
    """A run's row: its RunInfo and the head of its hash chain."""

    #: The link of the run's last record (``chain.seed(run_id)`` before the first).
    head: bytes = b""


# -- SQL ---------------------------------------------------------------------------------
# "@." stands for the journal's schema, quoted, and a dot (see PostgresJournal._sql).
_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE @.boundloop_runs (
            run_id text COLLATE "C" PRIMARY KEY,
            run_order bigserial NOT NULL UNIQUE,
            owner text NOT NULL DEFAULT '',
            epoch bigint NOT NULL DEFAULT 0,
            last_seq bigint NOT NULL DEFAULT 0,
            status text,
            parent_run_id text,
            created_ts double precision NOT NULL,
            updated_ts double precision NOT NULL,
            finished_ts double precision,
            head bytea NOT NULL)""",
        "CREATE INDEX boundloop_runs_open ON @.boundloop_runs (run_order) "
        "WHERE status IS NULL",
        "CREATE INDEX boundloop_runs_finished ON @.boundloop_runs (finished_ts) "
        "WHERE finished_ts IS NOT NULL",
        # No foreign key to the runs: the chain check on every read catches a record
        # without its run, and a key check per inserted event would cost every append.
        """CREATE TABLE @.boundloop_events (
            run_id text COLLATE "C" NOT NULL,
            seq bigint NOT NULL,
            epoch bigint NOT NULL,
            kind text NOT NULL,
            body bytea NOT NULL,
            link bytea NOT NULL,
            PRIMARY KEY (run_id, seq))""",
        """CREATE TABLE @.boundloop_owners (
            owner text PRIMARY KEY,
            pid bigint NOT NULL,
            host text NOT NULL,
            started double precision NOT NULL,
            lease_until double precision NOT NULL,
            boot_id text NOT NULL DEFAULT '',
            pidns text NOT NULL DEFAULT '')""",
        "CREATE INDEX boundloop_owners_lease ON @.boundloop_owners (lease_until)",
        "CREATE TABLE @.boundloop_meta (key text PRIMARY KEY, value bytea NOT NULL)",
        "REVOKE ALL ON @.boundloop_runs, @.boundloop_events, @.boundloop_owners, "
        "@.boundloop_meta FROM PUBLIC",
        "REVOKE ALL ON SEQUENCE @.boundloop_runs_run_order_seq FROM PUBLIC",
        f"INSERT INTO @.boundloop_meta (key, value) VALUES ('format', "
        f"'\\x{chain.FORMAT.to_bytes(4, 'big').hex()}'::bytea)",
    ],
}

_RUN_COLS = ("run_id, run_order, last_seq, created_ts, updated_ts, status, finished_ts, "
             "parent_run_id, owner, epoch, head")
_SQL = {
    "lock": f"SELECT {_RUN_COLS} FROM @.boundloop_runs WHERE run_id = ANY(%s) "
            "ORDER BY run_id FOR UPDATE",
    # A claim does not wait for a run another worker is appending to (claiming, say): it
    # is skipped, as recovery skips runs another worker is claiming (SPEC 12).
    "lock_nowait": f"SELECT {_RUN_COLS} FROM @.boundloop_runs WHERE run_id = ANY(%s) "
                   "ORDER BY run_id FOR UPDATE NOWAIT",
    "create": "INSERT INTO @.boundloop_runs (run_id, created_ts, updated_ts, head) "
              "SELECT * FROM unnest(%s::text[], %s::float8[], %s::float8[], %s::bytea[]) "
              "ON CONFLICT (run_id) DO NOTHING RETURNING run_id, run_order",
    "unuse": "DELETE FROM @.boundloop_runs WHERE run_id = ANY(%s)",
    "insert": "INSERT INTO @.boundloop_events (run_id, seq, epoch, kind, body, link) "
              "SELECT * FROM unnest(%s::text[], %s::int8[], %s::int8[], %s::text[], "
              "%s::bytea[], %s::bytea[])",
    "update": "UPDATE @.boundloop_runs AS r SET owner = u.owner, epoch = u.epoch, "
              "last_seq = u.last_seq, status = u.status, parent_run_id = u.parent_run_id, "
              "updated_ts = u.updated_ts, finished_ts = u.finished_ts, head = u.head "
              "FROM unnest(%s::text[], %s::text[], %s::int8[], %s::int8[], %s::text[], "
              "%s::text[], %s::float8[], %s::float8[], %s::bytea[]) "
              "AS u(run_id, owner, epoch, last_seq, status, parent_run_id, updated_ts, "
              "finished_ts, head) WHERE r.run_id = u.run_id",
    "proof": "SELECT e.run_id, e.seq, e.link FROM @.boundloop_events e "
             "JOIN unnest(%s::text[], %s::int8[]) AS p(run_id, seq) "
             "ON e.run_id = p.run_id AND e.seq = p.seq",
    "find": f"SELECT {', '.join('r.' + c for c in _RUN_COLS.split(', '))}, "
            "CASE WHEN r.run_id IS NULL THEN (SELECT min(seq) FROM @.boundloop_events e "
            "WHERE e.run_id = k.run_id) END "
            "FROM (SELECT %s::text COLLATE \"C\" AS run_id) k "
            "LEFT JOIN @.boundloop_runs r ON r.run_id = k.run_id",
    "read": "SELECT r.last_seq, r.head, r.run_id IS NOT NULL, e.seq, e.link, e.body "
            "FROM (SELECT %(rid)s::text COLLATE \"C\" AS run_id) k "
            "LEFT JOIN @.boundloop_runs r ON r.run_id = k.run_id "
            "LEFT JOIN @.boundloop_events e ON e.run_id = k.run_id AND e.seq >= "
            "CASE WHEN r.run_id IS NULL THEN 0 ELSE LEAST(%(after)s, r.last_seq) END "
            "ORDER BY e.seq",
    "infos": f"SELECT {_RUN_COLS} FROM @.boundloop_runs ORDER BY run_order",
    "runs": "SELECT run_id FROM @.boundloop_runs ORDER BY run_order",
    "open": "SELECT run_id FROM @.boundloop_runs WHERE status IS NULL ORDER BY run_order",
    "open_infos": f"SELECT {_RUN_COLS} FROM @.boundloop_runs WHERE status IS NULL "
                  "ORDER BY run_order",
    "claimable": f"SELECT {', '.join('r.' + c for c in _RUN_COLS.split(', '))} "
                 "FROM @.boundloop_runs r LEFT JOIN @.boundloop_owners o ON o.owner = r.owner "
                 "WHERE r.status IS NULL AND (o.owner IS NULL OR o.lease_until < %s) "
                 "AND r.owner <> %s ORDER BY r.run_order LIMIT %s FOR UPDATE OF r SKIP LOCKED",
    "recorded": "WITH RECURSIVE t(rid) AS (SELECT min(run_id) FROM @.boundloop_events "
                "UNION ALL SELECT (SELECT min(run_id) FROM @.boundloop_events "
                "WHERE run_id > t.rid) FROM t WHERE t.rid IS NOT NULL) "
                "SELECT rid FROM t WHERE rid IS NOT NULL",
    "put_owner": "INSERT INTO @.boundloop_owners (owner, pid, host, started, lease_until, "
                 "boot_id, pidns) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                 "ON CONFLICT (owner) DO UPDATE SET pid = EXCLUDED.pid, host = EXCLUDED.host, "
                 "started = EXCLUDED.started, lease_until = EXCLUDED.lease_until, "
                 "boot_id = EXCLUDED.boot_id, pidns = EXCLUDED.pidns",
    "owners": "SELECT owner, pid, host, started, lease_until, boot_id, pidns "
              "FROM @.boundloop_owners ORDER BY owner",
    "remove_owner": "DELETE FROM @.boundloop_owners WHERE owner = %s",
    "claim_owners": "SELECT owner, pid, host, started, lease_until, boot_id, pidns "
                    "FROM @.boundloop_owners WHERE owner = ANY(%s)",
    "prune": "WITH gone AS (DELETE FROM @.boundloop_runs WHERE run_id = ANY(%s) "
             "AND finished_ts IS NOT NULL AND finished_ts < %s RETURNING run_id), "
             "recs AS (DELETE FROM @.boundloop_events WHERE run_id IN "
             "(SELECT run_id FROM gone)) SELECT run_id FROM gone",
    "meta": "SELECT key, value FROM @.boundloop_meta WHERE key = ANY(%s)",
    "meta_add": "INSERT INTO @.boundloop_meta (key, value) VALUES (%s, %s) "
                "ON CONFLICT (key) DO NOTHING RETURNING key",
}

#: Sets synchronous_commit for one transaction: ``on`` (kept at ``remote_apply``, which
#: waits for more) whatever the server's or role's default.
_SYNC_ON = ("SELECT set_config('synchronous_commit', CASE WHEN "
            "current_setting('synchronous_commit') = 'remote_apply' THEN 'remote_apply' "
            "ELSE 'on' END, true)")
_SYNC_OFF = "SELECT set_config('synchronous_commit', 'off', true)"
#: The lease the session timeouts follow until one is given or learned (Runner's default).
DEFAULT_LEASE_S = 30.0


def timeouts(lease_s: float) -> dict[str, int]:
    """The server-side timeouts, in milliseconds, of a journal whose runners hold leases of
    ``lease_s``: an idle transaction is ended after half the lease (at least 200 ms), before
    its runs can be claimed; a wait for a row lock after the lease (at least 1 s)."""
    lease_ms = max(float(lease_s), 0.0) * 1000
    return {"idle_in_transaction_session_timeout": max(200, int(lease_ms / 2)),
            "lock_timeout": max(1000, int(lease_ms))}


def _keepalives(url: str, lease_s: float) -> dict[str, Any]:
    """TCP keepalives and ``tcp_user_timeout`` from the lease (a dead server is noticed
    within about the lease), for the parameters the URL does not set itself."""
    try:
        given = _conninfo.conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a bad URL is reported when connecting
        given = {}
    lease = max(float(lease_s), 1.0)
    wanted: dict[str, Any] = {"keepalives": 1, "keepalives_idle": max(1, int(lease / 2)),
              "keepalives_interval": 1, "keepalives_count": 3,
              "tcp_user_timeout": int(lease * 2000)}
    return {k: v for k, v in wanted.items() if k not in given}


class _Conns:
    """The readers' connections: at most ``size`` at once, made when one is needed (never
    in the background, so never after a backoff), an idle one reused when there is one.
    A connection that was lost, or that is left inside a transaction, is closed, not
    reused; ``discard_idle`` closes every idle one (after a server restart broke them)."""

    def __init__(self, connect: Callable[[], Any], size: int, wait_s: float) -> None:
        self._new = connect
        self._size = max(1, size)
        self._wait_s = wait_s
        self._idle: list[Any] = []
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        conn = self._get()
        try:
            yield conn
        finally:
            self._put(conn)

    def _get(self) -> Any:
        deadline = time.monotonic() + self._wait_s
        stale: list[Any] = []
        try:
            with self._cond:
                while True:
                    if self._closed:
                        raise JournalUnavailable("the journal is closed; open it again")
                    while self._idle:
                        conn = self._idle.pop()
                        if _lost(conn):
                            stale.append(conn)
                            continue
                        self._busy += 1
                        return conn
                    if self._busy < self._size:
                        self._busy += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise JournalUnavailable(f"no free connection within {self._wait_s:g}s "
                                                 f"({self._size} in use)")
                    self._cond.wait(left)
        finally:
            for conn in stale:
                _close(conn)
        try:
            return self._new()
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify()
            raise

    def _put(self, conn: Any) -> None:
        keep = not _lost(conn) and conn.info.transaction_status == _IDLE
        with self._cond:
            self._busy -= 1
            if keep and not self._closed:
                self._idle.append(conn)
                conn = None
            self._cond.notify()
        if conn is not None:
            _close(conn)

    def discard_idle(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.discard_idle()


def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


_IDLE = psycopg.pq.TransactionStatus.IDLE if psycopg is not None else None


def _need_psycopg() -> None:
    if psycopg is None:
        raise ConfigError("a PostgreSQL journal needs psycopg 3: pip install "
                          "'boundloop[postgres]'")


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lock_key(schema: str) -> int:
    """The advisory lock taken while the schema is created or migrated."""
    digest = hashlib.blake2b(b"boundloop schema\x00" + schema.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _display(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        params = _conninfo.conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a bad URL is reported when connecting
        return "a PostgreSQL journal"
    user = str(params.get("user", ""))
    host = str(params.get("host", ""))
    port = str(params.get("port", ""))
    where = f"{host}:{port}" if port else host
    return f"postgresql://{user + '@' if user else ''}{where}/{params.get('dbname', '')}"


def _lost(conn: Any) -> bool:
    """True when the connection can no longer be used (it was lost or broken)."""
    return bool(conn is None or conn.closed or conn.broken)


def _tag(event: ev.Event) -> str:
    return str(type(event).__struct_config__.tag)


def _owner(row: Sequence[Any]) -> OwnerRecord:
    return OwnerRecord(row[0], int(row[1]), row[2], float(row[3]), float(row[4]), row[5],
                       row[6])


def _claims_from(req: _Request, owner: str) -> bool:
    """``base.unforced_claim`` of a request."""
    return unforced_claim(req.fence, req.events, owner)


def _is_claim(req: _Request) -> bool:
    """A request that claims its run, other than a forced resolve (``base.is_claim``)."""
    return is_claim(req.events)


def _index(row: Sequence[Any]) -> _Index:
    run_id, order, last_seq, created, updated, status, finished, parent, owner, epoch, head \
        = row[:11]
    return _Index(run_id, int(order), last_seq=int(last_seq), created_ts=float(created),
                  updated_ts=float(updated), status=status,
                  finished_ts=None if finished is None else float(finished),
                  parent_run_id=parent, owner=owner, epoch=int(epoch), head=bytes(head))


class _Request(msgspec.Struct):
    run_id: str
    expected_seq: int
    events: Sequence[ev.Event]
    encoded: list[bytes]
    done: Done
    fence: Fence | None = None


class _Outcome(msgspec.Struct):
    """What one pass over a batch decided, before its commit."""

    errors: list[BaseException | None]
    #: Per accepted append with events: (index in the batch, run id, last seq, last link).
    proofs: list[tuple[int, str, int, bytes]]


class PostgresJournal(keys.KeyedJournal, Journal):
    """A journal in a PostgreSQL database (SPEC 12; see the module's docstring).

    Args:
        url: a libpq connection string or URL (``postgresql://user@host:5432/db``; a password
            is best kept in ``~/.pgpass`` or ``$PGPASSWORD`` rather than in the URL).
        sync: commit every append with ``synchronous_commit=on`` (the default) whatever the
            server's default; False commits with ``off`` (faster, but a server crash may
            lose the last acknowledged appends).
        schema: the schema holding the journal's tables, created when absent (default: the
            connection's ``current_schema()``).
        readonly: write nothing, create nothing (``boundloop show`` and the like); the
            schema must exist at this version.
        create: create the journal's tables when they do not exist (else
            ``JournalUnavailable``); an older schema is migrated either way.
        pool_size: most connections the readers use at once (the writer has its own).
        connect_timeout: seconds to wait for the server when connecting.
        lease_s: the lease of the runners using the journal, which the server-side
            timeouts follow (see the module's docstring; default: learned from the first
            owner record registered through the journal, else 30 s).
        compress: store events compressed, as LMDB's ``compress`` does (record format 3).

    Raises:
        JournalUnavailable: the server cannot be reached, or the journal's schema is of
            another version (or absent, when ``readonly``).
        ConfigError: psycopg is not installed, or there is no schema to use.
    """

    def __init__(self, url: str, *, sync: bool = True, schema: str | None = None,
                 readonly: bool = False, create: bool = True, pool_size: int = 8,
                 connect_timeout: float = 10.0, lease_s: float | None = None,
                 compress: bool = False) -> None:
        _need_psycopg()
        if not isinstance(url, str) or not url:
            raise ConfigError("a PostgreSQL journal needs a connection URL, e.g. "
                              "postgresql://user@host/db")
        self.url = url
        self.sync = sync
        self.readonly = readonly
        self.compress = compress
        self._format = chain.COMPRESSED if compress else chain.FORMAT
        self.pid = os.getpid()
        self.connect_timeout = float(connect_timeout)
        self.name = _display(url)
        self.create = create
        self._closed = False
        self._lock = threading.Lock()
        self._key: bytes | None = None
        self._key_lock = threading.Lock()
        #: Transactions the writer committed (group commit: fewer than the appends).
        self.commits = 0
        #: Appends those transactions held.
        self.appended = 0
        #: Test hook: called with the cursor inside every append transaction, after its
        #: synchronous_commit is set and before anything is written.
        self.transaction_hook: Callable[[Any], None] | None = None
        #: Test hook: called with the connection inside every append transaction once the
        #: rows of its runs are locked (a client frozen there holds them).
        self.locked_hook: Callable[[Any], None] | None = None
        self._sync_sql = _SYNC_ON if sync else _SYNC_OFF
        self._lease_given = lease_s is not None
        self._owners_seen: set[str] = set()
        self.lease_s = DEFAULT_LEASE_S
        self._begin_sql = self._sync_sql
        self.set_lease(DEFAULT_LEASE_S if lease_s is None else lease_s)
        conn = self._connect(autocommit=True)
        try:
            self.schema = self._schema_of(conn, schema)
            self.name = f"{self.name} (schema {self.schema})"
            self._q = {k: self._sql(v) for k, v in _SQL.items()}
            if readonly:
                self._check_schema(conn)
            else:
                self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        conn.close()
        self._writer_conn: Any = None
        self._pool = _Conns(lambda: self._connect(autocommit=True), pool_size,
                            self.connect_timeout)
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="boundloop-journal-pg",
                                        daemon=True)
        if not readonly:
            self._writer.start()

    # -- connections ---------------------------------------------------------------------
    def _sql(self, text: str) -> str:
        return text.replace("@.", _quote_ident(self.schema) + ".")

    def set_lease(self, lease_s: float) -> None:
        """Make the server-side timeouts follow runners' leases of ``lease_s`` (see
        ``timeouts``); from the next transaction on, and for new connections."""
        if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) \
                or not lease_s > 0:
            raise ConfigError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self.lease_s = float(lease_s)
        settings = "".join(f", set_config('{k}', '{v}ms', true)"
                           for k, v in timeouts(self.lease_s).items())
        self._begin_sql = self._sync_sql + settings  # one string: swapped atomically

    def _connect(self, autocommit: bool) -> Any:
        try:
            conn = psycopg.connect(self.url, autocommit=autocommit,
                                   connect_timeout=max(1, int(self.connect_timeout)),
                                   **_keepalives(self.url, self.lease_s))
        except psycopg.Error as exc:
            raise JournalUnavailable(f"cannot connect to {self.name}: "
                                     f"{str(exc).strip() or type(exc).__name__}") from None
        except Exception as exc:  # a malformed URL, say
            raise ConfigError(f"cannot use {self.name} as a PostgreSQL journal: {exc}") \
                from None
        if self.readonly:
            conn.execute("SET default_transaction_read_only = on")
        return conn

    def _schema_of(self, conn: Any, schema: str | None) -> str:
        if schema is not None:
            if not isinstance(schema, str) or not schema or "\x00" in schema:
                raise ConfigError(f"schema must be a non-empty name, got {schema!r}")
            return schema
        found = conn.execute("SELECT current_schema()").fetchone()[0]
        if found is None:
            raise ConfigError(f"{self.name} has no schema to keep the journal in (no schema "
                              "of its search_path exists): create one, or pass schema=")
        return str(found)

    def _version_of(self, conn: Any) -> int | None:
        """The schema version, None when the journal's tables do not exist."""
        table = f"{_quote_ident(self.schema)}.boundloop_schema_version"
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
            return None
        row = conn.execute(f"SELECT max(version) FROM {table}").fetchone()
        return 0 if row[0] is None else int(row[0])

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise JournalUnavailable(f"the journal in {self.name} has schema version "
                                     f"{version}, newer than this boundloop's "
                                     f"{SCHEMA_VERSION}: upgrade boundloop to use it")

    def _check_format(self, conn: Any) -> None:
        """The record format must be one this version reads; a writer that compresses
        stamps a format 2 journal 3 (``chain.COMPRESSED``), as LMDB's does."""
        query = "SELECT value FROM @.boundloop_meta WHERE key = 'format'"
        raw = conn.execute(self._sql(query)).fetchone()
        version = None if raw is None or len(raw[0]) != 4 else int.from_bytes(raw[0], "big")
        if version not in chain.READS:
            newer = version is not None and version > chain.COMPRESSED
            raise JournalUnavailable(f"the journal in {self.name} has record format "
                                     f"{version}, and this boundloop reads formats "
                                     f"{', '.join(map(str, chain.READS))} only"
                                     + (": upgrade boundloop to read it" if newer else ""))
        if version < self._format and not self.readonly:
            try:
                conn.execute(self._sql("UPDATE @.boundloop_meta SET value = %s WHERE key = "
                                       "'format'"), (self._format.to_bytes(4, "big"),))
            except psycopg.errors.InsufficientPrivilege as exc:
                raise JournalUnavailable(
                    f"cannot mark the journal in {self.name} as holding compressed records "
                    f"(record format {self._format}): {exc}; grant this role UPDATE on "
                    "boundloop_meta, or open it once with compress=True as its owner") \
                    from None

    def _check_schema(self, conn: Any) -> None:
        """A read-only open: the tables must be there, at this version."""
        version = self._version_of(conn)
        if version is None:
            raise JournalUnavailable(f"no journal in {self.name}; run a command that creates "
                                     "one, or pass the right --journal")
        self._check_version(version)
        if version < SCHEMA_VERSION:
            raise JournalUnavailable(f"the journal in {self.name} has schema version "
                                     f"{version}; open it once with a writer (a Runner) of "
                                     "this boundloop to migrate it")
        self._check_format(conn)

    def _migrate(self, conn: Any) -> None:
        """Create or migrate the schema, under an advisory lock held by one opener at a
        time (workers starting together)."""
        try:
            # Up to date (the common case): no DDL, so no CREATE privilege is needed.
            found = self._version_of(conn)
            if found == SCHEMA_VERSION:
                self._check_format(conn)
                return
            if found is None and not self.create:
                raise JournalUnavailable(f"no journal in {self.name}; run a command that "
                                         "creates one, or pass the right --journal")
            with conn.transaction():
                conn.execute(self._begin_sql)  # a frozen opener does not hold the lock long
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(self.schema),))
                if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                                (self.schema,)).fetchone() is None:
                    conn.execute(f"CREATE SCHEMA {_quote_ident(self.schema)}")
                conn.execute(self._sql(
                    "CREATE TABLE IF NOT EXISTS @.boundloop_schema_version ("
                    "version integer PRIMARY KEY, applied_ts double precision NOT NULL)"))
                conn.execute(self._sql("REVOKE ALL ON @.boundloop_schema_version FROM PUBLIC"))
                version = self._version_of(conn) or 0
                self._check_version(version)
                for number in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in _MIGRATIONS[number]:
                        conn.execute(self._sql(statement))
                    conn.execute(self._sql("INSERT INTO @.boundloop_schema_version "
                                           "(version, applied_ts) VALUES (%s, %s)"),
                                 (number, time.time()))
            self._check_format(conn)
        except JournalError:
            raise
        except psycopg.errors.InsufficientPrivilege as exc:
            raise JournalUnavailable(f"cannot create the journal's tables in {self.name}: "
                                     f"{exc}; grant this role CREATE on the schema, or have "
                                     "its owner open the journal once") from None
        except psycopg.Error as exc:
            raise JournalUnavailable(f"cannot prepare the journal in {self.name}: {exc}") \
                from None

    def _error(self, exc: BaseException) -> JournalError:
        """What a psycopg error escaping a journal operation is to the caller."""
        if isinstance(exc, JournalError):
            return exc
        if psycopg is not None and isinstance(exc, (psycopg.errors.DataCorrupted,
                                                    psycopg.errors.IndexCorrupted)):
            return JournalCorrupt(f"the journal in {self.name} is damaged: PostgreSQL "
                                  f"reports {exc}; restore it from a backup")
        if psycopg is not None and isinstance(exc, psycopg.errors.LockNotAvailable):
            return JournalUnavailable(f"journal error: {self.name}: a run's row stayed locked "
                                      f"by another session past lock_timeout; nothing of "
                                      "this append was stored")
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return JournalUnavailable(f"journal error: {self.name}: {text}")

    def _run(self, fn: Callable[[Any], Any], write: bool = False) -> Any:
        """``fn(conn)`` on a pooled connection (in one transaction with durable commit when
        ``write``), once more on a new connection when the first one was lost (every such
        ``fn`` is idempotent). No psycopg error escapes."""
        self._usable(write=write)
        for attempt in range(2):
            try:
                with self._pool.connection() as conn:
                    if not write:
                        return fn(conn)
                    with conn.transaction():
                        conn.execute(self._begin_sql)
                        return fn(conn)
            except JournalError:
                raise
            except psycopg.OperationalError as exc:
                if attempt == 0 and not self._closed:
                    # The server may have restarted: every idle connection is broken too.
                    self._pool.discard_idle()
                    continue
                raise self._error(exc) from None
            except psycopg.Error as exc:
                raise self._error(exc) from None
        raise AssertionError("unreachable")

    def _rows(self, key: str, params: Any = ()) -> list[Any]:
        return self._run(lambda conn: conn.execute(self._q[key], params).fetchall())  # type: ignore[no-any-return]

    # -- the redaction key (as LmdbJournal's: boundloop.keys finds and keeps it; the meta
    # table keeps only the journal's id and the key's fingerprint) -----------------------
    _META_KEYS = [keys.META_JOURNAL_ID.decode(), keys.META_FINGERPRINT.decode()]

    def _key_meta(self, rows: list[Any]) -> tuple[str | None, str | None]:
        found = {k: bytes(v) for k, v in rows}
        return (keys.journal_id_of(found.get(self._META_KEYS[0]), self.name),
                keys.fingerprint_of(found.get(self._META_KEYS[1]), self.name))

    def _read_key(self) -> bytes:
        """A read-only open's key: the journal's when it can be found, else a random key of
        this open's own (see ``LmdbJournal._read_key``). Writes nothing."""
        try:
            journal_id, recorded = self._key_meta(self._rows("meta", (self._META_KEYS,)))
        except JournalError:
            journal_id = recorded = None
        found = keys.find(journal_id, recorded)
        return found if found is not None else secrets.token_bytes(keys.MIN_KEY_BYTES)

    def _load_key(self, source: keys.KeySource | None = None) -> bytes:
        """A writer's key (``keys.resolve``): the journal gets an id at its first key, and the
        key's fingerprint is recorded once; a key with another fingerprint is refused."""
        if self.readonly:
            given = keys.given_key(source, None)
            if given is None:
                return self._read_key()
            _, recorded = self._key_meta(self._rows("meta", (self._META_KEYS,)))
            keys.check_fingerprint(given[0], recorded, given[1], self.name)
            return given[0]

        def ids(conn: Any) -> tuple[str | None, str | None]:
            conn.execute(self._q["meta_add"], (self._META_KEYS[0],
                                               keys.new_journal_id().encode()))
            return self._key_meta(conn.execute(self._q["meta"],
                                               (self._META_KEYS,)).fetchall())

        journal_id, recorded = self._run(ids, write=True)
        assert journal_id is not None
        key = keys.resolve(source, journal_id=journal_id, recorded=recorded, journal_dir=None,
                           journal=self.name)
        if recorded is None:
            mine = keys.fingerprint(key)

            def record(conn: Any) -> str | None:
                conn.execute(self._q["meta_add"], (self._META_KEYS[1], mine.encode()))
                return self._key_meta(conn.execute(self._q["meta"],
                                                   (self._META_KEYS,)).fetchall())[1]

            # Another worker may have recorded its key meanwhile: then it must be this one.
            raced = self._run(record, write=True)
            keys.check_fingerprint(key, raced, "this runner", self.name, journal_id)
        return key

    def _key_place(self) -> tuple[Path | None, str]:
        return None, self.name

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _usable(self, write: bool = False) -> None:
        if write and self.readonly:
            raise JournalUnavailable(f"the journal in {self.name} was opened read-only")
        if self._closed:
            raise JournalUnavailable(f"the journal in {self.name} is closed; open it again")
        if os.getpid() != self.pid:
            raise JournalUnavailable("this journal was opened before fork(), and its "
                                     "connections cannot be shared across fork(): open the "
                                     "journal in the process that uses it")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join()
        if os.getpid() == self.pid:
            self._pool.close()

    def __repr__(self) -> str:
        return f"PostgresJournal({self.name!r})"

    # -- writing -------------------------------------------------------------------------
    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
               done: Done, fence: Fence | None = None) -> None:
        try:
            check_run_id(run_id)
            events = list(events)
            encoded = codec.stored(events, run_id, self.compress)
            request = _Request(run_id, expected_seq, events, encoded, done, fence)
            with self._lock:  # close() cannot slip in between the check and the put
                self._usable(write=True)
                self._queue.put(request)
        except Exception as exc:
            done(exc)

    def _write_loop(self) -> None:
        try:
            for batch in batches(self._queue, MAX_BATCH):
                self._commit(batch)
        finally:
            self._fail_pending()
            self._drop_writer()

    def _fail_pending(self) -> None:
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                with contextlib.suppress(Exception):
                    req.done(JournalUnavailable("the journal was closed before this append"))

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

    #: Called by the writer after each durable commit: ``(latency_s, appends)`` (telemetry,
    #: as ``LmdbJournal.on_commit``).
    on_commit: Callable[[float, int], None] | None = None
    #: Called as a commit is sent, to wait for the server (as ``LmdbJournal.before_sync``).
    before_sync: Callable[[], None] | None = None

    def _commit(self, batch: list[_Request]) -> None:
        started = time.perf_counter()
        try:
            if self._closed:
                raise JournalUnavailable(f"the journal in {self.name} is closed")
            outcomes = self._commit_batch(batch)
        except JournalError as exc:
            outcomes = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any bad append
            outcomes = [JournalUnavailable(f"journal write failed: {type(exc).__name__}: "
                                           f"{exc}")] * len(batch)
        answer(batch, outcomes, started, self.on_commit)

    def _begin(self, cur: Any) -> None:
        # Every statement whose rows are fetched has a cursor of its own: in pipeline mode a
        # cursor's earlier result can arrive after its next execute and be taken for it.
        cur.connection.execute(self._begin_sql)
        hook = self.transaction_hook
        if hook is not None:
            hook(cur.connection.cursor())

    def _commit_batch(self, batch: list[_Request]) -> list[BaseException | None]:
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

    def _commit_one_by_one(self, batch: list[_Request]) -> list[BaseException | None]:
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

    def _statement_error(self, req: _Request, exc: BaseException) -> JournalError:
        if isinstance(exc, psycopg.errors.LockNotAvailable) and _is_claim(req):
            return SequenceConflict(f"run {req.run_id!r} is being appended to (claimed?) by "
                                    "another worker right now; this claim was not made")
        if isinstance(exc, psycopg.errors.UniqueViolation):
            return chain.ChainError(req.run_id, req.expected_seq + 1,
                                    "a record past the run's last is already stored")
        return self._error(exc)

    def _finish(self, conn: Any, batch: list[_Request],
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

    def _resolve(self, batch: list[_Request], outcome: _Outcome, backend: int,
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

    def _apply(self, cur: Any, reqs: Sequence[_Request], pipeline: Any = None) -> _Outcome:
        """Check and write ``reqs`` in the open transaction (not committed): every append is
        checked, in order, before anything of it is written (see the module's docstring)."""
        now = time.time()
        ids = sorted({r.run_id for r in reqs})
        conn = cur.connection  # a new cursor for each statement whose rows are fetched
        lock = self._q["lock_nowait"] if reqs and all(_is_claim(r) for r in reqs) \
            else self._q["lock"]
        rows: dict[str, _Index] = {
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
                rows[rid] = _Index(rid, order, created_ts=now, updated_ts=now,
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
                   and _claims_from(r, rows[r.run_id].owner)}
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
            info = rows.get(rid)
            exists = info is not None and (rid not in fresh or rid in used)
            fence = req.fence
            if fence is not None and exists and info is not None and (
                    info.owner != fence.owner or info.epoch != fence.epoch):
                errors.append(LeaseLost(
                    f"run {rid!r} is owned by {info.owner!r} at epoch {info.epoch}, not by "
                    f"{fence.owner!r} at epoch {fence.epoch}; this runner stopped driving it"))
                continue
            last = info.last_seq if exists and info is not None else 0
            if last != req.expected_seq:
                errors.append(SequenceConflict(
                    f"run {rid!r} is at sequence {last}, not {req.expected_seq}; another "
                    "writer appended first"))
                continue
            assert info is not None  # a missing run with expected_seq 0 was created above
            if len(info.head) != chain.LINK_SIZE:
                errors.append(chain.ChainError(rid, last, "the run's row holds no chain head"))
                continue
            if rid in claimed and owner_alive(alive.get(info.owner)) \
                    and _claims_from(req, info.owner):
                errors.append(SequenceConflict(
                    f"run {rid!r}: its owner {info.owner!r} is alive (its lease was renewed "
                    "after it was judged gone); the claim is refused"))
                continue
            new = msgspec.structs.replace(info)
            epochs: list[int] = []
            refused: BaseException | None = None
            for event in req.events:
                match event:
                    case ev.RunAdmitted():
                        new.parent_run_id = event.parent_run_id
                        new.owner, new.epoch = event.owner, 1
                    case ev.OwnerClaimed():
                        epoch = event.epoch or new.epoch + 1
                        if epoch != new.epoch + 1:
                            refused = SequenceConflict(
                                f"run {rid!r} is at epoch {new.epoch}; a claim of epoch "
                                f"{epoch} came too late")
                            break
                        new.owner, new.epoch = event.owner, epoch
                    case ev.RunFinished():
                        new.status, new.finished_ts = event.status, event.ts or now
                    case ev.RunResumed() | ev.RunRequeued():
                        new.status, new.finished_ts = None, None
                    case _:
                        pass
                epochs.append(new.epoch)
            if refused is not None:
                errors.append(refused)
                continue
            head, seq = new.head, last
            for event, data, epoch in zip(req.events, req.encoded, epochs, strict=True):
                seq += 1
                head = chain.link(head, data)
                e_run.append(rid)
                e_seq.append(seq)
                e_epoch.append(epoch)
                e_kind.append(_tag(event))
                e_body.append(data)
                e_link.append(head)
            new.head, new.last_seq, new.updated_ts = head, seq, now
            rows[rid] = new
            used.add(rid)
            errors.append(None)
            if req.encoded:
                proofs.append((i, rid, seq, head))
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
                raise chain.ChainError(run_id, seq, f"the record does not decode: {exc}") \
                    from None
            out.append((seq, event))
            expected += 1
        if expected - 1 < last:
            raise chain.ChainError(run_id, expected, f"the record is missing (the run's row "
                                                     f"says it has {last})")
        if expected - 1 > last:
            raise chain.ChainError(run_id, last + 1, f"a record past the run's last (its row "
                                                     f"says it has {last})")
        if prev != head:
            raise chain.ChainError(run_id, last, "the chain does not end at the head kept in "
                                                 "the run's row (its last record was altered "
                                                 "or replaced)")
        return out, head

    def chain_head(self, run_id: str) -> bytes:
        """Check the whole run and return its chain head (as ``LmdbJournal.chain_head``).

        Raises:
            UnknownRun: no run has that id.
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        self._usable()
        if not valid_run_id(run_id):
            raise UnknownRun(f"{run_id!r} cannot name a run")
        _, head = self._read(run_id, 0)
        if head is None:
            raise UnknownRun(f"no run {run_id!r} in this journal; `boundloop runs` lists them")
        return head

    def stored_head(self, run_id: str) -> bytes | None:
        """The chain head the run's row keeps (unchecked), None when unreadable."""
        try:
            info = self.find(run_id)
        except JournalCorrupt:
            return None
        return None if info is None else info.head  # type: ignore[attr-defined]

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
        victims = [i.run_id for i in self.infos()
                   if i.finished_ts is not None and i.finished_ts < finished_before
                   and not (keep is not None and keep(i))]
        if dry_run or not victims:
            return victims
        if progress is not None:
            progress(0, len(victims))
        # Checked again where the rows are deleted: a run resumed since is kept.
        gone = {r[0] for r in self._run(lambda conn: conn.execute(
            self._q["prune"], (victims, finished_before)).fetchall(), write=True)}
        if progress is not None:
            progress(len(victims), len(victims))
        return [rid for rid in victims if rid in gone]
