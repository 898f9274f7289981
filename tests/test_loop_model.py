"""SPEC 2, 3 and 5 steps 1-7: malformed responses, model errors, the final-only step."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from loop_helpers import USER, journal_of, transcript

import boundloop as bl


def call_echo(cid: str) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(cid, "echo", {"text": cid})])


def pair(cid: str) -> list[dict[str, Any]]:
    return [{"kind": "call", "id": cid, "name": "echo", "arguments": {"text": cid}},
            {"kind": "tool_result", "id": cid, "status": "ok", "content": cid}]


MALFORMED = {
    "string": "just text",
    "none": None,
    "list": [{"kind": "final", "text": "x"}],
    "int": 42,
    "toolcall-object": bl.ToolCall("c1", "echo", {"text": "a"}),
    "unknown-kind": {"kind": "maybe", "text": "x"},
    "no-kind": {"text": "x"},
    "final-missing-text": {"kind": "final"},
    "final-text-wrong-type": {"kind": "final", "text": 42},
    "final-struct-text-wrong-type": bl.Final(42),  # type: ignore[arg-type]
    "calls-empty": {"kind": "calls", "calls": []},
    "calls-struct-empty": bl.CallTools([]),
    "calls-not-a-list": {"kind": "calls", "calls": "echo"},
    "calls-missing": {"kind": "calls"},
    "call-missing-arguments": {"kind": "calls", "calls": [{"id": "c1", "name": "echo"}]},
    "call-missing-id": {"kind": "calls",
                        "calls": [{"name": "echo", "arguments": {"text": "a"}}]},
    "arguments-list": {"kind": "calls",
                       "calls": [{"id": "c1", "name": "echo", "arguments": ["a"]}]},
    "arguments-string": {"kind": "calls",
                         "calls": [{"id": "c1", "name": "echo", "arguments": "text=a"}]},
    "arguments-struct-not-dict": bl.CallTools(
        [bl.ToolCall("c1", "echo", ["a"])]),  # type: ignore[arg-type]
    "call-name-wrong-type": {"kind": "calls",
                             "calls": [{"id": "c1", "name": 7, "arguments": {}}]},
}


@pytest.mark.parametrize("response", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_response_ends_the_run(runner: bl.Runner, echo: tuple[bl.Tool, list[str]],
                                         response: Any) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([response, bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go")

    assert (result.status, result.exhausted_limit) == ("malformed_response", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert model.calls == 1
    assert ran == []
    assert transcript(result) == [USER]
    assert result.explanation
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names


@pytest.mark.parametrize("response", [MALFORMED["string"], MALFORMED["unknown-kind"],
                                      MALFORMED["calls-empty"], MALFORMED["arguments-list"],
                                      MALFORMED["final-text-wrong-type"]],
                         ids=["string", "unknown-kind", "calls-empty", "arguments-list",
                              "wrong-type"])
def test_malformed_retry_appends_notice_and_goes_on(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]], response: Any) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([response, call_echo("c1"), bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(malformed_retries=1))

    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (3, 1)
    assert ran == ["c1"]
    t = transcript(result)
    assert t[0] == USER
    assert t[1]["kind"] == "notice" and isinstance(t[1]["text"], str) and t[1]["text"]
    assert t[2:] == pair("c1") + [{"kind": "final", "text": "done"}]
    # The model's next step saw the notice.
    assert msgspec.to_builtins(model.seen[1]) == t[:2]
    assert model.seen[1][-1].kind == "notice"
    journal_of(runner, result)


def test_malformed_retries_run_out(runner: bl.Runner) -> None:
    model = bl.ScriptedModel(["bad", {"kind": "nope"}, {"kind": "calls", "calls": []},
                              bl.Final("never")])
    result = runner.run(model=model, prompt="go", budget=bl.Budget(malformed_retries=2))
    assert (result.status, result.exhausted_limit) == ("malformed_response", None)
    assert (result.model_steps, result.tool_calls) == (3, 0)
    assert model.calls == 3
    kinds = [m["kind"] for m in transcript(result)]
    assert kinds == ["user", "notice", "notice"]
    journal_of(runner, result)


def test_malformed_retries_are_counted_per_run(runner: bl.Runner,
                                               echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel(["bad", call_echo("c1"), "bad again", bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(malformed_retries=1))
    assert (result.status, result.model_steps, result.tool_calls) == ("malformed_response", 3, 1)
    assert ran == ["c1"]
    t = transcript(result)
    assert [m["kind"] for m in t] == ["user", "notice", "call", "tool_result"]
    journal_of(runner, result)


def test_malformed_step_counts_toward_max_model_steps(runner: bl.Runner) -> None:
    model = bl.ScriptedModel(["bad", "bad", "bad"])
    result = runner.run(model=model, prompt="go",
                        budget=bl.Budget(max_model_steps=2, malformed_retries=5))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (2, 0)
    assert model.calls == 2
    journal_of(runner, result)


def test_dict_responses_are_accepted(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([
        {"kind": "calls", "calls": [{"id": "c1", "name": "echo", "arguments": {"text": "c1"}}]},
        {"kind": "final", "text": "done"}])
    result = runner.run(model=model, tools=[tool], prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == ["c1"]
    assert transcript(result) == [USER, *pair("c1"), {"kind": "final", "text": "done"}]
    journal_of(runner, result)


# -- model errors (step 3) -----------------------------------------------------------------
def test_model_exception_is_model_error(runner: bl.Runner,
                                        echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1"), RuntimeError("provider down"), bl.Final("x")])
    result = runner.run(model=model, tools=[tool], prompt="go")
    assert (result.status, result.exhausted_limit) == ("model_error", None)
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert model.calls == 2
    assert ran == ["c1"]
    assert transcript(result) == [USER, *pair("c1")]
    assert result.explanation
    journal_of(runner, result)


def test_model_raising_on_first_step_counts_the_step(runner: bl.Runner) -> None:
    def broken(history: list[Any], ctx: bl.ModelContext) -> Any:
        raise ValueError("bad key")

    result = runner.run(model=broken, prompt="go")
    assert (result.status, result.exhausted_limit) == ("model_error", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert transcript(result) == [USER]
    journal_of(runner, result)


def test_script_exhausted_is_model_error(runner: bl.Runner) -> None:
    model = bl.ScriptedModel([])
    result = runner.run(model=model, prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("model_error", 1, 0)
    journal_of(runner, result)


# -- the final-only step (steps 2, 7, 8) ---------------------------------------------------
def test_last_step_is_final_only_and_a_call_there_exceeds_model_steps(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1"), call_echo("c2"), call_echo("c3")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=3))

    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (3, 2)
    assert ran == ["c1", "c2"]
    assert [c.tools_allowed for c in model.contexts] == [True, True, False]
    assert [c.step for c in model.contexts] == [1, 2, 3]
    assert [c.remaining.model_steps for c in model.contexts] == [2, 1, 0]
    assert transcript(result) == [USER, *pair("c1"), *pair("c2")]
    assert "3" in result.explanation
    names, events = journal_of(runner, result)
    assert [e.call_id for e in events if type(e).__name__ == "CallDecided"] == ["c1", "c2"]


def test_final_on_the_final_only_step_is_accepted(runner: bl.Runner,
                                                  echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1"), bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=2))
    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert [c.tools_allowed for c in model.contexts] == [True, False]
    assert transcript(result) == [USER, *pair("c1"), {"kind": "final", "text": "done"}]
    journal_of(runner, result)


def test_single_step_budget_is_final_only(runner: bl.Runner,
                                          echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=1))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert model.contexts[0].tools_allowed is False
    assert ran == []
    assert transcript(result) == [USER]
    journal_of(runner, result)


def test_final_only_step_wins_over_repeated_id(runner: bl.Runner,
                                               echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1"), call_echo("c1")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=2))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (2, 1)
    assert ran == ["c1"]
    journal_of(runner, result)


def test_without_reserve_final_step_the_last_step_may_call(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo("c1"), call_echo("c2"), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=2, reserve_final_step=False))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert [c.tools_allowed for c in model.contexts] == [True, True]
    assert model.calls == 2
    assert ran == ["c1", "c2"]
    assert transcript(result) == [USER, *pair("c1"), *pair("c2")]
    journal_of(runner, result)


def test_model_steps_limit_stops_before_the_model_call(runner: bl.Runner,
                                                       echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call_echo(f"c{i}") for i in range(1, 6)])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_model_steps=4, reserve_final_step=False))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (4, 4)
    assert model.calls == 4
    assert ran == ["c1", "c2", "c3", "c4"]
    journal_of(runner, result)
