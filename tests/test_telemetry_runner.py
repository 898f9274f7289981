"""SPEC 11 telemetry as the runner feeds it: the supervisors hand each durable commit's events
to ``Telemetry.observe``, so when ``run`` returns (or a Future resolves) the run's spans have
ended and been exported, and its metrics recorded. Checked with the OpenTelemetry SDK's
in-memory exporter, and with slow and broken exporters and span processors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from test_telemetry import (  # noqa: E402
    PRICE,
    SCENARIOS,
    Otel,
    children,
    observed_runner,
    run_scenarios,
    run_span,
    tools,
)

import boundloop as bl  # noqa: E402
from boundloop.telemetry import Telemetry, names  # noqa: E402
from boundloop.telemetry._telemetry import WAKE_AT  # noqa: E402

ROUNDS = 3
SPANS_PER_RUN = 1 + (ROUNDS + 1) + ROUNDS  # invoke_agent, a chat a step, a tool an attempt


def rounds_model(rounds: int = ROUNDS) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall(f"c{i}", "echo", {"text": str(i)})])
                             for i in range(rounds)] + [bl.Final("done")])


def of_run(spans: Sequence[ReadableSpan], run_id: str) -> list[ReadableSpan]:
    return [s for s in spans if (s.attributes or {}).get(names.RUN_ID) == run_id]


def shape(spans: Sequence[ReadableSpan]) -> list[tuple[Any, ...]]:
    """The spans without their times and ids: name, parent's name, attributes, status.
    Without the provider's name too: a journal's writer (the direct feed) never sees the
    model object that says it."""
    by_id = {s.context.span_id: s for s in spans}
    out = []
    for s in spans:
        parent = by_id.get(s.parent.span_id) if s.parent is not None else None
        attrs = {k: v for k, v in (s.attributes or {}).items() if k != names.PROVIDER}
        out.append((s.name, parent.name if parent is not None else None,
                    tuple(sorted(attrs.items())), s.status.status_code.name))
    return sorted(out, key=repr)


def _no_provider(metrics: dict[Any, Any]) -> dict[Any, Any]:
    return {(name, frozenset((k, v) for k, v in attrs if k != names.PROVIDER)): value
            for (name, attrs), value in metrics.items()}


class SlowExporter(SpanExporter):
    """Takes ``delay`` seconds per export (a network exporter behind a SimpleSpanProcessor)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.spans: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        time.sleep(self.delay)
        with self._lock:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def slow_otel(delay: float) -> tuple[Otel, SlowExporter]:
    otel, exporter = Otel(), SlowExporter(delay)
    otel.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return otel, exporter


def test_the_runner_fed_projection_matches_the_directly_fed_one(tmp_path: Path) -> None:
    """Every scenario through ``Runner(telemetry=...)`` projects as the same events fed to
    the projection straight from the journal's writer; and each run's spans are out when its
    ``run`` returns."""
    direct = Otel()
    with observed_runner(tmp_path / "observed", direct.telemetry) as runner:
        run_scenarios(runner)
    fed = Otel()
    known = tools()
    with bl.Runner(tmp_path / "fed", sync=False, price=PRICE,
                   telemetry=fed.telemetry) as runner:
        for run_id, script, used, budget, expected in SCENARIOS:
            result = runner.run(model=bl.ScriptedModel(script),
                                tools=[known[t] for t in used], prompt=f"scenario {run_id}",
                                budget=budget, run_id=run_id)
            assert (result.status, result.exhausted_limit) == expected
            mine = of_run(fed.spans(), run_id)
            assert run_span(mine, run_id).end_time is not None
            assert shape(mine) == shape(of_run(direct.spans(), run_id)), run_id
    assert shape(fed.spans()) == shape(direct.spans())
    got, want = _no_provider(fed.metrics()), _no_provider(direct.metrics())
    assert set(got) == set(want)
    for key, value in want.items():
        if key[0].startswith("boundloop.journal"):
            continue  # commits are grouped as the writer finds them
        if isinstance(value, tuple):
            assert got[key][0] == value[0], key  # histograms: as many observations
        else:
            assert got[key] == value, key


def test_a_child_run_is_under_its_parents_tool_span_with_a_slow_exporter(
        tmp_path: Path) -> None:
    otel, exporter = slow_otel(0.002)
    known = tools()
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        result = runner.run(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("d", "delegate", {"task": "sub"})]), bl.Final("done")]),
            tools=[known["delegate"], known["echo"]], prompt="go", run_id="parent")
        assert result.status == "final"
        spans = otel.spans()
        assert len(exporter.spans) == len(spans)  # the slow exporter has them all too
    parent, child = run_span(spans, "parent"), run_span(spans, "child")
    [delegate] = [s for s in children(spans, parent) if s.name == "execute_tool delegate"]
    assert child.parent is not None and child.parent.span_id == delegate.context.span_id
    assert {s.name for s in children(spans, child)} == {"chat boundloop",
                                                        "execute_tool echo"}
    assert delegate.end_time is not None and child.end_time is not None
    assert delegate.end_time >= child.end_time


def test_every_span_is_exported_when_run_returns_with_a_slow_exporter(tmp_path: Path) -> None:
    otel, exporter = slow_otel(0.01)  # 10 ms a span
    known = tools()
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        for i in range(3):
            rid = f"r{i}"
            result = runner.run(model=rounds_model(), tools=[known["echo"]], prompt="go",
                                run_id=rid)
            assert result.status == "final"
            mine = of_run(exporter.spans, rid)  # right away: no waiting here
            assert len(mine) == SPANS_PER_RUN
            assert run_span(mine, rid).attributes[names.RUN_STATUS] == "final"
        assert otel.total(names.RUNS.name, **{names.RUN_STATUS: "final"}) == 3
        assert otel.total(names.TOOL_LATENCY.name) == 3 * ROUNDS


def test_futures_resolve_after_their_spans_are_exported(tmp_path: Path) -> None:
    otel, exporter = slow_otel(0.002)
    known = tools()
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        futures = [runner.submit(rounds_model(), [known["echo"]], "go", run_id=f"f{i}")
                   for i in range(8)]
        for i, f in enumerate(futures):
            assert f.result(timeout=60).status == "final"
            assert len(of_run(exporter.spans, f"f{i}")) == SPANS_PER_RUN


class Broken(SpanProcessor):
    """A span processor that raises in everything (an SDK or exporter bug)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("processor down (start)")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor down (end)")


class EndOnly(Broken):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass


class BrokenExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise RuntimeError("exporter down")


@pytest.mark.parametrize("broken", ["processor", "on_end", "exporter"])
def test_a_broken_exporter_or_processor_never_affects_a_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str) -> None:
    otel = Otel()
    otel.tracer_provider.add_span_processor(
        {"processor": Broken(), "on_end": EndOnly()}.get(broken)
        or SimpleSpanProcessor(BrokenExporter()))
    known = tools()
    with caplog.at_level(logging.ERROR), \
            bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        for rid in ("a", "b"):
            result = runner.run(model=rounds_model(), tools=[known["echo"]], prompt="go",
                                run_id=rid)
            assert (result.status, result.tool_calls) == ("final", ROUNDS)
        nested = runner.run(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("d", "delegate", {"task": "sub"})]), bl.Final("done")]),
            tools=[known["delegate"], known["echo"]], prompt="go", run_id="nested")
        assert nested.status == "final"
        one_round = runner.run(model=rounds_model(1), tools=[known["echo"]], prompt="go",
                                run_id="c")
        assert one_round.status == "final"
    if broken == "exporter":  # the SDK reports it; spans and metrics are all made
        assert otel.total(names.RUNS.name) == 5
        assert len(otel.spans()) == 2 * SPANS_PER_RUN + 8 + 4  # nested: 4 + 4, "c": 4
    else:  # the projection's own error report, once
        assert len([r for r in caplog.records if r.name == "boundloop.telemetry"]) == 1


def test_without_an_sdk_nothing_is_projected(tmp_path: Path) -> None:
    quiet = Telemetry()
    assert not quiet.enabled
    known = tools()
    with bl.Runner(tmp_path / "j", sync=False, telemetry=quiet) as runner:
        assert runner.run(model=rounds_model(1), tools=[known["echo"]],
                          prompt="go").status == "final"
    assert not quiet._projection.runs and not quiet._commits


def test_counters_flushed_twice_count_everything(tmp_path: Path) -> None:
    """Counter sums reach the SDK at every flush, not only the first."""
    otel = Otel()
    known = tools()
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        for i in range(3):
            runner.run(model=rounds_model(1), tools=[known["echo"]], prompt="go",
                       run_id=f"r{i}")
            assert otel.total(names.RUNS.name) == i + 1  # (metrics() flushes)


class ThreadNoting(SpanExporter):
    """Notes the thread that exported each span (the thread that projected its end)."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.threads.extend(threading.current_thread().name for _ in spans)
        return SpanExportResult.SUCCESS


def test_the_projection_waits_for_the_journal_to_sync_and_is_done_by_the_runs_end(
        tmp_path: Path) -> None:
    """The projector thread projects while the journal waits for its disk (off the loop's
    path), once enough waits (``WAKE_AT`` commits' events: a run long enough); what it has
    not got to when the run ends, the run's end projects, so every span is out when run
    returns, in order (a tool span after the run span it is under)."""
    otel, noting = Otel(), ThreadNoting()
    otel.tracer_provider.add_span_processor(SimpleSpanProcessor(noting))
    known = tools()
    rounds = WAKE_AT + 4  # a commit a round, and the queue is full after WAKE_AT of them
    per_run = 1 + (rounds + 1) + rounds
    with bl.Runner(tmp_path / "j", sync=True, telemetry=otel.telemetry) as runner:
        for i in range(6):
            rid = f"s{i}"
            assert runner.run(model=rounds_model(rounds), tools=[known["echo"]], prompt="go",
                              run_id=rid, budget=bl.Budget(max_model_steps=rounds + 2,
                                                           max_tool_calls=rounds)
                              ).status == "final"
            assert len(of_run(otel.exporter.get_finished_spans(), rid)) == per_run
    assert len(noting.threads) == 6 * per_run
    assert "boundloop-telemetry" in noting.threads, noting.threads  # the projector did some
    assert set(noting.threads) - {"boundloop-telemetry"}, noting.threads  # the runs' ends too


def test_a_short_run_is_projected_at_its_end_without_waking_the_projector(
        tmp_path: Path) -> None:
    """Fewer than ``WAKE_AT`` commits' events are not worth a thread's wake-up (issue #23):
    a short durable run's spans are all made by its end, on the thread that ends it, and no
    projector thread is started."""
    otel, noting = Otel(), ThreadNoting()
    otel.tracer_provider.add_span_processor(SimpleSpanProcessor(noting))
    known = tools()
    with bl.Runner(tmp_path / "j", sync=True, telemetry=otel.telemetry) as runner:
        for i in range(3):
            rid = f"short{i}"
            assert runner.run(model=rounds_model(), tools=[known["echo"]], prompt="go",
                              run_id=rid).status == "final"
            assert len(of_run(otel.exporter.get_finished_spans(), rid)) == SPANS_PER_RUN
        assert otel.telemetry._projector is None
    assert len(noting.threads) == 3 * SPANS_PER_RUN
    assert "boundloop-telemetry" not in noting.threads, noting.threads
