"""The journal contract's appends and reads: what an append stores and refuses (the
expected sequence, fencing by owner and epoch), what reads return, and the run index."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import Fence, Journal, OwnerRecord
from boundloop.testing._contract_base import ContractBase
from boundloop.testing._contract_events import (
    admitted,
    finished,
    run_ids,
    several,
    step,
)


class AppendContract(ContractBase):
    """Appends and reads, the expected sequence, the run index and fencing."""

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
