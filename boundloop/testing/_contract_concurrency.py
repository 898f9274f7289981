"""The journal contract under concurrent writers: group commit (many threads, many
writers on one run, ``submit``'s answers) and closing while appends are in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import Journal
from boundloop.testing._contract_base import ContractBase
from boundloop.testing._contract_events import (
    admitted,
    run_ids,
    step,
)


def _answers(journal: Journal, run_id: str, seq: int, events: Sequence[ev.Event],
             within: float) -> list[BaseException | None]:
    """Submit ``events`` and return what ``done`` was called with, once it was (within
    ``within`` seconds: a store that never answers fails the test here)."""
    box: list[BaseException | None] = []
    flag = threading.Event()

    def done(err: BaseException | None) -> None:
        box.append(err)
        flag.set()

    journal.submit(run_id, seq, list(events), done)
    assert flag.wait(within), f"done was never called within {within} s"
    return box


class ConcurrencyContract(ContractBase):
    """Group commit and close, with many threads appending at once."""

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
        box = _answers(journal, "r1", 0, [step("r1", 1)], 30)
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
        box = _answers(journal, "r1", 1, [step("r1", 1)], 10)
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
