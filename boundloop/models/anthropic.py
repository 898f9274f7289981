"""AnthropicModel: a boundloop model callable on the Anthropic Messages API (SPEC 13).

Extra ``boundloop[anthropic]`` (the official ``anthropic`` SDK)::

    import anthropic
    from boundloop.models.anthropic import AnthropicModel

    model = AnthropicModel(anthropic.Anthropic(), "claude-sonnet-4-5", max_tokens=1024)
    runner.run(model=model, tools=[...], prompt="...")

With an ``anthropic.AsyncAnthropic`` client the adapter is an ``AsyncAnthropicModel``
(a subclass with an ``async def __call__``): ``runner.arun`` runs it on the caller's loop.

What it sends, each step:

* ``messages`` rebuilt from the history: user and notice texts as user text blocks (adjacent
  ones merged, so roles alternate); an earlier final answer as an assistant text turn; one
  assistant message per model step holding the step's blocks (the provider ``content`` the
  adapter stored on that step: thinking and redacted_thinking blocks with their signatures,
  text, server-tool blocks, verbatim and in order), and a ``tool_use`` block for every call
  of the step, then ONE user message with a ``tool_result`` for each call, paired by
  ``tool_use_id`` (``is_error: true`` for every status but ``ok``, the status named in the
  text; a result that is not a string is sent as JSON; a call without a recorded result is
  sent as an error result saying so). A tool_use block's ``name`` and ``input`` always come
  from the history's call message, so arguments are never duplicated in ``content`` (they
  are journaled once, redacted by the runner).
* ``tools`` as ``{"name", "description", "input_schema"}``: ``$ref`` inlined, root an object.
  A tool name outside ``^[a-zA-Z0-9_-]{1,64}$`` is sent as a stable stand-in
  (``web.search`` → ``web_search_<digest>``) and mapped back in the response.
* On a step where ``ctx.tools_allowed`` is False: the same ``tools`` (the API requires tool
  definitions when the messages hold tool_use blocks, and a cached prefix stays valid) with
  ``tool_choice={"type": "none"}``, so the model cannot call one.
* A per-request ``timeout`` of the time left before ``ctx.deadline``, on a copy of the client
  with ``max_retries=0`` (the SDK's own retries would not respect the deadline).
* With ``cache=True``: ``cache_control={"type": "ephemeral"}`` on the system prompt's last
  block, the last tool, and the last content block of the last user message.

What it returns: ``end_turn``/``stop_sequence`` → ``bl.Final`` (text blocks joined);
``tool_use`` → ``bl.CallTools`` with the step's text and its full content blocks as
``content``; ``max_tokens``, ``refusal``, ``pause_turn``, ``model_context_window_exceeded``
(and any other stop reason) → ``bl.Malformed`` naming it. Tool input that is not an
object (a string from a proxy or a streaming accumulator) is decoded if it is JSON, else
passed on as the raw string (the runner reports the call's arguments malformed). Usage maps
``input_tokens``, ``output_tokens``, ``cache_creation_input_tokens`` (→ cache_write) and
``cache_read_input_tokens`` (→ cache_read), priced by ``price``.

Errors: timeouts, connection errors, 408/409/429 and 5xx (529 overloaded included) raise (the
step ends ``model_error``) unless ``retry`` is given, in which case they are retried within
the step after ``Retry-After``/``retry-after-ms`` (else the policy's backoff), never past
``ctx.deadline``. Other API errors (400, 401, ...) always raise.

The output maximum sent is ``max_tokens``, or one token past what the run has left of its
output tokens (``ctx.remaining.output_tokens``) when that is less: a turn that would overrun
the run's budget is stopped by the API just past it, and the run ends ``limit_exceeded``.

Streaming (``stream=True``): the request goes through ``messages.stream`` and the response is
the one above, read from the stream's accumulated message (thinking blocks and signatures,
tool input JSON joined from its deltas, the usage of ``message_delta``). Each text delta is
given to ``on_text(delta, ctx)`` as it comes. The output is counted as it streams (the
``message_delta`` running count where given, else 4 characters a token of text, tool input
and thinking); once the turn has said more than the run has left of its output tokens (or of
its total tokens, less the input ``message_start`` reports; or than its remaining cost buys,
with a ``price``), the stream is closed, cutting the HTTP request, and the turn is returned
as ``bl.Malformed`` with the usage so far: the runner charges it and ends the run
``limit_exceeded``. Cancelling the run cuts the stream (the run
ends ``cancelled``), and so does its deadline (``limit_exceeded(deadline)``). A stream that
fails before any text was delivered is retried like a request; after, it is not. If
``on_text`` raises, the step ends as a model error naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from boundloop.context import ModelContext
from boundloop.core.budget import Usage
from boundloop.errors import ConfigError
from boundloop.messages import CallTools, Final, Malformed, ToolCall
from boundloop.models._anthropic_messages import EPHEMERAL as EPHEMERAL
from boundloop.models._anthropic_messages import _arguments as _arguments
from boundloop.models._anthropic_messages import _mark_last_user_block, _stored_block
from boundloop.models._anthropic_messages import assistant_blocks as assistant_blocks
from boundloop.models._anthropic_messages import messages_from_history as messages_from_history
from boundloop.models._anthropic_messages import tool_result_block as tool_result_block
from boundloop.models._common import (
    ToolNames,
    acall_with_retry,
    call_with_retry,
    make_usage,
    malformed,
    provider_schema,
    require_sdk,
    response_info,
    status_of,
    transient_status,
)
from boundloop.models._stream import (
    Cut,
    OnText,
    StreamMeter,
    apump,
    cancelled_reason,
    capped_max_tokens,
    check_on_text,
    pump,
    stream_transient,
)
from boundloop.pricing import PriceOption, check_price
from boundloop.tools import RetryPolicy

__all__ = ["AnthropicModel", "AsyncAnthropicModel"]

#: Arguments of ``messages.create`` the adapter sets itself (refused in ``**extra``).
_RESERVED = frozenset({"messages", "model", "max_tokens", "system", "stream", "timeout"})
#: Stop reasons that end a turn without a usable answer, and what the reason says.
_STOPS = {
    "max_tokens": "the model reached its output limit (max_tokens={max_tokens}) before it "
                  "finished its turn (stop reason `max_tokens`)",
    "refusal": "the model refused to answer (stop reason `refusal`{detail})",
    "pause_turn": "the provider paused a long-running turn (stop reason `pause_turn`), and "
                  "the adapter does not continue paused turns",
    "model_context_window_exceeded": "the conversation no longer fits the model's context "
                                     "window (stop reason `model_context_window_exceeded`)",
}


def _sdk() -> Any:
    return require_sdk("anthropic", "anthropic", what="AnthropicModel")


def _is_async_client(sdk: Any, client: Any) -> bool:
    if isinstance(client, sdk.AsyncAnthropic):
        return True
    create = getattr(getattr(client, "messages", None), "create", None)
    return inspect.iscoroutinefunction(create)


class AnthropicModel:
    """A model callable ``model(history, ctx)`` on the Anthropic Messages API.

    Args:
        client: an ``anthropic.Anthropic`` (sync model) or ``anthropic.AsyncAnthropic``
            (the constructor then returns an :class:`AsyncAnthropicModel`).
        model: the model name, e.g. ``"claude-sonnet-4-5"``.
        max_tokens: the output maximum of each request; also ``max_output_tokens``, the
            output part of each step's budget reservation.
        system: the system prompt, a string or a list of text blocks.
        price: a ``bl.Price`` to compute each step's cost from its usage, or ``"auto"``:
            the runner prices each step from the genai-prices catalogue
            (``boundloop[prices]``) for the model the response reports.
        retry: a ``bl.RetryPolicy`` for transient provider errors (see the module doc);
            None: they end the step as a model error.
        cache: mark the system prompt, the last tool and the last user block for prompt
            caching.
        stream: use the streaming Messages API (``messages.stream``): the same response,
            assembled from the stream's events; text deltas go to ``on_text`` as they come,
            and the stream is cut once the turn has said more than the run has left of its
            output (or total) tokens, or the run is cancelled, or its deadline passes
            (see the module doc).
        on_text: with ``stream=True``, ``on_text(delta, ctx)`` gets each piece of text
            (``ctx`` is the step's ``bl.ModelContext``: ``run_id``, ``step``); with an
            async client it may be ``async``. A ``bl.TextStream`` is one, for
            ``async for``. If it raises, the step ends as a model error naming it.
        **extra: more arguments of ``messages.create`` (``temperature``, ``thinking``,
            ``metadata``, ``stop_sequences``, ``extra_headers``, ...). ``tools`` given here
            (e.g. server tools) are sent after the runner's; ``tool_choice`` is used on
            steps where tools are allowed.

    Raises:
        ConfigError: the ``anthropic`` SDK is not installed (extra ``boundloop[anthropic]``),
            or an argument is invalid.
    """

    max_output_tokens: int
    #: ``gen_ai.provider.name`` of its ``chat`` spans (OpenTelemetry GenAI conventions).
    provider = "anthropic"

    def __new__(cls, client: Any, *args: Any, **kwargs: Any) -> AnthropicModel:
        sdk = _sdk()
        if cls is AnthropicModel and _is_async_client(sdk, client):
            return object.__new__(AsyncAnthropicModel)
        return object.__new__(cls)

    def __init__(self, client: Any, model: str, max_tokens: int = 1024,
                 system: str | list[dict[str, Any]] | None = None,
                 price: PriceOption = None,
                 retry: RetryPolicy | None = None, cache: bool = False,
                 stream: bool = False, on_text: OnText | None = None,
                 **extra: Any) -> None:
        self._anthropic = _sdk()
        if not isinstance(model, str) or not model:
            raise ConfigError(f"AnthropicModel: model must be a model name, got {model!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"AnthropicModel: max_tokens must be a whole number of at "
                              f"least 1, got {max_tokens!r}")
        if system is not None and not isinstance(system, str) and not (
                isinstance(system, list) and all(isinstance(b, Mapping) for b in system)):
            raise ConfigError("AnthropicModel: system must be a string or a list of text "
                              f"blocks (dicts), got {type(system).__name__}")
        price = check_price(price, "AnthropicModel")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"AnthropicModel: retry must be a bl.RetryPolicy, got "
                              f"{type(retry).__name__}")
        reserved = sorted(_RESERVED.intersection(extra))
        if reserved:
            raise ConfigError(f"AnthropicModel: `{reserved[0]}` is set by the adapter and "
                              "cannot be given as an extra argument")
        if "tools" in extra and not isinstance(extra["tools"], list):
            raise ConfigError("AnthropicModel: extra `tools` must be a list of tool dicts")
        if not isinstance(stream, bool):
            raise ConfigError(f"AnthropicModel: stream must be True or False, got {stream!r}")
        if on_text is not None and not stream:
            raise ConfigError("AnthropicModel: on_text needs stream=True")
        self.on_text = check_on_text(on_text, is_async=isinstance(self, AsyncAnthropicModel),
                                     name="AnthropicModel")
        self.stream = stream
        self.client = client
        # The SDK's own retries would not know the run's deadline: the adapter retries.
        with_options = getattr(client, "with_options", None)
        self._client = with_options(max_retries=0) if callable(with_options) else client
        self.model = model
        self.max_tokens = max_tokens
        self.max_output_tokens = max_tokens
        self.system = system
        self.price = price
        self.retry = retry
        self.cache = bool(cache)
        self.extra = dict(extra)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, max_tokens={self.max_tokens})"

    # --- the call ----------------------------------------------------------------------

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    def __call__(self, history: list[Any], ctx: ModelContext) -> CallTools | Final | Malformed:
        kwargs, names = self.request(history, ctx)
        if self.stream:
            return self._streamed(kwargs, names, ctx)
        create = self._client.messages.create

        def send(timeout: float | None) -> Any:
            return create(**kwargs) if timeout is None else create(**kwargs, timeout=timeout)

        message = call_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                  transient=self.transient, cancel=ctx.cancel)
        return self.response(message, names, max_tokens=kwargs["max_tokens"])

    def _streamed(self, kwargs: dict[str, Any], names: ToolNames, ctx: ModelContext
                  ) -> CallTools | Final | Malformed:
        meter = StreamMeter(ctx, kwargs, self.price)
        open_stream = self._client.messages.stream

        def send(timeout: float | None) -> tuple[Cut | None, Any, _Reader]:
            meter.reset()
            reader = _Reader(meter)
            options = kwargs if timeout is None else {**kwargs, "timeout": timeout}
            with open_stream(**options) as stream:
                try:
                    cut = pump(stream, reader.read, ctx, meter, self.on_text)
                except ValueError as exc:
                    reader.failed(exc)
                    return None, None, reader
                return cut, stream.current_message_snapshot if reader.started else None, reader

        cut, message, reader = call_with_retry(
            send, retry=self.retry, deadline=ctx.deadline,
            transient=stream_transient(meter, self.transient), cancel=ctx.cancel)
        return self.stream_result(cut, message, names, meter, kwargs, reader.bad_input)

    def stream_result(self, cut: Cut | None, message: Any, names: ToolNames,
                      meter: StreamMeter, kwargs: Mapping[str, Any],
                      bad_input: str | None = None) -> CallTools | Final | Malformed:
        """The boundloop response for a stream that ended (``cut`` None: its accumulated
        message, as :meth:`response` reads it), or was cut at the run's token limit (a
        malformed turn with the usage counted so far) or by cancellation, or stopped at tool
        input that is not JSON (``bad_input``: a malformed turn saying so; its reservation
        stands)."""
        if bad_input is not None:
            return malformed(bad_input)
        if cut == "cancelled":
            return malformed(cancelled_reason())
        if cut == "limit":
            return meter.cut(self.price)
        return self.response(message, names, max_tokens=kwargs["max_tokens"])

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a provider error worth retrying: a timeout or connection
        error, or an API status of 408, 409, 429 or 5xx (529, overloaded, included)."""
        sdk = self._anthropic
        if isinstance(exc, sdk.APIConnectionError):
            return True
        return isinstance(exc, sdk.APIStatusError) and transient_status(status_of(exc))

    # --- the request -------------------------------------------------------------------

    def request(self, history: list[Any], ctx: ModelContext) -> tuple[dict[str, Any], ToolNames]:
        """The keyword arguments of ``messages.create`` for this step (without ``timeout``),
        and the tool-name mapping used to read the response."""
        names = ToolNames([str(t.get("name", "")) for t in ctx.tools])
        kwargs: dict[str, Any] = {k: v for k, v in self.extra.items()
                                  if k not in ("tools", "tool_choice")}
        kwargs["model"] = self.model
        kwargs["max_tokens"] = capped_max_tokens(self.max_tokens, ctx,
                                                 floor=self._thinking_budget() + 1)
        system = self._system()
        if system is not None:
            kwargs["system"] = system
        tools = [self._tool(t, names) for t in ctx.tools]
        tools += [dict(t) for t in self.extra.get("tools") or ()]
        if tools:
            if self.cache:
                tools[-1] = {**tools[-1], "cache_control": dict(EPHEMERAL)}
            kwargs["tools"] = tools
            if not ctx.tools_allowed:
                kwargs["tool_choice"] = {"type": "none"}
            elif "tool_choice" in self.extra:
                kwargs["tool_choice"] = self.extra["tool_choice"]
        messages = messages_from_history(history, names)
        if self.cache:
            _mark_last_user_block(messages)
        kwargs["messages"] = messages
        return kwargs, names

    def _thinking_budget(self) -> int:
        """The ``budget_tokens`` of extended thinking, if enabled (the API wants
        ``max_tokens`` above it), else 0."""
        thinking = self.extra.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, Mapping) else None
        return budget if isinstance(budget, int) and not isinstance(budget, bool) else 0

    def _system(self) -> str | list[dict[str, Any]] | None:
        if self.system is None:
            return None
        if isinstance(self.system, str):
            if not self.cache:
                return self.system
            return [{"type": "text", "text": self.system, "cache_control": dict(EPHEMERAL)}]
        blocks = [dict(b) for b in self.system]
        if self.cache and blocks:
            blocks[-1]["cache_control"] = dict(EPHEMERAL)
        return blocks

    @staticmethod
    def _tool(spec: Mapping[str, Any], names: ToolNames) -> dict[str, Any]:
        name = str(spec.get("name", ""))
        tool: dict[str, Any] = {"name": names.to_provider(name)}
        description = spec.get("description")
        if description:
            tool["description"] = str(description)
        tool["input_schema"] = provider_schema(spec.get("parameters"), tool=name)
        return tool

    # --- the response ------------------------------------------------------------------

    def response(self, message: Any, names: ToolNames, *, max_tokens: int | None = None
                 ) -> CallTools | Final | Malformed:
        """The boundloop response for an ``anthropic.types.Message`` (``max_tokens``: the
        output maximum the request sent, named by a ``max_tokens`` stop)."""
        usage = self.usage(getattr(message, "usage", None))
        blocks = list(getattr(message, "content", None) or [])
        stop = getattr(message, "stop_reason", None)
        text = "".join(str(getattr(b, "text", "") or "") for b in blocks
                       if getattr(b, "type", None) == "text")
        uses = [b for b in blocks if getattr(b, "type", None) == "tool_use"]
        info = response_info(getattr(message, "id", None), getattr(message, "model", None), stop)
        if stop in ("end_turn", "stop_sequence", "tool_use") and uses:
            calls = [ToolCall(str(b.id), names.from_provider(str(b.name)),
                              _arguments(getattr(b, "input", None))) for b in uses]
            return CallTools(calls, usage=usage, text=text or None,
                             content=[_stored_block(b) for b in blocks], info=info)
        if stop in ("end_turn", "stop_sequence"):
            return Final(text, usage=usage, info=info)
        if stop == "tool_use":
            return malformed("the model stopped to use a tool (stop reason `tool_use`) but "
                             "its response holds no tool_use block", usage)
        return malformed(self._stop_reason(message, stop, max_tokens), usage)

    def _stop_reason(self, message: Any, stop: Any, max_tokens: int | None = None) -> str:
        template = _STOPS.get(stop) if isinstance(stop, str) else None
        if template is None:
            shown = f"`{stop[:40]}`" if isinstance(stop, str) else "none"
            return (f"the provider ended the turn with stop reason {shown}, which gives "
                    "neither a final answer nor tool calls")
        category = getattr(getattr(message, "stop_details", None), "category", None)
        detail = f", category `{category}`" if isinstance(category, str) else ""
        sent = self.max_tokens if max_tokens is None else max_tokens
        limit = f"{sent}" if sent == self.max_tokens else \
            f"{sent}, lowered to what the run had left of its output tokens"
        return template.format(max_tokens=limit, detail=detail)

    def usage(self, reported: Any) -> Usage | None:
        """A bl.Usage for the Messages API's ``usage`` object (None when there is none)."""
        if reported is None:
            return None
        return make_usage(getattr(reported, "input_tokens", 0),
                          getattr(reported, "output_tokens", 0),
                          getattr(reported, "cache_creation_input_tokens", 0),
                          getattr(reported, "cache_read_input_tokens", 0), price=self.price)


class AsyncAnthropicModel(AnthropicModel):
    """:class:`AnthropicModel` on an ``anthropic.AsyncAnthropic`` client: an ``async def``
    model callable (``AnthropicModel(async_client, ...)`` returns one)."""

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    async def __call__(  # type: ignore[override]
            self, history: list[Any], ctx: ModelContext) -> CallTools | Final | Malformed:
        kwargs, names = self.request(history, ctx)
        if self.stream:
            return await self._astreamed(kwargs, names, ctx)
        create = self._client.messages.create

        async def send(timeout: float | None) -> Any:
            if timeout is None:
                return await create(**kwargs)
            return await create(**kwargs, timeout=timeout)

        message = await acall_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                         transient=self.transient, cancel=ctx.cancel)
        return self.response(message, names, max_tokens=kwargs["max_tokens"])

    async def _astreamed(self, kwargs: dict[str, Any], names: ToolNames, ctx: ModelContext
                         ) -> CallTools | Final | Malformed:
        meter = StreamMeter(ctx, kwargs, self.price)
        open_stream = self._client.messages.stream

        async def send(timeout: float | None) -> tuple[Cut | None, Any, _Reader]:
            meter.reset()
            reader = _Reader(meter)
            options = kwargs if timeout is None else {**kwargs, "timeout": timeout}
            async with open_stream(**options) as stream:
                try:
                    cut = await apump(stream, reader.read, ctx, meter, self.on_text)
                except ValueError as exc:
                    reader.failed(exc)
                    return None, None, reader
                return cut, stream.current_message_snapshot if reader.started else None, reader

        cut, message, reader = await acall_with_retry(
            send, retry=self.retry, deadline=ctx.deadline,
            transient=stream_transient(meter, self.transient), cancel=ctx.cancel)
        return self.stream_result(cut, message, names, meter, kwargs, reader.bad_input)


class _Reader:
    """Reads the events of one ``messages.stream``: counts their output on the meter, takes
    the input the provider reports at ``message_start``, and returns each text delta."""

    def __init__(self, meter: StreamMeter) -> None:
        self.meter = meter
        self.started = False
        self.tools = 0
        self.tool: str | None = None
        #: Why the stream stopped at tool input that is not JSON (the SDK's accumulator
        #: refuses it), if it did.
        self.bad_input: str | None = None

    def failed(self, exc: ValueError) -> None:
        """The stream raised ``exc``: tool input that is not JSON (then say which call), or
        anything else (raised again)."""
        if self.tool is None or "tool parameter JSON" not in str(exc):
            raise exc
        cause = exc.__cause__
        why = str(cause) if cause is not None else "it does not parse"
        self.bad_input = (f"call {self.tools} (`{self.tool}`) has arguments that are not "
                          f"valid JSON ({why[:200]})")

    def read(self, event: Any) -> str | None:
        kind = getattr(event, "type", None)
        meter = self.meter
        if kind == "content_block_start":
            block = getattr(event, "content_block", None)
            if getattr(block, "type", None) == "tool_use":
                self.tools += 1
                self.tool = str(getattr(block, "name", "") or "")
        elif kind == "message_start":
            self.started = True
            usage = getattr(getattr(event, "message", None), "usage", None)
            if usage is not None:
                meter.input_reported = make_usage(
                    getattr(usage, "input_tokens", 0), 0,
                    getattr(usage, "cache_creation_input_tokens", 0),
                    getattr(usage, "cache_read_input_tokens", 0))
        elif kind == "content_block_delta":
            delta = getattr(event, "delta", None)
            delta_kind = getattr(delta, "type", None)
            if delta_kind == "text_delta":
                text = str(getattr(delta, "text", "") or "")
                meter.count(text)
                return text
            if delta_kind == "input_json_delta":
                meter.count(str(getattr(delta, "partial_json", "") or ""))
            elif delta_kind == "thinking_delta":
                meter.count(str(getattr(delta, "thinking", "") or ""))
        elif kind == "message_delta":
            meter.report(getattr(getattr(event, "usage", None), "output_tokens", None))
        return None
