"""Elastic thread pools for sync callables, which never starve.

A thread that waits inside a pooled call (a sync handler blocked in ``run_child``) or that a
timed-out handler still holds is *compensated*: the pool starts another thread for as long
as the wait lasts, as Java's ForkJoinPool ``managedBlock`` does, up to a cap
(``MAX_THREADS`` per pool by default).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

#: The most threads one pool runs to replace abandoned calls (SPEC 5: at least 256); calls
#: waiting in run_child are replaced beyond it (SPEC 8).
MAX_THREADS = 256
#: How long a thread above the pool's size waits idle before it ends.
_IDLE_S = 2.0
#: How long calls may wait in the queue while every thread is busy before the pool adds a
#: thread (handlers that hang with no timeout must not keep other runs' calls waiting).
STARVED_S = 1.0


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
            names = [self._reserve() for _ in range(threads)]
        self._start(names)

    @property
    def threads(self) -> int:
        """Threads alive now."""
        return self._live

    @property
    def closed(self) -> bool:
        """True once ``shutdown`` was called: a call submitted now would never run."""
        return self._closed

    def _reserve(self) -> str:
        # Under self._lock: one thread more counts as live now; the caller starts it with
        # _start once it has let go of the lock. Thread.start() waits until the new thread
        # runs, which under load takes milliseconds: under the lock, it stalled every
        # thread ending a call and the executor actor compensating one (seen in the soak).
        self._live += 1
        self.peak = max(self.peak, self._live)
        return f"{self._name}-{next(self._serial)}"

    def _start(self, names: list[str]) -> None:
        # Not under self._lock: start the threads _reserve counted.
        for i, name in enumerate(names):
            try:
                threading.Thread(target=self._work, name=name, daemon=True).start()
            except BaseException:
                with self._lock:  # none of the rest will run: they are not live after all
                    self._live -= len(names) - i
                raise

    def _target(self) -> int:
        # Under self._lock: the threads the pool should have now. The cap bounds what
        # abandoned calls are owed; a call waiting for a child is always replaced, so any
        # number of parents may wait on their children at once (SPEC 8).
        return min(self._size + self._extra + self._boost, self._cap) + self._waits

    def _grow(self) -> list[str]:
        # Under self._lock: one thread more while it is owed (to _start after the lock).
        if not self._closed and self._live < self._target():
            return [self._reserve()]
        return []

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
        names: list[str] = []
        with self._lock:
            self._watching = False
            # Starved, not merely busy: calls wait and no thread took one all this time.
            starved = self._queue.qsize() > 0 and self._taken == self._taken_at_watch \
                and len(self._running) >= self._live
            if starved and not self._closed and self._live < self._cap + self._waits:
                self._boost += 1
                names.append(self._reserve())
        self._start(names)
        if starved:
            self._watch()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Compensate the calling pool thread while the ``with`` body waits (for a child
        run), beyond the cap."""
        with self._lock:
            self._waits += 1
            names = self._grow()
        try:
            self._start(names)
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
            names = self._grow()
        self._start(names)

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
