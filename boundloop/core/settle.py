"""Resume (SPEC 6, SPEC 14): settle what a crash left open by the tools' own means, then
dispatch the calls a person approved (pure; part of ``decide``)."""

from __future__ import annotations

from typing import Any

from boundloop import events as ev
from boundloop.core import rules
from boundloop.core.effects import CallStart, Reconcile, StartCalls, Step, Validate
from boundloop.core.finish import JOURNAL_LOST, done, stamp, unavailable
from boundloop.core.inputs import AttemptsEnded, Reconciled, Tick, Validated
from boundloop.core.state import Instant, Machine
from boundloop.core.steps import (
    end_round,
    given,
    halt,
    journal_lost,
    link,
    next_round,
    now_of,
    record,
    record_round,
    then,
)

#: Who closes an approved call that cannot be sent (``CallResolved.by``).
RUNNER = "boundloop"


def settle(m: Machine, _: Tick, now: Instant) -> Step:
    """Resolve what a crash left open, by the tools' own means: reconcile, then retry an
    idempotent tool under the same key; anything else goes to a person."""
    st, tools = m.state, m.config.tools
    while m.to_settle:
        eid = m.to_settle.pop(0)
        rec = st.calls[eid]
        tool = tools.get(rec.tool)
        if tool is None:
            m.review.append(f"{rec.tool} {eid} (tool not given to resume)")
            continue
        m.settling, m.settle_attempt, m.settle_closed = eid, max(rec.attempt, 1), False
        # Arguments redacted in the journal cannot be sent again (SPEC 6).
        m.settle_retryable = tool.idempotent and not rec.redacted
        if tool.reconcile:
            m.stage = "settle_reconcile"
            return Step([], [Reconcile(eid)])
        return _settle_retry(m, Tick(), now)
    return _approved(m, now)


def _settle_reconciled(m: Machine, inp: Reconciled, now: Instant) -> Step:
    events = rules.reconciled(m.settling, m.settle_attempt, inp.took, inp.fields,
                              fields_of=given, now=now_of(m, now))
    if inp.took is True or (inp.took is False and not m.settle_retryable):
        return then(m, "settle", events)
    # Not taken: the call is closed as such unless a retry runs; nothing unknown is left.
    m.settle_closed = inp.took is False
    return then(m, "settle_retry", events)


def _settle_retry(m: Machine, _: Tick, now: Instant) -> Step:
    rec = m.state.calls[m.settling]
    if not m.settle_retryable:
        why = "its arguments were redacted" if rec.redacted else "it is not idempotent"
        m.review.append(f"{rec.tool} {rec.execution_id} ({why} and cannot be reconciled)")
        m.stage = "settle"
        return settle(m, Tick(), now)
    m.stage = "settle_validate"
    return Step([], [Validate([m.settling])])


def _settle_validated(m: Machine, inp: Validated, now: Instant) -> Step:
    st, budget, eid = m.state, m.config.budget, m.settling
    rec = st.calls[eid]
    if inp.invalid[0] is not None and not m.settle_closed:
        m.review.append(f"{rec.tool} {eid} (arguments no longer valid: {inp.invalid[0]})")
        m.stage = "settle"
        return settle(m, Tick(), now)
    if inp.invalid[0] is not None or st.tool_calls >= budget.max_tool_calls \
            or m.deadline_passed(now.mono):
        if m.settle_closed:
            # Reconcile said it did not take effect: closed as not taken, go on settling.
            m.stage = "settle"
            return settle(m, Tick(), now)
        return then(m, "settle", [ev.CallOutcomeUnknown(
            **stamp(m, now), execution_id=eid, attempt=m.settle_attempt,
            content="the call's outcome is unknown and no budget is left to retry it")])
    allowance = m.allowance = budget.max_tool_calls - st.tool_calls - 1
    link(m)
    m.stage = "settle_dispatch"
    return Step([], [StartCalls([CallStart(eid, rec.idempotency_key, rec.call_id, rec.tool,
                                           first_attempt=m.settle_attempt + 1)],
                                1, allowance, rec.step)])


def _settle_dispatched(m: Machine, inp: AttemptsEnded, now: Instant) -> Step:
    if journal_lost(inp):
        return done(m, unavailable(m, JOURNAL_LOST, False, now))
    events: list[ev.Event] = []
    for outcome in inp.outcomes:
        if outcome.skipped and m.state.calls[outcome.execution_id].stage == "not_taken":
            continue  # reconcile said it did not take effect, and no retry was dispatched
        if outcome.skipped:
            # Its retry's dispatch may be recorded already: name the last attempt.
            events.append(ev.CallOutcomeUnknown(
                **stamp(m, now), execution_id=outcome.execution_id,
                attempt=max(m.state.calls[outcome.execution_id].attempt, 1),
                content=f"the retry was not run: {outcome.skipped}"))
        else:
            events += record(m, outcome, now)
    return then(m, "settle", events)


def _approved(m: Machine, now: Instant) -> Step:
    """Dispatch the calls a person approved (SPEC 14): each attempt's CallDispatched is
    durable before it starts, as always."""
    st, tools = m.state, m.config.tools
    m.skipped = []
    m.approved_ids = [eid for eid in st.round_calls
                      if st.calls[eid].approved and st.calls[eid].attempt == 0
                      and st.calls[eid].stage == "intended"]
    asked = [eid for eid in m.approved_ids
             if st.calls[eid].tool in tools and not st.calls[eid].redacted]
    m.stage = "approved_validate"
    if asked:
        return Step([], [Validate(asked)])
    return _approved_validated(m, Validated([]), now)


def _approved_validated(m: Machine, inp: Validated, now: Instant) -> Step:
    st, tools = m.state, m.config.tools
    invalid = iter(inp.invalid)
    events: list[ev.Event] = []
    m.planned_calls = []
    for eid in m.approved_ids:
        rec = st.calls[eid]
        why = "tool not given to resume" if rec.tool not in tools else \
            "its arguments were redacted in the journal" if rec.redacted else None
        if why is None:
            wrong = next(invalid)
            if wrong is not None:
                why = f"arguments no longer valid: {wrong}"
        if why is not None:
            # It never ran and cannot be sent from here: closed as not done, in words the
            # model and the report show (a person approved it; nobody can send it).
            events.append(ev.CallResolved(**stamp(m, now), execution_id=eid,
                                          outcome="failed", by=RUNNER,
                                          note=f"approved, but not sent: {why}"))
            continue
        m.planned_calls.append(CallStart(eid, rec.idempotency_key, rec.call_id, rec.tool))
    if not m.planned_calls:
        return then(m, "approved_end", events)
    return then(m, "approved_go", events)


def _approved_go(m: Machine, _: Tick, now: Instant) -> Step:
    st = m.state
    allowance = m.allowance = m.config.budget.max_tool_calls - st.tool_calls
    link(m)
    m.stage = "approved_dispatch"
    return Step([], [StartCalls(list(m.planned_calls), m.config.budget.max_parallel,
                                allowance, st.model_steps)])


def _approved_dispatched(m: Machine, inp: AttemptsEnded, now: Instant) -> Step:
    if journal_lost(inp):
        return done(m, unavailable(m, JOURNAL_LOST, False, now))
    return then(m, "approved_end", record_round(m, inp.outcomes, now))


def _approved_end(m: Machine, _: Tick, now: Instant) -> Step:
    st, tools = m.state, m.config.tools
    m.review.extend(f"{p.tool} {p.execution_id}" for p in m.planned_calls
                    if tools[p.tool].irreversible
                    and st.calls[p.execution_id].status == "outcome_unknown")
    if m.review:
        return halt(m, rules.needs_review(m.review), now)
    if st.round_calls:
        return end_round(m, [], m.skipped, now)
    return next_round(m, now, [])


HANDLERS: dict[tuple[str, type], Any] = {
    ("settle", Tick): settle,
    ("settle_reconcile", Reconciled): _settle_reconciled,
    ("settle_retry", Tick): _settle_retry,
    ("settle_validate", Validated): _settle_validated,
    ("settle_dispatch", AttemptsEnded): _settle_dispatched,
    ("approved_validate", Validated): _approved_validated,
    ("approved_go", Tick): _approved_go,
    ("approved_dispatch", AttemptsEnded): _approved_dispatched,
    ("approved_end", Tick): _approved_end,
}
