"""Values at the boundary: digests, shape (depth and cycles), JSON checks, ``redact``."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Collection, Iterator
from typing import Any, Literal

import msgspec

from boundloop.policy.redact._credentials import (
    _CREDENTIAL,
    is_credential,
)

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
def redact(value: Any, secret_key: bytes, sensitive: Collection[str] = (),
           found: list[Any] | None = None) -> tuple[Any, bool]:
    """``value`` with credential and ``sensitive`` fields (at any depth) replaced by digests.

    Returns the redacted copy and whether anything was replaced; each clear value replaced
    is appended to ``found`` when given (a ``Scrubber`` remembers them). Containers nested
    deeper than ``MAX_DEPTH`` (or holding themselves) are replaced by a short text and
    count as redacted: the journal never holds them.
    """
    if isinstance(value, dict | list | tuple):
        return _redact(value, secret_key, sensitive, 1, found)
    return value, False


def _redact(value: Any, secret_key: bytes, sensitive: Collection[str],
            level: int, found: list[Any] | None = None) -> tuple[Any, bool]:
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
                if found is not None:
                    found.append(v)
            elif isinstance(v, dict | list | tuple):
                out[k], sub = _redact(v, secret_key, sensitive, level + 1, found)
                changed = changed or sub
            else:
                out[k] = v
        return out, changed
    if _flat(value):
        return list(value), False
    items: list[Any] = []
    for v in value:
        if isinstance(v, dict | list | tuple):
            v, sub = _redact(v, secret_key, sensitive, level + 1, found)
            changed = changed or sub
        items.append(v)
    return items, changed


# -- secrets in text -------------------------------------------------------------------------
#: Remembered values shorter than this are never looked for in text (the field that held
