"""SPEC 14: approvals before dispatch (in one process; across processes: test_worker_fleet)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import boundloop as bl
from boundloop.cli import cli


class Refunds:
    """A refund tool that needs approval and proves its intent was durable first."""

    def __init__(self, journal_dir: Path, needs: Any = True) -> None:
        self.ran: list[str] = []
        self.dispatched_first: list[bool] = []
        self.runner: bl.Runner | None = None

        @bl.tool(needs_approval=needs)
        def refund(order: str, amount: int = 5, *, ctx: bl.ToolContext) -> str:
            """Refund an order."""
            assert self.runner is not None
            # The attempt's CallDispatched is in the journal before the handler runs.
            self.dispatched_first.append(any(
                isinstance(e, bl.CallDispatched) and e.execution_id == ctx.execution_id
                for e in self.runner.journal.events(ctx.run_id)))
            self.ran.append(order)
            return f"refunded {order}"

        @bl.tool(read_only=True)
        def lookup(order: str) -> str:
            """Look an order up."""
            return f"order {order}: paid"

        self.tools = [lookup, refund]


def script(*calls: bl.ToolCall) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools(list(calls)), bl.Final("done")])


def test_a_call_that_needs_approval_pauses_the_run_durably(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("c1", "lookup", {"order": "42"}),
                       bl.ToolCall("c2", "refund", {"order": "42"}))
        result = runner.run(model, r.tools, "refund 42", run_id="r1")
        assert result.status == "awaiting_approval"
        assert result.exhausted_limit is None
        assert "approve" in result.explanation and "r1:1:1" in result.explanation
        assert (result.model_steps, result.tool_calls) == (1, 2)
        assert result.unresolved == [] and r.ran == []
        # The lookup ran; neither call is in the transcript until the round completes.
        assert [c.tool for c in result.completed] == ["lookup"]
        events = list(runner.journal.events("r1"))
        names = [type(e).__name__ for e in events]
        assert names[-3:] == ["ApprovalRequested", "RunFinished", "OwnerClaimed"]
        decided = [e for e in events if isinstance(e, bl.CallDecided)]
        assert [(d.tool, d.decision, d.approval) for d in decided] == [
            ("lookup", "allow", False), ("refund", "allow", True)]
        assert not any(isinstance(e, bl.CallDispatched) and e.execution_id == "r1:1:1"
                       for e in events)
        released = events[-1]
        assert isinstance(released, bl.OwnerClaimed) and released.owner == ""
        state = bl.replay(events)
        assert state.status == "awaiting_approval" and state.owner == ""
        assert [c.execution_id for c in state.awaiting] == ["r1:1:1"]

        after = runner.approve("r1", "r1:1:1", by="alice", note="looks right")
        assert after.status == "queued" and not after.finished
        decided_event = [e for e in runner.journal.events("r1")
                         if isinstance(e, bl.ApprovalDecided)][0]
        assert (decided_event.approved, decided_event.by, decided_event.note) == (
            True, "alice", "looks right")
        final = runner.resume("r1", model, r.tools)
        assert final.status == "final"
        assert r.ran == ["42"] and r.dispatched_first == [True]
        assert [m.kind for m in final.transcript] == [
            "user", "call", "tool_result", "call", "tool_result", "final"]
        assert [m.status for m in final.transcript if m.kind == "tool_result"] == ["ok", "ok"]
        assert (final.model_steps, final.tool_calls) == (2, 2)
        again = bl.replay(runner.journal.events("r1"))
        assert (again.status, again.tool_calls, again.transcript) == (
            "final", 2, final.transcript)


def test_a_denied_call_never_runs_counts_and_the_model_sees_it(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    seen: list[Any] = []

    def model(history: list[Any], ctx: bl.ModelContext) -> Any:
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", "refund", {"order": "7"})])
        seen.extend(history)
        return bl.Final("ok")

    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        assert runner.run(model, r.tools, "go", run_id="d1").status == "awaiting_approval"
        runner.deny("d1", "d1:1:0", by="bob", note="too much")
        final = runner.resume("d1", model, r.tools)
    assert final.status == "final" and r.ran == []
    results = [m for m in seen if m.kind == "tool_result"]
    assert [(m.status, m.content) for m in results] == [("denied", "denied by bob: too much")]
    assert final.tool_calls == 1
    assert [c.status for c in final.completed] == ["denied"]


def test_a_decision_on_a_call_that_does_not_wait_is_refused(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("c1", "lookup", {"order": "1"}),
                       bl.ToolCall("c2", "refund", {"order": "1"}))
        runner.run(model, r.tools, "go", run_id="x")
        with pytest.raises(bl.ApprovalError, match="does not wait"):
            runner.approve("x", "x:1:0")  # the lookup: never waited
        with pytest.raises(bl.ApprovalError, match="no call"):
            runner.deny("x", "x:9:9")
        with pytest.raises(bl.UnknownRun):
            runner.approve("nope", "x:1:1")
        runner.approve("x", "x:1:1")
        with pytest.raises(bl.ApprovalError):
            runner.deny("x", "x:1:1")  # decided already
        before = len(list(runner.journal.events("x")))
        with pytest.raises(bl.ApprovalError):
            runner.approve("x", "x:1:1")
        assert len(list(runner.journal.events("x"))) == before  # nothing written
        assert issubclass(bl.ApprovalError, bl.BoundloopError)


def test_a_rule_decides_per_call_and_a_failing_rule_asks_a_person(journal_dir: Path) -> None:
    def rule(call: bl.ToolCall, ctx: bl.ModelContext) -> bool:
        if call.arguments["order"] == "boom":
            raise RuntimeError("rule failed")
        return bool(call.arguments["amount"] > 100)

    r = Refunds(journal_dir, needs=rule)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("a", "refund", {"order": "small", "amount": 5}),
                       bl.ToolCall("b", "refund", {"order": "big", "amount": 500}),
                       bl.ToolCall("c", "refund", {"order": "boom", "amount": 1}))
        result = runner.run(model, r.tools, "go", run_id="rule")
        assert result.status == "awaiting_approval"
        assert r.ran == ["small"]
        assert [c.execution_id for c in runner.state("rule").awaiting] == ["rule:1:1",
                                                                           "rule:1:2"]
        runner.approve("rule", "rule:1:1")
        assert runner.state("rule").status == "awaiting_approval"  # one more waits
        runner.deny("rule", "rule:1:2")
        assert runner.state("rule").status == "queued"
        final = runner.resume("rule", model, r.tools)
    assert final.status == "final" and r.ran == ["small", "big"]
    assert [m.status for m in final.transcript if m.kind == "tool_result"] == [
        "ok", "ok", "denied"]


def test_the_deadline_holds_while_a_run_waits(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("c1", "refund", {"order": "late"}))
        result = runner.run(model, r.tools, "go", run_id="late",
                            budget=bl.Budget(deadline_s=0.6))
        assert result.status == "awaiting_approval"
        time.sleep(0.8)
        runner.approve("late", "late:1:0")  # approved after the deadline passed
        final = runner.resume("late", model, r.tools)
    assert (final.status, final.exhausted_limit) == ("limit_exceeded", "deadline")
    assert r.ran == []
    assert final.elapsed_s >= 0.6


def test_a_worker_ends_a_run_that_waited_past_its_deadline(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    agent = bl.Agent("refunds", model=script(bl.ToolCall("c1", "refund", {"order": "o"})),
                     tools=r.tools, budget=bl.Budget(deadline_s=0.5))
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        assert runner.run(agent, prompt="go", run_id="w").status == "awaiting_approval"
    worker = bl.Worker(journal_dir, [agent], poll_s=0.05)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    try:
        assert worker.wait_ready(10)
        t0 = time.monotonic()
        while worker.finished.get("w") != "limit_exceeded" and time.monotonic() - t0 < 10:
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(15)
    assert not thread.is_alive()
    assert worker.finished.get("w") == "limit_exceeded" and r.ran == []
    with bl.Runner(journal_dir) as runner:
        state = runner.state("w")
    assert (state.status, state.exhausted_limit) == ("limit_exceeded", "deadline")
    assert [c.status for c in state.calls.values()] == ["skipped"]


def test_the_cli_shows_approves_and_denies(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    model = script(bl.ToolCall("c1", "refund", {"order": "a"}),
                   bl.ToolCall("c2", "refund", {"order": "b"}))
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        runner.run(model, r.tools, "go", run_id="cli")
    j = ["--journal", str(journal_dir)]
    shown = CliRunner().invoke(cli, ["show", "cli", *j])
    assert shown.exit_code == 0, shown.output
    flat = " ".join(shown.output.split())
    assert "awaiting_approval" in flat and "cli:1:0" in flat and "cli:1:1" in flat
    ok = CliRunner().invoke(cli, ["approve", "cli", "cli:1:0", *j, "--by", "alice",
                                  "--note", "fine Bearer abcdefghijklmnopqrstuvwxyz0123"])
    assert ok.exit_code == 0, ok.output
    assert "approved" in ok.output and "1 more" in ok.output
    no = CliRunner().invoke(cli, ["deny", "cli", "cli:1:1", *j, "--note", "no"])
    assert no.exit_code == 0 and "queued" in no.output
    again = subprocess.run([sys.executable, "-m", "boundloop", "deny", "cli", "cli:1:1", *j],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "does not wait" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
    with bl.Runner(journal_dir) as runner:
        events = [e for e in runner.journal.events("cli") if isinstance(e, bl.ApprovalDecided)]
        assert [(e.approved, e.by) for e in events] == [(True, "alice"), (False, events[1].by)]
        assert "abcdefghijklmnopqrstuvwxyz0123" not in events[0].note  # scrubbed
        r.runner = runner
        final = runner.resume("cli", model, r.tools)
    assert final.status == "final" and r.ran == ["a"]


# -- found by attack (each failed before its fix) -------------------------------------------
def test_the_time_waited_counts_once(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("c1", "refund", {"order": "w"}))
        runner.run(model, r.tools, "go", run_id="once", budget=bl.Budget(deadline_s=3.0))
        time.sleep(1.2)
        runner.approve("once", "once:1:0")
        final = runner.resume("once", model, r.tools)
    assert final.status == "final" and r.ran == ["w"]
    assert 1.2 <= final.elapsed_s < 2.5


def test_a_note_never_holds_a_secret_of_the_waiting_call(journal_dir: Path) -> None:
    @bl.tool(needs_approval=True)
    def login(user: str, password: str) -> str:
        """Log in."""
        return "in"

    model = script(bl.ToolCall("c1", "login", {"user": "u", "password": "S3cr3t-Pa55"}))
    with bl.Runner(journal_dir) as runner:
        runner.run(model, [login], "go", run_id="s")
    with bl.Runner(journal_dir) as other:  # another process's runner, in effect
        other.deny("s", "s:1:0", note="wrong password S3cr3t-Pa55, use the vault")
        final = other.resume("s", model, [login])
        events = list(other.journal.events("s"))
    assert final.status == "final"
    assert "S3cr3t-Pa55" not in repr(events) and "S3cr3t-Pa55" not in repr(final.transcript)


def test_prune_keeps_a_run_that_waits_for_a_person(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        runner.run(script(bl.ToolCall("c1", "refund", {"order": "p"})), r.tools, "go",
                   run_id="keep")
    time.sleep(0.05)
    done = subprocess.run([sys.executable, "-m", "boundloop", "prune", "--older-than", "0s",
                           "--journal", str(journal_dir)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    with bl.Runner(journal_dir) as runner:
        assert runner.state("keep").status == "awaiting_approval"
        runner.approve("keep", "keep:1:0")


def test_a_nested_run_cannot_wait_for_a_person(journal_dir: Path) -> None:
    ran: list[str] = []

    @bl.tool(needs_approval=True)
    def pay(n: str) -> str:
        """Pay."""
        ran.append(n)
        return "paid"

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        """Run a child that pays."""
        child = ctx.run_child(script(bl.ToolCall("k1", "pay", {"n": "x"})), [pay], "pay x")
        return f"{child.status}: {child.transcript[-2].status}"

    with bl.Runner(journal_dir) as runner:
        final = runner.run(script(bl.ToolCall("c1", "delegate", {})), [delegate], "go")
    assert final.status == "final" and ran == []
    assert final.transcript[2].content == "final: denied"


def test_an_approved_call_that_cannot_be_sent_is_closed_and_the_run_goes_on(
        journal_dir: Path) -> None:
    ran: list[str] = []

    @bl.tool(needs_approval=True)
    def login(user: str, password: str) -> str:
        """Log in."""
        ran.append(user)
        return "in"

    model = script(bl.ToolCall("c1", "login", {"user": "u", "password": "pw-123456"}))
    with bl.Runner(journal_dir) as runner:
        runner.run(model, [login], "go", run_id="red")
        runner.approve("red", "red:1:0")
        final = runner.resume("red", model, [login])
    assert final.status == "final" and ran == [] and final.unresolved == []
    [result] = [m for m in final.transcript if m.kind == "tool_result"]
    assert result.status == "error" and "approved, but not sent" in result.content
    assert "redacted" in result.content


def test_stats_counts_a_waiting_turn_as_no_finished_run(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        model = script(bl.ToolCall("c1", "refund", {"order": "s"}))
        runner.run(model, r.tools, "go", run_id="st")
    out = CliRunner().invoke(cli, ["stats", "--journal", str(journal_dir), "--json"])
    figures = json.loads(out.output)
    assert (figures["runs"], figures["open_runs"], figures["awaiting_approval"]) == (0, 0, 1)


def test_a_note_is_bounded(journal_dir: Path) -> None:
    r = Refunds(journal_dir)
    with bl.Runner(journal_dir) as runner:
        r.runner = runner
        runner.run(script(bl.ToolCall("c1", "refund", {"order": "n"})), r.tools, "go",
                   run_id="n")
        with pytest.raises(bl.ConfigError, match="4096"):
            runner.deny("n", "n:1:0", note="x" * 5000)
        assert runner.state("n").status == "awaiting_approval"
