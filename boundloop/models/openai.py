"""OpenAI adapters (SPEC 13): Chat Completions and the Responses API, on the official SDK.

Install the extra: ``pip install 'boundloop[openai]'``. ``import boundloop`` never imports
``openai``; this module imports it only when an adapter is made.

```python
import openai
import boundloop as bl
from boundloop.models.openai import OpenAIChatModel, OpenAIResponsesModel

model = OpenAIChatModel(client=openai.OpenAI(), model="gpt-4.1", max_tokens=1024)
model = OpenAIResponsesModel(client=openai.AsyncOpenAI(), model="o4-mini")   # async def model
```

Both take ``(client, model, max_tokens=1024, system=None, price=None, retry=None, **extra)``:

- ``client``: ``openai.OpenAI`` (a sync model) or ``openai.AsyncOpenAI`` (the model is an
  ``async def`` callable, run on the caller's event loop by ``runner.arun``). The adapter uses
  ``client.with_options(max_retries=0)``: the SDK's own retries could outlive the run's
  deadline; ``retry`` replaces them.
- ``max_tokens``: sent as ``max_completion_tokens`` (Chat) / ``max_output_tokens``
  (Responses), and declared as the model's ``max_output_tokens`` for the runner's reservation.
- ``system``: a ``system`` message first (Chat) / ``instructions`` (Responses).
- ``price``: a ``bl.Price``; each step's usage then carries its cost. ``"auto"``: the runner
  prices each step from the genai-prices catalogue (``boundloop[prices]``) for the model
  the response reports.
- ``retry``: a ``bl.RetryPolicy``. Without it, a provider error (timeout, connection error,
  408/409/429, 5xx) ends the step as a model error. With it, such errors that are instances
  of ``retry.retry_on`` are retried within the step, up to ``retry.max_attempts`` attempts in
  all, after the delay the response asks for (``retry-after-ms``, else ``Retry-After``) or
  else ``retry.delay(attempt)``; a delay that would not end before ``ctx.deadline``, or a
  ``Retry-After`` above 60 s, is not taken (the error is raised). Cancelling the run ends a
  delay early.
- ``**extra``: passed to ``create`` as they are (``temperature``, ``reasoning=...``,
  ``extra_headers=...``, ...). The arguments the adapter builds (``model``, the messages or
  input, ``tools``, ``tool_choice``, the token maximum, ``timeout``, ``stream``, and for
  Responses ``instructions``, ``previous_response_id``, ``conversation``) are refused with
  ``ConfigError``. Responses: ``store`` (default False) and ``include`` (default
  ``["reasoning.encrypted_content"]``) may be overridden, e.g. ``include=[]`` for a model that
  does not support encrypted reasoning.

What is sent:

- the history, rebuilt: ``user`` messages and the runner's ``notice`` messages as user
  messages; each model step with tool calls as ONE assistant turn (its text and every call
  of the step), followed by one result per call, paired by call id; ``final`` messages as
  assistant text.
- Chat has no error flag on a tool message: a result whose status is not ``ok`` is sent as
  text starting ``error: `` (status ``error``) or ``error (<status>): `` (``denied``,
  ``invalid_arguments``, ``unknown_tool``, ``outcome_unknown``, ``too_large``). Responses
  ``function_call_output`` items are flagged the same way. A non-string result is sent as
  JSON. A call with no result in the history gets an ``error (no_result)`` result (the
  providers refuse a call left unanswered); a result whose call is not in the history is
  sent as user text.
- Responses is used statelessly (``store=False``): the step's output items, saved in the
  step's ``AssistantMessage.content`` (reasoning items with their ``encrypted_content`` and
  ids, messages, function calls), are sent back verbatim and in order with the next request.
- tools as the provider's function tools, their JSON Schemas with ``$ref`` inlined and an
  object root (Responses: ``strict: false``, since strict mode would refuse optional
  parameters), names within ``^[a-zA-Z0-9_-]{1,64}$`` (a name outside it is sent as a stable
  stand-in and mapped back in the response).
- on a step where ``ctx.tools_allowed`` is False: ``tool_choice="none"`` (the tools are still
  listed, so prompt caching holds, but none can be called).
- each HTTP request's ``timeout`` is the time left before ``ctx.deadline``.

What comes back: ``bl.Final(text)`` or ``bl.CallTools(calls, text=..., content=...)``, with
``bl.Usage`` where ``input_tokens`` excludes cached input (``cached_tokens`` is reported as
``cache_read_tokens``, ``cache_write_tokens`` as ``cache_write_tokens``). Arguments that are
not valid JSON are returned as the raw string (the runner reports the response malformed,
naming the call and the parse error). A turn without a usable answer (``finish_reason``
``length`` or ``content_filter``, a refusal, Responses ``status: incomplete``, or no text and
no call at all) is returned as ``bl.Malformed(reason)``, never raised. A Responses
``status: failed`` is raised (the step ends ``model_error``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from boundloop.errors import ConfigError
from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models._common import (
    AssistantText,
    OrphanResult,
    ToolNames,
    ToolStep,
    UserTurn,
    acall_with_retry,
    call_with_retry,
    group_history,
    make_usage,
    malformed,
    parse_arguments,
    provider_schema,
    require_sdk,
    response_info,
    result_text,
    status_of,
    transient_status,
)
from boundloop.policy.budget import Usage
from boundloop.pricing import PriceOption, check_price
from boundloop.tools import RetryPolicy

__all__ = ["AsyncOpenAIChatModel", "AsyncOpenAIResponsesModel", "OpenAIChatModel",
           "OpenAIResponsesModel"]

EXTRA = "openai"
#: How much of a refusal's own text a malformed reason quotes.
_QUOTE = 200
#: Responses output item types that are sent back as input; others in ``content`` (e.g.
#: another provider's blocks in a history) are left out.
_ITEM_TYPES = frozenset({"reasoning", "message", "function_call", "compaction"})


def _sdk() -> Any:
    return require_sdk("openai", EXTRA, what="boundloop.models.openai")


def _is_async_client(client: Any) -> bool:
    try:
        import openai
    except ImportError:
        return False
    if isinstance(client, openai.AsyncOpenAI):
        return True
    for path in (("chat", "completions", "create"), ("responses", "create")):
        node = client
        try:
            for part in path:
                node = getattr(node, part)
        except Exception:  # noqa: BLE001 - a client without this resource
            continue
        if inspect.iscoroutinefunction(node):
            return True
    return False


def _flagged(status: str, content: Any) -> str:
    text = result_text(content)
    if status == "ok":
        return text
    if status == "error":
        return f"error: {text}"
    return f"error ({status}): {text}"


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _QUOTE else text[:_QUOTE - 1] + "…"


def _arguments_json(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False, default=str)


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _as_dict(item: Any) -> dict[str, Any]:
    """An SDK model (or a dict) as its JSON wire form, fields the API did not send left out."""
    if isinstance(item, dict):
        return item
    to_dict = getattr(item, "to_dict", None)
    if callable(to_dict):
        value = to_dict(mode="json", exclude_none=True)
        if isinstance(value, dict):
            return value
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        value = dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(value, dict):
            return value
    raise TypeError(f"cannot read a {type(item).__name__} from the provider's response")


def _transient(exc: BaseException) -> bool:
    """Provider errors worth retrying: timeouts, connection errors, 408/409/429, 5xx."""
    try:
        import openai
    except ImportError:  # pragma: no cover - the adapter was made, so the SDK is there
        return False
    if isinstance(exc, openai.APIConnectionError):  # APITimeoutError is one
        return True
    return isinstance(exc, openai.APIStatusError) and transient_status(status_of(exc))


class _OpenAIModel:
    """What the Chat and Responses adapters share: arguments, the client, retries."""

    #: ``gen_ai.provider.name`` of its ``chat`` spans (OpenTelemetry GenAI conventions).
    provider = "openai"
    #: create() arguments the adapter builds itself.
    _RESERVED: frozenset[str] = frozenset()
    _SYNC: type[_OpenAIModel] | None = None
    _ASYNC: type[_OpenAIModel] | None = None

    def __new__(cls, client: Any = None, *args: Any, **kwargs: Any) -> Any:
        # The public classes pick their sync or async variant from the client.
        if cls._ASYNC is not None and cls is not cls._ASYNC and _is_async_client(client):
            cls = cls._ASYNC
        return super().__new__(cls)

    def __init__(self, client: Any, model: str, max_tokens: int = 1024,
                 system: str | None = None, price: PriceOption = None,
                 retry: RetryPolicy | None = None, **extra: Any) -> None:
        _sdk()
        name = type(self).__name__
        if client is None:
            raise ConfigError(f"{name} needs a client: openai.OpenAI() or openai.AsyncOpenAI()")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{name}: model must be a model name, got {model!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"{name}: max_tokens must be a whole number of at least 1, "
                              f"got {max_tokens!r}")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{name}: system must be text or None, got {system!r}")
        price = check_price(price, name)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"{name}: retry must be a bl.RetryPolicy or None, got {retry!r}")
        taken = sorted(set(extra) & self._RESERVED)
        if taken:
            raise ConfigError(f"{name}: {', '.join(taken)} cannot be given; the adapter builds "
                              "them from the history, ctx and its own arguments")
        is_async = _is_async_client(client)
        if is_async and not inspect.iscoroutinefunction(type(self).__call__):
            raise ConfigError(f"{name} is for openai.OpenAI; with openai.AsyncOpenAI use "
                              f"{self._ASYNC.__name__ if self._ASYNC else 'the async adapter'}")
        if not is_async and inspect.iscoroutinefunction(type(self).__call__):
            raise ConfigError(f"{name} is for openai.AsyncOpenAI; with openai.OpenAI use "
                              f"{self._SYNC.__name__ if self._SYNC else 'the sync adapter'}")
        self.client = client
        with_options = getattr(client, "with_options", None)
        # The SDK's own retries could outlive the run's deadline: `retry` replaces them.
        self._client = with_options(max_retries=0) if callable(with_options) else client
        self.model = model
        self.max_tokens = max_tokens
        #: The declared output maximum, used by the runner's default reservation.
        self.max_output_tokens = max_tokens
        self.system = system
        self.price = price
        self.retry = retry
        self.extra = dict(extra)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, max_tokens={self.max_tokens})"

    # -- subclass hooks --------------------------------------------------------------------

    def _request(self, history: list[Any], ctx: Any, names: ToolNames) -> dict[str, Any]:
        raise NotImplementedError

    def _create(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _parse(self, response: Any, names: ToolNames) -> Any:
        raise NotImplementedError

    # -- one step ----------------------------------------------------------------------------

    def _prepare(self, history: list[Any], ctx: Any) -> tuple[dict[str, Any], ToolNames]:
        names = ToolNames([str(t.get("name", "")) for t in (ctx.tools or [])])
        return self._request(history, ctx, names), names

    def _step(self, history: list[Any], ctx: Any) -> Any:
        params, names = self._prepare(history, ctx)
        create = self._create()

        def send(timeout: float | None) -> Any:
            return create(**params) if timeout is None else create(**params, timeout=timeout)

        response = call_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                   transient=_transient, cancel=ctx.cancel)
        return self._parse(response, names)

    async def _astep(self, history: list[Any], ctx: Any) -> Any:
        params, names = self._prepare(history, ctx)
        create: Callable[..., Awaitable[Any]] = self._create()

        def send(timeout: float | None) -> Awaitable[Any]:
            return create(**params) if timeout is None else create(**params, timeout=timeout)

        response = await acall_with_retry(send, retry=self.retry, deadline=ctx.deadline,
                                          transient=_transient, cancel=ctx.cancel)
        return self._parse(response, names)

    def _tools(self, ctx: Any, names: ToolNames) -> list[tuple[str, str, dict[str, Any]]]:
        tools = []
        for spec in ctx.tools or []:
            name = str(spec.get("name", ""))
            schema = provider_schema(spec.get("parameters"), tool=name)
            tools.append((names.to_provider(name), str(spec.get("description") or ""), schema))
        return tools


# --- Chat Completions ----------------------------------------------------------------------

class OpenAIChatModel(_OpenAIModel):
    """A model callable on the Chat Completions API (``client.chat.completions.create``).

    See the module's documentation for the arguments and what is sent. With an
    ``openai.AsyncOpenAI`` client this makes an :class:`AsyncOpenAIChatModel` (an ``async
    def`` model).
    """

    _RESERVED = frozenset({"model", "messages", "tools", "tool_choice", "max_completion_tokens",
                           "max_tokens", "timeout", "stream", "functions", "function_call"})

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    def __call__(self, history: list[Any], ctx: Any) -> Any:
        return self._step(history, ctx)

    def _create(self) -> Callable[..., Any]:
        create: Callable[..., Any] = self._client.chat.completions.create
        return create

    def _request(self, history: list[Any], ctx: Any, names: ToolNames) -> dict[str, Any]:
        params: dict[str, Any] = dict(self.extra)
        params["model"] = self.model
        params["messages"] = self._messages(history, names)
        params["max_completion_tokens"] = self.max_tokens
        tools = self._tools(ctx, names)
        if tools:
            params["tools"] = [
                {"type": "function",
                 "function": {"name": name, **({"description": desc} if desc else {}),
                              "parameters": schema}}
                for name, desc, schema in tools]
            if not ctx.tools_allowed:
                params["tool_choice"] = "none"
        return params

    def _messages(self, history: list[Any], names: ToolNames) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        for turn in group_history(history):
            if isinstance(turn, UserTurn):
                messages.append({"role": "user", "content": turn.text})
            elif isinstance(turn, AssistantText):
                messages.append({"role": "assistant", "content": turn.text})
            elif isinstance(turn, OrphanResult):
                messages.append({"role": "user", "content": _orphan_text(turn.result)})
            elif isinstance(turn, ToolStep):
                messages.extend(self._step_messages(turn, names))
        return messages

    def _step_messages(self, turn: ToolStep, names: ToolNames) -> list[dict[str, Any]]:
        if not turn.calls:
            return [{"role": "assistant", "content": turn.text}] if turn.text else []
        out: list[dict[str, Any]] = [{
            "role": "assistant",
            "content": turn.text or None,
            "tool_calls": [
                {"id": str(_field(call, "id")), "type": "function",
                 "function": {"name": names.to_provider(str(_field(call, "name"))),
                              "arguments": _arguments_json(_field(call, "arguments"))}}
                for call in turn.calls],
        }]
        for call, result in turn.paired():
            out.append({"role": "tool", "tool_call_id": str(_field(call, "id")),
                        "content": _result_content(result)})
        return out

    def _parse(self, response: Any, names: ToolNames) -> Any:
        usage = self._usage(_field(response, "usage"))
        choices = _field(response, "choices") or []
        if not choices:
            return malformed("the provider's response has no choices (no message at all)", usage)
        choice = choices[0]
        message = _field(choice, "message")
        finish = _field(choice, "finish_reason")
        if finish == "length":
            return malformed(
                "the model stopped at its output limit (finish_reason `length`, "
                f"max_completion_tokens={self.max_tokens}) before it finished its answer", usage)
        if finish == "content_filter":
            return malformed("the provider's content filter stopped the answer "
                             "(finish_reason `content_filter`)", usage)
        refusal = _field(message, "refusal")
        if refusal:
            return malformed(f"the model refused to answer (a `refusal` message): "
                             f"{_quote(str(refusal))}", usage)
        text = _field(message, "content")
        calls: list[ToolCall] = []
        for tool_call in _field(message, "tool_calls") or []:
            function = _field(tool_call, "function")
            if function is not None:
                name = names.from_provider(str(_field(function, "name") or ""))
                arguments = parse_arguments(_field(function, "arguments"))
            else:  # a custom tool call: its input is free text, never an object
                custom = _field(tool_call, "custom")
                name = names.from_provider(str(_field(custom, "name") or ""))
                arguments = _field(custom, "input")
            calls.append(ToolCall(str(_field(tool_call, "id") or ""), name, arguments))
        info = response_info(_field(response, "id"), _field(response, "model"), finish)
        if calls:
            return CallTools(calls, usage=usage, text=text or None, info=info)
        if text:
            return Final(text, usage=usage, info=info)
        return malformed("the model ended its turn with neither text nor a tool call "
                         f"(finish_reason `{finish}`)", usage)

    def _usage(self, usage: Any) -> Usage | None:
        if usage is None:
            return None
        details = _field(usage, "prompt_tokens_details")
        cached = _count(_field(details, "cached_tokens"))
        written = _count(_field(details, "cache_write_tokens"))
        prompt = _count(_field(usage, "prompt_tokens"))
        return make_usage(max(prompt - cached - written, 0), _field(usage, "completion_tokens"),
                          written, cached, price=self.price)


class AsyncOpenAIChatModel(OpenAIChatModel):
    """:class:`OpenAIChatModel` for ``openai.AsyncOpenAI``: an ``async def`` model callable.
    ``OpenAIChatModel(client=openai.AsyncOpenAI(), ...)`` makes one."""

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    async def __call__(self, history: list[Any], ctx: Any) -> Any:
        return await self._astep(history, ctx)


OpenAIChatModel._SYNC = OpenAIChatModel
OpenAIChatModel._ASYNC = AsyncOpenAIChatModel


# --- Responses -----------------------------------------------------------------------------

class OpenAIResponsesModel(_OpenAIModel):
    """A model callable on the Responses API (``client.responses.create``), used statelessly:
    ``store=False``, ``include=["reasoning.encrypted_content"]``, and each step's output items
    (reasoning included) kept in ``CallTools.content`` and sent back with the next request.

    See the module's documentation for the arguments. With an ``openai.AsyncOpenAI`` client
    this makes an :class:`AsyncOpenAIResponsesModel` (an ``async def`` model).
    """

    _RESERVED = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                           "max_output_tokens", "timeout", "stream", "previous_response_id",
                           "conversation"})

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    def __call__(self, history: list[Any], ctx: Any) -> Any:
        return self._step(history, ctx)

    def _create(self) -> Callable[..., Any]:
        create: Callable[..., Any] = self._client.responses.create
        return create

    def _request(self, history: list[Any], ctx: Any, names: ToolNames) -> dict[str, Any]:
        params: dict[str, Any] = {"store": False, "include": ["reasoning.encrypted_content"]}
        params.update(self.extra)
        params["model"] = self.model
        params["input"] = self._input(history, names)
        if self.system:
            params["instructions"] = self.system
        params["max_output_tokens"] = self.max_tokens
        tools = self._tools(ctx, names)
        if tools:
            params["tools"] = [
                {"type": "function", "name": name, **({"description": desc} if desc else {}),
                 "parameters": schema, "strict": False}
                for name, desc, schema in tools]
            if not ctx.tools_allowed:
                params["tool_choice"] = "none"
        return params

    def _input(self, history: list[Any], names: ToolNames) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for turn in group_history(history):
            if isinstance(turn, UserTurn):
                items.append({"type": "message", "role": "user", "content": turn.text})
            elif isinstance(turn, AssistantText):
                items.append({"type": "message", "role": "assistant", "content": turn.text})
            elif isinstance(turn, OrphanResult):
                items.append({"type": "message", "role": "user",
                              "content": _orphan_text(turn.result)})
            elif isinstance(turn, ToolStep):
                items.extend(self._step_items(turn, names))
        return items

    def _step_items(self, turn: ToolStep, names: ToolNames) -> list[dict[str, Any]]:
        ids = [str(_field(call, "id")) for call in turn.calls]
        saved = [item for item in (turn.content if isinstance(turn.content, list) else [])
                 if isinstance(item, dict) and item.get("type") in _ITEM_TYPES]
        out: list[dict[str, Any]] = []
        sent: set[str] = set()
        if turn.text and not any(item.get("type") == "message" for item in saved):
            out.append({"type": "message", "role": "assistant", "content": turn.text})
        for item in saved:
            if item.get("type") == "function_call":
                call_id = str(item.get("call_id"))
                # Only the calls the history holds (each needs its output), each once.
                if call_id not in ids or call_id in sent:
                    continue
                sent.add(call_id)
            out.append(item)
        for call in turn.calls:
            call_id = str(_field(call, "id"))
            if call_id in sent:
                continue
            sent.add(call_id)
            out.append({"type": "function_call", "call_id": call_id,
                        "name": names.to_provider(str(_field(call, "name"))),
                        "arguments": _arguments_json(_field(call, "arguments"))})
        for call, result in turn.paired():
            out.append({"type": "function_call_output", "call_id": str(_field(call, "id")),
                        "output": _result_content(result)})
        return out

    def _parse(self, response: Any, names: ToolNames) -> Any:
        usage = self._usage(_field(response, "usage"))
        status = _field(response, "status")
        if status == "failed":
            error = _field(response, "error")
            raise RuntimeError(f"the Responses API reports the response failed: "
                               f"{_field(error, 'code') or 'no code'}: "
                               f"{_field(error, 'message') or 'no message'}")
        if status == "incomplete":
            reason = _field(_field(response, "incomplete_details"), "reason")
            if reason == "max_output_tokens":
                return malformed(
                    "the model stopped at its output limit (status `incomplete`, reason "
                    f"`max_output_tokens`, max_output_tokens={self.max_tokens}) before it "
                    "finished its answer", usage)
            if reason == "content_filter":
                return malformed("the provider's content filter stopped the answer (status "
                                 "`incomplete`, reason `content_filter`)", usage)
            return malformed(f"the response is incomplete (status `incomplete`, reason "
                             f"`{reason}`)", usage)
        if status not in (None, "completed"):
            return malformed(f"the response is not complete (status `{status}`)", usage)
        output = list(_field(response, "output") or [])
        texts: list[str] = []
        calls: list[ToolCall] = []
        for item in output:
            kind = _field(item, "type")
            if kind == "message":
                for part in _field(item, "content") or []:
                    part_kind = _field(part, "type")
                    if part_kind == "refusal":
                        return malformed(f"the model refused to answer (a `refusal`): "
                                         f"{_quote(str(_field(part, 'refusal') or ''))}", usage)
                    if part_kind == "output_text":
                        texts.append(str(_field(part, "text") or ""))
            elif kind == "function_call":
                calls.append(ToolCall(str(_field(item, "call_id") or ""),
                                      names.from_provider(str(_field(item, "name") or "")),
                                      parse_arguments(_field(item, "arguments"))))
        text = "".join(texts)
        # The Responses API has no finish reason: a completed response stopped by itself, or
        # to call tools (the names Chat Completions gives those two).
        info = response_info(_field(response, "id"), _field(response, "model"),
                             "tool_calls" if calls else "stop")
        if calls:
            return CallTools(calls, usage=usage, text=text or None,
                             content=[_as_dict(item) for item in output], info=info)
        if text:
            return Final(text, usage=usage, info=info)
        return malformed("the model ended its turn with neither text nor a tool call", usage)

    def _usage(self, usage: Any) -> Usage | None:
        if usage is None:
            return None
        details = _field(usage, "input_tokens_details")
        cached = _count(_field(details, "cached_tokens"))
        written = _count(_field(details, "cache_write_tokens"))
        total_in = _count(_field(usage, "input_tokens"))
        return make_usage(max(total_in - cached - written, 0), _field(usage, "output_tokens"),
                          written, cached, price=self.price)


class AsyncOpenAIResponsesModel(OpenAIResponsesModel):
    """:class:`OpenAIResponsesModel` for ``openai.AsyncOpenAI``: an ``async def`` model
    callable. ``OpenAIResponsesModel(client=openai.AsyncOpenAI(), ...)`` makes one."""

    #: is_async may read ``__call__`` off this exact class (workers.is_async).
    _plain_call = True

    async def __call__(self, history: list[Any], ctx: Any) -> Any:
        return await self._astep(history, ctx)


OpenAIResponsesModel._SYNC = OpenAIResponsesModel
OpenAIResponsesModel._ASYNC = AsyncOpenAIResponsesModel


# --- shared --------------------------------------------------------------------------------

def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _result_content(result: Any) -> str:
    if result is None:
        return "error (no_result): no result was recorded for this call"
    return _flagged(str(_field(result, "status") or "ok"), _field(result, "content"))


def _orphan_text(result: Any) -> str:
    return (f"(the result of tool call {_field(result, 'id')}, whose call is not in this "
            f"conversation) {_result_content(result)}")
