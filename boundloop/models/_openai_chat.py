"""The Chat Completions adapter (OpenAIChatModel, AsyncOpenAIChatModel) and its stream reader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from boundloop.core.budget import Usage
from boundloop.messages import CallTools, Final, ToolCall
from boundloop.models._common import (
    AssistantText,
    OrphanResult,
    ToolNames,
    ToolStep,
    UserTurn,
    group_history,
    make_usage,
    malformed,
    parse_arguments,
    response_info,
)
from boundloop.models._openai_common import (
    _arguments_json,
    _count,
    _field,
    _limit,
    _OpenAIModel,
    _orphan_text,
    _quote,
    _Reader,
    _result_content,
)
from boundloop.models._stream import (
    StreamMeter,
    capped_max_tokens,
)


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
        params["max_completion_tokens"] = capped_max_tokens(self.max_tokens, ctx)
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

    def _sent_max(self, params: dict[str, Any]) -> int | None:
        sent: int | None = params.get("max_completion_tokens")
        return sent

    def _stream_params(self, params: dict[str, Any]) -> dict[str, Any]:
        options = dict(params.get("stream_options") or {})
        options["include_usage"] = True
        return {**params, "stream": True, "stream_options": options}

    def _reader(self, meter: StreamMeter) -> _Reader:
        return _ChatReader(meter)

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

    def _parse(self, response: Any, names: ToolNames, max_tokens: int | None = None) -> Any:
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
                f"max_completion_tokens={_limit(self.max_tokens, max_tokens)}) before it "
                "finished its answer", usage)
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
class _ChatReader(_Reader):
    """Chat Completions chunks, assembled into the completion's dict form: the text, the
    refusal, each tool call's id, name and arguments (joined from their deltas by index),
    the finish reason, and the usage of the last chunk (``include_usage``)."""

    def __init__(self, meter: StreamMeter) -> None:
        super().__init__(meter)
        self.id: Any = None
        self.model: Any = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: Any = None
        self.usage: Any = None
        self.chunks = 0

    def read(self, event: Any) -> str | None:
        self.chunks += 1
        self.id = self.id or _field(event, "id")
        self.model = self.model or _field(event, "model")
        if _field(event, "usage") is not None:
            self.usage = _field(event, "usage")
        text: str | None = None
        for choice in _field(event, "choices") or []:
            if (_field(choice, "index") or 0) != 0:
                continue
            if _field(choice, "finish_reason"):
                self.finish = _field(choice, "finish_reason")
            delta = _field(choice, "delta")
            if delta is None:
                continue
            piece = _field(delta, "content")
            if piece:
                self.content.append(str(piece))
                self.meter.count(str(piece))
                text = (text or "") + str(piece)
            refusal = _field(delta, "refusal")
            if refusal:
                self.refusal.append(str(refusal))
                self.meter.count(str(refusal))
            for call in _field(delta, "tool_calls") or []:
                self._call(call)
        return text

    def _call(self, call: Any) -> None:
        index = _field(call, "index") or 0
        entry = self.calls.setdefault(index, {"id": "", "type": "function",
                                              "function": {"name": "", "arguments": ""}})
        if _field(call, "id"):
            entry["id"] = str(_field(call, "id"))
        if _field(call, "type"):
            entry["type"] = str(_field(call, "type"))
        function = _field(call, "function")
        if function is not None:
            if _field(function, "name"):
                entry["function"]["name"] += str(_field(function, "name"))
            arguments = _field(function, "arguments")
            if arguments:
                entry["function"]["arguments"] += str(arguments)
                self.meter.count(str(arguments))

    def result(self) -> dict[str, Any]:
        if not self.chunks:
            raise RuntimeError("the provider's stream ended before its first chunk")
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.content) or None,
                                   "refusal": "".join(self.refusal) or None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"id": self.id, "model": self.model, "usage": self.usage,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish}]}


#: Responses stream events whose ``delta`` is output the model generates.
