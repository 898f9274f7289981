"""The closed vocabularies of a run, defined once (DESIGN rule 3).

Each ``Literal`` type names the values one field may take; the matching frozenset is what
the replay fold checks an event's string against (events keep plain ``str`` fields, so an
old journal always decodes: an unknown value is refused by the fold, with a message, not by
the decoder).
"""

from __future__ import annotations

from typing import Literal, get_args

#: The policy's decision on one call (``CallDecided.decision``, SPEC 5 step 9): ``skipped``
#: when cancellation or the deadline kept an accepted call from running.
Decision = Literal["allow", "denied", "invalid_arguments", "unknown_tool", "skipped"]

#: How far a call got (SPEC 6): its intent is recorded, an attempt was dispatched, or its
#: result is known (or declared unknown).
Phase = Literal["intended", "dispatched", "done"]

#: How a run ended (SPEC 3, ``RunFinished.status``); ``awaiting_approval`` ends only the
#: run's turn: a person's decision makes it go on (SPEC 14).
RunStatus = Literal["final", "limit_exceeded", "repeated_call", "cancelled",
                    "malformed_response", "model_error", "needs_review",
                    "journal_unavailable", "rejected", "awaiting_approval"]

#: The limit that stopped a run (``RunFinished.exhausted_limit``, SPEC 1).
Limit = Literal["model_steps", "tool_calls", "deadline", "input_tokens", "output_tokens",
                "total_tokens", "cost"]

#: A call's result as the model sees it (the ``tool_result`` statuses of SPEC 2).
CallStatus = Literal["ok", "error", "denied", "invalid_arguments", "unknown_tool",
                     "outcome_unknown", "too_large"]

#: What the fold keeps as a call's status: a SPEC 2 status, or ``skipped`` (an accepted
#: call that never ran and never enters the history).
RecordStatus = CallStatus | Literal["skipped"]

#: ``CallSucceeded.status``: the attempt returned; ``too_large``: its result was over
#: max_result_bytes (a result that cannot be recorded is ``ok``, its content says why).
SucceededStatus = Literal["ok", "too_large"]

#: A person's decision on an unresolved action (``CallResolved.outcome``, SPEC 6).
Resolution = Literal["succeeded", "failed", "abandoned"]

#: Where a call stands in the fold's transition table (``CallRecord.stage``):
#: ``intended`` (allowed, no attempt dispatched), ``running`` (an attempt dispatched, its
#: outcome not recorded), ``failed_retrying`` (the attempt raised, another follows),
#: ``timed_out`` (the attempt timed out; reconcile, a retry or ``outcome_unknown`` follows),
#: ``not_taken`` (reconcile said the attempt did not take effect; a retry may follow),
#: ``unknown`` (the result is ``outcome_unknown``; open until resolved), ``failed`` (the last
#: attempt raised) and ``closed`` (nothing more can happen to the call); ``held`` (allowed,
#: waits for approval, not yet asked) and ``awaiting`` (a person was asked: ApprovalRequested).
CallStage = Literal["intended", "running", "failed_retrying", "timed_out", "not_taken",
                    "unknown", "failed", "closed", "held", "awaiting"]

DECISIONS: frozenset[str] = frozenset(get_args(Decision))
PHASES: frozenset[str] = frozenset(get_args(Phase))
RUN_STATUSES: frozenset[str] = frozenset(get_args(RunStatus))
LIMITS: frozenset[str] = frozenset(get_args(Limit))
CALL_STATUSES: frozenset[str] = frozenset(get_args(CallStatus))
SUCCEEDED_STATUSES: frozenset[str] = frozenset(get_args(SucceededStatus))
RESOLUTIONS: frozenset[str] = frozenset(get_args(Resolution))
CALL_STAGES: frozenset[str] = frozenset(get_args(CallStage))


# -- named rules over the vocabularies -----------------------------------------------------
# Modules outside the pure core ask these instead of comparing the values themselves
# (tests/test_vocabulary.py): what a value means to the rest of the package is written once.

#: A finished run's statuses that wait for a person: to resolve an action (``needs_review``)
#: or to decide a call (``awaiting_approval``); ``resume`` takes such a run up.
WAITING_STATUSES: frozenset[str] = frozenset({"needs_review", "awaiting_approval"})
#: Statuses a run ends with that ``resume`` continues (besides runs left open).
RESUMABLE_STATUSES: frozenset[str] = WAITING_STATUSES | {"journal_unavailable"}
#: A call's statuses that say it did not happen: skipped, or its attempt raised.
NOT_RUN_STATUSES: frozenset[str] = frozenset({"skipped", "error"})


def is_final(status: str | None) -> bool:
    """The run ended with the model's final answer."""
    return status == "final"


def needs_review(status: str | None) -> bool:
    """The run stopped at an action whose outcome a person must resolve."""
    return status == "needs_review"


def awaits_approval(status: str | None) -> bool:
    """The run's turn ended waiting for a person to approve or deny a call."""
    return status == "awaiting_approval"


def is_rejected(status: str | None) -> bool:
    """Admission refused the run: nothing of it ran."""
    return status == "rejected"


def is_journal_unavailable(status: str | None) -> bool:
    """The run stopped because the journal could not record it (or this runner was fenced)."""
    return status == "journal_unavailable"


def is_cancelled(status: str | None) -> bool:
    """The run was cancelled."""
    return status == "cancelled"


def is_limit_exceeded(status: str | None) -> bool:
    """A budget limit stopped the run (its ``exhausted_limit`` says which)."""
    return status == "limit_exceeded"


def is_ok(status: str | None) -> bool:
    """A call's result is what its tool returned."""
    return status == "ok"


def is_error(status: str | None) -> bool:
    """A call's (last) attempt raised."""
    return status == "error"


def is_too_large(status: str | None) -> bool:
    """A call's result was over ``max_result_bytes``: the model sees a note instead."""
    return status == "too_large"


def is_allowed(decision: str | None) -> bool:
    """The policy let the call run."""
    return decision == "allow"


def is_denied(decision: str | None) -> bool:
    """The permit (or read-only mode, or a person) refused the call."""
    return decision == "denied"


def is_skipped(decision: str | None) -> bool:
    """An accepted call never ran: cancellation or the deadline came first."""
    return decision == "skipped"


def has_invalid_arguments(decision: str | None) -> bool:
    """The call's arguments did not match its tool's schema."""
    return decision == "invalid_arguments"


def is_deadline(limit: str | None) -> bool:
    """The limit is the run's wall-clock deadline."""
    return limit == "deadline"


def awaits_decision(stage: str | None) -> bool:
    """The call waits for a person's decision (``ApprovalRequested`` recorded)."""
    return stage == "awaiting"
