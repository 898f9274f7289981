"""The tool executor: runs handlers with timeouts, ``max_parallel``, retries and reconcile.

It is a message-driven state machine: handlers run on the workers' pools (or an event
loop), their completions, timeouts, retry delays, the run's deadline and its cancellation
come back as messages, and the actor's own thread never waits on a handler. Whether a call
is tried again is the run's decision (``core.decide``, asked through the supervisor with
the attempt's facts), as is every attempt's CallDispatched, durable before it starts; what
may start now is ``core.rules.dispatch_gate``. The executor reports raw facts (an attempt
ran and returned, raised, timed out, or never started).

The plain case takes no hop through this actor: a supervisor starts a batch of one call
whose dispatch is durable straight on the tool pool (``launch_alone``), and the thread that
ran the attempt reports its outcome to the supervisor itself when that attempt is the
call's last (``_report``). Whatever else happens to it (its timeout, a retry to ask for, a
cancellation, the deadline, a call not started) hands the batch to this actor
(``_Adopt``), which owns its walls from then on; the call's ``gate`` lock decides which of
the thread and the actor ends an attempt.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import msgspec

from boundloop.actors._base import Actor
from boundloop.actors.messages import DispatchBatch
from boundloop.actors.workers import NotStarted, Workers, outcome, tell
from boundloop.core import rules as decide
from boundloop.core.inputs import AttemptFailed
from boundloop.loop import Attempt, Dispatch, Outcome, Planned, Reconcile
from boundloop.policy.safe_text import describe_exception
from boundloop.telemetry import Telemetry
from boundloop.tools import ToolContext

Stage = Literal["queued", "recording", "launched", "running", "asking", "delay", "reconciling",
                "done"]


class _Done(msgspec.Struct):
    batch: int
    index: int
    generation: int
    value: Any = None
    error: BaseException | None = None


class _TimedOut(msgspec.Struct):
    batch: int
    index: int
    generation: int
    timeout: float


class _Retry(msgspec.Struct):
    batch: int
    index: int
    generation: int


class _Answer(msgspec.Struct):
    """The run's answer to an attempt that failed: the delay before the next attempt, or
    None: the call is over."""

    batch: int
    index: int
    generation: int
    delay: float | None


class _Recorded(msgspec.Struct):
    batch: int
    index: int
    generation: int
    error: BaseException | None = None


class _Halt(msgspec.Struct):
    """The run's deadline passed or it was cancelled: calls not yet started never will."""

    batch: int
    why: decide.SkipReason


class _Reconciled(msgspec.Struct):
    batch: int
    index: int
    generation: int
    took: bool | None
    value: Any = None


class _Adopt(msgspec.Struct):
    """A batch a supervisor launched itself (``launch_alone``) is this actor's from now on:
    its attempt timed out, failed with a retry to ask for or did not start, or the run was
    cancelled or its deadline passed. ``event`` is what happened."""

    batch: _Batch
    bid: int
    event: _Done | _TimedOut | _Halt


class _Call(msgspec.Struct):
    planned: Planned
    outcome: Outcome
    attempt: int
    stage: Stage = "queued"
    generation: int = 0
    recorded: int = 0  # the highest attempt whose CallDispatched is durable
    future: Future[Any] | None = None
    halted: bool = False
    # Taken by the pool thread right before the handler starts, and by a halt.
    gate: threading.Lock = msgspec.field(default_factory=threading.Lock)
    # Set on the pool thread when the handler really starts (read after its messages).
    started: list[float] = msgspec.field(default_factory=lambda: [0.0])
    # Under ``gate``: the generation of the attempt whose end was taken, by the thread that
    # ran it (it reported the call's outcome itself) or by a timeout here, whichever first.
    ended: int = 0


class _Batch(msgspec.Struct):
    dispatch: Dispatch
    reply: Callable[[Any, BaseException | None], None]
    calls: list[_Call]
    waiting: deque[int]
    running: int = 0
    finished: int = 0
    unwatch: Callable[[], None] | None = None
    #: None: this actor launched it. False: a supervisor did (``launch_alone``) and its
    #: thread may still report the outcome itself; True: this actor has taken it over.
    adopted: bool | None = None


#: Batch ids, shared by the actor and ``launch_alone`` (``next`` on a count is atomic).
_IDS = itertools.count()


def reconcile_result(value: Any, error: BaseException | None) -> tuple[bool | None, Any]:
    """``reconcile``'s answer: (True, result) took effect; (False, None) did not; (None,
    None) cannot tell (it raised)."""
    if error is not None:
        return None, None
    return (False, None) if value is None else (True, value)


class ExecutorActor(Actor):
    """Performs Dispatch and Reconcile effects."""

    def __init__(self, workers: Workers, telemetry: Telemetry | None = None) -> None:
        super().__init__()
        self.workers = workers
        #: makes each attempt's execute_tool span current in its handler (linked traces)
        self.telemetry = telemetry
        self.batches: dict[int, _Batch] = {}
        self._ids = _IDS
        #: Batches whose one call's thread reported its outcome itself (see _launch):
        #: forgotten here on the next message (a deque: appended from those threads).
        self._ended: deque[int] = deque()

    def _tell_when_done(self, future: Future[Any], make: Callable[[Any, BaseException | None],
                                                                  Any]) -> None:
        me = self.actor_ref

        def done(f: Future[Any]) -> None:
            tell(me, make(*outcome(f)))

        future.add_done_callback(done)

    def on_receive(self, message: Any) -> Any:
        while self._ended:
            self._forget(self._ended.popleft())
        match message:
            case DispatchBatch(dispatch=Reconcile() as r, reply=reply):
                try:
                    self._reconcile(r, reply)
                except Exception as exc:  # noqa: BLE001 - fail this request, keep the actor
                    reply(None, exc)
            case DispatchBatch(dispatch=Dispatch() as d, reply=reply):
                try:
                    self._start_batch(d, reply)
                except Exception as exc:  # noqa: BLE001 - fail this batch, keep the actor
                    for key in [k for k, b in self.batches.items() if b.reply is reply]:
                        self._forget(key)
                    reply(None, exc)
            case _Adopt(batch=adopted, bid=bid, event=event):
                call = adopted.calls[0]
                with call.gate:
                    if adopted.adopted is False:
                        if call.ended == call.generation:
                            return None  # its thread reported the outcome itself
                        adopted.adopted = True
                        self.batches[bid] = adopted
                self.on_receive(event)
            case _Done() | _TimedOut() | _Reconciled() | _Retry() | _Recorded() | _Halt() \
                    | _Answer():
                batch = self.batches.get(message.batch)
                if batch is not None:
                    try:
                        self._on_event(batch, message)
                    except Exception as exc:  # noqa: BLE001 - fail this batch, keep the actor
                        self._forget(message.batch)
                        batch.reply(None, exc)
        return None

    def _reconcile(self, r: Reconcile, reply: Callable[[Any, BaseException | None],
                                                       None]) -> None:
        p = r.planned
        if p.tool.reconcile is None:
            reply((None, None), None)
            return
        future = self.workers.start(self.workers.tool_pool, p.tool.reconcile,
                                    (p.idempotency_key,), {}, loop=r.loop)
        answered = threading.Lock()
        workers = self.workers

        def answer(took: tuple[bool | None, Any], late: bool = False) -> None:
            if answered.acquire(blocking=False):  # the first answer wins
                if late:
                    workers.compensate(future)
                reply(took, None)

        future.add_done_callback(lambda f: answer(reconcile_result(*outcome(f))))
        # A reconcile that hangs cannot tell: after the tool's timeout it is unknown.
        self.workers.timer.after(p.tool.timeout_s or 60.0,
                                 lambda: answer((None, None), late=True))

    # -- batches -----------------------------------------------------------------------
    def _start_batch(self, d: Dispatch,
                     reply: Callable[[Any, BaseException | None], None]) -> None:
        bid = next(self._ids)
        calls = [_Call(p, Outcome(p.execution_id), p.first_attempt,
                       recorded=p.first_attempt if p.recorded else p.first_attempt - 1)
                 for p in d.calls]
        batch = _Batch(d, reply, calls, deque(range(len(calls))))
        self.batches[bid] = batch
        if not calls:
            self._reply(bid, batch)
            return
        me = self.actor_ref
        # Deadlines and cancellation are timers of their own: a call waiting for a free
        # thread is skipped at once, not when a thread finally picks it up.
        batch.unwatch = d.cancel.on_cancel(lambda: tell(me, _Halt(bid, "cancelled")))
        if d.deadline is not None:
            self.workers.timer.at(d.deadline, lambda: tell(me, _Halt(bid, "deadline")))
        if bid in self.batches:
            self._fill(bid, batch)

    def _gate(self, d: Dispatch) -> decide.SkipReason | None:
        return _gate(d)

    def _fill(self, bid: int, batch: _Batch) -> None:
        limit = batch.dispatch.max_parallel or len(batch.calls)
        while batch.waiting and batch.running < limit and bid in self.batches:
            index = batch.waiting.popleft()
            batch.running += 1
            self._begin(bid, batch, index)

    def _begin(self, bid: int, batch: _Batch, index: int) -> None:
        """Start the call's current attempt once its dispatch is durable (SPEC 6)."""
        d, call = batch.dispatch, batch.calls[index]
        why = self._gate(d)
        if why is not None:
            self._unstarted(bid, batch, index, why)
            return
        if call.recorded >= call.attempt or d.record is None:
            self._launch(bid, batch, index)
            return
        call.stage = "recording"
        call.generation += 1
        gen, me = call.generation, self.actor_ref
        d.record(call.planned.execution_id, call.attempt, list(call.outcome.attempts),
                 lambda err: tell(me, _Recorded(bid, index, gen, err)))

    def _launch(self, bid: int, batch: _Batch, index: int) -> None:
        me = self.actor_ref
        _launch(self.workers, self.telemetry, bid, batch, index, lambda m: tell(me, m),
                self._ended)

    def _on_event(self, batch: _Batch,
                  m: _Done | _TimedOut | _Reconciled | _Retry | _Recorded | _Halt | _Answer,
                  ) -> None:
        bid = m.batch
        if isinstance(m, _Halt):
            self._halt(bid, batch, m.why)
            return
        call = batch.calls[m.index]
        if m.generation != call.generation:
            return  # a completion after its timeout, or a timer after its completion
        match m:
            case _Retry():
                self._begin(bid, batch, m.index)
                return
            case _Answer():
                self._answered(bid, batch, m.index, m.delay)
                return
            case _Recorded(error=None):
                call.recorded = call.attempt
                self._launch(bid, batch, m.index)
                return
            case _Recorded():
                self._unstarted(bid, batch, m.index, "journal")
                return
        latency = time.perf_counter() - call.started[0]
        policy, tool = call.planned.tool.retry, call.planned.tool
        match m:
            case _Done(error=NotStarted()):
                self._unstarted(bid, batch, m.index, self._gate(batch.dispatch) or "cancelled")
            case _Done(error=None):
                call.generation += 1
                call.outcome.attempts.append(Attempt(call.attempt, "ok", m.value,
                                                     latency_s=latency))
                self._call_done(bid, batch, m.index)
            case _Done(error=exc) if exc is not None:
                call.generation += 1
                call.outcome.attempts.append(Attempt(
                    call.attempt, "error", error=describe_exception(exc),
                    category=type(exc).__name__, latency_s=latency))
                self._retry_or_done(bid, batch, m.index,
                                    policy is not None and isinstance(exc, policy.retry_on))
            case _TimedOut():
                with call.gate:
                    if call.ended == m.generation:
                        return  # its thread reported its outcome first
                    call.ended = m.generation
                call.generation += 1
                if call.future is not None:
                    # The handler may never return: its thread is replaced, so it cannot
                    # keep other runs' calls from starting.
                    self.workers.compensate(call.future)
                timeout = m.timeout
                call.outcome.attempts.append(Attempt(
                    call.attempt, "timeout", latency_s=latency, timeout_s=timeout,
                    error=f"the call timed out after {timeout:.3g}s; whether it took effect "
                          "is not known"))
                if tool.reconcile is None:
                    self._retry_or_done(bid, batch, m.index, self._timeout_retryable(call, None))
                    return
                call.stage = "reconciling"
                gen = call.generation
                future = self.workers.start(self.workers.tool_pool, tool.reconcile,
                                            (call.planned.idempotency_key,), {},
                                            loop=batch.dispatch.loop)
                self._tell_when_done(future, lambda v, e: _Reconciled(
                    bid, m.index, gen, *reconcile_result(v, e)))
                me = self.actor_ref
                self.workers.timer.after(timeout or 1.0, lambda: tell(
                    me, _Reconciled(bid, m.index, gen, None)))
            case _Reconciled():
                call.generation += 1
                att = call.outcome.attempts[-1]
                att.reconciled, att.reconciled_value = m.took, m.value
                if m.took is True:
                    self._call_done(bid, batch, m.index)
                else:
                    self._retry_or_done(bid, batch, m.index,
                                        self._timeout_retryable(call, m.took))

    def _halt(self, bid: int, batch: _Batch, why: decide.SkipReason) -> None:
        """Calls that have not started (queued, being recorded, waiting for a thread or a
        retry delay) end now; calls running go on until they end or time out."""
        while batch.waiting and bid in self.batches:
            self._unstarted(bid, batch, batch.waiting.popleft(), why, held=False)
        for index, call in enumerate(batch.calls):
            if bid not in self.batches:
                return
            if call.stage in ("recording", "delay"):
                call.generation += 1
                self._unstarted(bid, batch, index, why)
            elif call.stage == "asking":
                # Its attempt ended and nothing follows it now: the call is over.
                call.generation += 1
                self._call_done(bid, batch, index)
            elif call.stage == "launched":
                with call.gate:
                    if call.started[0] == 0.0:
                        call.halted = True
                if call.halted:
                    call.generation += 1
                    self._unstarted(bid, batch, index, why)

    def _unstarted(self, bid: int, batch: _Batch, index: int, why: decide.SkipReason,
                   held: bool = True) -> None:
        """The call's current attempt never started."""
        call = batch.calls[index]
        call.generation += 1
        if not call.outcome.attempts or why == "journal" and call.recorded < call.attempt:
            call.outcome.skipped = why  # "journal": the run ends, writing nothing more
        elif call.recorded >= call.attempt:
            # Its dispatch is in the journal: say that this attempt did not run.
            call.outcome.attempts.append(Attempt(
                call.attempt, "error", category="NotStarted",
                error=f"attempt {call.attempt} was not started ({_WHY[why]})"))
        self._call_done(bid, batch, index, held)

    def _timeout_retryable(self, call: _Call, reconciled: bool | None) -> bool:
        policy, tool = call.planned.tool.retry, call.planned.tool
        return policy is not None and decide.timeout_retryable(
            policy.retry_on, idempotent=tool.idempotent, reconciled=reconciled)

    def _retry_or_done(self, bid: int, batch: _Batch, index: int, retryable: bool) -> None:
        """The attempt failed: the run decides whether another follows (``core.decide``);
        the executor reports the facts (is the failure one the tool retries, its delay,
        what would keep an attempt from starting now) and waits for the answer."""
        d, call = batch.dispatch, batch.calls[index]
        policy = call.planned.tool.retry
        if policy is None or d.retry is None:  # a tool without a retry policy: one attempt
            self._call_done(bid, batch, index)
            return
        call.stage = "asking"
        call.generation += 1
        me, gen = self.actor_ref, call.generation
        d.retry(AttemptFailed(call.planned.execution_id, retryable, policy.max_attempts,
                              call.attempt - call.planned.first_attempt + 1,
                              policy.delay(call.attempt + 1), self._gate(d)),
                lambda delay: tell(me, _Answer(bid, index, gen, delay)))

    def _answered(self, bid: int, batch: _Batch, index: int, delay: float | None) -> None:
        call = batch.calls[index]
        if delay is None:
            self._call_done(bid, batch, index)
            return
        call.attempt += 1
        if delay > 0:
            call.stage = "delay"
            call.generation += 1
            me, gen = self.actor_ref, call.generation
            self.workers.timer.after(delay, lambda: tell(me, _Retry(bid, index, gen)))
        else:
            self._begin(bid, batch, index)

    def _call_done(self, bid: int, batch: _Batch, index: int, held: bool = True) -> None:
        batch.calls[index].stage = "done"
        if held:
            batch.running -= 1
        batch.finished += 1
        if batch.finished == len(batch.calls):
            self._reply(bid, batch)
        else:
            self._fill(bid, batch)

    def _forget(self, bid: int) -> None:
        batch = self.batches.pop(bid, None)
        if batch is not None and batch.unwatch is not None:
            batch.unwatch()

    def _reply(self, bid: int, batch: _Batch) -> None:
        self._forget(bid)
        batch.reply([c.outcome for c in batch.calls], None)


_WHY = {"journal": "the journal could record nothing more", "cancelled": "the run was cancelled",
        "deadline": "the deadline passed", "lease": "this runner's lease ran out"}


def _report(batch: _Batch, call: _Call, gen: int, value: Any, error: BaseException | None,
            ended: deque[int] | None, bid: int) -> bool:
    """On the thread that ran the attempt: when it is the call's last (it returned, or it
    raised and the tool has no retry policy), and no timeout took it first, record it and
    reply with the call's outcome; True if so."""
    if error is not None and (isinstance(error, NotStarted)
                              or (call.planned.tool.retry is not None
                                  and batch.dispatch.retry is not None)):
        return False
    with call.gate:
        if call.ended == gen or call.halted or batch.adopted:
            return False
        call.ended = gen
    latency = time.perf_counter() - call.started[0]
    if error is None:
        call.outcome.attempts.append(Attempt(call.attempt, "ok", value, latency_s=latency))
    else:
        call.outcome.attempts.append(Attempt(
            call.attempt, "error", error=describe_exception(error),
            category=type(error).__name__, latency_s=latency))
    call.stage = "done"
    if ended is not None:
        ended.append(bid)  # the actor forgets it on its next message
    elif batch.unwatch is not None:
        batch.unwatch()
    batch.reply([call.outcome], None)
    return True


def _gate(d: Dispatch) -> decide.SkipReason | None:
    return decide.dispatch_gate(
        recordable=d.recordable is None or d.recordable(), cancelled=d.cancel.cancelled,
        deadline_passed=d.deadline is not None and d.clock.monotonic() >= d.deadline,
        leased=d.leased is None or d.leased())


def _launch(workers: Workers, telemetry: Telemetry | None, bid: int, batch: _Batch,
            index: int, send: Callable[[Any], None], ended: deque[int] | None) -> None:
    """Start the call's current attempt (its dispatch is durable) on the tool pool. Its
    timeout and its end come to the executor through ``send``, except the end the thread
    that ran it reports itself (``_report``)."""
    d, call = batch.dispatch, batch.calls[index]
    tool, p = call.planned.tool, call.planned
    child = None if d.run_child is None or d.parent is None else \
        _bind(d.run_child, d.parent, p.execution_id)
    ctx = ToolContext(p.run_id, p.call_id, p.execution_id, p.idempotency_key, call.attempt,
                      d.deadline, d.cancel, d.epoch, child)
    call.generation += 1
    call.stage = "launched"
    call.started[0] = 0.0
    gen, timer, started = call.generation, workers.timer, call.started

    def on_start() -> bool:
        # On the pool thread (or the event loop), right before the handler: a call that
        # waited for a free thread past the deadline or a cancellation does not run,
        # and its timeout counts from here, never from the wait.
        with call.gate:
            if call.halted or _gate(d) is not None:
                return False
            started[0] = time.perf_counter()
        timeout = decide.attempt_timeout(tool.timeout_s, d.deadline, d.clock.monotonic())
        if timeout is not None:
            timer.after(timeout, lambda: send(_TimedOut(bid, index, gen, timeout)))
        return True

    otel = None if telemetry is None else \
        telemetry.tool_context(p.run_id, p.execution_id, call.attempt)
    future = workers.start(workers.tool_pool, tool.handler, (), tool.bind(p.kwargs, ctx),
                           on_start, loop=d.loop, context=otel)
    call.future = future
    alone = len(batch.calls) == 1

    def done(f: Future[Any]) -> None:
        # On the thread that ran the handler: the call of a batch of one whose attempt is
        # its last (it returned, or raised with no retry to ask for) is reported to the
        # supervisor from here, not through the executor's inbox (one hand-off less a
        # round); anything else (a timeout first, a retry, a call not started) is the
        # executor's to handle, as a message.
        value, error = outcome(f)
        if not (alone and _report(batch, call, gen, value, error, ended, bid)):
            send(_Done(bid, index, gen, value, error))

    future.add_done_callback(done)


def launch_alone(executor: Any, workers: Workers, telemetry: Telemetry | None, d: Dispatch,
                 reply: Callable[[Any, BaseException | None], None]) -> bool:
    """On the supervisor's thread: start a batch of one call whose dispatch is durable and
    that may start now straight on the tool pool, without a hand-off to the executor; the
    thread that runs it reports its outcome (``_report``). The executor takes the batch
    over (``_Adopt``) when anything else happens: its timeout (the executor's wall), a
    retry to ask for, a cancellation or the deadline. False: nothing was started, the
    batch is the executor's to perform."""
    if len(d.calls) != 1 or not (d.calls[0].recorded or d.record is None) \
            or _gate(d) is not None:
        return False
    p = d.calls[0]
    call = _Call(p, Outcome(p.execution_id), p.first_attempt,
                 recorded=p.first_attempt if p.recorded else p.first_attempt - 1)
    batch = _Batch(d, reply, [call], deque(), running=1, adopted=False)
    bid = next(_IDS)

    # The timers (the attempt's timeout, the run's deadline) outlive the call and are never
    # cancelled: they hold the batch through this box, emptied once the batch is done, or
    # a finished call's result would stay in memory until they fire (up to timeout_s).
    box: list[_Batch | None] = [batch]

    def send(message: Any) -> None:
        held = box[0]
        if held is not None:  # else done: whatever it says would be ignored
            tell(executor, _Adopt(held, bid, message))

    _launch(workers, telemetry, bid, batch, 0, send, None)
    # Watched once launched (the executor takes nothing over before): a call waiting for
    # a free thread is skipped at once when the run is cancelled or its deadline passes.
    unwatch_cancel = d.cancel.on_cancel(lambda: send(_Halt(bid, "cancelled")))

    def unwatch() -> None:
        box[0] = None
        unwatch_cancel()

    batch.unwatch = unwatch
    if d.deadline is not None:
        workers.timer.at(d.deadline, lambda: send(_Halt(bid, "deadline")))
    with call.gate:
        reported = call.ended == call.generation
    if reported:
        batch.unwatch()
    return True


def _bind(run_child: Callable[..., Any], parent: Any, execution_id: str) -> Callable[..., Any]:
    def child(*args: Any, **kwargs: Any) -> Any:
        return run_child(parent, execution_id, *args, **kwargs)

    return child
