"""SPEC 5 steps 1 and 6, SPEC 7: token and cost limits, reservations, reported usage."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from loop_helpers import journal_of, transcript

import boundloop as bl


def reservation_tokens(history: list[Any]) -> int:
    """SPEC 5.1: ceil(bytes of the history as JSON / 4)."""
    return math.ceil(len(msgspec.json.encode(msgspec.to_builtins(history))) / 4)


def call(cid: str, usage: Any = None) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(cid, "echo", {"text": cid})], usage=usage)


def charged(events: list[Any]) -> list[tuple[Any, bool]]:
    return [(e.usage, e.estimated) for e in events if type(e).__name__ == "UsageCharged"]


# -- reported usage ----------------------------------------------------------------------------
def test_usage_sums_reported_steps(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    u1 = bl.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=5)
    u2 = bl.Usage(input_tokens=150, output_tokens=30, cache_write_tokens=7)
    model = bl.ScriptedModel([call("c1", u1), bl.Final("done", usage=u2)])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_total_tokens=10_000))
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == ["c1"]
    assert result.usage == bl.Usage(input_tokens=250, output_tokens=50, cache_write_tokens=7,
                                    cache_read_tokens=5)
    names, events = journal_of(runner, result)
    assert charged(events) == [(u1, False), (u2, False)]


def test_dict_usage_is_charged(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([
        {"kind": "calls", "calls": [{"id": "c1", "name": "echo", "arguments": {"text": "c1"}}],
         "usage": {"input_tokens": 11, "output_tokens": 3}},
        {"kind": "final", "text": "done", "usage": {"input_tokens": 13, "output_tokens": 4}},
    ])
    result = runner.run(model=model, tools=[tool], prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == ["c1"]
    assert result.usage == bl.Usage(input_tokens=24, output_tokens=7)
    journal_of(runner, result)


def test_unreported_step_keeps_its_reservation(runner: bl.Runner,
                                               echo: tuple[bl.Tool, list[str]]) -> None:
    tool, _ = echo
    model = bl.ScriptedModel([call("c1", bl.Usage(input_tokens=40, output_tokens=2)),
                              bl.Final("done")], max_output_tokens=64)
    result = runner.run(model=model, tools=[tool], prompt="go")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    second = reservation_tokens(model.seen[1])
    assert result.usage == bl.Usage(input_tokens=40 + second, output_tokens=2 + 64)
    names, events = journal_of(runner, result)
    assert [estimated for _, estimated in charged(events)] == [False, True]


def test_model_error_keeps_the_reservation(runner: bl.Runner) -> None:
    model = bl.ScriptedModel([RuntimeError("down")], max_output_tokens=10)
    result = runner.run(model=model, prompt="hello there")
    assert (result.status, result.model_steps, result.tool_calls) == ("model_error", 1, 0)
    assert result.usage == bl.Usage(input_tokens=reservation_tokens(model.seen[0]),
                                    output_tokens=10)
    names, events = journal_of(runner, result)
    assert [estimated for _, estimated in charged(events)] == [True]


def test_reported_cost_is_summed(runner: bl.Runner, echo: tuple[bl.Tool, list[str]]) -> None:
    tool, _ = echo
    model = bl.ScriptedModel([call("c1", bl.Usage(input_tokens=1, cost=0.25)),
                              bl.Final("done", usage=bl.Usage(input_tokens=1, cost=0.5))])
    result = runner.run(model=model, tools=[tool], prompt="go", budget=bl.Budget(max_cost=1.0))
    assert (result.status, result.tool_calls) == ("final", 1)
    assert result.usage.cost == pytest.approx(0.75)
    journal_of(runner, result)


# -- reservation checked before the call (step 1) -----------------------------------------
@pytest.mark.parametrize("kind", ["input_tokens", "output_tokens", "total_tokens"])
def test_reservation_above_limit_stops_before_the_model_call(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]], kind: str) -> None:
    tool, ran = echo
    prompt = "x" * 400  # about 100 input tokens reserved
    budget = {
        "input_tokens": bl.Budget(max_input_tokens=50),
        "output_tokens": bl.Budget(max_output_tokens=500),
        "total_tokens": bl.Budget(max_total_tokens=150, max_input_tokens=1000),
    }[kind]
    model = bl.ScriptedModel([call("c1"), bl.Final("never")], max_output_tokens=1000)
    result = runner.run(model=model, tools=[tool], prompt=prompt, budget=budget)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", kind)
    assert (result.model_steps, result.tool_calls) == (0, 0)
    assert model.calls == 0
    assert ran == []
    assert transcript(result) == [{"kind": "user", "text": prompt}]
    assert str(budget.limit(kind)) in result.explanation
    names, _ = journal_of(runner, result)
    assert "ModelStepStarted" not in names and "CallDecided" not in names


def test_reservation_equal_to_limit_is_allowed(runner: bl.Runner) -> None:
    prompt = "x" * 400
    need = reservation_tokens([bl.UserMessage(prompt)])
    model = bl.ScriptedModel([bl.Final("ok", usage=bl.Usage(input_tokens=1))])
    result = runner.run(model=model, prompt=prompt, budget=bl.Budget(max_input_tokens=need))
    assert (result.status, result.model_steps) == ("final", 1)
    assert result.usage == bl.Usage(input_tokens=1)
    journal_of(runner, result)

    model = bl.ScriptedModel([bl.Final("never")])
    result = runner.run(model=model, prompt=prompt, budget=bl.Budget(max_input_tokens=need - 1))
    assert (result.status, result.exhausted_limit, result.model_steps) == (
        "limit_exceeded", "input_tokens", 0)
    assert model.calls == 0
    journal_of(runner, result)


def test_used_plus_reservation_stops_a_later_step(runner: bl.Runner,
                                                  echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call("c1", bl.Usage(input_tokens=190)), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_input_tokens=200))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "input_tokens")
    assert (result.model_steps, result.tool_calls) == (1, 1)
    assert model.calls == 1
    assert ran == ["c1"]
    assert [m["kind"] for m in transcript(result)] == ["user", "call", "tool_result"]
    assert result.usage == bl.Usage(input_tokens=190)
    journal_of(runner, result)


def test_cost_reservation_from_price_table(journal_dir: Path) -> None:
    # 1 currency unit per input token: ~100 tokens reserved is above max_cost=10.
    with bl.Runner(journal_dir, price=bl.Price(input_per_mtok=1_000_000)) as runner:
        model = bl.ScriptedModel([bl.Final("never")])
        result = runner.run(model=model, prompt="x" * 400, budget=bl.Budget(max_cost=10))
        assert (result.status, result.exhausted_limit) == ("limit_exceeded", "cost")
        assert (result.model_steps, result.tool_calls) == (0, 0)
        assert model.calls == 0
        journal_of(runner, result)


def test_context_remaining_after_reported_usage(runner: bl.Runner,
                                                echo: tuple[bl.Tool, list[str]]) -> None:
    tool, _ = echo
    model = bl.ScriptedModel([call("c1", bl.Usage(input_tokens=10)), bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_input_tokens=1000, max_tool_calls=5))
    assert result.status == "final"
    first, second = model.contexts
    assert (first.remaining.model_steps, first.remaining.tool_calls) == (5, 5)
    assert (second.remaining.model_steps, second.remaining.tool_calls) == (4, 4)
    assert first.remaining.input_tokens <= 1000
    reserve = reservation_tokens(model.seen[1])
    assert 990 - reserve <= second.remaining.input_tokens <= 990
    assert first.remaining.output_tokens is None
    journal_of(runner, result)


# -- reported usage over a limit (step 6) --------------------------------------------------
@pytest.mark.parametrize(("usage", "budget", "kind"), [
    (bl.Usage(input_tokens=10, output_tokens=300), bl.Budget(max_output_tokens=200),
     "output_tokens"),
    (bl.Usage(input_tokens=500), bl.Budget(max_input_tokens=400), "input_tokens"),
    (bl.Usage(input_tokens=10, cache_read_tokens=500), bl.Budget(max_input_tokens=400),
     "input_tokens"),
    (bl.Usage(input_tokens=250, output_tokens=250), bl.Budget(max_total_tokens=400),
     "total_tokens"),
    (bl.Usage(input_tokens=1, cost=2.5), bl.Budget(max_cost=1.5), "cost"),
], ids=["output", "input", "cached-input", "total", "cost"])
def test_reported_usage_over_limit_dispatches_nothing(
        runner: bl.Runner, echo: tuple[bl.Tool, list[str]], usage: bl.Usage,
        budget: bl.Budget, kind: str) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call("c1", usage), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go", budget=budget)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", kind)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert ran == []
    assert model.calls == 1
    assert transcript(result) == [{"kind": "user", "text": "go"}]
    assert result.usage == usage
    names, _ = journal_of(runner, result)
    assert "CallDecided" not in names and "CallDispatched" not in names


def test_final_over_a_limit_is_still_accepted(runner: bl.Runner) -> None:
    usage = bl.Usage(input_tokens=10, output_tokens=900)
    model = bl.ScriptedModel([bl.Final("long answer", usage=usage)])
    result = runner.run(model=model, prompt="go", budget=bl.Budget(max_output_tokens=100))
    assert (result.status, result.exhausted_limit) == ("final", None)
    assert (result.model_steps, result.tool_calls) == (1, 0)
    assert transcript(result)[-1] == {"kind": "final", "text": "long answer"}
    assert result.usage == usage
    journal_of(runner, result)


def test_step_limit_is_checked_before_token_limits(runner: bl.Runner,
                                                   echo: tuple[bl.Tool, list[str]]) -> None:
    tool, ran = echo
    model = bl.ScriptedModel([call("c1", bl.Usage(input_tokens=195)), bl.Final("never")])
    result = runner.run(model=model, tools=[tool], prompt="go",
                        budget=bl.Budget(max_input_tokens=200, max_model_steps=1,
                                         reserve_final_step=False))
    # Out of steps, and used + reservation is above max_input_tokens: steps are reported.
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "model_steps")
    assert (result.model_steps, result.tool_calls) == (1, 1)
    assert ran == ["c1"]
    journal_of(runner, result)


def test_malformed_and_discarded_steps_keep_their_reservation(runner: bl.Runner) -> None:
    def cancel(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        ctx.cancel.cancel()
        return bl.Final("discarded", usage=bl.Usage(input_tokens=1))

    model = bl.ScriptedModel(["malformed", cancel], max_output_tokens=7)
    result = runner.run(model=model, prompt="go", budget=bl.Budget(malformed_retries=1))
    assert (result.status, result.model_steps, result.tool_calls) == ("cancelled", 2, 0)
    expected = reservation_tokens(model.seen[0]) + reservation_tokens(model.seen[1])
    assert result.usage == bl.Usage(input_tokens=expected, output_tokens=14)
    names, events = journal_of(runner, result)
    assert [estimated for _, estimated in charged(events)] == [True, True]
