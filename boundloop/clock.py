"""Clocks: the system clock, and a fake one for tests of time."""

from __future__ import annotations

import threading
import time


class Clock:
    """The system clock: ``monotonic()`` for deadlines, ``time()`` for timestamps."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        return time.monotonic()

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        return time.time()


class FakeClock(Clock):
    """A clock that moves only when told to: ``advance(seconds)``. Thread-safe."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall - start
        self._lock = threading.Lock()

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
