"""What the model callback learns about its step."""

from __future__ import annotations

from typing import Any

import msgspec

from boundloop.cancel import CancelToken
from boundloop.policy.budget import Remaining


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
