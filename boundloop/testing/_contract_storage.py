"""The journal contract's storage: owner records, retention (``prune``), and what a store
keeps across reopening (its runs, its private files and modes, its secret key), up to a
runner's run replayed from it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.core import kinds
from boundloop.journal.base import Journal, OwnerRecord
from boundloop.testing._contract_base import ContractBase
from boundloop.testing._contract_events import (
    admitted,
    finished,
    run_ids,
    several,
    step,
)


class StorageContract(ContractBase):
    """Owners, retention and persistence."""

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
