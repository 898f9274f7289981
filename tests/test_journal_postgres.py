"""The journal contract on PostgreSQL (SPEC 12), plus what only a shared server has: races
between connections, synchronous_commit forced on, group commit across the batch, Runners in
several processes on one database, and a server crash (``pg_ctl -m immediate``).

A real PostgreSQL runs on loopback for the session (``pg_server``); without its binaries the
whole module is skipped, with the reason naming the missing binary.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from journal_contract import admitted, several, step

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import Fence, OwnerRecord
from boundloop.testing import JournalContract

psycopg = pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg 3: pip "
                                                "install 'boundloop[postgres]'")

from pg_server import PgServer  # noqa: E402

from boundloop.journal import codec  # noqa: E402
from boundloop.journal.postgres import PostgresJournal  # noqa: E402

TESTS = Path(__file__).parent


def schema_for(path: Path) -> str:
    """The schema that stands for the journal "at" ``path``: one per test and path, the
    same again when the test reopens it."""
    return "j_" + hashlib.blake2b(str(path).encode(), digest_size=10).hexdigest()


@pytest.fixture
def database(pg: PgServer) -> str:
    """The URL of a new, empty database."""
    return pg.create_database("db_" + uuid.uuid4().hex[:12])


def _sql(url: str, query: str, params: Any = ()) -> list[Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


class TestPostgresJournal(JournalContract):
    """The whole contract, unchanged, with one schema per journal path."""

    @pytest.fixture(autouse=True)
    def _server(self, pg: PgServer) -> None:
        self.url = pg.url()

    def make_store(self, path: Path) -> PostgresJournal:
        return PostgresJournal(self.url, schema=schema_for(path))

    # A PostgreSQL journal has no directory: what the two tests of its mode mean here is
    # that nobody but the journal's role can use its tables.
    def test_directory_is_private(self, journal: PostgresJournal) -> None:  # type: ignore[override]
        """No privilege on any journal table for PUBLIC (the directory's 0700/0600)."""
        journal.append("r1", 0, several("r1"))
        journal.put_owner(OwnerRecord("o", 1, "h", 1.0, 2.0))
        rows = _sql(self.url, "SELECT c.relname, c.relacl::text FROM pg_class c JOIN "
                              "pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
                              "AND c.relkind IN ('r', 'S')", (journal.schema,))
        assert len(rows) >= 6, rows
        for name, acl in rows:
            for priv in ("SELECT", "INSERT", "UPDATE", "DELETE"):
                if name.endswith("_seq"):
                    continue
                assert not _sql(self.url, "SELECT has_table_privilege('public', %s, %s)",
                                (f'"{journal.schema}".{name}', priv))[0][0], (name, acl)

    def test_an_existing_directory_is_made_private(  # type: ignore[override]
            self, path: Path) -> None:
        """A schema whose default privileges grant PUBLIC everything still gets private
        tables (the existing 0755 directory made 0700)."""
        schema = schema_for(path)
        _sql(self.url, f'CREATE SCHEMA "{schema}"')
        _sql(self.url, f'ALTER DEFAULT PRIVILEGES IN SCHEMA "{schema}" GRANT ALL ON TABLES '
                       "TO PUBLIC")
        j = self.make_store(path)
        try:
            j.append("r1", 0, [admitted("r1")])
            for table in ("boundloop_runs", "boundloop_events", "boundloop_meta",
                          "boundloop_owners", "boundloop_schema_version"):
                assert not _sql(self.url, "SELECT has_table_privilege('public', %s, 'SELECT')",
                                (f'"{schema}".{table}',))[0][0], table
        finally:
            j.close()


class TestPostgresJournalCompressed(TestPostgresJournal):
    """The whole contract again with the records stored compressed (format 3)."""

    def make_store(self, path: Path) -> PostgresJournal:
        return PostgresJournal(self.url, schema=schema_for(path), compress=True)

    def test_the_records_are_stored_compressed(self, path: Path) -> None:
        with self.make_store(path) as j:
            j.append("run-compressed", 0, several("run-compressed"))
        rows = _sql(self.url, f'SELECT body FROM "{schema_for(path)}".boundloop_events')
        assert len(rows) == len(several("x")) and all(bytes(b)[0] == codec.MARK
                                                     for (b,) in rows)


def _format(url: str, schema: str) -> int:
    [(raw,)] = _sql(url, f"SELECT value FROM \"{schema}\".boundloop_meta WHERE key = 'format'")
    return int.from_bytes(bytes(raw), "big")


def test_a_compressing_writer_stamps_format_3_and_reads_plain_records(
        pg: PgServer, tmp_path: Path) -> None:
    url, schema = pg.url(), schema_for(tmp_path)
    first, second = several("r1"), several("r2")
    with PostgresJournal(url, schema=schema) as j:
        j.append("r1", 0, first)
    assert _format(url, schema) == 2
    with PostgresJournal(url, schema=schema, readonly=True, compress=True) as ro:
        assert list(ro.events("r1")) == first
    assert _format(url, schema) == 2  # a reader stamps nothing
    with PostgresJournal(url, schema=schema, compress=True) as j:
        j.append("r2", 0, second)
        assert list(j.events("r1")) == first and list(j.events("r2")) == second
    assert _format(url, schema) == 3
    bodies = _sql(url, f'SELECT run_id, body FROM "{schema}".boundloop_events ORDER BY run_id, '
                       "seq")
    assert {r for r, b in bodies if bytes(b)[0] == codec.MARK} == {"r2"}
    with PostgresJournal(url, schema=schema) as j:  # a plain writer never goes back
        assert list(j.events("r2")) == second
    assert _format(url, schema) == 3


# -- the schema ---------------------------------------------------------------------------
def test_schema_is_versioned_and_the_key_is_not_stored(pg: PgServer, tmp_path: Path) -> None:
    url, schema = pg.url(), schema_for(tmp_path)
    with PostgresJournal(url, schema=schema) as j:
        key = j.secret_key
        j.append("r1", 0, [admitted("r1")])
    assert _sql(url, f'SELECT version FROM "{schema}".boundloop_schema_version') == [(1,)]
    meta = dict(_sql(url, f'SELECT key, value FROM "{schema}".boundloop_meta'))
    assert set(meta) == {"format", "journal_id", "key_fingerprint"}
    assert not any(key in bytes(v) for v in meta.values())
    # A newer schema is refused, not read.
    _sql(url, f'INSERT INTO "{schema}".boundloop_schema_version VALUES (99, 0)')
    with pytest.raises(bl.JournalUnavailable, match="newer"):
        PostgresJournal(url, schema=schema)


def test_readonly_open_writes_nothing(pg: PgServer, tmp_path: Path) -> None:
    url = pg.url()
    with pytest.raises(bl.JournalUnavailable, match="no journal"):
        PostgresJournal(url, schema=schema_for(tmp_path / "none"), readonly=True)
    assert not _sql(url, "SELECT 1 FROM pg_namespace WHERE nspname = %s",
                    (schema_for(tmp_path / "none"),))
    schema = schema_for(tmp_path)
    with PostgresJournal(url, schema=schema) as j:
        j.append("r1", 0, several("r1"))
        key = j.secret_key
    with PostgresJournal(url, schema=schema, readonly=True) as ro:
        assert [type(e) for e in ro.events("r1")] == [type(e) for e in several("r1")]
        assert ro.secret_key == key  # found in the state directory by the journal id
        with pytest.raises(bl.JournalUnavailable):
            ro.append("r1", 12, [step("r1", 1)])
        with pytest.raises(bl.JournalUnavailable):
            ro.put_owner(OwnerRecord("o", 1, "h", 1.0, 2.0))


def test_damage_is_reported_with_run_and_seq(pg: PgServer, tmp_path: Path) -> None:
    url, schema = pg.url(), schema_for(tmp_path)
    with PostgresJournal(url, schema=schema) as j:
        j.append("r1", 0, several("r1"))
        head = j.chain_head("r1")
        _sql(url, f'UPDATE "{schema}".boundloop_events SET body = body || %s '
                  "WHERE run_id = 'r1' AND seq = 5", (b"\x00",))
        with pytest.raises(bl.JournalCorrupt) as info:
            list(j.read("r1"))
        assert (info.value.run_id, info.value.seq) == ("r1", 5)  # type: ignore[attr-defined]
        assert j.stored_head("r1") == head
        _sql(url, f'DELETE FROM "{schema}".boundloop_events WHERE run_id = %s AND seq = %s',
             ("r1", 12))
        with pytest.raises(bl.JournalCorrupt):
            j.chain_head("r1")


# -- races between connections ----------------------------------------------------------
def test_fenced_appends_from_two_connections_race(pg: PgServer, tmp_path: Path) -> None:
    """The old owner appends (fenced) while another worker claims, on another connection:
    exactly one wins; the loser hears LeaseLost (old owner) or SequenceConflict (claimer)
    and stored nothing."""
    url, schema = pg.url(), schema_for(tmp_path)
    a, b = PostgresJournal(url, schema=schema), PostgresJournal(url, schema=schema)
    try:
        winners = {"owner": 0, "claim": 0}
        for i in range(20):
            rid = f"race{i}"
            a.append(rid, 0, [admitted(rid, owner="A")], Fence("A", 1))
            barrier = threading.Barrier(2)
            out: dict[str, Any] = {}

            def owner_step(rid: str = rid, barrier: threading.Barrier = barrier,
                           out: dict[str, Any] = out) -> None:
                barrier.wait()
                try:
                    out["owner"] = a.append(rid, 1, [step(rid, 1), step(rid, 2)],
                                            Fence("A", 1))
                except bl.JournalError as exc:
                    out["owner"] = exc

            def claim(rid: str = rid, barrier: threading.Barrier = barrier,
                      out: dict[str, Any] = out) -> None:
                barrier.wait()
                try:
                    out["claim"] = b.append(rid, 1, [ev.OwnerClaimed(run_id=rid, owner="B",
                                                                     epoch=2)])
                except bl.JournalError as exc:
                    out["claim"] = exc

            threads = [threading.Thread(target=owner_step), threading.Thread(target=claim)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            kinds = [type(e).__name__ for e in b.events(rid)]
            if isinstance(out["owner"], int):
                winners["owner"] += 1
                assert isinstance(out["claim"], bl.SequenceConflict), out
                assert kinds == ["RunAdmitted", "ModelStepStarted", "ModelStepStarted"]
                assert (b.info(rid).owner, b.info(rid).epoch) == ("A", 1)
            else:
                winners["claim"] += 1
                assert out["claim"] == 2 and isinstance(out["owner"], bl.LeaseLost), out
                assert kinds == ["RunAdmitted", "OwnerClaimed"]
                assert (a.info(rid).owner, a.info(rid).epoch) == ("B", 2)
                # The old owner stays fenced whatever sequence it tries.
                with pytest.raises(bl.LeaseLost):
                    a.append(rid, 2, [step(rid, 3)], Fence("A", 1))
        assert sum(winners.values()) == 20
    finally:
        a.close()
        b.close()


def test_two_connections_creating_one_run(pg: PgServer, tmp_path: Path) -> None:
    url, schema = pg.url(), schema_for(tmp_path)
    journals = [PostgresJournal(url, schema=schema) for _ in range(2)]
    try:
        for i in range(15):
            rid = f"new{i}"
            barrier = threading.Barrier(2)
            out: list[Any] = [None, None]

            def create(k: int, rid: str = rid, barrier: threading.Barrier = barrier,
                       out: list[Any] = out) -> None:
                barrier.wait()
                try:
                    out[k] = journals[k].append(rid, 0, [admitted(rid, owner=f"w{k}"),
                                                         step(rid, k)])
                except bl.JournalError as exc:
                    out[k] = exc

            threads = [threading.Thread(target=create, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            won = [k for k in range(2) if out[k] == 2]
            assert len(won) == 1 and isinstance(out[1 - won[0]], bl.SequenceConflict), out
            got = list(journals[0].read(rid))
            assert [s for s, _ in got] == [1, 2]
            assert got[0][1].owner == f"w{won[0]}"  # type: ignore[attr-defined]
        assert journals[0].runs() and len(list(journals[1].runs())) == 15
    finally:
        for j in journals:
            j.close()


# -- durability settings ----------------------------------------------------------------
def test_synchronous_commit_is_forced_on(pg: PgServer, tmp_path: Path) -> None:
    url = pg.url()
    _sql(url, "ALTER SYSTEM SET synchronous_commit = off")
    _sql(url, "SELECT pg_reload_conf()")
    try:
        deadline = time.monotonic() + 10
        while _sql(url, "SHOW synchronous_commit") != [("off",)]:
            assert time.monotonic() < deadline, "the server did not take the setting"
            time.sleep(0.05)
        seen: list[str] = []
        with PostgresJournal(url, schema=schema_for(tmp_path)) as j:
            j.transaction_hook = lambda cur: seen.append(
                cur.execute("SHOW synchronous_commit").fetchone()[0])
            j.append("r1", 0, [admitted("r1")])
            j.append("r1", 1, [step("r1", 1)])
        assert seen == ["on", "on"]
        seen.clear()
        with PostgresJournal(url, schema=schema_for(tmp_path / "nosync"), sync=False) as j:
            j.transaction_hook = lambda cur: seen.append(
                cur.execute("SHOW synchronous_commit").fetchone()[0])
            j.append("r1", 0, [admitted("r1")])
        assert seen == ["off"]  # sync=False asks for it (as LMDB's sync=False)
    finally:
        _sql(url, "ALTER SYSTEM RESET synchronous_commit")
        _sql(url, "SELECT pg_reload_conf()")


# -- group commit -----------------------------------------------------------------------
def test_concurrent_submits_share_transactions(pg: PgServer, tmp_path: Path) -> None:
    with PostgresJournal(pg.url(), schema=schema_for(tmp_path)) as j:
        threads_n, per = 16, 15

        def work(t: int) -> None:
            rid = f"t{t}"
            seq = j.append(rid, 0, [admitted(rid)])
            for n in range(per):
                seq = j.append(rid, seq, [step(rid, n)])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert j.appended == threads_n * (per + 1)
        assert j.commits < j.appended / 2, (j.commits, j.appended)
        for t in range(threads_n):
            assert j.info(f"t{t}").last_seq == per + 1


def _hold_writer(j: PostgresJournal) -> tuple[threading.Event, threading.Event]:
    """Make the writer's next transaction wait (inside it) until released, so that every
    append submitted meanwhile lands in the transaction after it."""
    entered, release = threading.Event(), threading.Event()

    def hook(cur: Any) -> None:
        if not entered.is_set():
            entered.set()
            release.wait(10)

    j.transaction_hook = hook
    return entered, release


def _submit_all(j: PostgresJournal, items: list[tuple[str, int, list[ev.Event]]]
                ) -> list[BaseException | None]:
    answers: list[Any] = [...] * len(items)
    left = threading.Semaphore(0)
    for k, (rid, seq, events) in enumerate(items):
        def done(err: BaseException | None, k: int = k) -> None:
            answers[k] = err
            left.release()
        j.submit(rid, seq, events, done)
    for _ in items:
        assert left.acquire(timeout=30)
    return answers


def test_a_conflict_in_a_batch_fails_alone(pg: PgServer, tmp_path: Path) -> None:
    with PostgresJournal(pg.url(), schema=schema_for(tmp_path)) as j:
        for k in range(6):
            j.append(f"r{k}", 0, [admitted(f"r{k}")])
        entered, release = _hold_writer(j)
        box: list[Any] = []
        j.submit("warm", 0, [admitted("warm")], box.append)
        assert entered.wait(10)
        before = j.commits
        items: list[tuple[str, int, list[ev.Event]]] = [
            (f"r{k}", 1 if k % 2 == 0 else 5, [step(f"r{k}", 1)]) for k in range(6)]
        items.append(("r0", 2, [step("r0", 2)]))  # after r0's first append, same batch
        items.append(("fresh", 0, [admitted("fresh")]))
        items.append(("fresh", 0, [admitted("fresh")]))  # the second creation conflicts
        answers: list[Any] = []
        t = threading.Thread(target=lambda: answers.extend(_submit_all(j, items)))
        t.start()
        time.sleep(0.3)  # all queued behind the held transaction
        release.set()
        t.join(30)
        assert box == [None]
        assert [type(a).__name__ for a in answers] == [
            "NoneType", "SequenceConflict", "NoneType", "SequenceConflict", "NoneType",
            "SequenceConflict", "NoneType", "NoneType", "SequenceConflict"]
        assert j.commits == before + 2  # the held one, then one for the whole batch
        assert [s for s, _ in j.read("r0")] == [1, 2, 3]
        assert [s for s, _ in j.read("r1")] == [1]
        assert [s for s, _ in j.read("fresh")] == [1]


def test_a_failing_statement_fails_only_its_append(pg: PgServer, tmp_path: Path) -> None:
    """A stray record where the next one goes (damage) makes the batch's INSERT fail: the
    batch is redone one append at a time under SAVEPOINTs, and only that append fails."""
    url, schema = pg.url(), schema_for(tmp_path)
    with PostgresJournal(url, schema=schema) as j:
        for k in range(4):
            j.append(f"r{k}", 0, [admitted(f"r{k}")])
        _sql(url, f'INSERT INTO "{schema}".boundloop_events VALUES '
                  "('r2', 2, 1, 'x', '\\x00', '\\x00')")
        entered, release = _hold_writer(j)
        box: list[Any] = []
        j.submit("warm", 0, [admitted("warm")], box.append)
        assert entered.wait(10)
        answers: list[Any] = []
        items: list[tuple[str, int, list[ev.Event]]] = [
            (f"r{k}", 1, [step(f"r{k}", 1)]) for k in range(4)]
        t = threading.Thread(target=lambda: answers.extend(_submit_all(j, items)))
        t.start()
        time.sleep(0.3)
        release.set()
        t.join(30)
        assert [a is None for a in answers] == [True, True, False, True]
        assert isinstance(answers[2], bl.JournalCorrupt)
        for k in (0, 1, 3):
            assert [s for s, _ in j.read(f"r{k}")] == [1, 2]
        assert j.info("r2").last_seq == 1


def test_a_connection_lost_before_commit_is_retried(pg: PgServer, tmp_path: Path) -> None:
    """The writer's server process is terminated in the middle of its transaction: nothing
    was committed, so the batch is redone once on a new connection and succeeds."""
    url = pg.url()
    with PostgresJournal(url, schema=schema_for(tmp_path)) as j:
        j.append("r", 0, [admitted("r")])
        pids: list[int] = []
        entered, release = threading.Event(), threading.Event()

        def hook(cur: Any) -> None:
            if not entered.is_set():
                pids.append(cur.connection.info.backend_pid)
                entered.set()
                release.wait(10)

        j.transaction_hook = hook
        answers: list[Any] = []
        t = threading.Thread(target=lambda: answers.append(j.append("r", 1, [step("r", 1)])))
        t.start()
        assert entered.wait(10)
        assert _sql(url, "SELECT pg_terminate_backend(%s)", (pids[0],)) == [(True,)]
        release.set()
        t.join(30)
        assert answers == [2]
        assert [s for s, _ in j.read("r")] == [1, 2]


def test_an_interrupted_commit_is_resolved_from_the_links(pg: PgServer,
                                                          tmp_path: Path) -> None:
    """White-box: when the answer to COMMIT is lost, the writer reads back the links it
    wrote; appends found there are reported stored, the others not."""
    from boundloop.journal import codec
    from boundloop.journal.postgres import _Request

    def request(rid: str, seq: int, events: list[ev.Event]) -> _Request:
        return _Request(rid, seq, events, [codec.encode(e) for e in events], lambda e: None)

    with PostgresJournal(pg.url(), schema=schema_for(tmp_path)) as j:
        j.append("r", 0, [admitted("r")])
        conn = j._writer_connection()
        committed = [request("r", 1, [step("r", 1)]), request("s", 0, [admitted("s")])]
        with conn.cursor() as cur:
            outcome = j._apply(cur, committed)
        conn.commit()
        lost = RuntimeError("connection lost")
        assert j._resolve(committed, outcome, 0, lost) == [None, None]
        rolled_back = [request("r", 2, [step("r", 2)]), request("t", 0, [admitted("t")])]
        with j._writer_connection().cursor() as cur:
            outcome = j._apply(cur, rolled_back)
        j._writer_connection().rollback()
        answers = j._resolve(rolled_back, outcome, 0, lost)
        assert all(isinstance(a, bl.JournalUnavailable) for a in answers), answers
        assert j.find("t") is None and j.info("r").last_seq == 2


def test_claimable_skips_live_leases_and_locked_runs(pg: PgServer, tmp_path: Path) -> None:
    url, schema = pg.url(), schema_for(tmp_path)
    with PostgresJournal(url, schema=schema) as j:
        now = time.time()
        j.put_owner(OwnerRecord("live", 1, "h", 1.0, now + 60))
        j.put_owner(OwnerRecord("dead", 2, "h", 1.0, now - 60))
        for rid, owner in (("a", "live"), ("b", "dead"), ("c", "unknown"), ("d", "dead")):
            j.append(rid, 0, [admitted(rid, owner=owner)])
        j.append("d", 1, [ev.RunFinished(run_id="d", status="final", exhausted_limit=None,
                                         explanation="", model_steps=0, tool_calls=0)])
        assert [i.run_id for i in j.claimable(10)] == ["b", "c"]
        assert [i.run_id for i in j.claimable(1)] == ["b"]
        # A run another worker is appending to (its row locked) is skipped, not waited for.
        with psycopg.connect(url) as other:
            other.execute(f'SELECT 1 FROM "{schema}".boundloop_runs WHERE run_id = %s '
                          "FOR UPDATE", ("b",))
            t0 = time.monotonic()
            assert [i.run_id for i in j.claimable(10)] == ["c"]
            assert time.monotonic() - t0 < 5
            other.rollback()


# -- Runners ----------------------------------------------------------------------------
def test_a_runner_on_a_postgresql_url(database: str) -> None:
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "echo", {"text": "hi"}),
                                            bl.ToolCall("c2", "echo", {"text": "ho"})]),
                              bl.Final("ok")])

    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        return text.upper()

    with bl.Runner(database) as runner:
        assert isinstance(runner.journal, PostgresJournal)
        result = runner.run(model=model, tools=[echo], prompt="go", run_id="pg-run")
        assert result.status == "final" and result.tool_calls == 2
        events = list(runner.journal.events("pg-run"))
        state = runner.state("pg-run")
    names = [type(e).__name__ for e in events]
    assert names[0] == "RunAdmitted" and names[-1] == "RunFinished"
    assert names.count("CallDecided") == 2 and names.count("CallSucceeded") == 2
    replayed = bl.replay(events)
    assert (replayed.status, replayed.model_steps, replayed.tool_calls) == ("final", 2, 2)
    assert replayed.transcript == result.transcript == state.transcript
    with PostgresJournal(database, readonly=True) as ro:
        assert list(ro.open_runs()) == []
        assert ro.info("pg-run").status == "final"


def test_other_url_schemes_are_refused(tmp_path: Path) -> None:
    for url in ("mysql://u@h/db", "sqlite:///x.db", "lmdb://x"):
        with pytest.raises(bl.ConfigError, match="postgresql://"):
            bl.Runner(url)
    assert not list(Path.cwd().glob("mysql:*"))  # no LMDB directory made of the URL


def test_a_url_with_a_search_path(pg: PgServer, database: str) -> None:
    _sql(database, "CREATE SCHEMA tenant")
    url = database + "?options=-csearch_path%3Dtenant"
    with bl.Runner(url) as runner:
        assert runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                          run_id="r").status == "final"
    assert _sql(database, "SELECT run_id FROM tenant.boundloop_runs") == [("r",)]


_WORKER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import boundloop as bl
from crash_worker import RUN_ID, make_tools, model_for
mode, url, ledger = sys.argv[2:5]
with bl.Runner(url) as runner:
    if mode == "crash":
        runner.run(model=model_for(["charge"]), tools=make_tools(Path(ledger), die=True),
                   prompt="go", run_id=RUN_ID)
    elif mode == "recover":
        print(json.dumps([r.run_id for r in runner.recover()]), flush=True)
        time.sleep(float(sys.argv[5]))  # stay alive: the run's owner now
    elif mode == "resume":
        got = [r.run_id for r in runner.recover()]
        result = runner.resume(RUN_ID, model=model_for(["charge"]), tools=make_tools(Path(ledger)))
        print(json.dumps({"recovered": got, "status": result.status,
                          "tool_calls": result.tool_calls}), flush=True)
"""


def _worker(mode: str, url: str, ledger: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WORKER, str(TESTS), mode, url,
                             str(ledger), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_recovery_across_runner_processes(database: str, tmp_path: Path) -> None:
    """A worker is SIGKILLed inside an idempotent tool's handler; of two workers recovering
    at once, exactly one takes the run; once it is gone too, a third resumes the run and
    retries the call under the same idempotency key."""
    from crash_worker import RUN_ID, ledger_lines

    ledger = tmp_path / "ledger"
    crashed = _worker("crash", database, ledger)
    _, err = crashed.communicate(timeout=60)
    assert crashed.returncode == -signal.SIGKILL, err
    assert [t for _, t in ledger_lines(ledger)] == ["charge"]
    recoverers = [_worker("recover", database, ledger, "2.5") for _ in range(2)]
    outs = []
    for proc in recoverers:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outs.append(json.loads(out))
    assert sorted(outs) == [[], [RUN_ID]], outs  # exactly one claimed it
    resumer = _worker("resume", database, ledger)
    out, err = resumer.communicate(timeout=60)
    assert resumer.returncode == 0, err
    report = json.loads(out)
    assert report == {"recovered": [RUN_ID], "status": "final", "tool_calls": 2}
    lines = ledger_lines(ledger)
    assert len(lines) == 2 and lines[0] == lines[1]  # the same key, retried once
    with PostgresJournal(database, readonly=True) as j:
        claims = [e for e in j.events(RUN_ID) if isinstance(e, ev.OwnerClaimed)]
        assert [c.epoch for c in claims] == [2, 3]
        assert j.info(RUN_ID).epoch == 3 and j.info(RUN_ID).status == "final"


def test_a_server_crash_keeps_every_acknowledged_append(pg: PgServer, tmp_path: Path) -> None:
    """``pg_ctl -m immediate`` (no checkpoint, like a power cut to the database process) in
    the middle of concurrent appends: every append that was acknowledged is there after
    the restart, the chains check, and appending goes on with a new connection."""
    url = pg.url()
    j = PostgresJournal(url, schema=schema_for(tmp_path), connect_timeout=20)
    acked: dict[str, list[int]] = {f"w{t}": [] for t in range(4)}
    unacked: dict[str, list[int]] = {rid: [] for rid in acked}
    stop = threading.Event()
    failures = [0]

    def work(rid: str) -> None:
        seq = j.append(rid, 0, [admitted(rid)])
        n = 0
        while not stop.is_set():
            try:
                seq = j.append(rid, seq, [step(rid, n)])
                acked[rid].append(n)
                n += 1
            except bl.JournalError:
                failures[0] += 1
                time.sleep(0.05)
                try:  # stored or not (an unknown outcome): the journal says
                    seq = j.info(rid).last_seq
                    if seq > 1 and list(j.read(rid, after=seq - 1))[0][1].step == n:
                        unacked[rid].append(n)
                        n += 1
                except bl.JournalError:
                    pass

    threads = [threading.Thread(target=work, args=(rid,)) for rid in acked]
    try:
        for t in threads:
            t.start()
        time.sleep(0.7)
        before = {rid: len(v) for rid, v in acked.items()}
        pg.restart_immediate()
        # Appending goes on once the writer has reconnected (reads wait for the pool, which
        # retries after 1 s, then 2 s, ...): until every worker has appended again.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                len(acked[rid]) > before[rid] + 5 for rid in acked):
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(60)
        assert all(n > 0 for n in before.values()), before
        assert failures[0] > 0  # the crash was seen
        assert all(len(acked[rid]) > before[rid] for rid in acked), "no append after restart"
    finally:
        stop.set()
        j.close()
    with PostgresJournal(url, schema=schema_for(tmp_path)) as again:
        for rid, steps in acked.items():
            stored = [e.step for _, e in list(again.read(rid))[1:]]  # type: ignore[attr-defined]
            assert set(steps) <= set(stored), rid  # every acknowledged append survived
            assert stored == sorted(steps + unacked[rid]), rid  # and nothing else


# -- frozen clients and a server that is down -----------------------------------------------
def test_the_session_timeouts_follow_the_runners_lease(database: str) -> None:
    """A Runner's first owner record tells the journal its lease: every transaction then
    ends an idle transaction after half of it, and waits for a row lock at most the lease
    (at least 1 s)."""
    from boundloop.journal.postgres import timeouts

    assert timeouts(30.0) == {"idle_in_transaction_session_timeout": 15000,
                              "lock_timeout": 30000}
    assert timeouts(0.1) == {"idle_in_transaction_session_timeout": 200, "lock_timeout": 1000}
    with bl.Runner(database, lease_s=0.6) as runner:
        j = runner.journal
        assert isinstance(j, PostgresJournal)
        assert j.lease_s == pytest.approx(0.6, abs=0.1)

        def show(conn: Any) -> list[str]:
            return [conn.execute(f"SHOW {name}").fetchone()[0]
                    for name in ("idle_in_transaction_session_timeout", "lock_timeout",
                                 "synchronous_commit")]

        assert j._run(show, write=True) == ["300ms", "1s", "on"]
    with PostgresJournal(database, lease_s=4.0) as given:
        assert given._run(show, write=True) == ["2s", "4s", "on"]


_FROZEN = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from journal_contract import admitted, step
from boundloop.journal.base import Fence
from boundloop.journal.postgres import PostgresJournal
url, schema, go = sys.argv[2:5]
j = PostgresJournal(url, schema=schema, lease_s=0.4)
j.append("r", 0, [admitted("r", owner="a")])
def hook(conn):  # inside the append's transaction, r's row locked
    j.locked_hook = None
    print("locked", conn.info.backend_pid, flush=True)
    while not Path(go).exists():  # frozen in here (SIGSTOP), then let go
        time.sleep(0.01)
j.locked_hook = hook
try:
    j.append("r", 1, [step("r", 1)], Fence("a", 1))
    print("stored", flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
j.close()
"""


def test_a_frozen_client_in_a_transaction_does_not_hold_its_runs(pg: PgServer,
                                                                tmp_path: Path) -> None:
    """A worker SIGSTOPped inside its append transaction, holding its run's row lock: the
    server ends its idle transaction after half its lease, so another worker's claim goes
    through (instead of waiting for the frozen one to wake up); once woken, the frozen
    worker's append is redone on a new connection, checked afresh, and refused."""
    url, schema, go = pg.url(), schema_for(tmp_path), tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", _FROZEN, str(TESTS), url, schema, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["locked"], proc.communicate(timeout=30)
        proc.send_signal(signal.SIGSTOP)
        frozen_backend = int(line[1])
        t0 = time.monotonic()
        with PostgresJournal(url, schema=schema, lease_s=0.4) as other:
            claim = ev.OwnerClaimed(run_id="r", ts=time.time(), owner="b", epoch=2)
            while True:  # a claim skips a run whose row is held (SPEC 12): try again
                try:
                    assert other.append("r", 1, [claim]) == 2
                    break
                except bl.SequenceConflict as exc:
                    assert "being appended to" in str(exc)
                    assert time.monotonic() - t0 < 3.0
                    time.sleep(0.05)
            waited = time.monotonic() - t0
            assert waited < 3.0, waited  # the frozen session was ended after 200 ms
            assert not _sql(url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                            (frozen_backend,))
            go.touch()
            proc.send_signal(signal.SIGCONT)
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert out.split() == ["LeaseLost"], (out, err)  # fenced: b owns r at epoch 2
            info = other.info("r")
            assert (info.owner, info.epoch, info.last_seq) == ("b", 2, 2)
            assert [type(e).__name__ for e in other.events("r")] == ["RunAdmitted",
                                                                     "OwnerClaimed"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_server_that_is_down_fails_closed_at_once(pg: PgServer, tmp_path: Path) -> None:
    """With the server down, appends, reads and owner records fail with JournalUnavailable
    at once (connections are refused: nothing waits for connect_timeout, nothing is
    reported stored); the first operation after the server is back works."""
    j = PostgresJournal(pg.url(), schema=schema_for(tmp_path), connect_timeout=20)
    try:
        assert j.append("r", 0, [admitted("r")]) == 1
        assert [s for s, _ in j.read("r")] == [1]
        pg.crash()
        try:
            t0 = time.monotonic()
            with pytest.raises(bl.JournalUnavailable):
                j.append("r", 1, [step("r", 1)])
            with pytest.raises(bl.JournalUnavailable):
                j.append("r", 1, [step("r", 1)])  # the writer, without a connection now
            with pytest.raises(bl.JournalUnavailable):
                list(j.read("r"))
            with pytest.raises(bl.JournalUnavailable):
                j.put_owner(OwnerRecord("o", 1, "h", 1.0, time.time() + 5))
            assert time.monotonic() - t0 < 5.0
        finally:
            pg.start_again()
        t0 = time.monotonic()
        assert j.append("r", 1, [step("r", 1)]) == 2  # nothing of the failed ones was stored
        assert [s for s, _ in j.read("r")] == [1, 2]
        assert time.monotonic() - t0 < 5.0
    finally:
        j.close()


def test_the_crash_worker_on_a_url(database: str, tmp_path: Path) -> None:
    """tests/crash_worker.py takes a postgresql:// URL as well as an LMDB directory: killed
    inside a reconcilable tool's handler, its run is recovered and resumed here."""
    from crash_worker import RUN_ID, ledger_lines, make_tools, model_for

    ledger = tmp_path / "ledger"
    out = subprocess.run([sys.executable, str(TESTS / "crash_worker.py"), database,
                          str(ledger), "book,ship", "--die"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    with bl.Runner(database) as runner:
        [found] = runner.recover()  # its process is gone (this machine, this pid namespace)
        assert found.run_id == RUN_ID and [u.tool for u in found.unresolved] == ["book"]
        result = runner.resume(RUN_ID, model=model_for(["book", "ship"]),
                               tools=make_tools(ledger))
    assert result.status == "final"  # book reconciled from the ledger, then ship ran once
    assert [t for _, t in ledger_lines(ledger)] == ["book", "ship"]


def test_recover_skips_a_run_another_worker_is_claiming(database: str) -> None:
    """SPEC 12: recovery skips runs another worker is claiming. A run whose row another
    session holds (as a claim in progress does) is skipped at once, not waited for (the claim
    used to block until lock_timeout and then fail the whole recover()); once free, the next
    recover() takes it."""
    from boundloop.journal.postgres import PostgresJournal as Pg

    with Pg(database) as j:
        for rid in ("o1", "o2", "o3"):
            j.append(rid, 0, [admitted(rid, owner="gone-owner")])  # no owner record: gone
    with psycopg.connect(database) as other, bl.Runner(database) as runner:
        other.execute("SELECT 1 FROM boundloop_runs WHERE run_id = %s FOR UPDATE", ("o2",))
        started = time.monotonic()
        first = sorted(r.run_id for r in runner.recover())
        assert time.monotonic() - started < 1.0
        assert first == ["o1", "o3"]
        other.rollback()
        assert [r.run_id for r in runner.recover() if r.run_id == "o2"] == ["o2"]
        epochs = {rid: [e.epoch for e in runner.journal.events(rid)
                        if isinstance(e, ev.OwnerClaimed)] for rid in ("o1", "o2", "o3")}
    assert epochs == {"o1": [2], "o2": [2], "o3": [2]}  # each claimed once
