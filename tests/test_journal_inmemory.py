"""boundloop's own in-memory journal (``boundloop.journal.memory``) keeps the shipped
contract, as LMDB and PostgreSQL do, carries a Runner, and keeps the hash chain that
``boundloop verify`` checks."""

from __future__ import annotations

from pathlib import Path

import pytest

import boundloop as bl
from boundloop.errors import JournalCorrupt
from boundloop.journal import chain
from boundloop.journal.memory import MemoryJournal
from boundloop.ops import verify_chains
from boundloop.testing import JournalContract
from boundloop.testing._journal_contract import admitted, step


class TestMemoryJournal(JournalContract):
    """The shipped contract, whole."""

    files = False

    def make_store(self, path: Path) -> MemoryJournal:
        return MemoryJournal(str(path))


def test_a_journal_without_a_name_has_a_store_of_its_own() -> None:
    a, b = MemoryJournal(), MemoryJournal()
    a.append("r", 0, [admitted("r")])
    assert list(a.runs()) == ["r"] and list(b.runs()) == []
    assert a.secret_key != b.secret_key


def test_its_records_are_chained_and_a_changed_one_is_caught() -> None:
    j = MemoryJournal()
    j.append("r", 0, [admitted("r"), step("r", 1), step("r", 2)])
    head = j.chain_head("r")
    assert head == j.stored_head("r") and len(head) == chain.LINK_SIZE
    assert [r.ok for r in verify_chains(j)] == [True]
    value = j._store.records["r"][1]
    j._store.records["r"][1] = value[:-1] + bytes([value[-1] ^ 1])
    with pytest.raises(JournalCorrupt) as caught:
        list(j.read("r"))
    assert isinstance(caught.value, chain.ChainError) and caught.value.seq == 2
    assert [(r.run_id, r.ok) for r in verify_chains(j)][0] == ("r", False)


def test_a_runner_times_its_commits_through_the_hooks() -> None:
    j = MemoryJournal()
    seen: list[int] = []
    j.on_commit = lambda latency, appends: seen.append(appends)
    j.append("r", 0, [admitted("r")])
    assert seen == [1]
    model = bl.ScriptedModel([bl.Final("ok")])
    with bl.Runner(j) as runner:
        assert runner.run(model, [], "go", run_id="one").status == "final"
        assert j.on_commit is not None and j.on_commit.__self__ is runner.telemetry  # type: ignore[attr-defined]


def test_a_runner_given_a_key_must_be_given_the_journal_s() -> None:
    j = MemoryJournal()
    model = bl.ScriptedModel([bl.Final("ok")])
    with bl.Runner(j, redaction_key=j.secret_key) as runner:
        assert runner.run(model, [], "go", run_id="one").status == "final"
    with pytest.raises(bl.ConfigError, match="not the key of the journal"):
        bl.Runner(MemoryJournal(), redaction_key=j.secret_key)
