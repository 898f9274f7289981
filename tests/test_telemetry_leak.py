"""A Runner per request leaks nothing through telemetry (the meter issue).

Without an OpenTelemetry SDK the global meter provider is the API's proxy, which keeps every
meter and instrument made on it (to hand them to an SDK set later). boundloop makes its
meter and instruments once per provider, so opening and closing Runners (each with its own
``bl.Telemetry()``) adds no objects; a Telemetry made before the SDK is set still records
once it is.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from opentelemetry import metrics

import boundloop as bl

KEY = b"k" * 32
ROOT = Path(__file__).resolve().parents[1]


def _proxy_objects() -> int:
    """Meters and instruments the global proxy meter provider holds (0 once an SDK is set)."""
    provider = metrics.get_meter_provider()
    meters = getattr(provider, "_meters", [])
    return len(meters) + sum(len(getattr(m, "_instruments", [])) for m in meters)


def _settled_objects(threads: int) -> int:
    """Live objects once the last Runner's threads are gone: the least of a few counts (what
    a closing Runner leaves goes a moment later, a leak stays)."""
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    counts = []
    for _ in range(4):
        gc.collect()
        counts.append(len(gc.get_objects()))
        time.sleep(0.05)
    return min(counts)


def _cycles(path: Path, n: int) -> tuple[list[int], int]:
    """Open and close ``n`` Runners; the live object count after each fifth, and how many
    meters and instruments the proxy provider gained."""
    def cycle() -> None:
        with bl.Runner(path, sync=False, redaction_key=KEY):
            pass

    for _ in range(20):  # warm: caches, interned names, the first meter and instruments
        cycle()
    proxy_before = _proxy_objects()
    threads = threading.active_count()
    counts = [_settled_objects(threads)]
    step = max(n // 5, 1)
    for i in range(1, n + 1):
        cycle()
        if i % step == 0:
            counts.append(_settled_objects(threads))
    return counts, _proxy_objects() - proxy_before


def _assert_flat(counts: list[int], proxy_growth: int, n: int) -> None:
    assert proxy_growth == 0, f"the proxy meter provider gained {proxy_growth} objects"
    # Before the fix every Runner left ~40 objects (a proxy meter and its 14 instruments);
    # allow a handful of stray objects over the whole run, never one per Runner.
    growth = counts[-1] - counts[0]
    assert growth < n // 10, f"live objects grew by {growth} over {n} Runners: {counts}"


def test_runners_opened_and_closed_leave_nothing_behind(tmp_path: Path) -> None:
    n = 300
    counts, proxy_growth = _cycles(tmp_path / "j", n)
    _assert_flat(counts, proxy_growth, n)


@pytest.mark.soak
@pytest.mark.timeout(3600)  # ~60 ms a Runner on the 2-core machine
def test_ten_thousand_runners_leave_nothing_behind(tmp_path: Path) -> None:
    n = 10_000
    counts, proxy_growth = _cycles(tmp_path / "j", n)
    _assert_flat(counts, proxy_growth, n)


def test_telemetries_share_the_providers_meter_and_instruments() -> None:
    before = _proxy_objects()
    for _ in range(50):
        bl.Telemetry()
    assert _proxy_objects() - before <= 15  # at most the first meter and its instruments


def test_a_given_meter_provider_is_not_kept_alive() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.metrics")
    import weakref

    provider = sdk.MeterProvider()
    bl.Telemetry(meter_provider=provider)
    ref = weakref.ref(provider)
    provider.shutdown()
    del provider
    gc.collect()
    assert ref() is None


def test_a_telemetry_made_before_the_sdk_records_once_it_is_set(tmp_path: Path) -> None:
    """The global providers are set once per process: in a child process."""
    pytest.importorskip("opentelemetry.sdk")
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import boundloop as bl
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        early = [bl.Telemetry() for _ in range(3)]   # on the proxy, sharing its instruments
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        time.sleep(1.1)  # a Telemetry on the global providers looks for an SDK once a second
        with bl.Runner({str(tmp_path / "j")!r}, sync=False, redaction_key=b"k" * 32,
                       telemetry=early[0]) as runner:
            runner.run(bl.ScriptedModel([bl.Final("hi")]), prompt="x")
        early[0].flush()
        names = {{m.name for rm in reader.get_metrics_data().resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics}}
        assert "boundloop.runs" in names, names
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
