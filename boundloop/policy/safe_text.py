"""Text about user objects that never raises: exception messages and the like."""

from __future__ import annotations

import re

#: The longest exception description kept (the rest is cut with an ellipsis).
MAX_TEXT = 2000
#: What ends a text cut short.
ELLIPSIS = "\u2026"

_SURROGATE = re.compile("[\ud800-\udfff]")


def _storable(text: str) -> str:
    # Lone surrogates cannot be encoded as UTF-8 (nor stored): U+FFFD stands for each.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + ELLIPSIS


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` for an exception (``"TypeName"`` when its message is empty),
    whatever its ``__str__`` does: when that raises or returns a non-string, the text is
    ``"TypeName (its message could not be read: <what it raised>)"``. Never raises (only a
    KeyboardInterrupt, a person's Ctrl-C, is let through); the result is storable (lone
    surrogates become U+FFFD) and at most ``MAX_TEXT`` characters.
    """
    name = type(exc).__name__
    try:
        message = str(exc)
        # A str subclass may override formatting or slicing: keep a plain str copy.
        message = str.__str__(message)
    except KeyboardInterrupt:
        raise
    except BaseException as inner:  # noqa: BLE001 - the description must not fail
        text = f"{name} (its message could not be read: {type(inner).__name__})"
    else:
        text = f"{name}: {message}" if message else name
    return _storable(_cut(text, MAX_TEXT))
