"""SPEC 5 steps 7-11: a tool-to-final exchange, the tool-call budget, repeated call ids."""

from __future__ import annotations

from typing import Any

import pytest
from loop_helpers import USER, journal_of, plain, transcript

import boundloop as bl


def call(cid: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"kind": "call", "id": cid, "name": name, "arguments": arguments}


def ok(cid: str, content: Any) -> dict[str, Any]:
    return {"kind": "tool_result", "id": cid, "status": "ok", "content": content}


@pytest.fixture
def echo() -> tuple[bl.Tool, list[str]]:
    ran: list[str] = []

    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo the text."""
        ran.append(text)
        return text.upper()

    return echo, ran


def calls(*ids: str) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(i, "echo", {"text": i}) for i in ids])


# -- the happy path ------------------------------------------------------------------------
def test_tool_then_final_exchange(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("c1", "c2"), bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="go")

    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert sorted(ran) == ["c1", "c2"]
    assert transcript(result) == [
        USER,
        call("c1", "echo", text="c1"), ok("c1", "C1"),
        call("c2", "echo", text="c2"), ok("c2", "C2"),
        {"kind": "final", "text": "done"},
    ]
    assert [(c.call_id, c.tool, c.status, c.attempts) for c in result.completed] == [
        ("c1", "echo", "ok", 1), ("c2", "echo", "ok", 1)]
    assert result.unresolved == []
    assert result.explanation
    # The model's second step observed both results, in the order it gave the calls.
    assert plain(model.seen[1]) == transcript(result)[:-1]
    assert [c.step for c in model.contexts] == [1, 2]
    assert all(c.run_id == result.run_id for c in model.contexts)
    assert [t["name"] for t in model.contexts[0].tools] == ["echo"]
    names, events = journal_of(runner, result)
    assert names.count("CallDecided") == 2
    assert names.count("CallDispatched") == 2
    assert names.count("CallSucceeded") == 2
    assert names.count("ModelStepCompleted") == 2
    assert list(runner.journal.runs()) == [result.run_id]


def test_run_id_given_is_used(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, _ = echo
    result = runner.run(model=bl.ScriptedModel([bl.Final("x")]), tools=[tool], prompt="go",
                        run_id="my-run")
    assert result.run_id == "my-run"
    assert result.status == "final"
    journal_of(runner, result)
    assert list(runner.journal.runs()) == ["my-run"]


# -- the tool-call budget (step 8) ---------------------------------------------------------
def test_new_call_beyond_spent_call_budget(runner: bl.Runner,
                                           echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("c1"), calls("c2"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=6, max_tool_calls=1))

    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert ran == ["c1"]
    assert transcript(result) == [USER, call("c1", "echo", text="c1"), ok("c1", "C1")]
    assert [c.tools_allowed for c in model.contexts] == [True, False]
    assert "1" in result.explanation
    names, events = journal_of(runner, result)
    assert [e.call_id for e in events if type(e).__name__ == "CallDecided"] == ["c1"]


def test_batch_that_would_pass_the_budget_is_refused_whole(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("a", "b"), calls("c", "d"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_tool_calls=3))

    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert sorted(ran) == ["a", "b"]
    assert transcript(result) == [USER, call("a", "echo", text="a"), ok("a", "A"),
                                  call("b", "echo", text="b"), ok("b", "B")]
    # Step 2 was still allowed tools (2 < 3): the batch as a whole is what failed.
    assert [c.tools_allowed for c in model.contexts] == [True, True]
    assert "3" in result.explanation
    names, events = journal_of(runner, result)
    assert [e.call_id for e in events if type(e).__name__ == "CallDecided"] == ["a", "b"]
    assert names.count("CallDispatched") == 2


def test_first_batch_larger_than_budget_runs_nothing(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("a", "b", "c"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_tool_calls=2))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "tool_calls")
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert ran == []
    assert transcript(result) == [USER]
    assert model.calls == 1
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names and "CallDispatched" not in names


def test_batch_filling_the_budget_exactly_runs_then_final(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("a", "b"), bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_tool_calls=2))
    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert sorted(ran) == ["a", "b"]
    # The call budget is spent: the final-answer step has no tools, and is still accepted.
    assert [c.tools_allowed for c in model.contexts] == [True, False]
    assert model.contexts[1].remaining.tool_calls == 0
    assert transcript(result)[-1] == {"kind": "final", "text": "done"}
    journal_of(runner, result)


# -- repeated call ids (step 8) ------------------------------------------------------------
def test_call_id_repeated_across_steps(runner: bl.Runner,
                                       echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("c1"), calls("c2", "c1"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go")

    assert (result.status, result.exhausted_limit) == ("repeated_call", None)
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert ran == ["c1"]  # c2, new, was in the refused batch and did not run
    assert transcript(result) == [USER, call("c1", "echo", text="c1"), ok("c1", "C1")]
    assert "c1" in result.explanation
    names, events = journal_of(runner, result)
    assert [e.call_id for e in events if type(e).__name__ == "CallDecided"] == ["c1"]


def test_call_id_repeated_inside_one_batch(runner: bl.Runner,
                                           echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("x", "echo", {"text": "one"}),
                      bl.ToolCall("y", "echo", {"text": "two"}),
                      bl.ToolCall("x", "echo", {"text": "three"})]),
        bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go")
    assert (result.status, result.exhausted_limit) == ("repeated_call", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert ran == []
    assert transcript(result) == [USER]
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names


def test_repeated_id_is_checked_before_the_call_budget(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([calls("x", "x", "x")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_tool_calls=2))
    assert (result.status, result.exhausted_limit) == ("repeated_call", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert ran == []
    journal_of(runner, result)


def test_call_ids_of_given_history_are_reserved(runner: bl.Runner,
                                                echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    history = [
        {"kind": "user", "text": "earlier"},
        call("h1", "echo", text="old"),
        ok("h1", "OLD"),
        {"kind": "final", "text": "earlier answer"},
    ]
    model = bl.ScriptedModel([calls("h2"), calls("h1"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], history=history, prompt="go")

    assert (result.status, result.exhausted_limit) == ("repeated_call", None)
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert ran == ["h2"]
    assert transcript(result) == history + [USER, call("h2", "echo", text="h2"),
                                            ok("h2", "H2")]
    assert plain(model.seen[0]) == history + [USER]
    names, events = journal_of(runner, result)
    assert plain(events[0].history) == history + [USER]
    assert [e.call_id for e in events if type(e).__name__ == "CallDecided"] == ["h2"]


def test_history_id_reserved_even_in_first_batch(runner: bl.Runner,
                                                 echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    history = [bl.UserMessage("earlier"), bl.CallMessage("h1", "echo", {"text": "old"}),
               bl.ToolResultMessage("h1", "ok", "OLD")]
    model = bl.ScriptedModel([calls("h1")])
    result = runner.run(model=model, tools=[tool], history=history)
    assert (result.status, result.model_steps, result.tool_calls) == ("repeated_call", 1, 0)
    assert ran == []
    assert transcript(result) == plain(history)
    journal_of(runner, result)


def test_context_tools_are_schemas_without_the_context_parameter(runner: bl.Runner) -> None:
    @bl.tool(read_only=True)
    def search(query: str, ctx: bl.ToolContext, limit: int = 5) -> list[str]:
        """Search the web."""
        return [f"{query}:{limit}:{ctx.call_id}"]

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("s1", "search", {"query": "q"})]), bl.Final("done")])
    result = runner.run(model=model, tools=[search], prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert transcript(result)[2] == ok("s1", ["q:5:s1"])
    (schema,) = model.contexts[0].tools
    assert schema["name"] == "search"
    assert schema["description"] == "Search the web."
    assert set(schema["parameters"]["properties"]) == {"query", "limit"}
    assert schema["parameters"]["required"] == ["query"]
    journal_of(runner, result)


def test_journal_lists_runs_oldest_first(runner: bl.Runner) -> None:
    ids = []
    for text in ("one", "two", "three"):
        result = runner.run(model=bl.ScriptedModel([bl.Final(text)]), prompt=text)
        assert result.status == "final"
        journal_of(runner, result)
        ids.append(result.run_id)
    assert len(set(ids)) == 3
    assert list(runner.journal.runs()) == ids
