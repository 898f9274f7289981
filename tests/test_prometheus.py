"""``boundloop[prometheus]`` (SPEC 11): the same metrics on a registry the application passes,
scraped from its text exposition."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_telemetry import Otel, observed_runner, run_scenarios  # noqa: E402

import boundloop as bl  # noqa: E402
from boundloop.telemetry import Telemetry, names, prometheus  # noqa: E402


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} from the registry's text exposition."""
    text = prometheus_client.generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Otel, dict[Any, float], str]:
    registry = prometheus_client.CollectorRegistry()
    otel = Otel(sinks=[prometheus.register(registry)])
    with observed_runner(tmp_path_factory.mktemp("prom") / "j", otel.telemetry) as runner:
        run_scenarios(runner)
    otel.telemetry.flush()
    return otel, scrape(registry), prometheus_client.generate_latest(registry).decode()


def test_names_carry_the_prefix_and_suffixes(scraped: tuple[Otel, dict[Any, float], str]
                                             ) -> None:
    _, samples, text = scraped
    assert value(samples, "boundloop_runs_total", status="final") >= 1
    assert value(samples, "boundloop_limit_hits_total", limit="tool_calls") == 1
    assert value(samples, "boundloop_actions_outcome_unknown_total", tool="slow") == 1
    assert value(samples, "boundloop_retries_total", tool="flaky") == 1
    assert value(samples, "boundloop_reconciliations_total", tool="book",
                 took_effect="true") == 1
    assert value(samples, "boundloop_reviews_total", tool="deploy") == 1
    assert value(samples, "boundloop_tokens_total", kind="cache_read") == 3
    for histogram in ("boundloop_run_duration_seconds", "boundloop_model_latency_seconds",
                      "boundloop_tool_latency_seconds",
                      "boundloop_journal_commit_latency_seconds",
                      "boundloop_journal_commit_batch_size", "boundloop_run_cost"):
        assert value(samples, histogram + "_count") > 0, histogram
        assert f"# TYPE {histogram} histogram" in text
    assert "# TYPE boundloop_runs_total counter" in text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("boundloop_"), line


def test_model_latency_buckets_go_past_ten_seconds(scraped: tuple[Otel, dict[Any, float], str]
                                                   ) -> None:
    _, samples, _ = scraped
    bounds = {float(dict(ls)["le"]) for (n, ls), _ in samples.items()
              if n == "boundloop_model_latency_seconds_bucket"}
    assert {30.0, 60.0, 120.0, 300.0, float("inf")} <= bounds
    assert max(b for b in bounds if b != float("inf")) == max(names.MODEL_BUCKETS)


def test_prometheus_agrees_with_the_opentelemetry_metrics(
        scraped: tuple[Otel, dict[Any, float], str]) -> None:
    otel, samples, _ = scraped
    compared = 0
    for (name, attrs), got in otel.metrics().items():
        metric = next(m for m in names.METRICS if m.name == name)
        labels = {metric.labels[metric.attributes.index(k)]: str(v) for k, v in attrs}
        if metric.kind == "counter":
            assert value(samples, metric.prom_name + "_total", **labels) == got, name
        else:
            count, total = got
            assert value(samples, metric.prom_name + "_count", **labels) == count, name
            assert value(samples, metric.prom_name + "_sum", **labels) == pytest.approx(total)
        compared += 1
    assert compared > 20


def test_prometheus_alone_needs_no_opentelemetry_sdk(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    telemetry = Telemetry(sinks=[prometheus.register(registry)])
    assert telemetry.enabled
    with observed_runner(tmp_path / "j", telemetry) as runner:
        run_scenarios(runner, only=["final", "lim-tool-calls"])
    samples = scrape(registry)
    assert value(samples, "boundloop_runs_total") == 2
    assert value(samples, "boundloop_limit_hits_total", limit="tool_calls") == 1


def test_one_registry_takes_boundloop_once() -> None:
    registry = prometheus_client.CollectorRegistry()
    prometheus.register(registry)
    with pytest.raises(bl.ConfigError, match="once per registry"):
        prometheus.register(registry)
    other = prometheus.register(registry, namespace="second_")
    other.record(names.RUNS, 1, ("final",))
    assert value(scrape(registry), "second_boundloop_runs_total", status="final") == 1


def test_a_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(bl.ConfigError, match=r"boundloop\[prometheus\]"):
        prometheus.register(object())
