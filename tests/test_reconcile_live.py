"""Timeouts in a live run are reconciled before any retry (SPEC 6), and recovery reads only
the open-runs index."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import LmdbJournal


def script(name: str) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", name, {"x": 1})]),
                             bl.Final("done")])


def reconciled(runner: bl.Runner, run_id: str) -> list[tuple[bool, Any]]:
    return [(e.took_effect, e.content) for e in runner.journal.events(run_id)
            if isinstance(e, ev.CallReconciled)]


def test_a_timeout_that_took_effect_is_reconciled_not_retried(runner: bl.Runner) -> None:
    keys: list[str] = []
    done: set[str] = set()

    def check(key: str) -> str | None:
        return "booked" if key in done else None

    @bl.tool(timeout_s=0.05, reconcile=check, retry=bl.RetryPolicy(3, 0.0))
    def book(x: int, ctx: bl.ToolContext) -> str:
        keys.append(ctx.idempotency_key)
        done.add(ctx.idempotency_key)
        time.sleep(0.3)
        return "booked"

    result = runner.run(model=script("book"), tools=[book], prompt="p")
    assert result.status == "final" and result.tool_calls == 1 and len(keys) == 1
    assert [(m.status, m.content) for m in result.transcript if m.kind == "tool_result"] == [
        ("ok", "booked")]
    assert reconciled(runner, result.run_id) == [(True, "booked")]
    assert result.unresolved == []


def test_a_timeout_that_did_not_take_effect_is_retried_under_the_same_key(
        runner: bl.Runner) -> None:
    keys: list[str] = []

    @bl.tool(timeout_s=0.05, reconcile=lambda key: None,
             retry=bl.RetryPolicy(2, 0.0, (TimeoutError,)))
    def book(x: int, ctx: bl.ToolContext) -> str:
        keys.append(ctx.idempotency_key)
        if ctx.attempt == 1:
            time.sleep(0.3)
        return f"booked on attempt {ctx.attempt}"

    result = runner.run(model=script("book"), tools=[book], prompt="p")
    assert result.status == "final" and result.tool_calls == 2
    assert len(keys) == 2 and keys[0] == keys[1]
    assert reconciled(runner, result.run_id) == [(False, None)]
    assert [m.content for m in result.transcript if m.kind == "tool_result"] == [
        "booked on attempt 2"]


def test_a_reconcile_that_cannot_tell_leaves_the_outcome_unknown(runner: bl.Runner) -> None:
    runs: list[int] = []

    def cannot_tell(key: str) -> str:
        raise ConnectionError("ledger down")

    @bl.tool(timeout_s=0.05, reconcile=cannot_tell, retry=bl.RetryPolicy(3, 0.0))
    def book(x: int) -> str:
        runs.append(x)
        time.sleep(0.3)
        return "booked"

    result = runner.run(model=script("book"), tools=[book], prompt="p")
    assert result.status == "final" and len(runs) == 1  # not idempotent: never retried
    assert [m.status for m in result.transcript if m.kind == "tool_result"] == [
        "outcome_unknown"]
    assert [u.call_id for u in result.unresolved] == ["c1"]


def test_no_retry_delay_runs_past_the_deadline(runner: bl.Runner) -> None:
    runs: list[int] = []

    @bl.tool(retry=bl.RetryPolicy(3, backoff_s=5.0))
    def flaky(x: int) -> str:
        runs.append(x)
        raise ConnectionError("down")

    started = time.monotonic()
    result = runner.run(model=script("flaky"), tools=[flaky], prompt="p",
                        budget=bl.Budget(deadline_s=2.0))
    assert time.monotonic() - started < 2.0
    assert len(runs) == 1 and result.tool_calls == 1
    assert [m.status for m in result.transcript if m.kind == "tool_result"] == ["error"]


class CountingJournal(LmdbJournal):
    """Counts which runs are read, to show recovery reads only the open ones."""

    reads: list[str]

    def read(self, run_id: str, after: int = 0) -> Any:
        self.reads.append(run_id)
        return super().read(run_id, after)


def test_recover_reads_only_open_runs(tmp_path: Path) -> None:
    journal = CountingJournal(tmp_path / "j", sync=False)
    journal.reads = []
    admitted = [ev.RunAdmitted(run_id=f"done-{i}", budget=bl.Budget(), history=[], tools=[],
                               owner="gone")
                for i in range(500)]
    for a in admitted:
        journal.append(a.run_id, 0, [a, ev.RunFinished(
            run_id=a.run_id, status="final", exhausted_limit=None, explanation="x",
            model_steps=0, tool_calls=0)])
    journal.append("orphan", 0, [ev.RunAdmitted(run_id="orphan", budget=bl.Budget(),
                                                history=[], tools=[], owner="gone")])
    with bl.Runner(journal) as runner:
        found = runner.recover()
    assert [r.run_id for r in found] == ["orphan"]
    assert set(journal.reads) == {"orphan"}
    journal.close()
