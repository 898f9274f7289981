"""Cancellation tokens."""

from __future__ import annotations

import threading
import time


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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` passes; True when cancelled."""
        return self._event.wait(timeout)

    def child(self, *others: CancelToken) -> CancelToken:
        """A token cancelled when this one (or any of ``others``) is, or on its own."""
        return _ChildToken((self, *others))

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled})"


class _ChildToken(CancelToken):
    __slots__ = ("_parents",)

    def __init__(self, parents: tuple[CancelToken, ...]) -> None:
        super().__init__()
        self._parents = parents

    @property
    def cancelled(self) -> bool:
        return self._event.is_set() or any(p.cancelled for p in self._parents)

    def wait(self, timeout: float | None = None) -> bool:
        # Poll the parent too: a child's wait must end when either is cancelled.
        end = None if timeout is None else time.monotonic() + timeout
        while not self.cancelled:
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                return False
            self._event.wait(left)
        return True
