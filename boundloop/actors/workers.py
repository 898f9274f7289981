"""Where user code runs: elastic thread pools for sync callables, event loops for
``async def`` ones (a loop per run, up to ``LOOP_THREADS`` loops: a thousand waiting async
calls cost no thread each, and one run's blocking coroutine stalls no other run's while
runs are fewer than loops), and one timer thread for timeouts, deadlines and retry delays.

A pool never starves: a thread that waits inside a pooled call (a sync handler blocked in
``run_child``) or that a timed-out handler still holds is *compensated*: the pool starts
another thread for as long as the wait lasts, as Java's ForkJoinPool ``managedBlock`` does,
up to a cap (``MAX_THREADS`` per pool by default).

The parts live in private modules by job: ``_pool`` (the thread pools and their
compensation), ``_loops`` (the event-loop threads), ``_timer`` (the timer thread). This
module puts them together (``Workers``) and starts calls on them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import Future
from types import FunctionType, MethodType
from typing import Any

import pykka
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from boundloop.actors._loops import LOOP_THREADS as LOOP_THREADS
from boundloop.actors._loops import Loops as Loops
from boundloop.actors._loops import RunLoop as RunLoop
from boundloop.actors._pool import MAX_THREADS as MAX_THREADS
from boundloop.actors._pool import Pool as Pool
from boundloop.actors._pool import PoolFuture as PoolFuture
from boundloop.actors._pool import waiting as waiting
from boundloop.actors._timer import Timer as Timer
from boundloop.clock import Clock

#: What ``inspect.markcoroutinefunction`` (Python 3.12+) sets on a function it marks async.
_MARKER = "_is_coroutine_marker"


def is_async(fn: Callable[..., Any]) -> bool:
    """True for an ``async def`` function or a callable object whose ``__call__`` is one (as
    ``inspect.iscoroutinefunction`` says of it or of its ``__call__``)."""
    # The common cases without inspect's unwrapping (~5 µs, twice a round): a plain
    # function, a bound method of one, and boundloop's own models (classes that say so with
    # ``_plain_call``, read on the exact class: a user's subclass is asked of inspect). A
    # function marked by markcoroutinefunction, and everything else, is asked of inspect:
    # proxies, partials, mocks and objects that set __call__ on themselves answer otherwise.
    if type(fn) is FunctionType and _MARKER not in fn.__dict__:
        return bool(fn.__code__.co_flags & inspect.CO_COROUTINE)
    if type(fn) is MethodType:
        func = fn.__func__
        if type(func) is FunctionType and _MARKER not in func.__dict__:
            return bool(func.__code__.co_flags & inspect.CO_COROUTINE)
    cls = type(fn)
    if cls.__dict__.get("_plain_call") is True and "__call__" not in fn.__dict__:
        call = cls.__dict__.get("__call__")
        if type(call) is FunctionType and _MARKER not in call.__dict__:
            return bool(call.__code__.co_flags & inspect.CO_COROUTINE)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - async callable objects


class NotStarted(Exception):
    """A call was not started: by the time a thread was free, it was no longer wanted."""




def tell(ref: Any, message: Any) -> None:
    """``ref.tell(message)``, ignoring an actor already stopped (a late completion)."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass


class Workers:
    """Thread pools for models and tools, the event loops for async ones, and the timer."""

    def __init__(self, model_threads: int = 32, tool_threads: int = 32,
                 clock: Clock | None = None, max_threads: int = MAX_THREADS,
                 loop_threads: int = LOOP_THREADS) -> None:
        self.model_pool = Pool(model_threads, "boundloop-model", max_threads)
        self.tool_pool = Pool(tool_threads, "boundloop-tool", max_threads)
        #: Where a refused run's Future with callbacks is settled (``Starting._admitted``):
        #: a caller's callback runs there, never on admission's thread nor behind tool calls.
        self.settle_pool = Pool(1, "boundloop-settle", max_threads)
        self.timer = Timer(clock)
        self.loops = Loops(loop_threads, max_threads)

    def start(self, pool: Pool, fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], on_start: Callable[[], bool] | None = None,
              loop: RunLoop | asyncio.AbstractEventLoop | None = None,
              context: Context | None = None) -> Future[Any]:
        """Start ``fn(*args, **kwargs)``: on ``loop`` (a run's, else any of the runner's
        loops) if it is async, else on ``pool``. ``on_start()`` runs right before ``fn``
        does (so a timeout can count from the real start, not from a wait in the pool's
        queue); when it returns False, ``fn`` is not run and the future fails with
        NotStarted. Whatever ``fn`` raises, even while a coroutine is being created,
        arrives through the future. ``context`` (an OpenTelemetry context) is the current
        one while ``fn`` runs (its ``chat`` or ``execute_tool`` span, so spans made inside
        nest under it)."""
        if is_async(fn):
            if on_start is not None and not on_start():
                return _failed(NotStarted())
            try:
                coroutine = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - a wrong signature, say
                return _failed(exc)
            wrapper = _await(coroutine, context)
            try:
                return self.loops.start(loop, wrapper)
            except RuntimeError as exc:  # the caller's loop (or the runner) was closed
                wrapper.close()
                if inspect.iscoroutine(coroutine):
                    coroutine.close()
                return _failed(exc)
        if context is not None:
            return pool.submit(self._call_in, context, on_start, fn, args, kwargs, loop)
        return pool.submit(self._call_sync, on_start, fn, args, kwargs, loop)

    def _call_sync(self, on_start: Callable[[], bool] | None, fn: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any],
                   loop: RunLoop | asyncio.AbstractEventLoop | None,
                   context: Context | None = None) -> Any:
        if on_start is not None and not on_start():
            raise NotStarted()
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):  # a sync callable that returned a coroutine
            with waiting():
                return self.loops.start(loop, _await(result, context)).result()
        return result

    def _call_in(self, context: Context, on_start: Callable[[], bool] | None,
                 fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 loop: RunLoop | asyncio.AbstractEventLoop | None) -> Any:
        # A separate path, so a call without telemetry pays nothing for it.
        token = otel_context.attach(context)
        try:
            return self._call_sync(on_start, fn, args, kwargs, loop, context)
        finally:
            otel_context.detach(token)

    def compensate(self, future: Future[Any]) -> None:
        """``future``'s call was abandoned: its thread (if any) is replaced in its pool."""
        self.model_pool.compensate(future)
        self.tool_pool.compensate(future)

    def close(self) -> None:
        """Stop the loops, the timer and the pools (handlers still running are not waited
        for: a timed-out handler finishes in the background)."""
        self.timer.close()
        self.loops.close()
        self.model_pool.shutdown()
        self.tool_pool.shutdown()
        self.settle_pool.shutdown()


def outcome(future: Future[Any]) -> tuple[Any, BaseException | None]:
    """A done future's (value, None) or (None, exception); never raises, even for a future
    cancelled when the runner closed (its call is over as far as anyone waits for it)."""
    if type(future) is PoolFuture and future.done():  # never cancelled: no lock to take
        return future._result, future._exception
    if future.cancelled():
        return None, NotStarted("the call was cancelled (the runner is closing)")
    exc = future.exception()
    return (None, exc) if exc is not None else (future.result(), None)


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class UserRaised(Exception):
    """User code raised what is not an ``Exception`` (a CancelledError nobody asked for, a
    KeyboardInterrupt, a SystemExit): it ends that call as an error, like any other."""


async def _await(awaitable: Any, context: Context | None = None) -> Any:
    # Attached inside the task: a task runs in a copy of the context it was made in, so
    # this reaches the awaited code and ends with the task.
    token = otel_context.attach(context) if context is not None else None
    try:
        return await awaitable
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # cancelled from outside (a timeout, the runner closing): a cancellation
        # Raised by the callable itself: an attempt that ran is not one never started.
        raise UserRaised("it raised asyncio.CancelledError itself") from None
    except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
        # In a task these would stop the application's event loop (asyncio re-raises them).
        raise UserRaised(f"it raised {type(exc).__name__}") from None
    finally:
        if token is not None:
            otel_context.detach(token)
