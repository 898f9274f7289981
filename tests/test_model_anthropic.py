"""AnthropicModel (SPEC 13) through the official SDK against a fake Messages API on loopback.

Every run here goes ``bl.Runner`` → AnthropicModel → ``anthropic.Anthropic`` (or
``AsyncAnthropic``) → HTTP → tests/fake_provider.py, so the assertions are on the JSON the
SDK really sent and on what the runner made of the answers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fake_provider import FakeProvider, anthropic_sse, fake_provider
from loop_helpers import journal_of

import boundloop as bl

anthropic = pytest.importorskip("anthropic")

from boundloop.models.anthropic import (  # noqa: E402
    AnthropicModel,
    AsyncAnthropicModel,
    _arguments,
    messages_from_history,
)

MODEL = "claude-sonnet-4-6"
PRICE = bl.Price(input_per_mtok=3.0, output_per_mtok=15.0, cache_write_per_mtok=3.75,
                 cache_read_per_mtok=0.3)


# --- fixtures and canned Messages API JSON -----------------------------------------------

@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    yield from fake_provider()


@pytest.fixture
def client(fake: FakeProvider) -> Iterator[Any]:
    # max_retries=5: the adapter must not let the SDK retry on its own (one request each).
    with anthropic.Anthropic(api_key="test", base_url=fake.url, max_retries=5) as c:
        yield c


def message(content: list[dict[str, Any]], stop_reason: str | None, *, input_tokens: int = 100,
            output_tokens: int = 20, cache_write: int = 0, cache_read: int = 0,
            msg_id: str = "msg_01XFDUDYJgAACzvnptvVoYEL") -> dict[str, Any]:
    """A Messages API response body, shaped as the API sends it."""
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": MODEL,
        "content": content, "stop_reason": stop_reason, "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens, "cache_creation_input_tokens": cache_write,
            "cache_read_input_tokens": cache_read,
            "cache_creation": {"ephemeral_5m_input_tokens": cache_write,
                               "ephemeral_1h_input_tokens": 0},
            "output_tokens": output_tokens, "service_tier": "standard",
        },
    }


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def tool_use(cid: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": cid, "name": name, "input": arguments}


def api_error(kind: str, msg: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": msg},
            "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"}


def bodies(fake: FakeProvider) -> list[dict[str, Any]]:
    assert all(r.path == "/v1/messages" and r.method == "POST" for r in fake.requests)
    return [r.body for r in fake.requests]


@pytest.fixture
def tools() -> tuple[bl.Tool, bl.Tool]:
    @bl.tool(read_only=True)
    def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
        """Current weather for a city."""
        return {"city": city, "temp": 21, "unit": unit}

    @bl.tool(read_only=True)
    def get_time(tz: str) -> str:
        """Current time in a time zone."""
        raise RuntimeError(f"unknown time zone {tz}")

    return get_weather, get_time


# --- import hygiene ----------------------------------------------------------------------

def test_import_boundloop_does_not_import_the_sdk() -> None:
    code = ("import sys, boundloop, boundloop.models, boundloop.models.anthropic\n"
            "assert 'anthropic' not in sys.modules, 'boundloop imported anthropic'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_sdk_is_a_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "anthropic", None)
    with pytest.raises(bl.ConfigError, match=r"boundloop\[anthropic\]"):
        AnthropicModel(object(), MODEL)


def test_bad_arguments_are_config_errors(client: Any) -> None:
    with pytest.raises(bl.ConfigError, match="max_tokens"):
        AnthropicModel(client, MODEL, max_tokens=0)
    with pytest.raises(bl.ConfigError, match="messages"):
        AnthropicModel(client, MODEL, messages=[])
    with pytest.raises(bl.ConfigError, match="retry"):
        AnthropicModel(client, MODEL, retry=3)
    model = AnthropicModel(client, MODEL, max_tokens=777)
    assert model.max_output_tokens == 777 and type(model) is AnthropicModel
    assert not inspect.iscoroutinefunction(model.__call__)


# --- a tool-use turn with two parallel calls, then the final answer ----------------------

def test_parallel_calls_then_final(tmp_path: Path, fake: FakeProvider, client: Any,
                                   tools: tuple[bl.Tool, bl.Tool]) -> None:
    fake.reply(200, message([
        text("I'll look up both."),
        tool_use("toolu_01A09q90qw90lq917835lq9", "get_weather", {"city": "Paris"}),
        tool_use("toolu_01B29q90qw90lq917835lq8", "get_time", {"tz": "Mars/Olympus"}),
    ], "tool_use", input_tokens=400, output_tokens=80, cache_write=1200))
    fake.reply(200, message([text("Paris is 21°C; the time zone is unknown.")], "end_turn",
                            input_tokens=150, output_tokens=30, cache_read=1200,
                            msg_id="msg_01Aq9w938a90dw8q"))
    model = AnthropicModel(client, MODEL, max_tokens=512, system="Be brief.", price=PRICE,
                           cache=True)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=list(tools), prompt="Weather and time in Paris?",
                            budget=bl.Budget(max_model_steps=2, deadline_s=30))
        journal_of(runner, result)

    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 2)
    assert result.transcript[-1] == bl.FinalMessage("Paris is 21°C; the time zone is unknown.")
    cost = (550 * 3.0 + 110 * 15.0 + 1200 * 3.75 + 1200 * 0.3) / 1e6
    assert result.usage.input_tokens == 550 and result.usage.output_tokens == 110
    assert result.usage.cache_write_tokens == 1200 and result.usage.cache_read_tokens == 1200
    assert result.usage.cost == pytest.approx(cost)

    first, second = bodies(fake)
    # The request: model, max_tokens, the system prompt, the tools in Anthropic's form.
    assert first["model"] == MODEL and first["max_tokens"] == 512
    assert first["system"] == [{"type": "text", "text": "Be brief.",
                                "cache_control": {"type": "ephemeral"}}]
    assert [t["name"] for t in first["tools"]] == ["get_weather", "get_time"]
    weather = first["tools"][0]
    assert weather["description"] == "Current weather for a city."
    assert weather["input_schema"]["type"] == "object"
    assert weather["input_schema"]["required"] == ["city"]
    assert "cache_control" not in weather
    assert first["tools"][1]["cache_control"] == {"type": "ephemeral"}  # the last tool
    assert "tool_choice" not in first  # tools allowed: the API's default, auto
    assert first["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Weather and time in Paris?",
         "cache_control": {"type": "ephemeral"}}]}]

    # The next request: ONE assistant message with the step's text and both tool_use
    # blocks, then ONE user message with both results, paired by id, the error flagged.
    user, assistant, results = second["messages"]
    assert user == {"role": "user", "content": [{"type": "text",
                                                 "text": "Weather and time in Paris?"}]}
    assert assistant == {"role": "assistant", "content": [
        {"type": "text", "text": "I'll look up both."},
        {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
         "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_01B29q90qw90lq917835lq8", "name": "get_time",
         "input": {"tz": "Mars/Olympus"}},
    ]}
    assert results["role"] == "user"
    ok, err = results["content"]
    assert ok["type"] == err["type"] == "tool_result"
    assert ok["tool_use_id"] == "toolu_01A09q90qw90lq917835lq9" and "is_error" not in ok
    assert json.loads(ok["content"]) == {"city": "Paris", "temp": 21, "unit": "celsius"}
    assert err["tool_use_id"] == "toolu_01B29q90qw90lq917835lq8" and err["is_error"] is True
    assert err["content"].startswith("error: ") and "Mars/Olympus" in err["content"]
    # Prompt caching moves with the conversation: the last block of the last user turn.
    assert err["cache_control"] == {"type": "ephemeral"} and "cache_control" not in ok
    # The final-only step (max_model_steps=2): the tools stay (cached prefix, and the API
    # needs them next to tool_use blocks) but none may be called.
    assert second["tool_choice"] == {"type": "none"}
    assert second["tools"] == first["tools"]

    # The deadline bounds the HTTP call, and the SDK did not retry on its own.
    for request in fake.requests:
        assert request.headers["x-stainless-retry-count"] == "0"
        assert 0 < float(request.headers["x-stainless-timeout"]) <= 30


def test_calls_of_a_history_without_steps_are_separate_turns() -> None:
    history = [
        bl.UserMessage("hi"),
        bl.CallMessage("c1", "a", {"x": 1}),
        bl.ToolResultMessage("c1", "ok", "one"),
        bl.CallMessage("c2", "a", {"x": 2}),
        bl.ToolResultMessage("c2", "denied", "not allowed"),
        bl.CallMessage("c3", "a", {"x": 3}),  # no result recorded
        bl.NoticeMessage("your last answer was malformed"),
        bl.UserMessage("and again"),
        bl.FinalMessage("done"),
        bl.UserMessage("more?"),
    ]
    messages = messages_from_history(history)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user",
                                             "assistant", "user", "assistant", "user"]
    assert messages[4]["content"] == [{"type": "tool_result", "tool_use_id": "c2",
                                       "is_error": True, "content": "denied: not allowed"}]
    # A call without a result still gets one (the API requires it), as an error; the
    # notice and the user text that follow join that user message, after the result.
    assert messages[6]["content"][0]["tool_use_id"] == "c3"
    assert messages[6]["content"][0]["is_error"] is True
    assert [b["text"] for b in messages[6]["content"][1:]] == [
        "your last answer was malformed", "and again"]
    assert messages[7] == {"role": "assistant", "content": [{"type": "text", "text": "done"}]}


# --- thinking blocks go back verbatim ----------------------------------------------------

def test_thinking_blocks_are_sent_back_verbatim(tmp_path: Path, fake: FakeProvider,
                                                client: Any,
                                                tools: tuple[bl.Tool, bl.Tool]) -> None:
    thinking = {"type": "thinking", "thinking": "The user wants Paris weather.",
                "signature": "EqQBCkgIARABGAIiQL2oFp8u3c1yI0k4x5ZAm1+Qk2c4Z8o5Vg=="}
    redacted = {"type": "redacted_thinking",
                "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"}
    call = tool_use("toolu_01T1x1fJ34qAmk2tNTrN7Up6", "get_weather", {"city": "Paris"})
    fake.reply(200, message([thinking, redacted, text("Checking."), call], "tool_use"))
    fake.reply(200, message([text("21°C.")], "end_turn"))
    model = AnthropicModel(client, MODEL, max_tokens=2048,
                           thinking={"type": "enabled", "budget_tokens": 1024})
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=list(tools), prompt="Paris?")
    assert result.status == "final"
    first, second = bodies(fake)
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert second["messages"][1] == {"role": "assistant",
                                     "content": [thinking, redacted, text("Checking."), call]}
    # The step's content is stored in the transcript; the call's arguments are not
    # duplicated in it (the tool_use block is filled from the call message when sent).
    turn = next(m for m in result.transcript if m.kind == "assistant")
    assert turn.text == "Checking."
    assert turn.content[:3] == [thinking, redacted, text("Checking.")]
    assert turn.content[3] == {"type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6"}


# --- turns without a usable answer are malformed, never exceptions -----------------------

def test_tool_input_that_is_not_json_is_malformed(tmp_path: Path, fake: FakeProvider,
                                                  client: Any,
                                                  tools: tuple[bl.Tool, bl.Tool]) -> None:
    # The API itself returns an object; a proxy or a streaming accumulator may hand over
    # the raw text. The SDK passes a string ``input`` through, so the fake can send one.
    fake.reply(200, message([tool_use("toolu_01", "get_weather", '{"city": "Par')],
                            "tool_use"))
    model = AnthropicModel(client, MODEL)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=list(tools), prompt="Paris?")
    assert result.status == "malformed_response"
    assert "call 1 (`get_weather`)" in result.explanation
    assert "not valid JSON" in result.explanation


def test_tool_input_conversion() -> None:
    assert _arguments({"a": 1}) == {"a": 1}
    assert _arguments('{"a": 1}') == {"a": 1}
    assert _arguments("") == {}
    assert _arguments('{"a": ') == '{"a": '  # the raw string, for the runner to report
    assert _arguments([1]) == [1]


@pytest.mark.parametrize(("stop", "words"), [
    ("max_tokens", "output limit (max_tokens=256)"),
    ("refusal", "refused"),
    ("pause_turn", "paused"),
    ("model_context_window_exceeded", "context window"),
    ("something_new", "`something_new`"),
])
def test_stops_without_an_answer_are_malformed(tmp_path: Path, fake: FakeProvider, client: Any,
                                               stop: str, words: str) -> None:
    fake.reply(200, message([text("I can")], stop))
    model = AnthropicModel(client, MODEL, max_tokens=256)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
        journal_of(runner, result)
    assert result.status == "malformed_response"
    assert words in result.explanation
    assert stop in result.explanation or stop == "something_new"
    # The tokens the turn used are charged, not the reservation.
    assert (result.usage.input_tokens, result.usage.output_tokens) == (100, 20)


def test_a_refusal_is_retried_with_malformed_retries(tmp_path: Path, fake: FakeProvider,
                                                     client: Any) -> None:
    fake.reply(200, message([], "refusal"))
    fake.reply(200, message([text("Here it is.")], "end_turn"))
    model = AnthropicModel(client, MODEL)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go",
                            budget=bl.Budget(max_model_steps=3, malformed_retries=1))
    assert (result.status, result.model_steps) == ("final", 2)
    second = bodies(fake)[1]
    # The notice is the runner's word to the model: a user text, merged with the prompt.
    (only,) = second["messages"]
    assert only["role"] == "user" and len(only["content"]) == 2
    assert "refused" in only["content"][1]["text"]


# --- provider errors: model_error, or retried within the step before the deadline --------

def test_a_429_without_retry_is_a_model_error_and_the_sdk_does_not_retry(
        tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    fake.reply(429, api_error("rate_limit_error", "Number of requests has exceeded your "
                              "rate limit"), headers={"retry-after": "0"})
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=AnthropicModel(client, MODEL), prompt="go")
    assert result.status == "model_error"
    assert len(fake.requests) == 1  # the client's max_retries=5 was not used


def test_a_429_with_retry_after_is_retried_after_that_delay(
        tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    fake.reply(429, api_error("rate_limit_error", "rate limited"),
               headers={"retry-after": "1"})
    fake.reply(200, message([text("ok")], "end_turn"))
    model = AnthropicModel(client, MODEL, retry=bl.RetryPolicy(3, 0.1))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go", budget=bl.Budget(deadline_s=20))
    assert (result.status, result.model_steps) == ("final", 1)
    first, second = fake.requests
    gap = second.at - first.at
    assert 0.95 <= gap < 3.0  # Retry-After (1 s) honoured, not the policy's 0.1 s
    assert second.headers["x-stainless-retry-count"] == "0"  # our retry, not the SDK's


def test_overloaded_and_5xx_are_retried_with_backoff(tmp_path: Path, fake: FakeProvider,
                                                     client: Any) -> None:
    fake.reply(529, api_error("overloaded_error", "Overloaded"))
    fake.reply(500, api_error("api_error", "Internal server error"))
    fake.reply(200, message([text("ok")], "end_turn"))
    model = AnthropicModel(client, MODEL, retry=bl.RetryPolicy(3, 0.05))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
    assert result.status == "final" and len(fake.requests) == 3
    gaps = [b.at - a.at for a, b in zip(fake.requests, fake.requests[1:], strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # 0.05 s, then doubled


def test_a_400_is_never_retried(tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    fake.reply(400, api_error("invalid_request_error", "messages: bad"))
    model = AnthropicModel(client, MODEL, retry=bl.RetryPolicy(3, 0.0))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
    assert result.status == "model_error" and len(fake.requests) == 1


def test_no_retry_delay_ends_past_the_deadline(tmp_path: Path, fake: FakeProvider,
                                               client: Any) -> None:
    fake.reply(429, api_error("rate_limit_error", "rate limited"),
               headers={"retry-after": "5"})
    fake.reply(200, message([text("too late")], "end_turn"))
    model = AnthropicModel(client, MODEL, retry=bl.RetryPolicy(3, 0.1))
    started = time.monotonic()
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go", budget=bl.Budget(deadline_s=2))
    assert result.status == "model_error"  # raised at once instead of sleeping past it
    assert time.monotonic() - started < 1.5
    assert len(fake.requests) == 1 and fake.pending == 1


def test_the_http_call_is_bounded_by_the_deadline(fake: FakeProvider, client: Any) -> None:
    fake.reply(200, message([text("slow")], "end_turn"), delay_s=5)
    model = AnthropicModel(client, MODEL)
    ctx = bl.ModelContext("run-1", 1, True, [], bl.Remaining(5, 5), time.monotonic() + 0.5,
                          bl.CancelToken())
    started = time.monotonic()
    with pytest.raises(anthropic.APITimeoutError):
        model([bl.UserMessage("go")], ctx)
    assert time.monotonic() - started < 2.0
    assert float(fake.requests[0].headers["x-stainless-timeout"]) <= 0.5
    assert len(fake.requests) == 1


# --- tool names and schemas --------------------------------------------------------------

def test_names_outside_the_api_limits_are_mapped_and_back(tmp_path: Path, fake: FakeProvider,
                                                          client: Any) -> None:
    ran: list[str] = []
    search = bl.Tool("web.search", lambda q: ran.append(q) or "found", read_only=True)
    first_name: list[str] = []

    def answer(request: Any) -> tuple[int, dict[str, str], Any]:
        first_name.append(request.body["tools"][0]["name"])
        return 200, {}, message([tool_use("toolu_01", first_name[0], {"q": "boundloop"})],
                                "tool_use")

    fake.reply_with(answer)
    fake.reply(200, message([text("done")], "end_turn"))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=AnthropicModel(client, MODEL), tools=[search], prompt="go")
    assert result.status == "final" and ran == ["boundloop"]
    assert first_name[0].startswith("web_search_") and len(first_name[0]) <= 64
    call = next(m for m in result.transcript if m.kind == "call")
    assert call.name == "web.search"
    sent = bodies(fake)[1]["messages"][1]["content"][0]
    assert sent["name"] == first_name[0]


class Point(msgspec.Struct):
    x: int
    y: int


def test_refs_are_inlined_in_input_schema(tmp_path: Path, fake: FakeProvider,
                                          client: Any) -> None:
    @bl.tool(read_only=True)
    def plot(points: list[Point], label: str = "") -> str:
        """Plot points."""
        return "ok"

    fake.reply(200, message([text("fine")], "end_turn"))
    with bl.Runner(tmp_path / "j") as runner:
        runner.run(model=AnthropicModel(client, MODEL), tools=[plot], prompt="go")
    schema = bodies(fake)[0]["tools"][0]["input_schema"]
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    assert schema["type"] == "object"
    item = schema["properties"]["points"]["items"]
    assert item["type"] == "object" and set(item["properties"]) == {"x", "y"}


# --- the async client ----------------------------------------------------------------------

def test_async_client_runs_through_arun(tmp_path: Path, fake: FakeProvider,
                                        tools: tuple[bl.Tool, bl.Tool]) -> None:
    fake.reply(200, message([tool_use("toolu_01", "get_weather", {"city": "Oslo"})],
                            "tool_use"))
    fake.reply(200, message([text("Oslo: 21°C")], "end_turn"))

    async def main() -> bl.RunResult:
        async with anthropic.AsyncAnthropic(api_key="test", base_url=fake.url) as aclient:
            model = AnthropicModel(aclient, MODEL, retry=bl.RetryPolicy(2, 0.05))
            assert isinstance(model, AsyncAnthropicModel)
            assert inspect.iscoroutinefunction(model.__call__)
            runner = bl.Runner(tmp_path / "j")
            if hasattr(runner, "arun"):
                async with runner:
                    return await runner.arun(model=model, tools=list(tools), prompt="Oslo?")
            # Before ``arun`` exists: the runner awaits async models on its own loop; the
            # client (bound to this loop) is then driven by a fresh one per request.
            with runner:  # pragma: no cover - depends on the runner's version
                return await asyncio.to_thread(runner.run, model=model, tools=list(tools),
                                               prompt="Oslo?")

    result = asyncio.run(main())
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert all(r.headers["x-stainless-async"].startswith("async") for r in fake.requests)
    assert bodies(fake)[1]["messages"][2]["content"][0]["tool_use_id"] == "toolu_01"


# --- the request on its own: final-only without tools, system blocks, extra tools --------

def ctx_of(tools: list[dict[str, Any]], allowed: bool, deadline: float | None = None
           ) -> bl.ModelContext:
    return bl.ModelContext("run-1", 1, allowed, tools, bl.Remaining(5, 5), deadline,
                           bl.CancelToken())


def test_request_shapes(client: Any) -> None:
    spec = {"name": "get_weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    server = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    model = AnthropicModel(client, MODEL, system=[{"type": "text", "text": "A"},
                                                  {"type": "text", "text": "B"}],
                           cache=True, tools=[server], tool_choice={"type": "any"},
                           temperature=0.2)
    kwargs, _ = model.request([bl.UserMessage("hi")], ctx_of([spec], True))
    assert kwargs["system"] == [{"type": "text", "text": "A"},
                                {"type": "text", "text": "B",
                                 "cache_control": {"type": "ephemeral"}}]
    assert [t["name"] for t in kwargs["tools"]] == ["get_weather", "web_search"]
    assert kwargs["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert kwargs["tool_choice"] == {"type": "any"} and kwargs["temperature"] == 0.2
    kwargs, _ = model.request([bl.UserMessage("hi")], ctx_of([spec], False))
    assert kwargs["tool_choice"] == {"type": "none"}  # overrides the user's choice
    # No tools at all: neither tools nor tool_choice (the API refuses a choice alone).
    plain = AnthropicModel(client, MODEL, system="S")
    kwargs, _ = plain.request([bl.UserMessage("hi")], ctx_of([], False))
    assert "tools" not in kwargs and "tool_choice" not in kwargs and kwargs["system"] == "S"
    assert kwargs["messages"] == [{"role": "user", "content": [text("hi")]}]
    # The output maximum: one past what the run has left, above any thinking budget.
    low = bl.ModelContext("run-1", 1, True, [], bl.Remaining(5, 5, output_tokens=99), None,
                          bl.CancelToken())
    assert plain.request([bl.UserMessage("hi")], low)[0]["max_tokens"] == 100
    thinking = AnthropicModel(client, MODEL, max_tokens=4096,
                              thinking={"type": "enabled", "budget_tokens": 2048})
    assert thinking.request([bl.UserMessage("hi")], low)[0]["max_tokens"] == 2049


# --- the example script, against the fake --------------------------------------------------

def test_example_runs_against_the_fake(fake: FakeProvider) -> None:
    fake.reply(200, message([text("Checking both."),
                             tool_use("toolu_01", "get_weather", {"city": "Paris"}),
                             tool_use("toolu_02", "get_local_time", {"city": "Tokyo"})],
                            "tool_use"))
    fake.reply(200, message([text("Paris: 21°C, clear; Tokyo: 21:05.")], "end_turn"))
    example = Path(__file__).resolve().parents[1] / "examples" / "anthropic_tools.py"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("ANTHROPIC")}
    env.update(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake.url)
    out = subprocess.run([sys.executable, str(example)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "status: final" in out.stdout and "answer: Paris: 21°C" in out.stdout
    assert len(fake.requests) == 2 and bodies(fake)[1]["messages"][2]["role"] == "user"


# --- the shared helpers (boundloop.models._common) -----------------------------------------

def test_common_helpers() -> None:
    from boundloop.models import _common as c

    assert c.retry_after_s({"retry-after": "2"}) == 2.0
    assert c.retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert c.retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert c.retry_after_s({"retry-after": "soon"}) is None and c.retry_after_s(None) is None
    assert [c.transient_status(s) for s in (400, 401, 408, 409, 429, 500, 529)] == [
        False, False, True, True, True, True, True]
    with pytest.raises(c.DeadlinePassed):
        c.request_timeout(time.monotonic() - 1)
    assert c.request_timeout(None) is None and c.request_timeout(None, 5.0) == 5.0
    left = c.request_timeout(time.monotonic() + 10)
    assert left is not None and 9 < left <= 10
    assert c.safe_tool_name("ok-name_1") == "ok-name_1"
    assert c.safe_tool_name("a.b") != c.safe_tool_name("a/b")
    assert len(c.safe_tool_name("x" * 100)) == 64
    recursive = {"$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}},
        "type": "object", "properties": {"t": {"$ref": "#/$defs/T"}}}
    schema = c.provider_schema(recursive)
    assert schema["properties"]["t"]["properties"]["kids"]["items"] == {}
    assert c.provider_schema(None) == {"type": "object", "properties": {}}
    with pytest.raises(bl.ConfigError, match="object"):
        c.provider_schema({"type": "array"}, tool="t")
    assert c.make_usage(None, 5, -1, "x").output_tokens == 5


def test_retry_delay_is_cut_short_by_cancellation() -> None:
    from boundloop.models import _common as c

    class Busy(Exception):
        status_code = 429
        response = type("R", (), {"headers": {"retry-after": "30"}})()

    token = bl.CancelToken()
    calls: list[float | None] = []

    def send(timeout: float | None) -> str:
        calls.append(timeout)
        token.cancel("stop")  # cancelled during the first attempt
        raise Busy()

    started = time.monotonic()
    with pytest.raises(Busy):
        c.call_with_retry(send, retry=bl.RetryPolicy(3, 0.0), deadline=None,
                          transient=lambda e: c.transient_status(c.status_of(e)), cancel=token)
    assert len(calls) == 1 and time.monotonic() - started < 1.0

    async def main() -> None:
        async def asend(timeout: float | None) -> str:
            raise Busy()

        token2 = bl.CancelToken()
        asyncio.get_running_loop().call_later(0.1, token2.cancel)
        with pytest.raises(Busy):
            await c.acall_with_retry(asend, retry=bl.RetryPolicy(3, 0.0), deadline=None,
                                     transient=lambda e: True, cancel=token2)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 1.0


# --- streaming (stream=True) ----------------------------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # 2,700 characters
SMALL_RESERVATION = bl.Usage(input_tokens=10)  # reserve no output: the stream is the limit


def streamed(body: dict[str, Any], **kwargs: Any) -> list[Any]:
    return anthropic_sse(body, **kwargs)


@pytest.mark.parametrize("body", [
    message([text("Paris is 21°C.")], "end_turn", cache_read=40),
    message([{"type": "thinking", "thinking": "The user wants weather.", "signature": "EqQB=="},
             text("Checking."),
             tool_use("toolu_01", "get_weather", {"city": "Paris", "days": [1, 2]}),
             tool_use("toolu_02", "get_time", {"tz": "Europe/Paris"})], "tool_use",
            cache_write=300),
    message([text("It was a long")], "max_tokens"),
    message([], "refusal"),
], ids=["final", "thinking-and-calls", "max_tokens", "refusal"])
def test_stream_and_non_stream_give_the_same_response(fake: FakeProvider, client: Any,
                                                      body: dict[str, Any]) -> None:
    fake.reply(200, body)
    fake.stream(streamed(body, chunk=5))
    spec = [{"name": "get_weather", "parameters": {}}, {"name": "get_time", "parameters": {}}]
    plain = AnthropicModel(client, MODEL, price=PRICE)(
        [bl.UserMessage("hi")], ctx_of(spec, True))
    deltas: list[str] = []
    model = AnthropicModel(client, MODEL, price=PRICE, stream=True,
                           on_text=lambda d, ctx: deltas.append(d))
    assert model([bl.UserMessage("hi")], ctx_of(spec, True)) == plain
    first, second = bodies(fake)
    assert second == {**first, "stream": True}
    assert "".join(deltas) == "".join(b["text"] for b in body["content"] if b["type"] == "text")


def test_a_streamed_run_sends_text_in_order_and_charges_the_final_usage(
        tmp_path: Path, fake: FakeProvider, client: Any,
        tools: tuple[bl.Tool, bl.Tool]) -> None:
    fake.stream(streamed(message([text("Let me look that up."),
                                  tool_use("toolu_01", "get_weather", {"city": "Oslo"})],
                                 "tool_use", input_tokens=300, output_tokens=40)))
    fake.stream(streamed(message([text("Oslo is 21°C and clear.")], "end_turn",
                                 input_tokens=350, output_tokens=12, msg_id="msg_2")))
    seen: list[tuple[str, str, int]] = []
    model = AnthropicModel(client, MODEL, stream=True,
                           on_text=lambda d, ctx: seen.append((d, ctx.run_id, ctx.step)))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=list(tools), prompt="Oslo?")
        journal_of(runner, result)
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert result.usage == bl.Usage(input_tokens=650, output_tokens=52)
    assert {run for _, run, _ in seen} == {result.run_id}
    by_step = {s: "".join(d for d, _, step in seen if step == s) for s in (1, 2)}
    assert by_step == {1: "Let me look that up.", 2: "Oslo is 21°C and clear."}
    assert [len(d) for d, _, _ in seen][:2] == [8, 8]  # deltas, not whole blocks
    assert all(b["stream"] is True for b in bodies(fake))


def test_a_stream_is_cut_at_the_runs_output_limit(tmp_path: Path, fake: FakeProvider,
                                                  client: Any) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn", output_tokens=700)),
                      gap_s=0.002)
    deltas: list[str] = []
    model = AnthropicModel(client, MODEL, max_tokens=1024, price=PRICE, stream=True,
                           on_text=lambda d, ctx: deltas.append(d))
    with bl.Runner(tmp_path / "j", estimator=lambda h, m: SMALL_RESERVATION) as runner:
        result = runner.run(model=model, prompt="go",
                            budget=bl.Budget(max_output_tokens=50, malformed_retries=2))
        names, events = journal_of(runner, result)
    assert (result.status, result.exhausted_limit, result.model_steps) == (
        "limit_exceeded", "output_tokens", 1)
    assert "cut while it streamed" in result.explanation
    # The request asked for one token past what the run had left, and was cut: the
    # server saw the connection closed long before its last event.
    assert bodies(fake)[0]["max_tokens"] == 51
    assert log.done.wait(5) and log.aborted and log.sent < log.total
    # The step is charged what streamed: the input reported at message_start, the output
    # counted from the text (4 characters a token), just past the limit.
    charge = [e for e in events if type(e).__name__ == "UsageCharged"]
    assert len(charge) == 1 and not charge[0].estimated
    assert charge[0].usage.input_tokens == 100 and 50 < charge[0].usage.output_tokens <= 53
    assert result.usage == charge[0].usage
    assert result.usage.cost == pytest.approx(PRICE.cost(charge[0].usage))
    assert 200 < len("".join(deltas)) <= 212 and LONG.startswith("".join(deltas))


def test_a_stream_is_cut_at_the_total_limit_less_the_reported_input(
        tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn", input_tokens=900,
                                       cache_read=60)), gap_s=0.002)
    model = AnthropicModel(client, MODEL, stream=True)
    with bl.Runner(tmp_path / "j", estimator=lambda h, m: SMALL_RESERVATION) as runner:
        result = runner.run(model=model, prompt="go", budget=bl.Budget(max_total_tokens=1000))
        journal_of(runner, result)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "total_tokens")
    assert result.usage.input_tokens == 900 and result.usage.cache_read_tokens == 60
    assert 40 < result.usage.output_tokens <= 43  # 1000 - 960 = 40 tokens of room
    assert log.done.wait(5) and log.aborted


def test_the_deadline_cuts_a_stream(tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn")), gap_s=0.02)
    model = AnthropicModel(client, MODEL, stream=True)
    started = time.monotonic()
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go", budget=bl.Budget(deadline_s=0.5))
        journal_of(runner, result)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert time.monotonic() - started < 2.0
    assert log.done.wait(5) and log.aborted and log.sent < log.total


def test_cancelling_the_run_cuts_a_stream(tmp_path: Path, fake: FakeProvider,
                                          client: Any) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn")), gap_s=0.002)

    def on_text(delta: str, ctx: bl.ModelContext) -> None:
        ctx.cancel.cancel("the user closed the tab")

    model = AnthropicModel(client, MODEL, stream=True, on_text=on_text)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
        journal_of(runner, result)
    assert result.status == "cancelled" and result.model_steps == 1
    assert log.done.wait(5) and log.aborted


def test_an_on_text_that_raises_ends_the_step_as_a_model_error(
        tmp_path: Path, fake: FakeProvider, client: Any) -> None:
    fake.stream(streamed(message([text("Hello there")], "end_turn")))

    def on_text(delta: str, ctx: bl.ModelContext) -> None:
        raise ValueError("the socket to the browser is gone")

    model = AnthropicModel(client, MODEL, stream=True, on_text=on_text,
                           retry=bl.RetryPolicy(3, 0.01))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
    assert result.status == "model_error" and len(fake.requests) == 1  # never retried
    assert "on_text" in result.explanation and "socket to the browser" in result.explanation


def test_a_stream_that_fails_to_open_is_retried(tmp_path: Path, fake: FakeProvider,
                                                client: Any) -> None:
    fake.reply(529, api_error("overloaded_error", "Overloaded"),
               headers={"retry-after-ms": "20"})
    fake.stream(streamed(message([text("Fine.")], "end_turn")))
    model = AnthropicModel(client, MODEL, stream=True, retry=bl.RetryPolicy(2, 0.01))
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, prompt="go")
    assert (result.status, len(fake.requests)) == ("final", 2)
    assert result.transcript[-1] == bl.FinalMessage("Fine.")


def test_streaming_arguments_are_checked(client: Any) -> None:
    with pytest.raises(bl.ConfigError, match="on_text needs stream=True"):
        AnthropicModel(client, MODEL, on_text=print)
    with pytest.raises(bl.ConfigError, match="async on_text needs an async client"):
        async def on_text(delta: str, ctx: bl.ModelContext) -> None: ...
        AnthropicModel(client, MODEL, stream=True, on_text=on_text)
    with pytest.raises(bl.ConfigError, match="stream must be True or False"):
        AnthropicModel(client, MODEL, stream="yes")  # type: ignore[arg-type]


def test_an_async_stream_feeds_a_text_stream_through_arun(
        tmp_path: Path, fake: FakeProvider, tools: tuple[bl.Tool, bl.Tool]) -> None:
    fake.stream(streamed(message([text("One moment."),
                                  tool_use("toolu_01", "get_weather", {"city": "Oslo"})],
                                 "tool_use")))
    fake.stream(streamed(message([text("Oslo: 21°C.")], "end_turn")))

    async def main() -> tuple[bl.RunResult, list[bl.TextDelta]]:
        async with anthropic.AsyncAnthropic(api_key="test", base_url=fake.url) as aclient:
            text_stream = bl.TextStream()
            model = AnthropicModel(aclient, MODEL, stream=True, on_text=text_stream)
            assert isinstance(model, AsyncAnthropicModel)
            async with bl.Runner(tmp_path / "j") as runner:
                async def run() -> bl.RunResult:
                    try:
                        return await runner.arun(model=model, tools=list(tools),
                                                 prompt="Oslo?")
                    finally:
                        text_stream.close()

                task = asyncio.create_task(run())
                got = [delta async for delta in text_stream]
                return await task, got

    result, got = asyncio.run(main())
    assert result.status == "final" and result.transcript[-1] == bl.FinalMessage("Oslo: 21°C.")
    assert ["".join(d.text for d in got if d.step == s) for s in (1, 2)] == [
        "One moment.", "Oslo: 21°C."]
    assert {d.run_id for d in got} == {result.run_id}


def test_an_async_stream_that_stalls_is_cut_at_the_deadline(tmp_path: Path,
                                                             fake: FakeProvider) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn"), chunk=400),
                      stall=(3, 2.0))  # message_start, block start, 400 characters, a stall
    seen: list[str] = []

    async def on_text(delta: str, ctx: bl.ModelContext) -> None:
        seen.append(delta)

    async def main() -> bl.RunResult:
        async with anthropic.AsyncAnthropic(api_key="test", base_url=fake.url) as aclient:
            model = AnthropicModel(aclient, MODEL, stream=True, on_text=on_text)
            async with bl.Runner(tmp_path / "j") as runner:
                return await runner.arun(model=model, prompt="go",
                                         budget=bl.Budget(deadline_s=0.4))

    started = time.monotonic()
    result = asyncio.run(main())
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert time.monotonic() - started < 1.5 and seen == [LONG[:400]]
    assert log.done.wait(5) and log.aborted and log.sent < log.total


def test_streamed_tool_input_that_is_not_json_is_malformed(tmp_path: Path, fake: FakeProvider,
                                                          client: Any,
                                                          tools: tuple[bl.Tool, bl.Tool]
                                                          ) -> None:
    events = streamed(message([text("Looking."),
                               tool_use("toolu_01", "get_weather", {"city": "Paris"})],
                              "tool_use"))
    for _, data in events:  # the provider sends input that is not JSON
        if data.get("delta", {}).get("type") == "input_json_delta":
            data["delta"]["partial_json"] = data["delta"]["partial_json"].replace('"P', "P")
    fake.stream(events)
    model = AnthropicModel(client, MODEL, stream=True)
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=model, tools=list(tools), prompt="Paris?")
        journal_of(runner, result)
    assert result.status == "malformed_response" and result.tool_calls == 0
    assert "call 1 (`get_weather`) has arguments that are not valid JSON" in result.explanation


def test_a_priced_stream_is_cut_at_the_runs_cost_limit(tmp_path: Path, fake: FakeProvider,
                                                       client: Any) -> None:
    log = fake.stream(streamed(message([text(LONG)], "end_turn", input_tokens=100)),
                      gap_s=0.002)
    model = AnthropicModel(client, MODEL, price=PRICE, stream=True)
    # 100 input tokens cost 0.0003; the rest buys about 50 output tokens at 15 per million.
    budget = bl.Budget(max_cost=0.0003 + 50 * 15 / 1e6)
    with bl.Runner(tmp_path / "j", estimator=lambda h, m: SMALL_RESERVATION) as runner:
        result = runner.run(model=model, prompt="go", budget=budget)
        journal_of(runner, result)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "cost")
    assert "output tokens its cost limit left were spent" in result.explanation
    assert result.usage.cost is not None and result.usage.cost > budget.max_cost
    assert 49 < result.usage.output_tokens <= 53
    assert log.done.wait(5) and log.aborted


def test_a_sync_stream_that_stalls_ends_at_the_deadline(tmp_path: Path, fake: FakeProvider,
                                                        client: Any) -> None:
    # Each read of a sync stream is bounded by the time left when the request was sent.
    log = fake.stream(streamed(message([text(LONG)], "end_turn"), chunk=400),
                      stall=(3, 1.5))
    started = time.monotonic()
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=AnthropicModel(client, MODEL, stream=True), prompt="go",
                            budget=bl.Budget(deadline_s=0.4))
        journal_of(runner, result)
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "deadline")
    assert time.monotonic() - started < 1.2
    assert log.done.wait(5) and log.aborted and log.sent == 3
