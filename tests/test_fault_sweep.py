"""Sweep a failure over every journal write of a scripted run (the way SQLite's crash tests
sweep failure points), and check the invariants after each reopen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from crash_worker import RUN_ID, ledger_lines, make_tools, model_for

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import LmdbJournal
from boundloop.testing import FaultyJournal

TOOLS = ["ship", "charge", "book"]
WORKER = Path(__file__).with_name("crash_worker.py")


def writes_of_a_clean_run(tmp_path: Path) -> int:
    journal = FaultyJournal(LmdbJournal(tmp_path / "probe"))
    with bl.Runner(journal) as runner:
        result = runner.run(model=model_for(TOOLS), tools=make_tools(tmp_path / "probe.ledger"),
                            prompt="go", run_id=RUN_ID)
    journal.close()
    assert result.status == "final"
    return journal.writes


def settle(journal: Path, ledger: Path) -> bl.RunResult:
    """Recover, resolve what needs a person (from the ledger, the ground truth), resume."""
    with bl.Runner(journal) as runner:
        if RUN_ID not in list(runner.journal.runs()):
            return runner.run(model=model_for(TOOLS), tools=make_tools(ledger), prompt="go",
                              run_id=RUN_ID)
        runner.recover()
        state = runner.state(RUN_ID)
        if state.finished and state.status != "needs_review":
            return state.result()
        result = runner.resume(RUN_ID, model=model_for(TOOLS), tools=make_tools(ledger))
        keys = {k for k, _ in ledger_lines(ledger)}
        for _ in range(3):
            if result.status != "needs_review":
                break
            for action in result.unresolved:
                outcome = "succeeded" if action.idempotency_key in keys else "failed"
                runner.resolve(RUN_ID, action.execution_id, outcome, note="ledger checked")
            result = runner.resume(RUN_ID, model=model_for(TOOLS), tools=make_tools(ledger))
        return result


def check_invariants(journal: Path, ledger: Path, result: bl.RunResult) -> None:
    assert result.status == "final", result.explanation
    with LmdbJournal(journal) as j:
        events = list(j.events(RUN_ID))
    decided = {e.idempotency_key: e.tool for e in events if isinstance(e, ev.CallDecided)}
    lines = ledger_lines(ledger)
    # Journal first, act second: every real side effect has a recorded intent.
    assert all(key in decided for key, _ in lines)
    for key, tool in decided.items():
        runs = sum(1 for k, _ in lines if k == key)
        limit = 2 if tool == "charge" else 1  # only the idempotent tool may run twice
        assert runs <= limit, (tool, runs)
    state = bl.replay(events)
    finished = [e for e in events if isinstance(e, ev.RunFinished)][-1]
    assert (state.status, state.model_steps, state.tool_calls) == (
        finished.status, finished.model_steps, finished.tool_calls)
    assert [m.kind for m in state.transcript].count("tool_result") == len(TOOLS)


def test_injected_raise_at_every_write(tmp_path: Path) -> None:
    total = writes_of_a_clean_run(tmp_path)
    assert total == len(TOOLS) + 2  # admission, one decision commit a round, the finish
    for n in range(1, total + 1):
        journal, ledger = tmp_path / f"raise{n}", tmp_path / f"raise{n}.ledger"
        faulty = FaultyJournal(LmdbJournal(journal), fail_at=n, mode="raise")
        with bl.Runner(faulty) as runner:
            result = runner.run(model=model_for(TOOLS), tools=make_tools(ledger), prompt="go",
                                run_id=RUN_ID)
        faulty.close()
        assert result.status == "journal_unavailable", n
        # Nothing was dispatched after the failed write.
        assert len(ledger_lines(ledger)) == min(n - 2, len(TOOLS)) if n > 1 else True
        check_invariants(journal, ledger, settle(journal, ledger))


@pytest.mark.parametrize("mode", ["kill_before", "kill_after"])
def test_sigkill_at_every_write(tmp_path: Path, mode: str) -> None:
    total = len(TOOLS) + 2
    for n in range(1, total + 1):
        journal, ledger = tmp_path / f"{mode}{n}", tmp_path / f"{mode}{n}.ledger"
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(journal), str(ledger), ",".join(TOOLS),
             "--fail-at", str(n), "--mode", mode], capture_output=True, text=True, timeout=60)
        assert proc.returncode == -9, proc.stderr
        check_invariants(journal, ledger, settle(journal, ledger))
