"""One run's interpreter: it feeds ``core.decide`` facts and performs the effects it asks for.

``Driver.run()`` is a generator of effect requests for the supervisor (``Commit`` events,
``InvokeModel``, ``Dispatch`` calls, ``CallUser``, ``Ledger``, ``Reconcile``): it performs no
I/O, starts no thread and never blocks, and it decides nothing. Each decision is
``core.decide(machine, input, now)``; its events, in their journal form (redacted), are folded
into the live state with ``core.replay.apply`` (the same fold that rebuilds the run from its
journal) and queued for the next commit; its effects are performed and their outcomes, made
facts (validated arguments, keyed result digests, prices), are the next inputs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Generator
from typing import Any, Protocol

import msgspec

from boundloop import events as ev
from boundloop import pricing
from boundloop._journal_form import JournalForm
from boundloop._run import (
    CallUser as CallUser,
)
from boundloop._run import (
    Commit as Commit,
)
from boundloop._run import (
    Dispatch as Dispatch,
)
from boundloop._run import (
    Effect as Effect,
)
from boundloop._run import (
    Estimator as Estimator,
)
from boundloop._run import (
    InvokeModel as InvokeModel,
)
from boundloop._run import (
    Ledger as Ledger,
)
from boundloop._run import (
    ModelReply as ModelReply,
)
from boundloop._run import (
    Outcome as Outcome,
)
from boundloop._run import (
    ParentLink as ParentLink,
)
from boundloop._run import (
    Permit as Permit,
)
from boundloop._run import (
    Planned as Planned,
)
from boundloop._run import (
    Reconcile as Reconcile,
)
from boundloop._run import (
    RunSpec as RunSpec,
)
from boundloop._run import (
    _apermits,
    _approvals,
    _permits,
    elapsed_before_start,
)
from boundloop._run import (
    content_of as content_of,
)
from boundloop._run import (
    run_deadline as run_deadline,
)
from boundloop.actors.workers import is_async
from boundloop.context import ModelContext
from boundloop.core import effects as fx
from boundloop.core import inputs as fact
from boundloop.core.budget import Price, Usage, default_reservation, priced
from boundloop.core.decide import admission, decide
from boundloop.core.finish import lose, outbox, unavailable
from boundloop.core.replay import RunState, apply
from boundloop.core.rules import UNKEEPABLE
from boundloop.core.rules import Attempt as Attempt
from boundloop.core.state import Config, Instant, Machine, ToolFacts
from boundloop.errors import JournalError, LeaseLost, SequenceConflict
from boundloop.messages import ToolCall, copy_history
from boundloop.policy.redact import Scrubber, journal_safe, plain_result
from boundloop.policy.safe_text import describe_exception
from boundloop.results import RunResult
from boundloop.tools import ArgumentError, Tool

_json = msgspec.json.Encoder()
_TICK = fact.Tick()
_replace = msgspec.structs.replace
_schemas_decoder = msgspec.json.Decoder(list[dict[str, Any]])


def _facts(tool: Tool) -> ToolFacts:
    rule = tool.needs_approval
    return ToolFacts(read_only=tool.read_only, idempotent=tool.idempotent,
                     irreversible=tool.irreversible,
                     approval="always" if rule is True else "never" if rule is False
                     else "rule",
                     max_calls=tool.max_calls, reconcile=tool.reconcile is not None)


def _verdict(value: Any) -> fact.Verdict:
    """``permit``'s answer as a fact (an exception it raised denies, fail closed)."""
    if isinstance(value, BaseException):
        return fact.PermitRaised(describe_exception(value))
    if value is None or value is True or isinstance(value, str):
        return value
    return False


class _Closes(Protocol):
    @property
    def closed(self) -> bool: ...


class Driver:
    """One run's interpreter: ``run()`` is the generator of effects; the supervisor may
    also ask it for the events of an attempt that starts mid-batch (``attempt_events``)
    and for an orderly end when driving it failed (``fail``)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.budget = spec.budget
        self.clock = spec.clock
        started = self.clock.monotonic()
        self.deadline = run_deadline(spec, started)
        self.schemas = _json.encode([t.schema for t in spec.tools.values()])
        # Priced by the catalogue: the Runner's price="auto", or the model adapter's.
        self.catalogue = pricing.prices_by_catalogue(spec.price, spec.model)
        table = spec.price if isinstance(spec.price, Price) else None
        tools = {name: _facts(t) for name, t in spec.tools.items()}
        config = Config(
            run_id=spec.run_id, budget=spec.budget, tools=tools, history=spec.history,
            owner=spec.owner, read_only=spec.read_only, permit=spec.permit is not None,
            parent_run_id=spec.parent_run_id, parent_step=spec.parent_step,
            parent_execution_id=spec.parent_execution_id, agent=spec.agent,
            agent_version=spec.agent_version, labels=spec.labels, table=table,
            catalogue=self.catalogue, unpriced=spec.unpriced)
        self.machine = Machine(
            config=config, state=spec.resume if spec.resume is not None else RunState(),
            resumed=spec.resume is not None, deadline=self.deadline, started=started,
            elapsed_before=elapsed_before_start(spec), current=spec.budget,
            # The run tree's ledger (SPEC 8): a child settles from the start; a parent
            # once a handler of it started a child.
            ledger_open=spec.parent_run_id is not None and spec.resume is None,
            caps={name: t.max_calls for name, t in spec.tools.items()
                  if t.max_calls is not None})
        self.state = self.machine.state
        self.sized = (0, 2)  # messages measured, compact JSON bytes of the list "[...]"
        # SPEC 9: every value redacted in the run is remembered and replaced in every later
        # text the run journals (a resumed run: see Runner._submit_resume).
        self.scrubber = spec.scrubber if spec.scrubber is not None else \
            Scrubber(spec.secret_key)
        self.form = JournalForm(spec.tools, self.scrubber)
        #: Validated arguments by execution id, for the calls ``core`` starts.
        self.kwargs: dict[str, dict[str, Any]] = {}
        self.copies: list[ToolCall] = []
        self.ctx: ModelContext | None = None
        #: Set by whoever performs the effects: the journal the run records to (nothing is
        #: recordable once it is closed).
        self.journal: _Closes | None = None

    # -- what the supervisor and the runner read ------------------------------------------
    @property
    def pending(self) -> list[ev.Event]:
        """Events folded and waiting for the next commit (journal form)."""
        return self.machine.pending

    @property
    def releasing(self) -> bool:
        """True once the run's last commit gives up its ownership (awaiting approval)."""
        return self.machine.releasing

    def now(self) -> Instant:
        """The clock and the world's flags, read once per decision."""
        spec, clock, journal = self.spec, self.clock, self.journal
        lease_ok, cancel = spec.lease_ok, spec.cancel
        return Instant(clock.time(), clock.monotonic(), cancel.cancelled, cancel.reason,
                       spec.children.is_set(), lease_ok is None or lease_ok(),
                       journal is None or not journal.closed)

    def take(self, events: list[ev.Event]) -> None:
        """Record what ``decide`` decided: each event in its journal form is folded into the
        live state and queued for the next commit."""
        state, pending, form = self.machine.state, self.machine.pending, self.form
        for event in events:
            event = form.event(event, state)
            apply(state, event)
            pending.append(event)

    def admit(self, owner: str, queued: bool = False) -> ev.Event:
        """The run's RunAdmitted (pending, in its journal form); ``queued``: enqueued, with
        no owner until a worker takes it."""
        self.take([admission(self.machine, owner, queued, self.now())])
        return self.machine.pending[-1]

    def lose(self, batch: list[ev.Event]) -> None:
        """Note what events that will never be recorded meant for the run's report."""
        lose(self.machine, batch)

    def unavailable(self, detail: str, plain: bool = False) -> RunResult:
        """The result of a run the journal failed: it says so, and nothing more is written."""
        return unavailable(self.machine, detail, plain, self.now())

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> Generator[Effect, Any, RunResult]:
        """The run as a generator: yields effects, is sent their results, returns the result."""
        return self.drive(fact.Tick())

    def fail(self, exc: BaseException) -> Generator[Effect, Any, RunResult]:
        """End the run in order after driving it failed inside boundloop (a bug): the run
        gets a status and a RunFinished, and a person is asked to look."""
        # No action's outcome is at stake: boundloop itself failed.
        return self.drive(fact.Failed(journal_safe(
            f"Boundloop failed while driving the run ({describe_exception(exc)}); a person "
            "should review it.")))

    def drive(self, first: fact.Input) -> Generator[Effect, Any, RunResult]:
        """Decide, fold, perform, feed the outcome back: until ``core`` says Finish."""
        inp, m = first, self.machine
        now = self.now()
        while True:
            step = decide(m, inp, now)
            if step.events:
                self.take(step.events)
            if not step.effects:
                # Going on after a fold: the flags are read again once an effect was
                # performed; the clock now (each event's time orders it, for the Replayer).
                inp = _TICK
                clock = self.clock
                now = _replace(now, ts=clock.time(), mono=clock.monotonic())
                continue
            effect = step.effects[0]
            if isinstance(effect, fx.Finish):
                return effect.result
            inline = self.inline(effect)
            if inline is not None:
                # Performed here, with nothing to wait for: as after a fold.
                inp = inline
                clock = self.clock
                now = _replace(now, ts=clock.time(), mono=clock.monotonic())
                continue
            inp = yield from self.perform(effect)
            now = self.now()

    def attempt_events(self, execution_id: str, attempt: int,
                       before: list[Attempt]) -> list[ev.Event]:
        """The events that must be durable before ``attempt`` starts: the outcomes of the
        attempts ``before`` it (not yet recorded) and its own CallDispatched (SPEC 6)."""
        m = self.machine
        step = decide(m, fact.AttemptStarting(execution_id, attempt, self.attempts(before)),
                      self.now())
        self.take(step.events)
        batch, m.pending = m.pending, []
        return batch

    def may_retry(self, failed: fact.AttemptFailed | fact.RetryReserved,
                  ) -> float | None | Ledger:
        """``core``'s answer to an attempt that failed: the delay before the next attempt,
        None when the call is over, or the run tree's reservation to ask first (its answer
        comes back as ``RetryReserved``)."""
        step = decide(self.machine, failed, self.now())
        self.take(step.events)
        effect = step.effects[0] if step.effects else None
        if isinstance(effect, fx.ChargeTree):
            return self.ledger(effect)
        return effect.delay_s if isinstance(effect, fx.Retry) else None

    def ledger(self, effect: fx.ChargeTree) -> Ledger:
        """The run tree's ledger effect for ``effect``."""
        return Ledger(self.spec.run_id, effect)

    # -- effects ---------------------------------------------------------------------------
    def inline(self, effect: fx.Effect) -> fact.Input | None:
        """The outcome of an effect that needs no user code on a worker (the default
        estimate; the calls' validation when no permission check is asked), else None."""
        if isinstance(effect, fx.Estimate):
            return self.default_estimate() if self.spec.estimator is None else None
        if isinstance(effect, fx.CheckCalls) and (effect.permit is None
                                                  or self.spec.permit is None):
            return self.validated(effect, self.copy_calls(), None)
        return None

    def perform(self, effect: fx.Effect) -> Generator[Effect, Any, fact.Input]:
        """Perform one of ``core``'s effects through the supervisor; the outcome as a fact."""
        if isinstance(effect, fx.Commit):
            try:
                yield Commit(outbox(self.machine))
            except SequenceConflict as exc:
                return fact.Committed(str(exc), conflict=True)
            except JournalError as exc:
                return fact.Committed(str(exc), lease=isinstance(exc, LeaseLost))
            return fact.Committed()
        try:
            return (yield from self._perform(effect))
        except JournalError as exc:
            return fact.EffectFailed(str(exc), lease=isinstance(exc, LeaseLost))

    def _perform(self, effect: fx.Effect) -> Generator[Effect, Any, fact.Input]:
        spec, m = self.spec, self.machine
        # The effects of a round first (a class pattern is an isinstance check).
        match effect:
            case fx.InvokeModel():
                return (yield from self.invoke(effect))
            case fx.StartCalls():
                planned = [Planned(spec.run_id, c.execution_id, c.idempotency_key, c.call_id,
                                   spec.tools[c.tool], self.kwargs.pop(c.execution_id, {}),
                                   first_attempt=c.first_attempt, recorded=c.recorded)
                           for c in effect.calls]
                outcomes = yield Dispatch(planned, effect.max_parallel, self.deadline,
                                          spec.cancel, effect.allowance, self.clock,
                                          spec.run_child, self.link(effect.link_step),
                                          epoch=m.state.epoch)
                return fact.AttemptsEnded([
                    fact.Ended(o.execution_id, self.attempts(o.attempts), o.skipped)
                    for o in outcomes])
            case fx.ChargeTree():
                reply = yield self.ledger(effect)
                return fact.TreeReplied(reply)
            case fx.Estimate():
                return (yield from self.reservation())
            case fx.CheckCalls():
                return (yield from self.check_calls(effect))
            case fx.AskApproval():
                calls, ctx = self.copies, self.ctx
                answer = yield CallUser(_approvals, (
                    [(spec.tools[calls[i].name].needs_approval, calls[i])
                     for i in effect.indexes], ctx), self.deadline, spec.cancel)
                got = answer.response
                if not isinstance(got, list) or len(got) != len(effect.indexes):
                    got = [True] * len(effect.indexes)  # never answered: a person looks
                return fact.ApprovalsRuled([bool(v) for v in got])
            case fx.Validate():
                invalid: list[str | None] = []
                for eid in effect.execution_ids:
                    rec = m.state.calls[eid]
                    try:
                        self.kwargs[eid] = spec.tools[rec.tool].validate(rec.arguments)
                        invalid.append(None)
                    except ArgumentError as exc:
                        invalid.append(str(exc))
                return fact.Validated(invalid)
            case fx.Reconcile():
                rec = m.state.calls[effect.execution_id]
                took, value = yield Reconcile(Planned(
                    spec.run_id, rec.execution_id, rec.idempotency_key, rec.call_id,
                    spec.tools[rec.tool], {}, first_attempt=max(rec.attempt, 1) + 1))
                return fact.Reconciled(took, self.result_fields(value) if took else None)
        raise TypeError(f"no way to perform {type(effect).__name__}")

    def invoke(self, effect: fx.InvokeModel) -> Generator[Effect, Any, fact.Input]:
        spec = self.spec
        ctx = self.ctx = ModelContext(
            run_id=spec.run_id, step=effect.step, tools_allowed=effect.tools_allowed,
            tools=_schemas_decoder.decode(self.schemas),  # its own copy: the model may edit it
            remaining=effect.remaining, deadline=effect.deadline, cancel=spec.cancel)
        reply = yield InvokeModel(spec.model, copy_history(self.machine.state.transcript), ctx)
        error = None if reply.error is None else journal_safe(describe_exception(reply.error))
        # The catalogue's price of the reply (an effect: the decider only reads it).
        quote = pricing.quote(reply.response, spec.model) \
            if self.catalogue and reply.error is None and reply.abandoned is None else None
        return fact.ModelReplied(reply.response, error, reply.latency_s, reply.abandoned, quote)

    def check_calls(self, effect: fx.CheckCalls) -> Generator[Effect, Any, fact.Input]:
        """The permission check (on a worker, never on the supervisor's thread) and the
        tools' ``validate``, on copies: nothing they do to the arguments can change the
        recorded call."""
        spec, calls = self.spec, self.copy_calls()
        verdicts: list[fact.Verdict] = [None] * len(calls)
        if effect.permit is not None and spec.permit is not None:
            asked = effect.permit
            check = _apermits if is_async(spec.permit) else _permits
            answers = yield CallUser(check, (spec.permit, [(calls[i], spec.tools[calls[i].name])
                                                           for i in asked], self.ctx),
                                     self.deadline, spec.cancel)
            got = answers.response
            if not isinstance(got, list) or len(got) != len(asked):
                # The permit check never answered (abandoned): deny, fail closed.
                got = [answers.error or TimeoutError("the permission check did not answer")
                       ] * len(asked)
            for i, verdict in zip(asked, got, strict=True):
                verdicts[i] = _verdict(verdict)
        return self.validated(effect, calls, verdicts)

    def copy_calls(self) -> list[ToolCall]:
        """The batch's calls, copied: nothing user code does to them changes the record."""
        batch = self.machine.batch
        assert batch is not None
        calls = self.copies = [msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=ToolCall)
                               for c in batch.calls]
        return calls

    def validated(self, effect: fx.CheckCalls, calls: list[ToolCall],
                  verdicts: list[fact.Verdict] | None) -> fact.Input:
        """The tools' ``validate`` of each call (its kwargs kept for the start), with the
        permission check's verdicts (None: none was asked)."""
        spec = self.spec
        validated: list[Any] = []
        invalid: list[str | None] = []
        for call, eid in zip(calls, effect.execution_ids, strict=True):
            tool = spec.tools.get(call.name)
            kwargs: dict[str, Any] = {}
            wrong = None
            if tool is not None:
                try:
                    kwargs = tool.validate(call.arguments)
                except ArgumentError as exc:
                    wrong = str(exc)
            self.kwargs[eid] = kwargs
            validated.append(content_of(kwargs))
            invalid.append(wrong)
        return fact.CallsChecked([None] * len(calls) if verdicts is None else verdicts,
                                 validated, invalid)

    def link(self, step: int) -> ParentLink:
        """What a child started by a handler of this step draws on."""
        st, spec, m = self.machine.state, self.spec, self.machine
        return ParentLink(spec.run_id, step, m.current, st.tool_calls, st.usage,
                          self.deadline, spec.cancel, spec.children, spec.loop,
                          self.scrubber, dict(st.tool_counts), dict(m.caps))

    def attempts(self, attempts: list[Attempt]) -> list[Attempt]:
        """Attempts as facts: each result (and reconciled result) as its journal fields."""
        # Every attempt's value is made fields (None for one that raised or timed out):
        # which of them the journal keeps is for ``core`` to say.
        replace, fields = msgspec.structs.replace, self.result_fields
        return [replace(att, value=fields(att.value),
                        reconciled_value=fields(att.reconciled_value) if att.reconciled
                        else None)
                for att in attempts]

    def result_fields(self, value: Any) -> dict[str, Any]:
        """The content, size and digest of a tool result, and whether it could not be
        recorded as it was (too deep, cyclic, unrepresentable: its content then says why).
        Whether it is ``too_large`` is ``core``'s to say. The digest is keyed (HMAC-SHA256
        under the journal's key, SPEC 9), so it cannot confirm a guessed result."""
        content, data, problem = plain_result(value)
        fields: dict[str, Any] = {
            "content": content, "size": len(data),
            "digest": hmac.digest(self.spec.secret_key, data, hashlib.sha256).hex()}
        if problem is not None:
            fields[UNKEEPABLE] = True
        return fields

    # -- the step's reservation --------------------------------------------------------
    def reservation(self) -> Generator[Effect, Any, fact.Input]:
        """The step's reservation by the runner's estimator (run on a worker); without one,
        ``default_estimate`` is made in place (``inline``)."""
        spec = self.spec
        assert spec.estimator is not None  # else the default estimate was made in place
        reply = yield CallUser(spec.estimator, (copy_history(self.machine.state.transcript),
                                                spec.model), self.deadline, spec.cancel)
        if reply.abandoned is not None:
            return fact.Estimated(abandoned=reply.abandoned)
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
            return fact.Estimated(failed=f"the runner's estimator {why}")
        return fact.Estimated(self.priced_estimate(estimate))

    def default_estimate(self) -> fact.Input:
        """ceil(history JSON bytes / 4) input tokens plus the model's declared output
        maximum, priced."""
        usage = default_reservation(self.history_bytes(),
                                    getattr(self.spec.model, "max_output_tokens", None))
        return fact.Estimated(self.priced_estimate(usage))

    def priced_estimate(self, usage: Usage) -> Usage:
        """A reservation with its cost: by the price table, else by the catalogue for the
        model the adapter asks for (left without one when the catalogue does not know it:
        the reply prices the step)."""
        if usage.unpriced_steps:  # only the decider says a step is unpriced
            usage = msgspec.structs.replace(usage, unpriced_steps=0)
        usage = priced(usage, self.machine.config.table)
        return pricing.reservation_cost(usage, self.spec.model) if self.catalogue else usage

    def history_bytes(self) -> int:
        """Bytes of the history as compact JSON, kept up to date as it grows (encoding the
        whole history each step would make a run quadratic)."""
        transcript = self.machine.state.transcript
        count, size = self.sized
        if count > len(transcript):  # never shrinks in a run; be safe anyway
            count, size = 0, 2
        for message in transcript[count:]:
            size += len(_json.encode(message)) + (1 if size > 2 else 0)
        self.sized = (len(transcript), size)
        return size


def drive(spec: RunSpec) -> Generator[Effect, Any, RunResult]:
    """The run as a generator: yields effects, is sent their results, returns the result."""
    return Driver(spec).run()
