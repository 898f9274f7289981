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

The package, by job: ``_store`` (PostgresJournal: opening, schema and migrations, format,
key, connections, lifecycle), ``_writer`` (appends: group commit in pipeline mode, the slow
path, a lost COMMIT), ``_reads`` (checked reads, owners, claims, pruning), ``_sql`` (the
schema and statements), ``_conn`` (URLs, the readers' pool, keepalives). The checks every
backend shares (fencing, the chain, the format stamp, the key) are ``journal._core``'s.
"""

from __future__ import annotations

from boundloop.journal.postgres._conn import SCHEMES as SCHEMES
from boundloop.journal.postgres._conn import _display as _display
from boundloop.journal.postgres._conn import is_url as is_url
from boundloop.journal.postgres._conn import url_scheme as url_scheme
from boundloop.journal.postgres._sql import DEFAULT_LEASE_S as DEFAULT_LEASE_S
from boundloop.journal.postgres._sql import MAX_BATCH as MAX_BATCH
from boundloop.journal.postgres._sql import SCHEMA_VERSION as SCHEMA_VERSION
from boundloop.journal.postgres._sql import timeouts as timeouts
from boundloop.journal.postgres._store import PostgresJournal as PostgresJournal
from boundloop.journal.postgres._store import open_url as open_url
from boundloop.journal.postgres._writer import _Request as _Request

__all__ = ["PostgresJournal", "SCHEMA_VERSION", "SCHEMES", "is_url", "open_url", "url_scheme"]
