"""SPEC 2: the callback gets a fresh copy of the history; result.transcript is a copy."""

from __future__ import annotations

from typing import Any

from loop_helpers import journal_of, plain

import boundloop as bl


def make_lookup(seen: list[dict[str, Any]]) -> bl.Tool:
    @bl.tool(read_only=True)
    def lookup(query: dict[str, Any]) -> dict[str, Any]:
        """Look something up; returns a nested structure."""
        seen.append(plain(query))
        return {"hits": [{"name": query["city"], "temp": 20}], "meta": {"n": 1}}

    return lookup


EXPECTED = [
    {"kind": "user", "text": "weather?"},
    {"kind": "call", "id": "c1", "name": "lookup",
     "arguments": {"query": {"city": "Paris", "tags": ["a"]}}},
    {"kind": "tool_result", "id": "c1", "status": "ok",
     "content": {"hits": [{"name": "Paris", "temp": 20}], "meta": {"n": 1}}},
    {"kind": "call", "id": "c2", "name": "lookup",
     "arguments": {"query": {"city": "Rome", "tags": []}}},
    {"kind": "tool_result", "id": "c2", "status": "ok",
     "content": {"hits": [{"name": "Rome", "temp": 20}], "meta": {"n": 1}}},
    {"kind": "final", "text": "sunny"},
]


def test_callback_mutating_its_history_changes_nothing_recorded(runner: bl.Runner) -> None:
    seen: list[dict[str, Any]] = []
    observed: list[list[dict[str, Any]]] = []

    def vandal(history: list[Any], ctx: bl.ModelContext) -> bl.CallTools:
        observed.append(plain(history))
        # Nested dicts and lists of the messages it was given...
        history[1].arguments["query"]["city"] = "HACKED"
        history[1].arguments["query"]["tags"].append("HACKED")
        history[1].arguments["evil"] = True
        history[2].content["hits"][0]["name"] = "HACKED"
        history[2].content["meta"].clear()
        # ...and the list itself.
        history.append(bl.UserMessage("injected"))
        history.insert(0, bl.FinalMessage("injected"))
        del history[1]
        return bl.CallTools([bl.ToolCall("c2", "lookup", {"query": {"city": "Rome",
                                                                    "tags": []}})])

    def check_then_final(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        observed.append(plain(history))
        history.clear()
        return bl.Final("sunny")

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "lookup", {"query": {"city": "Paris", "tags": ["a"]}})]),
        vandal, check_then_final])
    result = runner.run(model=model, tools=[make_lookup(seen)], prompt="weather?")

    assert (result.status, result.model_steps, result.tool_calls) == ("final", 3, 2)
    assert seen == [{"city": "Paris", "tags": ["a"]}, {"city": "Rome", "tags": []}]
    assert plain(result.transcript) == EXPECTED
    # Each step got a fresh, unmutated copy.
    assert observed[0] == EXPECTED[:3]
    assert observed[1] == EXPECTED[:5]
    names, events = journal_of(runner, result)
    decided = [plain(e.arguments) for e in events
               if type(e).__name__ == "CallDecided"]
    assert decided == [{"query": {"city": "Paris", "tags": ["a"]}},
                       {"query": {"city": "Rome", "tags": []}}]


def test_result_transcript_is_a_copy_of_the_given_history(runner: bl.Runner) -> None:
    seen: list[dict[str, Any]] = []
    nested = {"city": "Oslo", "tags": ["x"]}
    content = {"hits": [{"name": "Oslo"}]}
    history: list[Any] = [
        {"kind": "user", "text": "before"},
        {"kind": "call", "id": "h1", "name": "lookup", "arguments": {"query": nested}},
        {"kind": "tool_result", "id": "h1", "status": "ok", "content": content},
    ]
    model = bl.ScriptedModel([bl.Final("done")])
    result = runner.run(model=model, tools=[make_lookup(seen)], history=history, prompt="more")
    expected = [
        {"kind": "user", "text": "before"},
        {"kind": "call", "id": "h1", "name": "lookup",
         "arguments": {"query": {"city": "Oslo", "tags": ["x"]}}},
        {"kind": "tool_result", "id": "h1", "status": "ok",
         "content": {"hits": [{"name": "Oslo"}]}},
        {"kind": "user", "text": "more"},
        {"kind": "final", "text": "done"},
    ]
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 1, 0)
    assert plain(result.transcript) == expected

    # The caller changes its own objects after the run: the result must not change.
    nested["city"] = "CHANGED"
    nested["tags"].append("CHANGED")
    content["hits"].append({"name": "CHANGED"})
    history.append({"kind": "user", "text": "CHANGED"})
    assert plain(result.transcript) == expected
    journal_of(runner, result)


def test_mutating_result_transcript_leaves_the_callers_history(runner: bl.Runner) -> None:
    nested = {"city": "Oslo", "tags": ["x"]}
    history: list[Any] = [
        {"kind": "call", "id": "h1", "name": "lookup", "arguments": {"query": nested}},
        {"kind": "tool_result", "id": "h1", "status": "ok", "content": ["r"]},
    ]
    result = runner.run(model=bl.ScriptedModel([bl.Final("done")]),
                        tools=[make_lookup([])], history=history, prompt="more")
    assert result.status == "final"
    result.transcript[0].arguments["query"]["city"] = "CHANGED"
    result.transcript[1].content.append("CHANGED")
    result.transcript.clear()
    assert nested == {"city": "Oslo", "tags": ["x"]}
    assert history[1]["content"] == ["r"]
    # The journal still holds the run as it happened.
    state = bl.replay(runner.journal.events(result.run_id))
    assert plain(state.transcript) == [
        {"kind": "call", "id": "h1", "name": "lookup",
         "arguments": {"query": {"city": "Oslo", "tags": ["x"]}}},
        {"kind": "tool_result", "id": "h1", "status": "ok", "content": ["r"]},
        {"kind": "user", "text": "more"},
        {"kind": "final", "text": "done"},
    ]
    assert (state.status, state.model_steps, state.tool_calls) == ("final", 1, 0)


def test_handler_mutating_its_arguments_changes_nothing_recorded(runner: bl.Runner) -> None:
    @bl.tool
    def scribble(query: dict[str, Any], items: list[Any]) -> str:
        """Mutate everything it was given."""
        query["inner"]["city"] = "HACKED"
        query["added"] = True
        items[0]["n"] = "HACKED"
        items.append("HACKED")
        return "scribbled"

    arguments = {"query": {"inner": {"city": "Paris"}}, "items": [{"n": 1}]}
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "scribble", arguments)]),
                              bl.Final("done")])
    result = runner.run(model=model, tools=[scribble], prompt="go")
    expected = [
        {"kind": "user", "text": "go"},
        {"kind": "call", "id": "c1", "name": "scribble",
         "arguments": {"query": {"inner": {"city": "Paris"}}, "items": [{"n": 1}]}},
        {"kind": "tool_result", "id": "c1", "status": "ok", "content": "scribbled"},
        {"kind": "final", "text": "done"},
    ]
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert plain(model.seen[1]) == expected[:3]
    assert plain(result.transcript) == expected
    journal_of(runner, result)
