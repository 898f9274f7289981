"""The OpenAI adapters (SPEC 13), run through the official SDK against a fake HTTP server.

Every test talks to ``tests/fake_provider.py`` on loopback with a real ``openai.OpenAI`` /
``openai.AsyncOpenAI`` client, so what is asserted is what the SDK put on the wire. The
canned bodies follow the SDK's own types (``openai.types.chat.ChatCompletion``,
``openai.types.responses.Response``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

import boundloop as bl
from tests.fake_provider import FakeProvider, chat_sse, fake_provider, responses_sse

openai = pytest.importorskip("openai")

from boundloop.models.openai import (  # noqa: E402
    AsyncOpenAIChatModel,
    AsyncOpenAIResponsesModel,
    OpenAIChatModel,
    OpenAIResponsesModel,
)

SAFE_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    yield from fake_provider()


@pytest.fixture
def client(fake: FakeProvider) -> Any:
    c = openai.OpenAI(api_key="test", base_url=fake.url + "/v1")
    yield c
    c.close()


@pytest.fixture
def runner(tmp_path: Any) -> Iterator[bl.Runner]:
    with bl.Runner(tmp_path / "j") as r:
        yield r


class Place(msgspec.Struct):
    city: str
    country: str = "FR"


@bl.tool(read_only=True, idempotent=True)
def get_weather(place: Place, unit: str = "celsius") -> dict[str, Any]:
    """The weather at a place."""
    return {"city": place.city, "temp": 21, "unit": unit}


@bl.tool(read_only=True)
def get_time(zone: str) -> str:
    """The local time in a time zone."""
    if zone == "Mars/Olympus":
        raise ValueError("no such zone")
    return "14:05"


TOOLS = [get_weather, get_time]


# --- canned bodies (the SDK's own shapes) --------------------------------------------------

def chat_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def chat_completion(message: dict[str, Any], finish: str = "stop",
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion",
        "created": 1741569952,
        "model": "gpt-4.1-2025-04-14",
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": None, "refusal": None,
                                 "annotations": [], **message},
                     "logprobs": None, "finish_reason": finish}],
        "usage": usage if usage is not None else chat_usage(50, 10),
        "service_tier": "default",
        "system_fingerprint": "fp_b376dfbbd5",
    }
    # The SDK parses it as its own type, so the shape is the real one.
    openai.types.chat.ChatCompletion.model_validate(body)
    return body


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_final(text: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return chat_completion({"content": text}, "stop", usage)


def responses_body(output: list[dict[str, Any]], *, status: str = "completed",
                   incomplete: str | None = None, usage: dict[str, Any] | None = None,
                   ) -> dict[str, Any]:
    body = {
        "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
        "object": "response",
        "created_at": 1741476542,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": None,
        "max_output_tokens": 1024,
        "model": "o4-mini-2025-04-16",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": "medium", "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage if usage is not None else responses_usage(40, 8),
        "user": None,
        "metadata": {},
    }
    openai.types.responses.Response.model_validate(body)
    return body


def responses_usage(input_tokens: int, output: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output}


def reasoning_item(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "encrypted_content": f"gAAAAABo-{item_id}-opaque-ciphertext=="}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": "completed",
            "call_id": call_id, "name": name, "arguments": arguments}


def message_item(text: str) -> dict[str, Any]:
    return {"id": "msg_67ccd2bf17f0819081ff3bb2cf6508e6", "type": "message",
            "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def json_body(request: Any) -> dict[str, Any]:
    body = request.body
    assert isinstance(body, dict), request.raw
    return body


# --- Chat Completions ----------------------------------------------------------------------

def test_chat_parallel_calls_then_final(fake: FakeProvider, client: Any,
                                        runner: bl.Runner) -> None:
    fake.reply(200, chat_completion(
        {"content": "Checking both.",
         "tool_calls": [tool_call("call_w", "get_weather", '{"place": {"city": "Paris"}}'),
                        tool_call("call_t", "get_time", '{"zone": "Mars/Olympus"}')]},
        "tool_calls", chat_usage(120, 40, cached=64)))
    fake.reply(200, chat_final("21°C in Paris; Olympus has no time zone.",
                               chat_usage(200, 12, cached=128)))
    model = OpenAIChatModel(client, "gpt-4.1", max_tokens=256, system="Be brief.")
    assert not inspect.iscoroutinefunction(model.__call__)
    assert model.max_output_tokens == 256

    result = runner.run(model=model, tools=TOOLS, prompt="Weather in Paris, time on Mars?",
                        budget=bl.Budget(max_model_steps=2))

    assert result.status == "final", result.explanation
    assert (result.model_steps, result.tool_calls) == (2, 2)
    # prompt_tokens includes the cached ones: input_tokens is what was not cached (SPEC 7).
    assert result.usage == bl.Usage(input_tokens=(120 - 64) + (200 - 128), output_tokens=52,
                                    cache_write_tokens=0, cache_read_tokens=64 + 128)
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"] * 2

    first, second = (json_body(r) for r in fake.requests)
    assert first["model"] == "gpt-4.1"
    assert first["max_completion_tokens"] == 256
    assert "tool_choice" not in first
    assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Weather in Paris, time on Mars?"}]
    assert [t["type"] for t in first["tools"]] == ["function", "function"]
    weather = first["tools"][0]["function"]
    assert weather["name"] == "get_weather"
    assert weather["description"] == "The weather at a place."
    params = weather["parameters"]
    assert params["type"] == "object"
    assert "$ref" not in json.dumps(params) and "$defs" not in params
    assert params["properties"]["place"]["properties"]["city"] == {"type": "string"}

    # The final-only step: no callable tools.
    assert second["tool_choice"] == "none"
    messages = second["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assistant = messages[2]
    assert assistant["content"] == "Checking both."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_w", "call_t"]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["get_weather",
                                                                       "get_time"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {
        "place": {"city": "Paris"}}
    ok, failed = messages[3], messages[4]
    assert ok["tool_call_id"] == "call_w"
    assert json.loads(ok["content"]) == {"city": "Paris", "temp": 21, "unit": "celsius"}
    assert failed["tool_call_id"] == "call_t"
    assert failed["content"].startswith("error: ")  # Chat has no is_error: flagged in text
    assert [c.status for c in result.completed] == ["ok", "error"]


def test_chat_malformed_arguments_get_a_notice(fake: FakeProvider, client: Any,
                                               runner: bl.Runner) -> None:
    fake.reply(200, chat_completion(
        {"tool_calls": [tool_call("call_bad", "get_time", "{not json")]}, "tool_calls"))
    fake.reply(200, chat_final("Sorry, it is 14:05."))
    model = OpenAIChatModel(client, "gpt-4.1")

    result = runner.run(model=model, tools=TOOLS, prompt="time?",
                        budget=bl.Budget(malformed_retries=1))

    assert result.status == "final", result.explanation
    assert (result.model_steps, result.tool_calls) == (2, 0)
    notice = json_body(fake.requests[1])["messages"][-1]
    assert notice["role"] == "user"
    assert "`get_time`" in notice["content"] and "call 1" in notice["content"]
    assert "not valid JSON" in notice["content"]
    assert "Expecting property name" in notice["content"]  # the parse error itself
    # The malformed step's call never entered the history.
    assert not any(m.get("tool_calls") for m in json_body(fake.requests[1])["messages"])


@pytest.mark.parametrize(("message", "finish", "named"), [
    ({"content": "The answer is"}, "length", "length"),
    ({"content": None}, "content_filter", "content_filter"),
    ({"content": None, "refusal": "I can't help with that."}, "stop", "refus"),
])
def test_chat_unusable_stop_is_malformed(fake: FakeProvider, client: Any, runner: bl.Runner,
                                         message: dict[str, Any], finish: str,
                                         named: str) -> None:
    fake.reply(200, chat_completion(message, finish))
    model = OpenAIChatModel(client, "gpt-4.1", max_tokens=64)

    result = runner.run(model=model, tools=TOOLS, prompt="hi")

    assert result.status == "malformed_response"
    assert named in result.explanation
    assert result.model_steps == 1
    assert result.usage.output_tokens == 10  # the step's usage is still charged


def test_chat_length_is_retried_as_malformed(fake: FakeProvider, client: Any,
                                             runner: bl.Runner) -> None:
    fake.reply(200, chat_completion({"content": "The answer is"}, "length"))
    fake.reply(200, chat_final("42."))
    model = OpenAIChatModel(client, "gpt-4.1", max_tokens=64)

    result = runner.run(model=model, tools=TOOLS, prompt="hi",
                        budget=bl.Budget(malformed_retries=1))

    assert result.status == "final" and result.transcript[-1].text == "42."
    notice = json_body(fake.requests[1])["messages"][-1]
    assert notice["role"] == "user" and "`length`" in notice["content"]


def test_chat_429_retry_after_is_honoured(fake: FakeProvider, client: Any,
                                          runner: bl.Runner) -> None:
    fake.reply(429, {"error": {"message": "Rate limit reached for gpt-4.1",
                               "type": "requests", "param": None,
                               "code": "rate_limit_exceeded"}},
               headers={"retry-after": "1"})
    fake.reply(200, chat_final("done"))
    model = OpenAIChatModel(client, "gpt-4.1", retry=bl.RetryPolicy(3, 0.1))

    result = runner.run(model=model, tools=TOOLS, prompt="hi",
                        budget=bl.Budget(deadline_s=10))

    assert result.status == "final", result.explanation
    assert result.model_steps == 1
    first, second = fake.requests
    waited = second.at - first.at
    assert 0.95 <= waited < 3.0, waited  # Retry-After (1 s), not the 0.1 s backoff
    # The SDK's own retries are off: the adapter's policy is the only one.
    assert first.headers["x-stainless-retry-count"] == "0"
    assert second.headers["x-stainless-retry-count"] == "0"


def test_chat_429_without_retry_is_a_model_error(fake: FakeProvider, client: Any,
                                                 runner: bl.Runner) -> None:
    fake.reply(429, {"error": {"message": "Rate limit", "type": "requests",
                               "code": "rate_limit_exceeded"}}, headers={"retry-after": "0"})
    fake.reply(200, chat_final("never sent"))
    model = OpenAIChatModel(client, "gpt-4.1")

    result = runner.run(model=model, tools=TOOLS, prompt="hi")

    assert result.status == "model_error"
    assert len(fake.requests) == 1  # the SDK did not retry behind the runner's back


def test_chat_no_retry_past_the_deadline(fake: FakeProvider, client: Any,
                                         runner: bl.Runner) -> None:
    fake.reply(429, {"error": {"message": "Rate limit", "type": "requests",
                               "code": "rate_limit_exceeded"}}, headers={"retry-after": "5"})
    fake.reply(200, chat_final("too late"))
    model = OpenAIChatModel(client, "gpt-4.1", retry=bl.RetryPolicy(3, 0.1))

    start = time.monotonic()
    result = runner.run(model=model, tools=TOOLS, prompt="hi",
                        budget=bl.Budget(deadline_s=2))

    assert time.monotonic() - start < 1.5  # it did not sleep toward a retry it cannot make
    assert result.status == "model_error", result.explanation
    assert len(fake.requests) == 1


def test_chat_5xx_retried_with_backoff(fake: FakeProvider, client: Any,
                                       runner: bl.Runner) -> None:
    fake.reply(500, {"error": {"message": "The server had an error", "type": "server_error"}})
    fake.reply(503, {"error": {"message": "overloaded", "type": "server_error"}})
    fake.reply(200, chat_final("done"))
    model = OpenAIChatModel(client, "gpt-4.1", retry=bl.RetryPolicy(3, 0.1))

    result = runner.run(model=model, tools=TOOLS, prompt="hi")

    assert result.status == "final"
    assert len(fake.requests) == 3
    assert fake.requests[1].at - fake.requests[0].at >= 0.09
    assert fake.requests[2].at - fake.requests[1].at >= 0.19  # doubled


def test_chat_request_timeout_is_the_time_left(fake: FakeProvider, client: Any,
                                               runner: bl.Runner) -> None:
    fake.reply(200, chat_final("slow"), delay_s=5)
    model = OpenAIChatModel(client, "gpt-4.1")

    start = time.monotonic()
    result = runner.run(model=model, tools=TOOLS, prompt="hi",
                        budget=bl.Budget(deadline_s=1))

    assert time.monotonic() - start < 2.0
    assert result.status in ("limit_exceeded", "model_error"), result.explanation
    sent_timeout = float(fake.requests[0].headers["x-stainless-read-timeout"])
    assert 0 < sent_timeout <= 1.0


def test_chat_step_none_calls_are_separate_turns(fake: FakeProvider, client: Any,
                                                 runner: bl.Runner) -> None:
    fake.reply(200, chat_final("ok"))
    history = [
        bl.UserMessage("go"),
        bl.CallMessage("c1", "get_time", {"zone": "UTC"}),
        bl.ToolResultMessage("c1", "ok", "12:00"),
        bl.CallMessage("c2", "get_time", {"zone": "CET"}),
        bl.ToolResultMessage("c2", "denied", "not now"),
        bl.FinalMessage("It is noon."),
        bl.UserMessage("and now?"),
    ]
    result = runner.run(model=OpenAIChatModel(client, "gpt-4.1"), tools=TOOLS,
                        history=history)

    assert result.status == "final"
    messages = json_body(fake.requests[0])["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool",
                                             "assistant", "user"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c2"]
    assert messages[4]["content"] == "error (denied): not now"
    assert messages[5] == {"role": "assistant", "content": "It is noon."}


def test_chat_unsafe_tool_names_are_mapped(fake: FakeProvider, client: Any,
                                           runner: bl.Runner) -> None:
    seen: list[str] = []

    def lookup(city: str) -> str:
        seen.append(city)
        return "found"

    dotted = bl.Tool("geo.lookup city", lookup)

    def answer(request: Any) -> tuple[int, dict[str, str], Any]:
        name = request.body["tools"][0]["function"]["name"]
        return 200, {}, chat_completion(
            {"tool_calls": [tool_call("call_1", name, '{"city": "Oslo"}')]}, "tool_calls")

    fake.reply_with(answer)
    fake.reply(200, chat_final("Oslo found."))
    result = runner.run(model=OpenAIChatModel(client, "gpt-4.1"), tools=[dotted],
                        prompt="find Oslo")

    assert result.status == "final", result.explanation
    assert seen == ["Oslo"]
    sent = json_body(fake.requests[0])["tools"][0]["function"]["name"]
    assert SAFE_NAME.match(sent) and sent != "geo.lookup city"
    echoed = json_body(fake.requests[1])["messages"][1]["tool_calls"][0]["function"]["name"]
    assert echoed == sent


def test_chat_price_and_extra_arguments(fake: FakeProvider, client: Any,
                                        runner: bl.Runner) -> None:
    fake.reply(200, chat_final("hi", chat_usage(1_000_000, 500_000, cached=400_000)))
    price = bl.Price(input_per_mtok=2.0, output_per_mtok=8.0, cache_read_per_mtok=0.5)
    model = OpenAIChatModel(client, "gpt-4.1", price=price, temperature=0.2)

    result = runner.run(model=model, tools=TOOLS, prompt="hi")

    assert json_body(fake.requests[0])["temperature"] == 0.2
    assert result.usage.input_tokens == 600_000
    assert result.usage.cost == pytest.approx(0.6 * 2.0 + 0.5 * 8.0 + 0.4 * 0.5)


def test_reserved_arguments_are_refused(client: Any) -> None:
    with pytest.raises(bl.ConfigError, match="messages"):
        OpenAIChatModel(client, "gpt-4.1", messages=[])
    with pytest.raises(bl.ConfigError, match="previous_response_id"):
        OpenAIResponsesModel(client, "o4-mini", previous_response_id="resp_1")
    with pytest.raises(bl.ConfigError, match="max_tokens"):
        OpenAIChatModel(client, "gpt-4.1", max_tokens=0)


# --- Responses -----------------------------------------------------------------------------

def test_responses_reasoning_items_are_sent_back(fake: FakeProvider, client: Any,
                                                 runner: bl.Runner) -> None:
    step1 = [reasoning_item("rs_1"),
             function_call_item("fc_1", "call_w", "get_weather", '{"place": {"city": "Rome"}}'),
             function_call_item("fc_2", "call_t", "get_time", '{"zone": "Europe/Rome"}')]
    fake.reply(200, responses_body(step1, usage=responses_usage(300, 60, cached=256)))
    fake.reply(200, responses_body([reasoning_item("rs_2"), message_item("Sunny, 14:05.")],
                                   usage=responses_usage(420, 20, cached=256)))
    model = OpenAIResponsesModel(client, "o4-mini", max_tokens=512, system="Be brief.")

    result = runner.run(model=model, tools=TOOLS, prompt="Rome?",
                        budget=bl.Budget(max_model_steps=2))

    assert result.status == "final", result.explanation
    assert result.transcript[-1].text == "Sunny, 14:05."
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert result.usage == bl.Usage(input_tokens=(300 - 256) + (420 - 256), output_tokens=80,
                                     cache_write_tokens=0, cache_read_tokens=512)
    assert [r.path for r in fake.requests] == ["/v1/responses"] * 2

    first, second = (json_body(r) for r in fake.requests)
    assert first["store"] is False
    assert first["include"] == ["reasoning.encrypted_content"]
    assert first["instructions"] == "Be brief."
    assert first["max_output_tokens"] == 512
    assert "tool_choice" not in first
    assert first["input"] == [{"type": "message", "role": "user", "content": "Rome?"}]
    tool = first["tools"][0]
    assert (tool["type"], tool["name"], tool["strict"]) == ("function", "get_weather", False)
    assert tool["parameters"]["type"] == "object" and "$ref" not in json.dumps(tool)

    assert second["tool_choice"] == "none"
    items = second["input"]
    assert [i.get("type") for i in items] == ["message", "reasoning", "function_call",
                                              "function_call", "function_call_output",
                                              "function_call_output"]
    assert items[1] == step1[0]  # verbatim: id and encrypted_content
    assert items[2]["call_id"] == "call_w" and items[2]["id"] == "fc_1"
    assert items[3]["call_id"] == "call_t"
    assert [i["call_id"] for i in items[4:]] == ["call_w", "call_t"]
    assert json.loads(items[4]["output"])["city"] == "Rome"
    assert items[5]["output"] == "14:05"
    # The step's output items are kept in the transcript for the next request.
    assistant = [m for m in result.transcript if m.kind == "assistant"]
    assert len(assistant) == 1 and assistant[0].content[0]["encrypted_content"]


@pytest.mark.parametrize(("reason", "named"), [("max_output_tokens", "max_output_tokens"),
                                               ("content_filter", "content_filter")])
def test_responses_incomplete_is_malformed(fake: FakeProvider, client: Any, runner: bl.Runner,
                                           reason: str, named: str) -> None:
    fake.reply(200, responses_body([reasoning_item("rs_1")], status="incomplete",
                                   incomplete=reason))
    result = runner.run(model=OpenAIResponsesModel(client, "o4-mini"), tools=TOOLS,
                        prompt="hi")
    assert result.status == "malformed_response"
    assert named in result.explanation and "incomplete" in result.explanation


def test_responses_refusal_is_malformed(fake: FakeProvider, client: Any,
                                        runner: bl.Runner) -> None:
    refusal = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "refusal", "refusal": "I can't assist with that."}]}
    fake.reply(200, responses_body([refusal]))
    result = runner.run(model=OpenAIResponsesModel(client, "o4-mini"), tools=TOOLS,
                        prompt="hi")
    assert result.status == "malformed_response"
    assert "refus" in result.explanation


def test_responses_malformed_arguments(fake: FakeProvider, client: Any,
                                       runner: bl.Runner) -> None:
    fake.reply(200, responses_body([function_call_item("fc_1", "call_1", "get_time", "{zone")]))
    result = runner.run(model=OpenAIResponsesModel(client, "o4-mini"), tools=TOOLS,
                        prompt="hi")
    assert result.status == "malformed_response"
    assert "`get_time`" in result.explanation and "not valid JSON" in result.explanation


# --- async clients -------------------------------------------------------------------------

def _ctx(tools_allowed: bool = True, deadline: float | None = None) -> bl.ModelContext:
    return bl.ModelContext(run_id="r1", step=1, tools_allowed=tools_allowed,
                           tools=[t.schema for t in TOOLS],
                           remaining=bl.Remaining(model_steps=5, tool_calls=5),
                           deadline=deadline, cancel=bl.CancelToken())


def test_async_client_makes_async_models(fake: FakeProvider) -> None:
    async def main() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(api_key="test", base_url=fake.url + "/v1") as aclient:
            chat = OpenAIChatModel(aclient, "gpt-4.1")
            responses = OpenAIResponsesModel(aclient, "o4-mini")
            assert isinstance(chat, AsyncOpenAIChatModel)
            assert isinstance(chat, OpenAIChatModel)
            assert isinstance(responses, AsyncOpenAIResponsesModel)
            assert inspect.iscoroutinefunction(type(chat).__call__)
            assert inspect.iscoroutinefunction(responses.__call__)
            history = [bl.UserMessage("hi")]
            deadline = time.monotonic() + 5
            got_chat = await chat(history, _ctx(deadline=deadline))
            got_resp = await responses(history, _ctx(tools_allowed=False))
            return got_chat, got_resp

    fake.reply(200, chat_completion(
        {"tool_calls": [tool_call("call_1", "get_time", '{"zone": "UTC"}'),
                        tool_call("call_2", "get_time", '{"zone": "CET"}')]}, "tool_calls"))
    fake.reply(200, responses_body([message_item("hello")]))
    got_chat, got_resp = asyncio.run(main())

    assert isinstance(got_chat, bl.CallTools)
    assert [(c.id, c.arguments) for c in got_chat.calls] == [("call_1", {"zone": "UTC"}),
                                                             ("call_2", {"zone": "CET"})]
    assert isinstance(got_resp, bl.Final) and got_resp.text == "hello"
    assert json_body(fake.requests[1])["tool_choice"] == "none"
    assert float(fake.requests[0].headers["x-stainless-read-timeout"]) <= 5


def test_async_retry_after_is_honoured(fake: FakeProvider) -> None:
    async def main() -> Any:
        async with openai.AsyncOpenAI(api_key="test", base_url=fake.url + "/v1") as aclient:
            model = OpenAIChatModel(aclient, "gpt-4.1", retry=bl.RetryPolicy(3, 0.1))
            return await model([bl.UserMessage("hi")], _ctx(deadline=time.monotonic() + 10))

    fake.reply(429, {"error": {"message": "slow down", "type": "requests"}},
               headers={"retry-after-ms": "400"})
    fake.reply(200, chat_final("done"))
    got = asyncio.run(main())
    assert isinstance(got, bl.Final)
    assert 0.38 <= fake.requests[1].at - fake.requests[0].at < 2.0


@pytest.mark.skipif(not hasattr(bl.Runner, "arun"), reason="Runner.arun is not there yet")
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_async_models_through_arun(fake: FakeProvider, tmp_path: Any, api: str) -> None:
    if api == "chat":
        fake.reply(200, chat_completion(
            {"tool_calls": [tool_call("call_1", "get_time", '{"zone": "UTC"}'),
                            tool_call("call_2", "get_time", '{"zone": "CET"}')]},
            "tool_calls", chat_usage(100, 10, cached=50)))
        fake.reply(200, chat_final("noon", chat_usage(150, 5, cached=50)))
    else:
        fake.reply(200, responses_body(
            [reasoning_item("rs_1"),
             function_call_item("fc_1", "call_1", "get_time", '{"zone": "UTC"}'),
             function_call_item("fc_2", "call_2", "get_time", '{"zone": "CET"}')],
            usage=responses_usage(100, 10, cached=50)))
        fake.reply(200, responses_body([message_item("noon")],
                                       usage=responses_usage(150, 5, cached=50)))

    async def main() -> bl.RunResult:
        async with openai.AsyncOpenAI(api_key="test", base_url=fake.url + "/v1") as aclient:
            cls = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
            model = cls(aclient, "gpt-4.1")
            async with bl.Runner(tmp_path / "j") as runner:
                result: bl.RunResult = await runner.arun(
                    model=model, tools=TOOLS, prompt="time?",
                    budget=bl.Budget(max_model_steps=2, deadline_s=10))
                return result

    result = asyncio.run(main())
    assert result.status == "final", result.explanation
    assert (result.model_steps, result.tool_calls) == (2, 2)
    assert result.usage.input_tokens == 50 + 100 and result.usage.cache_read_tokens == 100
    second = json_body(fake.requests[1])
    assert second["tool_choice"] == "none"
    if api == "chat":
        assert [m["role"] for m in second["messages"]] == ["user", "assistant", "tool", "tool"]
        assert len(second["messages"][1]["tool_calls"]) == 2
    else:
        assert [i["type"] for i in second["input"]][1] == "reasoning"


# --- the optional SDK ----------------------------------------------------------------------

def test_import_boundloop_does_not_import_openai() -> None:
    code = ("import sys, boundloop, boundloop.models, boundloop.models.openai; "
            "assert 'openai' not in sys.modules, 'openai imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("cls", [OpenAIChatModel, OpenAIResponsesModel])
def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch, cls: Any) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(bl.ConfigError, match=re.escape("boundloop[openai]")):
        cls(client=object(), model="gpt-4.1")


# --- streaming (stream=True) ----------------------------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # 2,700 characters
SMALL_RESERVATION = bl.Usage(input_tokens=10)  # reserve no output: the stream is the limit


def ctx_of(tools: list[Any]) -> bl.ModelContext:
    schemas = [{"name": t.name, "parameters": {"type": "object"}} for t in tools]
    return bl.ModelContext("run-1", 1, True, schemas, bl.Remaining(5, 5), None,
                           bl.CancelToken())


CHAT_BODIES = {
    "final": chat_final("Paris: 21°C, clear.", chat_usage(80, 9, cached=30)),
    "calls": chat_completion(
        {"content": "Checking both.",
         "tool_calls": [tool_call("call_1", "get_weather", '{"place": {"city": "Paris"}}'),
                        tool_call("call_2", "get_time", '{"zone": "Europe/Paris"}')]},
        "tool_calls", chat_usage(120, 30)),
    "length": chat_completion({"content": "The answer is"}, "length"),
    "filter": chat_completion({"content": ""}, "content_filter"),
    "refusal": chat_completion({"refusal": "I can't help with that."}, "stop"),
    "bad-json": chat_completion(
        {"tool_calls": [tool_call("call_1", "get_time", '{"zone": "UTC"')]}, "tool_calls"),
}

RESPONSES_BODIES = {
    "final": responses_body([message_item("Paris: 21°C.")], usage=responses_usage(90, 7, 20)),
    "reasoning-and-calls": responses_body(
        [reasoning_item("rs_1"), message_item("Checking."),
         function_call_item("fc_1", "call_1", "get_weather", '{"place": {"city": "Oslo"}}'),
         function_call_item("fc_2", "call_2", "get_time", '{"zone": "CET"}')]),
    "incomplete": responses_body([message_item("The answer")], status="incomplete",
                                 incomplete="max_output_tokens"),
    "refusal": responses_body([{**message_item(""), "content": [
        {"type": "refusal", "refusal": "No."}]}]),
}


@pytest.mark.parametrize("name", list(CHAT_BODIES))
def test_chat_stream_and_non_stream_give_the_same_response(fake: FakeProvider, client: Any,
                                                           name: str) -> None:
    body = CHAT_BODIES[name]
    fake.reply(200, body)
    fake.stream(chat_sse(body, chunk=5))
    price = bl.Price(input_per_mtok=2.0, output_per_mtok=8.0)
    plain = OpenAIChatModel(client, "gpt-4.1", price=price)([bl.UserMessage("hi")],
                                                             ctx_of(TOOLS))
    deltas: list[str] = []
    model = OpenAIChatModel(client, "gpt-4.1", price=price, stream=True,
                            on_text=lambda d, ctx: deltas.append(d))
    assert model([bl.UserMessage("hi")], ctx_of(TOOLS)) == plain
    first, second = (json_body(r) for r in fake.requests)
    assert second == {**first, "stream": True, "stream_options": {"include_usage": True}}
    assert "".join(deltas) == (body["choices"][0]["message"]["content"] or "")


@pytest.mark.parametrize("name", list(RESPONSES_BODIES))
def test_responses_stream_and_non_stream_give_the_same_response(
        fake: FakeProvider, client: Any, name: str) -> None:
    body = RESPONSES_BODIES[name]
    fake.reply(200, body)
    fake.stream(responses_sse(body, chunk=5))
    plain = OpenAIResponsesModel(client, "o4-mini")([bl.UserMessage("hi")], ctx_of(TOOLS))
    deltas: list[str] = []
    model = OpenAIResponsesModel(client, "o4-mini", stream=True,
                                 on_text=lambda d, ctx: deltas.append(d))
    assert model([bl.UserMessage("hi")], ctx_of(TOOLS)) == plain
    first, second = (json_body(r) for r in fake.requests)
    assert second == {**first, "stream": True}
    texts = [p["text"] for i in body["output"] if i["type"] == "message"
             for p in i["content"] if p["type"] == "output_text"]
    assert "".join(deltas) == "".join(texts)


def test_chat_streamed_run_assembles_calls_and_charges_the_usage_chunk(
        fake: FakeProvider, client: Any, runner: bl.Runner) -> None:
    fake.stream(chat_sse(CHAT_BODIES["calls"], chunk=3))
    fake.stream(chat_sse(chat_final("Paris: 21°C; 14:05.", chat_usage(200, 8, cached=100))))
    seen: list[tuple[str, int]] = []
    model = OpenAIChatModel(client, "gpt-4.1", stream=True,
                            on_text=lambda d, ctx: seen.append((d, ctx.step)))
    result = runner.run(model=model, tools=TOOLS, prompt="Paris?")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 2)
    assert result.completed[0].status == "ok"
    assert result.usage == bl.Usage(input_tokens=220, output_tokens=38, cache_read_tokens=100)
    assert ["".join(d for d, s in seen if s == step) for step in (1, 2)] == [
        "Checking both.", "Paris: 21°C; 14:05."]
    assert len(seen) > 5  # deltas, not whole messages


def test_chat_stream_is_cut_at_the_runs_output_limit(fake: FakeProvider, client: Any,
                                                     tmp_path: Any) -> None:
    log = fake.stream(chat_sse(chat_final(LONG)), gap_s=0.002)
    with bl.Runner(tmp_path / "j", estimator=lambda h, m: SMALL_RESERVATION) as runner:
        model = OpenAIChatModel(client, "gpt-4.1", stream=True)
        result = runner.run(model=model, prompt="go", budget=bl.Budget(max_output_tokens=50))
        events = list(runner.journal.events(result.run_id))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "output_tokens")
    assert json_body(fake.requests[0])["max_completion_tokens"] == 51
    assert log.done.wait(5) and log.aborted and log.sent < log.total
    charge = [e for e in events if type(e).__name__ == "UsageCharged"]
    assert len(charge) == 1 and not charge[0].estimated
    # No usage chunk came: the input is estimated from the request's size.
    assert charge[0].usage.input_tokens > 0 and 50 < charge[0].usage.output_tokens <= 53


@pytest.mark.skipif(not hasattr(bl.Runner, "arun"), reason="Runner.arun is not there yet")
def test_async_responses_stream_into_a_text_stream_is_cut_at_the_limit(
        fake: FakeProvider, tmp_path: Any) -> None:
    fake.stream(responses_sse(responses_body(
        [function_call_item("fc_1", "call_1", "get_time", '{"zone": "UTC"}')])))
    log = fake.stream(responses_sse(responses_body([message_item(LONG)])), gap_s=0.002)

    async def main() -> tuple[bl.RunResult, list[bl.TextDelta]]:
        async with openai.AsyncOpenAI(api_key="test", base_url=fake.url + "/v1") as aclient:
            text = bl.TextStream()
            model = OpenAIResponsesModel(aclient, "o4-mini", stream=True, on_text=text)
            assert isinstance(model, AsyncOpenAIResponsesModel)
            async with bl.Runner(tmp_path / "j",
                                 estimator=lambda h, m: SMALL_RESERVATION) as runner:
                async def run() -> bl.RunResult:
                    try:
                        return await runner.arun(model=model, tools=TOOLS, prompt="go",
                                                 budget=bl.Budget(max_output_tokens=60))
                    finally:
                        text.close()

                task = asyncio.create_task(run())
                got = [d async for d in text]
                return await task, got

    result, got = asyncio.run(main())
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "output_tokens")
    assert result.tool_calls == 1 and {d.step for d in got} == {2}
    assert LONG.startswith("".join(d.text for d in got)) and len(got) < 60
    # The second request asked for what was left (60 less the first step's 8) plus one.
    assert json_body(fake.requests[1])["max_output_tokens"] == 53
    assert log.done.wait(5) and log.aborted


@pytest.mark.skipif(not hasattr(bl.Runner, "arun"), reason="Runner.arun is not there yet")
def test_async_chat_stream_through_arun(fake: FakeProvider, tmp_path: Any) -> None:
    fake.stream(chat_sse(chat_final("Noon in Paris.", chat_usage(60, 4))))
    seen: list[str] = []

    async def on_text(delta: str, ctx: bl.ModelContext) -> None:
        await asyncio.sleep(0)
        seen.append(delta)

    async def main() -> bl.RunResult:
        async with openai.AsyncOpenAI(api_key="test", base_url=fake.url + "/v1") as aclient:
            model = OpenAIChatModel(aclient, "gpt-4.1", stream=True, on_text=on_text)
            assert isinstance(model, AsyncOpenAIChatModel)
            async with bl.Runner(tmp_path / "j") as runner:
                return await runner.arun(model=model, prompt="time?")

    result = asyncio.run(main())
    assert result.status == "final" and result.transcript[-1].text == "Noon in Paris."
    assert seen == ["Noon in ", "Paris."] and result.usage.output_tokens == 4


def test_a_responses_stream_without_its_end_is_a_model_error(
        fake: FakeProvider, client: Any, runner: bl.Runner) -> None:
    fake.stream(responses_sse(responses_body([message_item("Half an answ")]))[:-1])
    model = OpenAIResponsesModel(client, "o4-mini", stream=True)
    result = runner.run(model=model, prompt="go")
    assert result.status == "model_error" and "response.completed" in result.explanation


def test_streaming_arguments_are_checked(client: Any) -> None:
    with pytest.raises(bl.ConfigError, match="on_text needs stream=True"):
        OpenAIChatModel(client, "gpt-4.1", on_text=print)
    with pytest.raises(bl.ConfigError, match="async on_text needs an async client"):
        async def on_text(delta: str, ctx: bl.ModelContext) -> None: ...
        OpenAIResponsesModel(client, "o4-mini", stream=True, on_text=on_text)
