"""Crash recovery with real SIGKILLed processes (SPEC 6): nothing runs twice by accident."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_worker import RUN_ID, ledger_lines, make_tools, model_for

import boundloop as bl
from boundloop import events as ev

WORKER = Path(__file__).with_name("crash_worker.py")


def crash(journal: Path, ledger: Path, tools: str, *extra: str) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), str(journal), str(ledger), tools, *extra],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def recovered_one(runner: bl.Runner) -> bl.RecoveredRun:
    runs = runner.recover()
    assert [r.run_id for r in runs] == [RUN_ID]
    return runs[0]


def test_crash_inside_irreversible_tool_needs_review(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    crash(journal, ledger, "ship", "--die")
    assert [t for _, t in ledger_lines(ledger)] == ["ship"]
    with bl.Runner(journal) as runner:
        rec = recovered_one(runner)
        assert [(u.tool, u.call_id, u.attempt) for u in rec.unresolved] == [("ship", "c1", 1)]
        assert rec.unresolved[0].phase == "dispatched"  # recorded before the handler ran
        assert rec.unresolved[0].idempotency_key == ledger_lines(ledger)[0][0]
        result = runner.resume(RUN_ID, model=model_for(["ship"]), tools=make_tools(ledger))
        assert result.status == "needs_review"
        assert [u.execution_id for u in result.unresolved] == [rec.unresolved[0].execution_id]
        assert len(ledger_lines(ledger)) == 1  # resume never re-ran it
        # A person checks and says it took effect; the run then finishes.
        runner.resolve(RUN_ID, rec.unresolved[0].execution_id, "succeeded", note="box left")
        result = runner.resume(RUN_ID, model=model_for(["ship"]), tools=make_tools(ledger))
        assert result.status == "final"
        assert len(ledger_lines(ledger)) == 1
        assert [m.kind for m in result.transcript] == ["user", "call", "tool_result", "final"]
        assert result.unresolved == []
        resolved = [e for e in runner.journal.events(RUN_ID) if isinstance(e, ev.CallResolved)]
        assert [(e.outcome, e.note) for e in resolved] == [("succeeded", "box left")]
        assert resolved[0].by


def test_crash_inside_idempotent_tool_is_retried_under_the_same_key(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    crash(journal, ledger, "charge", "--die")
    with bl.Runner(journal) as runner:
        rec = recovered_one(runner)
        assert [u.tool for u in rec.unresolved] == ["charge"]
        result = runner.resume(RUN_ID, model=model_for(["charge"]), tools=make_tools(ledger))
    assert result.status == "final"
    keys = ledger_lines(ledger)
    assert len(keys) == 2 and keys[0] == keys[1]  # the same key, at most twice
    assert result.tool_calls == 2  # the retry counts
    assert [(c.tool, c.status, c.attempts) for c in result.completed] == [("charge", "ok", 2)]


def test_crash_inside_reconcilable_tool_is_reconciled_not_rerun(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    crash(journal, ledger, "book", "--die")
    with bl.Runner(journal) as runner:
        recovered_one(runner)
        result = runner.resume(RUN_ID, model=model_for(["book"]), tools=make_tools(ledger))
        events = list(runner.journal.events(RUN_ID))
    assert result.status == "final"
    assert len(ledger_lines(ledger)) == 1
    assert [(e.took_effect, e.content) for e in events if isinstance(e, ev.CallReconciled)] == [
        (True, "book done")]
    assert result.tool_calls == 1


def test_crash_before_the_decision_commit_never_runs_the_call(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    # Append 1 admits the run; append 2 holds the first step's CallDecided.
    crash(journal, ledger, "ship", "--fail-at", "2", "--mode", "kill_before")
    assert ledger_lines(ledger) == []
    with bl.Runner(journal) as runner:
        rec = recovered_one(runner)
        assert rec.unresolved == [] and rec.state.tool_calls == 0
        result = runner.resume(RUN_ID, model=model_for(["ship"]), tools=make_tools(ledger))
    assert result.status == "final"
    assert [t for _, t in ledger_lines(ledger)] == ["ship"]  # ran once, after the restart


def test_recover_leaves_runs_of_a_live_owner_alone(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    with bl.Runner(journal) as first:
        blocker = bl.CancelToken()

        def slow(history: list[bl.Message], ctx: bl.ModelContext) -> object:
            blocker.wait(10)
            return bl.Final("late")

        future = first.submit(model=slow, prompt="hi", run_id="busy")
        end = time.monotonic() + 10
        while first.journal.find("busy") is None:  # its admission is committed meanwhile
            assert time.monotonic() < end
            time.sleep(0.005)
        second = bl.Runner(first.journal)  # another runner in the same live process
        try:
            assert [r.run_id for r in second.recover()] == []
            with pytest.raises(bl.RecoveryError):
                second.resume("busy", model=slow)
        finally:
            blocker.cancel()
            second.close()
        assert future.result(timeout=10).status == "final"


def test_resume_rejects_finished_runs_and_resolve_checks_input(tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "j") as runner:
        done = runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p", run_id="r1")
        assert done.status == "final"
        with pytest.raises(bl.RecoveryError):
            runner.resume("r1", model=bl.ScriptedModel([]))
        with pytest.raises(bl.UnknownRun):
            runner.resume("nope", model=bl.ScriptedModel([]))
        with pytest.raises(bl.ConfigError):
            runner.resolve("r1", "x", "maybe")
        with pytest.raises(bl.RecoveryError):
            runner.resolve("r1", "r1:1:0", "succeeded")
