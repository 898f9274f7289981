"""Transcript messages and model responses: tagged msgspec Structs.

``msgspec.to_builtins(message)`` gives the dict form of SPEC 2; every message also exposes
its ``kind`` as a plain attribute.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from boundloop.core.budget import Usage
from boundloop.errors import ConfigError
from boundloop.policy.redact import (
    MAX_DEPTH,
    json_problem,
    shape_problem,
    shape_text,
    storable,
    unstorable_reason,
)

__all__ = [
    "AssistantMessage", "CallMessage", "CallTools", "Final", "FinalMessage", "Malformed",
    "Message", "NoticeMessage", "Response", "ToolCall", "ToolResultMessage", "UserMessage",
    "ResponseInfo", "copy_history", "to_history",
]

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class UserMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="user"):
    """What the user said."""

    kind: ClassVar[str] = "user"
    text: str


class AssistantMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="assistant"):
    """What the model said alongside the calls of step ``step`` (``text``), and the
    provider's own blocks for that turn (``content``: reasoning or thinking blocks with
    their signatures, sent back verbatim by an adapter). Present only when the step's
    CallTools carried either; it comes right before the step's calls."""

    kind: ClassVar[str] = "assistant"
    step: int
    text: str | None = None
    content: Any = None


class CallMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="call"):
    """One tool call the model made (one message per call). ``step`` is the model step
    whose response proposed it: the calls of one step form one assistant turn. In a
    ``history=`` it may be None; consecutive calls without a step are separate turns."""

    kind: ClassVar[str] = "call"
    id: str
    name: str
    arguments: dict[str, Any]
    step: int | None = None


class ToolResultMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="tool_result"):
    """The result of one call: status is ok, error, denied, invalid_arguments, unknown_tool,
    outcome_unknown or too_large."""

    kind: ClassVar[str] = "tool_result"
    id: str
    status: str
    content: Any


class FinalMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="final"):
    """The model's accepted final answer."""

    kind: ClassVar[str] = "final"
    text: str


class NoticeMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="notice"):
    """The runner's word to the model (e.g. why its last response was malformed)."""

    kind: ClassVar[str] = "notice"
    text: str


Message = (UserMessage | AssistantMessage | CallMessage | ToolResultMessage | FinalMessage
           | NoticeMessage)

_history_encoder = msgspec.msgpack.Encoder()
_history_decoder = msgspec.msgpack.Decoder(list[Message])


def copy_history(history: list[Message]) -> list[Message]:
    """A deep copy of a history: nothing in it shares mutable state with the original."""
    return _history_decoder.decode(_history_encoder.encode(history))


def to_history(items: list[Any]) -> list[Message]:
    """Convert a user-given history (message Structs or their dicts) into messages, checked
    so the journal can store every one (SPEC 2).

    Raises:
        ConfigError: an item is not a message, or holds a value the journal cannot store
            (text with a lone surrogate, an integer beyond 64 bits, a value nested deeper
            than ``MAX_DEPTH`` levels or containing itself, an object that is not
            JSON-like); the message names the item and where in it.
    """
    messages = [_message(index, item) for index, item in enumerate(items)]
    try:
        # Through msgpack and back: nothing nested stays shared with the caller's objects.
        return _history_decoder.decode(_history_encoder.encode(messages))
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError,
            RecursionError) as exc:  # pragma: no cover - each message was checked
        raise ConfigError(f"history cannot be recorded: {exc}") from None


def _message(index: int, item: Any) -> Message:
    where = f"history[{index}]"
    # The shape first: msgspec's converters recurse (in C) and do not stop at a cycle.
    if isinstance(item, msgspec.Struct):
        fields = {f: getattr(item, f, None) for f in item.__struct_fields__}
    elif isinstance(item, dict):
        fields = item
    else:
        raise ConfigError(f"{where} is not a message (SPEC 2): it is a "
                          f"{type(item).__name__}, not a message Struct or a dict")
    for name, value in fields.items():
        problem = shape_problem(value)
        if problem is not None:
            raise ConfigError(
                f"{where} cannot be recorded: its `{name!s}` is {shape_text(problem)}; the "
                f"journal keeps values nested at most {MAX_DEPTH} levels deep, and none that "
                "contains itself")
    try:
        plain = msgspec.to_builtins(item) if isinstance(item, msgspec.Struct) else item
        message: Message = msgspec.convert(plain, Message)
    except (msgspec.ValidationError, TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{where} is not a message (SPEC 2): {exc}") from None
    fields = msgspec.structs.asdict(message)
    # The transcript is journaled (msgpack), and also measured and sent as JSON.
    why = unstorable_reason(fields) if not storable(message) else json_problem(fields)
    if why is not None:
        raise ConfigError(
            f"{where} (a `{message.kind}` message) holds {why}, "
            "which the journal cannot store: pass big integers as strings, decode text with "
            "errors='replace', and give only JSON-like values")
    return message


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call the model proposes: its id, the tool's name, and the arguments."""

    id: NonEmpty
    name: NonEmpty
    arguments: dict[str, Any]


class ResponseInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the provider said about a response, journaled with it (in ``ModelStepCompleted``)
    and shown on the step's ``chat`` span (OpenTelemetry GenAI conventions): ``id``
    (``gen_ai.response.id``), the ``model`` that answered (``gen_ai.response.model``) and
    the provider's ``finish_reason`` (``gen_ai.response.finish_reasons``). The provider
    adapters fill it in; every field is optional."""

    id: str | None = None
    model: str | None = None
    finish_reason: str | None = None


class Final(msgspec.Struct, frozen=True, tag_field="kind", tag="final"):
    """A model response that ends the run with ``text``; ``info``, what the provider said
    about it (see ``ResponseInfo``)."""

    kind: ClassVar[str] = "final"
    text: str
    usage: Usage | None = None
    info: ResponseInfo | None = None


class CallTools(msgspec.Struct, frozen=True, tag_field="kind", tag="calls"):
    """A model response asking for one or more tool calls; ``text`` is what the model said
    alongside them, ``content`` provider-specific blocks (any msgpack-storable value) that
    an adapter must send back verbatim with this turn; ``info``, what the provider said about
    it (see ``ResponseInfo``)."""

    kind: ClassVar[str] = "calls"
    calls: Annotated[list[ToolCall], msgspec.Meta(min_length=1)]
    usage: Usage | None = None
    text: str | None = None
    content: Any = None
    info: ResponseInfo | None = None


Response = Final | CallTools


class Malformed(msgspec.Struct, frozen=True):
    """What a provider adapter returns for a turn without a usable answer (a ``max_tokens``
    or ``length`` stop, a refusal, ``pause_turn``): the response is malformed, for
    ``reason`` (a plain sentence), and counts against ``malformed_retries``.

    ``limit`` is set by an adapter that cut the turn itself because the run's limit was
    spent while it streamed (``output_tokens``, ``total_tokens`` or ``cost``): when its
    ``usage`` puts the run over that limit, the run ends ``limit_exceeded``, whatever
    ``malformed_retries`` allows."""

    reason: str
    usage: Usage | None = None
    limit: str | None = None
