"""Telemetry (SPEC 11): spans and metrics as a projection of the journal's event stream.

``Telemetry`` is fed the journal form of each run's events after they are durable; it never
sits inside the loop. It depends on ``opentelemetry-api`` only: without an SDK it costs next
to nothing. ``boundloop.telemetry.names`` lists every span, attribute and metric;
``boundloop.telemetry.prometheus`` (extra ``boundloop[prometheus]``) exposes the same
metrics on a Prometheus registry the application passes.
"""

from boundloop.telemetry._state import Fanout, Sink
from boundloop.telemetry._telemetry import OtelMetrics, Telemetry
from boundloop.telemetry.projection import Projection

__all__ = ["Telemetry", "Sink", "OtelMetrics", "Fanout", "Projection"]
