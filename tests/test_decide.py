"""The decider (DESIGN rule 3), tested as plain functions in memory: facts in, events out.

Each rule of SPEC 5 steps 2 to 11 is a function of ``policy.decide``; these tests feed it
states and replies and check the events and the stop it returns, and (by hypothesis) that
whatever it decides folds legally onto the state it decided from.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import boundloop as bl
from boundloop import events as ev
from boundloop.core import rules as decide
from boundloop.core.budget import Budget, Usage
from boundloop.core.replay import RunState, apply, replay

RID = "r"
NOW = decide.Now(RID, 1_700_000_000.0, 1.5)


def at_step(budget: Budget, steps_before: int = 0, usage: Usage | None = None,
            reservation: Usage | None = None) -> RunState:
    """A run whose step ``steps_before + 1`` was just started."""
    state = replay([ev.RunAdmitted(run_id=RID, budget=budget, history=[], tools=["t"])])
    for n in range(1, steps_before + 1):
        for e in (decide.start_step(state, budget, Usage(), NOW),
                  ev.ModelStepFailed(run_id=RID, step=n, reason="malformed", detail="x"),
                  ev.UsageCharged(run_id=RID, step=n, usage=Usage(), estimated=True),
                  ev.NoticeAdded(run_id=RID, text="n")):
            apply(state, e)
    if usage is not None:
        apply(state, ev.ChildCharged(run_id=RID, child_run_id="c", usage=usage))
    apply(state, decide.start_step(state, budget, reservation or Usage(), NOW))
    return state


def reply_to(state: RunState, budget: Budget, reply: decide.Reply, *,
             cancelled: bool = False, reservation: Usage | None = None) -> decide.Replied:
    out = decide.model_replied(state, budget, reply, reservation=reservation or Usage(),
                               cancelled=cancelled, price=None, now=NOW)
    for event in out.events:  # whatever the decider says must fold
        apply(state, event)
    return out


def names(events: list[ev.Event]) -> list[str]:
    return [type(e).__name__ for e in events]


def calls(*ids: str) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(i, "t", {}) for i in ids])


def test_step_2_counts_the_step_and_closes_tools_on_the_final_only_step() -> None:
    budget = Budget(max_model_steps=2)
    state = replay([ev.RunAdmitted(run_id=RID, budget=budget, history=[], tools=["t"])])
    first = decide.start_step(state, budget, Usage(input_tokens=5), NOW)
    assert (first.step, first.tools_allowed, first.reservation) == (1, True, Usage(5))
    apply(state, first)
    assert state.model_steps == 1 and state.usage == Usage(5)
    apply(state, ev.UsageCharged(run_id=RID, step=1, usage=Usage(5), estimated=True))
    apply(state, ev.RoundCompleted(run_id=RID, step=1))
    assert decide.start_step(state, budget, Usage(), NOW).tools_allowed is False


def test_step_3_a_model_that_raised_is_a_model_error_with_its_reservation_estimated() -> None:
    state = at_step(Budget(), reservation=Usage(7))
    out = reply_to(state, Budget(), decide.Reply(error="ValueError: boom"),
                   reservation=Usage(7))
    assert names(out.events) == ["ModelStepFailed", "UsageCharged"]
    assert out.stop == decide.Stop("model_error", detail="ValueError: boom")
    charged = out.events[1]
    assert isinstance(charged, ev.UsageCharged) and charged.estimated
    assert state.usage == Usage(7)


def test_a_model_error_once_the_deadline_passed_is_the_deadline() -> None:
    state = at_step(Budget(deadline_s=5))
    out = decide.model_replied(state, Budget(deadline_s=5),
                               decide.Reply(error="APITimeoutError: Request timed out."),
                               reservation=Usage(), cancelled=False, price=None, now=NOW,
                               deadline_passed=True)
    assert out.stop is not None and (out.stop.status, out.stop.limit) == \
        ("limit_exceeded", "deadline")
    failed = out.events[0]
    assert isinstance(failed, ev.ModelStepFailed) and failed.reason == "deadline"
    assert "APITimeoutError" in failed.detail


def test_the_deadline_wall_and_a_call_never_started() -> None:
    out = reply_to(at_step(Budget()), Budget(), decide.Reply(abandoned="deadline"))
    assert (out.stop.status, out.stop.limit) == ("limit_exceeded", "deadline")  # type: ignore[union-attr]
    failed = out.events[0]
    assert isinstance(failed, ev.ModelStepFailed) and failed.reason == "deadline"
    out = reply_to(at_step(Budget()), Budget(), decide.Reply(abandoned="cancelled"))
    assert out.stop is not None and out.stop.status == "cancelled"


def test_step_4_cancellation_after_the_response_discards_it() -> None:
    state = at_step(Budget())
    out = reply_to(state, Budget(), decide.Reply(bl.Final("done")), cancelled=True)
    assert out.stop is not None and out.stop.status == "cancelled"
    assert names(out.events) == ["ModelStepFailed", "UsageCharged"]
    assert state.transcript == []  # nothing of the response entered the history


def test_step_5_malformed_retries_then_malformed_response() -> None:
    budget = Budget(malformed_retries=1)
    state = at_step(budget)
    out = reply_to(state, budget, decide.Reply({"kind": "bogus"}))
    assert out.stop is None and out.batch is None  # a notice, and the loop goes on
    assert names(out.events) == ["ModelStepFailed", "UsageCharged", "NoticeAdded"]
    notice = out.events[2]
    assert isinstance(notice, ev.NoticeAdded) and "malformed" in notice.text
    state = at_step(budget, steps_before=1)
    out = reply_to(state, budget, decide.Reply({"kind": "bogus"}))
    assert out.stop is not None and out.stop.status == "malformed_response"


def test_steps_6_and_7_reported_usage_replaces_the_reservation_and_final_wins() -> None:
    budget = Budget(max_total_tokens=100)
    state = at_step(budget, reservation=Usage(50))
    out = reply_to(state, budget, decide.Reply(bl.Final("x", usage=Usage(200, 10))),
                   reservation=Usage(50))
    assert out.stop == decide.Stop("final")  # accepted even past the token limit
    assert state.usage == Usage(200, 10)
    state = at_step(budget, reservation=Usage(50))
    out = reply_to(state, budget, decide.Reply(calls("a").__class__(
        calls("a").calls, usage=Usage(200, 10))), reservation=Usage(50))
    assert out.stop is not None and (out.stop.status, out.stop.limit) == \
        ("limit_exceeded", "total_tokens")
    assert out.batch is None


def test_step_9_every_intent_before_any_dispatch_and_only_max_parallel_at_once() -> None:
    state = at_step(Budget())
    reply_to(state, Budget(), decide.Reply(calls("a", "b", "c")))
    plans = [decide.CallPlan("allow", ""), decide.CallPlan("denied", "no"),
             decide.CallPlan("allow", "")]
    events = decide.calls_decided(state, calls("a", "b", "c"), plans, keys=["k1", "k2", "k3"],
                                  max_parallel=1, parent_step=None, now=NOW)
    assert names(events) == ["CallDecided"] * 3 + ["CallDispatched"]
    dispatched = events[3]
    assert isinstance(dispatched, ev.CallDispatched)
    assert dispatched.execution_id == f"{RID}:1:0"  # the first allowed call only
    for e in events:
        apply(state, e)
    assert state.tool_calls == 3


def test_step_11_review_keeps_the_round_open_and_skips_say_why() -> None:
    state = at_step(Budget())
    events, stop = decide.round_ended(state, review=["ship r:1:0"], skipped=[],
                                      cancelled=False, now=NOW)
    assert events == [] and stop is not None and stop.status == "needs_review"
    for why, status in (("lease", "journal_unavailable"), ("journal", "journal_unavailable"),
                        ("cancelled", "cancelled"), ("deadline", "limit_exceeded")):
        events, stop = decide.round_ended(state, review=[], skipped=[why], cancelled=False,
                                          now=NOW)
        assert names(events) == ["RoundCompleted"] and stop is not None
        assert stop.status == status


def test_a_timeout_is_never_a_failure() -> None:
    fields: Any = lambda value: {"content": value, "size": 1, "digest": ""}  # noqa: E731
    timed_out = decide.Attempt(1, "timeout", timeout_s=1.0)
    failed = decide.Attempt(2, "error", error="boom", category="ValueError")
    events, doubt = decide.attempt_outcomes("e", [timed_out, failed], final=True, doubt=False,
                                            fields_of=fields, limit=None, now=NOW)
    assert names(events) == ["CallTimedOut", "CallFailed", "CallOutcomeUnknown"] and doubt
    events, doubt = decide.attempt_outcomes(
        "e", [decide.Attempt(1, "timeout", reconciled=False), failed], final=True,
        doubt=False, fields_of=fields, limit=None, now=NOW)
    assert names(events) == ["CallTimedOut", "CallReconciled", "CallFailed"] and not doubt


def test_a_result_over_max_result_bytes_is_too_large_in_the_core() -> None:
    """SPEC 9: the core, not the interpreter, says a result is ``too_large``: over the
    limit its content says so; at the limit, or unrecordable (kept ``ok``: the action took
    effect), or reconciled, it stays ``ok``."""
    def fields(value: Any) -> dict[str, Any]:
        size, unkeepable = value
        got: dict[str, Any] = {"content": "x" * size, "size": size, "digest": "d"}
        if unkeepable:
            got[decide.UNKEEPABLE] = True
        return got

    def outcome(value: Any, limit: int | None) -> ev.CallSucceeded:
        events, _ = decide.attempt_outcomes("e", [decide.Attempt(1, "ok", value)], final=True,
                                            doubt=False, fields_of=fields, limit=limit,
                                            now=NOW)
        assert len(events) == 1 and isinstance(events[0], ev.CallSucceeded)
        return events[0]

    over = outcome((11, False), 10)
    assert (over.status, over.size, over.digest) == ("too_large", 11, "d")
    assert over.content == "the result was 11 bytes, over max_result_bytes=10; it was not kept"
    assert (outcome((10, False), 10).status, outcome((10, False), 10).content) == ("ok", "x" * 10)
    assert outcome((11, False), None).status == "ok"
    assert (outcome((11, True), 10).status, outcome((11, True), 10).content) == ("ok", "x" * 11)
    timed_out = decide.Attempt(1, "timeout", reconciled=True, reconciled_value=(50, False))
    events, _ = decide.attempt_outcomes("e", [timed_out], final=True, doubt=False,
                                        fields_of=fields, limit=10, now=NOW)
    assert names(events) == ["CallTimedOut", "CallReconciled"]
    assert isinstance(events[1], ev.CallReconciled) and events[1].size == 50


REPLIES = st.one_of(
    st.builds(decide.Reply, st.just(None), st.text(min_size=1, max_size=5)),
    st.builds(decide.Reply, st.just(None), st.none(), st.just(0.0),
              st.sampled_from(["deadline", "cancelled"])),
    st.builds(lambda t, u: decide.Reply(bl.Final(t, usage=u)), st.text(max_size=5),
              st.none() | st.builds(Usage, st.integers(0, 500), st.integers(0, 500))),
    st.builds(lambda n, u: decide.Reply(bl.CallTools(
        [bl.ToolCall(f"c{i}", "t", {}) for i in range(n)], usage=u)), st.integers(1, 3),
        st.none() | st.builds(Usage, st.integers(0, 500), st.integers(0, 500))),
    st.sampled_from([decide.Reply({"kind": "nope"}), decide.Reply(42), decide.Reply(
        {"kind": "calls", "calls": []})]),
)


@settings(max_examples=300, deadline=None)
@given(reply=REPLIES, cancelled=st.booleans(), retries=st.integers(0, 2),
       steps_before=st.integers(0, 2), limit=st.none() | st.integers(1, 600),
       reserved=st.integers(0, 100))
def test_whatever_the_decider_says_folds_and_follows_spec_5(
        reply: decide.Reply, cancelled: bool, retries: int, steps_before: int,
        limit: int | None, reserved: int) -> None:
    budget = Budget(malformed_retries=retries, max_total_tokens=limit, max_model_steps=6)
    reservation = Usage(reserved)
    state = at_step(budget, steps_before=steps_before, reservation=reservation)
    out = reply_to(state, budget, reply, cancelled=cancelled, reservation=reservation)
    stop = out.stop
    response = reply.response
    if reply.abandoned == "deadline":
        assert stop is not None and stop.limit == "deadline"
    elif reply.abandoned or (cancelled and reply.error is None):
        assert stop is not None and stop.status == "cancelled"
    elif reply.error is not None:
        assert stop is not None and stop.status == "model_error"
    elif isinstance(response, bl.Final):
        assert stop == decide.Stop("final")
        assert state.transcript[-1] == bl.FinalMessage(response.text)
    elif isinstance(response, bl.CallTools):
        over = limit is not None and state.usage.input_tokens + state.usage.output_tokens \
            > limit
        assert (stop is not None and stop.limit == "total_tokens") == over
        assert (out.batch is not None) == (not over)
    else:  # malformed
        assert state.malformed == steps_before + 1
        if steps_before + 1 <= retries:
            assert stop is None and isinstance(state.transcript[-1], bl.NoticeMessage)
        else:
            assert stop is not None and stop.status == "malformed_response"
    assert state.model_steps == steps_before + 1  # the step always counts


# -- malformed responses are explained in a person's words, not Python's -------------------
@pytest.mark.parametrize(("raw", "said"), [
    (None, "not nothing (None)"),
    ("hello", "not a string"),
    (42, "not a number"),
    ([bl.Final("x")], "not a list"),
    ((1, 2), "not a list"),
    (b"raw", "not bytes"),
    (print, "not a function"),
    (object(), "not an object object"),
    ({"kind": "calls", "calls": [None]}, "call 1 is nothing (None), not an object"),
    ({"kind": "final", "text": True}, "the final response's text is true or false"),
])
def test_a_malformed_response_is_explained_in_plain_words(raw: Any, said: str) -> None:
    got = decide.parse_response(raw)
    assert isinstance(got, bl.Malformed)
    assert said in got.reason, got.reason
    # Python's names for these types (and JSON's for None) are not a person's words
    assert not re.search(r"\b(NoneType|str|int|float|tuple|builtin_function_or_method|null)\b",
                         got.reason), got.reason


def test_a_users_own_type_is_named_as_an_object_of_that_type() -> None:
    class Reply:
        pass

    got = decide.parse_response(Reply())
    assert isinstance(got, bl.Malformed)
    assert got.reason.endswith("not a Reply object"), got.reason
