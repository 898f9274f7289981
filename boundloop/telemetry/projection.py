"""The projection: journal events in, spans and metric observations out (SPEC 11).

DESIGN: telemetry is an observer of the event stream. Nothing here is called from the loop;
the projection is fed the journal form of each run's events after they are durable, and
rebuilds from them what happened: a run span from RunAdmitted to RunFinished, a model-step
span per ModelStepStarted/Completed, a tool span per attempt (CallDispatched to its outcome),
and the metric observations of ``names.METRICS``. Timestamps are the events' own ``ts``
(wall clock), so spans show when things happened, not when they were observed. Given
``ids``, ``chat`` and ``execute_tool`` spans get ids derived from the events (see
``boundloop.telemetry._links``): the ids of the spans that were current, live, while the
model call or the tool handler ran; a run linked to its caller (``links``) hangs under the
caller's span.

The same projection, without a tracer, computes ``boundloop stats`` from a journal (see
``boundloop.stats``), so the figures an operator reads from the journal are the metrics'.

State is bounded: a run's entry is dropped at its RunFinished (or when it is released or
evicted, past ``max_runs``), and open tool attempts are capped at ``max_attempts``.
Not thread-safe by itself: ``Telemetry`` serializes calls.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.messages import Final
from boundloop.telemetry import names as n
from boundloop.telemetry._links import FixedIds, RunLink, SpanIds

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

class Projection:
    """Projects runs' events onto a metric sink and (when given) a tracer.

    Args:
        sink: where metric observations go (None: no metrics).
        tracer: an OpenTelemetry tracer for spans (None: no spans).
        capture_content: put message content on spans (the journal's redacted form).
        keep_finished: keep a run's entry after its RunFinished (``stats``: a resume or a
            person's resolution may follow in the same read).
        on_event: called with each event before it is projected (``stats`` uses it).
        max_runs: open runs tracked at once; past it the oldest is dropped (its spans end).
        max_attempts: open tool attempts tracked at once, across runs.
    """

    def __init__(self, sink: Sink | None, tracer: Tracer | None = None, *,
                 capture_content: bool = False, keep_finished: bool = False,
                 on_event: Callable[[ev.Event], None] | None = None,
                 max_runs: int = 10_000, max_attempts: int = 100_000) -> None:
        self.sink = sink
        self.tracer = tracer
        self.capture_content = capture_content
        self.keep_finished = keep_finished
        self.on_event = on_event
        self.max_runs = max_runs
        self.max_attempts = max_attempts
        self.runs: dict[str, _Run] = {}
        #: open attempts of every run, by execution id (a child run's parent is one)
        self.attempts: dict[str, _Attempt] = {}
        #: Where runs' spans hang (``Telemetry.link``), by run id; read, never written here.
        self.links: Mapping[str, RunLink] = {}
        #: Gives spans the ids of ``boundloop.telemetry._links`` (None: the SDK's own ids).
        self.ids: FixedIds | None = None
        self._state: StateView | None = None
        #: The index of the event ``project`` is projecting (after an error: the one that
        #: failed).
        self.at = 0
        # Dispatch on the event's type: one dict lookup instead of a chain of isinstance.
        self._handlers: dict[type, Callable[[_Run, Any], None]] = {
            ev.ModelStepStarted: self._step_started, ev.ModelStepCompleted: self._completed,
            ev.ModelStepFailed: self._step_failed, ev.UsageCharged: self._usage,
            ev.CallDecided: self._decided, ev.CallDispatched: self._dispatched,
            ev.CallSucceeded: self._succeeded, ev.CallFailed: self._failed,
            ev.CallTimedOut: self._timed_out, ev.CallOutcomeUnknown: self._unknown,
            ev.CallReconciled: self._reconciled, ev.CallSkipped: self._skipped,
            ev.CallResolved: self._resolved, ev.RunFinished: self._finished,
        }

    # -- feeding ----------------------------------------------------------------------
    def project(self, run_id: str, events: Iterable[ev.Event], *, model: Any = None,
                state: StateView | None = None,
                stop: Callable[[], bool] | None = None) -> int:
        """Project ``events`` of run ``run_id`` (in order; any chunking); return how many
        were projected: all of them, unless ``stop`` (asked before each event but the first)
        said to stop. While it works, ``at`` is the index of the event being projected.

        ``model`` names the run's ``chat`` spans (see ``model_name``); ``state``, the run's
        live state, tells the tools and open actions of a run first seen mid-way (a resumed
        run); both are read only when the run is first seen.
        """
        self._state = state
        run = self.runs.get(run_id)
        handlers, on_event = self._handlers, self.on_event
        i = -1
        try:
            for i, event in enumerate(events):  # noqa: B007 - read after the loop
                if stop is not None and i and stop():
                    return i
                if on_event is not None:
                    on_event(event)
                handler = handlers.get(type(event))
                if handler is not None:
                    if run is None:
                        if isinstance(event, ev.CallResolved):
                            continue  # resolved after its run ended here: nothing open
                        run = self._start(run_id, model, event)
                    handler(run, event)
                    if run.finished and not self.keep_finished:
                        run = None
                elif isinstance(event, ev.RunAdmitted):
                    run = self._admitted(run_id, model, run, event)
                elif isinstance(event, ev.RunResumed):
                    run = self._resumed(run_id, model, run, event)
            return i + 1
        except BaseException:
            self.at = i
            raise
        finally:
            self._state = None

    def release(self, run_id: str, status: str | None = None, ts: float | None = None) -> bool:
        """Forget run ``run_id`` (its spans end, as ``status`` or ``unfinished``); True when
        it was still open here (it ended without a RunFinished being projected)."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self._abandon(run, status or n.UNFINISHED, ts)
        return not run.finished

    # -- runs -------------------------------------------------------------------------
    def _start(self, run_id: str, model: Any, event: ev.Event) -> _Run:
        """A run first seen here: from its RunAdmitted, a RunResumed, or mid-way (a late
        start has no span: its metrics still count)."""
        run = _Run(run_id, model_name(model), provider_name(model), max_tokens_of(model))
        state = self._state
        if state is not None and not isinstance(event, ev.RunAdmitted):
            for eid, rec in state.calls.items():
                run.tools[eid] = (rec.tool, rec.call_id)
                if rec.open:
                    run.open[eid] = rec.tool
        if len(self.runs) >= self.max_runs:
            oldest = next(iter(self.runs))
            self._abandon(self.runs.pop(oldest), n.UNFINISHED, None)
        self.runs[run_id] = run
        return run

    def _parent_context(self, parent_run_id: str | None,
                        parent_execution_id: str | None) -> Context | None:
        """The context of a child run's span: its parent's tool span, else its parent's run
        span; None for a root run (or a parent not traced here)."""
        if parent_execution_id is not None:
            att = self.attempts.get(parent_execution_id)
            if att is not None and att.ctx is not None:
                if att.span is None:
                    att.span = self._start_span(att.span_name, att.ctx, att.base_attributes(),
                                                att.start_ns, _INTERNAL, att.span_id)
                return trace.set_span_in_context(att.span)
        if parent_run_id is not None:
            parent = self.runs.get(parent_run_id)
            if parent is not None and parent.ctx is not None:
                return parent.ctx
        return None

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

    def _open_run_span(self, run: _Run, ts: float, parent: Context | None,
                       attrs: Attrs) -> None:
        link = self.links.get(run.run_id)
        trace_id = 0
        if parent is None and link is not None:
            # The caller's span is its parent; without one, the trace decided at its start.
            if link.has_parent:
                parent = link.context
            else:
                trace_id = link.trace_id
        attrs[n.PROVIDER] = run.provider
        attrs[n.CONVERSATION_ID] = run.run_id
        if run.model is not None:
            attrs[n.REQUEST_MODEL] = run.model
        ids = self.ids
        if ids is not None and trace_id:
            # Only the trace id is given: the run span's own id is nobody's parent but its
            # own spans', which the projection makes under it.
            ids.give(0, trace_id)
            try:
                span = self._start_span(n.SPAN_RUN, parent, attrs, _ns(ts), _INTERNAL)
            finally:
                ids.clear()
        else:
            span = self._start_span(n.SPAN_RUN, parent, attrs, _ns(ts), _INTERNAL)
        run.span = span
        run.recording = span.is_recording()
        run.trace_id = span.get_span_context().trace_id
        run.ctx = trace.set_span_in_context(span)
        if ids is not None:
            # The ids its handlers and model calls ran under: the link's, begun once a run.
            run.ids = link.ids if link is not None and link.trace_id == run.trace_id else \
                SpanIds(run.trace_id, run.run_id)

    def _admitted(self, run_id: str, model: Any, run: _Run | None,
                  e: ev.RunAdmitted) -> _Run:
        if run is not None:  # admitted twice (a bug elsewhere): the first ends here
            self.runs.pop(run_id, None)
            self._abandon(run, n.UNFINISHED, e.ts)
        run = self._start(run_id, model, e)
        run.parent_execution_id = e.parent_execution_id
        if self.tracer is not None:
            attrs: Attrs = {n.OPERATION: "invoke_agent", n.RUN_ID: run_id,
                            **_agent_attrs(e.agent, e.agent_version, e.labels)}
            if e.parent_run_id is not None:
                attrs[n.PARENT_RUN_ID] = e.parent_run_id
            if self.capture_content:
                attrs[n.INPUT_MESSAGES] = content(e.history)
            self._open_run_span(run, e.ts, self._parent_context(e.parent_run_id,
                                                                e.parent_execution_id), attrs)
        return run

    def _resumed(self, run_id: str, model: Any, run: _Run | None, e: ev.RunResumed) -> _Run:
        if run is None:
            run = self._start(run_id, model, e)
        elif run.span is not None and not run.finished:
            self._end_run_span(run, n.UNFINISHED, e.ts, None)
        run.finished = False
        if self.tracer is not None:
            state = self._state
            parent_run_id = state.parent_run_id if state is not None else None
            attrs: Attrs = {n.OPERATION: "invoke_agent", n.RUN_ID: run_id, n.RESUMED: True}
            if state is not None:
                attrs.update(_agent_attrs(state.agent, state.agent_version, state.labels))
            if parent_run_id is not None:
                attrs[n.PARENT_RUN_ID] = parent_run_id
            self._open_run_span(run, e.ts, self._parent_context(parent_run_id, None), attrs)
        return run

    def _finished(self, run: _Run, e: ev.RunFinished) -> None:
        # A turn that ends awaiting approval is no finished run: the run goes on later.
        rec = self.sink.record if self.sink is not None \
            and not kinds.awaits_approval(e.status) else None
        status = (e.status,)
        if rec is not None:
            rec(n.RUNS, 1, status)
            if e.exhausted_limit is not None:
                rec(n.LIMIT_HITS, 1, (e.exhausted_limit,))
            rec(n.RUN_DURATION, e.elapsed_s, status)
            if e.usage.cost is not None:
                rec(n.RUN_COST, e.usage.cost, status)
            if kinds.needs_review(e.status):
                for tool in run.open.values():
                    rec(n.REVIEWS, 1, (tool,))
        run.finished = True
        if run.recording:
            self._end_run_span(run, e.status, e.ts, e)
        if run.parent_execution_id is not None:
            parent = self.attempts.get(run.parent_execution_id)
            if parent is not None:
                parent.child_end_ns = max(parent.child_end_ns, _ns(e.ts))
        if not self.keep_finished:
            self.runs.pop(run.run_id, None)

    def _end_run_span(self, run: _Run, status: str, ts: float | None,
                      e: ev.RunFinished | None) -> None:
        """End the run's span (and what is still open under it)."""
        self._flush_step(run)
        for att in list(run.attempts.values()):
            self._end_attempt(run, att, n.UNFINISHED, ts, None)
        span, run.span, run.recording = run.span, None, False
        if span is None:
            return
        attrs: Attrs = {n.RUN_STATUS: status}
        if e is not None:
            u = e.usage
            if e.exhausted_limit is not None:
                attrs[n.LIMIT] = e.exhausted_limit
            attrs[n.INPUT_TOKENS] = u.all_input_tokens  # the conventions' input: all of it
            attrs[n.OUTPUT_TOKENS] = u.output_tokens
            attrs[n.CACHE_READ_TOKENS] = u.cache_read_tokens
            attrs[n.CACHE_CREATION_TOKENS] = u.cache_write_tokens
            if u.cost is not None:
                attrs[n.COST] = u.cost
            attrs[n.MODEL_STEPS] = e.model_steps
            attrs[n.TOOL_CALLS] = e.tool_calls
            if self.capture_content and run.final_text is not None:
                attrs[n.OUTPUT_MESSAGES] = content([{"kind": "final", "text": run.final_text}])
        if status in _ERROR_STATUSES:
            attrs[n.ERROR_TYPE] = status
            span.set_status(StatusCode.ERROR, status)
        span.set_attributes(attrs)
        span.end(end_time=_ns(ts) if ts is not None else None)

    def _abandon(self, run: _Run, status: str, ts: float | None) -> None:
        """Drop a run without its RunFinished: its spans end, its attempts are forgotten."""
        if run.span is not None:
            self._end_run_span(run, status, ts, None)
        for eid in run.attempts:
            self.attempts.pop(eid, None)
        run.attempts.clear()

    # -- model steps ------------------------------------------------------------------
    def _step_started(self, run: _Run, e: ev.ModelStepStarted) -> None:
        if run.step_start is not None:
            self._flush_step(run)
        run.step, run.step_start, run.step_end = e.step, e.ts, None

    def _completed(self, run: _Run, e: ev.ModelStepCompleted) -> None:
        if self.sink is not None:
            self.sink.record(n.MODEL_LATENCY, e.latency_s, run.completed)
            self.sink.record(n.CLIENT_DURATION, e.latency_s, run.client_ok)
        run.step_end, run.step_outcome = e.ts, "completed"
        response = e.response
        info = run.info = response.info
        run.finish = info.finish_reason if info is not None and info.finish_reason else (
            "stop" if isinstance(response, Final) else "tool_calls")
        if self.capture_content:
            run.response = response
            if isinstance(response, Final):
                run.final_text = response.text

    def _step_failed(self, run: _Run, e: ev.ModelStepFailed) -> None:
        if self.sink is not None:
            self.sink.record(n.MODEL_LATENCY, e.latency_s,
                             (run.model or n.DEFAULT_MODEL, e.reason))
            self.sink.record(n.CLIENT_DURATION, e.latency_s, (*run.client, e.reason))
        run.step_end, run.step_outcome = e.ts, e.reason
        run.response = None

    def _usage(self, run: _Run, e: ev.UsageCharged) -> None:
        u = e.usage
        if self.sink is not None:
            rec = self.sink.record
            k_in, k_out, k_cw, k_cr = _KIND_VALUES
            if u.input_tokens:
                rec(n.TOKENS, u.input_tokens, k_in)
            if u.output_tokens:
                rec(n.TOKENS, u.output_tokens, k_out)
            if u.cache_write_tokens:
                rec(n.TOKENS, u.cache_write_tokens, k_cw)
            if u.cache_read_tokens:
                rec(n.TOKENS, u.cache_read_tokens, k_cr)
            if not e.estimated:  # the conventions' token usage is what the model reported
                rec(n.CLIENT_TOKENS, u.all_input_tokens, (*run.client, "input"))
                rec(n.CLIENT_TOKENS, u.output_tokens, (*run.client, "output"))
        if run.recording and run.step_start is not None and e.step == run.step:
            self._chat_span(run, e)

    def _chat_span(self, run: _Run, charged: ev.UsageCharged | None) -> None:
        """The step's ``chat`` span, made in one go once its usage is known."""
        start = run.step_start
        assert start is not None
        end = run.step_end if run.step_end is not None else start
        # Attributes cost the SDK ~0.5 µs each (a sequence far more): those that say
        # nothing (a completed step, zero cache tokens, a reported usage) are left out.
        attrs = run.chat_first.copy()
        attrs[n.STEP] = run.step
        if run.step_outcome != "completed":
            attrs[n.MODEL_OUTCOME] = run.step_outcome or n.UNFINISHED
        else:
            info = run.info
            if info is not None:
                if info.id is not None:
                    attrs[n.RESPONSE_ID] = info.id
                if info.model is not None:
                    attrs[n.RESPONSE_MODEL] = info.model
            attrs[n.FINISH_REASONS] = (run.finish,)
        attrs.update(run.chat_last)
        if charged is not None:
            u = charged.usage
            attrs[n.INPUT_TOKENS] = u.all_input_tokens  # the conventions' input: all of it
            attrs[n.OUTPUT_TOKENS] = u.output_tokens
            if u.cache_read_tokens:
                attrs[n.CACHE_READ_TOKENS] = u.cache_read_tokens
            if u.cache_write_tokens:
                attrs[n.CACHE_CREATION_TOKENS] = u.cache_write_tokens
            if charged.estimated:
                attrs[n.ESTIMATED] = True
            if u.cost is not None:
                attrs[n.COST] = u.cost
        if self.capture_content and run.response is not None:
            attrs[n.OUTPUT_MESSAGES] = content([run.response])
        ids = run.ids
        span = self._start_span(run.chat_name, run.ctx, attrs, int(start * 1e9), _CLIENT,
                                ids.chat(run.step) if ids is not None else 0)
        if run.step_outcome in _ERROR_STEPS:
            span.set_attribute(n.ERROR_TYPE, run.step_outcome)
            span.set_status(StatusCode.ERROR, run.step_outcome)
        span.end(end_time=int(end * 1e9))
        run.step_start = run.step_end = None
        run.step_outcome, run.response, run.info = "", None, None

    def _flush_step(self, run: _Run) -> None:
        """A step whose UsageCharged never came (it always follows; be safe)."""
        if run.step_start is not None:
            if run.recording:
                self._chat_span(run, None)
            run.step_start = run.step_end = None

    # -- calls ------------------------------------------------------------------------
    def _decided(self, run: _Run, e: ev.CallDecided) -> None:
        run.tools[e.execution_id] = (e.tool, e.call_id)
        if kinds.is_allowed(e.decision):
            run.open[e.execution_id] = e.tool
        if self.capture_content:
            run.args[e.execution_id] = e.arguments

    def _dispatched(self, run: _Run, e: ev.CallDispatched) -> None:
        eid = e.execution_id
        found = run.tools.get(eid)
        tool, call_id = found if found is not None else ("unknown", "")
        if e.attempt > 1 and self.sink is not None:
            self.sink.record(n.RETRIES, 1, (tool,))
        run.open[eid] = tool
        if not run.recording:
            return
        previous = run.attempts.get(eid)
        if previous is not None:
            self._end_attempt(run, previous, n.UNFINISHED, e.ts, None)
        att = _Attempt(run.run_id, eid, tool, call_id, e.attempt, int(e.ts * 1e9), run.ctx,
                       run.ids)
        run.attempts[eid] = att
        attempts = self.attempts
        if len(attempts) >= self.max_attempts:
            attempts.pop(next(iter(attempts)))
        attempts[eid] = att

    def _latency(self, run: _Run, eid: str, latency: float, outcome: str) -> None:
        if self.sink is not None:
            self.sink.record(n.TOOL_LATENCY, latency, (run.tool_of(eid), outcome))

    def _succeeded(self, run: _Run, e: ev.CallSucceeded) -> None:
        self._latency(run, e.execution_id, e.latency_s, e.status)
        run.open.pop(e.execution_id, None)
        self._ended(run, e, e.status, e.latency_s, e.content)

    def _failed(self, run: _Run, e: ev.CallFailed) -> None:
        self._latency(run, e.execution_id, e.latency_s, "error")
        if not e.retrying:
            run.open.pop(e.execution_id, None)
        self._ended(run, e, "error", e.latency_s, e.content, e.error_category)

    def _timed_out(self, run: _Run, e: ev.CallTimedOut) -> None:
        self._latency(run, e.execution_id, e.latency_s, "timed_out")
        self._ended(run, e, "timed_out", e.latency_s, None, "timeout")

    def _unknown(self, run: _Run, e: ev.CallOutcomeUnknown) -> None:
        tool = run.tool_of(e.execution_id)
        if self.sink is not None:
            self.sink.record(n.OUTCOME_UNKNOWN, 1, (tool,))
        run.open[e.execution_id] = tool
        self._ended(run, e, "outcome_unknown", 0.0, e.content, "outcome_unknown")

    def _reconciled(self, run: _Run, e: ev.CallReconciled) -> None:
        if self.sink is not None:
            self.sink.record(n.RECONCILIATIONS, 1, (run.tool_of(e.execution_id),)
                             + (_TRUE if e.took_effect else _FALSE))
        run.open.pop(e.execution_id, None)
        self._ended(run, e, "reconciled", 0.0, e.content)

    def _skipped(self, run: _Run, e: ev.CallSkipped) -> None:
        run.open.pop(e.execution_id, None)
        self._ended(run, e, "skipped", 0.0, None)

    def _resolved(self, run: _Run, e: ev.CallResolved) -> None:
        run.open.pop(e.execution_id, None)

    def _ended(self, run: _Run, e: Any, outcome: str, latency: float, result: Any,
               error: str | None = None) -> None:
        if run.recording:
            att = run.attempts.get(e.execution_id)
            if att is not None:
                self._end_attempt(run, att, outcome, e.ts, latency, result, error)

    def _end_attempt(self, run: _Run, att: _Attempt, outcome: str, ts: float | None,
                     latency: float | None, result: Any = None,
                     error: str | None = None) -> None:
        run.attempts.pop(att.execution_id, None)
        if self.attempts.get(att.execution_id) is att:
            del self.attempts[att.execution_id]
        if latency:
            end = att.start_ns + int(latency * 1e9)
        else:
            end = int(ts * 1e9) if ts is not None else att.start_ns
        end = max(end, att.child_end_ns, att.start_ns)
        span = att.span
        # Made in one go, with all its attributes, when it ends (unless a child run needed
        # it as a parent earlier).
        attrs: Attrs = att.base_attributes() if span is None else {}
        attrs[n.TOOL_OUTCOME] = outcome
        if error is not None:
            attrs[n.ERROR_TYPE] = error
        if self.capture_content:
            args = run.args.get(att.execution_id)
            if args is not None:
                attrs[n.TOOL_ARGUMENTS] = content(args)
            if result is not None:
                attrs[n.TOOL_RESULT] = content(result)
        if span is None:
            span = self._start_span(att.span_name, att.ctx, attrs, att.start_ns, _INTERNAL,
                                    att.span_id)
        else:
            span.set_attributes(attrs)
        if error is not None or outcome == n.UNFINISHED:
            span.set_status(StatusCode.ERROR, error or outcome)
        span.end(end_time=end)

