"""How a run ends (SPEC 6), its report, and its ledger with the run tree (SPEC 8): the
parts of ``decide`` that every stage may reach (pure)."""

from __future__ import annotations

from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.core import rules
from boundloop.core.budget import LedgerReply, add_counts, sub_counts
from boundloop.core.effects import ChargeTree, Commit, Finish, Step
from boundloop.core.inputs import Committed, Tick, TreeReplied
from boundloop.core.rules import Stop
from boundloop.core.state import Instant, Machine
from boundloop.results import RunResult, UnresolvedAction

#: What an attempt that ran leaves: recorded even when the run stops on a fenced runner.
ATTEMPT_FACTS = (ev.CallSucceeded, ev.CallFailed, ev.CallTimedOut, ev.CallOutcomeUnknown,
                 ev.CallReconciled)
#: Why a run ends when an attempt's dispatch could not be recorded (SPEC 6).
JOURNAL_LOST = ("The journal could not record a call's dispatch; nothing more was started "
                "or written.")


def stamp(m: Machine, now: Instant) -> dict[str, Any]:
    """The fields every event of the run takes from the moment: run id, time, elapsed."""
    return {"run_id": m.config.run_id, "ts": now.ts, "elapsed_s": m.elapsed(now.mono)}


def done(m: Machine, res: RunResult) -> Step:
    """The run is over: nothing more is decided."""
    m.stage = "done"
    m.result = res
    return Step([], [Finish(res)])


def outbox(m: Machine) -> list[ev.Event]:
    """The queued events, for the Commit the interpreter performs now (the batch in flight
    is kept: should it fail, ``Committed`` says so and the run notes what it lost)."""
    batch, m.pending = m.pending, []
    m.committing = batch
    return batch


def lose(m: Machine, batch: list[ev.Event]) -> None:
    """Note what events that will never be recorded meant for the run's report."""
    m.unrecorded.update(
        e.execution_id for e in batch
        if isinstance(e, ev.CallSucceeded | ev.CallFailed | ev.CallOutcomeUnknown
                      | ev.CallReconciled | ev.CallTimedOut))
    # A call decided, or retried, in a lost commit never ran: the journal does not count
    # it, and neither does the report (as the fold counts tool calls).
    m.uncounted += sum(isinstance(e, ev.CallDecided)
                       or isinstance(e, ev.CallDispatched) and e.attempt > 1 for e in batch)
    # Calls decided in a lost commit were never dispatched: nothing is unknown.
    m.never_dispatched.update(e.execution_id for e in batch if isinstance(e, ev.CallDecided))


def result(m: Machine, now: Instant) -> RunResult:
    """The run's RunResult: its state's, less what the journal never recorded."""
    st = m.state
    res = st.result(m.elapsed(now.mono))
    if m.unrecorded or m.never_dispatched:
        lost = [st.calls[e] for e in m.unrecorded if e in st.calls]
        res = msgspec.structs.replace(
            res,
            completed=[c for c in res.completed if c.execution_id not in m.unrecorded],
            unresolved=[u for u in res.unresolved
                        if u.execution_id not in m.never_dispatched | m.unrecorded] + [
                UnresolvedAction(m.config.run_id, r.call_id, r.tool, r.execution_id,
                                 r.idempotency_key, max(r.attempt, 1), "dispatched")
                for r in lost])
    if m.uncounted:
        res = msgspec.structs.replace(res, tool_calls=max(res.tool_calls - m.uncounted, 0))
    if m.uninvoked:
        res = msgspec.structs.replace(res, model_steps=max(res.model_steps - m.uninvoked, 0))
    if res.status == "journal_unavailable" and res.unresolved:
        # No RunFinished carries this explanation: it counts what the result lists.
        res = msgspec.structs.replace(res, explanation=(
            f"{res.explanation} {rules.unresolved_sentence(len(res.unresolved))}"))
    return res


def unavailable(m: Machine, detail: str, plain: bool, now: Instant) -> RunResult:
    """The result of a run the journal failed: it says so, and nothing more is written."""
    lose(m, m.pending)
    m.pending = []
    stop = Stop("journal_unavailable", detail=detail, plain=plain)
    m.state.status = stop.status
    m.state.explanation = rules.explain(stop, m.config.budget)
    return result(m, now)


# -- the run tree's ledger -----------------------------------------------------------------
def tree(m: Machine, now: Instant, reserve: int = 0, close: bool = False,
         reserve_tools: dict[str, int] | None = None) -> ChargeTree | None:
    """Charge own spend to the run tree, fold what descendants spent, and (for a child)
    reserve ``reserve`` tool calls (``reserve_tools`` of them by tool) against every
    ancestor at once; None while no ledger is open (no child started yet)."""
    st = m.state
    if not open_ledger(m, now):
        return None
    own_calls = st.tool_calls - st.child_tool_calls
    own_usage = st.usage - st.child_usage
    own_tools = sub_counts(st.tool_counts, st.child_tool_counts)
    reserve_tools = reserve_tools or {}
    m.asked_tree = (reserve, reserve_tools, own_calls, own_usage, own_tools)
    return ChargeTree(reserve, max(own_calls - m.charged[0], 0), own_usage - m.charged[1],
                      close, sub_counts(own_tools, m.charged_tools), reserve_tools)


def open_ledger(m: Machine, now: Instant) -> bool:
    """True when the run settles with the run tree's ledger: a child from its start, a
    parent once a handler of it started a child (its own spend then is the base)."""
    if not m.ledger_open and now.children:
        m.ledger_open = True
        m.charged = m.snapshot
        m.charged_tools = m.snapshot_tools
    return m.ledger_open


def children_charged(m: Machine, reply: LedgerReply, now: Instant) -> list[ev.Event]:
    """What descendants spent, as the authority's reply says, for the run to fold."""
    base = stamp(m, now)
    return [ev.ChildCharged(**base, child_run_id=child.child_run_id,
                            tool_calls=child.tool_calls, usage=child.usage, tools=child.tools)
            for child in reply.children]


def tree_replied(m: Machine, reply: LedgerReply, now: Instant) -> list[ev.Event]:
    """What the authority's answer leaves: own spend charged, descendants' spend folded."""
    reserve, reserve_tools, own_calls, own_usage, own_tools = m.asked_tree
    m.charged = (own_calls + (reserve if reply.granted else 0), own_usage)
    m.charged_tools = add_counts(own_tools, reserve_tools) if reply.granted else own_tools
    return children_charged(m, reply, now)


# -- the end ---------------------------------------------------------------------------------
def finish(m: Machine, now: Instant) -> Step:
    """End the run with ``m.stop``."""
    stop = m.stop
    assert stop is not None
    m.stage = "finish"
    if stop.status == "journal_unavailable":
        if m.pending and not now.leased:
            # This runner fenced itself (its lease, or a worker shutting down) while the
            # journal works: what its attempts did is recorded, fenced as ever, so a resume
            # elsewhere knows it instead of finding unknown outcomes. Only those facts:
            # calls it did not start stay as a crash leaves them, for the resume to settle
            # (the model never saw them skipped).
            m.pending = [e for e in m.pending if isinstance(e, ATTEMPT_FACTS)]
            m.stage = "facts_commit"
            return Step([], [Commit()])
        # Else a write already failed: write nothing more. The run stays open in the
        # journal, as its durable events left it, for recovery to resolve and resume.
        return done(m, unavailable(m, stop.detail, stop.plain, now))
    ask = tree(m, now, close=True)
    if ask is not None:
        m.stage = "finish_tree"
        return Step([], [ask])
    return finish_event(m, Tick(), now)


def finish_tree(m: Machine, inp: TreeReplied, now: Instant) -> Step:
    """The run tree's ledger is settled: then the RunFinished."""
    m.stage = "finish_event"
    return Step(tree_replied(m, inp.reply, now))


def finish_event(m: Machine, _: Tick, now: Instant) -> Step:
    """SPEC 6: the RunFinished, and (awaiting approval) the run given up by its owner."""
    stop, st = m.stop, m.state
    assert stop is not None
    events: list[ev.Event] = [rules.run_finished(
        st, stop, m.current, cancel_reason=now.cancel_reason,
        now=rules.Now(m.config.run_id, now.ts, m.elapsed(now.mono)))]
    if stop.status == "awaiting_approval":
        # The turn ends and the run is nobody's: after the decisions, any worker (or a
        # resume) takes it without waiting for this runner's lease (SPEC 14).
        events.append(ev.OwnerClaimed(**stamp(m, now), owner="", epoch=st.epoch + 1))
        m.releasing = True
    m.stage = "finish_commit"
    return Step(events, [Commit()])


def finish_committed(m: Machine, inp: Committed, now: Instant) -> Step:
    """The RunFinished is durable (or not: the run says so)."""
    stop = m.stop
    assert stop is not None
    if inp.error is not None:
        return done(m, unavailable(m, f"The run ended {stop.status}, but the journal could "
                                      f"not record it ({inp.error}).", False, now))
    return done(m, result(m, now))
