"""The replay fold: ``apply(state, event) -> state`` and ``replay(events) -> RunState``.

This is the one state machine of a run. The supervisor folds the events it makes into its
live state with the same ``apply`` that rebuilds a run at recovery and in
``boundloop replay``. Illegal transitions raise :class:`ReplayError` and leave the state
untouched. ``apply`` updates the state it is given (and returns it) to keep a round O(1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.errors import BoundloopError
from boundloop.messages import (
    CallMessage,
    Final,
    FinalMessage,
    Message,
    NoticeMessage,
    ToolResultMessage,
    copy_history,
)
from boundloop.policy.budget import Budget, Usage
from boundloop.results import CompletedAction, RunResult, UnresolvedAction


class ReplayError(BoundloopError):
    """An event does not follow from the state before it (a damaged journal, or a bug)."""


class CallRecord(msgspec.Struct):
    """What the fold knows of one logical call."""

    execution_id: str
    idempotency_key: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    step: int
    index: int
    decision: str
    attempt: int = 0
    phase: str = "intended"  # intended | dispatched | done
    dispatched: bool = False
    status: str | None = None
    content: Any = None
    abandoned: bool = False
    redacted: bool = False
    idempotent: bool = False
    irreversible: bool = False

    @property
    def open(self) -> bool:
        """True while the call's outcome is unknown and nobody closed it."""
        return self.phase != "done" or (self.status == "outcome_unknown" and not self.abandoned)


class RunState(msgspec.Struct):
    """A run as its events left it (SPEC 6)."""

    run_id: str = ""
    status: str = "running"
    exhausted_limit: str | None = None
    explanation: str = ""
    model_steps: int = 0
    tool_calls: int = 0
    transcript: list[Message] = msgspec.field(default_factory=list)
    usage: Usage = msgspec.field(default_factory=Usage)
    budget: Budget = msgspec.field(default_factory=Budget)
    owner: str = ""
    parent_run_id: str | None = None
    parent_step: int | None = None
    elapsed_s: float = 0.0
    started_ts: float = 0.0
    last_ts: float = 0.0
    finished: bool = False
    admitted: bool = False
    calls: dict[str, CallRecord] = msgspec.field(default_factory=dict)
    reserved_ids: set[str] = msgspec.field(default_factory=set)
    child_tool_calls: int = 0
    child_usage: Usage = msgspec.field(default_factory=Usage)
    malformed: int = 0
    reservation: Usage | None = None
    round_calls: list[str] = msgspec.field(default_factory=list)
    events: int = 0

    @property
    def unresolved(self) -> list[UnresolvedAction]:
        """Actions whose outcome is unknown: no outcome recorded, or ``outcome_unknown``."""
        return [self._unresolved(r) for r in self.calls.values()
                if r.open or (r.abandoned and r.status == "outcome_unknown")]

    @property
    def open_actions(self) -> list[UnresolvedAction]:
        """Unresolved actions nobody has closed yet (what recovery must resolve)."""
        return [self._unresolved(r) for r in self.calls.values() if r.open]

    def _unresolved(self, r: CallRecord) -> UnresolvedAction:
        return UnresolvedAction(self.run_id, r.call_id, r.tool, r.execution_id,
                                r.idempotency_key, max(r.attempt, 1),
                                "dispatched" if r.dispatched else "intended", r.abandoned)

    @property
    def completed(self) -> list[CompletedAction]:
        """Calls whose result is known (not skipped, not unknown)."""
        return [CompletedAction(r.call_id, r.tool, r.status, r.attempt, r.execution_id)
                for r in self.calls.values()
                if r.phase == "done" and r.status not in (None, "skipped", "outcome_unknown")]

    def result(self, elapsed_s: float | None = None) -> RunResult:
        """The RunResult this state reports."""
        return RunResult(
            run_id=self.run_id, status=self.status, exhausted_limit=self.exhausted_limit,
            explanation=self.explanation, model_steps=self.model_steps,
            tool_calls=self.tool_calls, transcript=copy_history(self.transcript),
            completed=self.completed, unresolved=self.unresolved, usage=self.usage,
            elapsed_s=self.elapsed_s if elapsed_s is None else elapsed_s)


def _record(state: RunState, execution_id: str) -> CallRecord:
    try:
        return state.calls[execution_id]
    except KeyError:
        raise ReplayError(f"run {state.run_id!r}: event for unknown execution "
                          f"{execution_id!r}") from None


def _check(state: RunState, event: ev.Event) -> None:
    if not state.admitted and not isinstance(event, ev.RunAdmitted):
        raise ReplayError(f"run {event.run_id!r}: {type(event).__name__} before RunAdmitted")
    if state.admitted and isinstance(event, ev.RunAdmitted):
        raise ReplayError(f"run {event.run_id!r}: admitted twice")
    if state.finished and not isinstance(event, ev.RunResumed | ev.CallResolved | ev.OwnerClaimed):
        raise ReplayError(f"run {event.run_id!r}: {type(event).__name__} after RunFinished")
    if state.admitted and event.run_id != state.run_id:
        raise ReplayError(f"event of run {event.run_id!r} in run {state.run_id!r}")


def apply(state: RunState, event: ev.Event) -> RunState:
    """Fold one event into ``state`` (updated in place and returned).

    Raises:
        ReplayError: the event cannot follow ``state``; the state is left untouched.
    """
    _check(state, event)
    match event:
        case ev.RunAdmitted():
            state.run_id = event.run_id
            state.admitted = True
            state.budget = event.budget
            state.transcript = list(event.history)
            state.reserved_ids = {m.id for m in event.history if isinstance(m, CallMessage)}
            state.owner = event.owner
            state.parent_run_id = event.parent_run_id
            state.parent_step = event.parent_step
            state.started_ts = event.ts
        case ev.ModelStepStarted():
            state.model_steps = event.step
            state.reservation = event.reservation
            state.usage = state.usage + event.reservation
            state.round_calls = []
        case ev.ModelStepCompleted():
            if isinstance(event.response, Final):
                state.transcript.append(FinalMessage(event.response.text))
        case ev.ModelStepFailed():
            if event.reason == "malformed":
                state.malformed += 1
        case ev.NoticeAdded():
            state.transcript.append(NoticeMessage(event.text))
        case ev.UsageCharged():
            if not event.estimated:
                state.usage = state.usage - (state.reservation or Usage()) + event.usage
            state.reservation = None
        case ev.ChildCharged():
            state.tool_calls += event.tool_calls
            state.usage = state.usage + event.usage
            state.child_tool_calls += event.tool_calls
            state.child_usage = state.child_usage + event.usage
        case ev.CallDecided():
            if event.execution_id in state.calls:
                raise ReplayError(f"execution {event.execution_id!r} decided twice")
            rec = CallRecord(event.execution_id, event.idempotency_key, event.call_id,
                             event.tool, event.arguments, event.step, event.index,
                             event.decision, redacted=event.redacted,
                             idempotent=event.idempotent, irreversible=event.irreversible)
            if event.decision == "skipped":
                rec.phase, rec.status = "done", "skipped"
            elif event.decision != "allow":
                rec.phase, rec.status, rec.content = "done", event.decision, event.reason
            state.calls[event.execution_id] = rec
            state.reserved_ids.add(event.call_id)
            state.round_calls.append(event.execution_id)
            state.tool_calls += 1
        case ev.CallDispatched():
            rec = _record(state, event.execution_id)
            if event.attempt > 1:
                state.tool_calls += 1
            rec.attempt, rec.phase, rec.dispatched = event.attempt, "dispatched", True
        case ev.CallSucceeded():
            rec = _record(state, event.execution_id)
            rec.phase, rec.status, rec.content = "done", event.status, event.content
        case ev.CallFailed():
            rec = _record(state, event.execution_id)
            rec.status, rec.content = "error", event.content
            if not event.retrying:
                rec.phase = "done"
        case ev.CallTimedOut():
            _record(state, event.execution_id).status = "outcome_unknown"
        case ev.CallOutcomeUnknown():
            rec = _record(state, event.execution_id)
            rec.phase, rec.status, rec.content = "done", "outcome_unknown", event.content
        case ev.CallReconciled():
            rec = _record(state, event.execution_id)
            rec.phase = "done"
            if event.took_effect:
                rec.status, rec.content = "ok", event.content
            else:
                rec.status, rec.content = "error", "the action did not take effect"
        case ev.CallSkipped():
            rec = _record(state, event.execution_id)
            rec.phase, rec.status = "done", "skipped"
        case ev.CallResolved():
            rec = _record(state, event.execution_id)
            if event.outcome not in ("succeeded", "failed", "abandoned"):
                raise ReplayError(f"unknown resolution {event.outcome!r}")
            rec.phase = "done"
            if event.outcome == "succeeded":
                rec.status, rec.content = "ok", f"resolved by a person: {event.note}".strip()
            elif event.outcome == "failed":
                rec.status, rec.content = "error", f"resolved by a person: {event.note}".strip()
            elif event.outcome == "abandoned":
                rec.status, rec.abandoned = "outcome_unknown", True
                rec.content = f"abandoned: {event.note}".strip()
        case ev.RoundCompleted():
            for eid in state.round_calls:
                rec = state.calls[eid]
                if rec.status in (None, "skipped"):
                    continue
                state.transcript.append(CallMessage(rec.call_id, rec.tool, rec.arguments))
                state.transcript.append(ToolResultMessage(rec.call_id, rec.status, rec.content))
            state.round_calls = []
        case ev.OwnerClaimed():
            state.owner = event.owner
        case ev.RunResumed():
            state.finished = False
            state.status = "running"
            state.exhausted_limit = None
            state.explanation = ""
            if event.owner:
                state.owner = event.owner
        case ev.RunFinished():
            state.finished = True
            state.status = event.status
            state.exhausted_limit = event.exhausted_limit
            state.explanation = event.explanation
        case _:
            raise ReplayError(f"unknown event {type(event).__name__}")
    state.elapsed_s = max(state.elapsed_s, event.elapsed_s)
    state.last_ts = max(state.last_ts, event.ts)
    state.events += 1
    return state


def replay(events: Iterable[ev.Event]) -> RunState:
    """Rebuild a run's state from its events, oldest first (a pure fold)."""
    state = RunState()
    for event in events:
        apply(state, event)
    return state
