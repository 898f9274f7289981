"""One Encoder and one typed Decoder for journal events, created once.

A stored body is the event's msgpack bytes (``encode``; record formats 2 and 3) or, in a
journal opened with ``compress=True`` (format 3) and when it comes out shorter, their
compressed form (``pack``):

    0xC1 || dictionary id (1 byte) || n (1 byte) || n big-endian u16 places || zstd frame

The frame (zstd, magicless, against the fixed dictionary ``_dictionary.V1`` of the field names
and shapes every run repeats) holds the msgpack bytes with the run id cut out wherever it
occurs (at most 255 places, each at most 0xFFFF bytes in; any later ones stay in); the
places say where to put it back (the run id is in the record's key, so a reader has it).
0xC1 is the one byte msgpack never uses, so the two forms cannot be mistaken for each other,
and ``decode`` reads both. Measured on the events of ``bench/loop.py``'s W1 runs: a round's
eight bodies take ~500 bytes instead of ~1,700 (its B-tree pages, which ``python
bench/run.py`` reports, ~1,300 instead of ~2,600), for ~5 µs of CPU per event packed and
~3 µs per event decoded.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections.abc import Sequence

import msgspec
import zstandard

from boundloop.errors import JournalCorrupt, JournalError
from boundloop.events import AnyEvent, Event
from boundloop.journal import _dictionary

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)

#: The first byte of a compressed body (msgpack's "never used" byte).
MARK = 0xC1
_MARK_BYTE = bytes((MARK,))
#: The dictionary that ``pack`` compresses with; ``decode`` knows every one ever used.
DICTIONARY_ID = 1
#: Bodies shorter than this are stored as they are: a frame would not be shorter.
_MIN_SIZE = 24
#: Run ids this long or shorter are not cut out (a place costs 2 bytes).
_MIN_CUT = 4
#: Largest body that is compressed: a bigger one is stored plain, so a frame that claims more
#: is damaged or forged, and reading one never allocates more than this.
MAX_PACKED = 64 << 20

# The fast strategy with small tables: a record is a few hundred bytes, and level 1's 64 KiB
# hash table is copied into the context at each frame (measured with the CPU caches cold, as
# between a supervisor's appends: 27 µs a frame at level 1, 3 µs with these, for 3 bytes more).
# No magic, checksum or dictionary id in the frame: the chain link already checks every
# byte, and the id sits in front of the frame.
_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=14, hash_log=10, chain_log=10, search_log=1, min_match=5, target_length=0,
    strategy=zstandard.STRATEGY_FAST, format=zstandard.FORMAT_ZSTD1_MAGICLESS,
    write_content_size=1, write_checksum=0, write_dict_id=0)
#: The bytes of every dictionary ever used, by id.
_RAW = {1: _dictionary.V1}
# Made on first use (``_dictionary_of``): a journal that never compresses pays nothing for them
# (making them costs ~2 ms at import).
_DICTIONARIES: dict[int, zstandard.ZstdCompressionDict] = {}
_made_lock = threading.Lock()


def _forked() -> None:
    # A child forked while another thread of its parent made a dictionary would wait for
    # ever on the lock that thread held: the child starts with its own (and makes its own).
    global _made_lock
    _made_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)
_FORMATS = [f">{n}H" for n in range(256)]
_HEADS = [bytes((MARK, DICTIONARY_ID, n)) for n in range(256)]
# zstd contexts are not safe to share between threads: each thread makes its own.
_local = threading.local()

#: The stored bytes of an event, plain: its msgpack bytes (``encode(event) -> bytes``, the
#: encoder's own method, so encoding costs no Python call of ours).
encode = _encoder.encode


def _dictionary_of(number: int) -> zstandard.ZstdCompressionDict:
    with _made_lock:
        made = _DICTIONARIES.get(number)
        if made is None:
            made = zstandard.ZstdCompressionDict(_RAW[number],
                                                 dict_type=zstandard.DICT_TYPE_RAWCONTENT)
            if number == DICTIONARY_ID:
                made.precompute_compress(compression_params=_PARAMS)
            _DICTIONARIES[number] = made
        return made


def _compressor() -> zstandard.ZstdCompressor:
    made = zstandard.ZstdCompressor(dict_data=_dictionary_of(DICTIONARY_ID),
                                    compression_params=_PARAMS)
    _local.compressor = made
    return made


def _decompressor(dictionary: int) -> zstandard.ZstdDecompressor:
    made: dict[int, zstandard.ZstdDecompressor] = _local.__dict__.setdefault("decompressors", {})
    if dictionary not in made:
        if dictionary not in _RAW:
            raise JournalCorrupt(f"undecodable journal event (compressed with dictionary "
                                 f"{dictionary}, which this version does not know); the "
                                 "journal may come from a newer boundloop or be damaged")
        made[dictionary] = zstandard.ZstdDecompressor(
            dict_data=_dictionary_of(dictionary), format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    return made[dictionary]


def pack(event: Event, run_id: str) -> bytes:
    """The stored bytes of ``event`` as a record of run ``run_id``, compressed: its msgpack
    bytes, or their compressed form when that is shorter (what a journal opened with
    ``compress=True`` stores). ``decode(data, run_id)`` gives the event back.

    Raises:
        TypeError, ValueError, OverflowError, RecursionError: as msgspec does for a value
            it cannot encode.
    """
    data = _encoder.encode(event)
    if not _MIN_SIZE <= len(data) <= MAX_PACKED:
        return data
    # The run id is in the record's key already: cut it out wherever it occurs (the event's
    # own field, execution ids), noting where, so it costs 2 bytes a time instead of ~32.
    rid = run_id.encode()
    # A cut costs 2 bytes: an id that short is left where it is.
    parts = data.split(rid) if len(rid) > _MIN_CUT else [data]
    if len(parts) == 1:
        head, content = _HEADS[0], data
    else:
        cuts = list(itertools.accumulate(map(len, parts[:-1])))
        if len(cuts) <= 255 and cuts[-1] <= 0xFFFF:  # split and join: measured 3x the loop
            content = b"".join(parts)
        else:
            cuts, content = _cut(data, rid)
        head = _HEADS[len(cuts)] + struct.pack(_FORMATS[len(cuts)], *cuts)
    try:
        compressor = _local.compressor
    except AttributeError:
        compressor = _compressor()
    packed = head + compressor.compress(content)
    return packed if len(packed) < len(data) else data


def stored(events: Sequence[Event], run_id: str, compress: bool) -> list[bytes]:
    """The stored bodies of ``events`` appended to run ``run_id``: ``pack``'s when
    ``compress``, else ``encode``'s (what every backend stores).

    Raises:
        JournalError: an event holds a value msgpack cannot store (too big an int, nested
            too deeply, ...).
    """
    try:
        return [pack(e, run_id) for e in events] if compress else [encode(e) for e in events]
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise JournalError(f"an event of run {run_id!r} cannot be stored "
                           f"({type(exc).__name__}: {exc})") from None


def _cut(data: bytes, rid: bytes) -> tuple[list[int], bytes]:
    """``data`` without its first occurrences of ``rid`` (as many as a record can name:
    255, each at most 0xFFFF bytes in), and where each was."""
    cuts: list[int] = []
    parts: list[bytes] = []
    start = 0
    at = data.find(rid)
    while at >= 0 and at - len(cuts) * len(rid) <= 0xFFFF and len(cuts) < 255:
        parts.append(data[start:at])
        cuts.append(at - len(cuts) * len(rid))
        start = at + len(rid)
        at = data.find(rid, start)
    parts.append(data[start:])
    return cuts, b"".join(parts)


def plain(data: bytes, run_id: str | None = None) -> bytes:
    """The msgpack bytes of a stored body of run ``run_id`` (the body itself unless it is
    compressed; see ``decode`` for ``run_id``).

    Raises:
        JournalCorrupt: a compressed body that does not decompress, or that leaves out a
            run id when none is given.
    """
    if data[:1] != _MARK_BYTE:
        return data
    if len(data) < 4:
        raise JournalCorrupt("undecodable journal event (a compressed record of "
                             f"{len(data)} bytes); the journal may be damaged")
    decompressor = _decompressor(data[1])
    count = data[2]
    begin = 3 + 2 * count
    frame = data[begin:]
    try:
        cuts = struct.unpack(_FORMATS[count], data[3:begin])
        size = zstandard.frame_content_size(b"\x28\xb5\x2f\xfd" + frame[:17])
        if not 0 <= size <= MAX_PACKED:
            raise zstandard.ZstdError(f"the frame claims {size} bytes")
        content = decompressor.decompress(frame, allow_extra_data=False)
    except (zstandard.ZstdError, struct.error, MemoryError) as exc:
        raise JournalCorrupt(f"undecodable journal event (its compressed form does not "
                             f"decompress: {exc}); the journal may be damaged") from None
    if not cuts:
        return content
    if not run_id:
        raise JournalCorrupt("a stored journal event that leaves out its run id was read "
                             "without one: read it through the journal (`boundloop export`)")
    rid = run_id.encode()
    parts: list[bytes] = []
    prev = 0
    for at in cuts:
        if not prev <= at <= len(content):
            raise JournalCorrupt("undecodable journal event (its run-id places are out of "
                                 "order); the journal may be damaged")
        parts += (content[prev:at], rid)
        prev = at
    parts.append(content[prev:])
    return b"".join(parts)


def decode(data: bytes, run_id: str | None = None) -> Event:
    """The event stored as ``data`` in run ``run_id`` (a compressed body may leave the run
    id out, since it is in the record's key: without ``run_id`` such a body is refused).

    Raises:
        JournalCorrupt: the bytes are not an event this version knows.
    """
    try:
        return _decoder.decode(data if data[:1] != _MARK_BYTE else plain(data, run_id))
    except msgspec.DecodeError as exc:
        raise JournalCorrupt(f"undecodable journal event ({exc}); the journal may come from a "
                             "newer boundloop or be damaged") from None
    except RecursionError:
        raise JournalCorrupt("undecodable journal event (nested too deeply to decode here); "
                             "the journal may be damaged") from None
