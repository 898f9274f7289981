"""The loop's checks, in the order of SPEC 5 (pure: time and flags are arguments)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypedDict

import msgspec

from boundloop import events as ev
from boundloop.core.budget import Budget, Price, Quote, Usage, exceeded, priced
from boundloop.core.explain import Stop as Stop
from boundloop.core.explain import explain as explain
from boundloop.core.explain import stop_limit as stop_limit
from boundloop.core.explain import unresolved_sentence as unresolved_sentence
from boundloop.core.kinds import Decision
from boundloop.core.parse import parse_response as parse_response
from boundloop.core.replay import RunState
from boundloop.messages import CallTools, Final, Malformed
from boundloop.policy.redact import (
    journal_safe,
)
from boundloop.policy.safe_text import describe_exception


def before_model(state: RunState, budget: Budget, *, cancelled: bool, deadline_passed: bool,
                 reservation: Usage) -> Stop | None:
    """SPEC 5.1: may the next model step run?"""
    if cancelled:
        return Stop("cancelled")
    if deadline_passed:
        return stop_limit("deadline")
    if state.model_steps >= budget.max_model_steps:
        return stop_limit("model_steps")
    limit = exceeded(budget, state.usage + reservation)
    if limit is not None:
        return stop_limit(limit)
    return None


def final_only(state: RunState, budget: Budget) -> bool:
    """True when the step about to run is the last one and is reserved for a final answer."""
    return budget.reserve_final_step and state.model_steps + 1 >= budget.max_model_steps


def tools_allowed(state: RunState, budget: Budget) -> bool:
    """SPEC 5.2: False on the final-only step and when the call budget is spent."""
    return not final_only(state, budget) and state.tool_calls < budget.max_tool_calls


def check_batch(state: RunState, budget: Budget, calls: CallTools, *,
                allowed: bool, was_final_only: bool) -> Stop | None:
    """SPEC 5.8: the batch as a whole; any failure refuses all of it."""
    if not allowed:
        return stop_limit("model_steps" if was_final_only else "tool_calls")
    seen: set[str] = set()
    for call in calls.calls:
        if call.id in seen or call.id in state.reserved_ids:
            return Stop("repeated_call", detail=call.id)
        seen.add(call.id)
    if state.tool_calls + len(calls.calls) > budget.max_tool_calls:
        return stop_limit("tool_calls")
    return None


def cap_denials(names: list[str], caps: Mapping[str, int], counts: Mapping[str, int], *,
                granted: Mapping[str, int] | None = None,
                tree_caps: Mapping[str, int] | None = None) -> list[str]:
    """Per-tool caps (``bl.tool(max_calls=N)``), for the calls of one batch in the model's
    order: the reason each call is denied for its tool's cap, or ``""``.

    Every call of a tool counts, whatever its decision (as ``tool_calls`` counts calls): a
    call is denied once the run's count of its tool (``counts``, nested runs' included)
    plus the earlier calls of it in the batch reach the run's cap (``caps``), or, in a
    nested run, once the batch's earlier calls of it reach what the run tree ``granted``
    (the budget authority's answer: what every ancestor's cap has left, ``tree_caps``
    naming the cap that binds).
    """
    seen: dict[str, int] = {}
    out: list[str] = []
    for name in names:
        before = seen.get(name, 0)
        seen[name] = before + 1
        cap = caps.get(name)
        if cap is not None and counts.get(name, 0) + before >= cap:
            out.append(f"tool {name!r} reached its cap of {cap} call{'' if cap == 1 else 's'} "
                       f"in this run (max_calls={cap})")
        elif granted is not None and name in granted and before >= granted[name]:
            bound = (tree_caps or {}).get(name)
            what = f"max_calls={bound}" if bound is not None else "max_calls"
            out.append(f"tool {name!r} reached its cap in an enclosing run ({what}, shared "
                       "with the runs nested in it)")
        else:
            out.append("")
    return out


class PermitRaised(msgspec.Struct, frozen=True):
    """The permission check raised, or never answered (``text`` describes it): the call is
    denied with that reason (a fact: the interpreter describes the exception)."""

    text: str


def call_decision(name: str, known: Collection[str], *, tool_read_only: bool,
                  read_only_runner: bool, verdict: Any, invalid: str | None,
                  deadline_passed: bool, cancelled: bool,
                  capped: str = "") -> tuple[Decision, str]:
    """SPEC 5.9, one call, in order: unknown tool, the read-only runner, the tool's cap
    (``capped``: the reason from ``cap_denials``, or ``""``), permission, arguments,
    deadline.

    ``verdict`` is what ``permit`` returned (True allows; a non-empty string is the reason
    to deny; an exception it raised denies), or None when there is no ``permit``.
    ``invalid`` says what is wrong with the arguments, or None when they are valid.
    Returns ``(decision, reason)``.
    """
    if name not in known:
        tools = ", ".join(sorted(known)) or "none"
        return "unknown_tool", f"no tool named {name!r} (tools: {tools})"
    if read_only_runner and not tool_read_only:
        return "denied", f"this runner is read-only and tool {name!r} is not marked read_only"
    if capped:
        return "denied", capped
    if isinstance(verdict, PermitRaised):
        return "denied", journal_safe(f"the permission check raised {verdict.text}")
    if isinstance(verdict, BaseException):
        return "denied", f"the permission check raised {describe_exception(verdict)}"
    if verdict is not None and verdict is not True:
        return "denied", journal_safe(verdict) if isinstance(verdict, str) and verdict else \
            "denied by the permission check"
    if invalid is not None:
        return "invalid_arguments", f"invalid arguments for {name!r}: {invalid}"
    if deadline_passed:
        return "skipped", "deadline"
    if cancelled:
        return "skipped", "cancelled"
    return "allow", ""


# -- SPEC 5 step 10 and SPEC 6: what the executor may start ------------------------------
SkipReason = Literal["journal", "lease", "cancelled", "deadline"]


def dispatch_gate(*, recordable: bool, cancelled: bool, deadline_passed: bool,
                  leased: bool = True) -> SkipReason | None:
    """SPEC 5.10 and 6: may an attempt start now? None, or why not: the journal can record
    nothing more (fail closed), this runner's lease lost its safety margin (it fences
    itself), cancellation or the deadline won before the dispatch."""
    if not recordable:
        return "journal"
    if not leased:
        return "lease"
    if cancelled:
        return "cancelled"
    if deadline_passed:
        return "deadline"
    return None


def attempt_timeout(tool_timeout_s: float | None, deadline: float | None,
                    now: float) -> float | None:
    """SPEC 5.10: an attempt's timeout is ``min(tool.timeout_s, time left)``."""
    if deadline is None:
        return tool_timeout_s
    left = max(deadline - now, 0.001)
    return left if tool_timeout_s is None else min(tool_timeout_s, left)


def timeout_retryable(retry_on: tuple[type[BaseException], ...], *, idempotent: bool,
                      reconciled: bool | None) -> bool:
    """SPEC 6: a timed-out attempt may be retried only when timeouts are retried and the
    retry cannot do the action twice (the tool is idempotent, or reconcile said it did not
    take effect)."""
    return issubclass(TimeoutError, retry_on) and (reconciled is False or idempotent)


def may_retry(*, retryable: bool, max_attempts: int, attempts_made: int, allowance: int,
              delay_s: float, now: float, deadline: float | None,
              gate: SkipReason | None) -> bool:
    """SPEC 6: another attempt runs when the failure is retryable, attempts and the call
    budget are left, nothing stops dispatch, and its delay ends before the deadline."""
    if not retryable or allowance <= 0 or attempts_made >= max_attempts or gate is not None:
        return False
    return deadline is None or now + delay_s < deadline


# -- the decider proper: facts in, events out ----------------------------------------------
class Attempt(msgspec.Struct):
    """One attempt of a call as the executor saw it (a raw fact): ``ok``, ``error`` or
    ``timeout`` (then maybe reconciled)."""

    attempt: int
    kind: str
    value: Any = None
    error: str = ""
    category: str = ""
    latency_s: float = 0.0
    timeout_s: float = 0.0
    reconciled: bool | None = None
    reconciled_value: Any = None



class Now(msgspec.Struct, frozen=True):
    """What every event carries that the decider may not read for itself (DESIGN rule 3:
    the clock and ids are inputs)."""

    run_id: str
    ts: float
    elapsed_s: float

    def stamp(self) -> _Stamp:
        """The fields every event takes from ``now``."""
        return {"run_id": self.run_id, "ts": self.ts, "elapsed_s": self.elapsed_s}


class _Stamp(TypedDict):
    run_id: str
    ts: float
    elapsed_s: float


class Reply(msgspec.Struct, frozen=True):
    """A model call's outcome as facts: what it returned, the text of what it raised, or
    why the runner stopped waiting (``abandoned``)."""

    response: Any = None
    error: str | None = None
    latency_s: float = 0.0
    abandoned: SkipReason | None = None


class Replied(msgspec.Struct, frozen=True):
    """What a model reply leads to: events to record, then either a ``stop``, or a
    ``batch`` of calls to check and decide, or neither (a malformed retry: next round)."""

    events: list[ev.Event]
    stop: Stop | None = None
    batch: CallTools | None = None


NOTICE = ("Your last response was malformed ({reason}). Answer with a final response or a "
          "list of tool calls.")


def start_step(state: RunState, budget: Budget, reservation: Usage,
               now: Now) -> ev.ModelStepStarted:
    """SPEC 5.2: count the step (with its reservation) before invoking the model; tools
    are not allowed on the final-only step or once the call budget is spent."""
    return ev.ModelStepStarted(run_id=now.run_id, ts=now.ts, elapsed_s=now.elapsed_s,
                               step=state.model_steps + 1,
                               tools_allowed=tools_allowed(state, budget),
                               reservation=reservation)


def _charged(usage: Usage, price: Price | None, catalogue: bool,
             quote: Quote | None) -> tuple[Usage, str]:
    """A step's usage as charged (priced by ``price``, else by the catalogue's ``quote``
    when the run is priced by the catalogue), and why it is unpriced (``""``: it is not)."""
    charged = priced(usage, price)
    if charged.unpriced_steps:  # only the decider says a step is unpriced
        charged = msgspec.structs.replace(charged, unpriced_steps=0)
    if not catalogue or charged.cost is not None:
        return charged, ""
    if quote is not None and quote.cost is not None:
        return msgspec.structs.replace(charged, cost=quote.cost), ""
    why = quote.why if quote is not None else \
        "the model reported no usage, and its estimate could not be priced"
    return msgspec.structs.replace(charged, unpriced_steps=1), why


def unpriced_stop(budget: Budget, step: int, why: str, unpriced: str,
                  what: str) -> Stop | None:
    """A run priced by the catalogue met a step it cannot price (``why``): with
    ``unpriced="fail"`` and a ``max_cost`` to enforce, it ends ``limit_exceeded(cost)``
    (fail closed: a cost limit never silently stops covering); else it goes on, its cost
    partial (``Usage.unpriced_steps``)."""
    if not why or unpriced != "fail" or budget.max_cost is None:
        return None
    return Stop("limit_exceeded", "cost", plain=True, detail=(
        f"The run stopped because its cost limit (max_cost={budget.max_cost}) cannot be "
        f"enforced: model step {step} could not be priced ({why}); {what} "
        "(unpriced='fail')."))


def partial_cost_sentence(usage: Usage) -> str:
    """What a run whose cost leaves out steps it could not price says of it."""
    n = usage.unpriced_steps
    if n <= 0:
        return ""
    steps = "one model step" if n == 1 else f"{n} model steps"
    return f"Its cost is partial: {steps} could not be priced."


def model_replied(state: RunState, budget: Budget, reply: Reply, *, reservation: Usage,
                  cancelled: bool, price: Price | None, now: Now,
                  deadline_passed: bool = False, catalogue: bool = False,
                  quote: Quote | None = None, unpriced: str = "fail") -> Replied:
    """SPEC 5 steps 3 to 7, for the step ``state.model_steps`` (already started).

    In order: the deadline wall abandoned the call (its reservation stands, estimated),
    or the model raised once the deadline had passed (an adapter's HTTP call bounded by
    the deadline timed out: that is the deadline too); the model raised (3); cancellation
    was observed after the response (4: it is discarded); the response is malformed (5: a
    notice while ``malformed_retries`` remain);
    else the reported usage replaces the reservation (6), a final response is accepted
    (7), and a token or cost limit now exceeded keeps any call from being dispatched (6).

    A run priced by the catalogue (``catalogue``; ``quote`` is the catalogue's answer for
    the reported usage) marks a step it cannot price (``Usage.unpriced_steps``, and the
    reason in ``UsageCharged.unpriced``); ``unpriced`` says what then happens
    (``unpriced_stop``). A final response is still accepted, as in (6).
    """
    step, stamp = state.model_steps, now.stamp()

    def charge(reported: Usage | None) -> tuple[ev.UsageCharged, str]:
        charged, why = _charged(reservation if reported is None else reported, price,
                                catalogue, None if reported is None else quote)
        return ev.UsageCharged(**stamp, step=step, usage=charged, estimated=reported is None,
                               unpriced=why), why

    def failed(reason: str, detail: str, stop: Stop | None,
               reported: Usage | None = None) -> Replied:
        charged, why = charge(reported)
        if stop is None:
            stop = unpriced_stop(budget, step, why, unpriced, "the run did not go on")
        return Replied([ev.ModelStepFailed(**stamp, step=step, reason=reason, detail=detail,
                                           latency_s=reply.latency_s), charged], stop)

    if reply.abandoned == "deadline":
        return failed("deadline", "the model ran on past the deadline and was abandoned",
                      Stop("limit_exceeded", "deadline",
                           "The model call still in flight was abandoned."))
    if reply.abandoned is not None:
        return failed("cancelled", "the model call never started",
                      Stop("cancelled", detail="The model call was not started."))
    if reply.error is not None and deadline_passed:
        return failed("deadline", reply.error, Stop(
            "limit_exceeded", "deadline", "The model call failed as the deadline passed."))
    if reply.error is not None:
        return failed("error", reply.error, Stop("model_error", detail=reply.error))
    if cancelled:
        return failed("cancelled", "the response was discarded",
                      Stop("cancelled", detail="The model's last response was discarded."))
    parsed = parse_response(reply.response)
    if isinstance(parsed, Malformed):
        over = None if parsed.usage is None or parsed.limit is None else exceeded(
            budget, state.usage - reservation + priced(parsed.usage, price))
        if over is not None:
            # A streamed turn the adapter cut because the run's limit was spent: its usage
            # puts the run over that limit, so step 6 ends the run, retries or not. Other
            # malformed turns keep SPEC 5's order (step 5 before the charge of step 6).
            return failed("malformed", parsed.reason, Stop(
                "limit_exceeded", over, f"The model's last turn was not usable "
                f"({parsed.reason.rstrip('.')})."), parsed.usage)
        retries = budget.malformed_retries
        if retries is None or state.malformed + 1 <= retries:
            out = failed("malformed", parsed.reason, None, parsed.usage)
            if out.stop is not None:  # a step it cannot price ends the run (unpriced_stop)
                return out
            return Replied([*out.events, ev.NoticeAdded(
                **stamp, text=NOTICE.format(reason=parsed.reason))])
        return failed("malformed", parsed.reason,
                      Stop("malformed_response", detail=parsed.reason), parsed.usage)
    events: list[ev.Event] = [ev.ModelStepCompleted(**stamp, step=step, response=parsed,
                                                    latency_s=reply.latency_s)]
    usage = state.usage
    charged, why = charge(parsed.usage)
    events.append(charged)
    if parsed.usage is not None:
        usage = usage - reservation + charged.usage
    if isinstance(parsed, Final):
        return Replied(events, Stop("final"))
    limit = exceeded(budget, usage)
    if limit is not None:
        return Replied(events, Stop("limit_exceeded", limit,
                                    "No call of the last response was dispatched."))
    stop = unpriced_stop(budget, step, why, unpriced, "no call of it was dispatched")
    if stop is not None:
        return Replied(events, stop)
    return Replied(events, batch=parsed)


class CallPlan(msgspec.Struct, frozen=True):
    """One call of a batch as the loop found it (SPEC 5.9's inputs): its decision and
    reason from ``call_decision``, the validated arguments, and the tool's flags."""

    decision: Decision
    reason: str
    validated: Any = None
    read_only: bool = False
    idempotent: bool = False
    irreversible: bool = False
    #: The call is allowed but waits for a person's approval before any dispatch.
    approval: bool = False


def calls_decided(state: RunState, batch: CallTools, plans: list[CallPlan], *,
                  keys: list[str], max_parallel: int | None, parent_step: int | None,
                  now: Now) -> list[ev.Event]:
    """SPEC 5.9 and 6: a durable intent (CallDecided) for every call of the batch, in the
    model's order, and the CallDispatched of the allowed calls that start at once (the rest
    get theirs when they start): all of it rides one commit, before any dispatch."""
    step, stamp = state.model_steps, now.stamp()
    events: list[ev.Event] = []
    allowed: list[str] = []
    for index, (call, plan, key) in enumerate(zip(batch.calls, plans, keys, strict=True)):
        eid = f"{now.run_id}:{step}:{index}"
        events.append(ev.CallDecided(
            **stamp, execution_id=eid, idempotency_key=key, step=step, round=step,
            index=index, call_id=call.id, tool=call.name, arguments=call.arguments,
            decision=plan.decision, reason=plan.reason, parent_step=parent_step,
            read_only=plan.read_only, idempotent=plan.idempotent,
            irreversible=plan.irreversible, validated=plan.validated,
            approval=plan.approval and plan.decision == "allow"))
        if plan.decision == "allow" and not plan.approval:
            allowed.append(eid)
    at_once = allowed[:max_parallel] if max_parallel else allowed
    events.extend(ev.CallDispatched(**stamp, execution_id=eid, attempt=1) for eid in at_once)
    return events


def needs_review(actions: list[str]) -> Stop:
    """SPEC 6: actions only a person can settle (an irreversible one whose outcome is
    unknown, or what recovery could not reconcile or retry) end the run ``needs_review``."""
    return Stop("needs_review", detail="Unresolved: " + "; ".join(actions) + ".")


def awaiting_approval(state: RunState, now: Now) -> tuple[list[ev.Event], Stop]:
    """SPEC 14: calls that wait for a person end the run's turn ``awaiting_approval``: a
    person is asked for each call not yet asked (ApprovalRequested), and the round stays
    open until every one of them is decided."""
    stamp = now.stamp()
    held = [r for r in state.calls.values() if r.stage in ("held", "awaiting")]
    events: list[ev.Event] = [ev.ApprovalRequested(**stamp, execution_id=r.execution_id,
                                                   tool=r.tool)
                              for r in held if r.stage == "held"]
    names = "; ".join(f"{r.tool} {r.execution_id}" for r in held)
    return events, Stop("awaiting_approval", detail=f"Waiting: {names}.")


def held_calls(state: RunState) -> list[str]:
    """Execution ids of the round's calls that wait for a person (asked or not yet)."""
    return [e for e in state.round_calls if state.calls[e].stage in ("held", "awaiting")]


def round_ended(state: RunState, *, review: list[str], skipped: list[str], cancelled: bool,
                now: Now) -> tuple[list[ev.Event], Stop | None]:
    """SPEC 5.10-11: once every call of the round has an outcome, its calls and results
    enter the history in the model's order (RoundCompleted) and the loop goes on, unless an
    irreversible action's outcome is unknown (``needs_review``: the round stays open until
    a person resolves it), or calls were kept from running (why decides the status)."""
    if review:
        return [], needs_review(review)
    events: list[ev.Event] = [ev.RoundCompleted(run_id=now.run_id, ts=now.ts,
                                                elapsed_s=now.elapsed_s,
                                                step=state.model_steps)]
    if not skipped:
        return events, None
    if "lease" in skipped:
        return events, Stop("journal_unavailable", plain=True,
                            detail="This runner stopped starting work during the batch (it "
                                   "is shutting down, or its lease ran out: was the process "
                                   "paused?); it started nothing more. Another runner may "
                                   "take the run over.")
    if "journal" in skipped:
        return events, Stop("journal_unavailable",
                            detail="The journal became unavailable during the batch; calls "
                                   "not yet started were not run.")
    if "cancelled" in skipped or cancelled:
        return events, Stop("cancelled", detail="Calls not yet started were not run.")
    return events, Stop("limit_exceeded", "deadline", "Calls not yet started were not run.")


def run_finished(state: RunState, stop: Stop, budget: Budget, *, cancel_reason: str,
                 now: Now) -> ev.RunFinished:
    """SPEC 6: the run ends with a RunFinished carrying the RunResult's status, limit,
    explanation and counters."""
    if stop.status == "cancelled" and cancel_reason:
        stop = msgspec.structs.replace(stop, detail=journal_safe(
            f"Reason: {cancel_reason}. {stop.detail}".strip()))
    explanation = explain(stop, budget, len(state.unresolved))
    partial = partial_cost_sentence(state.usage)
    return ev.RunFinished(run_id=now.run_id, ts=now.ts, elapsed_s=now.elapsed_s,
                          status=stop.status, exhausted_limit=stop.limit,
                          explanation=f"{explanation} {partial}" if partial else explanation,
                          model_steps=state.model_steps,
                          tool_calls=state.tool_calls, usage=state.usage)


FieldsOf = Callable[[Any], dict[str, Any]]

#: The key of a result's fields that says it could not be recorded as it was (too deep,
#: cyclic, unrepresentable: its content says why); such a result is never ``too_large``.
UNKEEPABLE = "unkeepable"


def kept(fields: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """SPEC 9: a result's journal fields (content, size, keyed digest) as they are kept: a
    result over ``max_result_bytes`` is ``too_large``, and its content says so instead. A
    result that could not be recorded at all stays ``ok``: the action did take effect."""
    unkeepable = fields.pop(UNKEEPABLE, False)
    size = fields["size"]
    if limit is not None and size > limit and not unkeepable:
        fields["content"] = (f"the result was {size} bytes, over max_result_bytes={limit}; "
                             "it was not kept")
        fields["status"] = "too_large"
    return fields


def reconciled(execution_id: str, attempt: int, took: bool | None, value: Any, *,
               fields_of: FieldsOf, now: Now) -> list[ev.Event]:
    """SPEC 6: what ``reconcile`` said becomes a CallReconciled (took effect, with its
    result, which is never refused for size; or did not); "cannot tell" records nothing
    and the outcome stays unknown."""
    if took is None:
        return []
    stamp = now.stamp()
    if took is False:
        return [ev.CallReconciled(**stamp, execution_id=execution_id, attempt=attempt,
                                  took_effect=False)]
    fields = fields_of(value)
    fields.pop(UNKEEPABLE, None)  # a reconciled result is never refused for its size
    return [ev.CallReconciled(**stamp, execution_id=execution_id, attempt=attempt,
                              took_effect=True, **fields)]


def attempt_outcomes(execution_id: str, attempts: list[Attempt], *, final: bool, doubt: bool,
                     fields_of: FieldsOf, limit: int | None,
                     now: Now) -> tuple[list[ev.Event], bool]:
    """SPEC 5.10 and 6: the events of attempts that ended (``final``: the last of them is
    the call's last). A timeout is never a failure: it is ``outcome_unknown`` unless
    reconcile settles it, and a later attempt that fails after one that may have taken
    effect (``doubt``) leaves the outcome unknown too; a result over ``limit``
    (``max_result_bytes``) is ``too_large``. Returns the events and the doubt after
    them."""
    stamp, eid = now.stamp(), execution_id
    events: list[ev.Event] = []
    for i, att in enumerate(attempts):
        last = final and i == len(attempts) - 1
        if att.kind == "ok":
            events.append(ev.CallSucceeded(**stamp, execution_id=eid, attempt=att.attempt,
                                           latency_s=att.latency_s,
                                           **kept(fields_of(att.value), limit)))
        elif att.kind == "error":
            events.append(ev.CallFailed(**stamp, execution_id=eid, attempt=att.attempt,
                                        error_category=att.category,
                                        content=journal_safe(att.error),
                                        latency_s=att.latency_s, retrying=not last))
            if last and doubt:
                events.append(ev.CallOutcomeUnknown(
                    **stamp, execution_id=eid, attempt=att.attempt, content=journal_safe(
                        f"an earlier attempt timed out and may have taken effect; the "
                        f"last one failed ({att.error})")))
        else:
            events.append(ev.CallTimedOut(**stamp, execution_id=eid, attempt=att.attempt,
                                          timeout_s=att.timeout_s, latency_s=att.latency_s))
            if att.reconciled is not None:
                events.extend(reconciled(eid, att.attempt, att.reconciled,
                                         att.reconciled_value, fields_of=fields_of, now=now))
            elif last:
                events.append(ev.CallOutcomeUnknown(
                    **stamp, execution_id=eid, attempt=att.attempt,
                    content=att.error or "the call timed out; whether it took effect is "
                                         "not known"))
            doubt = doubt or att.reconciled is not False
    return events, doubt
