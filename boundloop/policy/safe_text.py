"""Text about user objects that never raises: exception messages and the like."""

from __future__ import annotations

#: The longest exception description kept (the rest is cut with an ellipsis).
MAX_TEXT = 2000


def _storable(text: str) -> str:
    # Lone surrogates cannot be encoded as UTF-8 (nor stored); replace them.
    return text.encode("utf-8", "replace").decode("utf-8")


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` for an exception, whatever its ``__str__`` does (raises,
    returns a non-string, loops): never raises, storable, at most ``MAX_TEXT`` characters."""
    name = type(exc).__name__
    try:
        message = str(exc)
        if not isinstance(message, str):  # pragma: no cover - str() enforces str
            raise TypeError
    except Exception as inner:  # noqa: BLE001 - the description must not fail
        message = f"(its message could not be read: {type(inner).__name__})"
    text = f"{name}: {message}" if message else name
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT - 1] + "…"
    return _storable(text)
