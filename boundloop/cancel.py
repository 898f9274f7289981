"""Cancellation tokens."""

from __future__ import annotations

import threading


class CancelToken:
    """A flag that asks a run to stop; safe to set from any thread (or from a callback)."""

    __slots__ = ("_event", "reason")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def cancel(self, reason: str = "") -> None:
        """Ask the run to stop at its next check (SPEC 5)."""
        if not self._event.is_set():
            self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called."""
        return self._event.is_set()

    def is_cancelled(self) -> bool:
        """Same as ``cancelled``."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` passes; True when cancelled."""
        return self._event.wait(timeout)

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled})"
