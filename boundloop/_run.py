"""What a run is given (``RunSpec``) and what its interpreter asks the supervisor to do:
the effects with the callables and objects they need (the pure ``core.effects`` name none),
and the helpers that run the user's permit and approval rules on a worker."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.actors.workers import RunLoop
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.context import ModelContext
from boundloop.core import rules as decide
from boundloop.core.budget import (
    Budget,
    Price,
    Usage,
)
from boundloop.core.effects import ChargeTree
from boundloop.core.replay import RunState
from boundloop.core.rules import Attempt as Attempt
from boundloop.messages import (
    Message,
    ToolCall,
)
from boundloop.policy.redact import (
    ARGUMENTS_NOT_KEPT,
    Scrubber,
    plain_result,
)
from boundloop.tools import Tool

Estimator = Callable[[list[Message], Any], Usage]
Permit = Callable[[ToolCall, Tool, ModelContext], Any]
_json = msgspec.json.Encoder()
_schemas_decoder = msgspec.json.Decoder(list[dict[str, Any]])


# -- effects the driver asks for --------------------------------------------------------
class Commit(msgspec.Struct):
    """Append these (journal-form) events durably; the reply is None or a JournalError."""

    events: list[ev.Event]


class InvokeModel(msgspec.Struct):
    """Call the model; the reply is a ModelReply."""

    model: Any
    history: list[Message]
    ctx: ModelContext


class ModelReply(msgspec.Struct):
    """What the model returned (or raised), and how long it took; ``abandoned`` says why
    the runner stopped waiting for it (``deadline``: it ran on past the deadline's grace;
    ``cancelled``: the run was cancelled before it got a thread)."""

    response: Any = None
    error: BaseException | None = None
    latency_s: float = 0.0
    abandoned: decide.SkipReason | None = None


class Planned(msgspec.Struct):
    """One allowed call, ready to run."""

    run_id: str
    execution_id: str
    idempotency_key: str
    call_id: str
    tool: Tool
    kwargs: dict[str, Any]
    first_attempt: int = 1
    #: True when the first attempt's CallDispatched rides the decision commit.
    recorded: bool = False


class ParentLink(msgspec.Struct):
    """What a child run started by a handler of this batch draws on (SPEC 8)."""

    run_id: str
    step: int
    budget: Budget
    tool_calls: int
    usage: Usage
    deadline: float | None
    cancel: CancelToken
    children: threading.Event
    #: The event loop of the run (the caller's, for ``arun``): children's run on it too.
    loop: asyncio.AbstractEventLoop | None = None
    #: The run's scrubber: a child starts knowing every secret its parent redacted.
    scrubber: Scrubber | None = None
    #: The run's accepted calls by tool, and its per-tool caps (tool name -> max_calls).
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)


class Dispatch(msgspec.Struct):
    """Run these calls (at most ``max_parallel`` at once); the reply is a list of Outcome."""

    calls: list[Planned]
    max_parallel: int | None
    deadline: float | None
    cancel: CancelToken
    retry_allowance: int
    clock: Clock
    run_child: Callable[..., Any] | None = None
    parent: ParentLink | None = None
    #: Set by whoever performs the effect: False once the journal can record nothing more.
    recordable: Callable[[], bool] | None = None
    #: Set by whoever performs the effect: False once this runner's lease lost its margin.
    leased: Callable[[], bool] | None = None
    #: Set by whoever performs the effect: ``record(execution_id, attempt, done)`` makes
    #: the attempt's CallDispatched durable, then calls ``done(None)`` (or the error).
    record: Callable[[str, int, list[Attempt], Callable[[BaseException | None], None]],
                     None] | None = None
    #: Set by whoever performs the effect: ``retry(failed, done)`` asks the run whether an
    #: attempt that failed is tried again; ``done(delay)`` answers (None: it is not).
    retry: Callable[[Any, Callable[[float | None], None]], None] | None = None
    #: Set by whoever performs the effect: where async handlers run (the run's loop).
    loop: RunLoop | asyncio.AbstractEventLoop | None = None
    #: The run's ownership epoch, given to handlers as a fencing token.
    epoch: int = 0


class Outcome(msgspec.Struct):
    """What became of one planned call; ``skipped`` names why it never ran."""

    execution_id: str
    attempts: list[Attempt] = msgspec.field(default_factory=list)
    skipped: str | None = None


class Reconcile(msgspec.Struct):
    """Ask the tool's ``reconcile`` whether the action took effect; the reply is
    ``(took_effect, result)`` with ``took_effect`` None when it cannot tell."""

    planned: Planned
    loop: RunLoop | asyncio.AbstractEventLoop | None = None


class Ledger(msgspec.Struct):
    """``core``'s ``ChargeTree`` for run ``run_id``, to the budget authority; the reply is
    a LedgerReply (what descendants spent, whether the reservation was granted, what the
    ancestors have left)."""

    run_id: str
    charge: ChargeTree


class CallUser(msgspec.Struct):
    """Call user code (an estimator, the permit check) off the supervisor's thread; the
    reply is a ModelReply holding its value or the exception it raised. Like a model call,
    it is abandoned past the run's deadline (plus grace)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    deadline: float | None = None
    cancel: CancelToken | None = None


def _permits(permit: Permit, calls: list[tuple[ToolCall, Tool]], ctx: ModelContext) -> list[Any]:
    """Every verdict of ``permit`` for a batch, in order (an exception stands for itself)."""
    verdicts: list[Any] = []
    for call, tool in calls:
        try:
            verdict = permit(call, tool, ctx)
        except Exception as exc:  # noqa: BLE001 - a failing permit denies (fail closed)
            verdict = exc
        if inspect.isawaitable(verdict):  # a sync callable that returned a coroutine
            if inspect.iscoroutine(verdict):
                verdict.close()
            verdict = TypeError("permit returned an awaitable from a plain function; make "
                                "it `async def` to have it awaited")
        verdicts.append(verdict)
    return verdicts


async def _apermits(permit: Permit, calls: list[tuple[ToolCall, Tool]],
                    ctx: ModelContext) -> list[Any]:
    """``_permits`` for an ``async def`` permit: each verdict awaited, in order, on the loop
    the run's async code runs on (the caller's, for a run started with ``arun``)."""
    verdicts: list[Any] = []
    for call, tool in calls:
        try:
            verdicts.append(await permit(call, tool, ctx))
        except Exception as exc:  # noqa: BLE001 - a failing permit denies (fail closed)
            verdicts.append(exc)
    return verdicts


def _approvals(rules: list[tuple[Any, ToolCall]], ctx: ModelContext) -> list[bool]:
    """Each ``needs_approval`` rule's answer for its call; a rule that raises or does not
    answer a bool asks for approval (fail closed: a person looks rather than nobody)."""
    out: list[bool] = []
    for rule, call in rules:
        try:
            verdict = rule(call, ctx)
        except Exception:  # noqa: BLE001 - a failing rule asks a person
            verdict = True
        if inspect.iscoroutine(verdict):
            verdict.close()
            verdict = True
        out.append(verdict if isinstance(verdict, bool) else True)
    return out


Effect = Commit | InvokeModel | Dispatch | Reconcile | Ledger | CallUser

# -- the run's fixed inputs ----------------------------------------------------------------
class RunSpec(msgspec.Struct, kw_only=True, weakref=True):
    """Everything a run needs that does not change while it runs (weakly referenced by the
    watch on its deadline: a timer far in the future keeps no run's history alive)."""

    run_id: str
    model: Any
    tools: dict[str, Tool]
    budget: Budget
    history: list[Message]
    cancel: CancelToken
    secret_key: bytes
    clock: Clock
    owner: str = ""
    #: True while the runner's lease has its safety margin left (SPEC 6 self-fencing).
    lease_ok: Callable[[], bool] | None = None
    permit: Permit | None = None
    read_only: bool = False
    #: A price table, ``"auto"`` (the genai-prices catalogue, ``boundloop.pricing``), or None.
    price: Price | str | None = None
    #: What a run priced by the catalogue does with a step it cannot price: ``"fail"``
    #: (a run with ``max_cost`` stops, fail closed) or ``"partial"`` (it goes on).
    unpriced: str = "fail"
    estimator: Estimator | None = None
    parent_run_id: str | None = None
    parent_step: int | None = None
    parent_execution_id: str | None = None
    #: The parent's deadline (on ``clock``), for a child run.
    parent_deadline: float | None = None
    run_child: Callable[..., Any] | None = None
    children: threading.Event = msgspec.field(default_factory=threading.Event)
    resume: RunState | None = None
    #: Where ``async def`` models, tools, permits and reconcilers run: the caller's event
    #: loop for a run started with ``arun`` (SPEC 1), else the runner's own (None).
    loop: asyncio.AbstractEventLoop | None = None
    #: What the run's texts are scrubbed with (SPEC 9); the runner keeps it for a resume.
    scrubber: Scrubber | None = None
    #: The agent the run runs (SPEC 14: name and version) and the run's labels.
    agent: str = ""
    agent_version: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)


def content_of(value: Any) -> Any:
    """A tool result as JSON-like data that the journal can store (what the model and the
    journal see); never raises. A value that cannot be recorded (nested deeper than
    ``redact.MAX_DEPTH`` levels, containing itself, or not convertible) becomes a sentence
    saying why; a dict stays a dict (``{"(arguments not kept)": why}``), so validated
    arguments keep their type."""
    content, _, why = plain_result(value)
    return {ARGUMENTS_NOT_KEPT: content} if why is not None and isinstance(value, dict) \
        else content


def elapsed_before_start(spec: RunSpec) -> float:
    """The run's active time before it (re)starts now: what its events say, plus the time
    it has waited for a person since its turn ended awaiting approval (the deadline runs on
    meanwhile, SPEC 14)."""
    state = spec.resume
    if state is None:
        return 0.0
    if state.waiting_since is None:
        return state.elapsed_s
    return state.elapsed_s + max(spec.clock.time() - state.waiting_since, 0.0)


def run_deadline(spec: RunSpec, now: float) -> float | None:
    """The run's deadline on its clock, for a run (re)started at ``now``, or None."""
    deadline_s = spec.budget.deadline_s
    elapsed_before = elapsed_before_start(spec)
    deadline = None if deadline_s is None else now + max(deadline_s - elapsed_before, 0.0)
    if spec.parent_deadline is not None:
        # Its budget's deadline_s was what the parent had left a moment ago: the parent's
        # own deadline bounds it exactly, at any depth (SPEC 8).
        deadline = spec.parent_deadline if deadline is None else \
            min(deadline, spec.parent_deadline)
    return deadline


