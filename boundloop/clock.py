"""Clocks: the system clock, and a fake one for tests of time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "FakeClock"]


class Clock:
    """The system clock: ``monotonic()`` for deadlines, ``time()`` for timestamps."""

    #: True when time passes by itself (a timer may sleep until what it waits for is due).
    real = True

    def on_advance(self, fn: Callable[[], None]) -> None:
        """Have ``fn`` called whenever the clock jumps forward (never, for the real one)."""

    # Methods that look up time.monotonic/time.time at each call (not the builtins bound
    # once, which saved ~15 Python calls a round): a test that patches the time module
    # (mock.patch, freezegun) moves this clock too, as it always did.
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        return time.monotonic()

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        return time.time()


class FakeClock(Clock):
    """A clock that moves only when told to: ``advance(seconds)``. Thread-safe. The
    runner's timers (tool timeouts, deadlines, retry delays) run on it too."""

    real = False

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall - start
        self._lock = threading.Lock()
        self._watchers: list[Callable[[], None]] = []

    def on_advance(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._watchers.append(fn)

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        with self._lock:
            self._now += seconds
            watchers = list(self._watchers)
        for fn in watchers:
            fn()
