"""Linked traces: the ids that tie a run's projected spans to the code that runs inside them.

The projection makes a run's spans from its events, after the fact (DESIGN: telemetry is an
observer of the event stream). Yet while a tool handler or a model call runs, its
``execute_tool`` or ``chat`` span must be the current span, so that a span the handler or a
provider SDK makes nests under it. So those spans' ids are decided up front, from what the
events say: a ``chat`` span's id is a digest of the run's trace id, the run id and the step;
an ``execute_tool`` span's, of the trace id, the run id, the execution id and the attempt.
The thread that runs the user code makes a span with those ids current (a
``NonRecordingSpan``: nothing is recorded twice), and the projection, later, makes the real
span with the same ids.

A run's trace is decided when the run starts (``Telemetry.link``): the caller's current span,
captured in the caller's thread (``run``, ``submit``, ``arun``; a child run's caller is its
parent's tool handler, whose tool span is current), is the run span's parent; without one the
run starts a trace of its own, whose id is decided then.

The OpenTelemetry API has no way to ask a tracer for given ids: the SDK's tracer takes them
from its ``id_generator``, which ``install`` wraps (on boundloop's own tracer only) with one
that hands out the ids the projection asks for and leaves every other span to the SDK's
generator. A tracer without an ``id_generator`` (another SDK) still gets the caller's span as
the run's parent; the spans of handlers and model calls then nest under the caller's span.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags


class SpanIds:
    """The ids of one run's ``chat`` and ``execute_tool`` spans in one trace: the digest of
    the trace id and run id is begun once (per run, not per span) and finished per span."""

    __slots__ = ("_begun",)

    def __init__(self, trace_id: int, run_id: str) -> None:
        self._begun = hashlib.blake2b(f"{trace_id:032x}/{run_id}/".encode(), digest_size=8)

    def chat(self, step: int) -> int:
        """The span id of step ``step``'s ``chat`` span."""
        digest = self._begun.copy()
        digest.update(f"chat/{step}".encode())
        return int.from_bytes(digest.digest(), "big") or 1  # 0 is not a valid span id

    def tool(self, execution_id: str, attempt: int) -> int:
        """The span id of the ``execute_tool`` span of attempt ``attempt`` of
        ``execution_id``."""
        digest = self._begun.copy()
        digest.update(f"tool/{execution_id}/{attempt}".encode())
        return int.from_bytes(digest.digest(), "big") or 1


def chat_span_id(trace_id: int, run_id: str, step: int) -> int:
    """The span id of step ``step``'s ``chat`` span."""
    return SpanIds(trace_id, run_id).chat(step)


def tool_span_id(trace_id: int, run_id: str, execution_id: str, attempt: int) -> int:
    """The span id of the ``execute_tool`` span of attempt ``attempt`` of ``execution_id``."""
    return SpanIds(trace_id, run_id).tool(execution_id, attempt)


class RunLink:
    """Where a run's spans hang: its trace, whether its spans are sampled, and the context
    the run was started in (its current span, if valid, is the run span's parent).

    Args:
        trace_id: its trace.
        flags: whether its spans are sampled (made once a run, not once a span), or how to
            decide it from the trace id when first asked (a sampler's decision costs ~6 µs,
            and most runs' code never reads a current span).
        context: the caller's context (its baggage goes to the handlers and model calls too).
        has_parent: True when ``context`` holds a valid span: the run span's parent.
        linkable: True when the projection can give its spans these ids (see ``install``).
        run_id: the run (its spans' ids derive from it).
    """

    __slots__ = ("trace_id", "_flags", "context", "has_parent", "linkable", "run_id", "_ids")

    def __init__(self, trace_id: int, flags: TraceFlags | Callable[[int], TraceFlags],
                 context: Context, has_parent: bool, linkable: bool, run_id: str = "") -> None:
        self.trace_id = trace_id
        self._flags = flags
        self.context = context
        self.has_parent = has_parent
        self.linkable = linkable
        self.run_id = run_id
        self._ids: SpanIds | None = None

    @property
    def flags(self) -> TraceFlags:
        """Whether its spans are sampled (decided on first use, see the class)."""
        flags = self._flags
        if not isinstance(flags, int):  # TraceFlags is an int: a decision still to make
            flags = self._flags = flags(self.trace_id)
        return flags

    @property
    def ids(self) -> SpanIds:
        """Its spans' ids (begun on first use: a run whose code never reads them pays
        nothing for them)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = SpanIds(self.trace_id, self.run_id)
        return ids

    def current(self, span_id: int) -> Context:
        """The caller's context with span ``span_id`` of this run's trace current."""
        span = NonRecordingSpan(SpanContext(self.trace_id, span_id, is_remote=False,
                                            trace_flags=self.flags))
        return trace.set_span_in_context(span, self.context)

    def chat(self, step: int) -> Context:
        """The caller's context with step ``step``'s ``chat`` span current."""
        return trace.set_span_in_context(_Deferred(self, step, None), self.context)

    def tool(self, execution_id: str, attempt: int) -> Context:
        """The caller's context with the attempt's ``execute_tool`` span current."""
        return trace.set_span_in_context(_Deferred(self, attempt, execution_id), self.context)


class _Deferred(NonRecordingSpan):
    """A ``NonRecordingSpan`` whose ids are worked out when first asked for: most handlers
    and model calls never make a span nor read the current one, and a run's model calls and
    tool attempts are on the loop's path."""

    def __init__(self, link: RunLink, number: int, execution_id: str | None) -> None:
        # NonRecordingSpan.__init__ is not called: it would set the context made below.
        self._link = link
        self._number = number
        self._execution_id = execution_id
        self._made: SpanContext | None = None

    @property
    def _context(self) -> SpanContext:  # type: ignore[override]
        made = self._made
        if made is None:
            link, eid = self._link, self._execution_id
            span_id = link.ids.chat(self._number) if eid is None else \
                link.ids.tool(eid, self._number)
            made = self._made = SpanContext(link.trace_id, span_id, is_remote=False,
                                            trace_flags=link.flags)
        return made

    def get_span_context(self) -> SpanContext:
        """The span's ids, worked out on first call (see the class)."""
        return self._context


class FixedIds:
    """An SDK id generator that hands out, once, the ids ``give`` was told, on the thread
    that told it; every other id comes from the generator it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._local = threading.local()

    def give(self, span_id: int, trace_id: int = 0) -> None:
        """The next span started on this thread gets ``span_id`` (and, when it is a root
        span, ``trace_id``, if not 0)."""
        local = self._local
        local.span_id, local.trace_id = span_id, trace_id

    def clear(self) -> None:
        """Forget what ``give`` said (the span was made, or failed to be)."""
        local = self._local
        local.span_id = local.trace_id = 0

    def generate_span_id(self) -> int:
        """The id ``give`` said, else the wrapped generator's."""
        local = self._local
        wanted: int = getattr(local, "span_id", 0)
        if wanted:
            local.span_id = 0
            return wanted
        made: int = self.inner.generate_span_id()
        return made

    def generate_trace_id(self) -> int:
        """The trace id ``give`` said, else the wrapped generator's."""
        local = self._local
        wanted: int = getattr(local, "trace_id", 0)
        if wanted:
            local.trace_id = 0
            return wanted
        made: int = self.inner.generate_trace_id()
        return made

    def is_trace_id_random(self) -> bool:
        """As the wrapped generator says (a trace id given here came from it too)."""
        said = getattr(self.inner, "is_trace_id_random", None)
        return bool(said()) if callable(said) else False


_install_lock = threading.Lock()


def install(tracer: Any) -> FixedIds | None:
    """Wrap ``tracer``'s ``id_generator`` (the SDK's; boundloop's own tracer) in a
    ``FixedIds``, once; None when it has none to wrap."""
    with _install_lock:
        inner = getattr(tracer, "id_generator", None)
        if isinstance(inner, FixedIds):
            return inner
        if inner is None or not callable(getattr(inner, "generate_span_id", None)) or \
                not callable(getattr(inner, "generate_trace_id", None)):
            return None
        ids = FixedIds(inner)
        try:
            tracer.id_generator = ids
        except (AttributeError, TypeError):
            return None
        return ids
