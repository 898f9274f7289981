"""SPEC 2: what a model returned, as a Response or a Malformed with a plain reason (pure)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from boundloop.core.budget import Usage
from boundloop.messages import CallTools, Final, Malformed, Response, ToolCall
from boundloop.policy.redact import arguments_not_kept, arguments_problem, storable


def parse_response(raw: Any) -> Response | Malformed:
    """SPEC 2: a Final or CallTools (Struct or dict form), else Malformed with a reason: a
    plain sentence naming what was wrong and where, never a library's message. An
    adapter's own ``bl.Malformed`` (a refusal, a length stop) passes through.

    Tool arguments the journal cannot keep (nested deeper than ``MAX_DEPTH``, containing
    themselves, holding what JSON cannot hold) are replaced, before anything walks them, by
    arguments that say why: the call then ends ``invalid_arguments``.
    """
    if isinstance(raw, Malformed):
        return raw
    raw = _keepable(raw)
    if isinstance(raw, Final | CallTools):
        try:
            raw = msgspec.to_builtins(raw)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            why = "nested too deep or holding itself" if isinstance(exc, RecursionError) \
                else type(exc).__name__
            return Malformed(f"the response holds a value that is not JSON-like ({why})")
    try:
        parsed: Response = msgspec.convert(raw, Response)
    except RecursionError:
        return Malformed("the response holds a value nested too deep or holding itself")
    except (msgspec.ValidationError, TypeError):
        # Only now, on the rare path, work out a plain sentence for what was wrong.
        reason = _shape_reason(raw) or \
            "the response does not have the shape of bl.Final or bl.CallTools"
        return Malformed(reason, _reported_usage(raw))
    if not storable(parsed):
        return Malformed("the response holds text that is not valid Unicode (a lone "
                         "surrogate) or an integer beyond 64 bits, which cannot be recorded")
    return parsed


def _reported_usage(raw: Any) -> Usage | None:
    """The usage a malformed response still reports (it was billed), if it is readable."""
    usage = raw.get("usage") if isinstance(raw, dict) else None
    if usage is None:
        return None
    try:
        return msgspec.convert(usage, Usage)
    except (msgspec.ValidationError, TypeError, ValueError):
        return None


#: What a value is, in a person's words (an explanation never names a Python type such as
#: ``NoneType``; a model's author reads it, and so may the model, in a notice).
_KINDS: dict[type, str] = {
    str: "a string", int: "a number", float: "a number", bool: "true or false",
    list: "a list", tuple: "a list", dict: "an object", type(None): "nothing (None)",
    bytes: "bytes", bytearray: "bytes", set: "a set", frozenset: "a set",
}


def _kind_of(value: Any) -> str:
    kind = _KINDS.get(type(value))
    if kind is not None:
        return kind
    if callable(value):
        # A model that hands back a function (or a coroutine function) instead of calling it.
        return "a function"
    name = type(value).__name__
    # Anything else is an object of the caller's own type: named as such, not as a type.
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} object"


def _shape_reason(raw: Any) -> str | None:
    """What makes ``raw`` (the dict form) not a response, as a plain sentence, else None."""
    if not isinstance(raw, dict):
        return (f"a response must be bl.Final, bl.CallTools or a dict, not "
                f"{_kind_of(raw)}")
    kind = raw.get("kind")
    if kind not in ("final", "calls"):
        # The value itself is not echoed: whatever the model put there may be a secret.
        return "the response has no `kind`" if kind is None else \
            f"the response's kind is {_kind_of(kind)} other than 'final' or 'calls'"
    usage = raw.get("usage")
    if usage is not None and not (isinstance(usage, dict) and all(
            isinstance(v, int | float) and not isinstance(v, bool) or v is None
            for v in usage.values())):
        return f"the response's usage is {_kind_of(usage)}, not a bl.Usage"
    if kind == "final":
        text = raw.get("text")
        if not isinstance(text, str):
            return "the final response has no text" if text is None else \
                f"the final response's text is {_kind_of(text)}, not a string"
        return None
    if raw.get("text") is not None and not isinstance(raw.get("text"), str):
        return f"the calls response's text is {_kind_of(raw['text'])}, not a string"
    calls = raw.get("calls")
    if not isinstance(calls, list):
        return "the response asks for tool calls but has no `calls` list" if calls is None \
            else f"the response's `calls` is {_kind_of(calls)}, not a list"
    if not calls:
        return "the response asks for tool calls but its `calls` list is empty"
    for n, call in enumerate(calls, 1):
        reason = _call_reason(n, call)
        if reason is not None:
            return reason
    return None


def _call_reason(n: int, call: Any) -> str | None:
    if not isinstance(call, dict):
        return f"call {n} is {_kind_of(call)}, not an object with id, name and arguments"
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return f"call {n} has no tool name" if not name else \
            f"call {n} has a name that is {_kind_of(name)}, not a string"
    cid = call.get("id")
    if not isinstance(cid, str) or not cid:
        return f"call {n} (`{name}`) has no id" if not cid else \
            f"call {n} (`{name}`) has an id that is {_kind_of(cid)}, not a string"
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        # A provider adapter hands over arguments that are not valid JSON as the raw string.
        try:
            json.loads(arguments)
        except ValueError as exc:
            return (f"call {n} (`{name}`) has arguments that are a string, not an object "
                    f"(not valid JSON: {exc.args[0] if exc.args else exc})")
        return f"call {n} (`{name}`) has arguments that are a string, not an object"
    if not isinstance(arguments, dict):
        return f"call {n} (`{name}`) has no arguments" if arguments is None else \
            f"call {n} (`{name}`) has arguments that are {_kind_of(arguments)}, not an object"
    return None


def _keepable(raw: Any) -> Any:
    # msgspec's converters recurse in C and do not stop at a cycle: check first.
    if isinstance(raw, CallTools):
        calls = [_keepable_call(c) for c in raw.calls]
        return raw if all(a is b for a, b in zip(calls, raw.calls, strict=True)) else \
            msgspec.structs.replace(raw, calls=calls)
    if isinstance(raw, dict) and isinstance(raw.get("calls"), list):
        calls = [_keepable_call(c) for c in raw["calls"]]
        return {**raw, "calls": calls}
    return raw


def _keepable_call(call: Any) -> Any:
    if isinstance(call, ToolCall):
        problem = arguments_problem(call.arguments)
        return call if problem is None else \
            msgspec.structs.replace(call, arguments=arguments_not_kept(problem))
    if isinstance(call, dict) and "arguments" in call:
        problem = arguments_problem(call["arguments"])
        if problem is not None:
            return {**call, "arguments": arguments_not_kept(problem)}
    return call
