"""The journal contract on the LMDB backend, plus what only LMDB has (sync, fork)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from journal_contract import admitted, several, step
from raw_journal import stored_bodies

import boundloop as bl
from boundloop.journal import LmdbJournal, codec
from boundloop.journal import lmdb as lmdb_journal
from boundloop.testing import JournalContract


class TestLmdbJournal(JournalContract):
    def make_store(self, path: Path) -> LmdbJournal:
        return LmdbJournal(path)


class TestLmdbJournalWithoutSync(JournalContract):
    """The whole contract holds with fsync off too (only crash durability differs)."""

    def make_store(self, path: Path) -> LmdbJournal:
        return LmdbJournal(path, sync=False)


class TestLmdbJournalCompressed(JournalContract):
    """The whole contract holds when the records are stored compressed (format 3)."""

    def make_store(self, path: Path) -> LmdbJournal:
        return LmdbJournal(path, sync=False, compress=True)

    def test_the_records_are_stored_compressed(self, path: Path) -> None:
        with self.make_store(path) as j:
            j.append("run-compressed", 0, several("run-compressed"))
        bodies = stored_bodies(path)
        assert len(bodies) == len(several("x")) and all(b[0] == codec.MARK for b in bodies)


# -- sync ------------------------------------------------------------------------------


def _env_sync(journal: LmdbJournal) -> bool:
    # White-box: LMDB reports its own flags; there is no other way to see fsync is on.
    return bool(journal._env.flags()["sync"])


def test_sync_is_on_by_default(tmp_path: Path) -> None:
    with LmdbJournal(tmp_path / "j") as j:
        assert _env_sync(j) is True  # type: ignore[arg-type]


def test_sync_false_turns_fsync_off_and_still_persists(tmp_path: Path) -> None:
    path = tmp_path / "j"
    j = LmdbJournal(path, sync=False)
    assert _env_sync(j) is False
    events = several("r1")
    j.append("r1", 0, events)
    j.close()
    with LmdbJournal(path) as again:
        assert list(again.events("r1")) == events
        assert _env_sync(again) is True  # type: ignore[arg-type]


def test_runner_passes_sync_to_its_journal(tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "a", sync=False) as runner:
        assert isinstance(runner.journal, LmdbJournal)
        assert _env_sync(runner.journal) is False
    with bl.Runner(tmp_path / "b") as runner:
        assert isinstance(runner.journal, LmdbJournal)
        assert _env_sync(runner.journal) is True


# -- opening ------------------------------------------------------------------------------


def test_create_false_on_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(bl.JournalUnavailable):
        LmdbJournal(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_a_file_is_not_a_journal(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(bl.BoundloopError):
        LmdbJournal(target)


# -- fork --------------------------------------------------------------------------------


def _in_child(fn) -> int:  # type: ignore[no-untyped-def]
    """Run ``fn()`` in a forked child; return its exit code (fn's int, 99 on any escape)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 99
        try:
            code = fn()
        except BaseException:  # noqa: BLE001 - the exit code carries the verdict
            code = 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_journal_used_after_fork_fails_closed_in_the_child(tmp_path: Path) -> None:
    journal = LmdbJournal(tmp_path / "j")
    try:
        journal.append("r1", 0, [admitted("r1")])

        def append_in_child() -> int:
            try:
                journal.append("r1", 1, [step("r1", 1)])
            except bl.JournalUnavailable:
                return 0
            return 1

        def submit_in_child() -> int:
            box: list[BaseException | None] = []
            flag = threading.Event()

            def done(err: BaseException | None) -> None:
                box.append(err)
                flag.set()

            journal.submit("child", 0, [admitted("child")], done)
            if not flag.wait(5):
                return 2
            return 0 if isinstance(box[0], bl.JournalUnavailable) else 1

        def read_in_child() -> int:
            try:
                list(journal.read("r1"))
            except bl.JournalUnavailable:
                return 0
            return 1

        assert _in_child(append_in_child) == 0
        assert _in_child(submit_in_child) == 0
        assert _in_child(read_in_child) == 0
        # The parent's journal is untouched and still works.
        assert [s for s, _ in journal.read("r1")] == [1]
        assert journal.find("child") is None
        assert journal.append("r1", 1, [step("r1", 1)]) == 2
    finally:
        journal.close()



def _readers(journal: LmdbJournal) -> list[str]:
    """This process's slots in the journal's reader table: a transaction id each, ``-`` for
    a reader py-lmdb keeps for reuse."""
    table = journal._env.readers().splitlines()[1:]  # type: ignore[attr-defined]
    return [line.split()[2] for line in table if line.split()[0] == str(os.getpid())]


def _reader_registered(journal: LmdbJournal) -> bool:
    """Whether a read transaction begun now holds a slot in the reader table."""
    txn = journal._env.begin()  # type: ignore[attr-defined]
    try:
        txn.get(b"x")
        return any(t != "-" for t in _readers(journal))
    finally:
        txn.abort()


def test_a_forked_child_opens_the_journal_afresh_and_leaves_the_parents_readers_alone(
        tmp_path: Path) -> None:
    journal = lmdb_journal.acquire(tmp_path / "j")
    try:
        journal.append("r1", 0, [admitted("r1")])
        assert [s for s, _ in journal.read("r1")] == [1]

        def open_in_child() -> int:
            mine = lmdb_journal.acquire(tmp_path / "j")  # not the parent's
            if mine is journal:
                return 1
            mine.append("child", 0, [admitted("child")])
            mine.append("r1", 1, [step("r1", 1)])
            lmdb_journal.release(mine)
            return 0

        for child in (lambda: 0, open_in_child):
            with journal._env.begin() as txn:  # type: ignore[attr-defined]
                txn.get(b"x")
            assert _readers(journal) == ["-"]  # a reader py-lmdb keeps for reuse
            assert _in_child(child) == 0
            # The child let go of its copy of the environment without ending that reader:
            # the parent's next snapshot holds a slot (without one, a writer could reuse
            # the pages it reads).
            assert _reader_registered(journal)
        # The child's appends are in the parent's journal, which works on.
        assert [s for s, _ in journal.read("r1")] == [1, 2]
        assert journal.find("child") is not None
        assert journal.append("r1", 2, [step("r1", 2)]) == 3
    finally:
        lmdb_journal.release(journal)
