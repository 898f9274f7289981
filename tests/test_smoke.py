"""A tool-to-final exchange end to end: result, transcript, journal and replay agree."""

from __future__ import annotations

import msgspec

import boundloop as bl


def test_tool_then_final(runner: bl.Runner) -> None:
    seen: list[str] = []

    @bl.tool(read_only=True)
    def search(query: str) -> list[str]:
        seen.append(query)
        return [f"sunny in {query}"]

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "search", {"query": "Paris"})]),
        bl.Final("sunny"),
    ])
    result = runner.run(model=model, tools=[search], prompt="weather?")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert seen == ["Paris"]
    assert msgspec.to_builtins(result.transcript) == [
        {"kind": "user", "text": "weather?"},
        {"kind": "call", "id": "c1", "name": "search", "arguments": {"query": "Paris"},
         "step": 1},
        {"kind": "tool_result", "id": "c1", "status": "ok", "content": ["sunny in Paris"]},
        {"kind": "final", "text": "sunny"},
    ]
    state = bl.replay(runner.journal.events(result.run_id))
    assert (state.status, state.model_steps, state.tool_calls) == ("final", 2, 1)
    assert state.transcript == result.transcript
    assert list(runner.journal.runs()) == [result.run_id]
