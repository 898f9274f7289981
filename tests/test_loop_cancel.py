"""SPEC 5 steps 1, 4 and 10: cancellation before the model, after it, and during dispatch."""

from __future__ import annotations

import threading
from typing import Any

from loop_helpers import USER, journal_of, plain

import boundloop as bl


def make_echo(ran: list[str]) -> bl.Tool:
    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo the text."""
        ran.append(text)
        return text

    return echo


def test_token_cancelled_before_the_run(runner: bl.Runner) -> None:
    ran: list[str] = []
    token = bl.CancelToken()
    token.cancel("not today")
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "echo", {"text": "a"})]),
                              bl.Final("never")])
    result = runner.run(model=model, tools=[make_echo(ran)], prompt="go", cancel=token)

    assert (result.status, result.exhausted_limit) == ("cancelled", None)
    assert (result.model_steps, result.tool_calls) == (0, 0)
    assert model.calls == 0
    assert ran == []
    assert plain(result.transcript) == [USER]
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names


def test_model_cancels_its_own_call_response_is_discarded(runner: bl.Runner) -> None:
    ran: list[str] = []

    def cancel_then_call(history: list[Any], ctx: bl.ModelContext) -> bl.CallTools:
        ctx.cancel.cancel("user pressed stop")
        return bl.CallTools([bl.ToolCall("c1", "echo", {"text": "a"})])

    model = bl.ScriptedModel([cancel_then_call, bl.Final("never")])
    result = runner.run(model=model, tools=[make_echo(ran)], prompt="go")

    assert (result.status, result.exhausted_limit) == ("cancelled", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert model.calls == 1
    assert ran == []
    # The response is discarded: no call of it enters the history.
    assert plain(result.transcript) == [USER]
    assert result.completed == [] and result.unresolved == []
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names and "CallDispatched" not in names


def test_model_cancels_and_answers_final_is_discarded_too(runner: bl.Runner) -> None:
    def cancel_then_final(history: list[Any], ctx: bl.ModelContext) -> dict[str, Any]:
        ctx.cancel.cancel()
        return {"kind": "final", "text": "too late"}

    model = bl.ScriptedModel([cancel_then_final])
    result = runner.run(model=model, prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("cancelled", 1, 0)
    assert plain(result.transcript) == [USER]
    journal_of(runner, result)


def test_cancel_given_token_after_a_tool_step(runner: bl.Runner) -> None:
    ran: list[str] = []
    token = bl.CancelToken()

    @bl.tool
    def stopper(text: str) -> str:
        """Cancel the run from inside a tool (it still returns)."""
        ran.append(text)
        token.cancel()
        return "stopped"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "stopper", {"text": "a"})]),
                              bl.Final("never")])
    result = runner.run(model=model, tools=[stopper], prompt="go", cancel=token)
    assert (result.status, result.model_steps, result.tool_calls) == ("cancelled", 1, 1)
    assert ran == ["a"]
    assert model.calls == 1
    assert plain(result.transcript) == [
        USER,
        {"kind": "call", "id": "c1", "name": "stopper", "arguments": {"text": "a"}},
        {"kind": "tool_result", "id": "c1", "status": "ok", "content": "stopped"},
    ]
    journal_of(runner, result)


def test_runner_cancel_from_another_thread_while_a_tool_runs(runner: bl.Runner) -> None:
    started = threading.Event()
    ran: list[str] = []
    lock = threading.Lock()

    @bl.tool(timeout_s=10)
    def hold(label: str, ctx: bl.ToolContext) -> str:
        """Wait until the run is cancelled."""
        with lock:
            ran.append(label)
        started.set()
        observed = ctx.cancel.wait(5)
        return f"{label} saw cancel={observed}"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "hold", {"label": "one"}),
                      bl.ToolCall("c2", "hold", {"label": "two"})]),
        bl.Final("never")])
    future = runner.submit(model=model, tools=[hold], prompt="go", run_id="r-cancel",
                           budget=bl.Budget(max_parallel=1))
    assert started.wait(5)

    cancelled_in = threading.Thread(target=lambda: runner.cancel("r-cancel"))
    cancelled_in.start()
    cancelled_in.join(5)
    result = future.result(timeout=10)

    assert (result.status, result.exhausted_limit) == ("cancelled", None)
    # Both calls were accepted (counted); the one not yet started never ran.
    assert (result.model_steps, result.tool_calls) == (1, 2)
    assert len(ran) == 1
    label = ran[0]
    cid = {"one": "c1", "two": "c2"}[label]
    assert plain(result.transcript) == [
        USER,
        {"kind": "call", "id": cid, "name": "hold", "arguments": {"label": label}},
        {"kind": "tool_result", "id": cid, "status": "ok",
         "content": f"{label} saw cancel=True"},
    ]
    assert model.calls == 1
    assert runner.cancel("r-cancel") is False  # no longer in flight
    names, events = journal_of(runner, result)
    assert names.count("CallDecided") == 2
    assert names.count("CallDispatched") == 1
    assert names.count("CallSkipped") == 1


def test_cancel_unknown_run_is_false(runner: bl.Runner) -> None:
    assert runner.cancel("no-such-run") is False


def test_runner_cancel_while_the_model_works(runner: bl.Runner) -> None:
    entered = threading.Event()
    resume = threading.Event()

    def slow_model(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        entered.set()
        resume.wait(5)
        return bl.Final("too late")

    model = bl.ScriptedModel([slow_model])
    future = runner.submit(model=model, prompt="go", run_id="r-model")
    try:
        assert entered.wait(5)
        assert runner.cancel("r-model") is True
    finally:
        resume.set()
    result = future.result(timeout=10)
    assert (result.status, result.exhausted_limit) == ("cancelled", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert plain(result.transcript) == [USER]
    journal_of(runner, result)


def test_cancellation_is_checked_before_the_deadline(journal_dir: Any) -> None:
    clock = bl.FakeClock()
    token = bl.CancelToken()

    @bl.tool
    def both() -> str:
        """Pass the deadline and cancel the run."""
        clock.advance(100)
        token.cancel()
        return "ok"

    with bl.Runner(journal_dir, clock=clock) as runner:
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "both", {})]),
                                  bl.Final("never")])
        result = runner.run(model=model, tools=[both], prompt="go", cancel=token,
                            budget=bl.Budget(deadline_s=10))
        # Both cancelled and past the deadline before step 2: cancelled wins (SPEC 5.1).
        assert (result.status, result.exhausted_limit) == ("cancelled", None)
        assert (result.model_steps, result.tool_calls) == (1, 1)
        assert model.calls == 1
        assert [m["kind"] for m in plain(result.transcript)] == [
            "user", "call", "tool_result"]
        journal_of(runner, result)
