"""Journal failures fail closed (SPEC 6): an outcome that cannot be recorded stays
unresolved and nothing more is dispatched."""

from __future__ import annotations

from pathlib import Path

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import LmdbJournal
from boundloop.testing import FaultyJournal


def test_an_outcome_that_cannot_be_recorded_stays_unresolved(tmp_path: Path) -> None:
    ran: list[str] = []

    @bl.tool
    def send(to: str) -> str:
        ran.append(to)
        return f"sent to {to}"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "send", {"to": "ann"})]),
        bl.CallTools([bl.ToolCall("c2", "send", {"to": "bob"})]),
        bl.Final("done"),
    ])
    # Append 1 admits the run, 2 holds step 1's decision, 3 carries c1's outcome with
    # step 2's decision: it fails.
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal) as runner:
        result = runner.run(model=model, tools=[send], prompt="p", run_id="r")
        assert result.status == "journal_unavailable"
        assert ran == ["ann"]  # c2 was never dispatched
        assert [(u.call_id, u.phase) for u in result.unresolved] == [("c1", "dispatched")]
        assert result.completed == []
        recorded = list(runner.journal.events("r"))
    assert not any(isinstance(e, ev.RunFinished | ev.CallSucceeded) for e in recorded)
    journal.close()
    # Later, recovery finds c1 open and, as `send` is neither idempotent nor reconcilable,
    # hands it to a person instead of sending again.
    with bl.Runner(tmp_path / "j") as runner:
        [found] = runner.recover()
        assert [u.call_id for u in found.unresolved] == ["c1"]
        again = runner.resume("r", model=bl.ScriptedModel([bl.Final("x")]), tools=[send])
    assert again.status == "needs_review" and ran == ["ann"]
