"""The journal contract (DESIGN rule 5): written once, run against every backend.

Shipped as ``boundloop.testing.JournalContract`` so that a third-party backend proves the
same behaviour as LMDB and PostgreSQL. A test module subclasses it (its name starting with
``Test``, so pytest collects it) and implements ``make_store(path)``::

    from boundloop.testing import JournalContract

    class TestMyJournal(JournalContract):
        def make_store(self, path):
            return MyJournal(path)

This module needs pytest (it is imported by ``boundloop.testing`` on first use only).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.core import kinds
from boundloop.journal.base import Fence, Journal, OwnerRecord

__all__ = ["JournalContract", "admitted", "finished", "run_ids", "several", "step"]

# -- event factories -------------------------------------------------------------------


def admitted(run_id: str, *, owner: str = "", parent: str | None = None,
             ts: float = 0.0) -> ev.RunAdmitted:
    """A run's first event, owned by ``owner``."""
    return ev.RunAdmitted(run_id=run_id, ts=ts, budget=bl.Budget(max_model_steps=3),
                          history=[bl.UserMessage("hello")], tools=["search"], owner=owner,
                          parent_run_id=parent)


def step(run_id: str, n: int) -> ev.ModelStepStarted:
    """A small event to append: model step ``n`` started."""
    return ev.ModelStepStarted(run_id=run_id, step=n, tools_allowed=True,
                               reservation=bl.Usage(input_tokens=10 * n))


def finished(run_id: str, *, ts: float = 0.0, status: str = "final") -> ev.RunFinished:
    """The event that ends a run, at ``ts`` (epoch seconds), with ``status``."""
    return ev.RunFinished(run_id=run_id, ts=ts, status=status, exhausted_limit=None,
                          explanation="The model gave a final answer.", model_steps=1,
                          tool_calls=0)


def several(run_id: str) -> list[ev.Event]:
    """One event of many different types, in a plausible order."""
    eid = f"{run_id}:1:0"
    return [
        admitted(run_id, owner="host:1:abc"),
        ev.ModelStepStarted(run_id=run_id, ts=1.5, elapsed_s=0.25, step=1, tools_allowed=True,
                            reservation=bl.Usage(input_tokens=12, output_tokens=100)),
        ev.ModelStepCompleted(run_id=run_id, step=1, latency_s=0.01, response=bl.CallTools(
            [bl.ToolCall("c1", "search", {"query": "Paris", "limit": 3})],
            usage=bl.Usage(input_tokens=11, output_tokens=7))),
        ev.UsageCharged(run_id=run_id, step=1, usage=bl.Usage(input_tokens=11, output_tokens=7,
                                                              cache_read_tokens=2, cost=0.5)),
        ev.CallDecided(run_id=run_id, execution_id=eid, idempotency_key="k" * 32, step=1,
                       round=1, index=0, call_id="c1", tool="search",
                       arguments={"query": "Paris", "limit": 3, "nested": {"x": [1, 2.5]}},
                       decision="allow", read_only=True, idempotent=True),
        ev.CallDispatched(run_id=run_id, execution_id=eid, attempt=1),
        ev.CallSucceeded(run_id=run_id, execution_id=eid, attempt=1,
                         content=["sunny", {"temp": 21}], size=22, digest="ab" * 32),
        ev.RoundCompleted(run_id=run_id, step=1),
        ev.NoticeAdded(run_id=run_id, text="a notice"),
        ev.ModelStepFailed(run_id=run_id, step=2, reason="malformed", detail="no kind"),
        ev.ModelStepCompleted(run_id=run_id, step=3, response=bl.Final("done")),
        ev.ApprovalRequested(run_id=run_id, execution_id=eid, tool="search"),
        ev.ApprovalDecided(run_id=run_id, execution_id=eid, approved=True, by="alice",
                           note="fine"),
        ev.RunRequeued(run_id=run_id, ts=time.time()),
        finished(run_id, ts=time.time()),
    ]


def run_ids(journal: Journal) -> list[str]:
    """``journal.runs()`` as a list."""
    return list(journal.runs())


class JournalContract:
    """Behaviour every Journal backend must have (the interface of
    ``boundloop.journal.base.Journal``), as pytest tests.

    Subclass it in a test module, as ``class TestMyJournal(JournalContract)``, and implement
    ``make_store``. Each test gets a fresh directory ``path`` (pytest's ``tmp_path``); the
    ``journal`` fixture is ``make_store(path)``, closed after the test. A store that keeps
    no files sets ``files = False``: the two tests of the directory's modes are skipped.
    """

    #: True when the store keeps its data in files under ``path`` (their modes are checked:
    #: SPEC 9, the directory 0700 and its files 0600).
    files: bool = True

    def make_store(self, path: Path) -> Journal:
        """Open the backend's journal stored at ``path``, creating it when absent.

        Called again with the same ``path`` (after the previous journal was closed), it must
        open the same store: its runs, owners and secret key kept. A different ``path`` is
        a different, empty store. ``path`` is a directory that may not exist yet; a backend
        that keeps nothing in files uses it as a name (a schema, a key prefix).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement make_store(path)")

    # -- fixtures ------------------------------------------------------------------------
    @pytest.fixture
    def path(self, tmp_path: Path) -> Path:
        """Where this test's store lives."""
        return tmp_path / "journal"

    @pytest.fixture
    def journal(self, path: Path) -> Iterator[Journal]:
        """This test's store, closed after it."""
        j = self.make_store(path)
        try:
            yield j
        finally:
            j.close()

    # -- append and read ------------------------------------------------------------------
    def test_round_trip_of_several_event_types(self, journal: Journal) -> None:
        events = several("r1")
        assert journal.append("r1", 0, events) == len(events)
        assert list(journal.events("r1")) == events
        assert [type(e) for _, e in journal.read("r1")] == [type(e) for e in events]

    def test_sequence_numbers_are_dense_from_one(self, journal: Journal) -> None:
        assert journal.append("r1", 0, [admitted("r1")]) == 1
        assert journal.append("r1", 1, [step("r1", 1), step("r1", 2)]) == 3
        assert journal.append("r1", 3, [step("r1", 3)]) == 4
        assert [seq for seq, _ in journal.read("r1")] == [1, 2, 3, 4]
        assert journal.info("r1").last_seq == 4

    def test_an_empty_append_stores_nothing(self, journal: Journal) -> None:
        journal.append("r1", 0, [admitted("r1")])
        assert journal.append("r1", 1, []) == 1
        assert [seq for seq, _ in journal.read("r1")] == [1]

    def test_read_after(self, journal: Journal) -> None:
        events = [admitted("r1"), *(step("r1", n) for n in range(1, 6))]
        journal.append("r1", 0, events)
        assert list(journal.read("r1", after=0)) == list(enumerate(events, start=1))
        assert list(journal.read("r1", after=2)) == [(n, events[n - 1]) for n in range(3, 7)]
        assert list(journal.read("r1", after=5)) == [(6, events[5])]
        assert list(journal.read("r1", after=6)) == []
        assert list(journal.read("r1", after=100)) == []

    def test_read_keeps_runs_apart(self, journal: Journal) -> None:
        # "r1" is a prefix of "r10": a range read of one must not leak into the other.
        for rid in ("r1", "r10", "r2", "r"):
            journal.append(rid, 0, [admitted(rid), step(rid, 1)])
        for rid in ("r1", "r10", "r2", "r"):
            got = list(journal.read(rid))
            assert [s for s, _ in got] == [1, 2]
            assert {e.run_id for _, e in got} == {rid}
        assert list(journal.read("nope")) == []

    def test_submit_many_appends_each_and_answers_each(self, journal: Journal) -> None:
        journal.append("r2", 0, [admitted("r2")])
        got: dict[str, BaseException | None] = {}
        flags = {r: threading.Event() for r in ("r1", "r2", "r3", "bad")}

        def done(run_id: str) -> Callable[[BaseException | None], None]:
            def answer(err: BaseException | None) -> None:
                got[run_id] = err
                flags[run_id].set()
            return answer

        journal.submit_many([
            ("r1", 0, [admitted("r1"), step("r1", 1)], done("r1"), None),
            ("r2", 1, [step("r2", 1)], done("r2"), None),
            ("bad", 5, [step("bad", 1)], done("bad"), None),  # refused: nothing at seq 5
            ("r3", 0, [admitted("r3")], done("r3"), None),
        ])
        assert all(f.wait(10) for f in flags.values())
        assert got["r1"] is None and got["r2"] is None and got["r3"] is None
        assert isinstance(got["bad"], bl.SequenceConflict)  # one refusal spoils no other
        assert [s for s, _ in journal.read("r1")] == [1, 2]
        assert [s for s, _ in journal.read("r2")] == [1, 2]
        assert [s for s, _ in journal.read("r3")] == [1]
        assert journal.find("bad") is None

    def test_submit_many_on_a_closed_journal_answers_with_an_error(self, path: Path) -> None:
        journal = self.make_store(path)
        journal.close()
        got: list[BaseException | None] = []
        journal.submit_many([("r1", 0, [admitted("r1")], got.append, None)])
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        assert len(got) == 1 and isinstance(got[0], bl.JournalError)

    def test_a_claim_from_an_owner_that_renewed_its_lease_is_refused(
            self, journal: Journal) -> None:
        """A claimer judged the owner gone on a record it read earlier; the owner has
        renewed its lease since (it woke up and went on with its own runs): the claim's
        transaction reads the owner's record again and refuses the claim. With the lease
        expired it goes through; a forced resolve claims from a live owner on purpose."""
        j = journal
        for rid in ("r", "s"):
            j.append(rid, 0, [admitted(rid, owner="a")])
        j.put_owner(OwnerRecord("a", 1, "elsewhere", 1.0, time.time() - 5))  # expired
        stale = j.owners()  # what the claimer judged on
        j.put_owner(OwnerRecord("a", 1, "elsewhere", 1.0, time.time() + 30))  # renewed
        assert stale["a"].lease_until < time.time()

        def claim(rid: str, forced: bool = False) -> list[ev.Event]:
            return [ev.OwnerClaimed(run_id=rid, ts=time.time(), owner="b", epoch=2), *[
                ev.CallResolved(run_id=rid, ts=time.time(), execution_id="x",
                                outcome="failed", forced=True) for _ in range(forced)]]

        with pytest.raises(bl.SequenceConflict, match="alive"):
            j.append("r", 1, claim("r"))
        assert j.info("r").owner == "a" and j.info("r").last_seq == 1
        assert j.append("r", 1, [step("r", 1)], Fence("a", 1)) == 2  # a goes on
        assert j.append("s", 1, claim("s", forced=True)) == 3  # forced: on purpose
        j.put_owner(OwnerRecord("a", 1, "elsewhere", 1.0, time.time() - 1))  # gone now
        assert j.append("r", 2, claim("r")) == 3
        assert (j.info("r").owner, j.info("r").epoch) == ("b", 2)

    # -- expected sequence ------------------------------------------------------------------
    def test_a_conflicting_append_raises_and_stores_nothing(self, journal: Journal) -> None:
        journal.append("r1", 0, [admitted("r1"), step("r1", 1)])
        for wrong in (0, 1, 3, 10):
            with pytest.raises(bl.SequenceConflict):
                journal.append("r1", wrong, [step("r1", 7), step("r1", 8), step("r1", 9)])
        assert [s for s, _ in journal.read("r1")] == [1, 2]
        assert journal.info("r1").last_seq == 2
        assert journal.append("r1", 2, [step("r1", 2)]) == 3

    def test_a_conflicting_first_append_creates_no_run(self, journal: Journal) -> None:
        with pytest.raises(bl.SequenceConflict):
            journal.append("ghost", 4, [admitted("ghost")])
        assert journal.find("ghost") is None
        assert "ghost" not in run_ids(journal)
        assert "ghost" not in list(journal.open_runs())
        assert list(journal.read("ghost")) == []

    def test_sequence_conflict_is_a_journal_error(self) -> None:
        assert issubclass(bl.SequenceConflict, bl.JournalError)

    def test_a_race_of_two_writers_has_one_winner(self, journal: Journal) -> None:
        for i in range(25):
            rid = f"race{i}"
            journal.append(rid, 0, [admitted(rid)])
            barrier = threading.Barrier(2)
            outcomes: dict[str, BaseException | int] = {}

            def write(name: str, n: int, rid: str = rid,
                      barrier: threading.Barrier = barrier,
                      outcomes: dict[str, BaseException | int] = outcomes) -> None:
                batch = [step(rid, 100 * n + k) for k in range(n)]
                barrier.wait()
                try:
                    outcomes[name] = journal.append(rid, 1, batch)
                except bl.JournalError as exc:
                    outcomes[name] = exc

            threads = [threading.Thread(target=write, args=("a", 2)),
                       threading.Thread(target=write, args=("b", 3))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            winners = [k for k, v in outcomes.items() if isinstance(v, int)]
            losers = [v for v in outcomes.values() if not isinstance(v, int)]
            assert len(winners) == 1, outcomes
            assert len(losers) == 1 and isinstance(losers[0], bl.SequenceConflict), outcomes
            n = 2 if winners[0] == "a" else 3
            got = list(journal.read(rid))
            assert [s for s, _ in got] == list(range(1, n + 2))
            # Only the winner's events were stored, none of the loser's.
            assert [getattr(e, "step", None) for _, e in got[1:]] == \
                [100 * n + k for k in range(n)]

    # -- the run index -------------------------------------------------------------------
    def test_runs_oldest_first(self, journal: Journal) -> None:
        order = ["zeta", "alpha", "mu", "beta", "omega"]
        for rid in order:
            journal.append(rid, 0, [admitted(rid)])
        journal.append("alpha", 1, [step("alpha", 1)])  # later appends do not reorder
        assert run_ids(journal) == order

    def test_open_runs_index(self, journal: Journal) -> None:
        for rid in ("a", "b", "c"):
            journal.append(rid, 0, [admitted(rid)])
        assert set(journal.open_runs()) == {"a", "b", "c"}
        journal.append("b", 1, [finished("b")])
        assert set(journal.open_runs()) == {"a", "c"}
        journal.append("b", 2, [ev.RunResumed(run_id="b", owner="me")])
        assert set(journal.open_runs()) == {"a", "b", "c"}
        journal.append("b", 3, [step("b", 1), finished("b")])
        journal.append("c", 1, [finished("c", status="cancelled")])
        assert set(journal.open_runs()) == {"a"}
        assert run_ids(journal) == ["a", "b", "c"]

    def test_finished_and_resumed_in_one_append(self, journal: Journal) -> None:
        journal.append("a", 0, [admitted("a"), finished("a"), ev.RunResumed(run_id="a")])
        assert list(journal.open_runs()) == ["a"]
        journal.append("b", 0, [admitted("b"), finished("b")])
        assert list(journal.open_runs()) == ["a"]

    def test_find_and_info(self, journal: Journal) -> None:
        assert journal.find("nope") is None
        with pytest.raises(bl.UnknownRun):
            journal.info("nope")
        journal.append("child", 0, [admitted("child", owner="host:9:x", parent="root")])
        info = journal.info("child")
        assert journal.find("child") == info
        assert (info.run_id, info.last_seq, info.status, info.finished_ts) == \
            ("child", 1, None, None)
        assert (info.parent_run_id, info.owner) == ("root", "host:9:x")
        journal.append("child", 1, [finished("child", ts=1234.5, status="limit_exceeded")])
        info = journal.info("child")
        assert (info.last_seq, info.status, info.finished_ts) == (2, "limit_exceeded", 1234.5)
        assert info.epoch == 1
        journal.append("child", 2, [ev.OwnerClaimed(run_id="child", owner="other:1:y", epoch=2),
                                    ev.RunResumed(run_id="child", owner="other:1:y")])
        info = journal.info("child")
        assert (info.status, info.finished_ts, info.owner, info.epoch) == \
            (None, None, "other:1:y", 2)

    # -- fencing (SPEC 6): owner and epoch checked in the same write as the sequence --------
    def test_a_fenced_append_by_the_owner_at_its_epoch_is_stored(self, journal: Journal) -> None:
        journal.append("r", 0, [admitted("r", owner="A")], Fence("A", 1))
        assert journal.append("r", 1, [step("r", 1)], Fence("A", 1)) == 2
        assert journal.info("r").epoch == 1

    def test_an_append_fenced_by_a_lost_owner_stores_nothing(self, journal: Journal) -> None:
        journal.append("r", 0, [admitted("r", owner="A")])
        journal.append("r", 1, [ev.OwnerClaimed(run_id="r", owner="B", epoch=2)])
        for fence in (Fence("A", 1), Fence("A", 2), Fence("B", 1)):
            with pytest.raises(bl.LeaseLost):
                journal.append("r", 2, [step("r", 1)], fence)
        # A stale owner with a stale sequence hears LeaseLost, not a sequence conflict.
        with pytest.raises(bl.LeaseLost):
            journal.append("r", 1, [step("r", 1)], Fence("A", 1))
        info = journal.info("r")
        assert (info.last_seq, info.owner, info.epoch) == (2, "B", 2)
        assert [type(e).__name__ for e in journal.events("r")] == ["RunAdmitted",
                                                                   "OwnerClaimed"]
        assert journal.append("r", 2, [step("r", 1)], Fence("B", 2)) == 3

    def test_claims_move_the_epoch_one_at_a_time(self, journal: Journal) -> None:
        journal.append("r", 0, [admitted("r", owner="A")])
        with pytest.raises(bl.SequenceConflict):
            journal.append("r", 1, [ev.OwnerClaimed(run_id="r", owner="B", epoch=3)])
        journal.append("r", 1, [ev.OwnerClaimed(run_id="r", owner="B", epoch=0)])  # "next"
        assert (journal.info("r").owner, journal.info("r").epoch) == ("B", 2)
        # Two claims of the same epoch: the second one conflicts and stores nothing.
        journal.append("r", 2, [ev.OwnerClaimed(run_id="r", owner="C", epoch=3)])
        with pytest.raises(bl.SequenceConflict):
            journal.append("r", 2, [ev.OwnerClaimed(run_id="r", owner="D", epoch=3)])
        assert (journal.info("r").owner, journal.info("r").epoch, journal.info("r").last_seq) \
            == ("C", 3, 3)

    def test_unknown_run_is_a_key_error(self, journal: Journal) -> None:
        with pytest.raises(KeyError):
            journal.info("nope")

    def test_events_of_an_unknown_run_raise(self, journal: Journal) -> None:
        with pytest.raises(bl.UnknownRun):
            list(journal.events("nope"))
        journal.append("r1", 0, [admitted("r1")])
        with pytest.raises(bl.UnknownRun):
            list(journal.events("r"))  # a prefix of a known id is not that run

    # -- group commit ------------------------------------------------------------------------
    def test_many_threads_appending_concurrently(self, journal: Journal) -> None:
        threads_n, runs_per_thread, appends_per_run = 16, 4, 10
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for r in range(runs_per_thread):
                    rid = f"t{t}-r{r}"
                    seq = journal.append(rid, 0, [admitted(rid)])
                    for n in range(appends_per_run):
                        seq = journal.append(rid, seq, [step(rid, n)] * (1 + n % 3))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[:3]
        expected_len = 1 + sum(1 + n % 3 for n in range(appends_per_run))
        ids = run_ids(journal)
        assert len(ids) == threads_n * runs_per_thread
        for rid in ids:
            assert [s for s, _ in journal.read(rid)] == list(range(1, expected_len + 1))
            assert journal.info(rid).last_seq == expected_len
            # Within a thread, its runs were created in order.
        for n in range(threads_n):
            mine = [i for i in ids if i.startswith(f"t{n}-")]
            assert mine == [f"t{n}-r{r}" for r in range(runs_per_thread)]

    def test_many_writers_on_one_run_keep_it_dense(self, journal: Journal) -> None:
        journal.append("shared", 0, [admitted("shared")])
        per_thread, threads_n = 20, 8
        conflicts = [0]
        lock = threading.Lock()

        def work(t: int) -> None:
            done = 0
            while done < per_thread:
                last = journal.info("shared").last_seq
                try:
                    journal.append("shared", last, [step("shared", t * 1000 + done)])
                    done += 1
                except bl.SequenceConflict:
                    with lock:
                        conflicts[0] += 1

        threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        got = list(journal.read("shared"))
        assert [s for s, _ in got] == list(range(1, 1 + threads_n * per_thread + 1))
        steps = sorted(getattr(e, "step", -1) for _, e in got[1:])
        assert steps == sorted(t * 1000 + d for t in range(threads_n) for d in range(per_thread))

    def test_submit_calls_done_once_per_append(self, journal: Journal) -> None:
        n = 300
        results: dict[str, list[BaseException | None]] = {f"s{i}": [] for i in range(n)}
        all_done = threading.Event()
        remaining = [n]
        lock = threading.Lock()

        def done_for(rid: str) -> Callable[[BaseException | None], None]:
            def done(err: BaseException | None) -> None:
                results[rid].append(err)
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        all_done.set()
            return done

        def work(ids: Sequence[str]) -> None:
            for rid in ids:
                journal.submit(rid, 0, [admitted(rid), step(rid, 1)], done_for(rid))

        ids = list(results)
        threads = [threading.Thread(target=work, args=(ids[k::6],)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all_done.wait(60)
        assert all(v == [None] for v in results.values())
        assert sorted(run_ids(journal)) == sorted(ids)
        for rid in ids:
            assert [s for s, _ in journal.read(rid)] == [1, 2]

    def test_submit_reports_a_conflict_to_done(self, journal: Journal) -> None:
        journal.append("r1", 0, [admitted("r1")])
        box: list[BaseException | None] = []
        flag = threading.Event()

        def done(err: BaseException | None) -> None:
            box.append(err)
            flag.set()

        journal.submit("r1", 0, [step("r1", 1)], done)
        assert flag.wait(30)
        assert len(box) == 1 and isinstance(box[0], bl.SequenceConflict)
        assert [s for s, _ in journal.read("r1")] == [1]

    # -- close ---------------------------------------------------------------------------
    def test_close_makes_append_and_submit_fail(self, journal: Journal) -> None:
        journal.append("r1", 0, [admitted("r1")])
        assert not journal.closed
        journal.close()
        assert journal.closed
        with pytest.raises(bl.JournalUnavailable):
            journal.append("r1", 1, [step("r1", 1)])
        with pytest.raises(bl.JournalUnavailable):
            journal.append("new", 0, [admitted("new")])
        box: list[BaseException | None] = []
        flag = threading.Event()

        def done(err: BaseException | None) -> None:
            box.append(err)
            flag.set()

        journal.submit("r1", 1, [step("r1", 1)], done)
        assert flag.wait(10), "done was never called after close"
        assert len(box) == 1 and isinstance(box[0], bl.JournalUnavailable)
        journal.close()  # closing twice is harmless
        assert journal.closed

    def test_close_while_appending_fails_every_pending_append(self, path: Path) -> None:
        """Every submission gets exactly one answer: stored (None) or refused (an error);
        nothing is left waiting forever, and nothing refused is stored."""
        journal = self.make_store(path)
        answers: dict[str, list[BaseException | None]] = {}
        lock = threading.Lock()
        stop = threading.Event()

        def work(t: int) -> None:
            i = 0
            while not stop.is_set() and i < 2000:
                rid = f"t{t}-{i}"
                with lock:
                    answers[rid] = []

                def done(err: BaseException | None, rid: str = rid) -> None:
                    with lock:
                        answers[rid].append(err)

                journal.submit(rid, 0, [admitted(rid)], done)
                i += 1

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        journal.close()
        stop.set()
        for t in threads:
            t.join(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with lock:
                if all(answers.values()):
                    break
            time.sleep(0.01)
        with lock:
            unanswered = [rid for rid, a in answers.items() if not a]
            twice = [rid for rid, a in answers.items() if len(a) > 1]
            stored = {rid for rid, a in answers.items() if a == [None]}
            refused = {rid for rid, a in answers.items()
                       if a and isinstance(a[0], bl.JournalUnavailable)}
        assert not unanswered, f"{len(unanswered)} submissions never answered"
        assert not twice
        assert stored | refused == set(answers)
        reopened = self.make_store(path)
        try:
            assert set(reopened.runs()) == stored
        finally:
            reopened.close()

    def test_a_submit_racing_close_is_still_answered(self, path: Path) -> None:
        """A submission that is inside ``submit`` while another thread closes the journal
        still gets its answer. (The events are a Sequence that is slow to iterate: it holds
        the submitting thread inside ``submit`` until the close has finished, the way a
        preempted thread would be held.) A lost answer leaves ``append`` waiting forever,
        which is not failing closed (SPEC 6)."""
        journal = self.make_store(path)
        entered, closed = threading.Event(), threading.Event()

        class SlowEvents(list[ev.Event]):
            def __iter__(self) -> Iterator[ev.Event]:
                entered.set()
                closed.wait(5)
                return super().__iter__()

        answers: list[BaseException | None] = []
        answered = threading.Event()

        def done(err: BaseException | None) -> None:
            answers.append(err)
            answered.set()

        submitter = threading.Thread(
            target=journal.submit, args=("r1", 0, SlowEvents([admitted("r1")]), done))
        submitter.start()
        entered.wait(5)
        journal.close()
        closed.set()
        submitter.join(10)
        assert answered.wait(3), "a submit racing close() was never answered"
        assert len(answers) == 1
        reopened = self.make_store(path)
        try:
            stored = reopened.find("r1") is not None
        finally:
            reopened.close()
        if answers[0] is None:
            assert stored
        else:
            assert isinstance(answers[0], bl.JournalUnavailable) and not stored

    # -- owners --------------------------------------------------------------------------
    def test_owners_put_get_remove(self, journal: Journal) -> None:
        assert journal.owners() == {}
        a = OwnerRecord("host:1:a", 1, "host", 100.0, time.time() + 30)
        b = OwnerRecord("host:2:b", 2, "host", 200.0, time.time() + 30)
        journal.put_owner(a)
        journal.put_owner(b)
        assert journal.owners() == {a.owner: a, b.owner: b}
        renewed = OwnerRecord(a.owner, 1, "host", 100.0, a.lease_until + 60)
        journal.put_owner(renewed)
        assert journal.owners()[a.owner] == renewed
        journal.remove_owner(a.owner)
        assert journal.owners() == {b.owner: b}
        journal.remove_owner("never-registered")
        assert journal.owners() == {b.owner: b}

    # -- retention ---------------------------------------------------------------------------
    def test_prune_removes_only_runs_finished_before_the_cut(self, journal: Journal) -> None:
        cut = 10_000.0
        journal.append("old1", 0, [admitted("old1"), finished("old1", ts=cut - 100)])
        journal.append("open_old", 0, [admitted("open_old", ts=1.0), step("open_old", 1)])
        journal.append("new", 0, [admitted("new"), finished("new", ts=cut + 100)])
        journal.append("old2", 0, [admitted("old2"), finished("old2", ts=cut - 1)])
        journal.append("resumed", 0, [admitted("resumed"), finished("resumed", ts=cut - 50),
                                      ev.RunResumed(run_id="resumed")])
        journal.append("at_cut", 0, [admitted("at_cut"), finished("at_cut", ts=cut)])
        before = run_ids(journal)

        assert sorted(journal.prune(cut, dry_run=True)) == ["old1", "old2"]
        assert run_ids(journal) == before  # a dry run removes nothing

        assert sorted(journal.prune(cut)) == ["old1", "old2"]
        assert run_ids(journal) == ["open_old", "new", "resumed", "at_cut"]
        for rid in ("old1", "old2"):
            assert journal.find(rid) is None
            assert list(journal.read(rid)) == []
            with pytest.raises(bl.UnknownRun):
                list(journal.events(rid))
        assert set(journal.open_runs()) == {"open_old", "resumed"}
        assert [s for s, _ in journal.read("open_old")] == [1, 2]
        assert [s for s, _ in journal.read("new")] == [1, 2]
        assert journal.prune(cut) == []
        # A pruned id can hold a new run again, with a new place in the order.
        journal.append("old1", 0, [admitted("old1")])
        assert run_ids(journal)[-1] == "old1"

    # -- persistence ---------------------------------------------------------------------
    def test_reopen_after_close_keeps_everything(self, path: Path) -> None:
        first = self.make_store(path)
        events = several("r1")
        first.append("r1", 0, events)
        first.append("r2", 0, [admitted("r2")])
        first.append("r3", 0, [admitted("r3"), finished("r3", ts=42.0)])
        owner = OwnerRecord("host:1:a", 1, "host", 1.0, 2.0)
        first.put_owner(owner)
        info = first.info("r3")
        key = first.secret_key
        first.close()

        again = self.make_store(path)
        try:
            assert not again.closed
            assert run_ids(again) == ["r1", "r2", "r3"]
            assert list(again.events("r1")) == events
            assert set(again.open_runs()) == {"r2"}
            assert again.info("r3") == info
            assert again.owners() == {owner.owner: owner}
            assert again.secret_key == key
            assert again.append("r2", 1, [step("r2", 1)]) == 2
            with pytest.raises(bl.SequenceConflict):
                again.append("r2", 1, [step("r2", 1)])
        finally:
            again.close()

    def test_directory_is_private(self, journal: Journal, path: Path) -> None:
        if not self.files:
            pytest.skip("this store keeps no files (files = False)")
        journal.append("r1", 0, several("r1"))
        journal.put_owner(OwnerRecord("o", 1, "h", 1.0, 2.0))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        files = [p for p in path.rglob("*")]
        assert files, "the journal directory holds no files"
        for p in files:
            mode = stat.S_IMODE(os.stat(p).st_mode)
            if p.is_dir():
                assert mode == 0o700, (p, oct(mode))
            else:
                assert mode == 0o600, (p, oct(mode))

    def test_an_existing_directory_is_made_private(self, path: Path) -> None:
        if not self.files:
            pytest.skip("this store keeps no files (files = False)")
        path.mkdir(mode=0o755)
        os.chmod(path, 0o755)
        j = self.make_store(path)
        try:
            j.append("r1", 0, [admitted("r1")])
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        finally:
            j.close()

    def test_redaction_key_persists_across_reopen(self, path: Path) -> None:
        first = self.make_store(path)
        key = first.secret_key
        first.close()
        assert isinstance(key, bytes) and len(key) >= 32
        # SPEC 9: the key lives apart from the journal; a copy of the directory lacks it.
        if path.is_dir():
            assert not [p for p in path.rglob("*") if p.is_file() and key in p.read_bytes()]
        again = self.make_store(path)
        try:
            assert again.secret_key == key
        finally:
            again.close()

    def test_each_journal_has_its_own_key(self, tmp_path: Path) -> None:
        a = self.make_store(tmp_path / "a")
        b = self.make_store(tmp_path / "b")
        try:
            assert a.secret_key != b.secret_key
        finally:
            a.close()
            b.close()

    def test_a_runner_on_this_journal_replays(self, journal: Journal) -> None:
        """The backend carries a real run end to end (the runner's own appends)."""
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "echo", {"text": "hi"})]),
                                  bl.Final("ok")])

        @bl.tool
        def echo(text: str) -> str:
            return text

        with bl.Runner(journal) as runner:
            result = runner.run(model=model, tools=[echo], prompt="go", run_id="run-1")
        assert kinds.is_final(result.status)
        state = bl.replay(journal.events("run-1"))
        assert (state.status, state.model_steps, state.tool_calls) == ("final", 2, 1)
        assert state.transcript == result.transcript
        assert "run-1" not in set(journal.open_runs())
