"""What a recorded run tells the check (``ops._check``): its events indexed by the inputs
``core.decide`` will ask for, its configuration as far as its events keep it, and each
call's attempts as the interpreter made them facts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.core.budget import Budget
from boundloop.core.rules import UNKEEPABLE, Attempt
from boundloop.core.state import Config, ToolFacts
from boundloop.errors import JournalCorrupt
from boundloop.ops._events import event_name

#: The events the check compares, in order.
DECISIONS = (ev.ModelStepStarted, ev.CallDecided, ev.RunFinished)
#: Where a check stops following the recording: after these, decisions depend on recovery,
#: a person, or child runs, none of which the check re-enacts.
HORIZON = (ev.OwnerClaimed, ev.RunResumed, ev.CallResolved, ev.ChildCharged)


class Recording:
    """A run's recorded events (up to the check's horizon), indexed by what ``decide``
    will ask about them.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """

    def __init__(self, events: Sequence[ev.Event]) -> None:
        admitted = events[0] if events else None
        if not isinstance(admitted, ev.RunAdmitted):
            raise JournalCorrupt("the run's events do not start with RunAdmitted")
        self.admitted = admitted
        self.note = ""
        cut = len(events)
        finished = False
        for i, event in enumerate(events):
            finished = finished or isinstance(event, ev.RunFinished)
            # After RunFinished, only a resume makes new decisions (a resolution makes none).
            if isinstance(event, ev.RunResumed) or (isinstance(event, HORIZON) and not finished):
                cut = i
                self.note = (f"checked up to seq {i}: at seq {i + 1} ({event_name(event)}) the "
                             "run was taken over by recovery, a person or a child run, which "
                             "the check does not re-enact")
                break
        self.events = list(events[:cut])
        self.finished = any(isinstance(e, ev.RunFinished) for e in self.events)
        self.decisions = [(seq, e) for seq, e in enumerate(self.events, 1)
                          if isinstance(e, DECISIONS)]
        self.replies: dict[int, ev.ModelStepCompleted | ev.ModelStepFailed] = {}
        self.charged: dict[int, ev.UsageCharged] = {}
        self.decided: dict[tuple[int, str], ev.CallDecided] = {}
        self.by_eid: dict[str, ev.CallDecided] = {}
        self.outcomes: dict[str, list[ev.Event]] = {}
        self.results: dict[tuple[str, int], tuple[int, ev.CallSucceeded]] = {}
        #: Each call's later CallDispatched, in the order the executor made them durable.
        self.dispatched: list[ev.CallDispatched] = []
        self.flags: dict[str, ev.CallDecided] = {}
        for seq, e in enumerate(self.events, 1):
            match e:
                case ev.ModelStepCompleted() | ev.ModelStepFailed():
                    self.replies[e.step] = e
                case ev.UsageCharged():
                    self.charged[e.step] = e
                case ev.CallDecided():
                    self.decided[(e.step, e.call_id)] = e
                    self.by_eid[e.execution_id] = e
                    self.flags.setdefault(e.tool, e)
                case ev.CallDispatched():
                    self.dispatched.append(e)
                case ev.CallSucceeded():
                    self.results[(e.execution_id, e.attempt)] = (seq, e)
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case (ev.CallFailed() | ev.CallTimedOut() | ev.CallOutcomeUnknown()
                      | ev.CallReconciled() | ev.CallSkipped()):
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case _:
                    pass
        #: When the run was first seen cancelled (its first event that says so), if ever.
        self.cancelled_at = next((e.elapsed_s for e in self.events if _cancelled(e)), None)
        #: Priced by the catalogue: some step is recorded as one it could not price.
        self.catalogue = any(u.unpriced for u in self.charged.values())

    def config(self, budget: Budget) -> Config:
        """The run's fixed configuration, as far as its events tell it. The tools are known by
        name and recorded flags; every tool has an approval rule and the run a permission
        check, both answered from the recorded decisions."""
        a = self.admitted
        tools = {}
        for name in a.tools:
            f = self.flags.get(name)
            tools[name] = ToolFacts(read_only=bool(f and f.read_only),
                                    idempotent=bool(f and f.idempotent),
                                    irreversible=bool(f and f.irreversible and not f.read_only),
                                    approval="rule", max_calls=a.tool_caps.get(name))
        # unpriced="fail" leaves its words in the run's explanation when it stops the run.
        fail = any(isinstance(e, ev.RunFinished) and "(unpriced='fail')" in e.explanation
                   for e in self.events)
        return Config(run_id=a.run_id, budget=budget, tools=tools, history=list(a.history),
                      owner=a.owner, permit=True, parent_run_id=a.parent_run_id,
                      parent_step=a.parent_step, parent_execution_id=a.parent_execution_id,
                      agent=a.agent, agent_version=a.agent_version, labels=dict(a.labels),
                      catalogue=self.catalogue, unpriced="fail" if fail else "allow")

    def attempts(self, execution_id: str) -> tuple[list[Attempt], str | None]:
        """A call's recorded attempts as the interpreter made them facts; and why it never
        ran, if so."""
        done: list[Attempt] = []
        skipped = None
        for e in self.outcomes.get(execution_id, []):
            last = done[-1] if done else None
            match e:
                case ev.CallSkipped():
                    skipped = e.reason
                case ev.CallSucceeded():
                    done.append(Attempt(e.attempt, "ok", self.fields(e),
                                        latency_s=e.latency_s))
                case ev.CallFailed():
                    done.append(Attempt(e.attempt, "error", error=e.content,
                                        category=e.error_category, latency_s=e.latency_s))
                case ev.CallTimedOut():
                    done.append(Attempt(e.attempt, "timeout", latency_s=e.latency_s,
                                        timeout_s=e.timeout_s))
                case ev.CallReconciled() if last is not None:
                    last.reconciled = e.took_effect
                    last.reconciled_value = {"content": e.content, "size": e.size,
                                             "digest": e.digest} if e.took_effect else None
                case ev.CallOutcomeUnknown() if last is not None and last.kind == "timeout":
                    last.error = str(e.content)
                case _:
                    pass
        return done, skipped

    def fields(self, e: ev.CallSucceeded) -> dict[str, Any]:
        """A result's journal fields as the interpreter gives them to ``core`` (which says
        whether it is ``too_large`` under the budget checked): a result recorded ``ok``
        over the recorded limit could not be recorded at all, and stays ``ok`` under any
        limit."""
        fields: dict[str, Any] = {"content": e.content, "size": e.size, "digest": e.digest}
        recorded = self.admitted.budget.max_result_bytes
        if kinds.is_ok(e.status) and recorded is not None and e.size > recorded:
            fields[UNKEEPABLE] = True
        return fields


def _cancelled(event: ev.Event) -> bool:
    """True when the event records the run's cancellation (or what it did to a step or a
    call)."""
    match event:
        case ev.RunFinished():
            return kinds.is_cancelled(event.status)
        case ev.CallDecided():
            return kinds.is_skipped(event.decision) and event.reason == "cancelled"
        case ev.ModelStepFailed() | ev.CallSkipped():
            return event.reason == "cancelled"
        case _:
            return False
