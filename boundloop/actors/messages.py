"""The messages actors send each other (msgspec Structs)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from boundloop.loop import Dispatch, Reconcile, RunSpec
from boundloop.results import RunResult


class StartRun(msgspec.Struct):
    """Supervisor: drive this run from its spec; ``seq`` is its last journal sequence."""

    spec: RunSpec
    future: Future[RunResult]
    seq: int = 0


class EffectDone(msgspec.Struct):
    """Supervisor: the effect a run waited for is done (``value``) or failed (``error``)."""

    run_id: str
    value: Any = None
    error: BaseException | None = None
    appended: int = 0
    #: The run's driving generation it answers (a failed run starts a new one).
    generation: int = 0


class DispatchBatch(msgspec.Struct):
    """Executor: run these calls, then call ``reply`` with their outcomes (or an error)."""

    dispatch: Dispatch | Reconcile
    reply: Callable[[Any, BaseException | None], None]


class Admit(msgspec.Struct):
    """Admission: may this run start? Answered by calling ``reply`` (on admission's thread)
    with ``(None, None)`` when admitted, ``(why not, None)`` when refused, or ``(None,
    error)`` when admission could not decide (the journal could not be read). Admission
    takes ``reply`` out of the message as it answers."""

    run_id: str
    reply: Callable[[str | None, BaseException | None], None]
    resuming: bool = False
