"""The PostgreSQL journal's schema, its statements and the session settings of its
transactions."""

from __future__ import annotations

from boundloop.journal import chain
from boundloop.journal._core import format_bytes

#: The schema version this boundloop writes and reads (``boundloop_schema_version``).
SCHEMA_VERSION = 1
#: Largest number of queued appends folded into one transaction.
MAX_BATCH = 1024

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
        f"'\\x{format_bytes(chain.FORMAT).hex()}'::bytea)",
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

