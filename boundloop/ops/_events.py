"""A run's events as files: their names, ``export`` (JSON lines, scrubbed) and
``load_events`` (that form, or msgpack, read back)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, get_args

import msgspec

from boundloop import events as ev
from boundloop.errors import (
    JournalCorrupt,
)
from boundloop.journal import codec
from boundloop.policy.redact import PREFIX, digest, is_credential

_json = msgspec.json.Encoder()


_json_events = msgspec.json.Decoder(ev.AnyEvent)
_raw_list = msgspec.msgpack.Decoder(list[bytes])


def load_events(path: str | os.PathLike[str]) -> list[ev.Event]:
    """Events from a file: JSON lines (``boundloop export``) or, for a ``.msgpack`` file, a
    msgpack array of the events' msgpack bytes (``codec.encode``, as a journal stores them
    uncompressed).

    Raises:
        JournalCorrupt: the file holds something that is not an event this version knows.
        OSError: the file cannot be read.
    """
    p = Path(path)
    data = p.read_bytes()
    if p.suffix == ".msgpack":
        try:
            raws = _raw_list.decode(data)
        except msgspec.DecodeError as exc:
            raise JournalCorrupt(f"{p}: not a msgpack array of events ({exc})") from None
        return [codec.decode(raw) for raw in raws]
    out: list[ev.Event] = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_json_events.decode(line))
        except msgspec.DecodeError as exc:
            named = _by_tag(line)  # "type" a class name (export), not a tag (older export)
            try:
                out.append(_json_events.decode(named if named is not None else line))
            except msgspec.DecodeError:
                raise JournalCorrupt(f"{p}, line {number}: not an event ({exc})") from None
    return out


#: Each event's stable tag, by its class name.
_TAGS = {cls.__name__: str(cls.__struct_config__.tag) for cls in get_args(ev.AnyEvent)}


def _by_tag(line: bytes) -> bytes | None:
    """A JSON line whose "type" names the event's class, with its tag there instead."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("type") not in _TAGS:
        return None
    obj["type"] = _TAGS[obj["type"]]
    return msgspec.json.encode(obj)


def event_type(event: ev.Event) -> str:
    """The event's stable tag (``call.decided``), as stored."""
    return str(type(event).__struct_config__.tag)


def event_name(event: ev.Event) -> str:
    """The event's class name (``CallDecided``), as SPEC 6 names it."""
    return type(event).__name__



#: Fields whose values ``export_lines(strip_content=True)`` replaces with digests.
CONTENT_FIELDS = frozenset({"text", "content", "arguments", "detail", "note"})


def _scrub(value: Any, key: bytes, strip: bool) -> Any:
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            already = isinstance(v, str) and v.startswith(PREFIX)
            if not isinstance(k, str) or already:
                out[k] = _scrub(v, key, strip)
            elif strip and k in ("arguments", "validated") and isinstance(v, dict):
                # Arguments stay an object (the schema says so); each value is digested.
                out[k] = {name: arg if isinstance(arg, str) and arg.startswith(PREFIX)
                          else digest(key, arg) for name, arg in v.items()}
            elif is_credential(k) or (strip and k in CONTENT_FIELDS and v is not None):
                out[k] = digest(key, v)
            else:
                out[k] = _scrub(v, key, strip)
        return out
    if isinstance(value, list):
        return [_scrub(v, key, strip) for v in value]
    return value


def export_lines(events: Iterable[ev.Event], secret_key: bytes, *,
                 strip_content: bool = False) -> Iterator[str]:
    """The events as JSON lines (``{"seq": n, "type": "CallDecided", ...}``: the event's
    class name, as ``show`` names it), for a bug report.

    Values the journal redacted stay digests; any other value under a key that names a
    credential is digested too (HMAC under ``secret_key``). With ``strip_content``, texts,
    arguments, results and error details become digests as well, keeping the structure.
    ``load_events`` reads the lines back.
    """
    for seq, event in enumerate(events, 1):
        data = _scrub(msgspec.to_builtins(event), secret_key, strip_content)
        data["type"] = event_name(event)  # as `show` names it (load_events takes both)
        yield _json.encode({"seq": seq, **data}).decode()
