"""The projection's tool calls: an ``execute_tool`` span per attempt (CallDispatched to its
outcome), and the tool-latency, retry, outcome-unknown and reconciliation observations."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import StatusCode

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.telemetry import names as n
from boundloop.telemetry._state import (
    _FALSE,
    _INTERNAL,
    _TRUE,
    Attrs,
    ProjectionBase,
    _Attempt,
    _Run,
    content,
)


class Calls(ProjectionBase):
    """The tool-call events' part of ``Projection``."""

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
