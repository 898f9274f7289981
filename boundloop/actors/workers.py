"""Where user code runs: elastic thread pools for sync callables, event loops for
``async def`` ones (a loop per run, up to ``LOOP_THREADS`` loops: a thousand waiting async
calls cost no thread each, and one run's blocking coroutine stalls no other run's while
runs are fewer than loops), and one timer thread for timeouts, deadlines and retry delays.

A pool never starves: a thread that waits inside a pooled call (a sync handler blocked in
``run_child``) or that a timed-out handler still holds is *compensated*: the pool starts
another thread for as long as the wait lasts, as Java's ForkJoinPool ``managedBlock`` does,
up to a cap (``MAX_THREADS`` per pool by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, InvalidStateError
from types import FunctionType, MethodType
from typing import Any

import pykka
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from boundloop.clock import Clock

#: The most threads one pool runs to replace abandoned calls (SPEC 5: at least 256); calls
#: waiting in run_child are replaced beyond it (SPEC 8).
MAX_THREADS = 256
#: How long a thread above the pool's size waits idle before it ends.
_IDLE_S = 2.0
#: How long calls may wait in the queue while every thread is busy before the pool adds a
#: thread (handlers that hang with no timeout must not keep other runs' calls waiting).
STARVED_S = 1.0


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


class Timer:
    """Runs callbacks at times of the runner's clock, on one thread (no thread per timeout).

    On a FakeClock the timer moves only when the clock is advanced, so tests of time need
    no sleeps.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or Clock()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._clock.on_advance(self._wake)
        self._thread = threading.Thread(target=self._run, name="boundloop-timer", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the timer thread; keep it short) ``delay`` seconds from now."""
        self.at(self._clock.monotonic() + max(delay, 0.0), fn)

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the clock reads ``when`` (a ``clock.monotonic()`` value)."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            if self._heap[0][2] is fn:
                # Only a new earliest time changes the timer thread's wait: waking it for
                # every later one cost ~3 thread wake-ups a round (a tool timeout each).
                self._cond.notify()

    def _run(self) -> None:
        real = self._clock.real
        while True:
            with self._cond:
                while not self._stopped and (not self._heap
                                             or self._heap[0][0] > self._clock.monotonic()):
                    wait = None if not self._heap or not real else \
                        self._heap[0][0] - self._clock.monotonic()
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a callback must not stop the timer
                pass

    def close(self) -> None:
        """Stop; callbacks not yet due never run."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)


class PoolFuture(Future[Any]):
    """The Future of a call on a ``Pool``: one plain lock instead of a Condition.

    concurrent.futures' Future takes its Python-level Condition in every method (creating
    it, starting, finishing, adding a callback, reading the outcome: ~25 Python calls per
    pool call, about a tenth of a round's). A pool call is never cancelled and is read
    once it is done, so waiting (``result``/``exception`` before the end) uses an Event
    made only when somebody waits. Not for ``concurrent.futures.wait``/``as_completed``.
    """

    def __init__(self) -> None:  # Future.__init__'s Condition is what this saves
        self._lock = threading.Lock()
        self._state = "PENDING"
        self._result: Any = None
        self._exception: BaseException | None = None
        self._done_callbacks: list[Callable[[Future[Any]], object]] = []
        self._ended: threading.Event | None = None

    def cancel(self) -> bool:
        """Pool calls are never cancelled: False."""
        return False

    def cancelled(self) -> bool:
        """False: a pool call is never cancelled."""
        return False

    def running(self) -> bool:
        """True while the call runs."""
        return self._state == "RUNNING"

    def done(self) -> bool:
        """True once the call has returned or raised."""
        return self._state == "FINISHED"

    def set_running_or_notify_cancel(self) -> bool:
        """The call starts (always True: nothing cancels it)."""
        self._state = "RUNNING"
        return True

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        """Call ``fn(self)`` once the call ends (now, if it has)."""
        with self._lock:
            if self._state != "FINISHED":
                self._done_callbacks.append(fn)
                return
        _run_callback(fn, self)

    def _wait(self, timeout: float | None) -> None:
        with self._lock:
            if self._state == "FINISHED":
                return
            if self._ended is None:
                self._ended = threading.Event()
            ended = self._ended
        if not ended.wait(timeout):
            raise TimeoutError("the pool call has not ended")

    def result(self, timeout: float | None = None) -> Any:
        """The call's return value (raising what it raised), waiting up to ``timeout``."""
        self._wait(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What the call raised, or None, waiting up to ``timeout``."""
        self._wait(timeout)
        return self._exception

    def set_result(self, result: Any) -> None:
        """The call returned ``result``."""
        self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        """The call raised ``exception``."""
        self._finish(None, exception)

    def __repr__(self) -> str:
        return f"<PoolFuture at {id(self):#x} state={self._state}>"

    def _finish(self, result: Any, exception: BaseException | None) -> None:
        with self._lock:
            if self._state == "FINISHED":  # as Future does: an outcome is set once
                raise InvalidStateError(f"{self!r} has its outcome already")
            self._result, self._exception = result, exception
            self._state = "FINISHED"
            callbacks, self._done_callbacks = self._done_callbacks, []
            ended = self._ended
        if ended is not None:
            ended.set()
        for fn in callbacks:
            _run_callback(fn, self)


def _run_callback(fn: Callable[[Future[Any]], object], future: Future[Any]) -> None:
    try:
        fn(future)
    except Exception:  # noqa: BLE001 - as Future does: a callback must not stop the pool
        pass


class _Item:
    __slots__ = ("future", "call", "compensated", "running")

    def __init__(self, future: Future[Any], call: Callable[[], Any]) -> None:
        self.future = future
        self.call = call
        self.compensated = False
        self.running = False


_local = threading.local()


class Pool:
    """An elastic pool of daemon threads (unlike ThreadPoolExecutor's, a handler stuck past
    its timeout cannot keep the interpreter from exiting).

    ``threads`` run at all times; each thread that waits inside a call (``blocking()``) or
    that is held by an abandoned call (``compensate(future)``) adds one more, up to
    ``cap`` threads in all.
    """

    def __init__(self, threads: int, name: str, cap: int = MAX_THREADS) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._name = name
        self._size = threads
        self._cap = max(cap, threads)
        self._lock = threading.Lock()
        self._live = 0
        self._extra = 0  # threads owed to abandoned calls (capped)
        self._waits = 0  # threads owed to calls waiting in run_child (never capped: SPEC 8)
        self._boost = 0  # threads added while calls waited and every thread was busy
        self._watching = False  # a starvation check is due
        self._taken = 0  # calls threads have taken from the queue, ever
        self._taken_at_watch = 0
        self._serial = itertools.count()
        self._running: dict[Future[Any], _Item] = {}
        self._closed = False
        self.peak = 0  # the most threads this pool ever ran at once
        with self._lock:
            for _ in range(threads):
                self._spawn()

    @property
    def threads(self) -> int:
        """Threads alive now."""
        return self._live

    def _spawn(self) -> None:
        # Under self._lock.
        self._live += 1
        self.peak = max(self.peak, self._live)
        threading.Thread(target=self._work, name=f"{self._name}-{next(self._serial)}",
                         daemon=True).start()

    def _target(self) -> int:
        # Under self._lock: the threads the pool should have now. The cap bounds what
        # abandoned calls are owed; a call waiting for a child is always replaced, so any
        # number of parents may wait on their children at once (SPEC 8).
        return min(self._size + self._extra + self._boost, self._cap) + self._waits

    def _grow(self) -> None:
        # Under self._lock: one thread more while it is owed.
        if not self._closed and self._live < self._target():
            self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a pool thread."""
        future = PoolFuture()
        self._queue.put(_Item(future, lambda: fn(*args, **kwargs)))
        if len(self._running) >= self._live and not self._watching:
            self._watch()  # every thread is busy: make sure this call does not wait for ever
        return future

    def _watch(self) -> None:
        with self._lock:
            if self._watching or self._closed:
                return
            self._watching = True
            self._taken_at_watch = self._taken
        timer = threading.Timer(STARVED_S, self._starved)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no thread to be had (interpreter shutdown)
            with self._lock:
                self._watching = False

    def _starved(self) -> None:
        """Calls still wait and every thread is still busy (handlers hanging with no
        timeout, say): one thread more, up to the cap; look again while it lasts."""
        with self._lock:
            self._watching = False
            # Starved, not merely busy: calls wait and no thread took one all this time.
            starved = self._queue.qsize() > 0 and self._taken == self._taken_at_watch \
                and len(self._running) >= self._live
            if starved and not self._closed and self._live < self._cap + self._waits:
                self._boost += 1
                self._spawn()
        if starved:
            self._watch()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Compensate the calling pool thread while the ``with`` body waits (for a child
        run), beyond the cap."""
        with self._lock:
            self._waits += 1
            self._grow()
        try:
            yield
        finally:
            with self._lock:
                self._waits -= 1

    def compensate(self, future: Future[Any]) -> None:
        """The call behind ``future`` is abandoned (it timed out) but still holds its
        thread: add a thread until it returns. A call not yet running is left alone."""
        with self._lock:
            item = self._running.get(future)
            if item is None or item.compensated:
                return
            item.compensated = True
            self._extra += 1
            self._grow()

    def _work(self) -> None:
        _local.pool = self
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._boost:
                        self._boost -= 1  # idle: what starvation added is no longer owed
                    if self._live > self._target() or self._closed:
                        self._live -= 1
                        return
                continue
            if item is None:
                with self._lock:
                    self._live -= 1
                return
            if not item.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[item.future] = item
                self._taken += 1
            try:
                result = item.call()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                outcome: tuple[bool, Any] = (False, exc)
            else:
                outcome = (True, result)
            with self._lock:
                del self._running[item.future]
                if item.compensated:
                    self._extra -= 1
                retire = self._live > self._target()
                if retire:
                    self._live -= 1
            if outcome[0]:
                item.future.set_result(outcome[1])
            else:
                item.future.set_exception(outcome[1])
            if retire:
                return

    def shutdown(self) -> None:
        """Stop taking work; threads end once their current call returns."""
        with self._lock:
            self._closed = True
            live = self._live
        for _ in range(live):
            self._queue.put(None)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Wrap a wait inside user code (``run_child`` from a sync handler): when it runs on a
    pool thread, the pool gets a thread more for the duration."""
    pool: Pool | None = getattr(_local, "pool", None)
    if pool is None:
        yield
        return
    with pool.blocking():
        yield


def tell(ref: Any, message: Any) -> None:
    """``ref.tell(message)``, ignoring an actor already stopped (a late completion)."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass


#: The most event-loop threads a runner starts for the ``async def`` callables of runs
#: started with ``run``/``submit`` (one loop per run up to it; past it runs share the least
#: busy loops). Small enough that a thousand async runs still cost no thread each.
LOOP_THREADS = 16


class _LoopThread:
    """An event loop running on a thread of its own, and what it serves."""

    __slots__ = ("loop", "thread", "runs", "calls", "orphans")

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.runs = 0  # runs that hold it
        self.calls = 0  # calls started on it that have not ended
        self.orphans = 0  # of those, calls of runs that have ended (abandoned, still running)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def idle(self) -> bool:
        """No run holds it and no call runs on it."""
        return self.runs == 0 and self.calls == 0


class RunLoop:
    """Where one run's ``async def`` callables run: the caller's loop for a run started with
    ``arun`` (SPEC 1), else a loop thread of the runner's, taken on the run's first async
    call (a run with only sync callables takes none) and given back when it ends.

    A loop per run keeps one run's blocking code (a ``time.sleep`` or a CPU spin inside an
    ``async def``) from stalling another run's coroutines (SPEC 1: one run's code must not
    stretch another's deadline)."""

    __slots__ = ("caller", "held", "released", "calls")

    def __init__(self, caller: asyncio.AbstractEventLoop | None = None) -> None:
        self.caller = caller
        self.held: _LoopThread | None = None
        self.released = False
        self.calls = 0  # its calls on ``held`` that have not ended


class Loops:
    """The runner's event-loop threads for async callables: up to ``cap`` of them, and up
    to ``limit`` while every loop is held by a call of an ended run.

    A run takes an idle loop (no run holds it, no call runs on it), else a new one while
    fewer than ``cap`` exist, else the one that serves the fewest runs and calls among
    those where no call of an ended run still runs. A loop that such a call holds (a
    coroutine that blocks, abandoned at its deadline) is never idle, so it is handed to no
    other run while it is stuck; when every loop is so held, a new one is started (up to
    ``limit``), and loops beyond ``cap`` end once idle again."""

    def __init__(self, cap: int = LOOP_THREADS, limit: int = MAX_THREADS) -> None:
        self._cap = max(cap, 1)
        self._limit = max(limit, self._cap)
        self._lock = threading.Lock()
        self._all: list[_LoopThread] = []
        self._serial = itertools.count()
        self._closed = False

    @property
    def threads(self) -> int:
        """Loop threads started and not stopped."""
        return len(self._all)

    def _pick(self) -> _LoopThread:
        # Under self._lock.
        for held in self._all:
            if held.idle():
                return held
        count = len(self._all)
        if count < self._cap or (count < self._limit and all(t.orphans for t in self._all)):
            held = _LoopThread(f"boundloop-loop-{next(self._serial)}")
            self._all.append(held)
            return held
        return min(self._all, key=lambda t: (t.orphans, t.runs + t.calls))

    def start(self, run: RunLoop | asyncio.AbstractEventLoop | None,
              coroutine: Coroutine[Any, Any, Any]) -> Future[Any]:
        """Run ``coroutine`` on the run's loop (taken now if the run holds none yet)."""
        if isinstance(run, asyncio.AbstractEventLoop):
            return asyncio.run_coroutine_threadsafe(coroutine, run)
        if run is not None and run.caller is not None:
            return asyncio.run_coroutine_threadsafe(coroutine, run.caller)
        with self._lock:
            if self._closed:
                raise RuntimeError("the runner's event loops are closed")
            # A run that has ended takes no loop of its own again (a late call of it runs
            # anywhere, as nobody's).
            held = run.held if run is not None and not run.released else None
            if held is None:
                held = self._pick()
                if run is not None and not run.released:
                    run.held = held
                    held.runs += 1
            mine = run is not None and run.held is held and not run.released
            held.calls += 1
            if mine:
                assert run is not None
                run.calls += 1
            else:  # a call of no run, or of one that has ended: nobody waits for it
                held.orphans += 1
        future = asyncio.run_coroutine_threadsafe(coroutine, held.loop)
        future.add_done_callback(lambda _: self._ended(held, run if mine else None))
        return future

    def _ended(self, held: _LoopThread, run: RunLoop | None) -> None:
        with self._lock:
            held.calls -= 1
            if run is None or run.released:
                held.orphans -= 1
            else:
                run.calls -= 1
            self._trim(held)

    def _trim(self, held: _LoopThread) -> None:
        # Under self._lock: a loop started past the cap (every other was stuck) ends once
        # it is idle, so the cap holds again once the stuck calls have ended.
        if held.idle() and len(self._all) > self._cap and held in self._all:
            self._all.remove(held)
            held.loop.call_soon_threadsafe(held.loop.stop)

    def release(self, run: RunLoop) -> None:
        """The run has ended: its loop may serve another run once its calls have ended."""
        with self._lock:
            if run.released:
                return
            run.released = True
            if run.held is not None:
                run.held.runs -= 1
                run.held.orphans += run.calls  # they run on, abandoned
                self._trim(run.held)

    def close(self) -> None:
        """Cancel what still runs on every loop (5 s in all, not each), stop the loops."""
        with self._lock:
            self._closed = True
            loops, self._all = self._all, []
        ends = time.monotonic() + 5
        waits = []
        for held in loops:
            if held.loop.is_running():
                waits.append(asyncio.run_coroutine_threadsafe(_cancel_all(), held.loop))
        for wait in waits:
            try:
                wait.result(timeout=max(ends - time.monotonic(), 0.01))
            except Exception:  # noqa: BLE001 - closing goes on regardless
                pass
        for held in loops:
            with contextlib.suppress(RuntimeError):  # closed already
                held.loop.call_soon_threadsafe(held.loop.stop)
        for held in loops:
            held.thread.join(timeout=max(ends - time.monotonic(), 0.01))


class Workers:
    """Thread pools for models and tools, the event loops for async ones, and the timer."""

    def __init__(self, model_threads: int = 32, tool_threads: int = 32,
                 clock: Clock | None = None, max_threads: int = MAX_THREADS,
                 loop_threads: int = LOOP_THREADS) -> None:
        self.model_pool = Pool(model_threads, "boundloop-model", max_threads)
        self.tool_pool = Pool(tool_threads, "boundloop-tool", max_threads)
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


async def _cancel_all() -> None:
    # Tasks of timed-out async calls may still be pending; cancel them so the loop stops
    # cleanly instead of destroying pending tasks.
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
