"""The projection's model steps: a ``chat`` span per step, made in one go once its usage is
known, and the model-latency, client-duration and token observations."""

from __future__ import annotations

from opentelemetry.trace import StatusCode

from boundloop import events as ev
from boundloop.messages import Final
from boundloop.telemetry import names as n
from boundloop.telemetry._state import (
    _CLIENT,
    _ERROR_STEPS,
    _KIND_VALUES,
    ProjectionBase,
    _Run,
    content,
)


class Steps(ProjectionBase):
    """The model-step events' part of ``Projection``."""

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
