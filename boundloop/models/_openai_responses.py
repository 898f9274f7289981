"""The Responses adapter (OpenAIResponsesModel, AsyncOpenAIResponsesModel) and its stream
reader."""

from __future__ import annotations

from collections.abc import Callable, Collection
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
    _ITEM_TYPES,
    _RESPONSES_MIN_OUTPUT,
    _arguments_json,
    _as_dict,
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
        params["max_output_tokens"] = capped_max_tokens(self.max_tokens, ctx,
                                                        floor=_RESPONSES_MIN_OUTPUT)
        tools = self._tools(ctx, names)
        if tools:
            params["tools"] = [
                {"type": "function", "name": name, **({"description": desc} if desc else {}),
                 "parameters": schema, "strict": False}
                for name, desc, schema in tools]
            if not ctx.tools_allowed:
                params["tool_choice"] = "none"
        return params

    def _sent_max(self, params: dict[str, Any]) -> int | None:
        sent: int | None = params.get("max_output_tokens")
        return sent

    def _stream_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {**params, "stream": True}

    def _reader(self, meter: StreamMeter) -> _Reader:
        return _ResponsesReader(meter)

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
        return step_items(turn, _ITEM_TYPES, names.to_provider, _result_content)

    def _parse(self, response: Any, names: ToolNames, max_tokens: int | None = None) -> Any:
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
                    f"`max_output_tokens`, max_output_tokens="
                    f"{_limit(self.max_tokens, max_tokens)}) before it "
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

_COUNTED = frozenset({"response.function_call_arguments.delta", "response.refusal.delta",
                      "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
                      "response.custom_tool_call_input.delta"})
#: The events that end a Responses stream, each with the whole response.
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class _ResponsesReader(_Reader):
    """Responses API events: text deltas from ``response.output_text.delta``; the response
    itself (output items, usage, status) from the terminal event."""

    def __init__(self, meter: StreamMeter) -> None:
        super().__init__(meter)
        self.response: Any = None

    def read(self, event: Any) -> str | None:
        kind = _field(event, "type")
        if kind == "response.output_text.delta":
            text = str(_field(event, "delta") or "")
            self.meter.count(text)
            return text
        if kind in _COUNTED:
            self.meter.count(str(_field(event, "delta") or ""))
        elif kind in _TERMINAL:
            self.response = _field(event, "response")
        elif kind == "error":
            raise RuntimeError(f"the Responses API stream reports an error: "
                               f"{_field(event, 'code') or 'no code'}: "
                               f"{_field(event, 'message') or 'no message'}")
        return None

    def result(self) -> Any:
        if self.response is None:
            raise RuntimeError("the provider's stream ended before the response was complete "
                               "(no response.completed event)")
        return self.response


def step_items(turn: ToolStep, item_types: Collection[str], name_of: Callable[[str], str],
               output_of: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """One model step of the history as Responses API input items: the provider's own items
    kept with the step (those of ``item_types``; reasoning with its encrypted content), each
    call once, then each call's ``function_call_output`` (``output_of(result)``). The OpenAI
    Agents SDK takes the same items (``boundloop.integrations.openai_agents``)."""
    ids = {str(_field(call, "id")) for call in turn.calls}
    saved = [item for item in (turn.content if isinstance(turn.content, list) else [])
             if isinstance(item, dict) and item.get("type") in item_types]
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
                    "name": name_of(str(_field(call, "name"))),
                    "arguments": _arguments_json(_field(call, "arguments"))})
    for call, result in turn.paired():
        out.append({"type": "function_call_output", "call_id": str(_field(call, "id")),
                    "output": output_of(result)})
    return out
