"""SPEC 2: turns are kept (calls carry their step, an assistant message carries what came
with them), and malformed responses are explained in plain sentences."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from loop_helpers import transcript

import boundloop as bl
from boundloop import events as ev


@bl.tool(read_only=True)
def echo(text: str) -> str:
    """Echo."""
    return text


@bl.tool(read_only=True)
def search(query: str) -> str:
    """Search."""
    return query


def call(cid: str, text: str = "x") -> bl.ToolCall:
    return bl.ToolCall(cid, "echo", {"text": text})


def test_one_parallel_batch_and_two_rounds_are_told_apart_by_step(runner: bl.Runner) -> None:
    parallel = runner.run(model=bl.ScriptedModel([bl.CallTools([call("c1"), call("c2")]),
                                                  bl.Final("done")]),
                          tools=[echo], prompt="p")
    sequential = runner.run(model=bl.ScriptedModel([bl.CallTools([call("c1")]),
                                                    bl.CallTools([call("c2")]),
                                                    bl.Final("done")]),
                            tools=[echo], prompt="p")
    steps = [[m["step"] for m in transcript(r, steps=True) if m["kind"] == "call"]
             for r in (parallel, sequential)]
    assert steps == [[1, 1], [1, 2]]
    assert transcript(parallel) == transcript(sequential)  # the same without steps
    for result in (parallel, sequential):
        assert msgspec.to_builtins(bl.replay(runner.journal.events(result.run_id)).transcript) \
            == transcript(result, steps=True)


def test_text_and_provider_content_come_back_as_an_assistant_message(
        runner: bl.Runner) -> None:
    blocks = [{"type": "thinking", "thinking": "hmm", "signature": "sig-1"},
              {"type": "text", "text": "let me check"}]
    seen: list[list[bl.Message]] = []

    def model(history: list[bl.Message], ctx: bl.ModelContext) -> Any:
        seen.append(history)
        if ctx.step == 1:
            return bl.CallTools([call("c1"), call("c2")], text="let me check", content=blocks)
        return bl.Final("done")

    result = runner.run(model=model, tools=[echo], prompt="p")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 2)
    kinds = [m.kind for m in result.transcript]
    assert kinds == ["user", "assistant", "call", "tool_result", "call", "tool_result", "final"]
    assistant = result.transcript[1]
    assert assistant == bl.AssistantMessage(1, "let me check", blocks)
    assert seen[1][1] == assistant  # the model gets it back verbatim on the next step
    events = list(runner.journal.events(result.run_id))
    [completed] = [e for e in events if isinstance(e, ev.ModelStepCompleted)
                   and isinstance(e.response, bl.CallTools)]
    assert completed.response.content == blocks and completed.response.text == "let me check"
    assert bl.replay(events).transcript == result.transcript


def test_no_assistant_message_without_text_or_content(runner: bl.Runner) -> None:
    result = runner.run(model=bl.ScriptedModel([bl.CallTools([call("c1")]), bl.Final("d")]),
                        tools=[echo], prompt="p")
    assert "assistant" not in [m.kind for m in result.transcript]


def test_history_calls_without_a_step_are_accepted(runner: bl.Runner) -> None:
    history = [{"kind": "user", "text": "hi"},
               {"kind": "call", "id": "h1", "name": "echo", "arguments": {"text": "a"}},
               {"kind": "tool_result", "id": "h1", "status": "ok", "content": "a"},
               {"kind": "assistant", "step": 3, "text": "earlier words"}]
    result = runner.run(model=bl.ScriptedModel([bl.Final("d")]), tools=[echo],
                        history=history)
    assert transcript(result, steps=True)[1]["step"] is None
    assert result.transcript[3] == bl.AssistantMessage(3, "earlier words")


MALFORMED = [
    ({"kind": "calls", "calls": [{"id": "c1", "name": "search", "arguments": {"query": "a"}},
                                 {"id": "c2", "name": "search", "arguments": "query=a"}]},
     "call 2 (`search`) has arguments that are a string, not an object"),
    ({"kind": "calls", "calls": [{"id": "c1", "name": "search", "arguments": "{\"query\": "}]},
     "call 1 (`search`) has arguments that are a string, not an object (not valid JSON: "),
    ({"kind": "calls", "calls": []}, "its `calls` list is empty"),
    ({"kind": "calls", "calls": [{"id": "c1", "arguments": {}}]}, "call 1 has no tool name"),
    ({"kind": "calls", "calls": [{"name": "search", "arguments": {}}]},
     "call 1 (`search`) has no id"),
    ({"kind": "final"}, "the final response has no text"),
    ({"kind": "final", "text": 3}, "the final response's text is a number, not a string"),
    ({"kind": "sk-secret-kind"}, "the response's kind is a string other than"),
    ({"text": "hi"}, "the response has no `kind`"),
    ("just text", "a response must be bl.Final, bl.CallTools or a dict, not a string"),
    (bl.CallTools([bl.ToolCall("c1", "search", {"query": "a"})], text=5),  # type: ignore[arg-type]
     "the calls response's text is a number, not a string"),
]


@pytest.mark.parametrize(("response", "reason"), MALFORMED,
                         ids=[f"m{i}" for i in range(len(MALFORMED))])
def test_malformed_reasons_are_plain_sentences(runner: bl.Runner, response: Any,
                                               reason: str) -> None:
    model = bl.ScriptedModel([response, bl.Final("ok")])
    result = runner.run(model=model, tools=[search], prompt="p",
                        budget=bl.Budget(malformed_retries=1))
    assert (result.status, result.model_steps) == ("final", 2)
    notice = result.transcript[1]
    assert isinstance(notice, bl.NoticeMessage) and reason in notice.text, notice.text
    for internal in ("Expected", "$.", "msgspec", "ValidationError"):
        assert internal not in notice.text
    assert "sk-secret-kind" not in notice.text  # the model's own value is not echoed
    failed = [e for e in runner.journal.events(result.run_id)
              if isinstance(e, ev.ModelStepFailed)]
    assert [(e.reason, reason in e.detail) for e in failed] == [("malformed", True)]


def test_an_adapters_malformed_response_counts_and_charges_its_usage(
        runner: bl.Runner) -> None:
    model = bl.ScriptedModel([bl.Malformed("the model stopped at max_tokens (length)",
                                           usage=bl.Usage(10, 1024))])
    result = runner.run(model=model, prompt="p")
    assert (result.status, result.model_steps) == ("malformed_response", 1)
    assert "max_tokens" in result.explanation
    assert (result.usage.input_tokens, result.usage.output_tokens) == (10, 1024)
    assert bl.replay(runner.journal.events(result.run_id)).usage == result.usage
