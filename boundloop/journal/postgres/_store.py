"""The PostgreSQL journal: opening it, its schema and migrations, its format, the key,
connections and transactions, its lifecycle."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boundloop import keys
from boundloop.errors import ConfigError, JournalCorrupt, JournalError, JournalUnavailable
from boundloop.journal import chain
from boundloop.journal._core import KeyBinding, Request, format_bytes, stamp_wanted
from boundloop.journal.base import Chained
from boundloop.journal.postgres._conn import (
    SCHEMES,
    _Conns,
    _display,
    _keepalives,
    _lock_key,
    _need_psycopg,
    _quote_ident,
    psycopg,
    url_scheme,
)
from boundloop.journal.postgres._reads import _Reads
from boundloop.journal.postgres._sql import (
    _MIGRATIONS,
    _SQL,
    _SYNC_OFF,
    _SYNC_ON,
    DEFAULT_LEASE_S,
    SCHEMA_VERSION,
    timeouts,
)
from boundloop.journal.postgres._writer import _Writes


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



class PostgresJournal(_Writes, _Reads, KeyBinding, Chained):
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
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
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
        if stamp_wanted(version, f"the journal in {self.name}", self._format, self.readonly):
            try:
                conn.execute(self._sql("UPDATE @.boundloop_meta SET value = %s WHERE key = "
                                       "'format'"), (format_bytes(self._format),))
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

    # -- the redaction key (KeyBinding; the meta table keeps the journal's id and the
    # key's fingerprint) ------------------------------------------------------------------
    _META_KEYS = [keys.META_JOURNAL_ID.decode(), keys.META_FINGERPRINT.decode()]

    def _key_rows(self, rows: list[Any]) -> tuple[bytes | None, bytes | None]:
        found = {k: bytes(v) for k, v in rows}
        return found.get(self._META_KEYS[0]), found.get(self._META_KEYS[1])

    def _meta_get(self) -> tuple[bytes | None, bytes | None]:
        return self._key_rows(self._rows("meta", (self._META_KEYS,)))

    def _meta_add(self, name: bytes, value: bytes) -> tuple[bytes | None, bytes | None, bool]:
        def add(conn: Any) -> tuple[bytes | None, bytes | None, bool]:
            conn.execute(self._q["meta_add"], (name.decode(), value))
            found = self._key_rows(conn.execute(self._q["meta"],
                                                (self._META_KEYS,)).fetchall())
            # No older version kept a key file beside a database: nothing to adopt.
            return found[0], found[1], False

        return self._run(add, write=True)  # type: ignore[no-any-return]

    def _key_place(self) -> tuple[Path | None, str]:
        return None, self.name

    # -- lifecycle -----------------------------------------------------------------------
    def _label(self) -> str:
        return f"the journal in {self.name}"

    def _forked(self) -> str:
        return ("this journal was opened before fork(), and its connections cannot be "
                "shared across fork(): open the journal in the process that uses it")

    def close(self) -> None:
        if not self._stop_writer():
            return
        if os.getpid() == self.pid:
            self._pool.close()

    def __repr__(self) -> str:
        return f"PostgresJournal({self.name!r})"

