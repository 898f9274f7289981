"""Where user code runs: bounded thread pools for sync callables, one asyncio loop for
``async def`` ones (so a thousand waiting async calls cost no threads), and one timer
thread for timeouts and retry delays."""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pykka


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - async callable objects


class NotStarted(Exception):
    """A call was not started: by the time a thread was free, it was no longer wanted."""


class Timer:
    """Runs callbacks after delays, on one thread (no thread per timeout)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="boundloop-timer", daemon=True)
        self._thread.start()

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the timer thread; keep it short) ``delay`` seconds from now."""
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + max(delay, 0.0), next(self._seq), fn))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap
                                             or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else self._heap[0][0] - time.monotonic()
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


class Pool:
    """A fixed pool of daemon threads: unlike ThreadPoolExecutor's, a handler stuck past its
    timeout cannot keep the interpreter from exiting."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a pool thread."""
        future: Future[Any] = Future()
        self._queue.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Stop taking work; threads end once their current call returns."""
        for _ in self._threads:
            self._queue.put(None)


def tell(ref: Any, message: Any) -> None:
    """``ref.tell(message)``, ignoring an actor already stopped (a late completion)."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass


class Workers:
    """Thread pools for models and tools, the event loop for async ones, and the timer."""

    def __init__(self, model_threads: int = 32, tool_threads: int = 32) -> None:
        self.model_pool = Pool(model_threads, "boundloop-model")
        self.tool_pool = Pool(tool_threads, "boundloop-tool")
        self.timer = Timer()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop for async callables, started on first use."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="boundloop-loop", daemon=True)
                self._thread.start()
            return self._loop

    def submit(self, pool: Pool, fn: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Future[Any]:
        """Start ``fn(*args, **kwargs)``: on the loop if it is async, else on ``pool``."""
        if _is_async(fn):
            return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop)
        return pool.submit(self._call_sync, fn, args, kwargs)

    def start(self, pool: Pool, fn: Callable[..., Any], kwargs: dict[str, Any],
              on_start: Callable[[], bool]) -> Future[Any]:
        """Like ``submit``, but ``on_start()`` runs right before ``fn`` does (so a timeout can
        count from the real start, not from a wait in the pool's queue); when it returns
        False, ``fn`` is not run and the future fails with NotStarted."""
        if _is_async(fn):
            if not on_start():
                refused: Future[Any] = Future()
                refused.set_exception(NotStarted())
                return refused
            return asyncio.run_coroutine_threadsafe(fn(**kwargs), self.loop)
        return pool.submit(self._call_started, on_start, fn, kwargs)

    def _call_started(self, on_start: Callable[[], bool], fn: Callable[..., Any],
                      kwargs: dict[str, Any]) -> Any:
        if not on_start():
            raise NotStarted()
        return self._call_sync(fn, (), kwargs)

    def _call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):  # a sync callable that returned a coroutine
            return asyncio.run_coroutine_threadsafe(_await(result), self.loop).result()
        return result

    def close(self) -> None:
        """Stop the loop, the timer and the pools (handlers still running are not waited
        for: a timed-out handler finishes in the background)."""
        self.timer.close()
        loop = self._loop
        if loop is not None and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing goes on regardless
                pass
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
        self.model_pool.shutdown()
        self.tool_pool.shutdown()


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def _cancel_all() -> None:
    # Tasks of timed-out async calls may still be pending; cancel them so the loop stops
    # cleanly instead of destroying pending tasks.
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
