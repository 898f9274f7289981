"""``ops.check`` as a Replayer (issue #21): the recorded run's inputs, derived from its events,
are fed to ``core.decide``; a recording whose decisions were edited is caught at the edited
event's sequence number; what the events cannot tell is reported "not checkable"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_decide import Script, budgets, drive, machine, outcome, reply

import boundloop as bl
from boundloop import events as ev
from boundloop import ops
from boundloop.core.budget import Budget

_DECISIONS = (ev.ModelStepStarted, ev.CallDecided, ev.RunFinished)


def record(tmp_path: Path, replies: list[Any], tools: list[bl.Tool],
           budget: bl.Budget | None = None, **options: Any) -> list[ev.Event]:
    """Run a scripted model and return the run's recorded events."""
    estimator = options.pop("estimator", None)
    with bl.Runner(tmp_path / "j", estimator=estimator) as runner:
        result = runner.run(model=bl.ScriptedModel(replies), tools=tools, prompt="go",
                            budget=budget, **options)
        return list(runner.journal.events(result.run_id))


def seq_of(events: list[ev.Event], kind: type[ev.Event],
           where: Callable[[Any], bool] = lambda e: True) -> int:
    return next(i for i, e in enumerate(events, 1) if isinstance(e, kind) and where(e))


def busy_run(tmp_path: Path) -> list[ev.Event]:
    """A run with every kind of call decision, a retry, queued calls and a final answer."""
    failures = [ConnectionError("reset")]

    @bl.tool(retry=bl.RetryPolicy(max_attempts=2, backoff_s=0.0))
    def flaky(n: int) -> int:
        if failures:
            raise failures.pop()
        return n * 2

    @bl.tool(read_only=True)
    def look(city: str) -> str:
        return f"sunny in {city}"

    @bl.tool
    def forbidden() -> str:
        return "never"

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: Any) -> bool | str:
        return "not here" if call.name == "forbidden" else True

    batch = bl.CallTools([bl.ToolCall("a", "flaky", {"n": 2}),
                          bl.ToolCall("b", "look", {"city": "Rome"}),
                          bl.ToolCall("c", "look", {"town": 3}),
                          bl.ToolCall("d", "nope", {}),
                          bl.ToolCall("e", "forbidden", {})])
    return record(tmp_path, [batch, bl.CallTools([bl.ToolCall("f", "look", {"city": "Oslo"})]),
                             bl.Final("done")], [flaky, look, forbidden],
                  bl.Budget(max_parallel=1, max_tool_calls=10), permit=permit)


def test_a_recorded_run_checks_clean(tmp_path: Path) -> None:
    events = busy_run(tmp_path)
    decisions = {e.decision for e in events if isinstance(e, ev.CallDecided)}
    assert decisions == {"allow", "denied", "invalid_arguments", "unknown_tool"}
    assert any(isinstance(e, ev.CallDispatched) and e.attempt == 2 for e in events)
    report = ops.check(events)
    assert report.ok, report.divergence
    assert report.note == ""
    assert report.decisions == sum(isinstance(e, _DECISIONS) for e in events)
    assert report.budget == ops.recorded_budget(events)


@pytest.mark.parametrize(("call_id", "flipped", "current"), [
    ("b", "unknown_tool", "call b (look) at step 1: allow"),
    ("d", "allow", "call d (nope) at step 1: unknown_tool (no tool named 'nope' (tools: "
                   "flaky, forbidden, look))"),
])
def test_an_edited_call_decision_is_reported_at_its_seq(tmp_path: Path, call_id: str,
                                                        flipped: str, current: str) -> None:
    events = busy_run(tmp_path)
    seq = seq_of(events, ev.CallDecided, lambda e: e.call_id == call_id)
    edited = list(events)
    edited[seq - 1] = msgspec.structs.replace(events[seq - 1], decision=flipped)
    report = ops.check(edited)
    assert not report.ok and report.divergence is not None
    div = report.divergence
    assert (div.seq, div.step) == (seq, 1)
    assert div.recorded.startswith(f"call {call_id} (") and f": {flipped}" in div.recorded
    assert div.current == current
    # Every decision before it matched.
    assert report.decisions == sum(isinstance(e, _DECISIONS) for e in events[:seq - 1])


def test_a_denial_is_an_input_taken_as_recorded(tmp_path: Path) -> None:
    """The permission check's verdict is kept only in the decision it made: a recorded
    denial is fed back as the verdict (user code is not called), so it checks clean."""
    events = busy_run(tmp_path)
    seq = seq_of(events, ev.CallDecided, lambda e: e.call_id == "b")
    edited = list(events)
    edited[seq - 1] = msgspec.structs.replace(events[seq - 1], decision="denied",
                                              reason="edited")
    assert ops.check(edited).ok


@pytest.mark.parametrize("status", ["model_error", "cancelled"])
def test_an_edited_finish_is_reported_at_its_seq(tmp_path: Path, status: str) -> None:
    """A cancellation is an input known only from the events that say so: a status edited
    to ``cancelled`` after a reply the run accepted still diverges (the reply's event says
    when the run decided on it, and it was not cancelled then)."""
    events = busy_run(tmp_path)
    assert isinstance(events[-1], ev.RunFinished) and events[-1].status == "final"
    edited = [*events[:-1], msgspec.structs.replace(events[-1], status=status)]
    report = ops.check(edited)
    assert report.divergence is not None
    assert report.divergence.seq == len(events)
    assert f"finishes {status}" in report.divergence.recorded
    assert "finishes final after 3 model steps" in report.divergence.current


def test_an_edited_reply_changes_the_decisions_after_it(tmp_path: Path) -> None:
    """The inputs come from the events: a recorded reply that says the model answered
    finally makes the current policy finish where the run went on."""
    events = busy_run(tmp_path)
    seq = seq_of(events, ev.ModelStepCompleted, lambda e: e.step == 2)
    edited = list(events)
    edited[seq - 1] = msgspec.structs.replace(events[seq - 1], response=bl.Final("early"))
    report = ops.check(edited)
    assert report.divergence is not None
    assert report.divergence.seq == seq_of(events, ev.CallDecided, lambda e: e.call_id == "f")
    assert "finishes final after 2 model steps" in report.divergence.current


def test_a_lower_limit_diverges_where_the_policy_changes(tmp_path: Path) -> None:
    events = busy_run(tmp_path)
    budget = msgspec.structs.replace(ops.recorded_budget(events), max_model_steps=2)
    report = ops.check(events, budget)
    assert report.divergence is not None
    # Step 2 is the last one the lower limit allows: it may only answer finally.
    assert report.divergence.seq == seq_of(events, ev.ModelStepStarted, lambda e: e.step == 2)
    assert "tools not allowed" in report.divergence.current


def test_a_run_awaiting_approval_checks_clean(tmp_path: Path) -> None:
    """The approval rule's answer is read from the recorded decision: the run's turn ends
    awaiting a person where it did, and a check that answered otherwise would go on."""
    @bl.tool(needs_approval=lambda call, ctx: call.arguments["to"] == "prod")
    def deploy(to: str) -> str:
        return f"deployed to {to}"

    batch = bl.CallTools([bl.ToolCall("s", "deploy", {"to": "staging"}),
                          bl.ToolCall("p", "deploy", {"to": "prod"})])
    events = record(tmp_path, [batch, bl.Final("done")], [deploy])
    finished = next(e for e in events if isinstance(e, ev.RunFinished))
    assert finished.status == "awaiting_approval"
    assert [e.approval for e in events if isinstance(e, ev.CallDecided)] == [False, True]
    report = ops.check(events)
    assert report.ok and report.note == "", report
    assert report.decisions == sum(isinstance(e, _DECISIONS) for e in events)
    # Had the rule said no for "p", the round would have gone on to a second step.
    seq = seq_of(events, ev.CallDecided, lambda e: e.call_id == "p")
    edited = list(events)
    edited[seq - 1] = msgspec.structs.replace(events[seq - 1], approval=False)
    report = ops.check(edited)
    assert report.divergence is not None
    assert report.divergence.seq == seq_of(events, ev.RunFinished)
    assert report.divergence.current == "model step 2 starts (tools allowed)"


@pytest.mark.parametrize(("limit", "status"), [("output_tokens", "limit_exceeded"),
                                               (None, "final")])
def test_a_malformed_turn_with_usage_checks_clean(tmp_path: Path, limit: str | None,
                                                 status: str) -> None:
    """A turn the adapter cut on a spent limit ends the run there; one it did not cut is
    retried (with no retries left it would end ``malformed_response``): the journal does not
    mark which, the decision that followed does."""
    cut = bl.Malformed(reason="The turn was cut.", usage=bl.Usage(output_tokens=500),
                       limit=limit)
    events = record(tmp_path, [cut, bl.Final("done")], [],
                    bl.Budget(max_output_tokens=400 if limit else 10_000,
                              malformed_retries=0 if limit else 1))
    finished = next(e for e in events if isinstance(e, ev.RunFinished))
    assert finished.status == status
    report = ops.check(events)
    assert report.ok and report.note == "", report
    assert report.decisions == sum(isinstance(e, _DECISIONS) for e in events)


def test_a_reservation_that_was_not_recorded_is_not_checkable(tmp_path: Path) -> None:
    """The runner's estimator reserved more than the run could spend: the step never
    started and its reservation is in no event, so the stop cannot be checked."""
    events = record(tmp_path, [bl.Final("never")], [], bl.Budget(max_input_tokens=100),
                    estimator=lambda history, model: bl.Usage(input_tokens=5000))
    finished = events[-1]
    assert isinstance(finished, ev.RunFinished)
    assert (finished.status, finished.exhausted_limit, finished.model_steps) == \
        ("limit_exceeded", "input_tokens", 0)
    report = ops.check(events)
    assert report.ok and report.divergence is None and report.decisions == 0
    assert report.note.startswith(f"not checkable at seq {len(events)}")
    assert "reservation" in report.note


def test_an_estimator_that_failed_checks_clean(tmp_path: Path) -> None:
    def broken(history: Any, model: Any) -> bl.Usage:
        raise RuntimeError("no estimate")

    events = record(tmp_path, [bl.Final("never")], [], estimator=broken)
    assert isinstance(events[-1], ev.RunFinished) and events[-1].status == "model_error"
    report = ops.check(events)
    assert report.ok and report.note == "" and report.decisions == 1


@pytest.mark.parametrize("cut", [3, 6])
def test_a_recording_cut_short_checks_up_to_its_end(tmp_path: Path, cut: int) -> None:
    events = busy_run(tmp_path)[:cut]
    report = ops.check(events)
    assert report.ok and "recording ends" in report.note
    assert report.decisions == sum(isinstance(e, _DECISIONS) for e in events)


# -- runs made by decide itself (no threads) check clean; edits to them are caught ---------
def scripted_run(budget: Budget, replies: list[Any], outcomes: list[str],
                 approvals: list[bool], estimate: int) -> list[ev.Event]:
    m = machine(budget)
    script = Script(list(replies), outcomes, approvals, estimate)
    drive(m, script)
    return list(script.appended)


@settings(max_examples=200, deadline=None)
@given(budgets, st.lists(reply, max_size=8), st.lists(outcome, max_size=12),
       st.lists(st.booleans(), max_size=4), st.integers(0, 120))
def test_runs_decide_made_check_clean(budget: Budget, replies: list[Any], outcomes: list[str],
                                     approvals: list[bool], estimate: int) -> None:
    events = scripted_run(budget, replies, outcomes, approvals, estimate)
    report = ops.check(events)
    assert report.ok, report.divergence
    # A step stopped by its (unrecorded) reservation is the one case said not checkable.
    assert report.note == "" or report.note.startswith("not checkable"), report.note


@settings(max_examples=200, deadline=None)
@given(budgets, st.lists(reply, min_size=1, max_size=8), st.lists(outcome, max_size=12),
       st.lists(st.booleans(), max_size=4), st.integers(0, 120), st.data())
def test_edited_decisions_of_decide_made_runs_are_caught(
        budget: Budget, replies: list[Any], outcomes: list[str], approvals: list[bool],
        estimate: int, data: st.DataObject) -> None:
    """The decisions ``decide`` makes from recorded inputs (a call's tool exists; how the
    run ends) diverge at the edited event when edited; a denial or invalid arguments are
    inputs (user code's verdicts) and are taken as recorded."""
    events = scripted_run(budget, replies, outcomes, approvals, estimate)
    fin = next(i for i, e in enumerate(events) if isinstance(e, ev.RunFinished))
    picks = [i for i, e in enumerate(events)
             if isinstance(e, ev.CallDecided) and e.decision in ("allow", "unknown_tool")]
    at = data.draw(st.sampled_from([fin, *picks]))
    event = events[at]
    if isinstance(event, ev.RunFinished):
        status = data.draw(st.sampled_from(sorted(
            {"final", "model_error", "needs_review", "limit_exceeded"} - {event.status})))
        edited = msgspec.structs.replace(event, status=status)
    else:
        assert isinstance(event, ev.CallDecided)
        edited = msgspec.structs.replace(
            event, decision="unknown_tool" if event.decision == "allow" else "allow")
    report = ops.check([*events[:at], edited, *events[at + 1:]])
    if report.note.startswith("not checkable"):
        return
    assert report.divergence is not None and report.divergence.seq == at + 1, report
