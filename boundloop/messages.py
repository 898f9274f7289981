"""Transcript messages and model responses: tagged msgspec Structs.

``msgspec.to_builtins(message)`` gives the dict form of SPEC 2; every message also exposes
its ``kind`` as a plain attribute.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from boundloop.errors import ConfigError
from boundloop.policy.budget import Usage

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class UserMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="user"):
    """What the user said."""

    kind: ClassVar[str] = "user"
    text: str


class CallMessage(msgspec.Struct, frozen=True, tag_field="kind", tag="call"):
    """One tool call the model made (one message per call)."""

    kind: ClassVar[str] = "call"
    id: str
    name: str
    arguments: dict[str, Any]


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


Message = UserMessage | CallMessage | ToolResultMessage | FinalMessage | NoticeMessage

_history_encoder = msgspec.msgpack.Encoder()
_history_decoder = msgspec.msgpack.Decoder(list[Message])


def copy_history(history: list[Message]) -> list[Message]:
    """A deep copy of a history: nothing in it shares mutable state with the original."""
    return _history_decoder.decode(_history_encoder.encode(history))


def to_history(items: list[Any]) -> list[Message]:
    """Convert a user-given history (message Structs or their dict forms) into messages.

    Raises:
        ConfigError: an item is not a message.
    """
    try:
        plain = [msgspec.to_builtins(m) if isinstance(m, msgspec.Struct) else m for m in items]
        # Through msgpack and back: nothing nested stays shared with the caller's objects.
        return _history_decoder.decode(_history_encoder.encode(
            msgspec.convert(plain, list[Message])))
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
        raise ConfigError(f"history is not a list of messages (SPEC 2): {exc}") from None


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call the model proposes: its id, the tool's name, and the arguments."""

    id: NonEmpty
    name: NonEmpty
    arguments: dict[str, Any]


class Final(msgspec.Struct, frozen=True, tag_field="kind", tag="final"):
    """A model response that ends the run with ``text``."""

    kind: ClassVar[str] = "final"
    text: str
    usage: Usage | None = None


class CallTools(msgspec.Struct, frozen=True, tag_field="kind", tag="calls"):
    """A model response asking for one or more tool calls."""

    kind: ClassVar[str] = "calls"
    calls: Annotated[list[ToolCall], msgspec.Meta(min_length=1)]
    usage: Usage | None = None


Response = Final | CallTools
