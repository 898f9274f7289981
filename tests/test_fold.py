"""The replay fold as a strict transition table (DESIGN rule 2), tested in memory.

Unit tests build events directly and check that each illegal transition raises ReplayError
and leaves the state exactly as it was, and that the histories the loop really emits (live,
and while a resumed run settles what a crash left open) stay legal. Property tests drive a
small model of the table written from SPEC 5 and 6: random legal histories fold with the
expected counters, and an illegal event at any point is refused without a trace, while the
fold and the model agree on every candidate event.
"""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundloop import events as ev
from boundloop.core.budget import Budget, Usage
from boundloop.core.kinds import DECISIONS, LIMITS, RUN_STATUSES
from boundloop.core.replay import ReplayError, RunState, apply, replay
from boundloop.messages import CallTools, Final

RID = "run"
NO_USAGE = Usage()


# -- events ---------------------------------------------------------------------------------
def admitted() -> ev.RunAdmitted:
    return ev.RunAdmitted(run_id=RID, budget=Budget(), history=[], tools=["t"])


def started(step: int) -> ev.ModelStepStarted:
    return ev.ModelStepStarted(run_id=RID, step=step, tools_allowed=True, reservation=NO_USAGE)


def completed(step: int) -> ev.ModelStepCompleted:
    return ev.ModelStepCompleted(run_id=RID, step=step, response=CallTools([]))


def eid_of(step: int, index: int) -> str:
    return f"{RID}:{step}:{index}"


def decided(step: int, index: int = 0, decision: str = "allow") -> ev.CallDecided:
    return ev.CallDecided(run_id=RID, execution_id=eid_of(step, index), idempotency_key="k",
                          step=step, round=step, index=index, call_id=f"c{step}.{index}",
                          tool="t", arguments={}, decision=decision,
                          reason="" if decision == "allow" else "because")


def dispatched(eid: str, attempt: int = 1) -> ev.CallDispatched:
    return ev.CallDispatched(run_id=RID, execution_id=eid, attempt=attempt)


def succeeded(eid: str, attempt: int = 1, status: str = "ok") -> ev.CallSucceeded:
    return ev.CallSucceeded(run_id=RID, execution_id=eid, attempt=attempt, content="r",
                            status=status)


def failed(eid: str, attempt: int = 1, retrying: bool = False) -> ev.CallFailed:
    return ev.CallFailed(run_id=RID, execution_id=eid, attempt=attempt, error_category="E",
                         content="boom", retrying=retrying)


def timed_out(eid: str, attempt: int = 1) -> ev.CallTimedOut:
    return ev.CallTimedOut(run_id=RID, execution_id=eid, attempt=attempt, timeout_s=1.0)


def unknown(eid: str, attempt: int = 1) -> ev.CallOutcomeUnknown:
    return ev.CallOutcomeUnknown(run_id=RID, execution_id=eid, attempt=attempt, content="?")


def reconciled(eid: str, attempt: int = 1, took: bool = True) -> ev.CallReconciled:
    return ev.CallReconciled(run_id=RID, execution_id=eid, attempt=attempt, took_effect=took,
                             content="r" if took else None)


def skipped(eid: str) -> ev.CallSkipped:
    return ev.CallSkipped(run_id=RID, execution_id=eid, reason="cancelled")


def resolved(eid: str, outcome: str = "succeeded") -> ev.CallResolved:
    return ev.CallResolved(run_id=RID, execution_id=eid, outcome=outcome, note="n")


def round_done(step: int) -> ev.RoundCompleted:
    return ev.RoundCompleted(run_id=RID, step=step)


def resumed() -> ev.RunResumed:
    return ev.RunResumed(run_id=RID, owner="me")


def finished(status: str = "final", limit: str | None = None) -> ev.RunFinished:
    return ev.RunFinished(run_id=RID, status=status, exhausted_limit=limit, explanation="",
                          model_steps=0, tool_calls=0)


E1 = eid_of(1, 0)
E2 = eid_of(1, 1)


def fold(*events: ev.Event) -> RunState:
    return replay(events)


def round_one(*call_events: ev.Event, decisions: tuple[str, ...] = ("allow",)) -> RunState:
    """A run at its first step, with one decided call per decision, then ``call_events``."""
    return fold(admitted(), started(1), completed(1),
                *[decided(1, i, d) for i, d in enumerate(decisions)], *call_events)


def crashed(*call_events: ev.Event) -> RunState:
    """A run a crash left inside its first round (one allowed call, then ``call_events``),
    resumed: what ``settle`` starts from."""
    return fold(admitted(), started(1), completed(1), decided(1), *call_events, resumed())


def then(state: RunState, *events: ev.Event) -> RunState:
    for event in events:
        apply(state, event)
    return state


def snapshot(state: RunState) -> tuple[RunState, Any]:
    return copy.deepcopy(state), msgspec.to_builtins(state)


def assert_refused(state: RunState, event: ev.Event, match: str | None = None) -> None:
    """``event`` raises ReplayError and the state is exactly as it was before."""
    copied, builtins = snapshot(state)
    with pytest.raises(ReplayError, match=match):
        apply(state, event)
    assert state == copied
    assert msgspec.to_builtins(state) == builtins


# -- probes: what the fold used to accept ---------------------------------------------------
OUTCOMES: list[Callable[[str], ev.Event]] = [succeeded, failed, timed_out]


@pytest.mark.parametrize("decision", ["denied", "invalid_arguments", "unknown_tool", "skipped"])
@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda f: f.__name__)
def test_no_outcome_for_a_call_that_was_not_allowed(decision: str,
                                                    outcome: Callable[[str], ev.Event]) -> None:
    assert_refused(round_one(decisions=(decision,)), outcome(E1), "not allowed")


@pytest.mark.parametrize("decision", ["denied", "invalid_arguments", "unknown_tool", "skipped"])
def test_no_dispatch_of_a_call_that_was_not_allowed(decision: str) -> None:
    assert_refused(round_one(decisions=(decision,)), dispatched(E1), "not allowed")
    # Not at resume either.
    state = fold(admitted(), started(1), decided(1, 0, decision), resumed())
    assert_refused(state, dispatched(E1, 2), "not allowed")


@pytest.mark.parametrize("ending", [
    [succeeded(E1)],
    [failed(E1)],
    [timed_out(E1), reconciled(E1, took=True)],
    [timed_out(E1), unknown(E1)],
    [skipped(E1)],
], ids=["succeeded", "failed", "reconciled", "outcome_unknown", "skipped"])
def test_no_dispatch_after_the_call_ended(ending: list[ev.Event]) -> None:
    state = round_one(*([] if ending[0].__class__ is ev.CallSkipped else [dispatched(E1)]),
                      *ending)
    assert_refused(state, dispatched(E1, 2))


def test_no_dispatch_after_the_call_was_resolved_even_at_resume() -> None:
    state = fold(admitted(), started(1), decided(1), dispatched(E1), resolved(E1, "failed"),
                 resumed())
    assert_refused(state, dispatched(E1, 2))
    state = fold(admitted(), started(1), decided(1), dispatched(E1), timed_out(E1),
                 unknown(E1), resolved(E1, "abandoned"), resumed())
    assert_refused(state, dispatched(E1, 2))


@pytest.mark.parametrize(("before", "attempt"), [
    ([], 2),  # the first attempt is 1
    ([], 0),
    ([dispatched(E1)], 1),  # twice the same attempt
    ([dispatched(E1)], 2),  # a retry while attempt 1 is in flight, live
    ([dispatched(E1), failed(E1, retrying=True)], 3),  # a jump
    ([dispatched(E1), failed(E1, retrying=True)], 1),  # backwards
    ([dispatched(E1), timed_out(E1)], 3),
    ([dispatched(E1), timed_out(E1), reconciled(E1, took=False)], 1),
])
def test_a_dispatch_is_the_next_attempt(before: list[ev.Event], attempt: int) -> None:
    assert_refused(round_one(*before), dispatched(E1, attempt))


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda f: f.__name__)
def test_no_outcome_before_any_dispatch(outcome: Callable[..., ev.Event]) -> None:
    assert_refused(round_one(), outcome(E1, 1), "intended")
    assert_refused(crashed(), outcome(E1, 1), "intended")


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("before", "attempt"), [
    ([dispatched(E1)], 2),
    ([dispatched(E1)], 0),
    ([dispatched(E1), failed(E1, retrying=True), dispatched(E1, 2)], 1),  # a stale attempt
    ([dispatched(E1), failed(E1, retrying=True), dispatched(E1, 2)], 3),
])
def test_an_outcome_is_of_the_attempt_in_flight(outcome: Callable[..., ev.Event],
                                                before: list[ev.Event], attempt: int) -> None:
    assert_refused(round_one(*before), outcome(E1, attempt), "attempt")


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda f: f.__name__)
def test_one_outcome_per_attempt(outcome: Callable[..., ev.Event]) -> None:
    for first in (succeeded(E1), failed(E1), failed(E1, retrying=True), timed_out(E1)):
        assert_refused(round_one(dispatched(E1), first), outcome(E1, 1))


def test_a_decision_outside_the_vocabulary_is_refused() -> None:
    state = fold(admitted(), started(1), completed(1))
    assert_refused(state, decided(1, 0, "bogus"), "unknown decision 'bogus'")
    assert_refused(state, decided(1, 0, "ALLOW"), "unknown decision")


def test_model_steps_count_one_by_one() -> None:
    state = fold(admitted(), started(1), completed(1))
    assert_refused(state, started(3), "next model step is 2")
    assert_refused(state, started(1))
    assert_refused(fold(admitted()), started(2))
    assert_refused(fold(admitted()), started(0))


def test_a_decision_is_for_the_current_model_step() -> None:
    state = fold(admitted(), started(1), completed(1))
    assert_refused(state, decided(2), "current model step is 1")
    assert_refused(state, decided(0))
    assert_refused(fold(admitted()), decided(0), "current model step is 0")
    later = fold(admitted(), started(1), completed(1), started(2), completed(2))
    assert_refused(later, decided(1), "current model step is 2")


@pytest.mark.parametrize("event", [completed(2), round_done(2),
                                   ev.UsageCharged(run_id=RID, step=2, usage=NO_USAGE),
                                   ev.ModelStepFailed(run_id=RID, step=0, reason="error")],
                         ids=["completed", "round", "usage", "failed"])
def test_step_events_name_the_current_step(event: ev.Event) -> None:
    assert_refused(fold(admitted(), started(1)), event, "model step")


def test_a_round_completes_before_the_next_step() -> None:
    state = round_one(dispatched(E1), succeeded(E1))
    assert_refused(state, started(2), "no RoundCompleted")
    apply(state, round_done(1))
    apply(state, started(2))


@pytest.mark.parametrize(("status", "limit"), [
    ("bogus", None), ("running", None), ("Final", None), ("", None),
    ("limit_exceeded", None), ("limit_exceeded", "bogus"), ("final", "deadline"),
])
def test_run_finished_with_a_spec_status(status: str, limit: str | None) -> None:
    assert_refused(fold(admitted(), started(1)), finished(status, limit))


def test_no_second_run_finished_without_a_resume() -> None:
    state = fold(admitted(), started(1), finished("final"))
    assert_refused(state, finished("final"), "after RunFinished")
    assert_refused(state, finished("needs_review"))
    apply(state, resumed())
    apply(state, finished("cancelled"))
    assert (state.status, state.finished) == ("cancelled", True)


def test_only_resume_resolve_and_claim_follow_run_finished() -> None:
    state = round_one(dispatched(E1), finished("needs_review"))
    for event in (started(2), dispatched(E1, 2), succeeded(E1), unknown(E1), completed(1),
                  ev.NoticeAdded(run_id=RID, text="x"), round_done(1)):
        assert_refused(state, event, "after RunFinished")
    apply(state, ev.OwnerClaimed(run_id=RID, owner="other"))
    apply(state, resolved(E1, "failed"))
    apply(state, resumed())


def test_resolve_applies_to_open_calls_only() -> None:
    assert_refused(round_one(dispatched(E1), succeeded(E1)), resolved(E1), "closed")
    assert_refused(round_one(decisions=("denied",)), resolved(E1), "not allowed")
    assert_refused(round_one(dispatched(E1), failed(E1)), resolved(E1), "failed")
    assert_refused(round_one(dispatched(E1), timed_out(E1), unknown(E1), resolved(E1,
                                                                                 "abandoned")),
                   resolved(E1, "succeeded"))
    assert_refused(round_one(dispatched(E1)), resolved(E1, "maybe"), "unknown resolution")


def test_skip_applies_to_calls_not_yet_started() -> None:
    assert_refused(round_one(dispatched(E1), succeeded(E1)), skipped(E1))
    assert_refused(round_one(dispatched(E1), failed(E1, retrying=True), dispatched(E1, 2)),
                   skipped(E1), "already ran")
    assert_refused(round_one(decisions=("denied",)), skipped(E1), "not allowed")
    # At resume a dispatched attempt may have run: it is never "skipped".
    assert_refused(crashed(dispatched(E1)), skipped(E1), "at resume")


def test_succeeded_status_is_ok_or_too_large() -> None:
    for status in ("outcome_unknown", "denied", "skipped", "bogus", "OK", "error"):
        assert_refused(round_one(dispatched(E1)), succeeded(E1, status=status),
                       "unknown status")
    for status in ("ok", "too_large"):
        apply(state := round_one(dispatched(E1)), succeeded(E1, status=status))
        assert state.calls[E1].status == status


def test_reconcile_and_unknown_follow_a_timeout_while_live() -> None:
    for before in ([], [dispatched(E1)], [dispatched(E1), failed(E1, retrying=True)],
                   [dispatched(E1), succeeded(E1)]):
        assert_refused(round_one(*before), reconciled(E1))
    for before in ([dispatched(E1)], [dispatched(E1), failed(E1)],
                   [dispatched(E1), succeeded(E1)]):
        assert_refused(round_one(*before), unknown(E1))
    assert_refused(round_one(dispatched(E1), timed_out(E1)), reconciled(E1, 2), "attempt")
    assert_refused(round_one(dispatched(E1), timed_out(E1)), unknown(E1, 2), "attempt")


def test_the_fold_counts_ownership_epochs() -> None:
    state = fold(admitted(), started(1))
    assert state.epoch == 1
    apply(state, ev.OwnerClaimed(run_id=RID, owner="b"))  # epoch 0: "the next one"
    assert (state.owner, state.epoch) == ("b", 2)
    if "epoch" in {f.name for f in msgspec.structs.fields(ev.OwnerClaimed)}:
        apply(state, ev.OwnerClaimed(run_id=RID, owner="c", epoch=3))
        assert state.epoch == 3
        assert_refused(state, ev.OwnerClaimed(run_id=RID, owner="d", epoch=3), "next epoch")
        assert_refused(state, ev.OwnerClaimed(run_id=RID, owner="d", epoch=5), "next epoch")


def test_unknown_events_and_runs_are_refused() -> None:
    state = round_one()
    assert_refused(state, dispatched("nope"), "unknown execution")
    assert_refused(state, ev.CallDispatched(run_id="other", execution_id=E1, attempt=1),
                   "in run")
    assert_refused(state, decided(1, 0), "decided already")
    assert_refused(state, admitted(), "admitted twice")
    with pytest.raises(ReplayError, match="before RunAdmitted"):
        apply(RunState(), started(1))


# -- legitimate histories: what the loop emits ------------------------------------------------
def test_a_round_as_the_loop_emits_it() -> None:
    a, b, c, d = (eid_of(1, i) for i in range(4))
    state = fold(
        admitted(), started(1), completed(1),
        ev.UsageCharged(run_id=RID, step=1, usage=Usage(input_tokens=3)),
        decided(1, 0), decided(1, 1), decided(1, 2), decided(1, 3, "denied"),
        dispatched(a),  # max_parallel=1: only the first rides the decision commit
        failed(a, 1, retrying=True), dispatched(a, 2), succeeded(a, 2),
        dispatched(b), timed_out(b), dispatched(b, 2), timed_out(b, 2), unknown(b, 2),
        dispatched(c), succeeded(c, status="too_large"),
        round_done(1), started(2),
        ev.ModelStepCompleted(run_id=RID, step=2, response=Final("done")),
        finished("final"))
    assert state.tool_calls == 4 + 2  # four decided, two retries
    assert state.model_steps == 2
    assert [(r.phase, r.status, r.attempt) for r in state.calls.values()] == [
        ("done", "ok", 2), ("done", "outcome_unknown", 2), ("done", "too_large", 1),
        ("done", "denied", 0)]
    assert state.calls[d].stage == "closed"
    assert [u.execution_id for u in state.unresolved] == [b]


def test_live_timeouts_retries_and_reconciles() -> None:
    # A timeout reconciled as not taken is retried; the earlier timeout left no doubt.
    state = round_one(dispatched(E1), timed_out(E1), reconciled(E1, 1, took=False),
                      dispatched(E1, 2), failed(E1, 2))
    assert (state.calls[E1].status, state.tool_calls) == ("error", 2)
    assert_refused(state, unknown(E1, 2), "no earlier attempt")
    # An unreconciled timeout, then a failure: the outcome stays unknown (SPEC 6).
    state = round_one(dispatched(E1), timed_out(E1), dispatched(E1, 2), failed(E1, 2),
                      unknown(E1, 2), round_done(1))
    assert state.calls[E1].open and state.calls[E1].status == "outcome_unknown"
    # Reconciled as taken: done.
    state = round_one(dispatched(E1), timed_out(E1), reconciled(E1, 1, took=True))
    assert (state.calls[E1].status, state.calls[E1].open) == ("ok", False)


def test_a_durable_dispatch_whose_attempt_never_started_is_skipped() -> None:
    state = round_one(dispatched(E1), dispatched(E2), succeeded(E1), skipped(E2),
                      round_done(1), decisions=("allow", "allow"))
    assert state.calls[E2].status == "skipped" and not state.calls[E2].open
    assert len(state.transcript) == 2  # a skipped call does not enter the history


def test_a_skipped_decision_may_be_said_skipped_again() -> None:
    state = round_one(skipped(E1), decisions=("skipped",))
    assert state.calls[E1].status == "skipped"


@pytest.mark.parametrize("before", [
    [],  # intended: its dispatch was never recorded
    [dispatched(E1)],  # dispatched, no outcome
    [dispatched(E1), failed(E1, retrying=True)],
    [dispatched(E1), timed_out(E1)],
    [dispatched(E1), timed_out(E1), unknown(E1)],  # outcome_unknown, seen by the model
], ids=["intended", "dispatched", "failed_retrying", "timed_out", "outcome_unknown"])
def test_settle_may_reconcile_retry_or_give_up_an_open_call(before: list[ev.Event]) -> None:
    attempt = max(sum(isinstance(e, ev.CallDispatched) for e in before), 1)
    # Reconciled (either answer).
    for took in (True, False):
        state = then(crashed(*before), reconciled(E1, attempt, took=took), round_done(1),
                     started(2))
        assert state.calls[E1].status == ("ok" if took else "error")
    # Retried, as settle numbers it: the attempt after max(attempt, 1).
    state = then(crashed(*before), dispatched(E1, attempt + 1), succeeded(E1, attempt + 1),
                 round_done(1))
    assert state.calls[E1].attempt == attempt + 1 and state.tool_calls == 2
    # Reconciled as not taken, then retried.
    then(crashed(*before), reconciled(E1, attempt, took=False), dispatched(E1, attempt + 1),
         timed_out(E1, attempt + 1), unknown(E1, attempt + 1))
    # No budget to retry: given up as outcome_unknown, even when only intended.
    state = then(crashed(*before), unknown(E1, attempt), round_done(1))
    assert state.calls[E1].open
    # Left for a person (needs_review), resolved, resumed.
    state = then(crashed(*before), finished("needs_review"), resolved(E1, "failed"),
                 resumed(), round_done(1), started(2))
    assert state.calls[E1].status == "error" and not state.unresolved
    # A retry that fails after an attempt whose effect is unknown (interrupted by the crash,
    # timed out, or never recorded as dispatched) leaves the outcome unknown; after an
    # attempt that failed, the failure stands.
    state = then(crashed(*before), dispatched(E1, attempt + 1), failed(E1, attempt + 1))
    if before and isinstance(before[-1], ev.CallFailed):
        assert_refused(state, unknown(E1, attempt + 1), "no earlier attempt")
    else:
        apply(state, unknown(E1, attempt + 1))


def test_settle_retries_a_call_that_was_only_intended_as_attempt_one_or_two() -> None:
    then(crashed(), dispatched(E1, 1), succeeded(E1, 1))
    then(crashed(), dispatched(E1, 2), succeeded(E1, 2))
    assert_refused(crashed(), dispatched(E1, 3))
    assert_refused(crashed(dispatched(E1)), dispatched(E1, 3))


def test_the_resume_window_closes_at_the_next_step() -> None:
    state = fold(admitted(), started(1), decided(1), dispatched(E1), timed_out(E1),
                 unknown(E1), round_done(1), resumed(), started(2))
    assert not state.resuming and state.calls[E1].open
    assert_refused(state, dispatched(E1, 2), "unknown")  # a live retry of an ended call
    assert_refused(state, reconciled(E1))
    # ... and a later resume may still settle it.
    state = fold(admitted(), started(1), decided(1), dispatched(E1), timed_out(E1),
                 unknown(E1), round_done(1), started(2), finished("final"), resumed())
    apply(state, dispatched(E1, 2))
    apply(state, succeeded(E1, 2))


def test_a_failed_apply_leaves_the_history_foldable() -> None:
    events = [admitted(), started(1), completed(1), decided(1), dispatched(E1),
              failed(E1, retrying=True), dispatched(E1, 2), succeeded(E1, 2), round_done(1),
              started(2), finished("final")]
    state = RunState()
    for event in events:
        for bad in (dispatched(E1, 3), succeeded(E1, 1), started(state.model_steps + 2),
                    finished("bogus"), decided(state.model_steps + 1, 5, "bogus")):
            copied = copy.deepcopy(state)
            try:
                apply(state, bad)
            except ReplayError:
                assert state == copied
            else:  # legal here (e.g. before the call exists, nothing); undo by replaying
                state = copied
        apply(state, event)
    assert state == replay(events)


# == property tests: a small model of the table =============================================
@dataclass
class MCall:
    """The model's view of one call: the last thing that happened to it."""

    decision: str
    # decided | dispatched | failed_retry | timed_out | reconciled_no | unknown | failed | closed
    last: str = "decided"
    attempt: int = 0
    doubt: bool = False

    def open(self) -> bool:
        return self.decision == "allow" and self.last in (
            "decided", "dispatched", "failed_retry", "timed_out", "unknown")

    def phase(self) -> str:
        if self.decision != "allow" or self.last not in ("decided", "dispatched",
                                                         "failed_retry", "timed_out"):
            return "done"
        return "intended" if self.last == "decided" else "dispatched"


@dataclass
class Model:
    """SPEC 5 and 6 as a table, written apart from the fold: what may come next."""

    admitted: bool = False
    finished: bool = False
    resuming: bool = False
    steps: int = 0
    round_open: bool = False
    calls: dict[str, MCall] = field(default_factory=dict)

    def legal(self, e: ev.Event) -> bool:  # noqa: C901 - a table, read top to bottom
        if not self.admitted:
            return isinstance(e, ev.RunAdmitted)
        if e.run_id != RID or isinstance(e, ev.RunAdmitted):
            return False
        if self.finished and not isinstance(e, ev.RunResumed | ev.CallResolved
                                            | ev.OwnerClaimed):
            return False
        match e:
            case ev.ModelStepStarted():
                return e.step == self.steps + 1 and not self.round_open
            case ev.ModelStepCompleted() | ev.ModelStepFailed() | ev.UsageCharged() \
                    | ev.RoundCompleted():
                return e.step == self.steps >= 1
            case ev.CallDecided():
                return e.execution_id not in self.calls and e.decision in DECISIONS \
                    and e.step == self.steps >= 1
            case ev.RunFinished():
                return e.status in RUN_STATUSES and (
                    (e.status == "limit_exceeded") == (e.exhausted_limit in LIMITS)) and (
                    e.exhausted_limit is None or e.exhausted_limit in LIMITS)
            case ev.NoticeAdded() | ev.OwnerClaimed() | ev.RunResumed():
                return True
        c = self.calls.get(getattr(e, "execution_id", ""))
        if c is None:
            return False
        allowed, resuming = c.decision == "allow", self.resuming
        match e:
            case ev.CallDispatched(attempt=n):
                if not allowed:
                    return False
                if resuming and (c.open() or c.last == "reconciled_no") \
                        and n in (c.attempt + 1, max(c.attempt, 1) + 1):
                    return True
                return (c.last == "decided" and n == 1) or (
                    c.last in ("failed_retry", "timed_out", "reconciled_no")
                    and n == c.attempt + 1)
            case ev.CallSucceeded() | ev.CallFailed() | ev.CallTimedOut():
                if isinstance(e, ev.CallSucceeded) and e.status not in ("ok", "too_large",
                                                                        "error"):
                    return False
                return allowed and c.last == "dispatched" and e.attempt == c.attempt
            case ev.CallReconciled(attempt=n):
                return n == max(c.attempt, 1) and (
                    c.last == "timed_out" or (resuming and c.open()))
            case ev.CallOutcomeUnknown(attempt=n):
                return allowed and n == max(c.attempt, 1) and (
                    c.last == "timed_out" or (c.last == "failed" and c.doubt)
                    or (resuming and c.open()))
            case ev.CallSkipped():
                return c.decision == "skipped" or (allowed and (
                    c.last == "decided"
                    or (not resuming and c.last == "dispatched" and c.attempt == 1)))
            case ev.CallResolved():
                return e.outcome in ("succeeded", "failed", "abandoned") and c.open()
        raise AssertionError(f"the model has no rule for {e!r}")

    def step(self, e: ev.Event) -> None:  # noqa: C901
        """Advance over a legal event."""
        match e:
            case ev.RunAdmitted():
                self.admitted = True
            case ev.ModelStepStarted():
                self.steps, self.resuming = e.step, False
            case ev.CallDecided():
                self.calls[e.execution_id] = MCall(
                    e.decision, "decided" if e.decision == "allow" else "closed")
                self.round_open = True
            case ev.RoundCompleted():
                self.round_open = False
            case ev.RunResumed():
                self.finished, self.resuming = False, True
            case ev.RunFinished():
                self.finished, self.resuming = True, False
            case ev.CallDispatched():
                c = self.calls[e.execution_id]
                if c.last in ("timed_out", "dispatched", "unknown") or e.attempt > 1 \
                        and c.last == "decided":
                    c.doubt = True
                c.last, c.attempt = "dispatched", e.attempt
            case ev.CallSucceeded() | ev.CallSkipped() | ev.CallResolved():
                self.calls[e.execution_id].last = "closed"
            case ev.CallFailed():
                self.calls[e.execution_id].last = "failed_retry" if e.retrying else "failed"
            case ev.CallTimedOut():
                self.calls[e.execution_id].last = "timed_out"
            case ev.CallOutcomeUnknown():
                self.calls[e.execution_id].last = "unknown"
            case ev.CallReconciled():
                self.calls[e.execution_id].last = "closed" if e.took_effect else "reconciled_no"
            case _:
                pass

    def candidates(self, full: bool = True) -> list[ev.Event]:
        """Events worth trying next, legal or not; ``full=False`` keeps to a few that cover
        every legal move (to generate histories quickly)."""
        s = self.steps
        out: list[ev.Event] = [
            started(s + 1), completed(s), round_done(s), resumed(), finished("final"),
            finished("needs_review"), finished("limit_exceeded", "cost"),
            ev.NoticeAdded(run_id=RID, text="n"), ev.OwnerClaimed(run_id=RID, owner="o"),
            ev.UsageCharged(run_id=RID, step=s, usage=NO_USAGE)]
        index = sum(1 for eid in self.calls if eid.startswith(f"{RID}:{s}:"))
        out += [decided(s, index), decided(s, index, "denied"), decided(s, index, "skipped")]
        if full:
            out += [started(s + 2), started(s), completed(s + 1), round_done(s + 1),
                    finished("bogus"), finished("final", "deadline"), finished("limit_exceeded"),
                    dispatched("nope"), ev.CallDispatched(run_id="other", execution_id="x"),
                    admitted(), decided(s, index, "bogus"), decided(s + 1, index)]
        for eid in list(self.calls)[-3:]:
            c = self.calls[eid]
            n, m = c.attempt, max(c.attempt, 1)
            if not full:  # only what may be legal: each event at the attempt it needs
                if c.last != "closed":
                    out += [dispatched(eid, n + 1), dispatched(eid, m + 1), succeeded(eid, n),
                            succeeded(eid, n, "too_large"), failed(eid, n),
                            failed(eid, n, retrying=True), timed_out(eid, n), unknown(eid, m),
                            reconciled(eid, m, took=True), reconciled(eid, m, took=False),
                            resolved(eid, "succeeded"), resolved(eid, "abandoned")]
                out.append(skipped(eid))
                continue
            out += [decided(s, int(eid.rsplit(":", 1)[1])) if eid.startswith(
                f"{RID}:{s}:") else dispatched(eid, 0), succeeded(eid, n, "bogus"),
                resolved(eid, "bogus"), succeeded(eid, n, "too_large"), skipped(eid),
                resolved(eid, "succeeded"), resolved(eid, "abandoned")]
            for a in {n, n + 1, n + 2, m, m + 1, max(n - 1, 0)}:
                out += [dispatched(eid, a), succeeded(eid, a), failed(eid, a),
                        failed(eid, a, retrying=True), timed_out(eid, a), unknown(eid, a),
                        reconciled(eid, a, took=True), reconciled(eid, a, took=False)]
        return out


ATTEMPT_EVENTS = (ev.CallDispatched, ev.CallSucceeded, ev.CallFailed, ev.CallTimedOut,
                  ev.CallReconciled, ev.CallOutcomeUnknown)


def weight(e: ev.Event) -> int:
    """How often a legal event is picked: attempts most, chatter and run ends least."""
    if isinstance(e, ATTEMPT_EVENTS):
        return 12
    if isinstance(e, ev.ModelStepStarted | ev.RoundCompleted):
        return 5
    if isinstance(e, ev.CallDecided):
        return 3
    if isinstance(e, ev.CallSkipped | ev.CallResolved):
        return 2
    return 1


def legal_history(choices: list[int]) -> list[ev.Event]:
    """A legal history: after RunAdmitted, one weighted legal move per choice."""
    model = Model()
    model.step(admitted())
    history: list[ev.Event] = [admitted()]
    for choice in choices:
        legal = [e for e in model.candidates(full=False) if model.legal(e)]
        ends = list(itertools.accumulate(weight(e) for e in legal))
        e = legal[bisect.bisect_right(ends, choice % ends[-1])]
        model.step(e)
        history.append(e)
    return history


def expected_counters(history: list[ev.Event]) -> tuple[int, int]:
    steps = [e.step for e in history if isinstance(e, ev.ModelStepStarted)]
    tool_calls = sum(isinstance(e, ev.CallDecided)
                     or (isinstance(e, ev.CallDispatched) and e.attempt > 1) for e in history)
    return (steps[-1] if steps else 0), tool_calls


FOLD_SETTINGS = settings(max_examples=300, deadline=None, database=None)
# Drawn in one go (a list of integers, one per move): hypothesis still shrinks it well, and a
# draw per move would cost more than the fold and the model together.
CHOICES = st.lists(st.integers(0, 2**20), max_size=44)


@FOLD_SETTINGS
@given(choices=CHOICES)
def test_random_legal_histories_fold(choices: list[int]) -> None:
    history = legal_history(choices)
    state = replay(history)
    assert (state.model_steps, state.tool_calls) == expected_counters(history)
    model = Model()
    for e in history:
        model.step(e)
    assert state.finished == model.finished and state.resuming == model.resuming
    for eid, c in model.calls.items():
        rec = state.calls[eid]
        assert (rec.phase, rec.open, rec.attempt) == (c.phase(), c.open(), c.attempt), eid


@FOLD_SETTINGS
@given(choices=CHOICES, where=st.integers(0, 2**20), pick=st.integers(0, 2**20))
def test_an_illegal_event_changes_nothing(choices: list[int], where: int, pick: int) -> None:
    history = legal_history(choices)
    at = 1 + where % len(history)
    model, state = Model(), RunState()
    for e in history[:at]:
        model.step(e)
        apply(state, e)
    copied, builtins = snapshot(state)
    candidates = model.candidates()
    illegal = [e for e in candidates if not model.legal(e)]
    bad = illegal[pick % len(illegal)]
    with pytest.raises(ReplayError):
        apply(state, bad)
    assert state == copied and msgspec.to_builtins(state) == builtins
    # The fold and the model agree on every candidate here.
    for e in candidates:
        if model.legal(e):
            apply(copy.deepcopy(state), e)
        else:
            with pytest.raises(ReplayError):
                apply(state, e)
            assert state == copied
    # The rest of the history folds on, as if nothing had been tried.
    for e in history[at:]:
        apply(state, e)
    assert (state.model_steps, state.tool_calls) == expected_counters(history)
