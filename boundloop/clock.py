"""Clocks: the system clock, and a fake one for tests of time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Clock:
    """The system clock: ``monotonic()`` for deadlines, ``time()`` for timestamps."""

    #: True when time passes by itself (a timer may sleep until what it waits for is due).
    real = True

    def on_advance(self, fn: Callable[[], None]) -> None:
        """Have ``fn`` called whenever the clock jumps forward (never, for the real one)."""

    # The builtins themselves, not methods wrapping them: the loop reads the clock ~15
    # times a round, and each wrapper was a Python call. A subclass overrides them with
    # methods (FakeClock).
    #: Seconds on a clock that never goes back (``time.monotonic``).
    monotonic: Callable[[], float] = staticmethod(time.monotonic)
    #: Wall-clock seconds since the epoch (``time.time``).
    time: Callable[[], float] = staticmethod(time.time)


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
