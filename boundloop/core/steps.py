"""The moves every part of ``decide`` shares: go on after a fold, stop, close a round,
record what attempts left, note the run's spend for its ledger (pure)."""

from __future__ import annotations

from typing import Any

from boundloop import events as ev
from boundloop.core import rules
from boundloop.core.budget import sub_counts
from boundloop.core.effects import Step
from boundloop.core.finish import finish, stamp
from boundloop.core.inputs import AttemptsEnded, Ended
from boundloop.core.rules import Stop
from boundloop.core.state import Instant, Machine


def then(m: Machine, stage: Any, events: list[ev.Event]) -> Step:
    """Fold ``events``, then go on at ``stage`` (on the Tick that follows)."""
    m.stage = stage
    return Step(events)


def halt(m: Machine, why: Stop, now: Instant, events: list[ev.Event] | None = None) -> Step:
    """End the run with ``why`` (after folding ``events``, if any)."""
    m.stop = why
    if events:
        return then(m, "finish", events)
    m.stage = "finish"
    return finish(m, now)


def next_round(m: Machine, now: Instant, events: list[ev.Event]) -> Step:
    return then(m, "round", events)


def end_round(m: Machine, review: list[str], skipped: list[str], now: Instant) -> Step:
    """Close the round (SPEC 5.11), or end the run's turn while calls of it wait for a
    person (SPEC 14); calls that wait are skipped when the round cannot go on anyway."""
    st, cancelled, passed = m.state, now.cancelled, m.deadline_passed(now.mono)
    held = rules.held_calls(st)
    if held and not review and not skipped and not cancelled and not passed:
        asked, waiting = rules.awaiting_approval(st, now_of(m, now))
        return halt(m, waiting, now, asked)
    events: list[ev.Event] = []
    for eid in held:
        why = "cancelled" if cancelled else "deadline" if passed else \
            "the round ended before a person decided"
        events.append(ev.CallSkipped(**stamp(m, now), execution_id=eid, reason=why))
        skipped.append("cancelled" if cancelled else "deadline")
    ended, stop = rules.round_ended(st, review=review, skipped=skipped, cancelled=cancelled,
                                    now=now_of(m, now))
    events += ended
    if stop is not None:
        return halt(m, stop, now, events)
    return next_round(m, now, events)


# -- what attempts leave -------------------------------------------------------------------
def given(fields: Any) -> dict[str, Any]:
    """An attempt's result as the interpreter made it journal fields (content, size, keyed
    digest, and whether it could be recorded at all)."""
    return dict(fields)


def record(m: Machine, outcome: Ended, now: Instant) -> list[ev.Event]:
    """What became of a call, from the attempts not recorded yet."""
    eid = outcome.execution_id
    if outcome.skipped:
        return [ev.CallSkipped(**stamp(m, now), execution_id=eid, reason=outcome.skipped)]
    return attempts(m, eid, outcome.attempts, True, now)


def record_round(m: Machine, outcomes: list[Ended], now: Instant) -> list[ev.Event]:
    """What became of a round's calls; why those kept from running were kept is noted for
    the round's end."""
    events: list[ev.Event] = []
    for outcome in outcomes:
        events += record(m, outcome, now)
        if outcome.skipped:
            m.skipped.append(outcome.skipped)
    return events


def attempts(m: Machine, eid: str, attempts: list[rules.Attempt], final: bool,
              now: Instant) -> list[ev.Event]:
    done = m.attempts_recorded.get(eid, 0)
    # An earlier attempt may have taken effect (this run, or before a crash).
    doubt = eid in m.unknown or m.state.calls[eid].doubt
    events, doubt = rules.attempt_outcomes(eid, attempts[done:], final=final, doubt=doubt,
                                           fields_of=given,
                                           limit=m.config.budget.max_result_bytes,
                                           now=now_of(m, now))
    m.attempts_recorded[eid] = len(attempts)
    if doubt:
        m.unknown.add(eid)
    return events


def journal_lost(inp: AttemptsEnded) -> bool:
    """True when an attempt did not start because the journal failed to record its
    dispatch (or could record nothing more): the run ends ``journal_unavailable`` and
    writes nothing more (SPEC 6)."""
    return any(o.skipped == "journal" for o in inp.outcomes)


def link(m: Machine) -> None:
    """Note the run's own spend as a batch starts: the base of its ledger should a child
    start (the interpreter gives the child what it draws on)."""
    st = m.state
    m.snapshot = (st.tool_calls - st.child_tool_calls, st.usage - st.child_usage)
    m.snapshot_tools = sub_counts(st.tool_counts, st.child_tool_counts)


def uncharged(m: Machine) -> bool:
    """True when the run has own tool calls the run tree's ledger does not know yet."""
    st = m.state
    return st.tool_calls - st.child_tool_calls > m.charged[0]


def now_of(m: Machine, now: Instant) -> rules.Now:
    return rules.Now(m.config.run_id, now.ts, m.elapsed(now.mono))
