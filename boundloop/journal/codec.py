"""One Encoder and one typed Decoder for journal events, created once."""

from __future__ import annotations

import msgspec

from boundloop.errors import JournalCorrupt
from boundloop.events import AnyEvent, Event

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)


#: The stored bytes of an event: ``encode(event) -> bytes`` (the encoder's own method, so
#: encoding costs no Python call of ours).
encode = _encoder.encode


def decode(data: bytes) -> Event:
    """The event stored as ``data``.

    Raises:
        JournalCorrupt: the bytes are not an event this version knows.
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise JournalCorrupt(f"undecodable journal event ({exc}); the journal may come from a "
                             "newer boundloop or be damaged") from None
