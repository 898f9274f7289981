"""The model callback's type, and what it learns about its step."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

import msgspec

from boundloop.cancel import CancelToken
from boundloop.core.budget import Remaining
from boundloop.messages import CallTools, Final, Malformed, Message

#: What a model returns (SPEC 2): a Final or CallTools, their dict form, or (from a provider
#: adapter) a Malformed saying why the provider gave no usable answer. Anything else is
#: malformed at run time, with a reason.
ModelResponse = Final | CallTools | Malformed | dict[str, Any]

__all__ = ["Model", "ModelContext", "ModelResponse"]


class ModelContext(msgspec.Struct, frozen=True):
    """The context of one model step (SPEC 2).

    Attributes:
        run_id: the run.
        step: 1-based model step.
        tools_allowed: False on the final-only step and once the call budget is spent.
        tools: the tools' JSON Schemas (``name``, ``description``, ``parameters``).
        remaining: what is left of each budget once this step is counted.
        deadline: a ``time.monotonic()`` value, or None, to bound the model's own call.
        cancel: the run's CancelToken.
    """

    run_id: str
    step: int
    tools_allowed: bool
    tools: list[dict[str, Any]]
    remaining: Remaining
    deadline: float | None
    cancel: CancelToken


class Model(Protocol):
    """The model: any callable ``model(history, ctx) -> response`` (SPEC 2), sync or async.

    ``history`` is a fresh copy of the run's messages (mutating it changes nothing that is
    recorded); ``ctx`` is the step's ModelContext. It returns a ``bl.Final``, a
    ``bl.CallTools`` or their dict form; an ``async def`` model returns an awaitable of one
    (``runner.arun`` awaits it on the caller's event loop). Plain functions, lambdas,
    ``bl.ScriptedModel`` and the provider adapters all are Models; the parameters are
    positional, so their names are the model's own.
    """

    def __call__(self, history: list[Message], ctx: ModelContext, /) -> (
            ModelResponse | Awaitable[ModelResponse]):
        """One model step: the response to ``history``."""
        ...
