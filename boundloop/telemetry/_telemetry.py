"""``Telemetry``: the projection wired to OpenTelemetry (and any extra sinks), fed by the
runner and projected by a background thread while the journal syncs (its metrics sink is
``boundloop.telemetry._metrics``)."""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    SpanKind,
    TraceFlags,
    TracerProvider,
)

from boundloop import events as ev
from boundloop.errors import ConfigError
from boundloop.telemetry import names as n
from boundloop.telemetry._links import FixedIds, RunLink, install
from boundloop.telemetry._metrics import OtelMetrics, instruments, meter
from boundloop.telemetry._state import Fanout, Sink, StateView
from boundloop.telemetry.projection import Projection

__all__ = ["OtelMetrics", "Telemetry", "instruments", "meter"]

try:  # the API's stand-in until an SDK is set globally (private name, stable since 1.10)
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _ProxyMeters
except ImportError:  # pragma: no cover - a future API without it: treat nothing as a proxy
    class _ProxyMeters:  # type: ignore[no-redef]
        pass

_log = logging.getLogger("boundloop.telemetry")
#: No parent: what a root run span's sampler is asked with.
_NO_PARENT = Context()

#: How often a Telemetry on the global providers looks again for an SDK while it has none.
RECHECK_S = 1.0
#: Journal commits noted and not yet recorded, at most (see ``Telemetry.journal_commit``).
MAX_PENDING_COMMITS = 1024
#: What waits to be recorded (counter sums, journal commits) is recorded within this time.
FLUSH_S = 1.0
#: How long the projector works each time the journal syncs: this share of what commits have
#: lately taken (an fsync: 250 µs or more), within the bounds below, so the committing thread
#: mostly finds the interpreter lock free when its sync ends, instead of waiting for the
#: projector (or out the interpreter's switch interval, 5 ms).
SYNC_SHARE = 0.5
MIN_SYNC_BUDGET_S = 50e-6
MAX_SYNC_BUDGET_S = 1e-3
#: The projector thread ends after this long without work.
PROJECTOR_IDLE_S = 2.0
#: Commits' events that wait before a sync wakes the projector. Waking it costs more CPU than
#: it saves when little waits (a futex wake, a thread scheduled on the other core, the
#: interpreter lock handed back and forth, the SDK's code cold there): a sequential W1 run
#: commits 7 times, so its spans are made in one go, warm, when it ends (``release``); many
#: runs at once, or a long run, fill the queue and are projected while the journal syncs.
WAKE_AT = 16
#: Runs whose events may wait for the projector at once; past that, observe projects at once.
MAX_QUEUED_RUNS = 100_000
#: Runs linked to their callers' traces at once (see ``Telemetry.link``); past that, a run
#: starts a trace of its own and its handlers' spans nest under nothing of it.
MAX_LINKS = 100_000
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)


class Telemetry:
    """boundloop's telemetry (SPEC 11): spans and metrics projected from the journal's events.

    ``Runner(telemetry=Telemetry(...))``; the runner feeds it each run's events once they are
    durable (``observe``) and each journal commit's latency (``journal_commit``). It reports
    through ``opentelemetry-api`` only: the application chooses the SDK and exporters. On the
    global providers (the default) and without an SDK, ``observe`` returns at once (it looks
    for an SDK again at most once a second); with one, spans follow the GenAI conventions
    (``invoke_agent``, ``chat {model}``, ``execute_tool {tool}``) and the metrics are those of
    ``boundloop.telemetry.names.METRICS``. The projection is kept out of the loop: the events
    of each commit wait in one queue (in commit order, so a child run's span finds its
    parent's tool span); once ``WAKE_AT`` commits' events wait, a projector thread works
    through them while the journal waits for its disk, when the loop would be idle anyway;
    whatever is left is projected within ``FLUSH_S`` or when the run ends, before its result
    is given, so a run's spans have ended and been exported (by a
    synchronous span processor) when ``run`` returns. A run's span is a child of the span
    current where it was started (``link``), and while its model calls and tool handlers run,
    their ``chat`` and ``execute_tool`` spans are current (``chat_context``,
    ``tool_context``; see ``boundloop.telemetry._links``). Counter additions and journal-commit
    figures wait at most ``FLUSH_S`` (1 s) before they reach the SDK (``flush`` records them
    at once: call it at shutdown). Nothing it does can fail a run: an error in it is logged
    (once) to the ``boundloop.telemetry`` logger and that observation is dropped. Thread-safe.

    Args:
        capture_content: put message content on spans (prompt history, responses, tool
            arguments and results), from the journal's redacted form: values the journal
            redacts appear as ``[redacted]``. Off by default.
        tracer_provider: the provider of spans (default: the global one).
        meter_provider: the provider of metrics (default: the global one).
        sinks: more metric sinks fed by the same projection, such as
            ``boundloop.telemetry.prometheus.register(registry)``.
        max_runs: runs tracked at once (open runs; a finished run is dropped at once).
        max_attempts: tool attempts in flight tracked at once, across runs.

    Raises:
        ConfigError: an argument is of the wrong kind.
    """

    def __init__(self, *, capture_content: bool = False,
                 tracer_provider: TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, sinks: Sequence[Sink] = (),
                 max_runs: int = 10_000, max_attempts: int = 100_000) -> None:
        if not isinstance(capture_content, bool):
            raise ConfigError("capture_content must be True or False")
        for name, value in (("max_runs", max_runs), ("max_attempts", max_attempts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        sinks = list(sinks)
        for sink in sinks:
            if not callable(getattr(sink, "record", None)):
                raise ConfigError(f"a sink must have record(metric, value, values), got "
                                  f"{sink!r}")
        self.capture_content = capture_content
        self._given_tracers = tracer_provider
        self._given_meters = meter_provider
        self._sinks = sinks
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(n.SCOPE)
        self._otel_metrics = OtelMetrics(meter(meter_provider or metrics.get_meter_provider()),
                                         self._schedule)
        self._timer: threading.Timer | None = None
        self._timer_lock = threading.Lock()
        self._projection = Projection(None, None, capture_content=capture_content,
                                      max_runs=max_runs, max_attempts=max_attempts)
        #: where each run started here hangs (``link``), by run id, until ``release``
        self._links: dict[str, RunLink] = {}
        self._projection.links = self._links
        self._ids: FixedIds | None = None
        #: Held while the projection works (it is not thread-safe by itself).
        self._lock = threading.Lock()
        #: (run id, events, model) observed and not yet projected, oldest first
        self._pending: collections.deque[tuple[str, list[ev.Event], Any]] = \
            collections.deque()
        #: runs whose events may wait in ``_pending`` (seen from their RunAdmitted on)
        self._queued: set[str] = set()
        #: The projector's signal: held while it has nothing to do, released to wake it.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._projector: threading.Thread | None = None
        self._sync_s = 2 * MIN_SYNC_BUDGET_S / SYNC_SHARE  # commits' latency, averaged
        self._sync_started = 0.0  # perf_counter of the last before_sync with work waiting
        #: set while a release waits for the lock, so the projector stops at the next event
        self._wanted = False
        self._sync_budget_s = self._sync_s * SYNC_SHARE
        #: (latency_s, batch_size) of commits not yet recorded (see ``journal_commit``)
        self._commits: collections.deque[tuple[float, int]] = collections.deque()
        self._tracing = self._metering = False
        self._live = bool(sinks)
        self._recheck_at = 0.0
        self._settled = False  # True once nothing more can change (explicit or SDK found)
        self._complained = False
        self._refresh()

    # -- liveness ---------------------------------------------------------------------
    def _refresh(self) -> None:
        """Find out whether spans and OpenTelemetry metrics go anywhere, and set the
        projection's tracer and sink to match (a no-op provider gets no work at all)."""
        tp = self._given_tracers or trace.get_tracer_provider()
        mp = self._given_meters or metrics.get_meter_provider()
        self._tracing = not isinstance(tp, ProxyTracerProvider | NoOpTracerProvider)
        self._metering = not isinstance(mp, _ProxyMeters | NoOpMeterProvider)
        sinks: list[Sink] = ([self._otel_metrics] if self._metering else []) + self._sinks
        projection = self._projection
        if self._tracing and self._ids is None:
            # The provider's own tracer (not the proxy's stand-in made before the SDK was
            # set), whose ids the projection can give (see ``_links``).
            self._tracer = tp.get_tracer(n.SCOPE)
            self._ids = projection.ids = install(self._tracer)
        projection.tracer = self._tracer if self._tracing else None
        projection.sink = None if not sinks else sinks[0] if len(sinks) == 1 else Fanout(sinks)
        self._live = self._tracing or bool(sinks)
        # A global provider is set once: after that (or with providers given), look no more.
        self._settled = (self._given_tracers is not None or self._tracing) and (
            self._given_meters is not None or self._metering)
        self._recheck_at = time.monotonic() + RECHECK_S

    def _recheck(self) -> None:
        # Never waits: another thread may be projecting (through a slow exporter, even);
        # the next call looks again.
        if self._lock.acquire(blocking=False):
            try:
                self._refresh()
            finally:
                self._lock.release()

    @property
    def enabled(self) -> bool:
        """True when spans or metrics go somewhere (an SDK or a sink is configured)."""
        if not self._settled and time.monotonic() >= self._recheck_at:
            self._recheck()
        return self._live

    # -- feeding ----------------------------------------------------------------------
    def observe(self, run_id: str, events: Iterable[ev.Event], *, model: Any = None,
                state: StateView | None = None) -> None:
        """Take the events of run ``run_id`` just made durable, in order, for projection.

        Call it after each durable commit of the run's events, with their journal form (so
        nothing redacted is ever seen here), before anything the commit allows starts (a
        child run's RunAdmitted must come after its parent's CallDispatched): the events wait
        in one queue, in the order observed, and are projected in that order, by the
        background projector while the journal syncs (``before_sync``), or at the latest by
        ``release`` or ``flush``. A run first seen other than by its RunAdmitted (a resumed
        run) is projected at once, with its live ``state``.

        Args:
            run_id: the run the events belong to.
            events: the committed events, oldest first.
            model: the run's model (its ``model`` attribute, when a string, names the
                ``chat`` spans; a string is the name itself); read when the run is first seen.
            state: the run's live ``RunState``; read only when the run is first seen other
                than by its RunAdmitted (a resumed run), for its tools and open actions.
        """
        if not self._settled and time.monotonic() >= self._recheck_at:
            self._recheck()
        if not self._live:
            return
        events = events if isinstance(events, list) else list(events)
        if (run_id in self._queued or (events and type(events[0]) is ev.RunAdmitted)) and \
                len(self._queued) < MAX_QUEUED_RUNS:
            self._queued.add(run_id)
            first = not self._pending
            self._pending.append((run_id, events, model))
            if first and self._timer is None:
                self._schedule()  # projected within FLUSH_S even if no journal syncs again
            return
        with self._lock:  # the state is read now, while it is the state of these events
            self._drain()
            self._project(run_id, events, model, state)
        if len(self._queued) < MAX_QUEUED_RUNS:
            self._queued.add(run_id)  # seen now: its next events may wait

    def link(self, run_id: str, parent_run_id: str | None = None) -> None:
        """Run ``run_id`` starts now, from the calling thread: its span's parent is the span
        current here (the caller's, or for a child run its parent's ``execute_tool`` span),
        else it starts a trace of its own. Call it in the caller's thread (or task) before
        the run is handed on; ``release`` forgets it. Costs nothing without an SDK.

        Args:
            run_id: the run about to start (or resume).
            parent_run_id: its parent run, for a child run: without a current span here (a
                handler that started it from a thread of its own), it joins its parent's
                trace all the same.
        """
        if not self._settled and time.monotonic() >= self._recheck_at:
            self._recheck()
        if not self._tracing or len(self._links) >= MAX_LINKS:
            return
        try:
            ctx = otel_context.get_current()
            parent = trace.get_current_span(ctx).get_span_context()
            linkable = self._ids is not None
            if parent.is_valid:
                link = RunLink(parent.trace_id, parent.trace_flags, ctx, True, linkable,
                               run_id)
            else:
                up = self._links.get(parent_run_id) if parent_run_id is not None else None
                if up is not None:
                    link = RunLink(up.trace_id, up.flags, ctx, False, linkable, run_id)
                else:
                    trace_id = self._new_trace_id()
                    link = RunLink(trace_id, self._root_flags, ctx, False, linkable, run_id)
            self._links[run_id] = link
        except Exception:  # noqa: BLE001 - telemetry never fails a run
            self._complain("linking run %r to its caller's trace", run_id)

    def _new_trace_id(self) -> int:
        ids = self._ids
        if ids is not None:
            made: int = ids.inner.generate_trace_id()  # the provider's kind of trace id
            return made
        return random.getrandbits(128) or 1

    def _root_flags(self, trace_id: int) -> TraceFlags:
        """Whether the root span of trace ``trace_id`` will be sampled: asked of the tracer's
        sampler when a run's link is first asked (the projection asks it again, with the same
        trace id, later), so what handlers make under the run's spans is sampled with them.
        Called from whatever thread reads a current span first: it never raises."""
        sampler = getattr(self._tracer, "sampler", None)
        if sampler is None:
            return _SAMPLED
        try:
            result = sampler.should_sample(_NO_PARENT, trace_id, n.SPAN_RUN, SpanKind.INTERNAL)
        except Exception:  # noqa: BLE001 - telemetry never fails a run (nor its handlers)
            self._complain("asking the sampler of trace %032x", trace_id)
            return _SAMPLED
        return _SAMPLED if result.decision.is_sampled() else _UNSAMPLED

    def chat_context(self, run_id: str, step: int) -> Context | None:
        """The context to run step ``step``'s model call in: the caller's, with the step's
        ``chat`` span current (so a span the provider SDK makes nests under it); just the
        caller's with a tracer whose span ids cannot be given; None when the run is not
        linked (no SDK)."""
        link = self._links.get(run_id)
        if link is None:
            return None
        if not link.linkable:
            return link.context
        return link.chat(step)

    def tool_context(self, run_id: str, execution_id: str, attempt: int) -> Context | None:
        """The context to run a tool attempt in: the caller's, with its ``execute_tool`` span
        current (see ``chat_context``)."""
        link = self._links.get(run_id)
        if link is None:
            return None
        if not link.linkable:
            return link.context
        return link.tool(execution_id, attempt)

    def before_sync(self) -> None:
        """The journal is about to wait for its disk (or server): a good moment to project
        what waits, on the projector thread, while the committing thread waits without the
        interpreter lock, once ``WAKE_AT`` commits' events wait. Costs ~0.1 µs otherwise."""
        if len(self._pending) < WAKE_AT:
            return
        self._sync_started = time.perf_counter()
        if self._projector is None:
            self._start_projector()
        wake = self._wake
        if wake.locked():  # not woken yet: one release wakes it (a lock is the cheapest signal)
            try:
                wake.release()
            except RuntimeError:  # woken by another committing thread meanwhile
                pass

    def _start_projector(self) -> None:
        with self._timer_lock:
            if self._projector is not None:
                return
            thread = self._projector = threading.Thread(
                target=self._project_loop, name="boundloop-telemetry", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (interpreter shutdown): release projects
            with self._timer_lock:
                self._projector = None

    def _project_loop(self) -> None:
        """Project what waits for at most ``SYNC_BUDGET_S`` each time the journal syncs, so
        the committing thread finds the interpreter lock free when its sync ends; end after
        ``PROJECTOR_IDLE_S`` without work (``before_sync`` starts another)."""
        wake, pending, clock = self._wake, self._pending, time.perf_counter
        deadline = 0.0

        def stop() -> bool:  # asked between events (a span's end costs the SDK ~20-30 µs)
            return self._wanted or clock() >= deadline

        while True:
            if not wake.acquire(timeout=PROJECTOR_IDLE_S):
                with self._timer_lock:
                    if wake.acquire(blocking=False):  # woken meanwhile: go on
                        pass
                    else:
                        self._projector = None
                        return
            if not self._lock.acquire(blocking=False):
                continue  # a release or flush is projecting: it takes everything
            try:
                # From the sync's start: waking this thread took part of the sync already.
                deadline = self._sync_started + self._sync_budget_s
                while pending and not stop():
                    run_id, events, model = pending.popleft()
                    done = self._project(run_id, events, model, None, stop)
                    if done < len(events):  # the rest waits for the next sync or release
                        pending.appendleft((run_id, events[done:], model))
                        break
                if self._commits:
                    self._record_commits()
            except Exception:  # noqa: BLE001 - telemetry never fails a run
                self._complain("projecting")
            finally:
                self._lock.release()

    def _drain(self, commits: bool = True) -> None:
        """Project everything that waits, in order (under ``_lock``), and record the journal
        commits noted (unless ``commits`` is False: a run's end leaves them to the flush,
        within ``FLUSH_S``, or the projector; the run's result need not wait for them)."""
        pending = self._pending
        while pending:
            run_id, events, model = pending.popleft()
            if pending and pending[0][0] == run_id:
                # A run's commits that wait one after another are projected in one go (a
                # W1 run's seven, at its end): one call, not one a commit. A new list: the
                # observed ones are the callers'.
                events = list(events)
                while pending and pending[0][0] == run_id:
                    events += pending.popleft()[1]
            self._project(run_id, events, model, None)
        if commits and self._commits:
            self._record_commits()

    def _project(self, run_id: str, events: Sequence[ev.Event], model: Any,
                 state: StateView | None, stop: Callable[[], bool] | None = None) -> int:
        """Project ``events`` (see ``Projection.project``); an event whose projection fails
        is dropped (and the failure logged once), the others are still projected."""
        projection, start = self._projection, 0
        while True:
            try:
                return start + projection.project(run_id, events[start:] if start else events,
                                                  model=model, state=state, stop=stop)
            except Exception:  # noqa: BLE001 - telemetry never fails a run
                self._complain("observing run %r", run_id)
                start += max(projection.at, 0) + 1  # past the event that failed
                if start >= len(events):
                    return start

    def journal_commit(self, latency_s: float, batch_size: int) -> None:
        """Note one durable journal commit: its latency and the appends it carried.

        Made for the journal's writer thread, the group commit's critical path: it only
        queues the figures (~0.1 µs); they are recorded by the projector or ``flush`` (within
        ``FLUSH_S``), so the SDK's ~6 µs a measurement is paid off the writer and off the
        run's end. At most ``MAX_PENDING_COMMITS`` wait; past that it records them itself
        (unless a projection is under way: that one records them). It also keeps the
        average commit latency the projector's budget is a share of (``SYNC_SHARE``).
        """
        if not self._settled and time.monotonic() >= self._recheck_at:
            self._recheck()
        # The projector's share of a sync: a fraction of what commits have lately taken.
        self._sync_s += (latency_s - self._sync_s) * 0.125
        self._sync_budget_s = min(max(self._sync_s * SYNC_SHARE, MIN_SYNC_BUDGET_S),
                                  MAX_SYNC_BUDGET_S)
        if self._projection.sink is None:
            return
        commits = self._commits
        first = not commits
        commits.append((latency_s, batch_size))
        if first:
            if self._timer is None:
                self._schedule()
        elif len(commits) >= MAX_PENDING_COMMITS and self._lock.acquire(blocking=False):
            try:  # never waits for the lock: the writer must not wait on an exporter
                self._record_commits()
            except Exception:  # noqa: BLE001 - telemetry must not stop the writer
                self._complain("recording journal commits")
            finally:
                self._lock.release()

    def flush(self) -> None:
        """Record what waits (journal commits, counter sums): it happens by itself within
        ``FLUSH_S``; call it before reading metrics at once, and at shutdown."""
        with self._lock:
            try:
                self._drain()
                self._record_commits()
                self._otel_metrics.flush()
            except Exception:  # noqa: BLE001 - telemetry never fails the caller
                self._complain("recording metrics")

    def _schedule(self) -> None:
        """Flush within FLUSH_S (one timer thread at a time, only while something waits)."""
        if self._timer is not None:  # already set (a timer clears it before it flushes)
            return
        with self._timer_lock:
            if self._timer is not None:
                return
            timer = self._timer = threading.Timer(FLUSH_S, self._timed_flush)
        timer.daemon = True
        timer.name = "boundloop-telemetry-flush"
        try:
            timer.start()
        except RuntimeError:  # no thread to be had (interpreter shutdown): next observe records
            with self._timer_lock:
                self._timer = None

    def _timed_flush(self) -> None:
        with self._timer_lock:
            self._timer = None
        self.flush()

    def _record_commits(self) -> None:
        sink, commits = self._projection.sink, self._commits
        while commits:
            latency_s, batch_size = commits.popleft()
            if sink is not None:
                sink.record(n.COMMIT_LATENCY, latency_s, ())
                sink.record(n.COMMIT_BATCH, batch_size, ())

    def release(self, run_id: str, status: str | None = None) -> None:
        """The runner stopped driving run ``run_id``. Call it for every run that ends on
        this runner (a no-op when its RunFinished was observed): a run that ended without
        one (journal unavailable, lease lost, runner closed) has its spans ended as
        ``status`` (else ``unfinished``) and is counted in ``boundloop.runs.unrecorded``."""
        self._queued.discard(run_id)
        link = self._links.get(run_id)
        if not self._live and not self._pending:
            if link is not None:
                self._links.pop(run_id, None)
            return
        self._wanted = True  # the projector lets go within an event
        with self._lock:
            self._wanted = False
            try:
                # This run's events and all observed before them, in order.
                self._drain(commits=False)
                projection = self._projection
                if projection.release(run_id, status, time.time()) and \
                        projection.sink is not None:
                    projection.sink.record(n.RUNS_UNRECORDED, 1, (status or n.UNFINISHED,))
            except Exception:  # noqa: BLE001 - telemetry never fails a run
                self._complain("releasing run %r", run_id)
            finally:
                # After its events are projected (they read it); only the link of this
                # start (a resume of the same run may have linked anew meanwhile).
                if link is not None and self._links.get(run_id) is link:
                    del self._links[run_id]

    def refused(self, status: str) -> None:
        """A run admission refused (``rejected``, or ``journal_unavailable`` at admission):
        it has no events, so only ``boundloop.runs.unrecorded`` counts it."""
        sink = self._projection.sink if self._live else None
        if sink is not None:
            try:
                sink.record(n.RUNS_UNRECORDED, 1, (status,))
            except Exception:  # noqa: BLE001 - telemetry never fails a run
                self._complain("counting a refused run")

    def _complain(self, what: str, *args: object) -> None:
        if not self._complained:
            self._complained = True
            _log.exception("boundloop telemetry failed " + what + " (reported once)", *args)
