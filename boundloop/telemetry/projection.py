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

Its parts: ``_state`` (what it reads and keeps of each run and attempt, and how a span is
made), ``_steps`` (model steps: ``chat`` spans) and ``_calls`` (tool calls: ``execute_tool``
spans); this module feeds them and keeps the runs (``invoke_agent`` spans).

State is bounded: a run's entry is dropped at its RunFinished (or when it is released or
evicted, past ``max_runs``), and open tool attempts are capped at ``max_attempts``.
Not thread-safe by itself: ``Telemetry`` serializes calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import StatusCode, Tracer

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.telemetry import names as n
from boundloop.telemetry._calls import Calls
from boundloop.telemetry._links import FixedIds, RunLink, SpanIds
from boundloop.telemetry._state import (
    _ERROR_STATUSES,
    _INTERNAL,
    Attrs,
    Sink,
    StateView,
    _agent_attrs,
    _Attempt,
    _ns,
    _Run,
    content,
    max_tokens_of,
    model_name,
    provider_name,
)
from boundloop.telemetry._steps import Steps


class Projection(Steps, Calls):
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
