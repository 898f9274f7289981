"""The loop's checks, in the order of SPEC 5 (pure: time and flags are arguments)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

import msgspec

from boundloop.messages import CallTools, Final, Response
from boundloop.policy.budget import Budget, Usage, exceeded
from boundloop.policy.redact import journal_safe, storable
from boundloop.policy.replay import RunState
from boundloop.policy.safe_text import describe_exception


class Stop(msgspec.Struct, frozen=True):
    """The run ends with ``status`` (and ``limit`` when a budget stopped it)."""

    status: str
    limit: str | None = None
    detail: str = ""


class Malformed(msgspec.Struct, frozen=True):
    """The model's response could not be read; ``reason`` says what was wrong."""

    reason: str


def stop_limit(limit: str) -> Stop:
    """A ``limit_exceeded`` stop naming ``limit``."""
    return Stop("limit_exceeded", limit)


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


def parse_response(raw: Any) -> Response | Malformed:
    """SPEC 2: a Final or CallTools (Struct or dict form), else Malformed with a reason."""
    if isinstance(raw, Final | CallTools):
        try:
            raw = msgspec.to_builtins(raw)
        except TypeError as exc:
            return Malformed(f"the response holds a value that is not JSON-like ({exc})")
    if not isinstance(raw, dict):
        return Malformed(f"a response must be bl.Final, bl.CallTools or a dict, "
                         f"not {type(raw).__name__}")
    try:
        parsed: Response = msgspec.convert(raw, Response)
    except msgspec.ValidationError as exc:
        return Malformed(str(exc))
    if not storable(parsed):
        return Malformed("the response holds text that is not valid Unicode (a lone "
                         "surrogate) or an integer beyond 64 bits, which cannot be recorded")
    return parsed


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


def call_decision(name: str, known: Collection[str], *, tool_read_only: bool,
                  read_only_runner: bool, verdict: Any, invalid: str | None,
                  deadline_passed: bool, cancelled: bool) -> tuple[str, str]:
    """SPEC 5.9, one call, in order: unknown tool, permission, arguments, deadline.

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


def explain(stop: Stop, budget: Budget) -> str:
    """One or two plain sentences on why the run ended."""
    if stop.status == "limit_exceeded" and stop.limit is not None:
        value = budget.limit(stop.limit)
        what = {
            "model_steps": f"the model-step limit (max_model_steps={value}) was reached",
            "tool_calls": f"the tool-call limit (max_tool_calls={value}) was reached",
            "deadline": f"the deadline (deadline_s={value}) passed",
            "input_tokens": f"the input-token limit (max_input_tokens={value}) was reached",
            "output_tokens": f"the output-token limit (max_output_tokens={value}) was reached",
            "total_tokens": f"the total-token limit (max_total_tokens={value}) was reached",
            "cost": f"the cost limit (max_cost={value}) was reached",
        }[stop.limit]
        text = f"The run stopped because {what}."
        return f"{text} {stop.detail}" if stop.detail else text
    base = {
        "final": "The model gave a final answer.",
        "repeated_call": f"The model reused call id {stop.detail!r}, which was already "
                         "reserved in this run; nothing in that batch ran.",
        "cancelled": "The run was cancelled.",
        "malformed_response": f"The model's response was malformed: {stop.detail}",
        "model_error": f"The model callback raised: {stop.detail}",
        "needs_review": "An action's outcome is unknown and the runner cannot settle it by the "
                        "tool's own means (reconcile, or a retry of an idempotent tool); a "
                        f"person must resolve it. {stop.detail}",
        "journal_unavailable": "The journal could not record the run; nothing more was "
                               f"dispatched (fail closed). {stop.detail}",
        "rejected": f"Admission refused the run: {stop.detail}",
    }[stop.status]
    if stop.status in ("repeated_call", "malformed_response", "model_error"):
        return base
    if stop.status in ("cancelled", "final"):
        return f"{base} {stop.detail}".strip()
    return base.strip()


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
