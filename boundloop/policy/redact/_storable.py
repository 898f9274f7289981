"""What the journal can hold: storable values, journal-safe and plain forms, digests in values."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from boundloop.policy.redact._values import (
    _ENCODE_ERRORS,
    _INT_MIN,
    _SCALARS,
    _SURROGATE,
    _UINT_MAX,
    MAX_DEPTH,
    PREFIX,
    TOO_DEEP_TEXT,
    _json,
    _msgpack,
    json_problem,
    safe_repr,
    shape_problem,
    shape_text,
)
from boundloop.policy.safe_text import describe_exception

#: Fields of boundloop's events and messages that ``Scrubber.struct`` leaves alone when
#: scrubbing what a run journals: ids, names and categories the fold and the replay check
#: match on (a remembered value that happens to equal a tool's name must not rename the
#: tool), and structs of numbers. Every other text field is scrubbed.
KEPT_FIELDS = frozenset({
    "run_id", "execution_id", "idempotency_key", "call_id", "id", "name", "tool", "tools",
    "decision", "status", "outcome", "owner", "by", "parent_run_id", "parent_execution_id",
    "child_run_id", "digest", "error_category", "exhausted_limit", "budget", "usage",
    "reservation",
})


# -- storability --------------------------------------------------------------------------
def storable(value: Any) -> bool:
    """True when ``value`` can be journaled as it is (msgpack takes no lone surrogate, no
    integer beyond 64 bits, no value nested too deep or holding itself). Never raises."""
    try:
        _msgpack.encode(value)
    except _ENCODE_ERRORS:
        return False
    return True


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value, types included (``1``, ``1.0`` and ``True`` are
    not): their msgpack bytes are equal. A value that cannot be encoded is not the same.
    Never raises."""
    try:
        return bool(_msgpack.encode(a) == _msgpack.encode(b))
    except _ENCODE_ERRORS:
        return False


_DIGEST = re.compile(re.escape(PREFIX) + "[0-9a-f]{64}")


def digests_in(value: Any) -> set[str]:
    """Every digest (``hmac-sha256:<hex>``) in a JSON-like value or msgspec Struct (a
    run's transcript), at any depth and inside texts."""
    try:
        text = _json.encode(value).decode()
    except _ENCODE_ERRORS:
        return set()
    return set(_DIGEST.findall(text))


def journal_safe(value: Any) -> Any:
    """``value`` (JSON-like data) made storable: lone surrogates in text become U+FFFD, and
    integers beyond 64 bits become their decimal strings. Storable values come back as they
    are."""
    if storable(value):
        return value
    return _made_safe(value, 1)


def _made_safe(value: Any, level: int) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _UINT_MAX else str(value)
    if isinstance(value, dict | list | tuple):
        if level > MAX_DEPTH:
            return TOO_DEEP_TEXT
        if isinstance(value, dict):
            return {_safe_key(k): _made_safe(v, level + 1) for k, v in value.items()}
        return [_made_safe(v, level + 1) for v in value]
    return value


def _safe_key(key: Any) -> Any:
    if isinstance(key, str):
        return _SURROGATE.sub("\ufffd", key)
    if isinstance(key, int) and not isinstance(key, bool) and not _INT_MIN <= key <= _UINT_MAX:
        return str(key)
    return key


def plain_result(value: Any) -> tuple[Any, bytes, str | None]:
    """A tool result as storable JSON-like data, with its compact JSON and, when it cannot
    be recorded, why not. Never raises.

    Objects msgspec does not know become their ``repr``; lone surrogates become U+FFFD and
    integers beyond 64 bits their decimal strings (as ``journal_safe``). A value nested
    deeper than ``MAX_DEPTH``, containing itself, or not convertible (a ``__repr__`` that
    raises, a dict key that is not a string or number) gives ``(sentence, its JSON, why)``,
    where ``why`` ends a sentence about the value (``"it is nested deeper than 64
    levels"``) and ``sentence`` is the content that stands for the result.

    The depth is walked only when the JSON has more than ``MAX_DEPTH`` brackets (a value
    cannot nest deeper than it has containers), so most results cost no Python-level walk.
    """
    if type(value) in _SCALARS:
        content = journal_safe(value)
        return content, _json.encode(content), None
    try:
        plain = msgspec.to_builtins(value, str_keys=True, enc_hook=repr)
    except RecursionError:
        problem = shape_problem(value)
        why = f"it is {shape_text(problem)}" if problem is not None else \
            "it is nested too deeply to be converted (or holds an object that contains itself)"
    except Exception as exc:  # noqa: BLE001 - user objects may raise anything while converted
        why = f"it holds a value that cannot be converted to JSON-like data " \
              f"({describe_exception(exc)})"
    else:
        data: bytes | None
        try:
            data = _json.encode(plain)
        except _ENCODE_ERRORS:  # a lone surrogate, or too deep for the encoder
            data = None
        problem = None
        if data is None or data.count(b"[") + data.count(b"{") > MAX_DEPTH:
            problem = shape_problem(plain)
        if problem is None:
            content = journal_safe(plain)
            if data is None or content is not plain:
                data = _json.encode(content)
            return content, data, None
        why = f"it is {shape_text(problem)}"
    text = f"The tool's result cannot be recorded: {why}."
    return text, _json.encode(text), why


def plain_content(value: Any) -> tuple[Any, str | None]:
    """``plain_result`` without the JSON: ``(content, None)``, or ``(None, why)`` when the
    value cannot be recorded."""
    content, _, why = plain_result(value)
    return (content, None) if why is None else (None, why)


def unstorable_reason(value: Any) -> str | None:
    """Why ``value`` cannot be journaled (or written as JSON, as the transcript is measured
    and sent), naming where (``"an integer beyond 64 bits at `arguments.n`"``), else None.
    Slower than ``storable``: for error messages."""
    problem = shape_problem(value)
    if problem is not None:
        return f"a value {shape_text(problem)}"
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        at = f" at `{where}`" if where else ""
        if isinstance(item, dict):
            for k, v in item.items():
                name = k if isinstance(k, str) else safe_repr(k)
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"a key with a lone surrogate (text that is not valid Unicode){at}"
                if isinstance(k, int) and not isinstance(k, bool) and \
                        not _INT_MIN <= k <= _UINT_MAX:
                    return f"a key that is an integer beyond 64 bits{at}"
                if not isinstance(k, str | int | float) and not storable(k):
                    return f"a key of type {type(k).__name__}{at}"
                stack.append((f"{where}.{name}" if where else name, v))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, str):
            if _SURROGATE.search(item):
                return f"text with a lone surrogate (not valid Unicode){at}"
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            if not _INT_MIN <= item <= _UINT_MAX:
                return f"an integer beyond 64 bits{at}"
        elif not storable(item):
            return f"a value of type {type(item).__name__}{at} (not JSON-like)"
    if not storable(value):
        return "a value that cannot be encoded"
    return json_problem(value)
