"""What may enter the journal: credential-like and sensitive fields become keyed digests, and
values the journal cannot hold are refused or made storable at the boundary.

A redacted value is stored as ``"hmac-sha256:<hex>"`` (HMAC under the journal's own key), so a
guessed secret cannot be confirmed from a copied journal without that key.

**Shape.** Tool arguments, tool results and ``history=`` values may nest containers (dicts,
lists, tuples, sets) at most ``MAX_DEPTH`` levels deep (the outermost container is level 1)
and may not contain themselves. Every walk here is iterative or bounded by ``MAX_DEPTH``, so
no value, however deep or cyclic, reaches Python's recursion limit; values are checked
before they reach msgspec's encoders, which recurse in C.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Collection, Iterator
from typing import Any, Literal

import msgspec

from boundloop.policy.safe_text import describe_exception

PREFIX = "hmac-sha256:"

#: The deepest nesting of containers kept in tool arguments, tool results and history values
#: (the outermost dict or list is level 1). Deeper values are refused at the boundary: the
#: call is ``invalid_arguments``, the result becomes an ``error``, a history raises
#: ConfigError.
MAX_DEPTH = 64

#: The one key of the arguments that stand for arguments that could not be kept (nested
#: deeper than MAX_DEPTH, holding themselves, or holding a key or value JSON cannot hold).
#: It is not a Python identifier, so no tool parameter has this name: such a call is always
#: ``invalid_arguments``; the value says why.
ARGUMENTS_NOT_KEPT = "(arguments not kept)"

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
_msgpack = msgspec.msgpack.Encoder()
_INT_MIN, _UINT_MAX = -(2 ** 63), 2 ** 64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
#: What an encoder may raise for a value it cannot take (RecursionError: too deep, cyclic).
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)

#: Exact types that hold no other value (a container of only these needs no walk).
_SCALARS = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = (dict, list, tuple, set, frozenset)
#: Stands in the journal for a part of a value nested deeper than MAX_DEPTH (never reached
#: through the runner, which refuses such values first; a safeguard for direct callers).
TOO_DEEP_TEXT = f"(not kept: nested deeper than {MAX_DEPTH} levels)"

Shape = Literal["too_deep", "cycle"]


def key_words(key: str) -> list[str]:
    """``"X-Api-Key"`` -> ``["x", "api", "key"]``; ``"maxTokens"`` -> ``["max", "tokens"]``."""
    return [w.lower() for w in _WORD.findall(key)]


def _names_credential(key: str) -> bool:
    words = key_words(key)
    if any(w in CREDENTIAL_WORDS for w in words):
        return True
    return any(pair in CREDENTIAL_PAIRS for pair in zip(words, words[1:], strict=False))


#: Verdicts of ``is_credential`` by key (a dict lookup is the hot path of ``redact``);
#: bounded, and only short keys, so hostile keys cannot grow it without limit.
_CREDENTIAL: dict[str, bool] = {}
_CACHE_KEYS = 4096


def is_credential(key: str) -> bool:
    """True when a whole word (or word pair) of ``key`` names a credential."""
    verdict = _CREDENTIAL.get(key)
    if verdict is None:
        verdict = _names_credential(key)
        if len(_CREDENTIAL) < _CACHE_KEYS and len(key) <= 256:
            _CREDENTIAL[key] = verdict
    return verdict


def safe_repr(value: Any) -> str:
    """``repr(value)``, or ``<TypeName object>`` when that raises; never raises."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user object's __repr__ must not fail the run
        return f"<{type(value).__name__} object>"
    return text if type(text) is str else f"<{type(value).__name__} object>"


def digest(secret_key: bytes, value: Any) -> str:
    """The keyed digest that stands for ``value`` in the journal (never raises)."""
    try:
        data = _json.encode(value)
    except _ENCODE_ERRORS:
        data = safe_repr(value).encode("utf-8", "surrogatepass")
    return PREFIX + hmac.new(secret_key, data, hashlib.sha256).hexdigest()


# -- shape: depth and cycles ------------------------------------------------------------
def _items(container: Any) -> Iterator[Any]:
    return iter(container.values() if isinstance(container, dict) else container)


def _flat(container: Any) -> bool:
    """True when ``container`` holds only plain scalars (one pass in C)."""
    values = container.values() if isinstance(container, dict) else container
    return _SCALARS.issuperset(map(type, values))


def _within(container: Any, levels: int) -> bool:
    """True when ``container`` nests at most ``levels`` levels (itself included). Recursion
    is bounded by ``levels``, so a cycle just runs out of levels."""
    if levels <= 0:
        return False
    values = container.values() if isinstance(container, dict) else container
    if len(values) > 16 and _SCALARS.issuperset(map(type, values)):
        return True  # a long run of scalars: one pass in C
    levels -= 1
    for v in values:
        if type(v) not in _SCALARS and isinstance(v, _CONTAINERS) and not _within(v, levels):
            return False
    return True


def shape_problem(value: Any, limit: int = MAX_DEPTH) -> Shape | None:
    """``"too_deep"`` when containers in ``value`` nest deeper than ``limit`` levels (the
    outermost is level 1), ``"cycle"`` when one contains itself, else None.

    Never reaches Python's recursion limit: a bounded check first (a container of plain
    scalars costs one pass in C), then, only for a value that fails it, an iterative walk
    that tells a cycle from depth. Dict keys are not walked (keys that cannot be encoded
    fail the encoder, which callers catch).
    """
    if not isinstance(value, _CONTAINERS) or _within(value, limit):
        return None
    return _classify(value, limit)


def _classify(value: Any, limit: int) -> Shape:
    on_path = {id(value)}
    path = [id(value)]
    frames = [_items(value)]
    while frames:
        for child in frames[-1]:
            if isinstance(child, _CONTAINERS):
                if not child or (type(child) in (list, dict) and _flat(child)):
                    if len(frames) >= limit:
                        return "too_deep"
                    continue
                cid = id(child)
                if cid in on_path:
                    return "cycle"
                if len(frames) >= limit:
                    return "too_deep"
                on_path.add(cid)
                path.append(cid)
                frames.append(_items(child))
                break
        else:
            frames.pop()
            on_path.discard(path.pop())
    return "too_deep"  # pragma: no cover - _within said so; a value changed meanwhile


def shape_text(problem: Shape) -> str:
    """What is wrong, as the end of a sentence about a value (``"it is ..."``)."""
    if problem == "too_deep":
        return f"nested deeper than {MAX_DEPTH} levels"
    return "a dict or list that contains itself"


def arguments_not_kept(problem: Shape | str) -> dict[str, Any]:
    """The arguments that stand for arguments that could not be kept: ``problem`` is a
    Shape, or what ends ``"the arguments ..."`` (from ``arguments_problem``)."""
    why = f"are nested deeper than {MAX_DEPTH} levels" if problem == "too_deep" else \
        "contain themselves (a dict or list nested inside itself)" if problem == "cycle" \
        else problem
    return {ARGUMENTS_NOT_KEPT: f"the arguments {why}, so they were not kept"}


def arguments_problem(arguments: Any) -> Shape | str | None:
    """Why tool arguments cannot be kept in the transcript and the journal, else None: a
    Shape, or (as the end of ``"the arguments ..."``) a key or value that JSON cannot hold,
    naming where. Text with a lone surrogate and integers beyond 64 bits are left to
    ``storable`` (the response is then malformed). Never raises."""
    problem = shape_problem(arguments)
    if problem is not None or not isinstance(arguments, dict):
        return problem
    why = json_problem(arguments)
    return None if why is None else f"hold {why}"


def json_problem(value: Any) -> str | None:
    """What in ``value`` (nested at most MAX_DEPTH deep) JSON cannot hold, naming where
    (``"a tuple key (1, 2) at `a` (JSON keys are text or numbers)"``), else None. Lone
    surrogates are left to ``storable``. Never raises."""
    try:
        _json.encode(value)
    except UnicodeEncodeError:
        return None
    except _ENCODE_ERRORS:
        return _json_problem(value)
    return None


def _json_problem(value: Any) -> str:
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        at = f" at `{where}`" if where else ""
        if isinstance(item, dict):
            for k, v in item.items():
                try:
                    _json.encode({k: None})
                except UnicodeEncodeError:
                    pass
                except _ENCODE_ERRORS:
                    return f"a {type(k).__name__} key {safe_repr(k)[:80]}{at} (JSON keys are " \
                           "text or numbers)"
                name = k if isinstance(k, str) else safe_repr(k)
                stack.append((f"{where}.{name}" if where else name, v))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
        else:
            try:
                _json.encode(item)
            except UnicodeEncodeError:
                pass
            except _ENCODE_ERRORS:
                return f"a value of type {type(item).__name__}{at} (not JSON-like)"
    return "a value that JSON cannot hold"


# -- redaction --------------------------------------------------------------------------
def redact(value: Any, secret_key: bytes, sensitive: Collection[str] = ()) -> tuple[Any, bool]:
    """``value`` with credential and ``sensitive`` fields (at any depth) replaced by digests.

    Returns the redacted copy and whether anything was replaced. Containers nested deeper
    than ``MAX_DEPTH`` (or holding themselves) are replaced by a short text and count as
    redacted: the journal never holds them.
    """
    if isinstance(value, dict | list | tuple):
        return _redact(value, secret_key, sensitive, 1)
    return value, False


def _redact(value: Any, secret_key: bytes, sensitive: Collection[str],
            level: int) -> tuple[Any, bool]:
    # Bounded recursion: at most MAX_DEPTH + 1 frames, whatever the value (a cycle too).
    if level > MAX_DEPTH:
        return TOO_DEEP_TEXT, True
    changed = False
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        known = _CREDENTIAL.get
        for k, v in value.items():
            if type(k) is str:
                credential = known(k)
                if credential is None:
                    credential = is_credential(k)
            else:
                credential = isinstance(k, str) and is_credential(k)
            if credential or (k in sensitive and isinstance(k, str)):
                out[k] = digest(secret_key, v)
                changed = True
            elif isinstance(v, dict | list | tuple):
                out[k], sub = _redact(v, secret_key, sensitive, level + 1)
                changed = changed or sub
            else:
                out[k] = v
        return out, changed
    if _flat(value):
        return list(value), False
    items: list[Any] = []
    for v in value:
        if isinstance(v, dict | list | tuple):
            v, sub = _redact(v, secret_key, sensitive, level + 1)
            changed = changed or sub
        items.append(v)
    return items, changed


# -- storability --------------------------------------------------------------------------
def storable(value: Any) -> bool:
    """True when ``value`` can be journaled as it is (msgpack takes no lone surrogate, no
    integer beyond 64 bits, no value nested too deep or holding itself). Never raises."""
    try:
        _msgpack.encode(value)
    except _ENCODE_ERRORS:
        return False
    return True


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
