"""A run's timeline, event by event (``boundloop show``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop._text import money, plain
from boundloop.core.budget import (
    Budget,
    Usage,
)
from boundloop.core.replay import RunState, apply
from boundloop.journal.base import Journal, OwnerRecord
from boundloop.messages import CallTools, Final
from boundloop.ops._events import event_name
from boundloop.ops._open import read_events, resolve_run_id
from boundloop.ops._runs import (
    OPEN_EXPLANATIONS,
    RunSummary,
    run_children,
    state_word,
    waiting_note,
)
from boundloop.results import CompletedAction, UnresolvedAction

_json = msgspec.json.Encoder()


# -- show --------------------------------------------------------------------------------
class TimelineRow(msgspec.Struct, kw_only=True):
    """One event of a run, with what was left of the budget after it."""

    seq: int
    offset_s: float
    #: The event's class name (``CallDecided``), as SPEC 6 names it and ``export`` too.
    event: str
    step: int | None = None
    call_id: str | None = None
    tool: str | None = None
    execution_id: str | None = None
    attempt: int | None = None
    decision: str | None = None
    outcome: str | None = None
    latency_s: float | None = None
    detail: str = ""
    model_steps: int = 0
    tool_calls: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)


class Timeline(msgspec.Struct, kw_only=True):
    """What a run did, event by event, and how it ended."""

    run_id: str
    status: str
    finished: bool
    exhausted_limit: str | None
    explanation: str
    model_steps: int
    tool_calls: int
    usage: Usage
    budget: Budget
    started_ts: float
    elapsed_s: float
    parent_run_id: str | None
    rows: list[TimelineRow]
    completed: list[CompletedAction]
    unresolved: list[UnresolvedAction]
    #: The runner that owns the run (its last OwnerClaimed, else its RunAdmitted).
    owner: str = ""
    #: The runs it started, oldest first (``run_timeline``; ``timeline`` leaves it empty).
    children: list[RunSummary] = msgspec.field(default_factory=list)
    #: The agent the run runs (name and version) and its labels (SPEC 14).
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: Calls that wait for a person: execution id, tool and arguments (as journaled).
    awaiting: list[AwaitingCall] = msgspec.field(default_factory=list)
    #: The run's per-tool caps (tool name -> max_calls) and its accepted calls by tool
    #: (nested runs' included), as the fold counts them.
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)


class AwaitingCall(msgspec.Struct, frozen=True):
    """A call that waits for a person's approve or deny."""

    execution_id: str
    tool: str
    arguments: dict[str, Any]


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else _json.encode(value).decode()
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _row(seq: int, event: ev.Event, state: RunState, t0: float) -> TimelineRow:
    row = TimelineRow(seq=seq, offset_s=round(max(event.ts - t0, 0.0), 6),
                      event=event_name(event))
    eid = getattr(event, "execution_id", None)
    if isinstance(eid, str):
        row.execution_id = eid
        rec = state.calls.get(eid)
        if rec is not None:
            row.step, row.call_id, row.tool = rec.step, rec.call_id, rec.tool
    match event:
        case ev.RunAdmitted():
            names = ", ".join(t + (f" (max_calls={event.tool_caps[t]})"
                                   if t in event.tool_caps else "")
                              for t in event.tools) or "none"
            row.detail = f"tools: {names}"
        case ev.ModelStepStarted():
            row.step = event.step
            row.detail = f"tools {'allowed' if event.tools_allowed else 'not allowed'}"
        case ev.ModelStepCompleted(response=Final() as resp):
            row.step, row.outcome, row.latency_s = event.step, "final", event.latency_s
            row.detail = _short(resp.text)
        case ev.ModelStepCompleted(response=CallTools() as resp):
            row.step, row.latency_s = event.step, event.latency_s
            row.outcome = f"{len(resp.calls)} call{'s' if len(resp.calls) != 1 else ''}"
            row.detail = ", ".join(f"{c.id} {c.name}" for c in resp.calls)
        case ev.ModelStepFailed():
            row.step, row.outcome, row.latency_s = event.step, event.reason, event.latency_s
            row.detail = _short(event.detail)
        case ev.UsageCharged():
            row.step = event.step
            u = event.usage
            row.detail = (f"in {u.all_input_tokens} out {u.output_tokens}"
                          f"{'' if u.cost is None else f' cost {money(u.cost)}'}"
                          f" ({'estimated' if event.estimated else 'reported'})"
                          + (f"; unpriced: {_short(event.unpriced)}" if event.unpriced else ""))
        case ev.NoticeAdded():
            row.detail = _short(event.text)
        case ev.CallDecided():
            row.step, row.call_id, row.tool = event.step, event.call_id, event.tool
            row.decision = event.decision + (" (awaits approval)" if event.approval else "")
            row.detail = _short(event.reason) if event.reason else _short(event.arguments)
        case ev.CallDispatched():
            row.attempt, row.outcome = event.attempt, "dispatched"
        case ev.CallSucceeded():
            row.attempt, row.outcome, row.latency_s = event.attempt, event.status, event.latency_s
            row.detail = f"{event.size} bytes"
        case ev.CallFailed():
            row.attempt, row.latency_s = event.attempt, event.latency_s
            row.outcome = "error (retrying)" if event.retrying else "error"
            row.detail = _short(event.content)
        case ev.CallTimedOut():
            row.attempt, row.outcome, row.latency_s = event.attempt, "timed_out", event.latency_s
            row.detail = f"timeout {plain(event.timeout_s, 3)}s"
        case ev.CallOutcomeUnknown():
            row.attempt, row.outcome = event.attempt, "outcome_unknown"
            row.detail = _short(event.content)
        case ev.CallReconciled():
            row.attempt = event.attempt
            row.outcome = "reconciled: " + ("took effect" if event.took_effect else "did not")
        case ev.CallSkipped():
            row.outcome, row.detail = "skipped", event.reason
        case ev.CallResolved():
            row.outcome = f"resolved: {event.outcome}"
            row.detail = _short(" ".join(x for x in (event.note, f"by {event.by}" if event.by
                                                     else "") if x))
        case ev.RoundCompleted():
            row.step = event.step
        case ev.ChildCharged():
            row.detail = f"child {event.child_run_id}: {event.tool_calls} tool calls"
        case ev.OwnerClaimed() | ev.RunResumed():
            row.detail = f"owner {event.owner}" if event.owner else \
                ("released: nobody owns it" if isinstance(event, ev.OwnerClaimed) else "")
        case ev.ApprovalRequested():
            row.outcome = "awaiting approval"
        case ev.ApprovalDecided():
            row.outcome = "approved" if event.approved else "denied"
            row.detail = _short(" ".join(x for x in (event.note, f"by {event.by}" if event.by
                                                     else "") if x))
        case ev.RunRequeued():
            row.outcome = "queued again"
        case ev.RunFinished():
            row.outcome = event.status + (f" ({event.exhausted_limit})"
                                          if event.exhausted_limit else "")
            row.step = event.model_steps
        case _:
            pass
    row.model_steps, row.tool_calls, row.usage = state.model_steps, state.tool_calls, state.usage
    return row


def timeline(events: Iterable[ev.Event],
             owners: dict[str, OwnerRecord] | None = None) -> Timeline:
    """The run's timeline: each event with its time offset, step, call, decision, outcome,
    latency and the counters after it; then how the run ended.

    With ``owners`` (``journal.owners()``), a run with no RunFinished event is ``running``
    or ``interrupted`` as in ``list_runs`` (see ``state_word``); without, the fold's
    ``running``.

    Raises:
        ReplayError: the events do not make a run.
    """
    state = RunState()
    rows: list[TimelineRow] = []
    t0: float | None = None
    for seq, event in enumerate(events, 1):
        t0 = event.ts if t0 is None else t0
        apply(state, event)
        rows.append(_row(seq, event, state, t0))
    status, explanation = state.status, state.explanation
    if owners is not None and not state.finished:
        status = state_word(False, status, state.owner, owners)
        explanation = f"{OPEN_EXPLANATIONS[status]} {waiting_note(state, status)}".strip()
    return Timeline(agent=state.agent, agent_version=state.agent_version,
                    labels=state.labels, tool_caps=dict(state.tool_caps),
                    tool_counts=dict(state.tool_counts),
                    awaiting=[AwaitingCall(r.execution_id, r.tool, r.arguments)
                              for r in state.awaiting],
                    run_id=state.run_id, status=status, finished=state.finished,
                    exhausted_limit=state.exhausted_limit, explanation=explanation,
                    model_steps=state.model_steps, tool_calls=state.tool_calls,
                    usage=state.usage, budget=state.budget, started_ts=state.started_ts,
                    elapsed_s=state.elapsed_s, parent_run_id=state.parent_run_id, rows=rows,
                    completed=state.completed, unresolved=state.unresolved, owner=state.owner)


def run_timeline(journal: Journal, run_id: str) -> Timeline:
    """``timeline`` of the journal's run ``run_id``, with its state word (``running`` or
    ``interrupted`` while it has no RunFinished event) and the runs it started.

    Raises:
        UnknownRun: the journal holds no such run.
        AmbiguousId: ``run_id`` is no run's id and begins several.
        ReplayError: the events do not make a run.
    """
    run_id = resolve_run_id(journal, run_id)
    tl = timeline(read_events(journal, run_id), journal.owners())
    tl.children = run_children(journal, run_id)
    return tl
