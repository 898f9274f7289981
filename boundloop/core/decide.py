"""``decide(machine, input, now) -> Step``: the run as one pure state machine (issue #21).

The order of a round (SPEC 5), its stop decisions, the calls' decisions, the run tree's
ledger (SPEC 8), the settling of what a crash left open (SPEC 6) and the run's end all live
here. ``Machine.stage`` says which input the run waits for; a Step whose events must be
folded before the next decision asks for a ``Tick``. No I/O, no threads, no clock reads:
time and the world's flags come in ``now`` (an ``Instant``).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from boundloop import events as ev
from boundloop.core import rules
from boundloop.core.budget import add_counts, remaining, within_tree
from boundloop.core.effects import (
    AskApproval,
    CallStart,
    ChargeTree,
    CheckCalls,
    Commit,
    Estimate,
    InvokeModel,
    Retry,
    StartCalls,
    Step,
)
from boundloop.core.finish import (
    ATTEMPT_FACTS,
    JOURNAL_LOST,
    children_charged,
    finish,
    finish_committed,
    finish_event,
    finish_tree,
    lose,
    open_ledger,
    result,
    stamp,
    tree,
    tree_replied,
    unavailable,
)
from boundloop.core.finish import (
    done as _done,
)
from boundloop.core.inputs import (
    ApprovalsRuled,
    AttemptFailed,
    AttemptsEnded,
    AttemptStarting,
    CallsChecked,
    Committed,
    EffectFailed,
    Estimated,
    Failed,
    Input,
    ModelReplied,
    RetryReserved,
    Tick,
    TreeReplied,
)
from boundloop.core.rules import Stop
from boundloop.core.settle import HANDLERS as SETTLE
from boundloop.core.settle import settle
from boundloop.core.state import Decided, Instant, Machine
from boundloop.core.steps import (
    attempts,
    end_round,
    halt,
    journal_lost,
    link,
    next_round,
    now_of,
    record,
    record_round,
    then,
    uncharged,
)
from boundloop.errors import BoundloopError
from boundloop.policy.redact import journal_safe

#: Who closes an approved call that cannot be sent (``CallResolved.by``).
RUNNER = "boundloop"

#: Why a nested run's call that needs approval is denied (SPEC 14, SPEC 8).
NESTED_APPROVAL = ("it needs a person's approval, and a nested run cannot wait for one; "
                   "call the tool from the parent run")


class Unexpected(BoundloopError):
    """An input the run's stage does not wait for (a bug in whoever drives the run)."""


def idempotency_key(run_id: str, call_id: str) -> str:
    """The key every attempt of one logical call shares."""
    return hashlib.sha256(f"{run_id}\x00{call_id}".encode()).hexdigest()[:32]


def admission(m: Machine, owner: str, queued: bool, now: Instant) -> ev.RunAdmitted:
    """The run's RunAdmitted; ``queued``: enqueued, with no owner until a worker takes it."""
    c = m.config
    return ev.RunAdmitted(**stamp(m, now), budget=c.budget, history=c.history,
                          tools=sorted(c.tools), owner=owner, parent_run_id=c.parent_run_id,
                          parent_step=c.parent_step,
                          parent_execution_id=c.parent_execution_id, agent=c.agent,
                          agent_version=c.agent_version, labels=c.labels, queued=queued,
                          tool_caps=m.caps)


def decide(m: Machine, inp: Input, now: Instant) -> Step:
    """The next Step of the run ``m`` (updated in place) given ``inp`` at ``now``; an input
    its stage does not wait for raises ``Unexpected`` and leaves ``m`` as it was."""
    kind = type(inp)
    handler = _HANDLERS.get((m.stage, kind))
    if handler is not None:  # the inputs a stage waits for (the table names none below)
        if isinstance(inp, Committed):
            if inp.error is not None:
                lose(m, m.committing)
            m.committing = []
        return handler(m, inp, now)
    if isinstance(inp, AttemptStarting | AttemptFailed):
        _expect(m, m.stage in _DISPATCHING, inp)
        if isinstance(inp, AttemptStarting):
            return _attempt_starting(m, inp, now)
        return _may_retry(m, inp, now)
    if isinstance(inp, RetryReserved):
        return _retry_reserved(m, inp, now)
    if isinstance(inp, Failed):
        _expect(m, m.stage != "done", inp)
        # Boundloop itself failed: what the run's attempts did is recorded with the
        # RunFinished (a resume would otherwise find those outcomes unknown); the rest
        # of what was folded and not written is dropped, as it may be what failed.
        m.pending = [e for e in m.pending if isinstance(e, ATTEMPT_FACTS)]
        return halt(m, Stop("needs_review", detail=inp.detail, plain=True), now)
    if isinstance(inp, EffectFailed) and m.stage not in _FINISHING:
        if m.stage == "model":
            _uninvoked(m)
        # A lost lease is this runner's, not the journal's failing: it says so alone.
        return halt(m, Stop("journal_unavailable", detail=inp.error, plain=inp.lease), now)
    raise Unexpected(f"the run in stage {m.stage!r} was given {kind.__name__}")


def _expect(m: Machine, accepted: bool, inp: Input) -> None:
    if not accepted:
        raise Unexpected(f"the run in stage {m.stage!r} was given {type(inp).__name__}")


#: The stages in which calls run (and attempts start and fail).
_DISPATCHING = ("dispatch", "settle_dispatch", "approved_dispatch")
_FINISHING = ("finish", "finish_tree", "finish_event", "finish_commit", "facts_commit", "done")


# -- the start ----------------------------------------------------------------------------
def _begin(m: Machine, _: Tick, now: Instant) -> Step:
    first: ev.Event = ev.RunResumed(**stamp(m, now), owner=m.config.owner) if m.resumed \
        else admission(m, m.config.owner, False, now)
    m.stage = "started"
    return Step([first], [Commit()])


def _started(m: Machine, inp: Committed, now: Instant) -> Step:
    run_id = m.config.run_id
    if inp.conflict:
        m.pending = []
        if m.resumed:
            # Appended to between its claim and now (a person's decision, say): nothing
            # was done here; the run is as the journal says.
            return _done(m, unavailable(
                m, f"Run {run_id!r} changed while it was being resumed (another writer "
                   "appended to it); nothing was done here: resume it again.", True, now))
        # Another runner admitted a run with this id first: this one never started.
        refused = Stop("rejected", detail=f"a run with id {run_id!r} already exists in the "
                                          "journal; use a new id")
        m.state.status = refused.status
        m.state.explanation = rules.explain(refused, m.config.budget)
        return _done(m, result(m, now))
    if inp.error is not None:
        return _done(m, unavailable(
            m, f"It could not record the run's start ({inp.error}); nothing ran.", False, now))
    if m.resumed:
        m.to_settle = [r.execution_id for r in m.state.calls.values() if r.open]
        m.review = []
        m.stage = "settle"
        return settle(m, Tick(), now)
    return next_round(m, now, [])


# -- a round ------------------------------------------------------------------------------
def _round(m: Machine, _: Tick, now: Instant) -> Step:
    ask = tree(m, now)
    if ask is not None:
        return _ask_tree(m, "round_tree", ask)
    m.current = m.config.budget
    return _estimate(m)


def _ask_tree(m: Machine, stage: Any, ask: ChargeTree) -> Step:
    m.stage = stage
    return Step([], [ask])


def _round_tree(m: Machine, inp: TreeReplied, now: Instant) -> Step:
    m.tree_reply = inp.reply
    return then(m, "round_budget", tree_replied(m, inp.reply, now))


def _round_budget(m: Machine, _: Tick, now: Instant) -> Step:
    st, reply = m.state, m.tree_reply
    assert reply is not None
    m.current = within_tree(m.config.budget, st.tool_calls, st.usage, reply.left)
    return _estimate(m)


def _estimate(m: Machine) -> Step:
    m.stage = "estimate"
    return Step([], [Estimate()])


def _estimated(m: Machine, inp: Estimated, now: Instant) -> Step:
    if inp.failed is not None:
        return halt(m, Stop("model_error", plain=True, detail=journal_safe(
            f"The model was not called: {inp.failed}")), now)
    if inp.abandoned == "deadline":
        return halt(m, Stop("limit_exceeded", "deadline",
                             "The step's estimate was not ready before the deadline."), now)
    if inp.abandoned is not None or inp.usage is None:
        return halt(m, Stop("cancelled", detail="The step's estimate was not awaited."), now)
    st, budget, reservation = m.state, m.current, inp.usage
    stop = rules.before_model(st, budget, cancelled=now.cancelled,
                              deadline_passed=m.deadline_passed(now.mono),
                              reservation=reservation)
    if stop is not None:
        return halt(m, stop, now)
    m.was_final_only = rules.final_only(st, budget)
    started = rules.start_step(st, budget, reservation, now_of(m, now))
    m.reservation, m.step, m.allowed = reservation, started.step, started.tools_allowed
    return then(m, "invoke", [started])


#: Why a model step was not run (fail closed, SPEC 6).
JOURNAL_CLOSED = "the journal was closed; the model was not called"
FENCED = ("this runner stopped starting work (it is shutting down, or its lease ran out: was "
          "the process paused?) and did not call the model; another runner may take the run "
          "over")


def _uninvoked(m: Machine) -> None:
    """Refused before the model was called (lease lost, journal closed): the step counted
    in the live state never ran, and is never recorded (SPEC 5: model steps count callback
    invocations)."""
    m.uninvoked += 1
    m.pending = [e for e in m.pending
                 if not (isinstance(e, ev.ModelStepStarted) and e.step == m.step)]


def _invoke(m: Machine, _: Tick, now: Instant) -> Step:
    if not now.recordable or not now.leased:
        # Fail closed: no model step the journal could not record, and none on a runner
        # that fenced itself (its lease, or a worker shutting down).
        _uninvoked(m)
        return halt(m, Stop("journal_unavailable",
                            detail=JOURNAL_CLOSED if not now.recordable else FENCED,
                            plain=now.recordable), now)
    st = m.state
    left = remaining(m.current, st.model_steps, st.tool_calls, st.usage - m.reservation,
                     m.elapsed(now.mono))
    m.stage = "model"
    return Step([], [InvokeModel(m.step, m.allowed, left, m.deadline)])


def _replied(m: Machine, inp: ModelReplied, now: Instant) -> Step:
    c = m.config
    replied = rules.model_replied(
        m.state, m.current, rules.Reply(inp.response, inp.error, inp.latency_s, inp.abandoned),
        reservation=m.reservation, cancelled=now.cancelled, price=c.table, now=now_of(m, now),
        deadline_passed=m.deadline_passed(now.mono), catalogue=c.catalogue, quote=inp.quote,
        unpriced=c.unpriced)
    if replied.batch is None:
        if replied.stop is not None:
            return halt(m, replied.stop, now, replied.events)
        return next_round(m, now, replied.events)
    m.batch = replied.batch
    return then(m, "batch", replied.events)


def _check_batch(m: Machine, _: Tick, now: Instant) -> Step:
    batch = m.batch
    assert batch is not None
    stop = rules.check_batch(m.state, m.current, batch, allowed=m.allowed,
                             was_final_only=m.was_final_only)
    if stop is not None:
        return halt(m, stop, now)
    m.tree_tools = None
    if m.ledger_open and m.config.parent_run_id is not None:
        by_tool = Counter(call.name for call in batch.calls)
        ask = tree(m, now, reserve=len(batch.calls), reserve_tools=dict(by_tool))
        if ask is not None:
            return _ask_tree(m, "batch_tree", ask)
    return _check_calls(m, Tick(), now)


def _batch_tree(m: Machine, inp: TreeReplied, now: Instant) -> Step:
    events = tree_replied(m, inp.reply, now)
    if not inp.reply.granted:
        return halt(m, Stop("limit_exceeded", "tool_calls",
                             "The parent run has too few tool calls left for the batch."),
                     now, events)
    m.tree_tools = (inp.reply.tools_granted, inp.reply.tool_caps)
    return then(m, "check_next", events)


def _check_calls(m: Machine, _: Tick, now: Instant) -> Step:
    c, batch = m.config, m.batch
    assert batch is not None
    granted, tree_caps = m.tree_tools or (None, None)
    names = [call.name for call in batch.calls]
    m.capped = rules.cap_denials(names, m.caps, m.state.tool_counts, granted=granted,
                                 tree_caps=tree_caps)
    permit: list[int] | None = None
    if c.permit:
        # A call its tool's cap denies is not put to the permission check.
        permit = [i for i, name in enumerate(names)
                  if name in c.tools and not m.capped[i]
                  and (c.read_only is False or c.tools[name].read_only)]
    eids = [f"{c.run_id}:{m.step}:{i}" for i in range(len(names))]
    m.stage = "check"
    return Step([], [CheckCalls(eids, permit)])


def _checked(m: Machine, inp: CallsChecked, now: Instant) -> Step:
    c, batch = m.config, m.batch
    assert batch is not None
    passed = m.deadline_passed(now.mono)
    decided = []
    for i, call in enumerate(batch.calls):
        tool = c.tools.get(call.name)
        decision, reason = rules.call_decision(
            call.name, c.tools, tool_read_only=bool(tool and tool.read_only),
            read_only_runner=c.read_only, verdict=inp.verdicts[i], invalid=inp.invalid[i],
            deadline_passed=passed, cancelled=now.cancelled, capped=m.capped[i])
        decided.append(Decided(decision, reason, inp.validated[i]
                               if decision in ("allow", "skipped") else None))
    m.decided = decided
    # Mark the allowed calls whose tool needs_approval (SPEC 14); a rule is asked.
    m.asked = []
    for i, (call, d) in enumerate(zip(batch.calls, decided, strict=True)):
        approval = c.tools[call.name].approval if d.decision == "allow" else "never"
        if approval == "always":
            d.approval = True
        elif approval == "rule":
            m.asked.append(i)
    if m.asked:
        m.stage = "approve"
        return Step([], [AskApproval(list(m.asked))])
    return _decide_calls(m, now)


def _approvals(m: Machine, inp: ApprovalsRuled, now: Instant) -> Step:
    for i, answer in zip(m.asked, inp.answers, strict=True):
        m.decided[i].approval = bool(answer)
    return _decide_calls(m, now)


def _decide_calls(m: Machine, now: Instant) -> Step:
    c, batch, st = m.config, m.batch, m.state
    assert batch is not None
    if c.parent_run_id is not None:
        # A nested run cannot wait for a person (its parent's handler waits for it, and
        # nothing would take it up again): such a call is denied, fail closed.
        m.decided = [Decided("denied", NESTED_APPROVAL) if d.approval else d
                     for d in m.decided]
    keys = [idempotency_key(c.run_id, call.id) for call in batch.calls]
    plans, m.skipped = [], []
    for call, d in zip(batch.calls, m.decided, strict=True):
        tool = c.tools.get(call.name)
        plans.append(rules.CallPlan(
            d.decision, d.reason, d.validated,
            read_only=bool(tool and tool.read_only), idempotent=bool(tool and tool.idempotent),
            irreversible=bool(tool and tool.irreversible), approval=d.approval))
        if d.decision == "skipped":
            m.skipped.append(d.reason)
    events = rules.calls_decided(st, batch, plans, keys=keys,
                                 max_parallel=c.budget.max_parallel,
                                 parent_step=c.parent_step, now=now_of(m, now))
    # The dispatch of the calls that start at once rides the decisions' commit, right
    # before they go to the executor: a crash from here on shows phase ``dispatched``.
    # Every later attempt gets its own durable CallDispatched first (SPEC 6).
    at_once = {e.execution_id for e in events if isinstance(e, ev.CallDispatched)}
    m.planned_calls = []
    for index, (call, d) in enumerate(zip(batch.calls, m.decided, strict=True)):
        if d.decision == "allow" and call.name in c.tools and not d.approval:
            eid = f"{c.run_id}:{m.step}:{index}"
            m.planned_calls.append(CallStart(eid, keys[index], call.id, call.name,
                                             recorded=eid in at_once))
    m.stage = "decided"
    return Step(events, [Commit()])


def _calls_committed(m: Machine, inp: Committed, now: Instant) -> Step:
    if inp.error is not None:
        return halt(m, Stop("journal_unavailable",
                             detail=f"The calls' decisions could not be recorded "
                                    f"({inp.error}); none was dispatched."), now)
    if m.planned_calls and m.ledger_open and uncharged(m):
        # The run tree's ledger is open (a handler of this run started a child before):
        # the batch's own calls count there before any child of it reserves, so that the
        # children see them (SPEC 8; per-tool caps too).
        ask = tree(m, now)
        if ask is not None:
            return _ask_tree(m, "dispatch_tree", ask)
    return _dispatch(m, Tick(), now)


def _dispatch_tree(m: Machine, inp: TreeReplied, now: Instant) -> Step:
    return then(m, "dispatch_go", tree_replied(m, inp.reply, now))


def _dispatch(m: Machine, _: Tick, now: Instant) -> Step:
    if not m.planned_calls:
        return end_round(m, [], m.skipped, now)
    allowance = m.allowance = m.current.max_tool_calls - m.state.tool_calls
    link(m)
    m.stage = "dispatch"
    return Step([], [StartCalls(list(m.planned_calls), m.config.budget.max_parallel,
                                allowance, m.step)])


def _dispatched(m: Machine, inp: AttemptsEnded, now: Instant) -> Step:
    if journal_lost(inp):
        events: list[ev.Event] = []
        # What the calls did is noted for the report (never written: the journal failed);
        # a call whose retry's dispatch was lost keeps the outcomes of its attempts.
        for outcome in inp.outcomes:
            events += attempts(m, outcome.execution_id, outcome.attempts, True, now) \
                if outcome.attempts else record(m, outcome, now)
        return then(m, "journal_lost", events)
    return then(m, "round_end", record_round(m, inp.outcomes, now))


def _round_end(m: Machine, _: Tick, now: Instant) -> Step:
    c, st = m.config, m.state
    review = [f"{p.tool} {p.execution_id}" for p in m.planned_calls
              if c.tools[p.tool].irreversible
              and st.calls[p.execution_id].status == "outcome_unknown"]
    return end_round(m, review, m.skipped, now)


def _attempt_starting(m: Machine, inp: AttemptStarting, now: Instant) -> Step:
    """The events that must be durable before an attempt starts: the outcomes of the
    attempts before it (not yet recorded) and its own CallDispatched (SPEC 6)."""
    events = attempts(m, inp.execution_id, inp.before, False, now)
    events.append(ev.CallDispatched(**stamp(m, now), execution_id=inp.execution_id,
                                    attempt=inp.attempt))
    return Step(events)


def _may_retry(m: Machine, inp: AttemptFailed, now: Instant) -> Step:
    """SPEC 6: another attempt runs when the failure is retryable, attempts and the batch's
    call budget are left, nothing stops dispatch, and its delay ends before the deadline.
    Its CallDispatched is made durable before it starts (``AttemptStarting``)."""
    if not rules.may_retry(retryable=inp.retryable, max_attempts=inp.max_attempts,
                           attempts_made=inp.attempts_made, allowance=m.allowance,
                           delay_s=inp.delay_s, now=now.mono, deadline=m.deadline,
                           gate=inp.gate):
        return Step()
    if open_ledger(m, now):
        # The run tree's ledger is open: the retry is one more call of the tree, reserved
        # with its authority first (a child's calls may have used what is left, SPEC 8).
        m.retry_delays[inp.execution_id] = inp.delay_s
        tool = m.state.calls[inp.execution_id].tool
        return Step([], [ChargeTree(reserve=1, reserve_tools={tool: 1})])
    m.allowance -= 1
    return Step([], [Retry(inp.execution_id, inp.delay_s)])


def _retry_reserved(m: Machine, inp: RetryReserved, now: Instant) -> Step:
    """The authority's answer to a retry's reservation: the retry runs when it was
    granted (every ancestor, and the tool's caps, have room) and the run has a call left
    counting what its descendants spent; else the last attempt's outcome stands."""
    eid, reply, st = inp.execution_id, inp.reply, m.state
    delay = m.retry_delays.pop(eid, None)
    if m.stage in _FINISHING or delay is None:
        return Step()  # nothing can be recorded or started any more
    tool = st.calls[eid].tool
    if reply.granted:  # the reservation is charged: the retry's dispatch is not again
        m.charged = (m.charged[0] + 1, m.charged[1])
        m.charged_tools = add_counts(m.charged_tools, {tool: 1})
    events = children_charged(m, reply, now)
    spent = st.tool_calls + sum(child.tool_calls for child in reply.children)
    if not reply.granted or reply.tools_granted.get(tool, 1) < 1 or m.allowance <= 0 \
            or spent >= m.config.budget.max_tool_calls or m.stage not in _DISPATCHING:
        return Step(events)
    m.allowance -= 1
    return Step(events, [Retry(eid, delay)])


def _handlers() -> dict[tuple[str, type], Callable[[Machine, Any, Instant], Step]]:
    table: dict[tuple[str, type], Callable[[Machine, Any, Instant], Step]] = {
        ("start", Tick): _begin,
        ("started", Committed): _started,
        ("round", Tick): _round,
        ("round_tree", TreeReplied): _round_tree,
        ("round_budget", Tick): _round_budget,
        ("estimate", Estimated): _estimated,
        ("invoke", Tick): _invoke,
        ("model", ModelReplied): _replied,
        ("batch", Tick): _check_batch,
        ("batch_tree", TreeReplied): _batch_tree,
        ("check_next", Tick): _check_calls,
        ("check", CallsChecked): _checked,
        ("approve", ApprovalsRuled): _approvals,
        ("decided", Committed): _calls_committed,
        ("dispatch_tree", TreeReplied): _dispatch_tree,
        ("dispatch_go", Tick): _dispatch,
        ("dispatch", AttemptsEnded): _dispatched,
        ("round_end", Tick): _round_end,
        ("finish", Tick): lambda m, _, now: finish(m, now),
        ("finish_tree", TreeReplied): finish_tree,
        ("finish_event", Tick): finish_event,
        ("finish_commit", Committed): finish_committed,
        ("journal_lost", Tick): lambda m, _, now: _done(
            m, unavailable(m, JOURNAL_LOST, False, now)),
        ("facts_commit", Committed): lambda m, _, now: _done(m, unavailable(
            m, m.stop.detail if m.stop else "", bool(m.stop and m.stop.plain), now)),
    }
    table.update(SETTLE)
    return table


_HANDLERS = _handlers()
