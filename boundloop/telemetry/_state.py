"""What the projection reads and keeps: the sinks it records to and the run state it is given
(protocols), its own record of each open run and tool attempt, the helpers that name their
spans and attributes, and how its parts make a span (``ProjectionBase``)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgspec
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer

from boundloop.telemetry import names as n
from boundloop.telemetry._links import FixedIds, SpanIds

AttrValue = str | bool | int | float | tuple[str, ...]
Attrs = dict[str, AttrValue]


class Sink(Protocol):
    """Where metric observations go: ``record(metric, value, values)``, ``values`` being the
    metric's attribute values in the order of ``metric.attributes`` (all strings)."""

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        """Add ``value`` to a counter, or observe it in a histogram."""


class CallView(Protocol):
    """What the projection reads of a call of a run's state (``core.replay.CallRecord``)."""

    @property
    def tool(self) -> str: ...
    @property
    def call_id(self) -> str: ...
    @property
    def open(self) -> bool: ...


class StateView(Protocol):
    """What the projection reads of a run's state (``core.replay.RunState``): the run's
    calls, its parent, its agent and its labels."""

    @property
    def calls(self) -> Mapping[str, CallView]: ...
    @property
    def parent_run_id(self) -> str | None: ...
    @property
    def agent(self) -> str: ...
    @property
    def agent_version(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


class Fanout:
    """A sink that records to several sinks."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = tuple(sinks)

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        """Record to every sink."""
        for sink in self.sinks:
            sink.record(metric, value, values)


def _ns(ts: float) -> int:
    return int(ts * 1e9)


_DIGEST = re.compile(r"hmac-sha256:[0-9a-f]{16,}")


def content(value: Any) -> str:
    """``value`` (journal form) as JSON for a content attribute; redacted values, stored as
    keyed digests, become ``[redacted]``: content capture never exports them."""
    try:
        text = json.dumps(msgspec.to_builtins(value), ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        text = json.dumps(repr(value))
    return _DIGEST.sub("[redacted]", text)


class _Attempt:
    """One tool attempt in flight; its span is made when it ends, or earlier when a child
    run needs it as a parent."""

    __slots__ = ("execution_id", "tool", "call_id", "attempt", "start_ns", "ctx", "span",
                 "child_end_ns", "run_id", "ids")

    def __init__(self, run_id: str, execution_id: str, tool: str, call_id: str, attempt: int,
                 start_ns: int, ctx: Context | None, ids: SpanIds | None = None) -> None:
        self.run_id = run_id
        #: its run's span ids (None: the SDK's own)
        self.ids = ids
        self.execution_id = execution_id
        self.tool = tool
        self.call_id = call_id
        self.attempt = attempt
        self.start_ns = start_ns
        self.ctx = ctx
        self.span: Span | None = None
        self.child_end_ns = 0

    def base_attributes(self) -> Attrs:
        return {n.OPERATION: "execute_tool", n.TOOL_NAME: self.tool, n.TOOL_TYPE: "function",
                n.TOOL_CALL_ID: self.call_id, n.EXECUTION_ID: self.execution_id,
                n.ATTEMPT: self.attempt, n.RUN_ID: self.run_id,
                n.CONVERSATION_ID: self.run_id}

    @property
    def span_id(self) -> int:
        """Its span's id (see ``boundloop.telemetry._links``); 0: the SDK's own."""
        ids = self.ids
        return ids.tool(self.execution_id, self.attempt) if ids is not None else 0

    @property
    def span_name(self) -> str:
        return _span_name(n.SPAN_TOOL, self.tool)


class _Run:
    """What the projection keeps of one run while it is open."""

    __slots__ = ("run_id", "model", "span", "ctx", "recording", "tools", "open", "attempts",
                 "step", "step_start", "step_end", "step_outcome", "response",
                 "args", "final_text", "parent_execution_id", "finished", "chat_name",
                 "completed", "provider", "max_tokens", "client", "client_ok", "trace_id",
                 "info", "finish", "ids", "chat_first", "chat_last")

    def __init__(self, run_id: str, model: str | None, provider: str = n.DEFAULT_PROVIDER,
                 max_tokens: int | None = None) -> None:
        self.run_id = run_id
        self.model = model
        self.provider = provider
        self.max_tokens = max_tokens
        #: the name of its ``chat`` spans, and the model-latency series of a completed step
        self.chat_name = _span_name(n.SPAN_CHAT, model or n.DEFAULT_MODEL)
        self.completed = (model or n.DEFAULT_MODEL, "completed")
        #: the GenAI client metrics' series: (operation, provider, model); a completed call's
        self.client = ("chat", provider, model or n.DEFAULT_MODEL)
        self.client_ok = (*self.client, "")
        #: the attributes every ``chat`` span of the run has, first and last (made once)
        self.chat_first: Attrs = {n.OPERATION: "chat", n.PROVIDER: provider, n.RUN_ID: run_id,
                                  n.CONVERSATION_ID: run_id}
        self.chat_last: Attrs = {}
        if model is not None:
            self.chat_last[n.REQUEST_MODEL] = model
        if max_tokens is not None:
            self.chat_last[n.REQUEST_MAX_TOKENS] = max_tokens
        self.span: Span | None = None
        self.ctx: Context | None = None
        #: the trace of its spans (0 until its run span is made)
        self.trace_id = 0
        #: its spans' ids, when they can be given (see ``boundloop.telemetry._links``)
        self.ids: SpanIds | None = None
        #: what the provider said of the step's response (ResponseInfo), its finish reason
        self.info: Any = None
        self.finish = ""
        self.recording = False
        #: execution id -> (tool, call id), from CallDecided
        self.tools: dict[str, tuple[str, str]] = {}
        #: execution ids of actions whose outcome is not known (the fold's ``open``) -> tool
        self.open: dict[str, str] = {}
        self.attempts: dict[str, _Attempt] = {}
        self.step = 0
        self.step_start: float | None = None
        self.step_end: float | None = None
        self.step_outcome = ""
        self.response: Any = None
        self.args: dict[str, Any] = {}
        self.final_text: str | None = None
        self.parent_execution_id: str | None = None
        self.finished = False

    def tool_of(self, execution_id: str) -> str:
        found = self.tools.get(execution_id)
        return found[0] if found is not None else "unknown"


def provider_name(model: Any) -> str:
    """``gen_ai.provider.name`` for ``model``: its ``provider`` attribute when a string (the
    adapters', ScriptedModel's), else ``names.DEFAULT_PROVIDER``."""
    name = getattr(model, "provider", None)
    return name if isinstance(name, str) and name else n.DEFAULT_PROVIDER


def max_tokens_of(model: Any) -> int | None:
    """``gen_ai.request.max_tokens`` for ``model``: its declared ``max_output_tokens``."""
    value = getattr(model, "max_output_tokens", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_name(model: Any) -> str | None:
    """The name ``chat`` spans use for ``model``: itself when a string, else its ``model``
    attribute when that is a string (the provider adapters'), else None."""
    if isinstance(model, str):
        return model or None
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and name else None


@functools.lru_cache(maxsize=10_000)
def _span_name(kind: str, what: str) -> str:
    """``chat {model}`` or ``execute_tool {tool}``, made once per name (a span per step)."""
    return f"{kind} {what}"


#: The context of a root span: empty, so a run never nests under whatever span happens to be
#: current on the thread that observes it.
_ROOT = Context()
_TRUE, _FALSE = ("true",), ("false",)
_KIND_VALUES = tuple((k,) for k in n.TOKEN_KINDS)
_ERROR_STATUSES = frozenset({"model_error", "malformed_response", "needs_review",
                             "journal_unavailable", n.UNFINISHED})
_ERROR_STEPS = frozenset({"error", "malformed", "deadline"})
_INTERNAL, _CLIENT = SpanKind.INTERNAL, SpanKind.CLIENT

def _agent_attrs(agent: str, version: str, labels: Mapping[str, str]) -> Attrs:
    """The run span's agent (GenAI ``gen_ai.agent.*``) and labels (SPEC 14), when set."""
    attrs: Attrs = {f"{n.RUN_LABEL_PREFIX}{k}": v for k, v in labels.items()}
    if agent:
        attrs[n.AGENT_NAME] = agent
    if version:
        attrs[n.AGENT_VERSION] = version
    return attrs


class ProjectionBase:
    """What the projection's parts (runs, model steps, calls) share: where metrics and spans
    go, the open tool attempts, and how a span is made (with the ids of
    ``boundloop.telemetry._links`` when they can be given)."""

    sink: Sink | None
    tracer: Tracer | None
    capture_content: bool
    max_attempts: int
    #: open attempts of every run, by execution id (a child run's parent is one)
    attempts: dict[str, _Attempt]
    #: Gives spans the ids of ``boundloop.telemetry._links`` (None: the SDK's own ids).
    ids: FixedIds | None

    def _start_span(self, name: str, ctx: Context | None, attrs: Attrs, start_ns: int,
                    kind: SpanKind, span_id: int = 0, trace_id: int = 0) -> Span:
        assert self.tracer is not None
        ids = self.ids
        if ids is None or not span_id:
            return self.tracer.start_span(name, context=ctx if ctx is not None else _ROOT,
                                          kind=kind, attributes=attrs, start_time=start_ns)
        ids.give(span_id, trace_id)
        try:
            span = self.tracer.start_span(name, context=ctx if ctx is not None else _ROOT,
                                          kind=kind, attributes=attrs, start_time=start_ns)
        except BaseException:
            ids.clear()  # what the SDK did not take is not left behind
            raise
        if trace_id:  # the SDK takes a trace id for a root span only
            ids.clear()
        return span
