"""Linked traces and the GenAI conventions (SPEC 11), with the OpenTelemetry SDK.

A run's ``invoke_agent`` span is a child of the span current where ``run``, ``submit`` or
``arun`` was called; inside a tool handler the attempt's ``execute_tool`` span is current, and
inside a model call the step's ``chat`` span, so spans the application or a provider SDK
makes there nest under them; a child run hangs under its parent's tool span. The spans carry
the conventions' attributes, and the conventions' client metrics are recorded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import baggage, trace  # noqa: E402
from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF  # noqa: E402

import boundloop as bl  # noqa: E402
from boundloop.telemetry import names  # noqa: E402

KEY = b"k" * 32


class Otel:
    """SDK providers with in-memory exporters; ``app`` is the application's own tracer."""

    def __init__(self, **provider: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(**provider)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = bl.Telemetry(tracer_provider=self.tracer_provider,
                                      meter_provider=self.meter_provider)
        self.app = self.tracer_provider.get_tracer("app")

    def spans(self) -> list[ReadableSpan]:
        self.telemetry.flush()
        return list(self.exporter.get_finished_spans())

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, data point) of each series of ``metric``."""
        self.telemetry.flush()
        data = self.reader.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == metric:
                        out.extend((dict(p.attributes or {}), p) for p in m.data.data_points)
        return out


@pytest.fixture
def otel() -> Otel:
    return Otel()


@pytest.fixture
def runner(tmp_path: Path, otel: Otel) -> Iterator[bl.Runner]:
    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry,
                   redaction_key=KEY) as r:
        yield r


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def parent_of(spans: Sequence[ReadableSpan], span: ReadableSpan) -> ReadableSpan | None:
    if span.parent is None:
        return None
    found = [s for s in spans if s.context.span_id == span.parent.span_id
             and s.context.trace_id == span.context.trace_id]
    assert found, f"{span.name}'s parent was not exported"
    return found[0]


def calls_then_final(tool: str = "echo", **arguments: Any) -> list[Any]:
    return [bl.CallTools([bl.ToolCall("c1", tool, arguments or {"text": "x"})]),
            bl.Final("done")]


# -- the caller's span is the run's parent --------------------------------------------------
def test_the_callers_span_parents_the_run(otel: Otel, runner: bl.Runner) -> None:
    with otel.app.start_as_current_span("request") as request:
        result = runner.run(bl.ScriptedModel([bl.Final("hi")]), prompt="x")
    assert result.status == "final"
    spans = otel.spans()
    run = one(spans, names.SPAN_RUN)
    assert run.parent is not None and run.parent.span_id == request.get_span_context().span_id
    assert run.context.trace_id == request.get_span_context().trace_id


def test_submit_takes_the_span_current_where_it_is_called(otel: Otel,
                                                          runner: bl.Runner) -> None:
    with otel.app.start_as_current_span("request") as request:
        future = runner.submit(bl.ScriptedModel([bl.Final("hi")]), prompt="x")
    # Another span is current when the run is driven: it changes nothing.
    with otel.app.start_as_current_span("elsewhere"):
        assert future.result(timeout=30).status == "final"
    run = one(otel.spans(), names.SPAN_RUN)
    assert run.parent is not None and run.parent.span_id == request.get_span_context().span_id


def test_arun_takes_the_tasks_span(otel: Otel, tmp_path: Path) -> None:
    async def main() -> tuple[int, int]:
        async with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry,
                             redaction_key=KEY) as runner:
            with otel.app.start_as_current_span("request") as request:
                await runner.arun(bl.ScriptedModel([bl.Final("hi")]), prompt="x")
            ctx = request.get_span_context()
            return ctx.trace_id, ctx.span_id

    trace_id, span_id = asyncio.run(main())
    run = one(otel.spans(), names.SPAN_RUN)
    assert run.parent is not None and (run.context.trace_id, run.parent.span_id) == (
        trace_id, span_id)


def test_without_a_callers_span_the_run_is_a_root_with_its_spans_current(
        otel: Otel, runner: bl.Runner) -> None:
    app = otel.app

    @bl.tool
    def echo(text: str) -> str:
        with app.start_as_current_span("in the tool"):
            return text

    runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
    spans = otel.spans()
    run = one(spans, names.SPAN_RUN)
    assert run.parent is None
    tool = parent_of(spans, one(spans, "in the tool"))
    assert tool is not None and tool.name == "execute_tool echo"
    assert parent_of(spans, tool) is run


# -- spans made inside tools and model calls -------------------------------------------------
def test_spans_inside_a_tool_and_a_model_call_nest_under_theirs(otel: Otel,
                                                                runner: bl.Runner) -> None:
    app = otel.app

    @bl.tool
    def echo(text: str) -> str:
        with app.start_as_current_span("in the tool"):
            return text

    def model(history: Any, ctx: bl.ModelContext) -> Any:
        with app.start_as_current_span(f"in the model {ctx.step}"):  # a provider SDK's span
            return calls_then_final()[ctx.step - 1]

    with app.start_as_current_span("request"):
        result = runner.run(bl.ScriptedModel([model, model]), tools=[echo], prompt="x")
    assert result.status == "final"
    spans = otel.spans()
    assert {s.context.trace_id for s in spans} == {one(spans, "request").context.trace_id}
    tool = one(spans, "execute_tool echo")
    assert parent_of(spans, one(spans, "in the tool")) is tool
    chats = named(spans, "chat boundloop")
    assert len(chats) == 2
    for step in (1, 2):
        inner = parent_of(spans, one(spans, f"in the model {step}"))
        assert inner is not None and inner.name == "chat boundloop"
        assert (inner.attributes or {})[names.STEP] == step
    assert parent_of(spans, tool) is one(spans, names.SPAN_RUN)


def test_spans_inside_async_tools_and_models_nest_under_theirs(otel: Otel, tmp_path: Path
                                                               ) -> None:
    app = otel.app

    @bl.tool
    async def echo(text: str) -> str:
        await asyncio.sleep(0)
        with app.start_as_current_span("in the tool"):
            return text

    script = calls_then_final()

    async def model(history: Any, ctx: bl.ModelContext) -> Any:
        await asyncio.sleep(0)
        with app.start_as_current_span("in the model"):
            return script[ctx.step - 1]

    async def main() -> str:
        async with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry,
                             redaction_key=KEY) as runner:
            result = await runner.arun(model, tools=[echo], prompt="x")
            # And a sync runner thread's loop (run, not arun): the same.
            other = await asyncio.to_thread(runner.run, model, [echo], "y")
            assert other.status == "final"
            return result.status

    assert asyncio.run(main()) == "final"
    spans = otel.spans()
    for inner in named(spans, "in the tool"):
        assert parent_of(spans, inner) in named(spans, "execute_tool echo")
    models = named(spans, "in the model")
    assert len(models) == 4
    for inner in models:
        assert parent_of(spans, inner) in named(spans, "chat boundloop")


def test_a_retried_attempt_has_its_own_current_span(otel: Otel, runner: bl.Runner) -> None:
    app = otel.app
    seen: list[int] = []

    @bl.tool(retry=bl.RetryPolicy(2, 0.0, (ValueError,)), idempotent=True)
    def flaky(text: str, ctx: bl.ToolContext) -> str:
        seen.append(trace.get_current_span().get_span_context().span_id)
        with app.start_as_current_span(f"attempt {ctx.attempt}"):
            if ctx.attempt == 1:
                raise ValueError("once")
        return text

    runner.run(bl.ScriptedModel(calls_then_final("flaky")), tools=[flaky], prompt="x")
    spans = otel.spans()
    tools = named(spans, "execute_tool flaky")
    assert len(tools) == 2 and len(set(seen)) == 2
    for attempt in (1, 2):
        tool = parent_of(spans, one(spans, f"attempt {attempt}"))
        assert tool is not None and (tool.attributes or {})[names.ATTEMPT] == attempt


def test_a_child_run_and_its_tools_nest_under_the_parents_tool(otel: Otel,
                                                               runner: bl.Runner) -> None:
    app = otel.app

    @bl.tool
    def leaf(text: str) -> str:
        with app.start_as_current_span("in the leaf"):
            return text

    @bl.tool
    def delegate(text: str, ctx: bl.ToolContext) -> str:
        child = ctx.run_child(model=bl.ScriptedModel(calls_then_final("leaf")), tools=[leaf],
                              prompt=text)
        return child.status

    @bl.tool
    def delegate_from_a_thread(text: str, ctx: bl.ToolContext) -> str:
        # A thread of the handler's own: no current span there; the child still joins.
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(ctx.run_child(
            model=bl.ScriptedModel([bl.Final("k")]), prompt=text).status))
        t.start()
        t.join(30)
        return out[0]

    with app.start_as_current_span("request") as request:
        result = runner.run(bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("c1", "delegate", {"text": "x"}),
                          bl.ToolCall("c2", "delegate_from_a_thread", {"text": "y"})]),
            bl.Final("done")]), tools=[delegate, delegate_from_a_thread], prompt="x")
    assert result.status == "final"
    spans = otel.spans()
    assert {s.context.trace_id for s in spans} == {request.get_span_context().trace_id}
    runs = named(spans, names.SPAN_RUN)
    assert len(runs) == 3
    root = next(s for s in runs if parent_of(spans, s) is one(spans, "request"))
    for tool_name in ("delegate", "delegate_from_a_thread"):
        tool = one(spans, f"execute_tool {tool_name}")
        assert parent_of(spans, tool) is root
        child = [s for s in runs if parent_of(spans, s) is tool]
        assert len(child) == 1, tool_name
    leaf_tool = one(spans, "execute_tool leaf")
    assert parent_of(spans, one(spans, "in the leaf")) is leaf_tool
    assert parent_of(spans, parent_of(spans, leaf_tool)) is one(spans, "execute_tool delegate")


def test_baggage_of_the_caller_reaches_the_tool(otel: Otel, runner: bl.Runner) -> None:
    got: list[object] = []

    @bl.tool
    def echo(text: str) -> str:
        got.append(baggage.get_baggage("tenant"))
        return text

    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with otel.app.start_as_current_span("request"):
            runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
    finally:
        otel_context.detach(token)
    assert got == ["acme"]


def test_nothing_is_current_in_a_tool_without_an_sdk(tmp_path: Path) -> None:
    got: list[bool] = []

    @bl.tool
    def echo(text: str) -> str:
        got.append(trace.get_current_span().get_span_context().is_valid)
        return text

    with bl.Runner(tmp_path / "j", sync=False, redaction_key=KEY) as runner:
        result = runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
        # Without an SDK no run is linked: model calls and handlers run as they are.
        assert runner.telemetry.chat_context(result.run_id, 1) is None
        assert runner.telemetry.tool_context(result.run_id, "e", 1) is None
    assert got == [False]


def test_a_run_sampled_out_makes_nothing_under_it_sampled(tmp_path: Path) -> None:
    otel = Otel(sampler=ALWAYS_OFF)
    # The application's own spans, on a provider that samples what its parent does (the
    # default): under a run that was not sampled, nothing is.
    app = TracerProvider().get_tracer("app")
    sampled: list[bool] = []

    @bl.tool
    def echo(text: str) -> str:
        with app.start_as_current_span("in the tool") as span:
            sampled.append(span.is_recording())
        return text

    with bl.Runner(tmp_path / "j", sync=False, telemetry=otel.telemetry,
                   redaction_key=KEY) as runner:
        runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
    assert sampled == [False] and otel.spans() == []


# -- the conventions' attributes and metrics -------------------------------------------------
class ProviderModel:
    """A model that says what the adapters say: its provider, name and output maximum, and
    each response's id, model and finish reason."""

    provider = "anthropic"
    model = "claude-test"
    max_output_tokens = 321

    def __call__(self, history: Any, ctx: bl.ModelContext) -> Any:
        usage = bl.Usage(input_tokens=10, output_tokens=4, cache_write_tokens=2,
                         cache_read_tokens=3)
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", "echo", {"text": "x"})], usage=usage,
                                info=bl.ResponseInfo("msg_1", "claude-test-0101", "tool_use"))
        return bl.Final("done", usage=usage,
                        info=bl.ResponseInfo("msg_2", "claude-test-0101", "end_turn"))


@bl.tool
def echo(text: str) -> str:
    return text


def test_spans_carry_the_conventions_attributes(otel: Otel, runner: bl.Runner) -> None:
    result = runner.run(ProviderModel(), tools=[echo], prompt="x")
    spans = otel.spans()
    run = one(spans, names.SPAN_RUN).attributes or {}
    assert run[names.PROVIDER] == "anthropic"
    assert run[names.CONVERSATION_ID] == result.run_id
    assert run[names.INPUT_TOKENS] == 2 * 15  # all input, cached or not
    chats = sorted(named(spans, "chat claude-test"),
                   key=lambda s: (s.attributes or {})[names.STEP])
    want = [("msg_1", ("tool_use",)), ("msg_2", ("end_turn",))]
    for chat, (response_id, reasons) in zip(chats, want, strict=True):
        attrs = chat.attributes or {}
        assert attrs[names.OPERATION] == "chat"
        assert attrs[names.PROVIDER] == "anthropic"
        assert attrs[names.CONVERSATION_ID] == result.run_id
        assert attrs[names.REQUEST_MODEL] == "claude-test"
        assert attrs[names.REQUEST_MAX_TOKENS] == 321
        assert attrs[names.RESPONSE_ID] == response_id
        assert attrs[names.RESPONSE_MODEL] == "claude-test-0101"
        assert tuple(attrs[names.FINISH_REASONS]) == reasons
        assert attrs[names.INPUT_TOKENS] == 15
        assert attrs[names.OUTPUT_TOKENS] == 4
    tool = one(spans, "execute_tool echo").attributes or {}
    assert tool[names.TOOL_TYPE] == "function"
    assert tool[names.CONVERSATION_ID] == result.run_id


def test_a_scripted_model_names_its_provider_and_its_finish_reasons(otel: Otel,
                                                                    runner: bl.Runner) -> None:
    runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
    runner.run(bl.ScriptedModel([bl.Final("hi")], provider="openai"), prompt="y")
    spans = otel.spans()
    chats = named(spans, "chat boundloop")
    providers = sorted(str((s.attributes or {})[names.PROVIDER]) for s in chats)
    assert providers == ["boundloop.scripted", "boundloop.scripted", "openai"]
    reasons = sorted(tuple((s.attributes or {})[names.FINISH_REASONS]) for s in chats)
    assert reasons == [("stop",), ("stop",), ("tool_calls",)]
    assert all(names.RESPONSE_ID not in (s.attributes or {}) for s in chats)


def test_the_conventions_client_metrics(otel: Otel, runner: bl.Runner) -> None:
    runner.run(ProviderModel(), tools=[echo], prompt="x")
    runner.run(bl.ScriptedModel([RuntimeError("down")]), prompt="y")
    usage = otel.points("gen_ai.client.token.usage")
    by_type = {attrs[names.TOKEN_TYPE]: point for attrs, point in usage
               if attrs[names.PROVIDER] == "anthropic"}
    assert set(by_type) == {"input", "output"}
    assert (by_type["input"].count, by_type["input"].sum) == (2, 30)  # all input, twice
    assert (by_type["output"].count, by_type["output"].sum) == (2, 8)
    for attrs, _ in usage:
        assert attrs[names.OPERATION] == "chat"
        assert attrs[names.REQUEST_MODEL] == "claude-test"  # the failed step reported none
    duration = otel.points("gen_ai.client.operation.duration")
    ok = [p for a, p in duration if a[names.PROVIDER] == "anthropic"]
    assert len(ok) == 1 and ok[0].count == 2
    assert all(names.ERROR_TYPE not in a for a, _ in duration
               if a[names.PROVIDER] == "anthropic")
    failed = [a for a, _ in duration if a[names.PROVIDER] == "boundloop.scripted"]
    assert failed == [{names.OPERATION: "chat", names.PROVIDER: "boundloop.scripted",
                       names.REQUEST_MODEL: names.DEFAULT_MODEL, names.ERROR_TYPE: "error"}]


def test_response_info_is_journaled_with_the_response(runner: bl.Runner) -> None:
    result = runner.run(ProviderModel(), tools=[echo], prompt="x")
    completed = [e for e in runner.journal.events(result.run_id)
                 if isinstance(e, bl.ModelStepCompleted)]
    assert [e.response.info for e in completed] == [
        bl.ResponseInfo("msg_1", "claude-test-0101", "tool_use"),
        bl.ResponseInfo("msg_2", "claude-test-0101", "end_turn")]


def test_the_adapters_say_their_provider_and_each_responses_id_model_and_finish() -> None:
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    from types import SimpleNamespace as NS

    from boundloop.models._common import ToolNames
    from boundloop.models.anthropic import AnthropicModel
    from boundloop.models.openai import OpenAIChatModel, OpenAIResponsesModel

    tools = ToolNames(["echo"])
    claude = AnthropicModel(anthropic.Anthropic(api_key="test"), "claude-x", max_tokens=99)
    assert (claude.provider, claude.max_output_tokens) == ("anthropic", 99)
    message = NS(id="msg_1", model="claude-x-0101", stop_reason="end_turn",
                 content=[NS(type="text", text="hi")],
                 usage=NS(input_tokens=1, output_tokens=1))
    assert claude.response(message, tools).info == bl.ResponseInfo(
        "msg_1", "claude-x-0101", "end_turn")

    client = openai.OpenAI(api_key="test")
    chat = OpenAIChatModel(client, "gpt-x")
    assert chat.provider == "openai"
    answer = {"id": "chatcmpl-1", "model": "gpt-x-2025", "choices": [{
        "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "echo", "arguments": "{\"text\": \"x\"}"}}]}}]}
    assert chat._parse(answer, tools).info == bl.ResponseInfo(
        "chatcmpl-1", "gpt-x-2025", "tool_calls")

    responses = OpenAIResponsesModel(client, "gpt-x")
    answer = {"id": "resp_1", "model": "gpt-x-2025", "status": "completed", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]}
    assert responses._parse(answer, tools).info == bl.ResponseInfo(
        "resp_1", "gpt-x-2025", "stop")


class _OtherTracer:
    """A tracer of another SDK: spans, but no ``id_generator`` to give ids through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.start_as_current_span(*args, **kwargs)


class _OtherProvider:
    def __init__(self, inner: TracerProvider) -> None:
        self._inner = inner

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _OtherTracer(self._inner.get_tracer(*args, **kwargs))


def test_with_another_sdks_tracer_runs_and_handlers_nest_under_the_caller(
        tmp_path: Path) -> None:
    otel = Otel()
    telemetry = bl.Telemetry(tracer_provider=_OtherProvider(otel.tracer_provider))
    app = otel.app

    @bl.tool
    def echo(text: str) -> str:
        with app.start_as_current_span("in the tool"):
            return text

    runner = bl.Runner(tmp_path / "j", sync=False, telemetry=telemetry, redaction_key=KEY)
    with runner, app.start_as_current_span("request") as request:
        runner.run(bl.ScriptedModel(calls_then_final()), tools=[echo], prompt="x")
    telemetry.flush()
    spans = list(otel.exporter.get_finished_spans())
    want = request.get_span_context().span_id
    run = one(spans, names.SPAN_RUN)
    assert run.parent is not None and run.parent.span_id == want
    inner = one(spans, "in the tool")
    assert inner.parent is not None and inner.parent.span_id == want
