"""ScriptedModel: a deterministic model callback for tests and demos."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from boundloop.errors import BoundloopError

__all__ = ["ScriptExhausted", "ScriptedModel"]


class ScriptExhausted(BoundloopError):
    """The ScriptedModel was called more often than it has responses."""


class ScriptedModel:
    """A model that answers from a script, one item per call.

    Each item is a response (``bl.Final``, ``bl.CallTools`` or their dicts), a callable
    ``(history, ctx) -> response``, or an exception (instance or class) to raise. Calling
    past the end raises :class:`ScriptExhausted` (the run ends ``model_error``).

    Attributes:
        seen: the history each call received, in order (what the model saw).
        contexts: the ModelContext of each call.
        max_output_tokens: the declared output maximum used by the default reservation.
        provider: ``gen_ai.provider.name`` of its ``chat`` spans (default
            ``boundloop.scripted``; a test standing in for a provider may name it).
    """

    #: ``gen_ai.provider.name`` of its ``chat`` spans (OpenTelemetry GenAI conventions).
    provider = "boundloop.scripted"

    def __init__(self, responses: Iterable[Any], *, max_output_tokens: int | None = None,
                 provider: str | None = None) -> None:
        self._responses = list(responses)
        self._next = 0
        self._lock = threading.Lock()
        self.seen: list[list[Any]] = []
        self.contexts: list[Any] = []
        self.max_output_tokens = max_output_tokens
        if provider is not None:
            self.provider = provider

    @property
    def calls(self) -> int:
        """How many times the model was invoked."""
        return self._next

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    def __call__(self, history: list[Any], ctx: Any) -> Any:
        with self._lock:
            index = self._next
            self._next += 1
            self.seen.append(history)
            self.contexts.append(ctx)
        if index >= len(self._responses):
            raise ScriptExhausted(f"the script has {len(self._responses)} responses; call "
                                  f"{index + 1} has none")
        item = self._responses[index]
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item()
        if callable(item) and not isinstance(item, type):
            return item(history, ctx)
        return item
