"""OpenTelemetry metrics: boundloop's meter and instruments (made once per provider and
meter), and ``OtelMetrics``, the projection's sink that records to them."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import Meter, MeterProvider

from boundloop.telemetry import names as n

#: Meters and instruments are made once per provider and meter, not once per Telemetry:
#: the API's proxy meter provider (the global one until an SDK is set) keeps every meter and
#: instrument made on it for ever, so that it can hand them to an SDK set later; made per
#: Telemetry, a process that makes a Runner per request grew ~3 KB a Runner without bound.
#: Weak keys: a provider (and its meters) given by a test or application can still go.
_MADE_LOCK = threading.Lock()
_METERS: weakref.WeakKeyDictionary[Any, Meter] = weakref.WeakKeyDictionary()
_INSTRUMENTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _cached(cache: weakref.WeakKeyDictionary[Any, Any], key: Any,
            make: Callable[[], Any]) -> Any:
    with _MADE_LOCK:
        try:
            found = cache.get(key)
        except TypeError:  # neither hashable nor weakly referable: made each time
            return make()
        if found is None:
            found = make()
            try:
                cache[key] = found
            except TypeError:
                pass
        return found


def meter(provider: MeterProvider) -> Meter:
    """boundloop's meter on ``provider``, made once per provider (see ``_METERS``)."""
    made: Meter = _cached(_METERS, provider, lambda: provider.get_meter(n.SCOPE))
    return made


def instruments(meter: Meter) -> dict[str, Any]:
    """How to record each metric of ``names.METRICS`` on ``meter`` (a counter's ``add``, a
    histogram's ``record``), the instruments made once per meter (see ``_METERS``)."""
    made: dict[str, Any] = _cached(_INSTRUMENTS, meter, lambda: _make_instruments(meter))
    return made


def _make_instruments(meter: Meter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in n.METRICS:
        if m.kind == "counter":
            inst: Any = meter.create_counter(m.name, unit=m.unit, description=m.description)
            out[m.name] = inst.add
            continue
        try:
            inst = meter.create_histogram(
                m.name, unit=m.unit, description=m.description,
                explicit_bucket_boundaries_advisory=list(m.buckets))
        except TypeError:  # opentelemetry-api < 1.23 takes no advisory
            inst = meter.create_histogram(m.name, unit=m.unit, description=m.description)
        out[m.name] = inst.record
    return out


class OtelMetrics:
    """A sink recording to OpenTelemetry instruments made from ``meter``, one per metric of
    ``names.METRICS``.

    Histograms are recorded at once. Counter additions are summed here and added to the
    SDK's counters by ``flush`` (``schedule`` is called when the first one waits, so a
    ``Telemetry`` flushes within ``FLUSH_S``): a synchronous SDK add costs ~5 µs on the
    2-core bench machine, a sum here ~0.2 µs, and a round adds tokens of two kinds or more.
    (Observable counters would be as cheap, but the SDK keeps the callbacks of only the
    first instrument of a name: a second Telemetry on the same provider would be lost.)
    """

    def __init__(self, meter: Meter, schedule: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._schedule = schedule
        self._instruments = instruments(meter)
        #: counter additions not yet given to the SDK, by (metric, attribute values)
        self._pending: dict[tuple[str, tuple[str, ...]], float] = {}
        self._attrs: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
        # (metric, values) -> how to record one value of that series, made once per series.
        self._bound: dict[tuple[str, tuple[str, ...]], Callable[[float], None]] = {}

    def _attributes(self, name: str, keys: tuple[str, ...],
                    values: tuple[str, ...]) -> dict[str, str]:
        key = (name, values)
        attrs = self._attrs.get(key)
        if attrs is None:
            # An empty value is an attribute the observation does not have (error.type of
            # a call that completed), left out as the conventions ask.
            attrs = {k: v for k, v in zip(keys, values, strict=True) if v}
            if len(self._attrs) < 10_000:  # series are few (statuses, limits, tools, models)
                self._attrs[key] = attrs
        return attrs

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        """Add to the metric's counter (at the next flush) or record in its histogram."""
        fn = self._bound.get((metric.name, values))
        if fn is None:
            fn = self._bind(metric, values)
        fn(value)

    def _bind(self, metric: n.Metric, values: tuple[str, ...]) -> Callable[[float], None]:
        key = (metric.name, values)
        if metric.kind == "counter":
            pending, lock, schedule = self._pending, self._lock, self._schedule

            def fn(value: float) -> None:
                with lock:
                    first = not pending
                    pending[key] = pending.get(key, 0) + value
                if first:
                    schedule()
        elif not metric.attributes:  # no attribute dict at all: the SDK's cheapest path
            fn = self._instruments[metric.name]
        else:
            fn = functools.partial(self._instruments[metric.name],
                                   attributes=self._attributes(metric.name, metric.attributes,
                                                               values))

        if len(self._bound) < 10_000:
            self._bound[key] = fn
        return fn

    def flush(self) -> None:
        """Give the summed counter additions to the SDK."""
        with self._lock:
            if not self._pending:
                return
            # Emptied in place: the bound counters of ``_bind`` hold this very dict.
            pending = dict(self._pending)
            self._pending.clear()
        keys = {m.name: m.attributes for m in n.METRICS}
        for (name, values), total in pending.items():
            self._instruments[name](total, self._attributes(name, keys[name], values))
