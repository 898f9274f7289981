"""The tool executor: runs handlers with timeouts, ``max_parallel``, retries and reconcile.

It is a message-driven state machine: handlers run on the workers' pools (or event loop),
their completions, timeouts and retry delays come back as messages, and the actor's own
thread never waits on a handler.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import pykka

from boundloop.actors.messages import DispatchBatch
from boundloop.actors.workers import NotStarted, Workers, tell
from boundloop.loop import Attempt, Dispatch, Outcome, Planned, Reconcile
from boundloop.tools import ToolContext


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


class _Reconciled(msgspec.Struct):
    batch: int
    index: int
    generation: int
    took: bool | None
    value: Any = None


class _Call(msgspec.Struct):
    planned: Planned
    outcome: Outcome
    attempt: int
    generation: int = 0
    # Set on the pool thread when the handler really starts (read after its messages).
    started: list[float] = msgspec.field(default_factory=lambda: [0.0])


class _Batch(msgspec.Struct):
    dispatch: Dispatch
    reply: Callable[[Any, BaseException | None], None]
    calls: list[_Call]
    waiting: deque[int]
    allowance: int
    running: int = 0
    finished: int = 0


def reconcile_result(value: Any, error: BaseException | None) -> tuple[bool | None, Any]:
    """``reconcile``'s answer: (True, result) took effect; (False, None) did not; (None,
    None) cannot tell (it raised)."""
    if error is not None:
        return None, None
    return (False, None) if value is None else (True, value)


class ExecutorActor(pykka.ThreadingActor):
    """Performs Dispatch and Reconcile effects."""

    # Daemon threads: a runner that is never closed must not keep the process alive.
    use_daemon_thread = True

    def __init__(self, workers: Workers) -> None:
        super().__init__()
        self.workers = workers
        self.batches: dict[int, _Batch] = {}
        self._ids = itertools.count()

    def _tell_when_done(self, future: Future[Any], make: Callable[[Any, BaseException | None],
                                                                  Any]) -> None:
        me = self.actor_ref

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            tell(me, make(None if exc is not None else f.result(), exc))

        future.add_done_callback(done)

    def on_receive(self, message: Any) -> Any:
        match message:
            case DispatchBatch(dispatch=Reconcile(planned=p), reply=reply):
                if p.tool.reconcile is None:
                    reply((None, None), None)
                    return None
                future = self.workers.submit(self.workers.tool_pool, p.tool.reconcile,
                                             p.idempotency_key)
                answered = threading.Lock()

                def answer(took: tuple[bool | None, Any]) -> None:
                    if answered.acquire(blocking=False):  # the first answer wins
                        reply(took, None)

                future.add_done_callback(lambda f: answer(reconcile_result(
                    None if f.exception() else f.result(), f.exception())))
                # A reconcile that hangs cannot tell: after the tool's timeout it is unknown.
                self.workers.timer.after(p.tool.timeout_s or 60.0, lambda: answer((None, None)))
            case DispatchBatch(dispatch=Dispatch() as d, reply=reply):
                try:
                    self._start_batch(d, reply)
                except Exception as exc:  # noqa: BLE001 - fail this batch, keep the actor
                    self.batches = {k: b for k, b in self.batches.items() if b.reply is not reply}
                    reply(None, exc)
            case _Done() | _TimedOut() | _Reconciled() | _Retry():
                batch = self.batches.get(message.batch)
                if batch is not None:
                    try:
                        self._on_event(batch, message)
                    except Exception as exc:  # noqa: BLE001 - fail this batch, keep the actor
                        self.batches.pop(message.batch, None)
                        batch.reply(None, exc)
        return None

    # -- batches -----------------------------------------------------------------------
    def _start_batch(self, d: Dispatch,
                     reply: Callable[[Any, BaseException | None], None]) -> None:
        bid = next(self._ids)
        calls = [_Call(p, Outcome(p.execution_id), p.first_attempt) for p in d.calls]
        batch = _Batch(d, reply, calls, deque(range(len(calls))), d.retry_allowance)
        self.batches[bid] = batch
        if not calls:
            self._reply(bid, batch)
            return
        self._fill(bid, batch)

    def _fill(self, bid: int, batch: _Batch) -> None:
        limit = batch.dispatch.max_parallel or len(batch.calls)
        while batch.waiting and batch.running < limit:
            index = batch.waiting.popleft()
            batch.running += 1
            self._attempt(bid, batch, index)

    def _why_not(self, d: Dispatch) -> str | None:
        if d.recordable is not None and not d.recordable():
            return "journal"  # fail closed: what cannot be recorded is not done
        if d.cancel.cancelled:
            return "cancelled"
        if d.deadline is not None and d.clock.monotonic() >= d.deadline:
            return "deadline"
        return None

    def _attempt(self, bid: int, batch: _Batch, index: int) -> None:
        d, call = batch.dispatch, batch.calls[index]
        why = self._why_not(d)
        if why is not None:
            if not call.outcome.attempts:
                call.outcome.skipped = why
            self._call_done(bid, batch)
            return
        tool, p = call.planned.tool, call.planned
        child = None if d.run_child is None or d.parent is None else \
            _bind(d.run_child, d.parent, p.execution_id)
        ctx = ToolContext(p.run_id, p.call_id, p.execution_id, p.idempotency_key, call.attempt,
                          d.deadline, d.cancel, child)
        call.generation += 1
        gen, me, timer, started = call.generation, self.actor_ref, self.workers.timer, call.started

        def on_start() -> bool:
            # On the pool thread, right before the handler: a call that waited for a free
            # thread past the deadline or a cancellation does not run, and its timeout
            # counts from here, never from the wait.
            if self._why_not(d) is not None:
                return False
            timeout = tool.timeout_s
            if d.deadline is not None:
                left = max(d.deadline - d.clock.monotonic(), 0.001)
                timeout = left if timeout is None else min(timeout, left)
            started[0] = time.perf_counter()
            if timeout is not None:
                timer.after(timeout, lambda: tell(me, _TimedOut(bid, index, gen, timeout)))
            return True

        future = self.workers.start(self.workers.tool_pool, tool.handler,
                                    tool.bind(p.kwargs, ctx), on_start)
        self._tell_when_done(future, lambda v, e: _Done(bid, index, gen, v, e))

    def _on_event(self, batch: _Batch, m: _Done | _TimedOut | _Reconciled | _Retry) -> None:
        bid = m.batch
        call = batch.calls[m.index]
        if isinstance(m, _Retry):
            self._attempt(bid, batch, m.index)
            return
        if m.generation != call.generation:
            return  # a completion after its timeout, or a timer after its completion
        latency = time.perf_counter() - call.started[0]
        policy, tool = call.planned.tool.retry, call.planned.tool
        match m:
            case _Done(error=NotStarted()):
                call.generation += 1
                if not call.outcome.attempts:
                    call.outcome.skipped = self._why_not(batch.dispatch) or "cancelled"
                self._call_done(bid, batch)
            case _Done(error=None):
                call.generation += 1
                call.outcome.attempts.append(Attempt(call.attempt, "ok", m.value,
                                                     latency_s=latency))
                self._call_done(bid, batch)
            case _Done(error=exc) if exc is not None:
                call.generation += 1
                call.outcome.attempts.append(Attempt(
                    call.attempt, "error", error=f"{type(exc).__name__}: {exc}",
                    category=type(exc).__name__, latency_s=latency))
                self._retry_or_done(bid, batch, m.index,
                                    policy is not None and isinstance(exc, policy.retry_on))
            case _TimedOut():
                call.generation += 1
                timeout = m.timeout
                call.outcome.attempts.append(Attempt(
                    call.attempt, "timeout", latency_s=latency, timeout_s=timeout,
                    error=f"the call timed out after {timeout:.3g}s; whether it took effect "
                          "is not known"))
                if tool.reconcile is None:
                    self._retry_or_done(bid, batch, m.index, self._timeout_retryable(call, None))
                    return
                gen = call.generation
                future = self.workers.submit(self.workers.tool_pool, tool.reconcile,
                                             call.planned.idempotency_key)
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
                    self._call_done(bid, batch)
                else:
                    self._retry_or_done(bid, batch, m.index, self._timeout_retryable(call, m.took))

    def _timeout_retryable(self, call: _Call, reconciled: bool | None) -> bool:
        policy, tool = call.planned.tool.retry, call.planned.tool
        return policy is not None and issubclass(TimeoutError, policy.retry_on) and (
            reconciled is False or tool.idempotent)

    def _retry_or_done(self, bid: int, batch: _Batch, index: int, retryable: bool) -> None:
        d, call = batch.dispatch, batch.calls[index]
        policy = call.planned.tool.retry
        if policy is None or not retryable or batch.allowance <= 0 \
                or call.attempt - call.planned.first_attempt + 1 >= policy.max_attempts:
            self._call_done(bid, batch)
            return
        delay = policy.delay(call.attempt + 1)
        if (d.deadline is not None and d.clock.monotonic() + delay >= d.deadline) \
                or self._why_not(d) is not None:
            self._call_done(bid, batch)
            return
        batch.allowance -= 1
        call.attempt += 1
        if delay > 0:
            me = self.actor_ref
            self.workers.timer.after(delay, lambda: tell(me, _Retry(bid, index)))
        else:
            self._attempt(bid, batch, index)

    def _call_done(self, bid: int, batch: _Batch) -> None:
        batch.running -= 1
        batch.finished += 1
        if batch.finished == len(batch.calls):
            self._reply(bid, batch)
        else:
            self._fill(bid, batch)

    def _reply(self, bid: int, batch: _Batch) -> None:
        del self.batches[bid]
        batch.reply([c.outcome for c in batch.calls], None)


def _bind(run_child: Callable[..., Any], parent: Any, execution_id: str) -> Callable[..., Any]:
    def child(*args: Any, **kwargs: Any) -> Any:
        return run_child(parent, execution_id, *args, **kwargs)

    return child
