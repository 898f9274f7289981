"""The runner's one timer thread: callbacks at times of its clock (timeouts, deadlines,
retry delays), with no thread per timeout."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable

from boundloop.clock import Clock


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
