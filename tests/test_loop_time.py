"""SPEC 5 steps 1, 7, 9 and 10: the deadline (on a FakeClock) and tool timeouts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from loop_helpers import USER, journal_of, transcript

import boundloop as bl


@pytest.fixture
def clock() -> bl.FakeClock:
    return bl.FakeClock()


@pytest.fixture
def timed(journal_dir: Path, clock: bl.FakeClock) -> Iterator[bl.Runner]:
    with bl.Runner(journal_dir, clock=clock) as r:
        yield r


def make_tools(clock: bl.FakeClock, ran: list[str]) -> list[bl.Tool]:
    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo the text."""
        ran.append(text)
        return text

    @bl.tool
    def slow(text: str, seconds: float) -> str:
        """Take ``seconds`` of (fake) time."""
        ran.append(text)
        clock.advance(seconds)
        return text

    return [echo, slow]


def test_context_deadline_is_on_the_runner_clock(timed: bl.Runner, clock: bl.FakeClock) -> None:
    ran: list[str] = []
    tool_deadlines: list[float | None] = []

    @bl.tool
    def probe(ctx: bl.ToolContext) -> str:
        """Note the deadline."""
        tool_deadlines.append(ctx.deadline)
        return "ok"

    start = clock.monotonic()
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("p", "probe", {})]), bl.Final("done")])
    result = timed.run(model=model, tools=[probe, *make_tools(clock, ran)], prompt="go",
                       budget=bl.Budget(deadline_s=30))
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert [c.deadline for c in model.contexts] == [start + 30, start + 30]
    assert tool_deadlines == [start + 30]
    assert model.contexts[0].remaining.deadline_s == pytest.approx(30)
    journal_of(timed, result)


def test_no_deadline_means_none(runner: bl.Runner) -> None:
    model = bl.ScriptedModel([bl.Final("done")])
    result = runner.run(model=model, prompt="go")
    assert result.status == "final"
    assert model.contexts[0].deadline is None
    journal_of(runner, result)


def test_deadline_passed_during_a_tool_stops_before_the_next_model_call(
        timed: bl.Runner, clock: bl.FakeClock) -> None:
    ran: list[str] = []
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("s", "slow", {"text": "a", "seconds": 11})]),
        bl.Final("never")])
    result = timed.run(model=model, tools=make_tools(clock, ran), prompt="go",
                       budget=bl.Budget(deadline_s=10))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert (result.model_steps, result.tool_calls) == (1, 1)
    assert model.calls == 1
    assert ran == ["a"]
    assert transcript(result) == [
        USER,
        {"kind": "call", "id": "s", "name": "slow", "arguments": {"text": "a", "seconds": 11}},
        {"kind": "tool_result", "id": "s", "status": "ok", "content": "a"},
    ]
    assert "10" in result.explanation
    journal_of(timed, result)


def test_final_after_the_deadline_is_accepted(timed: bl.Runner, clock: bl.FakeClock) -> None:
    def slow_final(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        clock.advance(100)
        return bl.Final("late but final")

    model = bl.ScriptedModel([slow_final])
    result = timed.run(model=model, prompt="go", budget=bl.Budget(deadline_s=10))
    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert transcript(result) == [USER, {"kind": "final", "text": "late but final"}]
    journal_of(timed, result)


def test_calls_after_the_deadline_are_counted_but_not_run(timed: bl.Runner,
                                                          clock: bl.FakeClock) -> None:
    ran: list[str] = []

    def slow_calls(history: list[Any], ctx: bl.ModelContext) -> bl.CallTools:
        clock.advance(11)
        return bl.CallTools([bl.ToolCall("a", "echo", {"text": "a"}),
                             bl.ToolCall("b", "echo", {"text": "b"})])

    model = bl.ScriptedModel([slow_calls, bl.Final("never")])
    result = timed.run(model=model, tools=make_tools(clock, ran), prompt="go",
                       budget=bl.Budget(deadline_s=10))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    # Accepted calls that the deadline kept from running are still counted (SPEC 5).
    assert (result.model_steps, result.tool_calls) == (1, 2)
    assert ran == []
    assert model.calls == 1
    assert transcript(result) == [USER]
    names, _ = journal_of(timed, result)
    assert names.count("CallDecided") == 2
    assert "CallDispatched" not in names


def test_deadline_passing_mid_batch_skips_the_rest(timed: bl.Runner,
                                                   clock: bl.FakeClock) -> None:
    ran: list[str] = []
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("s1", "slow", {"text": "one", "seconds": 6}),
                      bl.ToolCall("s2", "slow", {"text": "two", "seconds": 6})]),
        bl.Final("never")])
    result = timed.run(model=model, tools=make_tools(clock, ran), prompt="go",
                       budget=bl.Budget(deadline_s=5, max_parallel=1))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert (result.model_steps, result.tool_calls) == (1, 2)
    assert len(ran) == 1
    label = ran[0]
    cid = {"one": "s1", "two": "s2"}[label]
    assert transcript(result) == [
        USER,
        {"kind": "call", "id": cid, "name": "slow", "arguments": {"text": label, "seconds": 6}},
        {"kind": "tool_result", "id": cid, "status": "ok", "content": label},
    ]
    names, _ = journal_of(timed, result)
    assert names.count("CallDecided") == 2
    assert names.count("CallDispatched") == 1
    assert names.count("CallSkipped") == 1


def test_deadline_checked_before_every_model_call(timed: bl.Runner, clock: bl.FakeClock) -> None:
    ran: list[str] = []

    def think(history: list[Any], ctx: bl.ModelContext) -> bl.CallTools:
        clock.advance(4)
        n = ctx.step
        return bl.CallTools([bl.ToolCall(f"c{n}", "echo", {"text": f"c{n}"})])

    model = bl.ScriptedModel([think] * 5)
    result = timed.run(model=model, tools=make_tools(clock, ran), prompt="go",
                       budget=bl.Budget(deadline_s=10))
    # Steps at t=0 and t=4 run their calls; the third step's calls come back at t=12.
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert (result.model_steps, result.tool_calls) == (3, 3)
    assert ran == ["c1", "c2"]
    assert [m["id"] for m in transcript(result) if m["kind"] == "call"] == ["c1", "c2"]
    journal_of(timed, result)


# -- tool timeouts ---------------------------------------------------------------------------
def test_tool_timeout_is_outcome_unknown_and_unresolved(runner: bl.Runner) -> None:
    release = threading.Event()
    started: list[str] = []

    @bl.tool(timeout_s=0.1)
    def hang(text: str) -> str:
        """Hang until released."""
        started.append(text)
        release.wait(3)
        return "too late"

    @bl.tool(read_only=True)
    def quick(text: str) -> str:
        """Answer at once."""
        return text

    try:
        model = bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("h", "hang", {"text": "x"}),
                          bl.ToolCall("q", "quick", {"text": "y"})]),
            bl.Final("gave up")])
        result = runner.run(model=model, tools=[hang, quick], prompt="go")
    finally:
        release.set()

    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert started == ["x"]
    t = transcript(result)
    assert [(m["id"], m["status"]) for m in t if m["kind"] == "tool_result"] == [
        ("h", "outcome_unknown"), ("q", "ok")]
    assert [(m["id"], m["status"]) for m in msgspec.to_builtins(model.seen[1])
            if m["kind"] == "tool_result"] == [("h", "outcome_unknown"), ("q", "ok")]
    assert len(result.unresolved) == 1
    u = result.unresolved[0]
    assert (u.run_id, u.call_id, u.tool, u.attempt, u.phase) == (
        result.run_id, "h", "hang", 1, "dispatched")
    assert u.execution_id and u.idempotency_key
    assert [c.call_id for c in result.completed if c.status == "ok"] == ["q"]
    names, events = journal_of(runner, result)
    assert "CallTimedOut" in names
    assert "CallFailed" not in names  # a timeout is never `failed`
    decided = [e for e in events if type(e).__name__ == "CallDecided" and e.call_id == "h"]
    assert decided[0].execution_id == u.execution_id


def test_tool_timeout_is_bounded_by_the_deadline(runner: bl.Runner) -> None:
    release = threading.Event()

    @bl.tool(timeout_s=30)
    def hang(text: str) -> str:
        """Hang until released."""
        release.wait(5)
        return "too late"

    try:
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("h", "hang", {"text": "x"})]),
                                  bl.Final("never")])
        result = runner.run(model=model, tools=[hang], prompt="go",
                            budget=bl.Budget(deadline_s=0.3))
    finally:
        release.set()
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert (result.model_steps, result.tool_calls) == (1, 1)
    assert result.elapsed_s < 3
    assert [(m["id"], m["status"]) for m in transcript(result) if m["kind"] == "tool_result"] \
        == [("h", "outcome_unknown")]
    assert [u.call_id for u in result.unresolved] == ["h"]
    journal_of(runner, result)


def test_deadline_is_checked_before_the_step_limit(timed: bl.Runner,
                                                   clock: bl.FakeClock) -> None:
    ran: list[str] = []
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("s", "slow", {"text": "a", "seconds": 20})]),
        bl.Final("never")])
    result = timed.run(model=model, tools=make_tools(clock, ran), prompt="go",
                       budget=bl.Budget(deadline_s=10, max_model_steps=1,
                                        reserve_final_step=False))
    # Past the deadline and out of steps at once: the deadline is reported (SPEC 5.1).
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert (result.model_steps, result.tool_calls) == (1, 1)
    assert ran == ["a"]
    journal_of(timed, result)
