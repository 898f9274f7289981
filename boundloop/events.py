"""Journal events: frozen, tagged msgspec Structs (DESIGN rule 1).

Tags are explicit, stable strings, never class names, so a rename cannot break an old
journal. Evolution rules (msgspec schema evolution): new fields get defaults; tags and
field types never change. Every event carries ``run_id`` and ``ts`` (wall-clock seconds)
and ``elapsed_s`` (seconds of the run's active time when it was made, used to resume
deadlines); every call event carries ``execution_id``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from boundloop.core.budget import Budget, Usage
from boundloop.messages import Message, Response


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every journal event."""

    run_id: str
    ts: float = 0.0
    elapsed_s: float = 0.0


class RunAdmitted(Event, frozen=True, tag="run.admitted"):
    """A run was admitted: its budget, initial history, tools and owner; the agent it runs
    (name and version, empty for a run of a bare model) and its labels. A ``queued`` run
    was enqueued: it has no owner (``owner`` is empty) until a worker takes it."""

    budget: Budget
    history: list[Message]
    tools: list[str]
    owner: str = ""
    parent_run_id: str | None = None
    parent_step: int | None = None
    parent_execution_id: str | None = None
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    queued: bool = False
    #: The run's per-tool caps (``bl.tool(max_calls=N)``): tool name -> N, for reports.
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)


class ModelStepStarted(Event, frozen=True, tag="model.started"):
    """The runner counted a model step and reserved its usage before invoking the model."""

    step: int
    tools_allowed: bool
    reservation: Usage


class ModelStepCompleted(Event, frozen=True, tag="model.completed"):
    """The model returned a well-formed response (arguments redacted in the journal)."""

    step: int
    response: Response
    latency_s: float = 0.0


class ModelStepFailed(Event, frozen=True, tag="model.failed"):
    """The model raised (``error``), returned something malformed (``malformed``), or its
    response was discarded because the run was cancelled (``cancelled``)."""

    step: int
    reason: str
    detail: str = ""
    latency_s: float = 0.0


class NoticeAdded(Event, frozen=True, tag="notice.added"):
    """The runner told the model something (appended to the history)."""

    text: str


class UsageCharged(Event, frozen=True, tag="usage.charged"):
    """A step's usage replaces its reservation; ``estimated`` when the model reported none."""

    step: int
    usage: Usage
    estimated: bool = False
    #: Why the step could not be priced, in a run priced by the catalogue (``""``: it
    #: was, or the run is not); its ``usage.unpriced_steps`` is then 1.
    unpriced: str = ""


class CallDecided(Event, frozen=True, tag="call.decided"):
    """The durable intent: the policy's decision on one call, recorded before any dispatch.

    ``decision`` is ``allow``, ``denied``, ``invalid_arguments``, ``unknown_tool`` or
    ``skipped`` (cancellation or the deadline kept an accepted call from running).
    """

    execution_id: str
    idempotency_key: str
    step: int
    round: int
    index: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    decision: str
    reason: str = ""
    parent_step: int | None = None
    read_only: bool = False
    idempotent: bool = False
    irreversible: bool = False
    redacted: bool = False
    validated: dict[str, Any] | None = None
    #: The call waits for a person's approve or deny before any dispatch (SPEC 14).
    approval: bool = False


class CallDispatched(Event, frozen=True, tag="call.dispatched"):
    """An attempt of a call was handed to its handler; attempts after the first count."""

    execution_id: str
    attempt: int = 1


class CallSucceeded(Event, frozen=True, tag="call.succeeded"):
    """An attempt returned; ``status`` is ``ok`` or ``too_large`` (result over the limit)."""

    execution_id: str
    attempt: int
    content: Any
    status: str = "ok"
    latency_s: float = 0.0
    size: int = 0
    digest: str = ""


class CallFailed(Event, frozen=True, tag="call.failed"):
    """An attempt raised: the action did not take effect (``error``)."""

    execution_id: str
    attempt: int
    error_category: str
    content: str
    latency_s: float = 0.0
    retrying: bool = False


class CallTimedOut(Event, frozen=True, tag="call.timed_out"):
    """An attempt ran past its timeout; whether it took effect is not known."""

    execution_id: str
    attempt: int
    timeout_s: float
    latency_s: float = 0.0


class CallOutcomeUnknown(Event, frozen=True, tag="call.outcome_unknown"):
    """The call's final result is ``outcome_unknown`` (seen by the model as such)."""

    execution_id: str
    attempt: int
    content: str


class CallReconciled(Event, frozen=True, tag="call.reconciled"):
    """The tool's ``reconcile`` told whether an unknown outcome took effect."""

    execution_id: str
    attempt: int
    took_effect: bool
    content: Any = None
    size: int = 0
    digest: str = ""


class CallSkipped(Event, frozen=True, tag="call.skipped"):
    """An accepted call was not run: cancellation or the deadline came first."""

    execution_id: str
    reason: str


class CallResolved(Event, frozen=True, tag="call.resolved"):
    """A person (or recovery) closed an unresolved action: succeeded, failed or abandoned."""

    execution_id: str
    outcome: str
    note: str = ""
    by: str = ""
    #: True when a live owner was fenced to resolve it (``force=True``, SPEC 6).
    forced: bool = False


class ApprovalRequested(Event, frozen=True, tag="approval.requested"):
    """An accepted call waits for a person: the run's turn ends ``awaiting_approval``."""

    execution_id: str
    tool: str = ""


class ApprovalDecided(Event, frozen=True, tag="approval.decided"):
    """A person approved (the call may be dispatched) or denied (its result is ``denied``)
    a call that waited for approval."""

    execution_id: str
    approved: bool
    by: str = ""
    note: str = ""


class RunRequeued(Event, frozen=True, tag="run.requeued"):
    """Every approval the run waited for is decided: it waits for a worker again."""


class RoundCompleted(Event, frozen=True, tag="round.completed"):
    """Every call of a step has an outcome; their messages enter the history in model order."""

    step: int


class ChildCharged(Event, frozen=True, tag="child.charged"):
    """A nested run spent tool calls and usage that count against this run too."""

    child_run_id: str
    tool_calls: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)
    #: The calls among ``tool_calls`` by tool name (they count against per-tool caps).
    tools: dict[str, int] = msgspec.field(default_factory=dict)


class OwnerClaimed(Event, frozen=True, tag="owner.claimed"):
    """A runner took ownership of the run (at recovery, resume, or a forced resolve): the
    run's ownership ``epoch`` becomes one more (0 in journals older than epochs: the fold
    counts it then)."""

    owner: str
    epoch: int = 0


class RunResumed(Event, frozen=True, tag="run.resumed"):
    """The run continues after recovery, with the budgets it had left."""

    owner: str = ""


class RunFinished(Event, frozen=True, tag="run.finished"):
    """The run ended: the RunResult's status, limit, explanation and counters."""

    status: str
    exhausted_limit: str | None
    explanation: str
    model_steps: int
    tool_calls: int
    usage: Usage = msgspec.field(default_factory=Usage)


AnyEvent = (RunAdmitted | ModelStepStarted | ModelStepCompleted | ModelStepFailed | NoticeAdded
            | UsageCharged | CallDecided | CallDispatched | CallSucceeded | CallFailed
            | CallTimedOut | CallOutcomeUnknown | CallReconciled | CallSkipped | CallResolved
            | RoundCompleted | ChildCharged | OwnerClaimed | RunResumed | RunFinished
            | ApprovalRequested | ApprovalDecided | RunRequeued)
