"""Event loops for ``async def`` callables: a loop per run, up to ``LOOP_THREADS`` loop
threads (a thousand waiting async calls cost no thread each, and one run's blocking
coroutine stalls no other run's while runs are fewer than loops)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from boundloop.actors._pool import MAX_THREADS

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


async def _cancel_all() -> None:
    # Tasks of timed-out async calls may still be pending; cancel them so the loop stops
    # cleanly instead of destroying pending tasks.
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
