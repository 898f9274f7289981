"""SPEC 11 telemetry: spans and metrics projected from the journal's events, checked with the
OpenTelemetry SDK's in-memory span exporter and metric reader.

Until the runner feeds it, the projection is fed here as the runner will feed it: a journal
whose writer hands each durable append to ``Telemetry.observe`` (and each commit's latency to
``journal_commit``), and, separately, the events of real runs read back from the journal in
commit-like chunks.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

import boundloop as bl  # noqa: E402
from boundloop import events as ev  # noqa: E402
from boundloop.journal.lmdb import LmdbJournal  # noqa: E402
from boundloop.telemetry import Telemetry, names  # noqa: E402

PRICE = bl.Price(input_per_mtok=1000.0, output_per_mtok=2000.0)  # 0.001 per input token


# -- the harness ----------------------------------------------------------------------------
class ObservedJournal(LmdbJournal):
    """An LMDB journal whose writer tells ``telemetries`` of every durable append (after the
    commit, before the appender hears of it) and of every commit's latency and batch size:
    the calls the runner will make."""

    telemetries: Sequence[Telemetry] = ()

    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event],
               done: Callable[[BaseException | None], None], fence: Any = None) -> None:
        batch = list(events)

        def committed(err: BaseException | None) -> None:
            if err is None:
                for t in self.telemetries:
                    t.observe(run_id, batch)
                    t.flush()  # project now, as the runner's release at the run's end does
            done(err)

        super().submit(run_id, expected_seq, batch, committed, fence)

    def _commit(self, batch: list[Any]) -> None:
        started = time.perf_counter()
        super()._commit(batch)
        for t in self.telemetries:
            t.journal_commit(time.perf_counter() - started, len(batch))


class Otel:
    """An SDK tracer and meter provider with in-memory exporters, and a Telemetry on them."""

    def __init__(self, **options: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(tracer_provider=self.tracer_provider,
                                   meter_provider=self.meter_provider, **options)

    def spans(self) -> list[ReadableSpan]:
        self.telemetry.flush()  # what observe queued is projected by now (release, flush)
        return list(self.exporter.get_finished_spans())

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, Any]]], Any]:
        """{(metric name, attributes): value (counter) or (count, sum) (histogram)}."""
        out: dict[tuple[str, frozenset[tuple[str, Any]]], Any] = {}
        self.telemetry.flush()  # journal commits are queued until the next observe
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for p in metric.data.data_points:
                        key = (metric.name, frozenset(p.attributes.items()))
                        out[key] = (p.count, p.sum) if hasattr(p, "count") else p.value
        return out

    def total(self, name: str, **attrs: str) -> float:
        """The counter's sum (or a histogram's count) over series matching ``attrs``."""
        total = 0.0
        for (metric, series), value in self.metrics().items():
            if metric == name and set(attrs.items()) <= set(series):
                total += value[0] if isinstance(value, tuple) else value
        return total

    def hist_sum(self, name: str, **attrs: str) -> float:
        return sum(v[1] for (m, s), v in self.metrics().items()
                   if m == name and set(attrs.items()) <= set(s))


@contextlib.contextmanager
def observed_runner(path: Path, *telemetries: Telemetry, **options: Any) -> Iterator[bl.Runner]:
    """A Runner (with a price table) on an ObservedJournal feeding ``telemetries``."""
    journal = ObservedJournal(path, sync=False)
    journal.telemetries = telemetries
    try:
        with bl.Runner(journal, price=PRICE, **options) as runner:
            yield runner
    finally:
        journal.close()


@contextlib.contextmanager
def read_journal(path: Path) -> Iterator[LmdbJournal]:
    journal = LmdbJournal(path, readonly=True)
    try:
        yield journal
    finally:
        journal.close()


@pytest.fixture
def otel() -> Otel:
    return Otel()


# -- scripted runs --------------------------------------------------------------------------
def calls(*pairs: tuple[str, dict[str, Any]], usage: bl.Usage | None = None) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(f"c{i}", name, args) for i, (name, args) in
                         enumerate(pairs, 1)], usage=usage)


def then(response: Any, delay: float) -> Callable[[Any, Any], Any]:
    def respond(history: Any, ctx: Any) -> Any:
        time.sleep(delay)
        return response
    return respond


def tools() -> dict[str, bl.Tool]:
    booked: set[str] = set()

    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo."""
        return text

    @bl.tool(timeout_s=0.05)
    def slow(x: int) -> str:
        """Times out, no reconcile: outcome unknown."""
        time.sleep(0.3)
        return "late"

    @bl.tool(idempotent=True, retry=bl.RetryPolicy(2, 0.0))
    def flaky(x: int, ctx: bl.ToolContext) -> str:
        """Fails its first attempt."""
        if ctx.attempt == 1:
            raise ConnectionError("try again")
        return "ok"

    def check(key: str) -> str | None:
        return "booked" if key in booked else None

    @bl.tool(timeout_s=0.05, reconcile=check)
    def book(x: int, ctx: bl.ToolContext) -> str:
        """Times out, but took effect: reconciled."""
        booked.add(ctx.idempotency_key)
        time.sleep(0.3)
        return "booked"

    @bl.tool(irreversible=True, timeout_s=0.05)
    def deploy(x: int) -> str:
        """Irreversible, times out: needs review."""
        time.sleep(0.3)
        return "deployed"

    @bl.tool
    def login(user: str, password: str) -> str:
        """Takes a credential (redacted in the journal)."""
        return f"welcome {user}"

    @bl.tool
    def delegate(task: str, ctx: bl.ToolContext) -> str:
        """Runs a child run."""
        child = ctx.run_child(model=bl.ScriptedModel([calls(("echo", {"text": task})),
                                                      bl.Final("child done")]),
                              tools=[echo], prompt=task, run_id="child")
        return child.status

    return {t.name: t for t in (echo, slow, flaky, book, deploy, login, delegate)}


#: (run id, model script, tools used, budget, expected (status, limit)).
SCENARIOS: list[tuple[str, list[Any], list[str], bl.Budget, tuple[str, str | None]]] = [
    ("final", [calls(("echo", {"text": "a"}),
                     usage=bl.Usage(10, 5, cache_write_tokens=2, cache_read_tokens=3)),
               bl.Final("done", usage=bl.Usage(4, 1))], ["echo"], bl.Budget(),
     ("final", None)),
    ("lim-model-steps", [calls(("echo", {"text": "a"}))], ["echo"],
     bl.Budget(max_model_steps=1), ("limit_exceeded", "model_steps")),
    ("lim-tool-calls", [calls(("echo", {"text": "a"}), ("echo", {"text": "b"}))], ["echo"],
     bl.Budget(max_tool_calls=1), ("limit_exceeded", "tool_calls")),
    ("lim-deadline", [then(calls(("echo", {"text": "a"})), 0.15), bl.Final("late")], ["echo"],
     bl.Budget(deadline_s=0.1), ("limit_exceeded", "deadline")),
    ("lim-input", [bl.Final("never")], [], bl.Budget(max_input_tokens=1),
     ("limit_exceeded", "input_tokens")),
    ("lim-output", [calls(("echo", {"text": "a"}), usage=bl.Usage(1, 500))], ["echo"],
     bl.Budget(max_output_tokens=100), ("limit_exceeded", "output_tokens")),
    ("lim-total", [calls(("echo", {"text": "a"}), usage=bl.Usage(300, 1))], ["echo"],
     bl.Budget(max_total_tokens=200), ("limit_exceeded", "total_tokens")),
    ("lim-cost", [calls(("echo", {"text": "a"}), usage=bl.Usage(20, 1, cost=5.0))], ["echo"],
     bl.Budget(max_cost=1.0), ("limit_exceeded", "cost")),
    ("unknown", [calls(("slow", {"x": 1})), bl.Final("done")], ["slow"], bl.Budget(),
     ("final", None)),
    ("retry", [calls(("flaky", {"x": 1})), bl.Final("done")], ["flaky"], bl.Budget(),
     ("final", None)),
    ("reconcile", [calls(("book", {"x": 1})), bl.Final("done")], ["book"], bl.Budget(),
     ("final", None)),
    ("review", [calls(("deploy", {"x": 1}))], ["deploy"], bl.Budget(),
     ("needs_review", None)),
    ("secret", [calls(("login", {"user": "ann", "password": "hunter2-secret"})),
                bl.Final("in")], ["login"], bl.Budget(), ("final", None)),
    ("nested", [calls(("delegate", {"task": "sub"})), bl.Final("done")], ["delegate", "echo"],
     bl.Budget(), ("final", None)),
]


def run_scenarios(runner: bl.Runner, only: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the scripted scenarios; {run id: RunResult}, each checked for its status."""
    known = tools()
    out = {}
    for run_id, script, used, budget, expected in SCENARIOS:
        if only is not None and run_id not in only:
            continue
        result = runner.run(model=bl.ScriptedModel(script), tools=[known[t] for t in used],
                            prompt=f"scenario {run_id}", budget=budget, run_id=run_id)
        assert (result.status, result.exhausted_limit) == expected, result
        out[run_id] = result
    return out


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def run_span(spans: Sequence[ReadableSpan], run_id: str) -> ReadableSpan:
    found = [s for s in spans if s.name == names.SPAN_RUN
             and (s.attributes or {}).get(names.RUN_ID) == run_id]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.parent is not None
                   and s.parent.span_id == parent.context.span_id), key=lambda s: s.start_time)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Otel, dict[str, Any], Path]:
    """Every scenario run once, observed live; the journal is kept for the other tests."""
    otel = Otel()
    path = tmp_path_factory.mktemp("telemetry") / "journal"
    with observed_runner(path, otel.telemetry) as runner:
        results = run_scenarios(runner)
    return otel, results, path


# -- spans ----------------------------------------------------------------------------------
def test_a_run_is_an_invoke_agent_span_with_chat_and_tool_spans_under_it(
        scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, results, _ = scripted
    spans = otel.spans()
    root = run_span(spans, "final")
    assert root.parent is None
    attrs = dict(root.attributes or {})
    assert attrs[names.OPERATION] == "invoke_agent"
    assert attrs[names.RUN_STATUS] == "final" and names.LIMIT not in attrs
    usage = results["final"].usage
    assert attrs[names.INPUT_TOKENS] == usage.all_input_tokens == 14 + 5
    assert attrs[names.OUTPUT_TOKENS] == usage.output_tokens == 6
    assert attrs[names.CACHE_READ_TOKENS] == 3 and attrs[names.CACHE_CREATION_TOKENS] == 2
    assert attrs[names.MODEL_STEPS] == 2 and attrs[names.TOOL_CALLS] == 1
    under = children(spans, root)
    assert [s.name for s in under] == ["chat boundloop", "execute_tool echo", "chat boundloop"]
    first, tool, last = under
    first_attrs = dict(first.attributes or {})
    # The conventions: input_tokens is all input, cached or not.
    assert first_attrs[names.INPUT_TOKENS] == 10 + 2 + 3
    assert first_attrs[names.OUTPUT_TOKENS] == 5
    assert first_attrs[names.CACHE_READ_TOKENS] == 3
    assert first_attrs[names.CACHE_CREATION_TOKENS] == 2
    assert first_attrs[names.OPERATION] == "chat" and first_attrs[names.STEP] == 1
    assert names.MODEL_OUTCOME not in first_attrs  # completed: nothing to say
    last_attrs = dict(last.attributes or {})
    assert (last_attrs[names.INPUT_TOKENS], last_attrs[names.OUTPUT_TOKENS]) == (4, 1)
    assert names.CACHE_READ_TOKENS not in last_attrs  # zero cache tokens are left out
    tool_attrs = dict(tool.attributes or {})
    assert tool_attrs[names.TOOL_NAME] == "echo" and tool_attrs[names.TOOL_CALL_ID] == "c1"
    assert tool_attrs[names.EXECUTION_ID] == "final:1:0" and tool_attrs[names.ATTEMPT] == 1
    assert tool_attrs[names.OPERATION] == "execute_tool"
    assert tool_attrs[names.TOOL_OUTCOME] == "ok"
    # Times are the events' own: nested and ordered.
    for s in under:
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
    assert first.end_time <= tool.start_time <= tool.end_time <= last.start_time


def test_span_times_are_the_events_wall_clock(scripted: tuple[Otel, dict[str, Any], Path]
                                              ) -> None:
    otel, results, path = scripted
    root = run_span(otel.spans(), "final")
    with read_journal(path) as journal:
        events = list(journal.events("final"))
    assert root.start_time == int(events[0].ts * 1e9)
    assert root.end_time == int(events[-1].ts * 1e9)


def test_a_child_run_is_under_its_parents_tool_span(
        scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, _, _ = scripted
    spans = otel.spans()
    parent = run_span(spans, "nested")
    child = run_span(spans, "child")
    tool = [s for s in children(spans, parent) if s.name == "execute_tool delegate"]
    assert len(tool) == 1
    assert child.parent is not None and child.parent.span_id == tool[0].context.span_id
    assert child.context.trace_id == parent.context.trace_id
    assert dict(child.attributes or {})[names.PARENT_RUN_ID] == "nested"
    assert tool[0].start_time <= child.start_time <= child.end_time <= tool[0].end_time
    assert [s.name for s in children(spans, child)] == [
        "chat boundloop", "execute_tool echo", "chat boundloop"]


def test_limit_runs_say_which_limit(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, results, _ = scripted
    spans = otel.spans()
    for run_id, result in results.items():
        if result.exhausted_limit is None:
            continue
        attrs = dict(run_span(spans, run_id).attributes or {})
        assert attrs[names.RUN_STATUS] == "limit_exceeded"
        assert attrs[names.LIMIT] == result.exhausted_limit


def test_every_attempt_is_a_span(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, _, _ = scripted
    spans = otel.spans()
    attempts = [dict(s.attributes or {}) for s in children(spans, run_span(spans, "retry"))
                if s.name == "execute_tool flaky"]
    assert [(a[names.ATTEMPT], a[names.TOOL_OUTCOME]) for a in attempts] == [
        (1, "error"), (2, "ok")]
    assert attempts[0][names.ERROR_TYPE] and attempts[0][names.EXECUTION_ID] == \
        attempts[1][names.EXECUTION_ID]
    unknown = [dict(s.attributes or {}) for s in children(spans, run_span(spans, "unknown"))
               if s.name == "execute_tool slow"]
    assert [a[names.TOOL_OUTCOME] for a in unknown] == ["timed_out"]
    review = run_span(spans, "review")
    assert dict(review.attributes or {})[names.RUN_STATUS] == "needs_review"
    assert review.status.status_code.name == "ERROR"


def test_no_content_unless_asked(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, _, _ = scripted
    content_keys = {names.INPUT_MESSAGES, names.OUTPUT_MESSAGES, names.TOOL_ARGUMENTS,
                    names.TOOL_RESULT}
    for s in otel.spans():
        assert not content_keys & set(s.attributes or {}), s.name
    assert not any("hunter2" in str(v) for s in otel.spans()
                   for v in (s.attributes or {}).values())


def test_content_capture_never_shows_a_redacted_value(tmp_path: Path) -> None:
    otel = Otel(capture_content=True)
    with observed_runner(tmp_path / "j", otel.telemetry) as runner:
        run_scenarios(runner, only=["secret"])
    spans = otel.spans()
    tool = [s for s in spans if s.name == "execute_tool login"][0]
    args = dict(tool.attributes or {})[names.TOOL_ARGUMENTS]
    assert '"user": "ann"' in args and '"password": "[redacted]"' in args
    assert dict(tool.attributes or {})[names.TOOL_RESULT] == '"welcome ann"'
    root = dict(run_span(spans, "secret").attributes or {})
    assert "scenario secret" in str(root[names.INPUT_MESSAGES])
    assert '"in"' in str(root[names.OUTPUT_MESSAGES])
    for s in spans:
        for value in (s.attributes or {}).values():
            assert "hunter2" not in str(value) and "hmac-sha256" not in str(value)


def test_a_resumed_run_gets_a_span_of_its_own(tmp_path: Path) -> None:
    otel = Otel()
    known = tools()
    with observed_runner(tmp_path / "j", otel.telemetry) as runner:
        first = runner.run(model=bl.ScriptedModel([calls(("deploy", {"x": 1}))]),
                           tools=[known["deploy"]], prompt="p", run_id="r")
        assert first.status == "needs_review"
        runner.resolve("r", first.unresolved[0].execution_id, "succeeded", note="checked")
        again = runner.resume("r", model=bl.ScriptedModel([bl.Final("done")]),
                              tools=[known["deploy"]])
        assert again.status == "final"
    spans = [s for s in otel.spans() if s.name == names.SPAN_RUN]
    assert [dict(s.attributes or {}).get(names.RESUMED, False) for s in spans] == [False, True]
    assert [dict(s.attributes or {})[names.RUN_STATUS] for s in spans] == [
        "needs_review", "final"]
    assert otel.total("boundloop.runs", **{names.RUN_STATUS: "needs_review"}) == 1
    assert otel.total("boundloop.runs", **{names.RUN_STATUS: "final"}) == 1
    assert otel.total("boundloop.reviews", **{names.TOOL_NAME: "deploy"}) == 1
    assert not otel.telemetry._projection.runs


# -- metrics --------------------------------------------------------------------------------
def test_metrics_after_the_scripted_runs(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, results, _ = scripted
    m = otel.total
    assert m("boundloop.runs") == len(results) + 1  # the child run too
    assert m("boundloop.runs", **{names.RUN_STATUS: "limit_exceeded"}) == 7
    assert m("boundloop.runs", **{names.RUN_STATUS: "needs_review"}) == 1
    for limit in ("model_steps", "tool_calls", "deadline", "input_tokens", "output_tokens",
                  "total_tokens", "cost"):
        assert m("boundloop.limit_hits", **{names.LIMIT: limit}) == 1, limit
    assert m("boundloop.actions.outcome_unknown") == 2  # slow, and deploy (sent to review)
    assert m("boundloop.actions.outcome_unknown", **{names.TOOL_NAME: "slow"}) == 1
    assert m("boundloop.retries") == 1
    assert m("boundloop.retries", **{names.TOOL_NAME: "flaky"}) == 1
    assert m("boundloop.reconciliations",
             **{names.TOOL_NAME: "book", names.TOOK_EFFECT: "true"}) == 1
    assert m("boundloop.reviews") == 1
    assert m("boundloop.reviews", **{names.TOOL_NAME: "deploy"}) == 1
    assert m("boundloop.tokens", **{names.TOKEN_KIND: "cache_write"}) == 2
    assert m("boundloop.tokens", **{names.TOKEN_KIND: "cache_read"}) == 3
    # Every run's tokens once: the roots' RunFinished usage includes their children's.
    roots = [r for r in results.values()]
    for kind, field in (("input", "input_tokens"), ("output", "output_tokens")):
        assert m("boundloop.tokens", **{names.TOKEN_KIND: kind}) == sum(
            getattr(r.usage, field) for r in roots), kind
    # Cost per finished run (all are priced here), children included.
    assert m("boundloop.run.cost") == 1 + sum(r.usage.cost is not None for r in roots)
    assert otel.hist_sum("boundloop.run.cost") == pytest.approx(
        sum(r.usage.cost or 0 for r in roots) + child_cost(otel))
    assert m("boundloop.run.duration") == len(results) + 1
    # RunFinished.elapsed_s: the run's active time when it ended (RunResult.elapsed_s is
    # read a moment later; the child's is within its parent's).
    assert 0 < otel.hist_sum("boundloop.run.duration") <= sum(r.elapsed_s for r in roots) + \
        results["nested"].elapsed_s
    assert m("boundloop.model.latency") >= 20
    assert m("boundloop.tool.latency", **{names.TOOL_NAME: "flaky"}) == 2
    assert m("boundloop.tool.latency", **{names.TOOL_NAME: "slow",
                                          names.TOOL_OUTCOME: "timed_out"}) == 1
    assert m("boundloop.journal.commit.latency") >= len(results) * 2
    assert m("boundloop.journal.commit.batch_size") == m("boundloop.journal.commit.latency")


def child_cost(otel: Otel) -> float:
    """The child run's cost (counted in its own finished run, and again in its parent's)."""
    spans = otel.spans()
    return float(dict(run_span(spans, "child").attributes or {}).get(names.COST, 0.0))


def test_model_latency_buckets_reach_300_seconds(otel: Otel, tmp_path: Path) -> None:
    with observed_runner(tmp_path / "j", otel.telemetry) as runner:
        run_scenarios(runner, only=["final"])
    data = otel.reader.get_metrics_data()
    assert data is not None
    bounds = [p.explicit_bounds for rm in data.resource_metrics for sm in rm.scope_metrics
              for met in sm.metrics if met.name == "boundloop.model.latency"
              for p in met.data.data_points]
    assert bounds and max(bounds[0]) == 300.0 and 60.0 in bounds[0]


# -- fed from the journal -------------------------------------------------------------------
def commit_like(journal: Any) -> Iterator[tuple[str, list[ev.Event]]]:
    """Every run's events, interleaved in time order, in chunks as commits make them: a run's
    events up to its next model step, and the RunAdmitted alone."""
    per_run = [[(e.ts, order, run_id, e) for e in journal.events(run_id)]
               for order, run_id in enumerate(journal.runs())]
    merged = heapq.merge(*per_run, key=lambda t: (t[0], t[1]))
    for run_id, group in itertools.groupby(merged, key=lambda t: t[2]):
        chunk: list[ev.Event] = []
        for *_, e in group:
            if isinstance(e, ev.ModelStepStarted | ev.CallDispatched) and chunk and not \
                    isinstance(chunk[-1], ev.CallDispatched):
                yield run_id, chunk
                chunk = []
            chunk.append(e)
            if isinstance(e, ev.RunAdmitted):
                yield run_id, chunk
                chunk = []
        if chunk:
            yield run_id, chunk


def shape(spans: Sequence[ReadableSpan]) -> list[tuple[str, str, tuple[Any, ...]]]:
    """Each span's name, its parent's name, and its attributes (order-free)."""
    ids = {s.context.span_id: s.name for s in spans}
    return sorted((s.name, ids.get(s.parent.span_id, "?") if s.parent else "",
                   tuple(sorted((k, str(v)) for k, v in (s.attributes or {}).items())))
                  for s in spans)


def test_events_read_back_from_the_journal_project_the_same(
        scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    live, _, path = scripted
    replayed = Otel()
    with read_journal(path) as journal:
        for run_id, chunk in commit_like(journal):
            replayed.telemetry.observe(run_id, chunk)
    assert shape(replayed.spans()) == shape(live.spans())
    journal_metrics = {"boundloop.journal.commit.latency", "boundloop.journal.commit.batch_size"}
    assert {k: v for k, v in replayed.metrics().items() if k[0] not in journal_metrics} == {
        k: v for k, v in live.metrics().items() if k[0] not in journal_metrics}
    assert not replayed.telemetry._projection.runs
    assert not replayed.telemetry._projection.attempts


# -- cost, bounds, failures -----------------------------------------------------------------
def events_of(path: Path, run_id: str) -> list[ev.Event]:
    with read_journal(path) as journal:
        return list(journal.events(run_id))


def test_without_an_sdk_observe_does_nothing(scripted: tuple[Otel, dict[str, Any], Path]
                                             ) -> None:
    from opentelemetry import metrics, trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider is set in this process")
    assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
    events = events_of(scripted[2], "final")
    telemetry = Telemetry()
    assert not telemetry.enabled
    for _ in range(100):
        telemetry.observe("final", events)
    assert not telemetry._projection.runs
    start = time.perf_counter()
    for _ in range(1000):
        telemetry.observe("final", events)
    per_call = (time.perf_counter() - start) / 1000
    assert per_call < 50e-6  # ~0.3 µs measured; generous for a loaded machine


def test_state_is_dropped_at_run_finished_and_bounded(tmp_path: Path,
                                                      scripted: tuple[Otel, dict[str, Any],
                                                                      Path]) -> None:
    otel = Otel(max_runs=2)
    events = events_of(scripted[2], "final")
    open_part = events[:3]  # admitted, started its step, ... but never finished
    for i in range(3):
        otel.telemetry.observe(f"open-{i}", [msg_run(e, f"open-{i}") for e in open_part])
    otel.telemetry.flush()
    projection = otel.telemetry._projection
    assert list(projection.runs) == ["open-1", "open-2"]
    evicted = [s for s in otel.spans() if s.name == names.SPAN_RUN]
    assert [dict(s.attributes or {})[names.RUN_STATUS] for s in evicted] == [names.UNFINISHED]
    assert dict(evicted[0].attributes or {})[names.RUN_ID] == "open-0"


def msg_run(event: ev.Event, run_id: str) -> ev.Event:
    import msgspec

    return msgspec.structs.replace(event, run_id=run_id)


def test_release_ends_a_run_that_never_finished(scripted: tuple[Otel, dict[str, Any], Path]
                                                ) -> None:
    otel = Otel()
    events = events_of(scripted[2], "final")
    finished_at = next(i for i, e in enumerate(events) if isinstance(e, ev.RunFinished))
    otel.telemetry.observe("final", events[:finished_at - 1])
    otel.telemetry.release("final", "journal_unavailable")
    otel.telemetry.release("final", "journal_unavailable")  # twice: nothing more
    root = run_span(otel.spans(), "final")
    assert dict(root.attributes or {})[names.RUN_STATUS] == "journal_unavailable"
    assert otel.total("boundloop.runs.unrecorded",
                      **{names.RUN_STATUS: "journal_unavailable"}) == 1
    assert otel.total("boundloop.runs") == 0
    otel.telemetry.release("never-seen", "rejected")  # a run it never saw: no-op
    otel.telemetry.refused("rejected")
    assert otel.total("boundloop.runs.unrecorded", **{names.RUN_STATUS: "rejected"}) == 1
    # a finished run is released as a no-op
    otel.telemetry.observe("final", events[finished_at - 1:])
    otel.telemetry.release("final", "final")
    assert otel.total("boundloop.runs.unrecorded") == 2


def test_a_failing_sink_never_fails_the_observer(caplog: pytest.LogCaptureFixture,
                                                 scripted: tuple[Otel, dict[str, Any], Path]
                                                 ) -> None:
    class Broken:
        def record(self, *args: Any) -> None:
            raise RuntimeError("sink down")

    telemetry = Telemetry(sinks=[Broken()])
    events = events_of(scripted[2], "final")
    with caplog.at_level(logging.ERROR, logger="boundloop.telemetry"):
        telemetry.observe("final", events)
        telemetry.flush()
        telemetry.observe("final", events)
        telemetry.flush()
        telemetry.journal_commit(0.001, 1)
    assert len([r for r in caplog.records if "sink down" in (r.exc_text or "")]) == 1


def test_an_event_that_fails_to_project_costs_only_itself(
        caplog: pytest.LogCaptureFixture, scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    """A sink that fails once drops that event's observations alone: the events after it in
    the same commit are still projected (the run's span ends, the run is counted)."""
    failed: list[str] = []

    class FailsOnce:
        def record(self, metric: names.Metric, value: float, values: tuple[str, ...]) -> None:
            if metric is names.MODEL_LATENCY and not failed:
                failed.append(metric.name)
                raise RuntimeError("sink hiccup")

    otel = Otel(sinks=[FailsOnce()])
    events = events_of(scripted[2], "final")
    with caplog.at_level(logging.ERROR, logger="boundloop.telemetry"):
        otel.telemetry.observe("final", events)  # the whole run as one commit
        otel.telemetry.release("final")
    assert failed == [names.MODEL_LATENCY.name]
    assert len([r for r in caplog.records if "sink hiccup" in (r.exc_text or "")]) == 1
    root = run_span(otel.spans(), "final")
    assert dict(root.attributes or {})[names.RUN_STATUS] == "final"
    assert otel.total("boundloop.runs", **{names.RUN_STATUS: "final"}) == 1
    assert otel.total("boundloop.runs.unrecorded") == 0


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(bl.ConfigError):
        Telemetry(capture_content="yes")  # type: ignore[arg-type]
    with pytest.raises(bl.ConfigError):
        Telemetry(max_runs=0)
    with pytest.raises(bl.ConfigError):
        Telemetry(sinks=[object()])  # type: ignore[list-item]


def test_the_names_table_lists_every_metric() -> None:
    table = names.metrics_table()
    for metric in names.METRICS:
        assert f"`{metric.name}`" in table
        assert metric.prom_name.startswith("boundloop_")
        assert len(metric.labels) == len(metric.attributes)
        if metric.kind == "histogram" and metric.unit == "s":
            assert metric.prom_name.endswith("_seconds")
    assert max(names.MODEL_LATENCY.buckets) >= 300


def test_chat_spans_are_named_for_the_model(scripted: tuple[Otel, dict[str, Any], Path]
                                            ) -> None:
    class Adapter:
        model = "claude-sonnet-4-5"

    events = events_of(scripted[2], "final")
    for model, expected in ((Adapter(), "claude-sonnet-4-5"), ("gpt-4.1", "gpt-4.1"),
                            (object(), None)):
        otel = Otel()
        otel.telemetry.observe("final", events, model=model)
        chats = [s for s in otel.spans() if s.name.startswith(names.SPAN_CHAT)]
        assert {s.name for s in chats} == {f"chat {expected or names.DEFAULT_MODEL}"}
        assert {dict(s.attributes or {}).get(names.REQUEST_MODEL) for s in chats} == {expected}
        assert otel.total("boundloop.model.latency",
                          **{names.REQUEST_MODEL: expected or names.DEFAULT_MODEL}) == 2


def test_a_run_resumed_after_a_crash_takes_its_calls_from_the_state() -> None:
    """The first commit of a resumed run is its RunResumed: the tools of the calls a crash
    left open come from the run's live state, which the runner passes along."""
    budget = bl.Budget()
    stamp = {"run_id": "r"}
    before = [
        ev.RunAdmitted(**stamp, ts=10.0, budget=budget, history=[bl.UserMessage("p")],
                       tools=["charge"]),
        ev.ModelStepStarted(**stamp, ts=10.1, step=1, tools_allowed=True,
                            reservation=bl.Usage(5)),
        ev.ModelStepCompleted(**stamp, ts=10.2, step=1,
                              response=calls(("charge", {"x": 1})), latency_s=0.1),
        ev.UsageCharged(**stamp, ts=10.2, step=1, usage=bl.Usage(5), estimated=True),
        ev.CallDecided(**stamp, ts=10.2, execution_id="r:1:0", idempotency_key="k", step=1,
                       round=1, index=0, call_id="c1", tool="charge", arguments={"x": 1},
                       decision="allow", idempotent=True),
        ev.CallDispatched(**stamp, ts=10.2, execution_id="r:1:0", attempt=1),
        # the process died here; another runner claims the run and resumes it
        ev.OwnerClaimed(**stamp, ts=20.0, owner="other", epoch=2),
    ]
    after = [
        ev.RunResumed(**stamp, ts=20.1, owner="other"),
        ev.CallDispatched(**stamp, ts=20.2, execution_id="r:1:0", attempt=2),
        ev.CallSucceeded(**stamp, ts=20.3, execution_id="r:1:0", attempt=2, content="ok",
                         latency_s=0.05),
        ev.RoundCompleted(**stamp, ts=20.3, step=1),
        ev.ModelStepStarted(**stamp, ts=20.4, step=2, tools_allowed=True,
                            reservation=bl.Usage(5)),
        ev.ModelStepCompleted(**stamp, ts=20.5, step=2, response=bl.Final("done"),
                              latency_s=0.1),
        ev.UsageCharged(**stamp, ts=20.5, step=2, usage=bl.Usage(5), estimated=True),
        ev.RunFinished(**stamp, ts=20.6, status="final", exhausted_limit=None,
                       explanation="done", model_steps=2, tool_calls=2,
                       usage=bl.Usage(10)),
    ]
    assert bl.replay(before + after).status == "final"  # a history the fold accepts
    otel = Otel()
    state = bl.replay([*before, after[0]])
    otel.telemetry.observe("r", after[:1], state=state)
    otel.telemetry.observe("r", after[1:])
    assert otel.total("boundloop.retries", **{names.TOOL_NAME: "charge"}) == 1
    assert otel.total("boundloop.tool.latency", **{names.TOOL_NAME: "charge"}) == 1
    spans = otel.spans()
    root = run_span(spans, "r")
    assert dict(root.attributes or {})[names.RESUMED] is True
    assert root.start_time == int(20.1 * 1e9) and root.end_time == int(20.6 * 1e9)
    tool = [s for s in children(spans, root) if s.name == "execute_tool charge"]
    assert [dict(s.attributes or {})[names.ATTEMPT] for s in tool] == [2]
    assert dict(tool[0].attributes or {})[names.TOOL_CALL_ID] == "c1"
    # the same events read whole, as stats reads them, count the same retry
    from boundloop import stats

    figures = stats.compute([("r", before + after)], by="tool")
    assert figures.retries == 1 and figures.groups is not None
    assert figures.groups["charge"].attempts == 1  # attempt 1's outcome was never recorded


def test_observing_from_many_threads(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    import threading

    import msgspec

    events = events_of(scripted[2], "nested") + events_of(scripted[2], "child")
    otel = Otel()
    errors: list[BaseException] = []

    def feed(worker: int) -> None:
        try:
            for i in range(25):
                rid = f"w{worker}-{i}"
                chunk = [msgspec.structs.replace(e, run_id=rid) for e in
                         events_of_run(events, "nested")]
                for j in range(0, len(chunk), 3):
                    otel.telemetry.observe(rid, chunk[j:j + 3])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert otel.total("boundloop.runs") == 100
    assert not otel.telemetry._projection.runs and not otel.telemetry._projection.attempts


def events_of_run(events: list[ev.Event], run_id: str) -> list[ev.Event]:
    return [e for e in events if e.run_id == run_id]


def test_journal_commits_are_recorded_off_the_writer(otel: Otel) -> None:
    telemetry = otel.telemetry
    telemetry.journal_commit(0.002, 3)
    telemetry.journal_commit(0.004, 1)
    assert len(telemetry._commits) == 2  # queued: nothing recorded on the writer's thread
    telemetry.observe("r", [])  # the next observe records them
    assert not telemetry._commits
    assert otel.total("boundloop.journal.commit.latency") == 2
    assert otel.hist_sum("boundloop.journal.commit.batch_size") == 4
    for _ in range(2000):  # bounded even if nothing observes
        telemetry.journal_commit(0.001, 1)
    assert len(telemetry._commits) < 1024
    quiet = Telemetry()  # no SDK: nothing is even queued
    quiet.journal_commit(0.001, 1)
    assert not quiet._commits


def test_counters_reach_the_sdk_within_a_second_by_themselves(
        scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel = Otel()
    otel.telemetry.observe("final", events_of(scripted[2], "final"))

    def runs_counted() -> float:
        data = otel.reader.get_metrics_data()  # no flush: the telemetry's own timer does it
        return sum(p.value for rm in (data.resource_metrics if data else ())
                   for sm in rm.scope_metrics for m in sm.metrics if m.name == "boundloop.runs"
                   for p in m.data.data_points)

    deadline = time.monotonic() + 5
    while runs_counted() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runs_counted() == 1


def test_two_telemetries_on_one_provider_both_count(tmp_path: Path,
                                                    scripted: tuple[Otel, dict[str, Any],
                                                                    Path]) -> None:
    otel = Otel()
    second = Telemetry(tracer_provider=otel.tracer_provider,
                       meter_provider=otel.meter_provider)
    events = events_of(scripted[2], "final")
    otel.telemetry.observe("final", events)
    second.observe("final", events)
    second.flush()
    assert otel.total("boundloop.runs") == 2
    assert otel.total("boundloop.model.latency") == 4


# -- the runner's own wiring ----------------------------------------------------------------
def test_the_runner_feeds_its_telemetry_from_its_commits(tmp_path: Path) -> None:
    otel = Otel()

    @bl.tool(read_only=True)
    def ping() -> str:
        return "pong"

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = ctx.run_child(model=bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("k", "ping", {})]), bl.Final("child done")]),
            tools=[ping], prompt="sub")
        return child.status

    @bl.tool(retry=bl.RetryPolicy(2, 0.0, (ValueError,)), idempotent=True)
    def flaky(ctx: bl.ToolContext) -> str:
        if ctx.attempt == 1:
            raise ValueError("once")
        return "ok"

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("d", "delegate", {}), bl.ToolCall("f", "flaky", {})],
                     usage=bl.Usage(100, 10, cache_read_tokens=50)),
        bl.Final("done")])
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry) as runner:
        result = runner.run(model=model, tools=[delegate, flaky, ping], prompt="go",
                            run_id="parent")
    assert result.status == "final"
    spans = otel.spans()
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    runs = {s.attributes["boundloop.run.id"]: s for s in by_name["invoke_agent"]}
    assert set(runs) == {"parent", next(r for r in runs if r != "parent")}
    parent = runs.pop("parent")
    [child] = runs.values()
    tools = {(s.attributes["gen_ai.tool.name"], s.attributes["boundloop.attempt"]): s
             for s in spans if s.name.startswith("execute_tool")}
    assert {("delegate", 1), ("flaky", 1), ("flaky", 2), ("ping", 1)} == set(tools)
    delegate_span = tools[("delegate", 1)]
    assert delegate_span.parent is not None
    assert delegate_span.parent.span_id == parent.context.span_id
    assert child.parent is not None and child.parent.span_id == delegate_span.context.span_id
    assert parent.attributes["boundloop.run.status"] == "final"
    chats = [s for s in spans if s.name.startswith("chat")
             and s.attributes["boundloop.run.id"] == "parent"]
    assert chats[0].attributes["gen_ai.usage.input_tokens"] == 150  # all input, cached too
    assert chats[0].attributes["gen_ai.usage.cache_read.input_tokens"] == 50
    assert otel.total(names.RETRIES.name) == 1
    assert otel.total(names.RUNS.name, **{"boundloop.run.status": "final"}) == 2
    assert otel.total(names.COMMIT_LATENCY.name) >= 3
