"""boundloop's metrics on a Prometheus registry (extra ``boundloop[prometheus]``, SPEC 11).

```python
import prometheus_client
import boundloop as bl
from boundloop.telemetry import prometheus

registry = prometheus_client.CollectorRegistry()      # or prometheus_client.REGISTRY
telemetry = bl.Telemetry(sinks=[prometheus.register(registry)])
runner = bl.Runner(path, telemetry=telemetry)
```

The collectors are fed by the same projection as the OpenTelemetry instruments, so they
carry the same figures, named ``boundloop_...`` with ``_total`` on counters and ``_seconds``
on durations (``names.METRICS`` gives each metric's Prometheus name and labels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from boundloop.errors import ConfigError
from boundloop.telemetry import names as n


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("boundloop.telemetry.prometheus needs prometheus_client: install "
                          "the extra, pip install 'boundloop[prometheus]'") from None
    return prometheus_client


class PrometheusSink:
    """A metric sink that records to prometheus_client collectors on one registry.

    Made by :func:`register`; give it to ``bl.Telemetry(sinks=[...])``.
    """

    def __init__(self, registry: Any, namespace: str = "") -> None:
        client = _client()
        self.registry = registry
        self.collectors: dict[str, Any] = {}
        try:
            for m in n.METRICS:
                name = namespace + m.prom_name
                if m.kind == "counter":
                    collector = client.Counter(name, m.description, m.labels,
                                               registry=registry)
                else:
                    collector = client.Histogram(name, m.description, m.labels,
                                                 registry=registry,
                                                 buckets=(*m.buckets, float("inf")))
                self.collectors[m.name] = collector
        except ValueError:
            for made in self.collectors.values():  # all or nothing
                registry.unregister(made)
            raise
        self._bound: dict[tuple[str, tuple[str, ...]], Callable[[float], None]] = {}

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        """Increment the metric's counter or observe its histogram, labelled by ``values``."""
        key = (metric.name, values)
        fn = self._bound.get(key)
        if fn is None:
            collector = self.collectors[metric.name]
            series = collector.labels(*values) if values else collector
            fn = series.inc if metric.kind == "counter" else series.observe
            if len(self._bound) < 10_000:
                self._bound[key] = fn
        fn(value)


def register(registry: Any, *, namespace: str = "") -> PrometheusSink:
    """Register boundloop's collectors on ``registry`` (a ``prometheus_client``
    ``CollectorRegistry``) and return the sink that feeds them.

    Args:
        registry: the application's registry (``prometheus_client.REGISTRY`` for the
            default one).
        namespace: a prefix put before every name (default none: names start
            ``boundloop_``), for two Telemetry objects on one registry.

    Raises:
        ConfigError: prometheus_client is not installed, or the registry already holds
            boundloop's collectors (register once per registry, or use a namespace).
    """
    try:
        return PrometheusSink(registry, namespace)
    except ValueError as exc:  # "Duplicated timeseries in CollectorRegistry"
        raise ConfigError(f"the registry already holds boundloop's metrics ({exc}); register "
                          "once per registry, or give a namespace") from None
