"""Cancellation tokens."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

__all__ = ["CancelToken"]

_keys = itertools.count()


class CancelToken:
    """A flag that asks a run to stop; safe to set from any thread (or from a callback)."""

    __slots__ = ("_event", "_set", "reason", "_lock", "_callbacks", "_children")

    def __init__(self) -> None:
        self._event = threading.Event()
        # A plain flag beside the Event: ``cancelled`` is read ~6 times a round, and
        # Event.is_set is a Python call.
        self._set = False
        self.reason = ""
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._children: dict[int, CancelToken] = {}

    def cancel(self, reason: str = "") -> None:
        """Ask the run to stop at its next check (SPEC 5)."""
        with self._lock:
            if self._set:
                return
            self.reason = reason
            self._set = True
            self._event.set()
            callbacks = list(self._callbacks.values())
            children = list(self._children.values())
            self._callbacks.clear()
            self._children.clear()
        for child in children:
            child.cancel(reason)
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one watcher must not stop the others
                pass

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called."""
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` passes; True when cancelled."""
        return self._event.wait(timeout)

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` once, when the token is cancelled (at once if it already is); returns
        a function that stops watching."""
        with self._lock:
            if not self._set:
                key = next(_keys)
                self._callbacks[key] = fn
                return lambda: self._forget(key)
        fn()
        return _nothing

    def _forget(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    def child(self, *others: CancelToken) -> CancelToken:
        """A token cancelled when this one (or any of ``others``) is, or on its own."""
        token = CancelToken()
        for parent in (self, *others):
            parent._adopt(token)
        return token

    def _adopt(self, token: CancelToken) -> None:
        with self._lock:
            if not self._set:
                self._children[id(token)] = token
                return
        token.cancel(self.reason)

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled})"


def _nothing() -> None:
    return None
