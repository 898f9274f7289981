"""The replay fold: ``apply(state, event) -> state`` and ``replay(events) -> RunState``.

This is the one state machine of a run. The supervisor folds the events it makes into its
live state with the same ``apply`` that rebuilds a run at recovery and in
``boundloop replay``. ``apply`` updates the state it is given (and returns it) to keep a
round O(1).

The fold is strict (DESIGN rule 2): every event is checked against the state before it, as
a transition table (``_LIVE`` and ``_AT_RESUME`` below, in the manner of h11's
``_state.py``), and an event that cannot follow raises :class:`ReplayError` before anything
in the state changes, so a failed ``apply`` leaves the state exactly as it was. Checks come
first, mutations after; nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast, get_args

import msgspec

from boundloop import events as ev
from boundloop.core.budget import Budget, Usage
from boundloop.core.kinds import (
    LIMITS,
    RUN_STATUSES,
    CallStage,
    Decision,
    Phase,
    RecordStatus,
    Resolution,
    RunStatus,
    SucceededStatus,
)
from boundloop.errors import BoundloopError
from boundloop.messages import (
    AssistantMessage,
    CallMessage,
    Final,
    FinalMessage,
    Message,
    NoticeMessage,
    ToolResultMessage,
    copy_history,
)
from boundloop.results import CompletedAction, RunResult, UnresolvedAction


class ReplayError(BoundloopError):
    """An event does not follow from the state before it (a damaged journal, or a bug)."""


class CallRecord(msgspec.Struct):
    """What the fold knows of one logical call.

    ``phase`` and ``status`` are what reports show; ``stage`` is the call's place in the
    fold's transition table (see ``kinds.CallStage``); ``doubt`` is True once an earlier
    attempt may have taken effect without its result being known (a timeout not reconciled,
    an attempt a crash interrupted), so a later failure still leaves the outcome unknown.
    """

    execution_id: str
    idempotency_key: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    step: int
    index: int
    decision: Decision
    attempt: int = 0
    phase: Phase = "intended"
    dispatched: bool = False
    status: RecordStatus | None = None
    content: Any = None
    abandoned: bool = False
    redacted: bool = False
    idempotent: bool = False
    irreversible: bool = False
    stage: CallStage = "intended"
    doubt: bool = False
    #: The call waits (or waited) for a person's approval before dispatch (SPEC 14).
    approval: bool = False
    #: A person approved it; until its first attempt is recorded it has never run.
    approved: bool = False

    @property
    def open(self) -> bool:
        """True while the call's outcome is unknown and nobody closed it (a call waiting for
        approval never ran: it is not unresolved)."""
        if self.stage in ("held", "awaiting"):
            return False
        if self.approved and self.attempt == 0:
            return False
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
    #: The ownership epoch (SPEC 6): 1 at admission, one more at each OwnerClaimed.
    epoch: int = 0
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
    #: Accepted calls by tool name, nested runs' included (as ``tool_calls`` counts them,
    #: retries aside): what per-tool caps (``bl.tool(max_calls=N)``) are checked against.
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)
    #: The part of ``tool_counts`` that nested runs made (``ChildCharged``).
    child_tool_counts: dict[str, int] = msgspec.field(default_factory=dict)
    #: The per-tool caps the run was admitted with (tool name -> max_calls).
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)
    malformed: int = 0
    reservation: Usage | None = None
    round_calls: list[str] = msgspec.field(default_factory=list)
    #: What the round's CallTools said besides its calls (SPEC 2's ``assistant`` message).
    round_turn: AssistantMessage | None = None
    events: int = 0
    #: True from a RunResumed until the next model step or RunFinished: the window in
    #: which resume settles what a crash left open (reconcile, retry, give up).
    resuming: bool = False
    #: The agent the run runs (name and version; empty for a bare model) and its labels.
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: When the run's turn ended ``awaiting_approval`` (wall clock): the deadline runs on
    #: while it waits, so a resume counts the time since (SPEC 14).
    waiting_since: float | None = None

    @property
    def awaiting(self) -> list[CallRecord]:
        """Calls that wait for a person's approve or deny."""
        return [r for r in self.calls.values() if r.stage == "awaiting"]

    @property
    def queued(self) -> bool:
        """True while the run waits for a worker (enqueued, or requeued after approvals)."""
        return self.status == "queued"

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
            # A result is made once the run stopped: its status is one of RUN_STATUSES
            run_id=self.run_id, status=cast(RunStatus, self.status),
            exhausted_limit=self.exhausted_limit,
            explanation=self.explanation, model_steps=self.model_steps,
            tool_calls=self.tool_calls, transcript=copy_history(self.transcript),
            completed=self.completed, unresolved=self.unresolved, usage=self.usage,
            elapsed_s=self.elapsed_s if elapsed_s is None else elapsed_s)


# -- the transition table -------------------------------------------------------------------
# str -> Literal, by lookup: the fold refuses a value outside its vocabulary (and mypy sees
# the narrowed type).
_DECISIONS: dict[str, Decision] = {d: d for d in get_args(Decision)}
_SUCCEEDED: dict[str, SucceededStatus] = {s: s for s in get_args(SucceededStatus)}
_RESOLUTIONS: dict[str, Resolution] = {r: r for r in get_args(Resolution)}
#: The result of a call the policy did not allow (it is done as soon as it is decided).
_NOT_ALLOWED: dict[Decision, RecordStatus] = {
    "denied": "denied", "invalid_arguments": "invalid_arguments",
    "unknown_tool": "unknown_tool", "skipped": "skipped"}

#: Stages of a call whose outcome nobody knows yet (``CallRecord.open``).
_OPEN: frozenset[CallStage] = frozenset(
    {"intended", "running", "failed_retrying", "timed_out", "unknown"})

#: For each call event, the stages of the call it may follow while the run is live. Guards
#: on attempt numbers and flags are in ``_check_call``:
#: - CallDispatched(n): n is the call's attempt + 1 (its first attempt, or a retry after a
#:   retried failure, a timeout, or a reconcile that said the attempt did not take effect);
#: - CallSucceeded/CallFailed/CallTimedOut(n): the outcome of the attempt in flight, n;
#: - CallReconciled/CallOutcomeUnknown(n): n is max(attempt, 1); OutcomeUnknown follows a
#:   final failure only when an earlier attempt may have taken effect (``doubt``);
#: - CallSkipped: a call whose first attempt never started (a durable dispatch included);
#:   also a call the policy decided ``skipped``;
#: - CallResolved: an open call only.
_LIVE: dict[type[ev.Event], frozenset[CallStage]] = {
    ev.CallDispatched: frozenset({"intended", "failed_retrying", "timed_out", "not_taken"}),
    ev.CallSucceeded: frozenset({"running"}),
    ev.CallFailed: frozenset({"running"}),
    ev.CallTimedOut: frozenset({"running"}),
    ev.CallReconciled: frozenset({"timed_out"}),
    ev.CallOutcomeUnknown: frozenset({"timed_out", "failed"}),
    ev.CallSkipped: frozenset({"intended", "running", "held", "awaiting"}),
    ev.CallResolved: _OPEN,
}
#: The same while the run settles at resume (RunResumed, up to its next model step or
#: RunFinished): an open call may be reconciled, retried (attempt + 1, or 2 for a call
#: whose dispatch was never recorded, as resume numbers it) or given up as outcome_unknown,
#: whatever its stage; a call is never skipped there (its attempt may have run).
_AT_RESUME: dict[type[ev.Event], frozenset[CallStage]] = {
    **_LIVE,
    ev.CallDispatched: _LIVE[ev.CallDispatched] | {"running", "unknown"},
    ev.CallReconciled: _OPEN,
    ev.CallOutcomeUnknown: _OPEN | {"failed"},
    ev.CallSkipped: frozenset({"intended", "held", "awaiting"}),
}


#: What may follow a RunFinished: a resume, a person's resolution, a claim, and (after a
#: turn that ended ``awaiting_approval``) the decisions and the requeue they lead to.
_AFTER_FINISHED = (ev.RunResumed, ev.CallResolved, ev.OwnerClaimed, ev.ApprovalDecided,
                   ev.RunRequeued)
#: What may follow while a run is queued: a claim, then the resume that starts it.
_WHILE_QUEUED = (ev.OwnerClaimed, ev.RunResumed)


def _refuse(state: RunState, event: ev.Event, why: str) -> ReplayError:
    return ReplayError(f"run {state.run_id!r}: {type(event).__name__} cannot follow: {why}")


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
    if state.finished and not isinstance(event, _AFTER_FINISHED):
        raise ReplayError(f"run {event.run_id!r}: {type(event).__name__} after RunFinished "
                          "(only RunResumed, CallResolved, OwnerClaimed, or a decision on an "
                          "approval may follow it)")
    if state.status == "queued" and not isinstance(event, _WHILE_QUEUED):
        raise ReplayError(f"run {event.run_id!r}: {type(event).__name__} while the run is "
                          "queued (a worker claims it and resumes it first)")
    if state.admitted and event.run_id != state.run_id:
        raise ReplayError(f"event of run {event.run_id!r} in run {state.run_id!r}")


def _check_step(state: RunState, event: ev.Event, step: int) -> None:
    if step != state.model_steps or step < 1:
        raise _refuse(state, event, f"it is for model step {step}, and the current model "
                                    f"step is {state.model_steps}")


def _check_call(state: RunState, rec: CallRecord, event: ev.Event, attempt: int) -> None:
    """Raise unless ``event`` (of ``attempt``; 0 when it has none) may follow ``rec``."""
    stage = rec.stage
    if isinstance(event, ev.CallSkipped) and rec.decision == "skipped":
        return  # the policy skipped it already; saying so again changes nothing
    legal = (_AT_RESUME if state.resuming else _LIVE)[type(event)]
    if stage not in legal:
        if rec.decision != "allow":
            why = f"call {rec.execution_id!r} was decided {rec.decision!r}, not allowed"
        else:
            where = " at resume" if state.resuming else ""
            why = (f"call {rec.execution_id!r} is {stage} (attempt {rec.attempt}, status "
                   f"{rec.status}){where}")
        raise _refuse(state, event, why)
    match event:
        case ev.CallDispatched():
            if attempt != rec.attempt + 1 and not (
                    state.resuming and attempt == max(rec.attempt, 1) + 1):
                raise _refuse(state, event, f"attempt {attempt} of call {rec.execution_id!r} "
                                            f"does not follow its attempt {rec.attempt}")
        case ev.CallSucceeded() | ev.CallFailed() | ev.CallTimedOut():
            if attempt != rec.attempt:
                raise _refuse(state, event, f"it is the outcome of attempt {attempt}, and "
                                            f"call {rec.execution_id!r} has attempt "
                                            f"{rec.attempt} in flight")
        case ev.CallReconciled() | ev.CallOutcomeUnknown():
            if attempt != max(rec.attempt, 1):
                raise _refuse(state, event, f"it names attempt {attempt}, and call "
                                            f"{rec.execution_id!r} is at attempt "
                                            f"{rec.attempt}")
            if stage == "failed" and not rec.doubt:
                raise _refuse(state, event, f"call {rec.execution_id!r} failed, and no "
                                            "earlier attempt of it may have taken effect")
        case ev.CallSkipped():
            if stage == "running" and rec.attempt != 1:
                raise _refuse(state, event, f"call {rec.execution_id!r} already ran "
                                            f"attempt {rec.attempt - 1}")
        case _:
            pass


def apply(state: RunState, event: ev.Event) -> RunState:
    """Fold one event into ``state`` (updated in place and returned).

    Raises:
        ReplayError: the event cannot follow ``state``; the state is left untouched.
    """
    # The usual event (of an admitted, open run, its own) passes every test of _check:
    # asked here in one expression, the fold costs one Python call less an event.
    if not state.admitted or state.finished or event.run_id != state.run_id \
            or isinstance(event, ev.RunAdmitted) or state.status == "queued":
        _check(state, event)
    # Every branch checks everything first and mutates after: a raise changes nothing.
    # The cases of a round come first, in the order a round makes them (a class pattern
    # is an isinstance check: the usual event tries a few, not twenty).
    match event:
        case ev.ModelStepStarted():
            if event.step != state.model_steps + 1:
                raise _refuse(state, event, f"it starts model step {event.step}, and the "
                                            f"next model step is {state.model_steps + 1}")
            if state.round_calls:
                raise _refuse(state, event, f"the round of model step {state.model_steps} "
                                            "has no RoundCompleted")
            state.model_steps = event.step
            state.reservation = event.reservation
            state.usage = state.usage + event.reservation
            state.round_calls = []
            state.round_turn = None
            state.resuming = False
        case ev.ModelStepCompleted():
            _check_step(state, event, event.step)
            response = event.response
            if isinstance(response, Final):
                state.transcript.append(FinalMessage(response.text))
            elif response.text is not None or response.content is not None:
                state.round_turn = AssistantMessage(event.step, response.text,
                                                    response.content)
        case ev.UsageCharged():
            _check_step(state, event, event.step)
            if not event.estimated:
                state.usage = state.usage - (state.reservation or Usage()) + event.usage
            elif event.usage.unpriced_steps:  # the estimate stands, and it has no price
                state.usage = state.usage + Usage(unpriced_steps=event.usage.unpriced_steps)
            state.reservation = None
        case ev.CallDecided():
            if event.execution_id in state.calls:
                raise _refuse(state, event, f"execution {event.execution_id!r} was decided "
                                            "already")
            decision = _DECISIONS.get(event.decision)
            if decision is None:
                raise _refuse(state, event, f"unknown decision {event.decision!r} (one of "
                                            f"{', '.join(_DECISIONS)})")
            _check_step(state, event, event.step)
            rec = CallRecord(event.execution_id, event.idempotency_key, event.call_id,
                             event.tool, event.arguments, event.step, event.index,
                             decision, redacted=event.redacted,
                             idempotent=event.idempotent, irreversible=event.irreversible)
            if decision == "allow" and event.approval:
                rec.approval, rec.stage = True, "held"
            if decision != "allow":
                rec.phase, rec.stage, rec.status = "done", "closed", _NOT_ALLOWED[decision]
                if decision != "skipped":
                    rec.content = event.reason
            state.calls[event.execution_id] = rec
            state.reserved_ids.add(event.call_id)
            state.round_calls.append(event.execution_id)
            state.tool_calls += 1
            state.tool_counts[event.tool] = state.tool_counts.get(event.tool, 0) + 1
        case ev.CallDispatched():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, event.attempt)
            if event.attempt > 1:
                state.tool_calls += 1
            # Leaving a timeout unreconciled, or an attempt a crash interrupted, leaves doubt.
            if rec.stage in ("timed_out", "running", "unknown") or (
                    rec.stage == "intended" and event.attempt > 1):
                rec.doubt = True
            rec.attempt, rec.phase, rec.dispatched = event.attempt, "dispatched", True
            rec.stage = "running"
        case ev.CallSucceeded():
            rec = _record(state, event.execution_id)
            status = _SUCCEEDED.get(event.status)
            if status is None:
                raise _refuse(state, event, f"unknown status {event.status!r} (ok or "
                                            "too_large)")
            _check_call(state, rec, event, event.attempt)
            rec.phase, rec.stage, rec.status, rec.content = "done", "closed", status, \
                event.content
        case ev.RoundCompleted():
            # Not required: every call of the round has an outcome. The loop ensures it, but
            # ``inspect.check`` answers a dispatch past the recording's end with an empty
            # outcome, and its round still completes.
            _check_step(state, event, event.step)
            calls, turn = state.calls, state.round_turn
            for eid in state.round_calls:
                rec = calls[eid]
                if rec.status in (None, "skipped"):
                    continue
                if turn is not None:  # right before the step's first call
                    state.transcript.append(turn)
                    turn = None
                state.transcript.append(CallMessage(rec.call_id, rec.tool, rec.arguments,
                                                    rec.step))
                state.transcript.append(ToolResultMessage(rec.call_id, rec.status, rec.content))
            state.round_calls = []
            state.round_turn = None
        case ev.RunAdmitted():
            state.run_id = event.run_id
            state.admitted = True
            state.budget = event.budget
            state.transcript = list(event.history)
            state.reserved_ids = {m.id for m in event.history if isinstance(m, CallMessage)}
            state.owner = event.owner
            state.epoch = 1
            state.parent_run_id = event.parent_run_id
            state.parent_step = event.parent_step
            state.started_ts = event.ts
            state.agent, state.agent_version = event.agent, event.agent_version
            state.labels = dict(event.labels)
            state.tool_caps = dict(event.tool_caps)
            if event.queued:
                state.status = "queued"
        case ev.ModelStepFailed():
            _check_step(state, event, event.step)
            if event.reason == "malformed":
                state.malformed += 1
        case ev.NoticeAdded():
            state.transcript.append(NoticeMessage(event.text))
        case ev.ChildCharged():
            state.tool_calls += event.tool_calls
            state.usage = state.usage + event.usage
            state.child_tool_calls += event.tool_calls
            state.child_usage = state.child_usage + event.usage
            for name, n in event.tools.items():
                state.tool_counts[name] = state.tool_counts.get(name, 0) + n
                state.child_tool_counts[name] = state.child_tool_counts.get(name, 0) + n
        case ev.CallFailed():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, event.attempt)
            rec.status, rec.content = "error", event.content
            if event.retrying:
                rec.stage = "failed_retrying"
            else:
                rec.phase, rec.stage = "done", "failed"
        case ev.CallTimedOut():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, event.attempt)
            rec.status, rec.stage = "outcome_unknown", "timed_out"
        case ev.CallOutcomeUnknown():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, event.attempt)
            rec.phase, rec.stage, rec.status, rec.content = "done", "unknown", \
                "outcome_unknown", event.content
        case ev.CallReconciled():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, event.attempt)
            rec.phase = "done"
            if event.took_effect:
                rec.stage, rec.status, rec.content = "closed", "ok", event.content
            else:
                rec.stage, rec.status = "not_taken", "error"
                rec.content = "the action did not take effect"
        case ev.CallSkipped():
            rec = _record(state, event.execution_id)
            _check_call(state, rec, event, 0)
            rec.phase, rec.stage, rec.status = "done", "closed", "skipped"
        case ev.CallResolved():
            rec = _record(state, event.execution_id)
            outcome = _RESOLUTIONS.get(event.outcome)
            if outcome is None:
                raise _refuse(state, event, f"unknown resolution {event.outcome!r} "
                                            "(succeeded, failed or abandoned)")
            _check_call(state, rec, event, 0)
            rec.phase, rec.stage = "done", "closed"
            if outcome == "succeeded":
                rec.status, rec.content = "ok", f"resolved by a person: {event.note}".strip()
            elif outcome == "failed" and event.by == "boundloop":  # an approved call unsent
                rec.status, rec.content = "error", event.note
            elif outcome == "failed":
                rec.status, rec.content = "error", f"resolved by a person: {event.note}".strip()
            else:
                rec.status, rec.abandoned = "outcome_unknown", True
                rec.content = f"abandoned: {event.note}".strip()
        case ev.ApprovalRequested():
            rec = _record(state, event.execution_id)
            if rec.stage != "held":
                raise _refuse(state, event, f"call {rec.execution_id!r} does not wait for an "
                                            f"approval to be asked (it is {rec.stage})")
            rec.stage = "awaiting"
        case ev.ApprovalDecided():
            rec = _record(state, event.execution_id)
            if rec.stage != "awaiting" or state.status != "awaiting_approval":
                raise _refuse(state, event, f"call {rec.execution_id!r} does not wait for a "
                                            f"decision (it is {rec.stage}, the run "
                                            f"{state.status})")
            if event.approved:
                rec.stage, rec.approved = "intended", True
            else:
                rec.phase, rec.stage, rec.status = "done", "closed", "denied"
                who = f" by {event.by}" if event.by else ""
                rec.content = f"denied{who}: {event.note}".strip().rstrip(":")
        case ev.RunRequeued():
            if state.status != "awaiting_approval" or state.awaiting:
                raise _refuse(state, event, "only a run whose turn ended awaiting_approval, "
                                            "with every approval decided, is requeued")
            state.finished = False
            state.status = "queued"
            state.explanation = ""
        case ev.OwnerClaimed():
            # epoch 0: a journal older than epochs, or "the next one"; the fold counts it.
            # (getattr: the field is being added to events.py alongside this.)
            epoch = getattr(event, "epoch", 0)
            if epoch not in (0, state.epoch + 1):
                raise _refuse(state, event, f"it claims epoch {epoch}, and the next epoch "
                                            f"of the run is {state.epoch + 1}")
            state.owner = event.owner
            state.epoch = state.epoch + 1
        case ev.RunResumed():
            state.finished = False
            state.status = "running"
            state.exhausted_limit = None
            state.explanation = ""
            state.resuming = True
            state.waiting_since = None
            if event.owner:
                state.owner = event.owner
        case ev.RunFinished():
            if event.status not in RUN_STATUSES:
                raise _refuse(state, event, f"unknown status {event.status!r} (SPEC 3: "
                                            f"{', '.join(sorted(RUN_STATUSES))})")
            limit = event.exhausted_limit
            if limit is not None and limit not in LIMITS:
                raise _refuse(state, event, f"unknown limit {limit!r}")
            if (limit is None) == (event.status == "limit_exceeded"):
                raise _refuse(state, event, f"status {event.status!r} with exhausted limit "
                                            f"{limit!r} (a limit names why a run ended "
                                            "limit_exceeded, and only then)")
            state.finished = True
            state.resuming = False
            state.waiting_since = event.ts if event.status == "awaiting_approval" else None
            state.status = event.status
            state.exhausted_limit = event.exhausted_limit
            state.explanation = event.explanation
        case _:
            raise ReplayError(f"unknown event {type(event).__name__}")
    if event.elapsed_s > state.elapsed_s:  # max(), without two builtin calls an event
        state.elapsed_s = event.elapsed_s
    if event.ts > state.last_ts:
        state.last_ts = event.ts
    state.events += 1
    return state


def replay(events: Iterable[ev.Event]) -> RunState:
    """Rebuild a run's state from its events, oldest first (a pure fold)."""
    state = RunState()
    for event in events:
        apply(state, event)
    return state
