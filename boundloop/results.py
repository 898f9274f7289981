"""What a run reports: RunResult and the actions it lists."""

from __future__ import annotations

import msgspec

from boundloop.core.budget import Usage
from boundloop.core.kinds import RunStatus
from boundloop.messages import Message

__all__ = ["CompletedAction", "RunResult", "UnresolvedAction"]


class CompletedAction(msgspec.Struct, frozen=True):
    """A call whose result is known: its call id, tool, result status and attempts."""

    call_id: str
    tool: str
    status: str
    attempts: int
    execution_id: str = ""


class UnresolvedAction(msgspec.Struct, frozen=True):
    """An action whose outcome is not known.

    ``phase`` is ``dispatched`` when the journal recorded its dispatch, else ``intended``.
    ``abandoned`` is True once a person closed it without knowing (it stays listed).
    """

    run_id: str
    call_id: str
    tool: str
    execution_id: str
    idempotency_key: str
    attempt: int
    phase: str
    abandoned: bool = False


class RunResult(msgspec.Struct, frozen=True):
    """How a run ended (SPEC 1)."""

    run_id: str
    #: One of the statuses of SPEC 3 (``boundloop.core.kinds.RunStatus``).
    status: RunStatus
    exhausted_limit: str | None
    explanation: str
    model_steps: int
    tool_calls: int
    transcript: list[Message]
    completed: list[CompletedAction]
    unresolved: list[UnresolvedAction]
    usage: Usage
    elapsed_s: float

