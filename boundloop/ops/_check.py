"""Replaying a recorded run (``boundloop replay``): ``rebuild`` and ``check``.

The check (``check``) answers "would the *current* policy have decided what the recorded run
decided?", the way Temporal's Replayer reports non-determinism: it drives ``loop.drive`` with
a RunSpec rebuilt from the run's ``RunAdmitted`` event and answers every effect from the
recording (no model or tool is called), then compares the decisions the current policy makes
with the recorded ones and reports the first that differs.

``rebuild`` folds a run's events and compares the result with its RunFinished event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.context import ModelContext
from boundloop.core import kinds
from boundloop.core.budget import (
    TOKEN_LIMITS,
    Budget,
    LedgerReply,
    TreeLeft,
    Usage,
    default_reservation,
    exceeded,
)
from boundloop.core.replay import RunState, apply, replay
from boundloop.errors import (
    JournalCorrupt,
)
from boundloop.messages import Message, ToolCall
from boundloop.ops._events import event_name, event_type
from boundloop.tools import ArgumentError, Tool

_json = msgspec.json.Encoder()


# -- replay ------------------------------------------------------------------------------
class Rebuilt(msgspec.Struct, kw_only=True):
    """A run's state rebuilt by the fold, and whether it agrees with its RunFinished event.

    ``finished_seq`` is the sequence number of the RunFinished event checked against (None
    when the run has not finished); ``mismatches`` says what disagrees (empty: consistent).
    """

    state: RunState
    finished_seq: int | None
    mismatches: list[str]

    @property
    def consistent(self) -> bool:
        """True when the fold agrees with the recorded RunFinished (or there is none)."""
        return not self.mismatches


def rebuild(events: Iterable[ev.Event]) -> Rebuilt:
    """Fold the events into the run's state and compare it with the last RunFinished event.

    Raises:
        ReplayError: the events do not make a run.
    """
    state = RunState()
    last: tuple[int, ev.RunFinished] | None = None
    for seq, event in enumerate(events, 1):
        apply(state, event)
        if isinstance(event, ev.RunFinished):
            last = (seq, event)
    if not state.finished or last is None:
        return Rebuilt(state=state, finished_seq=None, mismatches=[])
    seq, fin = last
    mismatches = [f"{name}: the fold gives {mine!r}, RunFinished (seq {seq}) says {theirs!r}"
                  for name, mine, theirs in (
                      ("status", state.status, fin.status),
                      ("exhausted_limit", state.exhausted_limit, fin.exhausted_limit),
                      ("model_steps", state.model_steps, fin.model_steps),
                      ("tool_calls", state.tool_calls, fin.tool_calls),
                      ("usage", state.usage, fin.usage))
                  # A RunFinished written before it carried usage decodes with an empty one.
                  if mine != theirs and not (name == "usage" and theirs == Usage())]
    return Rebuilt(state=state, finished_seq=seq, mismatches=mismatches)


# -- check -------------------------------------------------------------------------------
class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """The first decision of the current policy that differs from the recorded one.

    ``seq`` is the recorded event's sequence number (None when the recording has no
    decision there) and ``step`` its model step.
    """

    seq: int | None
    step: int
    recorded: str
    current: str

    def __str__(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else "after the last event"
        return (f"step {self.step}, {where}: recorded {self.recorded}; "
                f"the current policy: {self.current}")


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``check`` found: ``ok`` when every recorded decision was made again.

    ``decisions`` counts the decisions compared and found equal; ``note`` says where the
    check stopped short of the end of the run, and why.
    """

    run_id: str
    ok: bool
    decisions: int
    divergence: Divergence | None
    budget: Budget
    note: str = ""


def recorded_budget(events: Sequence[ev.Event]) -> Budget:
    """The budget the run was admitted with.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """
    if not events or not isinstance(events[0], ev.RunAdmitted):
        raise JournalCorrupt("the run's events do not start with RunAdmitted")
    return events[0].budget


_DECISIONS = (ev.ModelStepStarted, ev.CallDecided, ev.RunFinished)
#: Where a check stops following the recording: after these, decisions depend on recovery,
#: a person, or child runs, none of which the check re-enacts.
_HORIZON = (ev.OwnerClaimed, ev.RunResumed, ev.CallResolved, ev.ChildCharged)
_STOP = object()
_MALFORMED = object()


class _ReplayClock(Clock):
    """Time as the recording saw it: ``now`` is seconds since the run started."""

    def __init__(self, wall0: float) -> None:
        self.now = 0.0
        self.wall0 = wall0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall0 + self.now


class RecordedModelError(Exception):
    """Stands for the exception the model raised in the recorded run."""


class _StandIn(Tool):
    """A tool known only by name: accepts any arguments unless the recording says otherwise."""

    def __init__(self, name: str, flags: ev.CallDecided | None, checker: _Checker) -> None:
        super().__init__(name, _no_handler, timeout_s=None,
                         read_only=bool(flags and flags.read_only),
                         idempotent=bool(flags and flags.idempotent),
                         irreversible=bool(flags and flags.irreversible and not flags.read_only))
        self._checker = checker

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # The loop validates each call in order right before its deadline check: set the
        # clock and cancellation as the recorded run saw them for this call.
        recorded = self._checker.recorded_for.pop(id(arguments), None)
        if recorded is not None:
            checker = self._checker
            checker.clock.now = max(checker.clock.now, checker.time_of(recorded))
            if kinds.is_skipped(recorded.decision) and recorded.reason == "cancelled":
                checker.cancel.cancel("as recorded")
            if kinds.has_invalid_arguments(recorded.decision):
                raise ArgumentError(recorded.reason or "invalid arguments (as recorded)")
        return dict(arguments)


def _no_handler() -> None:
    """Never called: the check answers dispatches from the recording."""


def _key(event: ev.Event) -> tuple[Any, ...]:
    match event:
        case ev.ModelStepStarted():
            return ("model", event.step, event.tools_allowed)
        case ev.CallDecided():
            return ("call", event.step, event.index, event.call_id, event.tool, event.decision)
        case ev.RunFinished():
            return ("finish", event.status, event.exhausted_limit, event.model_steps,
                    event.tool_calls)
        case _:
            return (event_type(event),)


def _step(event: ev.Event) -> int:
    match event:
        case ev.ModelStepStarted() | ev.CallDecided():
            return event.step
        case ev.RunFinished():
            return event.model_steps
        case _:
            return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def describe(event: ev.Event) -> str:
    """A decision event in a few words (what ``check`` reports)."""
    match event:
        case ev.ModelStepStarted():
            allowed = "tools allowed" if event.tools_allowed else "tools not allowed"
            return f"model step {event.step} starts ({allowed})"
        case ev.CallDecided():
            why = f" ({event.reason})" \
                if event.reason and not kinds.is_allowed(event.decision) else ""
            return (f"call {event.call_id} ({event.tool}) at step {event.step}: "
                    f"{event.decision}{why}")
        case ev.RunFinished():
            limit = f" ({event.exhausted_limit})" if event.exhausted_limit else ""
            return (f"the run finishes {event.status}{limit} after "
                    f"{_count(event.model_steps, 'model step')} and "
                    f"{_count(event.tool_calls, 'tool call')}")
        case _:
            return event_name(event)


def _tripping(budget: Budget, used: Usage, limit: str) -> Usage:
    """The smallest reservation that takes ``used`` over ``limit`` (and over no limit that is
    checked before it): stands for a reservation the recording did not keep."""
    def room(cap: float | None, spent: float) -> float:
        return math.inf if cap is None else max(cap - spent, 0)

    if limit == "input_tokens" and budget.max_input_tokens is not None:
        return Usage(input_tokens=int(room(budget.max_input_tokens, used.all_input_tokens)) + 1)
    if limit == "output_tokens" and budget.max_output_tokens is not None:
        return Usage(output_tokens=int(room(budget.max_output_tokens, used.output_tokens)) + 1)
    if limit == "total_tokens" and budget.max_total_tokens is not None:
        need = int(room(budget.max_total_tokens, used.total_tokens)) + 1
        take_in = int(min(need, room(budget.max_input_tokens, used.all_input_tokens)))
        return Usage(input_tokens=take_in, output_tokens=need - take_in)
    if limit == "cost" and budget.max_cost is not None:
        gap = room(budget.max_cost, used.cost or 0.0)
        return Usage(cost=gap + max(budget.max_cost, 1.0) * 1e-9)
    return Usage()


class _Checker:
    def __init__(self, events: Sequence[ev.Event], budget: Budget | None) -> None:
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
            if isinstance(event, ev.RunResumed) or (isinstance(event, _HORIZON) and not finished):
                cut = i
                self.note = (f"checked up to seq {i}: at seq {i + 1} ({event_name(event)}) the "
                             "run was taken over by recovery, a person or a child run, which "
                             "the check does not re-enact")
                break
        self.recording = list(events[:cut])
        self.finished = any(isinstance(e, ev.RunFinished) for e in self.recording)
        self.decisions = [(seq, e) for seq, e in enumerate(self.recording, 1)
                          if isinstance(e, _DECISIONS)]
        self.responses: dict[int, ev.ModelStepCompleted | ev.ModelStepFailed] = {}
        self.charged: dict[int, Usage] = {}
        self.decided: dict[tuple[int, str], ev.CallDecided] = {}
        self.outcomes: dict[str, list[ev.Event]] = {}
        self.results: dict[tuple[str, int], tuple[int, ev.CallSucceeded]] = {}
        flags: dict[str, ev.CallDecided] = {}
        for seq, e in enumerate(self.recording, 1):
            match e:
                case ev.ModelStepCompleted() | ev.ModelStepFailed():
                    self.responses[e.step] = e
                case ev.UsageCharged(estimated=False):
                    self.charged[e.step] = e.usage
                case ev.CallDecided():
                    self.decided[(e.step, e.call_id)] = e
                    flags.setdefault(e.tool, e)
                case ev.CallSucceeded():
                    self.results[(e.execution_id, e.attempt)] = (seq, e)
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case (ev.CallDispatched() | ev.CallFailed() | ev.CallTimedOut()
                      | ev.CallOutcomeUnknown() | ev.CallReconciled() | ev.CallSkipped()):
                    self.outcomes.setdefault(e.execution_id, []).append(e)
                case _:
                    pass
        self.recorded_budget = admitted.budget
        self.budget = budget if budget is not None else admitted.budget
        self.output_guess = next((e.reservation.output_tokens for _, e in self.decisions
                                  if isinstance(e, ev.ModelStepStarted)), 0)
        self.pos = 0
        self.matched = 0
        self.divergence: Divergence | None = None
        self.recorded_for: dict[int, ev.CallDecided] = {}
        self.cancel = CancelToken()
        self.clock = _ReplayClock(admitted.ts)
        self.tools = {name: _StandIn(name, flags.get(name), self) for name in admitted.tools}

    # -- the recording's cursor ----------------------------------------------------------
    def upcoming(self) -> tuple[int, ev.Event] | None:
        return self.decisions[self.pos] if self.pos < len(self.decisions) else None

    def time_of(self, event: ev.Event) -> float:
        """When the recorded run made its check for ``event``: its elapsed time, kept just
        under the recorded deadline unless the event says the deadline had passed."""
        t = event.elapsed_s
        deadline = self.recorded_budget.deadline_s
        passed = (isinstance(event, ev.RunFinished) and kinds.is_deadline(event.exhausted_limit)) \
            or (isinstance(event, ev.CallDecided) and kinds.is_skipped(event.decision)
                and event.reason == "deadline")
        if deadline is not None and not passed:
            t = min(t, math.nextafter(deadline, -math.inf))
        return t

    def sync(self) -> None:
        """Set the clock and the cancel token as the recorded run saw them next."""
        nxt = self.upcoming()
        if nxt is None:
            return
        event = nxt[1]
        self.clock.now = max(self.clock.now, self.time_of(event))
        if isinstance(event, ev.RunFinished) and kinds.is_cancelled(event.status):
            self.cancel.cancel("as recorded")

    def end(self, note: str) -> object:
        self.note = "; ".join(n for n in (self.note, note) if n)
        return _STOP

    def ends_here(self, where: str) -> object:
        """The recording has nothing more to answer with (a crash, or the horizon)."""
        if self.note:  # the horizon note already says where and why
            return _STOP
        return self.end(f"the recording ends {where} before the run finished; every recorded "
                        "decision matched")

    def expect(self, current: ev.Event) -> bool:
        """Compare one decision of the current policy with the next recorded one."""
        nxt = self.upcoming()
        if nxt is None:
            if self.finished:
                self.divergence = Divergence(seq=None, step=_step(current),
                                             recorded="nothing more (the run had finished)",
                                             current=describe(current))
            else:
                self.ends_here(f"at seq {len(self.recording)}")
            return False
        seq, recorded = nxt
        if isinstance(recorded, ev.RunFinished) \
                and kinds.is_journal_unavailable(recorded.status):
            self.end(f"the journal failed before seq {seq} and nothing after that was "
                     "recorded; every recorded decision before it matched")
            return False
        if _key(recorded) != _key(current):
            self.divergence = Divergence(seq=seq, step=_step(recorded),
                                         recorded=describe(recorded), current=describe(current))
            return False
        self.pos += 1
        self.matched += 1
        self.sync()
        return True

    # -- inputs the current policy asks for ----------------------------------------------
    def estimate(self, history: list[Message], model: Any) -> Usage:
        """The recorded reservation of the step about to start."""
        nxt = self.upcoming()
        if nxt is not None and isinstance(nxt[1], ev.ModelStepStarted):
            return nxt[1].reservation
        estimate = default_reservation(len(_json.encode(history)), self.output_guess)
        if nxt is not None and isinstance(nxt[1], ev.RunFinished) \
                and kinds.is_limit_exceeded(nxt[1].status) \
                and nxt[1].exhausted_limit in TOKEN_LIMITS:
            # The recorded run stopped before this step: its reservation went over the limit
            # but was not kept. Use the default estimate when it agrees, else the least that
            # does.
            limit = nxt[1].exhausted_limit or ""
            used = replay(self.recording[:nxt[0] - 1]).usage
            if exceeded(self.recorded_budget, used + estimate) != limit:
                return _tripping(self.recorded_budget, used, limit)
        return estimate

    def permit(self, call: ToolCall, tool: Tool, ctx: ModelContext) -> Any:
        """Feeds the recorded decision of this call: a denial here; invalid arguments, the
        clock and cancellation through the stand-in's ``validate`` (keyed by the call's
        arguments object, which the loop hands to both)."""
        recorded = self.decided.get((ctx.step, call.id))
        if recorded is None:
            return True
        self.recorded_for[id(call.arguments)] = recorded
        if kinds.is_denied(recorded.decision):
            return recorded.reason or "denied (as recorded)"
        return True

    def model_reply(self, ctx: ModelContext) -> Any:
        from boundloop.loop import ModelReply

        started = ev.ModelStepStarted(run_id=self.admitted.run_id, step=ctx.step,
                                      tools_allowed=ctx.tools_allowed, reservation=Usage())
        if not self.expect(started):
            return _STOP
        recorded = self.responses.get(ctx.step)
        if recorded is None:
            return self.ends_here(f"at seq {len(self.recording)}, with no answer of the "
                                  f"model to step {ctx.step},")
        if isinstance(recorded, ev.ModelStepCompleted):
            response: Any = recorded.response
            if ctx.step in self.charged:
                response = msgspec.structs.replace(response, usage=self.charged[ctx.step])
            return ModelReply(response, None, recorded.latency_s)
        if recorded.reason == "error":
            return ModelReply(None, RecordedModelError(recorded.detail), recorded.latency_s)
        if recorded.reason == "cancelled":
            self.cancel.cancel("as recorded")
            return ModelReply(None, None, recorded.latency_s)
        return ModelReply(_MALFORMED, None, recorded.latency_s)

    def outcome(self, execution_id: str) -> Any:
        from boundloop.loop import Attempt, Outcome

        out = Outcome(execution_id)
        for e in self.outcomes.get(execution_id, []):
            last = out.attempts[-1] if out.attempts else None
            match e:
                case ev.CallSkipped():
                    out.skipped = e.reason
                case ev.CallSucceeded():
                    value: Any = e.content
                    if kinds.is_too_large(e.status):
                        value = "x" * max(e.size - 2, 0)  # as many JSON bytes as the result
                    out.attempts.append(Attempt(e.attempt, "ok", value, latency_s=e.latency_s))
                case ev.CallFailed():
                    out.attempts.append(Attempt(e.attempt, "error", error=e.content,
                                                category=e.error_category,
                                                latency_s=e.latency_s))
                case ev.CallTimedOut():
                    out.attempts.append(Attempt(e.attempt, "timeout", latency_s=e.latency_s,
                                                timeout_s=e.timeout_s))
                case ev.CallReconciled() if last is not None:
                    last.reconciled = e.took_effect
                    last.reconciled_value = e.content
                case ev.CallOutcomeUnknown() if last is not None:
                    last.error = e.content
                case _:
                    pass
        return out

    def committed(self, events: Sequence[ev.Event]) -> object:
        for event in events:
            if isinstance(event, ev.CallDecided | ev.RunFinished):
                if not self.expect(event):
                    return _STOP
            elif isinstance(event, ev.CallSucceeded):
                found = self.results.get((event.execution_id, event.attempt))
                if found is not None and found[1].status != event.status:
                    seq, recorded = found
                    rec = self.decided_by_eid(event.execution_id)
                    what = f"call {rec.call_id} ({rec.tool}) result" if rec else "call result"
                    self.divergence = Divergence(
                        seq=seq, step=rec.step if rec else 0,
                        recorded=f"{what} {recorded.status} ({recorded.size} bytes)",
                        current=f"{what} {event.status}")
                    return _STOP
        return None

    def decided_by_eid(self, execution_id: str) -> ev.CallDecided | None:
        return next((d for d in self.decided.values() if d.execution_id == execution_id), None)

    # -- the drive -----------------------------------------------------------------------
    def run(self) -> CheckReport:
        from boundloop import loop

        spec = loop.RunSpec(
            run_id=self.admitted.run_id, model=_no_handler, tools=dict(self.tools),
            budget=self.budget, history=list(self.admitted.history), cancel=self.cancel,
            secret_key=b"boundloop-check", clock=self.clock, owner=self.admitted.owner,
            permit=self.permit, estimator=self.estimate,
            parent_run_id=self.admitted.parent_run_id, parent_step=self.admitted.parent_step,
            parent_execution_id=self.admitted.parent_execution_id)
        driver = loop.Driver(spec)
        gen = driver.run()
        self.sync()
        reply: Any = None
        try:
            while True:
                try:
                    effect = gen.send(reply)
                except StopIteration:
                    break
                if isinstance(effect, loop.Commit):
                    reply = self.committed(effect.events)
                elif isinstance(effect, loop.InvokeModel):
                    reply = self.model_reply(effect.ctx)
                elif isinstance(effect, loop.Dispatch):
                    reply = [self.outcome(p.execution_id) for p in effect.calls]
                    for p, out in zip(effect.calls, reply, strict=True):
                        # As the executor does: an attempt that did not ride its round's
                        # commit has its dispatch recorded before it starts.
                        done = p.first_attempt if p.recorded else p.first_attempt - 1
                        for i, att in enumerate(out.attempts):
                            if att.attempt > done:
                                driver.attempt_events(p.execution_id, att.attempt,
                                                      out.attempts[:i])
                                done = att.attempt
                elif isinstance(effect, loop.CallUser):
                    # The check's own estimator and permit stand-ins: call them in place.
                    try:
                        reply = loop.ModelReply(effect.fn(*effect.args))
                    except Exception as exc:  # noqa: BLE001 - delivered as the reply
                        reply = loop.ModelReply(None, exc)
                elif isinstance(effect, loop.Ledger):
                    # A child run settling with its tree: its own budget (already the smaller
                    # of what it asked and what was left) is what the check holds it to.
                    reply = LedgerReply(True, [], TreeLeft())
                else:
                    reply = self.end(f"the current loop asked for {type(effect).__name__}, "
                                     "which a recording cannot answer")
                if reply is _STOP:
                    break
        finally:
            gen.close()
        return CheckReport(run_id=self.admitted.run_id, ok=self.divergence is None,
                           decisions=self.matched, divergence=self.divergence,
                           budget=self.budget, note=self.note)


def check(events: Sequence[ev.Event], budget: Budget | None = None) -> CheckReport:
    """Re-run the current policy over a recorded run and report the first decision that
    differs (a Replayer): no model or tool is called.

    The run is driven by ``loop.drive`` with a RunSpec rebuilt from its RunAdmitted event.
    Model steps are answered with the recorded responses (and reported usage), dispatches
    with the recorded outcomes; time and cancellation follow the recording; recorded
    ``denied``, ``invalid_arguments`` and ``unknown_tool`` decisions are taken as given (the
    tools are stand-ins known by name). The decisions compared are each model step's start
    (and whether tools were allowed), each call's decision, and how the run finished
    (status, limit, counters), plus each result's status (``too_large``).

    Args:
        events: the run's events, oldest first.
        budget: the budget to check under (default: the recorded one), e.g. a lower
            ``max_tool_calls`` to ask whether it would have changed past decisions.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """
    return _Checker(list(events), budget).run()
