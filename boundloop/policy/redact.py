"""What may enter the journal: credential-like and sensitive fields become keyed digests.

A redacted value is stored as ``"hmac-sha256:<hex>"`` (HMAC under the journal's own key), so a
guessed secret cannot be confirmed from a copied journal without that key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Collection
from typing import Any

import msgspec

PREFIX = "hmac-sha256:"

#: Whole words (of a key split at punctuation and camelCase) that name a credential.
CREDENTIAL_WORDS = frozenset({
    "password", "passwd", "passphrase", "token", "secret", "authorization", "auth",
    "credential", "credentials", "apikey", "cookie", "bearer", "privatekey",
})
#: Adjacent word pairs that name a credential (``api_key``, ``private-key``, ``AccessKey``).
CREDENTIAL_PAIRS = frozenset({("api", "key"), ("private", "key"), ("access", "key"),
                              ("secret", "key"), ("session", "key"), ("signing", "key")})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_json = msgspec.json.Encoder()


def key_words(key: str) -> list[str]:
    """``"X-Api-Key"`` -> ``["x", "api", "key"]``; ``"maxTokens"`` -> ``["max", "tokens"]``."""
    return [w.lower() for w in _WORD.findall(key)]


@functools.lru_cache(maxsize=4096)
def is_credential(key: str) -> bool:
    """True when a whole word (or word pair) of ``key`` names a credential."""
    words = key_words(key)
    if any(w in CREDENTIAL_WORDS for w in words):
        return True
    return any(pair in CREDENTIAL_PAIRS for pair in zip(words, words[1:], strict=False))


def digest(secret_key: bytes, value: Any) -> str:
    """The keyed digest that stands for ``value`` in the journal."""
    try:
        data = _json.encode(value)
    except TypeError:
        data = repr(value).encode()
    return PREFIX + hmac.new(secret_key, data, hashlib.sha256).hexdigest()


def redact(value: Any, secret_key: bytes, sensitive: Collection[str] = ()) -> tuple[Any, bool]:
    """``value`` with credential and ``sensitive`` fields (at any depth) replaced by digests.

    Returns the redacted copy and whether anything was replaced.
    """
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        changed = False
        for k, v in value.items():
            if isinstance(k, str) and (k in sensitive or is_credential(k)):
                out[k] = digest(secret_key, v)
                changed = True
            else:
                out[k], sub = redact(v, secret_key, sensitive)
                changed = changed or sub
        return out, changed
    if isinstance(value, list | tuple):
        items = [redact(v, secret_key, sensitive) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    return value, False


_msgpack = msgspec.msgpack.Encoder()
_INT_MIN, _UINT_MAX = -(2 ** 63), 2 ** 64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(value: Any) -> bool:
    """True when ``value`` can be journaled as it is (msgpack takes no lone surrogate and no
    integer beyond 64 bits)."""
    try:
        _msgpack.encode(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def journal_safe(value: Any) -> Any:
    """``value`` (JSON-like data) made storable: lone surrogates in text become U+FFFD, and
    integers beyond 64 bits become their decimal strings. Storable values come back as they
    are."""
    if storable(value):
        return value
    return _made_safe(value)


def _made_safe(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _UINT_MAX else str(value)
    if isinstance(value, dict):
        return {_made_safe(k): _made_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_made_safe(v) for v in value]
    return value
