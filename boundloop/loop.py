"""One run's orchestration, written as a generator of effect requests.

``drive(spec)`` yields what it needs done (``Commit`` events, ``InvokeModel``,
``Dispatch`` calls) and is sent the results; it performs no I/O, starts no thread and never
blocks. The supervisor actor performs the effects; tests can drive it with fakes. Decisions
come from ``policy.decide`` and every event is folded into the live state with
``policy.replay.apply``: the same state machine that rebuilds the run from its journal.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import threading
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop import pricing
from boundloop.actors.workers import RunLoop, is_async
from boundloop.cancel import CancelToken
from boundloop.clock import Clock
from boundloop.context import ModelContext
from boundloop.core import rules as decide
from boundloop.core.budget import (
    Budget,
    LedgerReply,
    Price,
    Usage,
    add_counts,
    default_reservation,
    priced,
    remaining,
    sub_counts,
    within_tree,
)
from boundloop.core.kinds import Decision
from boundloop.core.replay import RunState, apply
from boundloop.core.rules import Attempt as Attempt
from boundloop.errors import JournalError, LeaseLost, SequenceConflict
from boundloop.messages import (
    AssistantMessage,
    CallMessage,
    CallTools,
    Message,
    ToolCall,
    ToolResultMessage,
    copy_history,
)
from boundloop.policy.redact import (
    ARGUMENTS_NOT_KEPT,
    KEPT_FIELDS,
    Scrubber,
    journal_safe,
    plain_result,
    same_value,
)
from boundloop.policy.safe_text import describe_exception
from boundloop.results import RunResult, UnresolvedAction
from boundloop.tools import ArgumentError, Tool

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
    """Settle with the budget authority: charge own spend since the last time, reserve
    ``reserve`` tool calls; the reply is a LedgerReply (what descendants spent, whether the
    reservation was granted, what the ancestors have left). ``close`` forgets the run."""

    run_id: str
    reserve: int = 0
    tool_calls: int = 0
    usage: Usage | None = None
    close: bool = False
    #: Own calls by tool since the last time (part of ``tool_calls``), and the calls of
    #: the batch to reserve by tool (part of ``reserve``), for per-tool caps.
    tools: dict[str, int] = msgspec.field(default_factory=dict)
    reserve_tools: dict[str, int] = msgspec.field(default_factory=dict)


class CallUser(msgspec.Struct):
    """Call user code (an estimator, the permit check) off the supervisor's thread; the
    reply is a ModelReply holding its value or the exception it raised. Like a model call,
    it is abandoned past the run's deadline (plus grace)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    deadline: float | None = None
    cancel: CancelToken | None = None


class EstimatorFailed(Exception):
    """The runner's estimator raised or returned something unusable (ends the run)."""


class EstimatorAbandoned(Exception):
    """The estimator was still running at the deadline, or the run was cancelled first."""


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

#: Who closes an approved call that cannot be sent (``CallResolved.by``).
RUNNER = "boundloop"

#: Why a nested run's call that needs approval is denied (SPEC 14, SPEC 8).
NESTED_APPROVAL = ("it needs a person's approval, and a nested run cannot wait for one; "
                   "call the tool from the parent run")

#: What an attempt that ran leaves: recorded even when the run stops on a fenced runner.
_ATTEMPT_FACTS = (ev.CallSucceeded, ev.CallFailed, ev.CallTimedOut, ev.CallOutcomeUnknown,
                  ev.CallReconciled)


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


def idempotency_key(run_id: str, call_id: str) -> str:
    """The key every attempt of one logical call shares."""
    return hashlib.sha256(f"{run_id}\x00{call_id}".encode()).hexdigest()[:32]


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


class Driver:
    """One run's orchestration: ``run()`` is the generator of effects; the supervisor may
    also ask it for the events of an attempt that starts mid-batch (``attempt_events``)
    and for an orderly end when driving it failed (``fail``)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.budget = spec.budget
        self.clock = spec.clock
        self.state = spec.resume if spec.resume is not None else RunState()
        self.pending: list[ev.Event] = []
        self.unrecorded: set[str] = set()
        self.never_dispatched: set[str] = set()
        self.uninvoked = 0  # model steps started but refused before the model was called
        self.started = self.clock.monotonic()
        self.elapsed_before = elapsed_before_start(spec)
        self.deadline = run_deadline(spec, self.started)
        self.schemas = _json.encode([t.schema for t in spec.tools.values()])
        # The run tree's ledger (SPEC 8): a child settles from the start; a parent once a
        # handler of it started a child. ``charged`` is own spend already charged.
        self.ledger_open = spec.parent_run_id is not None and spec.resume is None
        self.charged: tuple[int, Usage] = (0, Usage())
        self.snapshot: tuple[int, Usage] = (0, Usage())
        # The same, by tool (per-tool caps travel up the tree as tool_calls do).
        self.charged_tools: dict[str, int] = {}
        self.snapshot_tools: dict[str, int] = {}
        #: The run's per-tool caps (``bl.tool(max_calls=N)``): tool name -> N.
        self.caps = {name: t.max_calls for name, t in spec.tools.items()
                     if t.max_calls is not None}
        #: A nested run's last reservation: the calls of the batch's capped tools the run
        #: tree granted, and the ancestors' caps that bound them.
        self.tree_tools: tuple[dict[str, int], dict[str, int]] | None = None
        self.current = self.budget
        self.sized = (0, 2)  # messages measured, compact JSON bytes of the list "[...]"
        # Per call: attempts whose outcome is recorded, and calls an attempt of which may
        # have taken effect (a timeout not reconciled as "did not").
        self.attempts_recorded: dict[str, int] = {}
        self.unknown: set[str] = set()
        # SPEC 9: every value redacted in the run is remembered and replaced in every later
        # text the run journals (a resumed run: see Runner._submit_resume).
        self.scrubber = spec.scrubber if spec.scrubber is not None else \
            Scrubber(spec.secret_key)
        #: True once the run's last commit gives up its ownership (awaiting approval).
        self.releasing = False
        # Priced by the catalogue: the Runner's price="auto", or the model adapter's.
        self.catalogue = pricing.prices_by_catalogue(spec.price, spec.model)
        self.table = spec.price if isinstance(spec.price, Price) else None

    # -- bookkeeping -------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.elapsed_before + (self.clock.monotonic() - self.started)

    def emit(self, make: Callable[..., ev.Event], **fields: Any) -> ev.Event:
        event = self._for_journal(make(run_id=self.spec.run_id, ts=self.clock.time(),
                                       elapsed_s=self.elapsed(), **fields))
        # The live state is folded from exactly the events the journal stores.
        apply(self.state, event)
        self.pending.append(event)
        return event

    def now(self) -> decide.Now:
        """The decider's clock and id inputs, read once per decision."""
        clock = self.clock  # elapsed(), inline: read for every decision
        return decide.Now(self.spec.run_id, clock.time(),
                          self.elapsed_before + (clock.monotonic() - self.started))

    def take(self, events: list[ev.Event]) -> list[ev.Event]:
        """Record what the decider decided: each event in its journal form (redacted) is
        folded into the live state and queued for the next commit."""
        out = []
        for event in events:
            event = self._for_journal(event)
            apply(self.state, event)
            self.pending.append(event)
            out.append(event)
        return out

    def _redact(self, tool_name: str, value: Any) -> tuple[Any, bool]:
        if value is None or (type(value) is dict and not value):  # nothing to redact
            return value, False
        tool = self.spec.tools.get(tool_name)
        return self.scrubber.redact(value, tool.sensitive if tool else ())

    def _for_journal(self, event: ev.Event) -> ev.Event:
        """The event as the journal stores it (SPEC 9): credential and sensitive fields of
        arguments and results become keyed digests (and are remembered), then every text
        the event carries is scrubbed (remembered values, credential-shaped text)."""
        replace = msgspec.structs.replace
        match event:
            case ev.CallDecided():
                args, changed = self._redact(event.tool, event.arguments)
                if event.validated is None:
                    validated, also = None, False
                elif same_value(event.validated, event.arguments):  # validation changed nothing
                    validated, also = args, changed
                else:
                    validated, also = self._redact(event.tool, event.validated)
                event = replace(event, arguments=args, redacted=changed or also,
                                validated=validated, tool=self._tool_name(event.tool))
            case ev.CallFailed():
                # An exception class's name is text its code chose (SPEC 9).
                category = self.scrubber.text(event.error_category)
                if category != event.error_category:
                    event = replace(event, error_category=category)
            case ev.CallSucceeded() | ev.CallReconciled():
                rec = self.state.calls[event.execution_id]
                content, changed = self._redact(rec.tool, event.content)
                if changed:
                    event = replace(event, content=content)
            case ev.ModelStepCompleted(response=CallTools() as resp):
                calls = [replace(c, arguments=self._redact(c.name, c.arguments)[0])
                         for c in resp.calls]
                calls = [replace(c, name=self._tool_name(c.name)) for c in calls]
                # Provider blocks (a server tool's input, say) hold credential keys too.
                content = resp.content if resp.content is None else \
                    self.scrubber.redact(resp.content)[0]
                event = replace(event, response=replace(resp, calls=calls, content=content))
            case ev.RunAdmitted():
                labels = self.scrubber.redact(event.labels)[0] if event.labels else {}
                event = replace(event, history=[self._redact_message(m)
                                                for m in event.history],
                                labels={str(k): str(v) for k, v in labels.items()})
            case _:
                pass
        scrubbed: ev.Event = self.scrubber.struct(event, self._kept)[0]
        return scrubbed

    @staticmethod
    def _kept(cls: type) -> frozenset[str]:
        """Fields the text scrubbing leaves alone: ids, names and categories (a failed
        step's ``reason``), and arguments already redacted with their ``redacted`` flag."""
        if cls is ev.ModelStepFailed:
            return KEPT_FIELDS | {"reason"}
        if cls is ev.CallDecided:
            return KEPT_FIELDS | {"arguments", "validated"}
        return KEPT_FIELDS

    def _tool_name(self, name: str) -> str:
        """A called tool's name as the journal keeps it: one of the run's tools as it is (a
        remembered value equal to it must not rename it), any other (an unknown tool the
        model named) scrubbed as the text the model wrote that it is (SPEC 9)."""
        if name in self.spec.tools or not isinstance(name, str):
            return name
        return self.scrubber.text(name)

    def _redact_message(self, m: Message) -> Message:
        if isinstance(m, CallMessage):
            return msgspec.structs.replace(m, arguments=self._redact(m.name, m.arguments)[0],
                                           name=self._tool_name(m.name))
        if isinstance(m, ToolResultMessage | AssistantMessage) and m.content is not None:
            return msgspec.structs.replace(m, content=self.scrubber.redact(m.content)[0])
        return m

    def commit(self) -> Generator[Effect, Any, None]:
        batch, self.pending = self.pending, []
        try:
            yield Commit(batch)
        except JournalError:
            self.lose(batch)
            raise

    def lose(self, batch: list[ev.Event]) -> None:
        """Note what events that will never be recorded meant for the run's report."""
        self.unrecorded.update(
            e.execution_id for e in batch
            if isinstance(e, ev.CallSucceeded | ev.CallFailed | ev.CallOutcomeUnknown
                          | ev.CallReconciled | ev.CallTimedOut))
        # Calls decided in a lost commit were never dispatched: nothing is unknown.
        self.never_dispatched.update(e.execution_id for e in batch
                                     if isinstance(e, ev.CallDecided))

    # -- the run -----------------------------------------------------------------------
    def admit(self, owner: str, queued: bool = False) -> ev.Event:
        """The run's RunAdmitted (pending, in its journal form); ``queued``: enqueued, with
        no owner until a worker takes it."""
        spec = self.spec
        return self.emit(ev.RunAdmitted, budget=self.budget, history=spec.history,
                         tools=sorted(spec.tools), owner=owner,
                         parent_run_id=spec.parent_run_id, parent_step=spec.parent_step,
                         parent_execution_id=spec.parent_execution_id, agent=spec.agent,
                         agent_version=spec.agent_version, labels=spec.labels, queued=queued,
                         tool_caps=self.caps)

    def run(self) -> Generator[Effect, Any, RunResult]:
        spec = self.spec
        if spec.resume is None:
            self.admit(spec.owner)
        else:
            self.emit(ev.RunResumed, owner=spec.owner)
        try:
            yield from self.commit()
        except SequenceConflict:
            self.pending = []
            if spec.resume is not None:
                # Appended to between its claim and now (a person's decision, say): nothing
                # was done here; the run is as the journal says.
                return self.unavailable(f"Run {spec.run_id!r} changed while it was being "
                                        "resumed (another writer appended to it); nothing "
                                        "was done here: resume it again.", plain=True)
            # Another runner admitted a run with this id first: this one never started.
            refused = decide.Stop("rejected", detail=f"a run with id {spec.run_id!r} "
                                                     "already exists in the journal; use a new id")
            self.state.status = refused.status
            self.state.explanation = decide.explain(refused, self.budget)
            return self.result()
        except JournalError as exc:
            return self.unavailable(f"It could not record the run's start ({exc}); nothing ran.")
        step = self.settle if spec.resume is not None else self.round
        while True:
            try:
                stop = yield from step()
            except JournalError as exc:
                # A lost lease is this runner's, not the journal's failing: it says so alone.
                stop = decide.Stop("journal_unavailable", detail=str(exc),
                                   plain=isinstance(exc, LeaseLost))
            if stop is not None:
                return (yield from self.finish(stop))
            step = self.round

    def settle(self) -> Generator[Effect, Any, decide.Stop | None]:
        """Resolve what a crash left open, by the tools' own means (SPEC 6): reconcile, then
        retry an idempotent tool under the same key; anything else goes to a person."""
        spec, st = self.spec, self.state
        review: list[str] = []
        for rec in [r for r in st.calls.values() if r.open]:
            tool = spec.tools.get(rec.tool)
            if tool is None:
                review.append(f"{rec.tool} {rec.execution_id} (tool not given to resume)")
                continue
            attempt = max(rec.attempt, 1)
            # Arguments redacted in the journal cannot be sent again (SPEC 6).
            retryable = tool.idempotent and not rec.redacted
            planned = Planned(spec.run_id, rec.execution_id, rec.idempotency_key, rec.call_id,
                              tool, {}, first_attempt=attempt + 1)
            if tool.reconcile is not None:
                took, value = yield Reconcile(planned)
                self.reconciled(rec.execution_id, attempt, took, value)
                if took is True or (took is False and not retryable):
                    continue
            if not retryable:
                why = "its arguments were redacted" if rec.redacted else "it is not idempotent"
                review.append(f"{rec.tool} {rec.execution_id} ({why} and cannot be reconciled)")
                continue
            try:
                planned.kwargs = tool.validate(rec.arguments)
            except ArgumentError as exc:
                review.append(f"{rec.tool} {rec.execution_id} (arguments no longer valid: {exc})")
                continue
            if st.tool_calls >= self.budget.max_tool_calls or self.deadline_passed():
                self.emit(ev.CallOutcomeUnknown, execution_id=rec.execution_id, attempt=attempt,
                          content="the call's outcome is unknown and no budget is left to retry it")
                continue
            allowance = self.budget.max_tool_calls - st.tool_calls - 1
            outcomes = yield Dispatch([planned], 1, self.deadline, spec.cancel, allowance,
                                      self.clock, spec.run_child, self.link(rec.step),
                                      epoch=st.epoch)
            for outcome in outcomes:
                if outcome.skipped:
                    # Its retry's dispatch may be recorded already: name the last attempt.
                    self.emit(ev.CallOutcomeUnknown, execution_id=rec.execution_id,
                              attempt=max(st.calls[rec.execution_id].attempt, 1),
                              content=f"the retry was not run: {outcome.skipped}")
                else:
                    self.record(outcome)
        skipped = yield from self.dispatch_approved(review)
        if review:
            return decide.needs_review(review)
        if st.round_calls:
            return self.end_round([], skipped)
        return None

    def dispatch_approved(self, review: list[str]) -> Generator[Effect, Any, list[str]]:
        """Dispatch the calls a person approved (SPEC 14): each attempt's CallDispatched is
        durable before it starts, as always; returns why calls were kept from running."""
        spec, st = self.spec, self.state
        planned: list[Planned] = []
        skipped: list[str] = []
        for eid in list(st.round_calls):
            rec = st.calls[eid]
            if not (rec.approved and rec.attempt == 0 and rec.stage == "intended"):
                continue
            tool = spec.tools.get(rec.tool)
            why = "tool not given to resume" if tool is None else \
                "its arguments were redacted in the journal" if rec.redacted else None
            if tool is not None and why is None:
                try:
                    kwargs = tool.validate(rec.arguments)
                except ArgumentError as exc:
                    why = f"arguments no longer valid: {exc}"
            if why is not None or tool is None:
                # It never ran and cannot be sent from here: closed as not done, in words
                # the model and the report show (a person approved it; nobody can send it).
                self.emit(ev.CallResolved, execution_id=eid, outcome="failed", by=RUNNER,
                          note=f"approved, but not sent: {why}")
                continue
            planned.append(Planned(spec.run_id, eid, rec.idempotency_key, rec.call_id, tool,
                                   kwargs))
        if not planned:
            return skipped
        allowance = self.budget.max_tool_calls - st.tool_calls
        outcomes = yield Dispatch(planned, self.budget.max_parallel, self.deadline,
                                  spec.cancel, allowance, self.clock, spec.run_child,
                                  self.link(st.model_steps), epoch=st.epoch)
        for outcome in outcomes:
            self.record(outcome)
            if outcome.skipped:
                skipped.append(outcome.skipped)
        review.extend(f"{p.tool.name} {p.execution_id}" for p in planned
                      if p.tool.irreversible
                      and st.calls[p.execution_id].status == "outcome_unknown")
        return skipped

    def unavailable(self, detail: str, plain: bool = False) -> RunResult:
        """The result of a run the journal failed: it says so, and nothing more is written."""
        self.lose(self.pending)
        self.pending = []
        stop = decide.Stop("journal_unavailable", detail=detail, plain=plain)
        self.state.status = stop.status
        self.state.explanation = decide.explain(stop, self.budget)
        return self.result()

    def result(self) -> RunResult:
        result = self.state.result(self.elapsed())
        if self.unrecorded or self.never_dispatched:
            lost = [self.state.calls[e] for e in self.unrecorded if e in self.state.calls]
            result = msgspec.structs.replace(
                result,
                completed=[c for c in result.completed
                           if c.execution_id not in self.unrecorded],
                unresolved=[u for u in result.unresolved
                            if u.execution_id not in self.never_dispatched] + [
                    UnresolvedAction(self.spec.run_id, r.call_id, r.tool, r.execution_id,
                                     r.idempotency_key, max(r.attempt, 1), "dispatched")
                    for r in lost])
        if self.uninvoked:
            result = msgspec.structs.replace(
                result, model_steps=max(result.model_steps - self.uninvoked, 0))
        if result.status == "journal_unavailable" and result.unresolved:
            # No RunFinished carries this explanation: it counts what the result lists.
            result = msgspec.structs.replace(result, explanation=(
                f"{result.explanation} "
                f"{decide.unresolved_sentence(len(result.unresolved))}"))
        return result

    def link(self, step: int) -> ParentLink:
        """What a child started by a handler of this step draws on; notes the run's own
        spend at the moment, the base of its ledger should a child start."""
        st = self.state
        self.snapshot = (st.tool_calls - st.child_tool_calls, st.usage - st.child_usage)
        self.snapshot_tools = sub_counts(st.tool_counts, st.child_tool_counts)
        return ParentLink(self.spec.run_id, step, self.current, st.tool_calls, st.usage,
                          self.deadline, self.spec.cancel, self.spec.children, self.spec.loop,
                          self.scrubber, dict(st.tool_counts), dict(self.caps))

    def uncharged(self) -> bool:
        """True when the run has own tool calls the run tree's ledger does not know yet."""
        st = self.state
        return st.tool_calls - st.child_tool_calls > self.charged[0]

    def settle_ledger(self, reserve: int = 0, close: bool = False,
                      reserve_tools: dict[str, int] | None = None,
                      ) -> Generator[Effect, Any, LedgerReply | None]:
        """Charge own spend to the run tree, fold what descendants spent, and (for a child)
        reserve ``reserve`` tool calls (``reserve_tools`` of them by tool, for per-tool
        caps) against every ancestor at once."""
        spec, st = self.spec, self.state
        if not self.ledger_open:
            if not spec.children.is_set():
                return None
            self.ledger_open = True
            self.charged = self.snapshot
            self.charged_tools = self.snapshot_tools
        own_calls = st.tool_calls - st.child_tool_calls
        own_usage = st.usage - st.child_usage
        own_tools = sub_counts(st.tool_counts, st.child_tool_counts)
        calls, usage = own_calls - self.charged[0], own_usage - self.charged[1]
        reply: LedgerReply = yield Ledger(spec.run_id, reserve, max(calls, 0), usage, close,
                                          sub_counts(own_tools, self.charged_tools),
                                          reserve_tools or {})
        self.charged = (own_calls + (reserve if reply.granted else 0), own_usage)
        self.charged_tools = add_counts(own_tools, reserve_tools or {}) if reply.granted \
            else own_tools
        for child in reply.children:
            self.emit(ev.ChildCharged, child_run_id=child.child_run_id,
                      tool_calls=child.tool_calls, usage=child.usage, tools=child.tools)
        return reply

    def finish(self, stop: decide.Stop) -> Generator[Effect, Any, RunResult]:
        if stop.status == "journal_unavailable":
            if self.pending and self.spec.lease_ok is not None and not self.spec.lease_ok():
                # This runner fenced itself (its lease, or a worker shutting down) while the
                # journal works: what its attempts did is recorded, fenced as ever, so a
                # resume elsewhere knows it instead of finding unknown outcomes. Only those
                # facts: calls it did not start stay as a crash leaves them, for the resume
                # to settle (the model never saw them skipped).
                self.pending = [e for e in self.pending if isinstance(e, _ATTEMPT_FACTS)]
                try:
                    yield from self.commit()
                except JournalError:
                    pass
            # Else a write already failed: write nothing more. The run stays open in the
            # journal, as its durable events left it, for recovery to resolve and resume.
            return self.unavailable(stop.detail, plain=stop.plain)
        yield from self.settle_ledger(close=True)
        self.take([decide.run_finished(self.state, stop, self.current,
                                       cancel_reason=self.spec.cancel.reason,
                                       now=self.now())])
        if stop.status == "awaiting_approval":
            # The turn ends and the run is nobody's: after the decisions, any worker (or a
            # resume) takes it without waiting for this runner's lease (SPEC 14).
            self.emit(ev.OwnerClaimed, owner="", epoch=self.state.epoch + 1)
            self.releasing = True
        try:
            yield from self.commit()
        except JournalError as exc:
            return self.unavailable(f"The run ended {stop.status}, but the journal could not "
                                    f"record it ({exc}).")
        return self.result()

    def fail(self, exc: BaseException) -> Generator[Effect, Any, RunResult]:
        """End the run in order after driving it failed inside boundloop (a bug): the run
        gets a status and a RunFinished, and a person is asked to look."""
        self.pending = []
        detail = journal_safe(f"Boundloop failed while driving the run "
                              f"({describe_exception(exc)}); a person should review it.")
        # No action's outcome is at stake: boundloop itself failed.
        return (yield from self.finish(decide.Stop("needs_review", detail=detail,
                                                   plain=True)))

    def deadline_passed(self) -> bool:
        return self.deadline is not None and self.clock.monotonic() >= self.deadline

    def reservation(self) -> Generator[Effect, Any, Usage]:
        """The step's reservation: the runner's estimator (run on a worker), else
        ceil(history JSON bytes / 4) input tokens plus the model's declared output maximum."""
        spec = self.spec
        if spec.estimator is None:
            usage = default_reservation(self.history_bytes(),
                                        getattr(spec.model, "max_output_tokens", None))
            return self.priced_estimate(usage)
        reply = yield CallUser(spec.estimator, (copy_history(self.state.transcript),
                                                spec.model), self.deadline, spec.cancel)
        if reply.abandoned is not None:
            raise EstimatorAbandoned(reply.abandoned)
        estimate = reply.response
        if isinstance(estimate, int) and not isinstance(estimate, bool):
            estimate = Usage(input_tokens=estimate) if estimate >= 0 else None
        if isinstance(estimate, Usage):
            try:  # a Usage made directly is not checked: negative counts would pass limits
                estimate = msgspec.convert(msgspec.to_builtins(estimate), Usage)
            except (msgspec.ValidationError, TypeError, ValueError):
                estimate = None
        if reply.error is not None or not isinstance(estimate, Usage):
            why = f"raised {describe_exception(reply.error)}" if reply.error else \
                "returned something other than a bl.Usage or an int of input tokens " \
                "(counts must be whole numbers >= 0)"
            raise EstimatorFailed(f"the runner's estimator {why}")
        return self.priced_estimate(estimate)

    def priced_estimate(self, usage: Usage) -> Usage:
        """A reservation with its cost: by the price table, else by the catalogue for the
        model the adapter asks for (left without one when the catalogue does not know it:
        the reply prices the step)."""
        if usage.unpriced_steps:  # only the decider says a step is unpriced
            usage = msgspec.structs.replace(usage, unpriced_steps=0)
        usage = priced(usage, self.table)
        return pricing.reservation_cost(usage, self.spec.model) if self.catalogue else usage

    def history_bytes(self) -> int:
        """Bytes of the history as compact JSON, kept up to date as it grows (encoding the
        whole history each step would make a run quadratic)."""
        transcript = self.state.transcript
        count, size = self.sized
        if count > len(transcript):  # never shrinks in a run; be safe anyway
            count, size = 0, 2
        for message in transcript[count:]:
            size += len(_json.encode(message)) + (1 if size > 2 else 0)
        self.sized = (len(transcript), size)
        return size

    def round(self) -> Generator[Effect, Any, decide.Stop | None]:
        spec, st = self.spec, self.state
        tree = yield from self.settle_ledger()
        budget = self.current = self.budget if tree is None else \
            within_tree(self.budget, st.tool_calls, st.usage, tree.left)
        try:
            reservation = yield from self.reservation()
        except EstimatorFailed as exc:
            return decide.Stop("model_error", plain=True,
                               detail=journal_safe(f"The model was not called: {exc}"))
        except EstimatorAbandoned as exc:
            if str(exc) == "deadline":
                return decide.Stop("limit_exceeded", "deadline",
                                   "The step's estimate was not ready before the deadline.")
            return decide.Stop("cancelled", detail="The step's estimate was not awaited.")
        stop = decide.before_model(st, budget, cancelled=spec.cancel.cancelled,
                                   deadline_passed=self.deadline_passed(),
                                   reservation=reservation)
        if stop is not None:
            return stop
        was_final_only = decide.final_only(st, budget)
        started = self.take([decide.start_step(st, budget, reservation, self.now())])[0]
        assert isinstance(started, ev.ModelStepStarted)
        step, allowed = started.step, started.tools_allowed
        ctx = ModelContext(
            run_id=spec.run_id, step=step, tools_allowed=allowed,
            tools=_schemas_decoder.decode(self.schemas),  # its own copy: the model may edit it
            remaining=remaining(budget, st.model_steps, st.tool_calls,
                                st.usage - reservation, self.elapsed()),
            deadline=self.deadline, cancel=spec.cancel)
        try:
            reply = yield InvokeModel(spec.model, copy_history(st.transcript), ctx)
        except JournalError:
            # Refused before the model was called (lease lost, journal closed): the step
            # counted in the live state never ran, and is never recorded (SPEC 5: model
            # steps count callback invocations).
            self.uninvoked += 1
            self.pending = [e for e in self.pending if e is not started]
            raise
        error = None if reply.error is None else journal_safe(describe_exception(reply.error))
        # The catalogue's price of the reply (an effect: the decider only reads it).
        quote = pricing.quote(reply.response, spec.model) \
            if self.catalogue and reply.error is None and reply.abandoned is None else None
        replied = decide.model_replied(
            st, budget, decide.Reply(reply.response, error, reply.latency_s, reply.abandoned),
            reservation=reservation, cancelled=spec.cancel.cancelled, price=self.table,
            now=self.now(), deadline_passed=self.deadline_passed(), catalogue=self.catalogue,
            quote=quote, unpriced=spec.unpriced)
        self.take(replied.events)
        if replied.batch is None:
            return replied.stop
        parsed = replied.batch
        stop = decide.check_batch(st, budget, parsed, allowed=allowed,
                                  was_final_only=was_final_only)
        if stop is not None:
            return stop
        self.tree_tools = None
        if self.ledger_open and spec.parent_run_id is not None:
            by_tool = Counter(call.name for call in parsed.calls)
            tree = yield from self.settle_ledger(reserve=len(parsed.calls),
                                                 reserve_tools=dict(by_tool))
            if tree is not None and not tree.granted:
                return decide.Stop("limit_exceeded", "tool_calls",
                                   "The parent run has too few tool calls left for the batch.")
            if tree is not None:
                self.tree_tools = (tree.tools_granted, tree.tool_caps)
        return (yield from self.calls(step, parsed, ctx))

    def decide_calls(self, batch: CallTools, ctx: ModelContext) -> Generator[
            Effect, Any, list[tuple[Decision, str, dict[str, Any], bool]]]:
        """(decision, reason, handler kwargs, waits for approval) per call, by
        ``decide.call_decision``. The user's ``permit`` and ``needs_approval`` rules run on a
        worker, never on the supervisor's thread."""
        spec = self.spec
        # permit and the handler get their own copies: nothing they do to the arguments
        # can change the recorded call.
        calls = [msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=ToolCall)
                 for c in batch.calls]
        granted, tree_caps = self.tree_tools or (None, None)
        capped = decide.cap_denials([c.name for c in calls], self.caps,
                                    self.state.tool_counts, granted=granted,
                                    tree_caps=tree_caps)
        verdicts: list[Any] = [None] * len(calls)
        if spec.permit is not None:
            # A call its tool's cap denies is not put to the permission check.
            asked = [(i, c, spec.tools[c.name]) for i, c in enumerate(calls)
                     if c.name in spec.tools and not capped[i]
                     and (spec.read_only is False or spec.tools[c.name].read_only)]
            check = _apermits if is_async(spec.permit) else _permits
            answers = yield CallUser(check, (spec.permit, [(c, t) for _, c, t in asked],
                                             ctx), self.deadline, spec.cancel)
            got = answers.response
            if not isinstance(got, list) or len(got) != len(asked):
                # The permit check never answered (abandoned): deny, fail closed.
                got = [answers.error or TimeoutError("the permission check did not answer")
                       ] * len(asked)
            for (i, _, _), verdict in zip(asked, got, strict=True):
                verdicts[i] = verdict
        out = []
        for call, verdict, cap in zip(calls, verdicts, capped, strict=True):
            tool = spec.tools.get(call.name)
            kwargs: dict[str, Any] = {}
            invalid = None
            if tool is not None:
                try:
                    kwargs = tool.validate(call.arguments)
                except ArgumentError as exc:
                    invalid = str(exc)
            decision, reason = decide.call_decision(
                call.name, spec.tools, tool_read_only=bool(tool and tool.read_only),
                read_only_runner=spec.read_only, verdict=verdict, invalid=invalid,
                deadline_passed=self.deadline_passed(), cancelled=spec.cancel.cancelled,
                capped=cap)
            out.append((decision, reason, kwargs if decision in ("allow", "skipped") else {},
                        False))
        return (yield from self.approvals(calls, out, ctx))

    def approvals(self, calls: list[ToolCall],
                  decided: list[tuple[Decision, str, dict[str, Any], bool]],
                  ctx: ModelContext) -> Generator[
                      Effect, Any, list[tuple[Decision, str, dict[str, Any], bool]]]:
        """Mark the allowed calls whose tool ``needs_approval`` (SPEC 14); a callable rule
        runs on a worker, and one that never answers asks a person (fail closed)."""
        tools = self.spec.tools
        rules: list[tuple[int, Any]] = []
        for i, (call, (decision, _, _, _)) in enumerate(zip(calls, decided, strict=True)):
            rule = tools[call.name].needs_approval if decision == "allow" else False
            if rule is True:
                decided[i] = (*decided[i][:3], True)
            elif rule is not False:
                rules.append((i, rule))
        if rules:
            reply = yield CallUser(_approvals, ([(rule, calls[i]) for i, rule in rules], ctx),
                                   self.deadline, self.spec.cancel)
            got = reply.response
            if not isinstance(got, list) or len(got) != len(rules):
                got = [True] * len(rules)
            for (i, _), verdict in zip(rules, got, strict=True):
                decided[i] = (*decided[i][:3], bool(verdict))
        if self.spec.parent_run_id is not None:
            # A nested run cannot wait for a person (its parent's handler waits for it, and
            # nothing would take it up again): such a call is denied, fail closed.
            decided = [("denied", NESTED_APPROVAL, {}, False) if x[3] else x for x in decided]
        return decided

    def calls(self, step: int, batch: CallTools,
              ctx: ModelContext) -> Generator[Effect, Any, decide.Stop | None]:
        spec, st = self.spec, self.state
        planned: list[Planned] = []
        skipped: list[str] = []
        decisions = yield from self.decide_calls(batch, ctx)
        keys = [idempotency_key(spec.run_id, call.id) for call in batch.calls]
        plans = []
        for call, (decision, reason, kwargs, approval) in zip(batch.calls, decisions,
                                                              strict=True):
            tool = spec.tools.get(call.name)
            plans.append(decide.CallPlan(
                decision, reason,
                content_of(kwargs) if decision in ("allow", "skipped") else None,
                read_only=bool(tool and tool.read_only),
                idempotent=bool(tool and tool.idempotent),
                irreversible=bool(tool and tool.irreversible), approval=approval))
            if decision == "skipped":
                skipped.append(reason)
        events = self.take(decide.calls_decided(
            st, batch, plans, keys=keys, max_parallel=self.budget.max_parallel,
            parent_step=spec.parent_step, now=self.now()))
        # The dispatch of the calls that start at once rides the decisions' commit, right
        # before they go to the executor: a crash from here on shows phase ``dispatched``.
        # Every later attempt gets its own durable CallDispatched first (SPEC 6).
        at_once = {e.execution_id for e in events if isinstance(e, ev.CallDispatched)}
        for index, (call, (decision, _, kwargs, approval)) in enumerate(
                zip(batch.calls, decisions, strict=True)):
            tool = spec.tools.get(call.name)
            if decision == "allow" and tool is not None and not approval:
                eid = f"{spec.run_id}:{step}:{index}"
                planned.append(Planned(spec.run_id, eid, keys[index], call.id, tool, kwargs,
                                       recorded=eid in at_once))
        try:
            yield from self.commit()
        except JournalError as exc:
            return decide.Stop("journal_unavailable",
                               detail=f"The calls' decisions could not be recorded ({exc}); "
                                      "none was dispatched.")
        outcomes: list[Outcome] = []
        if planned and self.ledger_open and self.uncharged():
            # The run tree's ledger is open (a handler of this run started a child before):
            # the batch's own calls count there before any child of it reserves, so that
            # the children see them (SPEC 8; per-tool caps too).
            yield from self.settle_ledger()
        if planned:
            allowance = self.current.max_tool_calls - st.tool_calls
            outcomes = yield Dispatch(planned, self.budget.max_parallel, self.deadline,
                                      spec.cancel, allowance, self.clock, spec.run_child,
                                      self.link(step), epoch=st.epoch)
        for outcome in outcomes:
            self.record(outcome)
            if outcome.skipped:
                skipped.append(outcome.skipped)
        review = [f"{p.tool.name} {p.execution_id}" for p in planned
                  if p.tool.irreversible and st.calls[p.execution_id].status == "outcome_unknown"]
        return self.end_round(review, skipped)

    def end_round(self, review: list[str], skipped: list[str]) -> decide.Stop | None:
        """Close the round (SPEC 5.11), or end the run's turn while calls of it wait for a
        person (SPEC 14); calls that wait are skipped when the round cannot go on anyway."""
        st, cancelled = self.state, self.spec.cancel.cancelled
        held = decide.held_calls(st)
        if held and not review and not skipped and not cancelled \
                and not self.deadline_passed():
            asked, waiting = decide.awaiting_approval(st, self.now())
            self.take(asked)
            return waiting
        for eid in held:
            why = "cancelled" if cancelled else "deadline" if self.deadline_passed() else \
                "the round ended before a person decided"
            self.emit(ev.CallSkipped, execution_id=eid, reason=why)
            skipped.append("cancelled" if cancelled else "deadline")
        ended, stop = decide.round_ended(st, review=review, skipped=skipped,
                                         cancelled=cancelled, now=self.now())
        self.take(ended)
        return stop

    def result_fields(self, value: Any) -> dict[str, Any]:
        """The content, size and digest of a tool result, and its status when not ``ok``
        (``too_large`` over ``max_result_bytes``). A result that cannot be recorded (too
        deep, cyclic, unrepresentable) is still ``ok``, since the action did take effect,
        with a content that says why it was not kept. The digest is keyed (HMAC-SHA256
        under the journal's key, SPEC 9), so it cannot confirm a guessed result."""
        content, data, problem = plain_result(value)
        fields = {"content": content, "size": len(data),
                  "digest": hmac.digest(self.spec.secret_key, data, hashlib.sha256).hex()}
        if problem is not None:
            return fields
        limit = self.budget.max_result_bytes
        if limit is not None and len(data) > limit:
            fields["content"] = (f"the result was {len(data)} bytes, over max_result_bytes="
                                 f"{limit}; it was not kept")
            fields["status"] = "too_large"
        return fields

    def reconciled(self, eid: str, attempt: int, took: bool | None, value: Any) -> None:
        """Record what ``reconcile`` said: took effect (with its result) or did not."""
        self.take(decide.reconciled(eid, attempt, took, value, fields_of=self.result_fields,
                                    now=self.now()))

    def record(self, outcome: Outcome) -> None:
        """Record what became of a call, from the attempts not recorded yet."""
        eid = outcome.execution_id
        if outcome.skipped:
            self.emit(ev.CallSkipped, execution_id=eid, reason=outcome.skipped)
            return
        self.record_attempts(eid, outcome.attempts, final=True)

    def attempt_events(self, execution_id: str, attempt: int,
                       before: list[Attempt]) -> list[ev.Event]:
        """The events that must be durable before ``attempt`` starts: the outcomes of the
        attempts ``before`` it (not yet recorded) and its own CallDispatched (SPEC 6)."""
        self.record_attempts(execution_id, before, final=False)
        self.emit(ev.CallDispatched, execution_id=execution_id, attempt=attempt)
        batch, self.pending = self.pending, []
        return batch

    def record_attempts(self, eid: str, attempts: list[Attempt], final: bool) -> None:
        done = self.attempts_recorded.get(eid, 0)
        # An earlier attempt may have taken effect (this run, or before a crash).
        doubt = eid in self.unknown or self.state.calls[eid].doubt
        events, doubt = decide.attempt_outcomes(eid, attempts[done:], final=final, doubt=doubt,
                                                fields_of=self.result_fields, now=self.now())
        self.take(events)
        self.attempts_recorded[eid] = len(attempts)
        if doubt:
            self.unknown.add(eid)


def drive(spec: RunSpec) -> Generator[Effect, Any, RunResult]:
    """The run as a generator: yields effects, is sent their results, returns the result."""
    return Driver(spec).run()
