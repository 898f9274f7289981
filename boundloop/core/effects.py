"""What a run asks for (issue #21): plain data, no callables. The interpreter performs each
effect after folding the Step's events, and answers with an input (``core.inputs``)."""

from __future__ import annotations

import msgspec

from boundloop import events as ev
from boundloop.core.budget import Remaining, Usage
from boundloop.results import RunResult


class Commit(msgspec.Struct, frozen=True):
    """Make every queued event durable (``Machine.pending``); answered by ``Committed``."""


class ChargeTree(msgspec.Struct, frozen=True):
    """Settle with the run tree's budget authority: charge own spend since the last time,
    reserve ``reserve`` tool calls (``reserve_tools`` by tool); ``close`` forgets the run.
    Answered by ``TreeReplied``."""

    reserve: int = 0
    tool_calls: int = 0
    usage: Usage | None = None
    close: bool = False
    tools: dict[str, int] = msgspec.field(default_factory=dict)
    reserve_tools: dict[str, int] = msgspec.field(default_factory=dict)


class Estimate(msgspec.Struct, frozen=True):
    """Reserve for the next model step (the runner's estimator, else the history's size);
    answered by ``Estimated``."""


class InvokeModel(msgspec.Struct, frozen=True):
    """Call the model for ``step`` on the run's transcript; answered by ``ModelReplied`` (or
    ``EffectFailed`` when the journal refused it)."""

    step: int
    tools_allowed: bool
    remaining: Remaining
    deadline: float | None


class CheckCalls(msgspec.Struct, frozen=True):
    """Copy the last response's calls, put those at ``permit`` (indexes) to the permission
    check, and validate every call of a known tool; the validated arguments are kept by
    execution id for ``StartCalls``. Answered by ``CallsChecked``."""

    execution_ids: list[str]
    #: None: the run has no permission check.
    permit: list[int] | None


class AskApproval(msgspec.Struct, frozen=True):
    """Ask the ``needs_approval`` rules of the calls at ``indexes`` of the batch; answered
    by ``ApprovalsRuled``."""

    indexes: list[int]


class Validate(msgspec.Struct, frozen=True):
    """Validate the recorded arguments of these calls (kept for ``StartCalls``); answered
    by ``Validated``."""

    execution_ids: list[str]


class Reconcile(msgspec.Struct, frozen=True):
    """Ask the call's tool whether the action took effect; answered by ``Reconciled``."""

    execution_id: str


class CallStart(msgspec.Struct, frozen=True):
    """One call to run with the arguments ``Validate``/``CheckCalls`` kept for it."""

    execution_id: str
    idempotency_key: str
    call_id: str
    tool: str
    first_attempt: int = 1
    #: True when the first attempt's CallDispatched rode the decisions' commit.
    recorded: bool = False


class StartCalls(msgspec.Struct, frozen=True):
    """Run these calls (at most ``max_parallel`` at once, ``allowance`` retries in all);
    a child run started by one draws on the run as it is at step ``link_step``. Answered by
    ``AttemptsEnded``; meanwhile ``AttemptStarting`` for attempts that start later."""

    calls: list[CallStart]
    max_parallel: int | None
    allowance: int
    link_step: int


class Retry(msgspec.Struct, frozen=True):
    """Try the call again after ``delay_s`` (its CallDispatched is made durable first, as
    every attempt's): the answer to ``AttemptFailed``."""

    execution_id: str
    delay_s: float = 0.0


class Finish(msgspec.Struct, frozen=True):
    """The run is over: its result."""

    result: RunResult


Effect = (Commit | ChargeTree | Estimate | InvokeModel | CheckCalls | AskApproval | Validate
          | Reconcile | StartCalls | Retry | Finish)


class Step(msgspec.Struct):
    """What one decision yields: events to fold and record, then effects to perform. A
    Step with neither a Finish nor an effect to answer asks to be given a ``Tick``."""

    events: list[ev.Event] = msgspec.field(default_factory=list)
    effects: list[Effect] = msgspec.field(default_factory=list)
