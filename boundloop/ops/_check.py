"""Replaying a recorded run (``boundloop replay``): ``rebuild`` and ``check``.

The check (``check``) answers "would the *current* policy have decided what the recorded run
decided?", the way Temporal's Replayer reports non-determinism: it derives the run's inputs
(``core.inputs``) from its recorded events, feeds them to the same ``core.decide`` the
interpreter runs, at the recorded times, and compares the events each Step yields with the
recorded ones, reporting the first decision that differs. No model or tool is called, and no
executor is re-enacted.

``rebuild`` folds a run's events and compares the result with its RunFinished event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.core import effects as fx
from boundloop.core import inputs as fact
from boundloop.core import kinds
from boundloop.core.budget import (
    TOKEN_LIMITS,
    Budget,
    LedgerReply,
    Quote,
    TreeLeft,
    Usage,
    default_reservation,
    exceeded,
)
from boundloop.core.decide import NESTED_APPROVAL, decide
from boundloop.core.finish import outbox
from boundloop.core.replay import RunState, apply
from boundloop.core.rules import SkipReason
from boundloop.core.state import Instant, Machine
from boundloop.errors import (
    JournalCorrupt,
)
from boundloop.messages import Malformed
from boundloop.ops._events import event_name, event_type
from boundloop.ops._recorded import DECISIONS, Recording

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


#: The run tree's answer when the check settles a run with it: none is recorded, so the run
#: is held to its own budget (already the smaller of what it asked and what was left).
_TREE = LedgerReply(True, [], TreeLeft())
#: The interpreter's words for a model call it abandoned (``rules.model_replied``).
_ABANDONED: dict[str, SkipReason] = {
    "the model ran on past the deadline and was abandoned": "deadline",
    "the model call never started": "cancelled"}


#: How the run's explanation begins when the runner's estimator failed (``decide``).
_NOT_CALLED = "The model was not called"


def _says(event: ev.CallDecided | ev.ModelStepFailed | ev.CallSkipped, why: str) -> bool:
    """True when the event records a call skipped, or a model step failed, for ``why``."""
    if isinstance(event, ev.CallDecided):
        return kinds.is_skipped(event.decision) and event.reason == why
    return event.reason == why


class RecordedModelError(Exception):
    """Stands for the exception the model raised in the recorded run (kept for callers of
    ``boundloop.ops``: the check now feeds the recorded error text to ``decide``)."""


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


class _Stop(Exception):
    """The check ends here (a divergence, or the recording has no more to answer with)."""


class _Replayer:
    """Feeds the recording's inputs to ``decide`` and compares what it decides."""

    def __init__(self, events: Sequence[ev.Event], budget: Budget | None) -> None:
        self.rec = rec = Recording(events)
        self.note = rec.note
        self.recorded_budget = rec.admitted.budget
        self.budget = budget if budget is not None else rec.admitted.budget
        self.output_guess = next((e.reservation.output_tokens for _, e in rec.decisions
                                  if isinstance(e, ev.ModelStepStarted)), 0)
        self.pos = 0
        self.matched = 0
        self.divergence: Divergence | None = None
        self.t = 0.0
        #: When the next decision was made, if the recording says so exactly (a model reply).
        self.held: float | None = None
        self.machine = Machine(
            config=rec.config(self.budget), state=RunState(), deadline=self.budget.deadline_s,
            started=0.0, current=self.budget, caps=dict(rec.admitted.tool_caps),
            ledger_open=rec.admitted.parent_run_id is not None)

    # -- the recording's cursor ----------------------------------------------------------
    def upcoming(self) -> tuple[int, ev.Event] | None:
        return self.rec.decisions[self.pos] if self.pos < len(self.rec.decisions) else None

    def time_of(self, event: ev.Event) -> float:
        """When the recorded run made its check for ``event``: its elapsed time, kept just
        under the recorded deadline unless the event says the deadline had passed."""
        t = event.elapsed_s
        deadline = self.recorded_budget.deadline_s
        passed = (isinstance(event, ev.RunFinished) and kinds.is_deadline(event.exhausted_limit)) \
            or (isinstance(event, ev.CallDecided | ev.ModelStepFailed)
                and _says(event, "deadline"))
        if deadline is not None and not passed:
            t = min(t, math.nextafter(deadline, -math.inf))
        return t

    def now(self) -> Instant:
        """The instant of the next decision: when the recorded run made it (its model reply's
        event, else its next recorded decision; time never runs backwards), and whether it
        was cancelled by then (its first event that says so)."""
        nxt, t = self.upcoming(), self.t
        if self.held is not None:
            # The reply's event is stamped when the run decided on it; the decisions before
            # it (which made no event) were only placed no later than the next decision.
            t, self.held = self.held, None
        elif nxt is not None:
            t = self.t = max(self.t, self.time_of(nxt[1]))
        at = self.rec.cancelled_at
        cancelled = at is not None and t >= at
        return Instant(self.rec.admitted.ts - self.rec.admitted.elapsed_s + t, t,
                       cancelled, "as recorded" if cancelled else "")

    def stop(self, note: str) -> _Stop:
        self.note = "; ".join(n for n in (self.note, note) if n)
        return _Stop()

    def ends_here(self, where: str) -> _Stop:
        """The recording has nothing more to answer with (a crash, or the horizon)."""
        if self.note:  # the horizon note already says where and why
            return _Stop()
        return self.stop(f"the recording ends {where} before the run finished; every "
                         "recorded decision matched")

    # -- comparing -----------------------------------------------------------------------
    def expect(self, current: ev.Event) -> None:
        """Compare one decision of the current policy with the next recorded one."""
        nxt = self.upcoming()
        if nxt is None:
            if self.rec.finished:
                self.divergence = Divergence(seq=None, step=_step(current),
                                             recorded="nothing more (the run had finished)",
                                             current=describe(current))
                raise _Stop
            raise self.ends_here(f"at seq {len(self.rec.events)}")
        seq, recorded = nxt
        if isinstance(recorded, ev.RunFinished) \
                and kinds.is_journal_unavailable(recorded.status):
            # Whether the journal could record, or the lease held, is not recorded.
            raise self.stop(f"the journal failed before seq {seq} and nothing after that was "
                            "recorded; every recorded decision before it matched")
        if _key(recorded) != _key(current):
            self.divergence = Divergence(seq=seq, step=_step(recorded),
                                         recorded=describe(recorded), current=describe(current))
            raise _Stop
        self.pos += 1
        self.matched += 1

    def result(self, event: ev.CallSucceeded) -> None:
        """A result's status (``too_large``) is decided again under the budget checked."""
        found = self.rec.results.get((event.execution_id, event.attempt))
        if found is None or found[1].status == event.status:
            return
        seq, recorded = found
        rec = self.rec.by_eid.get(event.execution_id)
        what = f"call {rec.call_id} ({rec.tool}) result" if rec else "call result"
        self.divergence = Divergence(
            seq=seq, step=rec.step if rec else 0,
            recorded=f"{what} {recorded.status} ({recorded.size} bytes)",
            current=f"{what} {event.status}")
        raise _Stop

    def feed(self, inp: fact.Input) -> fx.Step:
        """One decision: its events compared with the recording, then folded and queued as
        the interpreter does."""
        m = self.machine
        step = decide(m, inp, self.now())
        for event in step.events:
            if isinstance(event, DECISIONS):
                self.expect(event)
            elif isinstance(event, ev.CallSucceeded):
                self.result(event)
            apply(m.state, event)
            m.pending.append(event)
        return step

    # -- inputs derived from the recording -----------------------------------------------
    def answer(self, effect: fx.Effect) -> fact.Input:
        m = self.machine
        match effect:
            case fx.Commit():
                outbox(m)
                return fact.Committed()
            case fx.ChargeTree():
                return fact.TreeReplied(_TREE)
            case fx.Estimate():
                return self.estimated()
            case fx.InvokeModel():
                return self.replied(effect.step)
            case fx.CheckCalls():
                return self.checked()
            case fx.AskApproval():
                batch = m.batch
                assert batch is not None
                answers = []
                for i in effect.indexes:
                    d = self.rec.decided.get((m.step, batch.calls[i].id))
                    answers.append(bool(d and (d.approval or d.reason == NESTED_APPROVAL)))
                return fact.ApprovalsRuled(answers)
            case fx.StartCalls():
                return self.dispatched(effect)
        raise self.stop(f"not checkable from seq {self.upcoming_seq()}: the current policy "
                        f"asked for {type(effect).__name__}, which a recording cannot answer")

    def upcoming_seq(self) -> int:
        nxt = self.upcoming()
        return nxt[0] if nxt is not None else len(self.rec.events)

    def estimated(self) -> fact.Input:
        """The recorded reservation of the step about to start; a step that never started
        kept none: the interpreter's default estimate stands in, when it gives the recorded
        decision under the recorded budget."""
        m, nxt = self.machine, self.upcoming()
        if nxt is None:
            raise self.ends_here(f"at seq {len(self.rec.events)}")
        seq, event = nxt
        if isinstance(event, ev.ModelStepStarted):
            return fact.Estimated(event.reservation)
        size = len(_json.encode(m.state.transcript))
        estimate = default_reservation(size, self.output_guess)
        if isinstance(event, ev.RunFinished) and kinds.is_limit_exceeded(event.status) \
                and event.exhausted_limit in TOKEN_LIMITS \
                and exceeded(self.recorded_budget, m.state.usage + estimate) \
                != event.exhausted_limit:
            raise self.stop(
                f"not checkable at seq {seq}: the run stopped before model step "
                f"{m.state.model_steps + 1} on its reservation, which was not recorded (the "
                "runner's estimator, or the model's output maximum); every recorded decision "
                "before it matched")
        if isinstance(event, ev.RunFinished) and _NOT_CALLED in event.explanation:
            return fact.Estimated(failed="the runner's estimator failed (as recorded)")
        return fact.Estimated(estimate)

    def replied(self, step: int) -> fact.Input:
        recorded = self.rec.replies.get(step)
        if recorded is None:
            raise self.ends_here(f"at seq {len(self.rec.events)}, with no answer of the "
                                 f"model to step {step},")
        self.held = self.time_of(recorded)
        charged = self.rec.charged.get(step)
        reported = charged.usage if charged is not None and not charged.estimated else None
        quote = Quote(charged.usage.cost, charged.unpriced) \
            if self.rec.catalogue and reported is not None and charged is not None else None
        latency = recorded.latency_s
        if isinstance(recorded, ev.ModelStepCompleted):
            response: Any = recorded.response
            if reported is not None:
                response = msgspec.structs.replace(response, usage=reported)
            return fact.ModelReplied(response, latency_s=latency, quote=quote)
        abandoned = _ABANDONED.get(recorded.detail)
        if recorded.reason in ("deadline", "cancelled") and abandoned is not None:
            return fact.ModelReplied(latency_s=latency, abandoned=abandoned)
        if recorded.reason in ("error", "deadline"):
            return fact.ModelReplied(error=recorded.detail, latency_s=latency)
        if recorded.reason == "cancelled":  # seen after the response, which was discarded
            return fact.ModelReplied(latency_s=latency)
        # A turn the adapter cut on a spent limit is not marked so in the journal: one whose
        # reported usage ended the run there (its next decision) was.
        nxt = self.upcoming()
        cut = nxt[1].exhausted_limit if nxt is not None and reported is not None \
            and isinstance(nxt[1], ev.RunFinished) and nxt[1].model_steps == step else None
        return fact.ModelReplied(Malformed(reason=recorded.detail, usage=reported, limit=cut),
                                 latency_s=latency, quote=quote)

    def checked(self) -> fact.Input:
        """The permission check's verdicts and the validation, as recorded."""
        m = self.machine
        batch = m.batch
        assert batch is not None
        verdicts: list[fact.Verdict] = []
        invalid: list[str | None] = []
        for call in batch.calls:
            d = self.rec.decided.get((m.step, call.id))
            denied = d is not None and kinds.is_denied(d.decision)
            verdicts.append((d.reason or False) if denied and d is not None else True)
            invalid.append((d.reason or "invalid arguments (as recorded)")
                           if d is not None and kinds.has_invalid_arguments(d.decision)
                           else None)
        return fact.CallsChecked(verdicts, [c.arguments for c in batch.calls], invalid)

    def dispatched(self, effect: fx.StartCalls) -> fact.Input:
        """The calls' recorded attempts: each attempt that started after its round made its
        CallDispatched durable first, in the order the recording has them."""
        m = self.machine
        starts = {c.execution_id: c for c in effect.calls}
        for d in self.rec.dispatched:
            c = starts.get(d.execution_id)
            if c is None or d.attempt < c.first_attempt \
                    or (c.recorded and d.attempt == c.first_attempt):
                continue
            done, _ = self.rec.attempts(d.execution_id)
            self.feed(fact.AttemptStarting(d.execution_id, d.attempt,
                                           [a for a in done if a.attempt < d.attempt]))
            outbox(m)
        ended = []
        for c in effect.calls:
            done, skipped = self.rec.attempts(c.execution_id)
            ended.append(fact.Ended(c.execution_id, done, skipped))
        return fact.AttemptsEnded(ended)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> CheckReport:
        inp: fact.Input = fact.Tick()
        try:
            while True:
                step = self.feed(inp)
                if not step.effects:
                    inp = fact.Tick()
                    continue
                effect = step.effects[0]
                if isinstance(effect, fx.Finish):
                    break
                inp = self.answer(effect)
        except _Stop:
            pass
        return CheckReport(run_id=self.rec.admitted.run_id, ok=self.divergence is None,
                           decisions=self.matched, divergence=self.divergence,
                           budget=self.budget, note=self.note)


def check(events: Sequence[ev.Event], budget: Budget | None = None) -> CheckReport:
    """Feed a recorded run's inputs to the current ``core.decide`` and report the first
    decision that differs (a Replayer, as Temporal's): no model or tool is called.

    The inputs are derived from the events: each model step's reservation
    (ModelStepStarted), reply and reported usage (ModelStepCompleted/Failed,
    UsageCharged), each call's permission verdict, validation and approval (its
    CallDecided), each attempt's outcome (CallDispatched, CallSucceeded, CallFailed,
    CallTimedOut, CallOutcomeUnknown, CallReconciled, CallSkipped); each decision is made
    at the time the recording places it, cancelled from the first event that says the run
    was, and every commit succeeds. The decisions compared are each model step's start (and
    whether tools were allowed), each call's decision, and how the run finished (status,
    limit, counters), plus each result's status (``too_large``); the other events each Step
    yields are folded, as the interpreter folds them, but not compared (a journal written
    before the first dispatch rode the decisions' commit orders them differently).

    Taken as recorded, since no event keeps what decided them: the permission check's
    verdicts, the tools' validation and approval rules (user code: a recorded ``denied`` or
    ``invalid_arguments`` is fed back as the verdict), whether a failed attempt was
    retried (the tool's retry settings), the run tree's answers to a child run (it is held
    to its own budget), the journal's and the lease's state (a run that ended
    ``journal_unavailable`` is checked up to there). What cannot be derived at all ends the
    check with a note saying "not checkable": the reservation of a step that never started
    when it is what stopped the run and the default estimate does not reproduce that.

    Args:
        events: the run's events, oldest first.
        budget: the budget to check under (default: the recorded one), e.g. a lower
            ``max_tool_calls`` to ask whether it would have changed past decisions.

    Raises:
        JournalCorrupt: the events do not start with RunAdmitted.
    """
    return _Replayer(list(events), budget).run()
