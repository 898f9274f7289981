"""Agents: a named, versioned configuration of a model, its tools and its budget (SPEC 14)."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from boundloop.core.budget import Budget
from boundloop.errors import ConfigError

#: Labels a run may carry, and how long their keys and values may be.
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 32, 64, 256


class Agent:
    """A name and a version for a model, its tools and its budget.

    Runs of an agent record its name and version (and their labels) at admission, so a
    worker that serves the agent by name can resume them after a crash, and take them
    from the durable queue (``runner.enqueue``).

    Args:
        name: the agent's name (what workers serve it by).
        model: ``(history, ctx) -> response``, sync or ``async def``.
        tools: the tools the model may call.
        budget: the budget of each run (default ``bl.Budget()``).
        version: recorded with each run, for people and reports; runs resume on whatever
            version a worker serves under the same name.
        permit: ``(call, tool, ctx) -> True | False | reason`` per call.
        max_running: the most runs of this agent running at once across every worker of
            the journal (None: no limit beyond each worker's ``concurrency``).
        max_queued: the most runs that may wait in the queue; ``enqueue`` refuses more with
            ``bl.AdmissionError``.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, name: str, *, model: Any, tools: Sequence[Any] = (),
                 budget: Budget | None = None, version: str = "",
                 permit: Callable[..., Any] | None = None, max_running: int | None = None,
                 max_queued: int = 100_000) -> None:
        if not isinstance(name, str) or not name.strip() or len(name) > 128 \
                or any(unicodedata.category(c)[0] == "C" for c in name):
            raise ConfigError(f"an agent needs a name of 1 to 128 printable characters, got "
                              f"{name!r}")
        if not callable(model):
            raise ConfigError(f"agent {name!r}: model must be a callable (history, ctx) -> "
                              f"response, got {model!r}")
        if isinstance(version, int) and not isinstance(version, bool):
            version = str(version)
        if not isinstance(version, str) or len(version) > 128:
            raise ConfigError(f"agent {name!r}: version must be a string, got {version!r}")
        if budget is not None and not isinstance(budget, Budget):
            raise ConfigError(f"agent {name!r}: budget must be a bl.Budget, got {budget!r}")
        if permit is not None and not callable(permit):
            raise ConfigError(f"agent {name!r}: permit must be a callable (call, tool, ctx)")
        for what, value, least in (("max_running", max_running, 1), ("max_queued", max_queued, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ConfigError(f"agent {name!r}: {what} must be a whole number >= {least}"
                                  f"{' or None' if what == 'max_running' else ''}, "
                                  f"got {value!r}")
        self.name = name
        self.model = model
        self.tools = list(tools) if not callable(tools) else [tools]
        self.budget = budget if budget is not None else Budget()
        self.version = version
        self.permit = permit
        self.max_running = max_running
        self.max_queued = max_queued

    def __repr__(self) -> str:
        version = f" version={self.version!r}" if self.version else ""
        return f"<bl.Agent {self.name!r}{version}>"


def check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    """``labels`` as a plain dict, else ConfigError saying what is wrong with them."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"labels must be a dict of strings to strings, got "
                          f"{type(labels).__name__}")
    if len(labels) > MAX_LABELS:
        raise ConfigError(f"a run may have at most {MAX_LABELS} labels, got {len(labels)}")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"labels must map strings to strings; {key!r}: {value!r} does "
                              "not (write numbers as text)")
        if not key or len(key) > MAX_LABEL_KEY or "=" in key:
            raise ConfigError(f"a label key must be 1 to {MAX_LABEL_KEY} characters without "
                              f"'=', got {key!r}")
        if len(value) > MAX_LABEL_VALUE:
            raise ConfigError(f"the value of label {key!r} is longer than {MAX_LABEL_VALUE} "
                              "characters")
        for text in (key, value):
            bad = next((c for c in text if unicodedata.category(c)[0] == "C"), None)
            if bad is not None:
                # Control and format characters (a newline, NUL, a bidi override) would
                # forge lines and reorder text where labels are printed.
                raise ConfigError(f"label {key!r} holds the control or format character "
                                  f"U+{ord(bad):04X}; labels are printable text")
        out[key] = value
    return out
