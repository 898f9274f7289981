"""The Anthropic Messages API's forms of a boundloop history and of a response's blocks:
``messages`` rebuilt from the history (one assistant message per model step, its stored
content blocks in order with tool_use blocks filled in from the step's calls, then one user
message of tool_result blocks), a response block as stored in ``CallTools.content``, and a
tool_use block's ``input`` as call arguments. Used by ``boundloop.models.anthropic``, whose
module doc says what is sent.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from boundloop.core import kinds
from boundloop.models._common import (
    AssistantText,
    OrphanResult,
    ToolNames,
    ToolStep,
    UserTurn,
    group_history,
    parse_arguments,
    result_text,
)

EPHEMERAL: dict[str, str] = {"type": "ephemeral"}


# --- conversions (module level, so tests can call them directly) ---------------------------

def _arguments(raw: Any) -> Any:
    """A tool_use block's ``input`` as call arguments: an object as it is; JSON text
    decoded; anything else (text that is not JSON) as it is, for the runner to report."""
    if isinstance(raw, dict):
        return raw
    return parse_arguments(raw) if isinstance(raw, str) else raw


def _stored_block(block: Any) -> Any:
    """A response content block as a plain dict to store in ``CallTools.content``; a
    tool_use block keeps only its ``type``, ``id`` (and ``caller``): its name and input are
    the call's, filled in from the history when the turn is sent back."""
    if getattr(block, "type", None) == "tool_use":
        stored: dict[str, Any] = {"type": "tool_use", "id": str(block.id)}
        caller = getattr(block, "caller", None)
        if caller is not None:
            stored["caller"] = _plain(caller)
        return stored
    return _plain(block)


def _plain(value: Any) -> Any:
    """An SDK model as the JSON-like dict the API sent (None fields left out)."""
    to_dict = getattr(value, "to_dict", None)
    return to_dict(mode="json", exclude_none=True, warnings=False) if callable(to_dict) \
        else value


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool_use(call: Any, names: ToolNames, base: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
    block = dict(base or {})
    block.update(type="tool_use", id=str(_field(call, "id")),
                 name=names.to_provider(str(_field(call, "name"))),
                 input=copy.deepcopy(_field(call, "arguments")))
    return block


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, Mapping) else getattr(message, name, None)


def assistant_blocks(step: ToolStep, names: ToolNames) -> list[dict[str, Any]]:
    """The content of a step's assistant message: the step's stored ``content`` blocks in
    order (tool_use placeholders filled from the step's calls; empty text blocks and
    tool_use blocks of calls not in the history left out), else its ``text``; then a
    tool_use block for every call the content did not hold."""
    by_id = {str(_field(c, "id")): c for c in step.calls}
    placed: set[str] = set()
    blocks: list[dict[str, Any]] = []
    if isinstance(step.content, list):
        for block in step.content:
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type")
            if kind == "tool_use":
                cid = str(block.get("id"))
                if cid in by_id and cid not in placed:
                    blocks.append(_tool_use(by_id[cid], names, block))
                    placed.add(cid)
            elif kind == "text" and not block.get("text"):
                continue
            else:
                blocks.append(copy.deepcopy(dict(block)))
    elif step.text:
        blocks.append(_text_block(step.text))
    blocks += [_tool_use(c, names) for cid, c in by_id.items() if cid not in placed]
    return blocks


def tool_result_block(call_id: str, result: Any) -> dict[str, Any]:
    """The ``tool_result`` block answering ``call_id`` with a ``tool_result`` message
    (None: no result was recorded, sent as an error)."""
    if result is None:
        return {"type": "tool_result", "tool_use_id": call_id, "is_error": True,
                "content": "no result was recorded for this call"}
    status = str(_field(result, "status") or "error")
    text = result_text(_field(result, "content"))
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    if kinds.is_ok(status):
        block["content"] = text
    else:
        block["is_error"] = True
        block["content"] = f"{status}: {text}" if text else status
    return block


def messages_from_history(history: list[Any], names: ToolNames | None = None
                          ) -> list[dict[str, Any]]:
    """The Messages API ``messages`` for a boundloop history (see the module doc)."""
    names = names or ToolNames([])
    messages: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})

    for turn in group_history(history):
        if isinstance(turn, UserTurn):
            add("user", [_text_block(turn.text)] if turn.text else [])
        elif isinstance(turn, AssistantText):
            add("assistant", [_text_block(turn.text)] if turn.text else [])
        elif isinstance(turn, ToolStep):
            blocks = assistant_blocks(turn, names)
            add("assistant", blocks)
            ids = [b["id"] for b in blocks if b.get("type") == "tool_use"]
            add("user", [tool_result_block(cid, turn.results.get(cid)) for cid in ids])
        elif isinstance(turn, OrphanResult):
            result = turn.result
            add("user", [_text_block(
                f"(result of call {_field(result, 'id')}, {_field(result, 'status')}): "
                f"{result_text(_field(result, 'content'))}")])
    return messages


def _mark_last_user_block(messages: list[dict[str, Any]]) -> None:
    for message in reversed(messages):
        if message["role"] == "user" and message["content"]:
            message["content"][-1] = {**message["content"][-1],
                                      "cache_control": dict(EPHEMERAL)}
            return
